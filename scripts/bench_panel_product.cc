// The float32 panel product (jaxengine/kernels/cpu_gemm.h) over the 30 layers' projections of the
// default model's shapes, with and without prefetching each thread's next strip, in turns, best
// of 12 passes each; the weights (425 MB) come from memory, as in a decode step. Build and run:
//
//   g++ -O3 -march=native -std=c++17 -pthread -Ijaxengine/kernels scripts/bench_panel_product.cc \
//       -o /tmp/bench_panel_product && /tmp/bench_panel_product THREADS ROWS
//
// Prints GF/s of both and checks that their outputs are identical.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "cpu_gemm.h"

int main(int argc, char** argv) {
  if (argc != 3) return std::fprintf(stderr, "usage: %s THREADS ROWS\n", argv[0]), 2;
  const int threads = std::atoi(argv[1]);
  const int64_t m = std::atoi(argv[2]), layers = 30, panel = jaxengine::kPanel;
  const int64_t shapes[5][2] = {{576, 960}, {576, 576}, {576, 1536}, {576, 1536}, {1536, 576}};  // (k, n)
  std::vector<std::vector<float>> w(5);
  double flops = 0;
  for (int s = 0; s < 5; ++s) {
    w[s].resize(layers * shapes[s][0] * shapes[s][1]);
    for (float& v : w[s]) v = (std::rand() % 100) * 0.001f;
    flops += 2.0 * m * shapes[s][0] * shapes[s][1] * layers;
  }
  std::vector<float> x(m * 1536), out[2] = {std::vector<float>(m * 1536), std::vector<float>(m * 1536)};
  for (float& v : x) v = (std::rand() % 100) * 0.01f;
  double best[2] = {1e9, 1e9};
  for (int pass = 0; pass < 12; ++pass)
    for (int prefetch = 0; prefetch < 2; ++prefetch) {
      const auto start = std::chrono::steady_clock::now();
      for (int64_t l = 0; l < layers; ++l)
        for (int s = 0; s < 5; ++s) {
          const int64_t k = shapes[s][0], n = shapes[s][1], strips = n / panel, size = k * panel;
          const float* wl = w[s].data() + l * k * n;
          float* o = out[prefetch].data();
          auto run = [&](int64_t b) {        // the kernel's split: a contiguous run of strips a thread
            const int64_t per = (strips + threads - 1) / threads, end = std::min(strips, (b + 1) * per);
            for (int64_t st = b * per; st < end; ++st)
              jaxengine::Gemm(x.data(), k, m, k, wl + st * size, panel, panel, o + st * panel, n,
                              prefetch && st + 1 < end ? wl + (st + 1) * size : nullptr, size);
          };
          std::vector<std::thread> helpers;
          for (int b = 1; b < threads; ++b) helpers.emplace_back(run, b);
          run(0);
          for (auto& t : helpers) t.join();
        }
      best[prefetch] = std::min(best[prefetch], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  if (out[0] != out[1]) return std::fprintf(stderr, "the outputs differ\n"), 1;
  std::printf("%d threads, %ld rows: without prefetching %.1f GF/s, with %.1f GF/s (%.2fx)\n", threads,
              static_cast<long>(m), flops / best[0] / 1e9, flops / best[1] / 1e9, best[0] / best[1]);
}
