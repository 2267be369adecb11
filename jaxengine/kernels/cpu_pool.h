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

}  // namespace jaxengine
