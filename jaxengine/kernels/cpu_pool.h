// Work items shared between the calling thread and helpers it schedules on XLA's intra-op thread
// pool (the FFI's ThreadPool context). The CPU kernels in this package split their work this way,
// so they use the threads XLA already has instead of starting their own; the exception is
// HotPool, for work items too short to wait for a sleeping thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxengine {

// The width of each of ``*blocks`` column blocks of an [.., N] output: one block per pool thread,
// each starting on a 16-column (64-byte) boundary of a row.
inline int64_t ColumnBlockWidth(int64_t n, int64_t threads, int64_t* blocks) {
  constexpr int64_t kColumnAlign = 16;
  *blocks = std::max<int64_t>(1, std::min<int64_t>(threads, n / kColumnAlign));
  return ((n + *blocks - 1) / *blocks + kColumnAlign - 1) / kColumnAlign * kColumnAlign;
}

// Runs run(i) for every i in [0, count), each exactly once, on the calling thread and up to
// pool.num_threads() - 1 helpers; returns when all are done. Items are taken in order, so put
// the longest first.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, std::function<void(int64_t)> run) {
  struct Shared {
    std::function<void(int64_t)> run;
    int64_t count;
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int running = 0;
    bool closed = false;

    void work() {
      for (int64_t i; (i = next.fetch_add(1)) < count;) run(i);
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->run = std::move(run);
  shared->count = count;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([shared] {
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        if (shared->closed) return;
        ++shared->running;
      }
      shared->work();
      std::lock_guard<std::mutex> lock(shared->mu);
      if (--shared->running == 0) shared->cv.notify_all();
    });
  shared->work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->closed = true;                              // helpers not yet started stay out
  shared->cv.wait(lock, [&] { return shared->running == 0; });
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Helper threads that stay awake between jobs, for work split into pieces of a few microseconds
// (a decode step's projections: tens of them a layer, each 5-40 us). Waking one of XLA's pool
// threads from sleep costs about as much as such a piece, so a helper here spins for kSpinNs
// after each job, waiting for the next, and only then sleeps; a decode step's jobs keep it awake
// from the first to the last. The caller never waits for a helper that has not started: it takes
// the items itself, closes the job, and waits only for helpers that joined it. One job at a time:
// a second caller meanwhile (another device's computation) runs its items alone. One pool per
// process and library, made on first use and never destroyed; after a fork the child's callers
// find no helpers and run alone.
class HotPool {
 public:
  static constexpr int64_t kSpinNs = 50000;
  static constexpr int kYieldSpins = 64;               // spins between offers of the core to another thread

  // The pool with ``helpers`` threads (the first call's count is kept).
  static HotPool& Get(int helpers) {
    static HotPool* pool = new HotPool(helpers);        // never destroyed: helpers may outlive exit's destructors
    return *pool;
  }

  // Runs run(i) for every i in [0, count), each exactly once, on the calling thread and the
  // helpers awake to join; returns when all are done.
  void Run(int64_t count, const std::function<void(int64_t)>& run) {
    bool idle = false;
    if (helpers_ == 0 || count < 2 || !busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) {
      for (int64_t i = 0; i < count; ++i) run(i);
      return;
    }
    run_ = &run;
    count_ = count;
    next_.store(0, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    ticket_.store(++generation_ << kGenerationShift, std::memory_order_seq_cst);    // open, none joined
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    Work();
    const uint64_t closed = ticket_.fetch_or(kClosed, std::memory_order_acq_rel);   // no one joins after this
    const int64_t joined = static_cast<int64_t>(closed & kJoinedMask);
    for (int spins = 1; finished_.load(std::memory_order_acquire) < joined; ++spins) {
      if (spins % kYieldSpins == 0) std::this_thread::yield();      // (a helper that joined was descheduled)
      else CpuRelax();
    }
    busy_.store(false, std::memory_order_release);
  }

 private:
  static constexpr int kGenerationShift = 16;
  static constexpr uint64_t kClosed = uint64_t{1} << 15, kJoinedMask = kClosed - 1;

  explicit HotPool(int helpers) : helpers_(std::max(0, std::min(helpers, static_cast<int>(kJoinedMask)))) {
    for (int i = 0; i < helpers_; ++i) std::thread([this] { Helper(); }).detach();
  }

  void Work() {
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < count_;) (*run_)(i);
  }

  void Helper() {
    uint64_t seen = 0;                                  // the last generation this helper looked at
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      auto since = std::chrono::steady_clock::now();
      for (int spins = 1; (t >> kGenerationShift) == seen; ++spins) {
        if (spins % kYieldSpins == 0) std::this_thread::yield();   // a thread waiting for this core goes first
        else CpuRelax();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - since > std::chrono::nanoseconds(kSpinNs)) {
          std::unique_lock<std::mutex> lock(mu_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lock, [&] { return (ticket_.load(std::memory_order_seq_cst) >> kGenerationShift) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_relaxed);
          since = std::chrono::steady_clock::now();
        }
        t = ticket_.load(std::memory_order_acquire);
      }
      seen = t >> kGenerationShift;
      while (!(t & kClosed)) {                          // join the open job, or find it closed
        if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
          Work();
          finished_.fetch_add(1, std::memory_order_release);
          break;
        }
        seen = t >> kGenerationShift;                   // (a newer job may have opened meanwhile)
      }
    }
  }

  const int helpers_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> ticket_{0};                     // generation << 16 | closed << 15 | helpers joined
  std::atomic<int64_t> next_{0}, finished_{0};
  std::atomic<int> sleeping_{0};
  uint64_t generation_ = 0;                             // written by the caller holding busy_
  const std::function<void(int64_t)>* run_ = nullptr;   // the open job: written before its ticket
  int64_t count_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

// A grouped matmul's rows (sorted by group: a mixture's experts): the non-empty groups, in order.
struct Group {
  int64_t first_row, rows, expert;
};

// The groups of ``sizes[0..experts)`` over ``m`` rows; false if a size is negative or they sum
// past m. ``*end``: the first row past the groups.
inline bool RowGroups(const int32_t* sizes, int64_t experts, int64_t m, std::vector<Group>* groups, int64_t* end) {
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = sizes[e];
    if (rows < 0 || row + rows > m) return false;
    if (rows > 0) groups->push_back({row, rows, e});
    row += rows;
  }
  *end = row;
  return true;
}

// run(group, first column, last column) over every group's [.., n] output: whole groups per thread
// when there are enough of them (each reads its weights front to back), else each group's columns
// split among the threads as in a dense matmul.
inline void ParallelForGroups(xla::ffi::ThreadPool& pool, const std::vector<Group>& groups, int64_t n,
                              const std::function<void(const Group&, int64_t, int64_t)>& run) {
  int64_t blocks = 1, width = n;
  if (static_cast<int64_t>(groups.size()) < pool.num_threads()) width = ColumnBlockWidth(n, pool.num_threads(), &blocks);
  ParallelFor(pool, static_cast<int64_t>(groups.size()) * blocks, [&, blocks, width](int64_t item) {
    const int64_t b = item % blocks;
    run(groups[item / blocks], std::min(n, b * width), std::min(n, (b + 1) * width));
  });
}

}  // namespace jaxengine
