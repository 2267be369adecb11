// Decode attention over the paged KV cache on the CPU: one query token per row, its keys and
// values read in place from the row's pages (XLA's version gathers them into a temporary first).
// Work items are rows (or, for a few rows, their KV heads), longest first, shared over XLA's
// intra-op thread pool (cpu_pool.h). f32 throughout; a page at a time, an
// online softmax per query head, as jaxengine/kernels/paged_attention/reference.py defines the result.
// Where the CPU has AVX-512 or AVX2 and a head is a whole number of vectors (16 floats, or 8; no soft
// cap), a page's tokens go a vector at a time: a query head's scores as one vector, its softmax
// update and exp on it (block::AttendPage). There too, a prompt's tokens (at least
// block::kRunRows rows of one sequence at consecutive positions, recognised by their lens and tables)
// go in blocks of queries, one query per lane, that read each key and value once (block::Attend).
// The caches are f32 or float8_e4m3fn, or its bytes as uint8 (an FP8 KV cache, its scales applied outside): an fp8 page is
// converted to f32 once, into a buffer of the thread's, then read as an f32 one.
//
// Shapes: q [B, N, H] (already scaled), k_cache and v_cache [NB, S, K*H], tables [B, M],
// lens [B] (keys each row attends to: its query's position + 1; 0 for a padding row), sinks [N] (each
// query head's sink logit, a key whose value is zero; -inf: none), out [B, N, H].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_pool.h"
#include "fp8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxHeads = 128;    // query heads this kernel serves (N)
constexpr int kMaxPage = 64;      // tokens per page this kernel serves (S)
constexpr int kLanes = 8;         // one AVX2 register of f32
constexpr int64_t kSoloBytes = 1 << 20;   // keys and values read: less, and the calling thread reads them alone
constexpr int64_t kPrefetchPages = 2;     // pages read ahead

struct Problem {
  const float* q;
  const void* k_cache;            // float, or float8_e4m3fn bytes with fp8
  const void* v_cache;
  const int32_t* tables;
  const int32_t* lens;
  const float* sinks;
  float* out;
  int64_t num_heads, kv_heads, head_size, page_size, width;
  int64_t sliding_window;         // 0: none
  float soft_cap;                 // 0: none
  bool fp8;
};


// n elements of a cache from element ``offset`` as floats: in place (f32), or converted into ``buf``.
inline const float* cache_floats(const Problem& p, const void* cache, int64_t offset, int64_t n, float* buf) {
  if (!p.fp8) return static_cast<const float*>(cache) + offset;
  const uint8_t* bytes = static_cast<const uint8_t*>(cache) + offset;
  for (int64_t i = 0; i < n; ++i) buf[i] = jaxengine::kFp8Values.value[bytes[i]];
  return buf;
}

// q . k over head_size floats, summed in kLanes independent lanes so the compiler vectorises it
// without reassociating (head_size a multiple of kLanes; the tail is scalar).
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t h = 0;
  for (; h + kLanes <= n; h += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[h + j] * b[h + j];
  float s = 0.0f;
  for (int j = 0; j < kLanes; ++j) s += lanes[j];
  for (; h < n; ++h) s += a[h] * b[h];
  return s;
}

// exp(x) for x <= 0 (a score minus its running maximum), branch-free so that loops of it
// vectorise: x = k ln2 + r, |r| <= ln2 / 2, and exp(r) by its degree-6 Taylor polynomial
// (relative error about 2e-7). Below -87 it returns 0, as the f32 exp underflows there.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;   // ln2 in two parts: r exact
  float y = 1.0f / 720;
  y = y * r + 1.0f / 120;
  y = y * r + 1.0f / 24;
  y = y * r + 1.0f / 6;
  y = y * r + 0.5f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k by its exponent bits
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// Bring bytes [from, to) of a page's keys and values towards the caches while an earlier page is
// computed: pages sit anywhere in the pool, where the hardware prefetcher does not follow.
inline void prefetch_page(const char* k, const char* v, int64_t from, int64_t to) {
  for (int64_t i = from; i < to; i += 64) {
    __builtin_prefetch(k + i);
    __builtin_prefetch(v + i);
  }
}

