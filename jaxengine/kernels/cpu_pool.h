// Work items shared between the calling thread and helpers it schedules on XLA's intra-op thread
// pool (the FFI's ThreadPool context). The CPU kernels in this package split their work this way,
// so they use the threads XLA already has instead of starting their own.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

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
