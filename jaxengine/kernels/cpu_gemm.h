// out [m, n] = x [m, k] @ w [k, n], every matrix row-major with its own leading dimension: the f32
// product under the CPU matmul kernels (float weights, and quantized weights dequantised block by
// block for many rows), on one thread; the callers split the columns among threads.
//
// w is read where it lies, with no packed copy: a strip of kColumns columns is multiplied into a
// block of up to kRows rows of x at a time, its sums in registers for the whole of k (each step of
// k: the strip's vectors loaded once, each row's x broadcast into a fused multiply-add with each),
// and the strip, read from memory by the first block of rows, is in the core's cache for the
// others. The sum over k runs in order, one term at a time, for every element alike.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace jaxengine {

constexpr int64_t kPanel = 32;           // a strip's columns in a weight laid out as panels (``PanelWeight``)

namespace gemm {

#if defined(__AVX512F__)
constexpr int kLanes = 16;               // zmm: 32 registers
constexpr int kVectors = 2;              // a strip's vectors
constexpr int kRows = 12;                // rows of a block: kRows * kVectors sums in registers
#else
constexpr int kLanes = 8;                // ymm (or two xmm halves): 16 registers
constexpr int kVectors = 2;
constexpr int kRows = 6;
#endif
constexpr int kColumns = kLanes * kVectors;

typedef float Vec __attribute__((vector_size(kLanes * 4)));
typedef float UnalignedVec __attribute__((vector_size(kLanes * 4), aligned(4)));

inline Vec Load(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<UnalignedVec*>(p) = v; }

// Rows R (at most kRows) of x times V vectors of columns of w, into out.
template <int R, int V>
inline void Block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* out, int64_t ldo) {
  Vec sum[R][V] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    Vec col[V];
    for (int v = 0; v < V; ++v) col[v] = Load(w + kk * ldw + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec a = Vec{} + x[r * ldx + kk];
      for (int v = 0; v < V; ++v) sum[r][v] += a * col[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(out + r * ldo + v * kLanes, sum[r][v]);
}

// The last m (< R) rows.
template <int V, int R>
inline void Rest(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k, float* out,
                 int64_t ldo) {
  if constexpr (R > 0) {
    if (m == R) return Block<R, V>(x, ldx, w, ldw, k, out, ldo);
    Rest<V, R - 1>(x, ldx, m, w, ldw, k, out, ldo);
  }
}

template <int V>
inline void Strip(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k, float* out,
                  int64_t ldo) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) Block<kRows, V>(x + r * ldx, ldx, w, ldw, k, out + r * ldo, ldo);
  Rest<V, kRows - 1>(x + r * ldx, ldx, m - r, w, ldw, k, out + r * ldo, ldo);
}

}  // namespace gemm

inline void Gemm(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k, int64_t n,
                 float* out, int64_t ldo) {
  using namespace gemm;
  int64_t c = 0;
  for (; c + kColumns <= n; c += kColumns) Strip<kVectors>(x, ldx, m, w + c, ldw, k, out + c, ldo);
  for (; c + kLanes <= n; c += kLanes) Strip<1>(x, ldx, m, w + c, ldw, k, out + c, ldo);
  for (; c < n; ++c)                     // columns past the last whole vector (none at the models' sizes)
    for (int64_t r = 0; r < m; ++r) {
      float sum = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) sum += x[r * ldx + kk] * w[kk * ldw + c];
      out[r * ldo + c] = sum;
    }
}

}  // namespace jaxengine