#ifdef __AVX512F__

// exp_nonpositive on 16 lanes (the same reduction and polynomial; 2^k applied by scalef).
inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.0f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, k);
}

// Lane i of the result: the sum of v[i]'s 16 lanes (pairs interleaved within 128-bit lanes, then
// 64-bit pairs, then the four 128-bit lanes folded).
inline __m512 LaneSums16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c01, c23, _MM_SHUFFLE(3, 1, 3, 1)));
}

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The vectors: AVX-512's 16 floats, or AVX2's 8, and what the kernels below do with them.
// A prompt's tokens (a run of rows of one sequence at consecutive positions) in blocks of up to
// kBlockQueries queries (the block's rows times one KV head's query heads), held transposed, one
// query per lane, so that each key and value read from a page serves the whole block. A token's
// scores against the block are whole vectors (no sums across lanes), and the online softmax runs on
// them. The vectors: AVX-512's 16 floats, or AVX2's 8.
#define JAXENGINE_BLOCKS 1
namespace block {
#if defined(__AVX512F__)
constexpr int kW = 16;
using V = __m512;
inline V Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, V x) { _mm512_storeu_ps(p, x); }
inline V Set(float x) { return _mm512_set1_ps(x); }
inline V Zero() { return _mm512_setzero_ps(); }
inline V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V Add(V a, V b) { return _mm512_add_ps(a, b); }
inline V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V Max(V a, V b) { return _mm512_max_ps(a, b); }
inline V Exp(V x) { return Exp16(x); }
// x where lo <= pos <= hi, else ``fill``; and x where ``keep`` != -inf, else 0.
inline V Within(V pos, V lo, V hi, V x, V fill) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(pos, hi, _CMP_LE_OQ) & _mm512_cmp_ps_mask(pos, lo, _CMP_GE_OQ), fill, x);
}
inline V WhereFinite(V keep, V x) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(keep, Set(-INFINITY), _CMP_NEQ_OQ), x); }
inline V LaneSums(const V* v) { return LaneSums16(v); }
inline float HMax(V x) { return _mm512_reduce_max_ps(x); }
inline float HSum(V x) { return _mm512_reduce_add_ps(x); }
inline V Lanes() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
constexpr int kTokens = 4;      // tokens per pass of the scores
constexpr int kMaxVectors = 4;  // query vectors per block
#else
constexpr int kW = 8;
using V = __m256;
inline V Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V Set(float x) { return _mm256_set1_ps(x); }
inline V Zero() { return _mm256_setzero_ps(); }
inline V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V Add(V a, V b) { return _mm256_add_ps(a, b); }
inline V Sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V Max(V a, V b) { return _mm256_max_ps(a, b); }
// exp_nonpositive on 8 lanes: the same reduction and polynomial, 2^k by its exponent bits.
inline V Exp(V x) {
  x = _mm256_max_ps(x, Set(-87.0f));
  const V k = _mm256_round_ps(_mm256_mul_ps(x, Set(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm256_fnmadd_ps(k, Set(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, Set(-2.12194440e-4f), r);
  V y = Set(1.0f / 720);
  y = Fma(y, r, Set(1.0f / 120));
  y = Fma(y, r, Set(1.0f / 24));
  y = Fma(y, r, Set(1.0f / 6));
  y = Fma(y, r, Set(0.5f));
  y = Fma(y, r, Set(1.0f));
  y = Fma(y, r, Set(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
inline V Within(V pos, V lo, V hi, V x, V fill) {
  return _mm256_blendv_ps(fill, x, _mm256_and_ps(_mm256_cmp_ps(pos, hi, _CMP_LE_OQ), _mm256_cmp_ps(pos, lo, _CMP_GE_OQ)));
}
inline V WhereFinite(V keep, V x) { return _mm256_and_ps(_mm256_cmp_ps(keep, Set(-INFINITY), _CMP_NEQ_OQ), x); }
// Lane i of the result: the sum of v[i]'s 8 lanes (pairs added within 128-bit halves, twice, then
// the halves).
inline V LaneSums(const V* v) {
  const V u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const V u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline float HMax(V x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float HSum(V x) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
inline V Lanes() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
constexpr int kTokens = 3;
constexpr int kMaxVectors = 4;
#endif
// One row (a decode): a page's tokens kW at a time, each query head's kW scores as one vector (the
// kW dot products' lanes summed together by a transpose), the softmax update and exp on that
// vector, then the values.

// acc[0..kW C) = correction acc + sum_t w[t] v[t][0..kW C) over count tokens, token_stride apart:
// the C vectors' sums interleaved token by token (one chain of multiply-adds per vector would
// wait on its own latency at every token).
template <int C>
inline void AccumulateValues(float* acc, const float* v, const float* w, int64_t count, int64_t token_stride,
                             float correction) {
  V o[C];
  for (int c = 0; c < C; ++c) o[c] = Mul(Load(acc + kW * c), Set(correction));
  for (int64_t t = 0; t < count; ++t) {
    const V wt = Set(w[t]);
    for (int c = 0; c < C; ++c) o[c] = Fma(wt, Load(v + t * token_stride + kW * c), o[c]);
  }
  for (int c = 0; c < C; ++c) Store(acc + kW * c, o[c]);
}

// n tokens of a page (k and v at its first, token_stride apart) for query heads [head_first,
// head_last): the scores, the running maxima m and sums l, and the unnormalised outputs in out.
// VECTORS: hs / kW known when compiled (0: read from hs), so that a token's dot product is
// unrolled and the kW tokens' products stay in registers.
template <int VECTORS>
void AttendPage(const float* q, const float* k, const float* v, int64_t n, int64_t head_first, int64_t head_last,
                int64_t g_size, int64_t hs, int64_t token_stride, float* m, float* l, float* out) {
  const int64_t vectors = VECTORS > 0 ? VECTORS : hs / kW;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const V fill = Set(minus_inf), lanes = Lanes();
  alignas(64) float w[kW];
  for (int64_t t0 = 0; t0 < n; t0 += kW) {
    const int64_t count = std::min<int64_t>(kW, n - t0);
    const V last = Set(static_cast<float>(count - 1));
    for (int64_t head = head_first; head < head_last; ++head) {
      const float* qh = q + head * hs;
      const float* kh = k + t0 * token_stride + (head / g_size) * hs;
      V dots[kW];
#pragma GCC unroll 16
      for (int64_t t = 0; t < kW; ++t) {            // tokens past count read the last one's (masked below)
        const float* kt = kh + std::min<int64_t>(t, count - 1) * token_stride;
        V d = Mul(Load(qh), Load(kt));
        for (int64_t c = 1; c < vectors; ++c) d = Fma(Load(qh + kW * c), Load(kt + kW * c), d);
        dots[t] = d;
      }
      const V scores = Within(lanes, Zero(), last, LaneSums(dots), fill);
      const float m_new = std::max(m[head], HMax(scores));
      const float correction = m[head] == minus_inf ? 0.0f : exp_nonpositive(m[head] - m_new);
      const V e = WhereFinite(scores, Exp(Sub(scores, Set(m_new))));
      l[head] = l[head] * correction + HSum(e);
      m[head] = m_new;
      Store(w, e);
      float* acc = out + head * hs;
      const float* vh = v + t0 * token_stride + (head / g_size) * hs;
      int64_t c = 0;
      for (; c + 4 <= vectors; c += 4) AccumulateValues<4>(acc + kW * c, vh + kW * c, w, count, token_stride, correction);
      for (; c < vectors; ++c) AccumulateValues<1>(acc + kW * c, vh + kW * c, w, count, token_stride, correction);
    }
  }
}

constexpr int64_t kRunRows = 8;                          // runs of at least this many rows go in blocks
constexpr int64_t kBlockQueries = kW * kMaxVectors;     // 64 with AVX-512, 32 with AVX2
constexpr int64_t kMaxHeadVectors = 128 / kW;           // head sizes served: whole vectors, up to 128

// s[t][..] (rows of kW * NQV floats) = the scores of n tokens (k, token_stride apart) against the
// NQV query vectors of qt ([hs][kW * NQV]), kTokens tokens at a time.
template <int NQV>
void Scores(const float* qt, const float* k, int64_t n, int64_t hs, int64_t token_stride, float* s) {
  constexpr int64_t stride = kW * NQV;
  int64_t t = 0;
  for (; t + kTokens <= n; t += kTokens) {
    V acc[kTokens][NQV];
    for (int j = 0; j < kTokens; ++j)
      for (int v = 0; v < NQV; ++v) acc[j][v] = Zero();
    const float* kt = k + t * token_stride;
    for (int64_t h = 0; h < hs; ++h)
      for (int j = 0; j < kTokens; ++j) {
        const V kb = Set(kt[j * token_stride + h]);
        for (int v = 0; v < NQV; ++v) acc[j][v] = Fma(Load(qt + h * stride + kW * v), kb, acc[j][v]);
      }
    for (int j = 0; j < kTokens; ++j)
      for (int v = 0; v < NQV; ++v) Store(s + (t + j) * stride + kW * v, acc[j][v]);
  }
  for (; t < n; ++t) {
    V acc[NQV];
    for (int v = 0; v < NQV; ++v) acc[v] = Zero();
    const float* kt = k + t * token_stride;
    for (int64_t h = 0; h < hs; ++h) {
      const V kb = Set(kt[h]);
      for (int v = 0; v < NQV; ++v) acc[v] = Fma(Load(qt + h * stride + kW * v), kb, acc[v]);
    }
    for (int v = 0; v < NQV; ++v) Store(s + t * stride + kW * v, acc[v]);
  }
}

// acc[q] = corr[q] acc[q] + sum_t p[t][q] v[t] for queries [0, queries) (heads of hs floats, acc's
// rows hs apart, p's p_stride apart): C vectors of a head for QB queries at a time.
template <int C, int QB>
void Values(float* acc, const float* p, const float* corr, const float* v, int64_t n, int64_t queries, int64_t hs,
            int64_t p_stride, int64_t token_stride) {
  for (int64_t c0 = 0; c0 < hs; c0 += C * kW)
    for (int64_t q0 = 0; q0 < queries; q0 += QB) {
      const int64_t qb = std::min<int64_t>(QB, queries - q0);
      V o[QB][C];
      for (int64_t i = 0; i < QB; ++i)
        for (int c = 0; c < C; ++c)
          o[i][c] = i < qb ? Mul(Load(acc + (q0 + i) * hs + c0 + kW * c), Set(corr[q0 + i])) : Zero();
      for (int64_t t = 0; t < n; ++t) {
        V vt[C];
        for (int c = 0; c < C; ++c) vt[c] = Load(v + t * token_stride + c0 + kW * c);
        for (int64_t i = 0; i < QB; ++i) {
          const V w = Set(p[t * p_stride + std::min<int64_t>(q0 + i, queries - 1)]);
          for (int c = 0; c < C; ++c) o[i][c] = Fma(w, vt[c], o[i][c]);
        }
      }
      for (int64_t i = 0; i < qb; ++i)
        for (int c = 0; c < C; ++c) Store(acc + (q0 + i) * hs + c0 + kW * c, o[i][c]);
    }
}

using ScoresFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*);
using ValuesFn = void (*)(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);

inline ScoresFn scores_for(int64_t nqv) {
  static constexpr ScoresFn fns[] = {Scores<1>, Scores<2>, Scores<3>, Scores<4>};
  return fns[nqv - 1];
}

// Vectors of a head at a time, and queries at a time: about 16 sums held (AVX-512's 32
// registers), or 8 (AVX2's 16).
inline ValuesFn values_for(int64_t vectors) {
  constexpr bool wide = kW == 16;
  if (vectors % 4 == 0) return wide ? Values<4, 4> : Values<4, 2>;
  if (vectors % 2 == 0) return wide ? Values<2, 6> : Values<2, 4>;
  return wide ? Values<1, 8> : Values<1, 6>;
}

struct Item {
  int64_t row_first, row_last, kv;   // rows [row_first, row_last) of one run, one KV head
};

// One block: its queries against every key its last row attends to (a page at a time, the
// causal and sliding-window limits masked per query), with the first row's table.
void Attend(const Problem& p, const Item& item) {
  const int64_t kh = p.kv_heads, g_size = p.num_heads / kh, hs = p.head_size, heads = p.num_heads;
  const int64_t r0 = item.row_first, rows = item.row_last - item.row_first;
  const int64_t queries = rows * g_size, nqv = (queries + kW - 1) / kW, stride = kW * nqv;
  const int64_t token_stride = kh * hs, page_stride = p.page_size * token_stride;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> qt, s, acc, k_buf, v_buf;
  qt.assign(hs * stride, 0.0f);
  s.resize(p.page_size * stride);
  acc.assign(queries * hs, 0.0f);
  alignas(64) float m[kBlockQueries], l[kBlockQueries], corr[kBlockQueries], lo[kBlockQueries], hi[kBlockQueries];
  for (int64_t q = 0; q < stride; ++q) {                  // padding lanes: no key is theirs
    m[q] = minus_inf;
    l[q] = lo[q] = 0.0f;
    hi[q] = -1.0f;
  }
  for (int64_t q = 0; q < queries; ++q) {                 // query q: row q / G, head kv G + q % G
    const int64_t row = r0 + q / g_size, head = item.kv * g_size + q % g_size;
    const float* qh = p.q + (row * heads + head) * hs;
    for (int64_t h = 0; h < hs; ++h) qt[h * stride + q] = qh[h];
    hi[q] = static_cast<float>(p.lens[row] - 1);         // its own position: the last key it sees
    lo[q] = p.sliding_window > 0 ? static_cast<float>(std::max<int64_t>(0, p.lens[row] - p.sliding_window)) : 0.0f;
    m[q] = p.sinks[head];                                 // the sink: a first key of value 0
    l[q] = p.sinks[head] == minus_inf ? 0.0f : 1.0f;
  }
  const int64_t len = p.lens[item.row_last - 1], first = static_cast<int64_t>(lo[0]);
  const int32_t* table = p.tables + r0 * p.width;
  const ScoresFn scores = scores_for(nqv);
  const ValuesFn values = values_for(hs / kW);
  const V fill = Set(minus_inf);
  for (int64_t page = first / p.page_size; page * p.page_size < len; ++page) {
    const int64_t t0 = std::max(first, page * p.page_size), t1 = std::min(len, (page + 1) * p.page_size);
    const int64_t n = t1 - t0, at = table[page] * page_stride + (t0 - page * p.page_size) * token_stride;
    if (p.fp8) k_buf.resize(page_stride), v_buf.resize(page_stride);
    const float* k = cache_floats(p, p.k_cache, at, p.fp8 ? n * token_stride : 0, k_buf.data()) + item.kv * hs;
    const float* v = cache_floats(p, p.v_cache, at, p.fp8 ? n * token_stride : 0, v_buf.data()) + item.kv * hs;
    scores(qt.data(), k, n, hs, token_stride, s.data());
    for (int64_t vq = 0; vq < nqv; ++vq) {                 // the online softmax, kW queries at a time
      float* sv = s.data() + kW * vq;
      const V lo_v = Load(lo + kW * vq), hi_v = Load(hi + kW * vq), m_old = Load(m + kW * vq);
      V m_new = m_old;
      for (int64_t t = 0; t < n; ++t) {
        const V x = Within(Set(static_cast<float>(t0 + t)), lo_v, hi_v, Load(sv + t * stride), fill);
        Store(sv + t * stride, x);
        m_new = Max(m_new, x);
      }
      const V c = WhereFinite(m_old, Exp(Sub(m_old, m_new)));
      const V base = WhereFinite(m_new, m_new);          // lanes that have seen no key yet: 0
      V sum = Zero();
      for (int64_t t = 0; t < n; ++t) {
        const V x = Load(sv + t * stride), e = WhereFinite(x, Exp(Sub(x, base)));
        Store(sv + t * stride, e);
        sum = Add(sum, e);
      }
      Store(l + kW * vq, Fma(Load(l + kW * vq), c, sum));
      Store(m + kW * vq, m_new);
      Store(corr + kW * vq, c);
    }
    values(acc.data(), s.data(), corr, v, n, queries, hs, stride, token_stride);
  }
  for (int64_t q = 0; q < queries; ++q) {
    const int64_t row = r0 + q / g_size, head = item.kv * g_size + q % g_size;
    const float inv = l[q] > 0.0f ? 1.0f / l[q] : 0.0f;
    float* out = p.out + (row * heads + head) * hs;
    for (int64_t h = 0; h < hs; ++h) out[h] = acc[q * hs + h] * inv;
  }
}
}  // namespace block
#endif

struct Item {
  int64_t row, kv_first, kv_last;   // KV heads [kv_first, kv_last) of one row
  int64_t row_last = -1;            // > row: rows [row, row_last) of one run as a block (one KV head)
  int64_t cost = 0;                 // queries times keys, for the order
};

// One item: its KV heads' G query heads each against every key the row attends to, a page at a
// time for all its KV heads together, so each page is streamed from memory once.
void attend(const Problem& p, const Item& item) {
  const int64_t kh = p.kv_heads, g_size = p.num_heads / kh, hs = p.head_size, heads = p.num_heads;
  const int64_t row = item.row, head_first = item.kv_first * g_size, head_last = item.kv_last * g_size;
  const int64_t len = p.lens[row];
  float* out = p.out + row * heads * hs;               // the accumulator, normalised at the end
  std::fill(out + head_first * hs, out + head_last * hs, 0.0f);
  if (len <= 0) return;
  const float* q = p.q + row * heads * hs;
  const int64_t first = p.sliding_window > 0 ? std::max<int64_t>(0, len - p.sliding_window) : 0;
  const int64_t token_stride = kh * hs, page_stride = p.page_size * token_stride;
  float m[kMaxHeads], l[kMaxHeads], s[kMaxHeads][kMaxPage];
  for (int64_t head = head_first; head < head_last; ++head) {     // the sink: a first key of value 0
    m[head] = p.sinks[head];
    l[head] = p.sinks[head] == -std::numeric_limits<float>::infinity() ? 0.0f : 1.0f;
  }
  const int64_t elem = p.fp8 ? 1 : sizeof(float), page_bytes = page_stride * elem;
  const char* k_cache = static_cast<const char*>(p.k_cache);
  const char* v_cache = static_cast<const char*>(p.v_cache);
  {                                                    // the first page (the second is not prefetched)
    const int64_t block = p.tables[row * p.width + first / p.page_size];
    prefetch_page(k_cache + block * page_bytes, v_cache + block * page_bytes, 0, page_bytes);
  }
  // The page kPrefetchPages ahead is brought in a slice per query head, between the heads'
  // work on this page: a whole page's prefetches at once wait on the core's few outstanding
  // misses (in the decode attention benchmark, 64 rows on 2 threads: ~30% faster).
  const int64_t slice = (page_bytes / 64 + (head_last - head_first) - 1) / (head_last - head_first) * 64;
  for (int64_t page = first / p.page_size; page * p.page_size < len; ++page) {
    const int64_t block = p.tables[row * p.width + page];
    const int64_t t0 = std::max(first, page * p.page_size), t1 = std::min(len, (page + 1) * p.page_size);
    const int64_t n = t1 - t0;
    const int64_t at = block * page_stride + (t0 - page * p.page_size) * token_stride;
    thread_local std::vector<float> k_buf, v_buf;      // an fp8 page's keys and values as floats
    if (p.fp8) k_buf.resize(page_stride), v_buf.resize(page_stride);
    const float* k = cache_floats(p, p.k_cache, at, n * token_stride, k_buf.data());
    const float* v = cache_floats(p, p.v_cache, at, n * token_stride, v_buf.data());
    const char *next_k = nullptr, *next_v = nullptr;
    if ((page + kPrefetchPages) * p.page_size < len) {
      const int64_t next = p.tables[row * p.width + page + kPrefetchPages];
      next_k = k_cache + next * page_bytes;
      next_v = v_cache + next * page_bytes;
    }
#ifdef JAXENGINE_BLOCKS
    if (hs % block::kW == 0 && p.soft_cap == 0.0f) {
      using block::AttendPage;
      constexpr int w = block::kW;
      for (int64_t head = head_first; head < head_last; ++head) {
        if (next_k != nullptr) {
          const int64_t from = (head - head_first) * slice;
          prefetch_page(next_k, next_v, from, std::min(page_bytes, from + slice));
        }
        if (hs == 8 * w)
          AttendPage<8>(q, k, v, n, head, head + 1, g_size, hs, token_stride, m, l, out);
        else if (hs == 4 * w)
          AttendPage<4>(q, k, v, n, head, head + 1, g_size, hs, token_stride, m, l, out);
        else if (hs == 16 * w)
          AttendPage<16>(q, k, v, n, head, head + 1, g_size, hs, token_stride, m, l, out);
        else
          AttendPage<0>(q, k, v, n, head, head + 1, g_size, hs, token_stride, m, l, out);
      }
      continue;
    }
#endif
    for (int64_t t = 0; t < n; ++t)
      for (int64_t head = head_first; head < head_last; ++head) {
        float x = dot(q + head * hs, k + t * token_stride + (head / g_size) * hs, hs);
        s[head][t] = p.soft_cap > 0.0f ? p.soft_cap * std::tanh(x / p.soft_cap) : x;
      }
    for (int64_t head = head_first; head < head_last; ++head) {
      if (next_k != nullptr) {
        const int64_t from = (head - head_first) * slice;
        prefetch_page(next_k, next_v, from, std::min(page_bytes, from + slice));
      }
      float m_new = m[head];
      for (int64_t t = 0; t < n; ++t) m_new = std::max(m_new, s[head][t]);
      const float correction = m[head] == -std::numeric_limits<float>::infinity()
                                   ? 0.0f : exp_nonpositive(m[head] - m_new);
      float sum = 0.0f;
      for (int64_t t = 0; t < n; ++t) {
        s[head][t] = exp_nonpositive(s[head][t] - m_new);
        sum += s[head][t];
      }
      l[head] = l[head] * correction + sum;
      m[head] = m_new;
      float* acc = out + head * hs;
      const float* vh = v + (head / g_size) * hs;
      for (int64_t h = 0; h < hs; ++h) acc[h] *= correction;
      for (int64_t t = 0; t < n; ++t) {
        const float w = s[head][t];
        const float* vt = vh + t * token_stride;
        for (int64_t h = 0; h < hs; ++h) acc[h] += w * vt[h];
      }
    }
  }
  for (int64_t head = head_first; head < head_last; ++head) {
    const float inv = l[head] > 0.0f ? 1.0f / l[head] : 0.0f;
    for (int64_t h = 0; h < hs; ++h) out[head * hs + h] *= inv;
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                           ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> tables,
                           ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::F32> sinks, int64_t sliding_window,
                           float soft_cap,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged decode: q [B, N, H], caches [NB, S, K*H], tables [B, M]");
  const int64_t rows = qd[0], num_heads = qd[1], head_size = qd[2], kv_heads = kd[2] / head_size;
  if (kd[2] % head_size != 0 || num_heads % kv_heads != 0 || num_heads > kMaxHeads ||
      kd[1] > kMaxPage || td[0] != rows || sinks.element_count() != static_cast<size_t>(num_heads))
    return ffi::Error::InvalidArgument("paged decode: shapes this kernel does not serve");
  const auto type = k_cache.element_type();
  const bool fp8 = type == ffi::DataType::F8E4M3FN || type == ffi::DataType::U8;    // U8: float8_e4m3fn bytes
  if ((type != ffi::DataType::F32 && !fp8) || v_cache.element_type() != type)
    return ffi::Error::InvalidArgument("paged decode: the caches must both be f32 or both float8_e4m3fn (or its bytes)");
  const Problem problem{q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(), tables.typed_data(),
                        lens.typed_data(), sinks.typed_data(), out->typed_data(), num_heads, kv_heads, head_size, kd[1],
                        td[1], sliding_window, soft_cap, fp8};
  const int32_t* len = lens.typed_data();
  const int32_t* table = tables.typed_data();
  const int64_t page_size = kd[1], width = td[1], g_size = num_heads / kv_heads;
  // Runs: rows of one sequence at consecutive positions (a prompt's tokens), their tables alike
  // as far as the later row reads.
  auto continues = [&](int64_t r) {
    const int64_t pages = std::min<int64_t>(width, (len[r] + page_size - 1) / page_size);
    return len[r - 1] > 0 && len[r] == len[r - 1] + 1 &&
           std::equal(table + (r - 1) * width, table + (r - 1) * width + pages, table + r * width);
  };
  bool blocks = false;
  int64_t block_rows = 0;
#ifdef JAXENGINE_BLOCKS
  blocks = head_size % block::kW == 0 && head_size / block::kW <= block::kMaxHeadVectors && soft_cap == 0.0f &&
           g_size <= block::kBlockQueries;
  block_rows = std::max<int64_t>(1, block::kBlockQueries / g_size);
  constexpr int64_t kRunRows = block::kRunRows;
#else
  constexpr int64_t kRunRows = 1;
#endif
  // Few rows: one item per KV head, so that a single long row still keeps every core busy.
  const int64_t live = std::count_if(len, len + rows, [](int32_t n) { return n > 0; });
  const bool split = live < 2 * std::max<int64_t>(pool.num_threads(), 1);
  std::vector<Item> items;
  for (int64_t r = 0, end; r < rows; r = end) {
    for (end = r + 1; blocks && end < rows && continues(end);) ++end;
    if (blocks && end - r >= kRunRows) {
      for (int64_t b = r; b < end; b += block_rows) {
        const int64_t b_end = std::min(end, b + block_rows);
        for (int64_t h = 0; h < kv_heads; ++h)
          items.push_back(Item{b, h, h + 1, b_end, (b_end - b) * g_size * len[b_end - 1]});
      }
      continue;
    }
    for (int64_t i = r; i < end; ++i)
      for (int64_t h = 0; h < kv_heads; h += split ? 1 : kv_heads)
        items.push_back(Item{i, h, split ? h + 1 : kv_heads, -1, (split ? g_size : num_heads) * std::max(len[i], 0)});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  auto run = [&](const Item& item) {
#ifdef JAXENGINE_BLOCKS
    if (item.row_last > item.row) return block::Attend(problem, block::Item{item.row, item.row_last, item.kv_first});
#endif
    attend(problem, item);
  };
  // Little to read (a decode of one short row): on the calling thread, as waking a pool thread
  // costs about what the work does.
  const int64_t keys = std::accumulate(len, len + rows, int64_t{0}, [](int64_t a, int32_t n) { return a + std::max(n, 0); });
  if (keys * kv_heads * head_size * 2 * (fp8 ? 1 : 4) < kSoloBytes) {
    for (const Item& item : items) run(item);
    return ffi::Error::Success();
  }
  jaxengine::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) { run(items[i]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxenginePagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
