// out [m, n] = x [m, k] @ w [k, n], f32, on one thread: the product under the CPU matmul kernels
// (float weights laid out as panels, and quantized weights dequantised a strip at a time for many
// rows); the callers split the columns among threads.
//
// x is first written as blocks of kRows rows, each [k][rows] (``Rows``), once for all the strips a
// thread multiplies. A strip of kColumns columns of w is then multiplied into a block of rows at a
// time, its sums in registers for the whole of k: each step of k loads the strip's vectors once and
// broadcasts each row's x into a fused multiply-add with each. The strip, read from memory by the
// first block of rows, is in the core's cache for the others. The sum over k runs in order, one
// term at a time, for every element alike.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

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
inline Vec Broadcast(float s) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(s);
#elif defined(__AVX__)
  return _mm256_set1_ps(s);
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = s;
  return v;
#endif
}

// R rows (a block of x as ``Rows`` writes it: [k][R]) times V vectors of columns of w, into out.
template <int R, int V>
inline void Block(const float* x, const float* w, int64_t ldw, int64_t k, float* out, int64_t ldo) {
  Vec sum[R][V] = {};
  for (int64_t kk = 0; kk < k; ++kk, x += R, w += ldw) {
    Vec col[V];
    for (int v = 0; v < V; ++v) col[v] = Load(w + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec a = Broadcast(x[r]);
      for (int v = 0; v < V; ++v) sum[r][v] += a * col[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(out + r * ldo + v * kLanes, sum[r][v]);
}

// The last block's R (< kRows) rows.
template <int V, int R = kRows - 1>
inline void LastBlock(int64_t rows, const float* x, const float* w, int64_t ldw, int64_t k, float* out,
                      int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return Block<R, V>(x, w, ldw, k, out, ldo);
    LastBlock<V, R - 1>(rows, x, w, ldw, k, out, ldo);
  }
}

}  // namespace gemm

// x [m, k] (row-major, ldx apart) as blocks of gemm::kRows rows, each block [k][its rows]: what
// Gemm reads.
class Rows {
 public:
  void Fill(const float* x, int64_t ldx, int64_t m, int64_t k) {
    m_ = m;
    k_ = k;
    data_.resize(m * k);
    for (int64_t r0 = 0; r0 < m; r0 += gemm::kRows) {
      const int64_t rows = std::min<int64_t>(gemm::kRows, m - r0);
      float* block = data_.data() + r0 * k;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t kk = 0; kk < k; ++kk) block[kk * rows + r] = x[(r0 + r) * ldx + kk];
    }
  }
  int64_t m() const { return m_; }
  int64_t k() const { return k_; }
  const float* block(int64_t r0) const { return data_.data() + r0 * k_; }

 private:
  std::vector<float> data_;
  int64_t m_ = 0, k_ = 0;
};

// out [m, n] (ldo apart) = x @ w [k, n] (ldw apart), x as ``Rows``.
inline void Gemm(const Rows& x, const float* w, int64_t ldw, int64_t n, float* out, int64_t ldo) {
  using namespace gemm;
  const int64_t m = x.m(), k = x.k();
  auto strip = [&](auto vectors, const float* ws, float* os) {
    constexpr int V = decltype(vectors)::value;
    int64_t r = 0;
    for (; r + kRows <= m; r += kRows) Block<kRows, V>(x.block(r), ws, ldw, k, os + r * ldo, ldo);
    LastBlock<V>(m - r, x.block(r), ws, ldw, k, os + r * ldo, ldo);
  };
  int64_t c = 0;
  for (; c + kColumns <= n; c += kColumns) strip(std::integral_constant<int, kVectors>{}, w + c, out + c);
  for (; c + kLanes <= n; c += kLanes) strip(std::integral_constant<int, 1>{}, w + c, out + c);
  for (; c < n; ++c)                     // columns past the last whole vector (none at the models' sizes)
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, m - r0);
      const float* xb = x.block(r0);
      for (int64_t r = 0; r < rows; ++r) {
        float sum = 0.0f;
        for (int64_t kk = 0; kk < k; ++kk) sum += xb[kk * rows + r] * w[kk * ldw + c];
        out[(r0 + r) * ldo + c] = sum;
      }
    }
}

}  // namespace jaxengine
