// out [m, n] = x [m, k] @ w [k, n], f32, on one thread: the product under the CPU matmul kernels
// (float weights laid out as panels, and quantized weights dequantised a strip at a time for many
// rows); the callers split the columns among threads.
//
// A strip of kColumns columns of w is multiplied into a block of up to kRows rows of x at a
// time, its sums in registers for the whole of k: each step of k loads the strip's vectors once and
// broadcasts each row's x into a fused multiply-add with each. The strip, read from memory by the
// first block of rows, is in the core's cache for the others. The sum over k runs in order, one
// term at a time, for every element alike.
//
// A caller that knows which weights it multiplies next (the next strip of a panel weight) names
// them, and the blocks prefetch them a cache line every few steps of k, spread over the whole
// product: the first block of the next strip then finds its weights in the cache instead of
// waiting on memory. Only up to kPrefetchRows rows, where it measured a gain.
#pragma once

#include <algorithm>
#include <cstdint>

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

// Cache lines to prefetch while multiplying: ``lines`` lines from ``next``, one every ``every``
// steps of k.
struct Prefetch {
  const char* next = nullptr;
  int64_t lines = 0;
  int64_t every = 1;
};

// R rows of x (ldx apart) times V vectors of columns of w, into out; with PF, prefetches pf's lines.
template <int R, int V, bool PF>
inline void Block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* out, int64_t ldo,
                  Prefetch pf) {
  Vec sum[R][V] = {};
  for (int64_t kk = 0, wait = 0; kk < k; ++kk, w += ldw) {
    if (PF && pf.lines > 0 && --wait <= 0) {
      __builtin_prefetch(pf.next, 0, 3);        // prefetcht0 on x86; portable to CPUs without it
      pf.next += 64;
      --pf.lines;
      wait = pf.every;
    }
    Vec col[V];
    for (int v = 0; v < V; ++v) col[v] = Load(w + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec a = Broadcast(x[r * ldx + kk]);
      for (int v = 0; v < V; ++v) sum[r][v] += a * col[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(out + r * ldo + v * kLanes, sum[r][v]);
}

// Block<rows, V> for rows in 1..R.
template <int V, bool PF, int R = kRows>
inline void BlockOf(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* out,
                    int64_t ldo, Prefetch pf) {
  if constexpr (R > 0) {
    if (rows == R) return Block<R, V, PF>(x, ldx, w, ldw, k, out, ldo, pf);
    BlockOf<V, PF, R - 1>(rows, x, ldx, w, ldw, k, out, ldo, pf);
  }
}

// The share of ``*pf`` (a product's lines to prefetch, spread over ``calls`` blocks) that block
// ``call`` takes: a line every 2 to 8 steps of k, the earlier the better (measured).
inline Prefetch ShareOf(const Prefetch& pf, int64_t call, int64_t calls, int64_t k) {
  const int64_t first = pf.lines * call / calls, last = pf.lines * (call + 1) / calls;
  Prefetch share{pf.next + first * 64, std::min(last - first, k / 2), 2};
  if (share.lines > 0) share.every = std::clamp<int64_t>(k / share.lines, 2, 8);
  return share;
}

// x's m rows times a strip of V vectors of columns, in blocks of at most kRows rows, as even as they
// go (64 rows: 11, 11, 11, 11, 10, 10, not five of 12 and a weaker one of 4).
// ``pf``: what to prefetch, ``*call`` of ``calls``: the product's blocks so far and in all.
template <int V>
inline void Strip(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k, float* out,
                  int64_t ldo, const Prefetch& pf, int64_t* call, int64_t calls) {
  const int64_t blocks = (m + kRows - 1) / kRows;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int64_t rows = m / blocks + (b < m % blocks ? 1 : 0);
    if (pf.lines > 0)
      BlockOf<V, true>(rows, x + r * ldx, ldx, w, ldw, k, out + r * ldo, ldo, ShareOf(pf, (*call)++, calls, k));
    else
      BlockOf<V, false>(rows, x + r * ldx, ldx, w, ldw, k, out + r * ldo, ldo, pf);
    r += rows;
  }
}

}  // namespace gemm

// Rows up to which prefetching measured a gain on AVX2 (8-24 rows: 1.06-1.36x); at 32 to 96 rows
// it measured 0.91-1.13x from run to run, at 256 and more it cost 5-10%.
constexpr int64_t kPrefetchRows = 24;

// out [m, n] (ldo apart) = x [m, k] (ldx apart) @ w [k, n] (ldw apart), prefetching the
// ``next_floats`` floats at ``next`` meanwhile (up to kPrefetchRows rows).
inline void Gemm(const float* x, int64_t ldx, int64_t m, int64_t k, const float* w, int64_t ldw, int64_t n,
                 float* out, int64_t ldo, const float* next = nullptr, int64_t next_floats = 0) {
  using namespace gemm;
  const Prefetch pf{reinterpret_cast<const char*>(next), next && m <= kPrefetchRows ? next_floats * 4 / 64 : 0, 1};
  const int64_t calls = (n / kColumns + (n % kColumns) / kLanes) * ((m + kRows - 1) / kRows);
  int64_t c = 0, call = 0;
  for (; c + kColumns <= n; c += kColumns) Strip<kVectors>(x, ldx, m, w + c, ldw, k, out + c, ldo, pf, &call, calls);
  for (; c + kLanes <= n; c += kLanes) Strip<1>(x, ldx, m, w + c, ldw, k, out + c, ldo, pf, &call, calls);
  for (; c < n; ++c)                     // columns past the last whole vector (none at the models' sizes)
    for (int64_t r = 0; r < m; ++r) {
      float sum = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) sum += x[r * ldx + kk] * w[kk * ldw + c];
      out[r * ldo + c] = sum;
    }
}

}  // namespace jaxengine
