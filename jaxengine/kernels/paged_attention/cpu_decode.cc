// Decode attention over the paged KV cache on the CPU: one query token per row, its keys and
// values read in place from the row's pages (XLA's version gathers them into a temporary first).
// Work items are rows (or, for a few rows, their KV heads), longest first, shared over XLA's
// intra-op thread pool (cpu_pool.h). f32 throughout; a page at a time, an
// online softmax per query head, as jaxengine/kernels/paged_attention/reference.py defines the result.
// Where the CPU has AVX-512 and a head is a whole number of 16-float vectors (no soft cap), a page's
// tokens go 16 at a time: a query head's 16 scores as one vector, its softmax update and exp on it.
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

#ifdef __AVX512F__
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
constexpr int64_t kPrefetchPages = 1;     // pages read ahead

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

// Bring a page's keys and values towards the caches while the previous page is computed: pages
// sit anywhere in the pool, where the hardware prefetcher does not follow.
inline void prefetch_page(const char* k, const char* v, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) {
    __builtin_prefetch(k + i);
    __builtin_prefetch(v + i);
  }
}

#ifdef __AVX512F__
// Where the CPU has AVX-512 and a head is a whole number of 16-float vectors (no soft cap): a page's
// tokens 16 at a time, each query head's 16 scores as one vector (the 16 dot products' lanes summed
// together by a transpose), the softmax update and exp on that vector, then the values.

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

// acc[0..16 C) = correction acc + sum_t w[t] v[t][0..16 C) over count tokens, token_stride apart:
// the C vectors' sums interleaved token by token (one chain of multiply-adds per vector would
// wait on its own latency at every token).
template <int C>
inline void AccumulateValues(float* acc, const float* v, const float* w, int64_t count, int64_t token_stride,
                             float correction) {
  __m512 o[C];
  for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), _mm512_set1_ps(correction));
  for (int64_t t = 0; t < count; ++t) {
    const __m512 wt = _mm512_set1_ps(w[t]);
    for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(v + t * token_stride + 16 * c), o[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, o[c]);
}

// n tokens of a page (k and v at its first, token_stride apart) for query heads [head_first,
// head_last): the scores, the running maxima m and sums l, and the unnormalised outputs in out.
// VECTORS: hs / 16 known when compiled (0: read from hs), so that a token's dot product is
// unrolled and the 16 tokens' products stay in registers.
template <int VECTORS>
void AttendPage16(const float* q, const float* k, const float* v, int64_t n, int64_t head_first, int64_t head_last,
                  int64_t g_size, int64_t hs, int64_t token_stride, float* m, float* l, float* out) {
  const int64_t vectors = VECTORS > 0 ? VECTORS : hs / 16;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  alignas(64) float w[16];
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - t0);
    const __mmask16 live = static_cast<__mmask16>(count == 16 ? 0xFFFF : (1u << count) - 1);
    for (int64_t head = head_first; head < head_last; ++head) {
      const float* qh = q + head * hs;
      const float* kh = k + t0 * token_stride + (head / g_size) * hs;
      __m512 dots[16];
#pragma GCC unroll 16
      for (int64_t t = 0; t < 16; ++t) {            // tokens past count read the last one's (masked below)
        const float* kt = kh + std::min<int64_t>(t, count - 1) * token_stride;
        __m512 d = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kt));
        for (int64_t c = 1; c < vectors; ++c) d = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), _mm512_loadu_ps(kt + 16 * c), d);
        dots[t] = d;
      }
      const __m512 scores = _mm512_mask_blend_ps(live, _mm512_set1_ps(minus_inf), LaneSums16(dots));
      const float m_new = std::max(m[head], _mm512_reduce_max_ps(scores));
      const float correction = m[head] == minus_inf ? 0.0f : exp_nonpositive(m[head] - m_new);
      const __m512 e = _mm512_maskz_mov_ps(live, Exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m_new))));
      l[head] = l[head] * correction + _mm512_reduce_add_ps(e);
      m[head] = m_new;
      _mm512_store_ps(w, e);
      float* acc = out + head * hs;
      const float* vh = v + t0 * token_stride + (head / g_size) * hs;
      int64_t c = 0;
      for (; c + 4 <= vectors; c += 4) AccumulateValues<4>(acc + 16 * c, vh + 16 * c, w, count, token_stride, correction);
      for (; c < vectors; ++c) AccumulateValues<1>(acc + 16 * c, vh + 16 * c, w, count, token_stride, correction);
    }
  }
}
#endif

struct Item {
  int64_t row, kv_first, kv_last;   // KV heads [kv_first, kv_last) of one row
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
  const int64_t elem = p.fp8 ? 1 : sizeof(float);
  for (int64_t page = first / p.page_size; page * p.page_size < len && page < first / p.page_size + kPrefetchPages; ++page) {
    const int64_t block = p.tables[row * p.width + page];
    prefetch_page(static_cast<const char*>(p.k_cache) + block * page_stride * elem,
                  static_cast<const char*>(p.v_cache) + block * page_stride * elem, page_stride * elem);
  }
  for (int64_t page = first / p.page_size; page * p.page_size < len; ++page) {
    const int64_t block = p.tables[row * p.width + page];
    const int64_t t0 = std::max(first, page * p.page_size), t1 = std::min(len, (page + 1) * p.page_size);
    const int64_t n = t1 - t0;
    const int64_t at = block * page_stride + (t0 - page * p.page_size) * token_stride;
    thread_local std::vector<float> k_buf, v_buf;      // an fp8 page's keys and values as floats
    if (p.fp8) k_buf.resize(page_stride), v_buf.resize(page_stride);
    const float* k = cache_floats(p, p.k_cache, at, n * token_stride, k_buf.data());
    const float* v = cache_floats(p, p.v_cache, at, n * token_stride, v_buf.data());
    if (kPrefetchPages > 0 && (page + kPrefetchPages) * p.page_size < len) {
      const int64_t next = p.tables[row * p.width + page + kPrefetchPages], item = p.fp8 ? 1 : sizeof(float);
      prefetch_page(static_cast<const char*>(p.k_cache) + next * page_stride * item,
                    static_cast<const char*>(p.v_cache) + next * page_stride * item, page_stride * item);
    }
#ifdef __AVX512F__
    if (hs % 16 == 0 && p.soft_cap == 0.0f) {
      if (hs == 64)
        AttendPage16<4>(q, k, v, n, head_first, head_last, g_size, hs, token_stride, m, l, out);
      else if (hs == 128)
        AttendPage16<8>(q, k, v, n, head_first, head_last, g_size, hs, token_stride, m, l, out);
      else
        AttendPage16<0>(q, k, v, n, head_first, head_last, g_size, hs, token_stride, m, l, out);
      continue;
    }
#endif
    for (int64_t t = 0; t < n; ++t)
      for (int64_t head = head_first; head < head_last; ++head) {
        float x = dot(q + head * hs, k + t * token_stride + (head / g_size) * hs, hs);
        s[head][t] = p.soft_cap > 0.0f ? p.soft_cap * std::tanh(x / p.soft_cap) : x;
      }
    for (int64_t head = head_first; head < head_last; ++head) {
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
  std::vector<int64_t> order(rows);
  std::iota(order.begin(), order.end(), 0);
  const int32_t* len = lens.typed_data();
  std::stable_sort(order.begin(), order.end(), [len](int64_t a, int64_t b) { return len[a] > len[b]; });
  // Few rows: one item per KV head, so that a single long row still keeps every core busy.
  const int64_t live = std::count_if(len, len + rows, [](int32_t n) { return n > 0; });
  const bool split = live < 2 * std::max<int64_t>(pool.num_threads(), 1);
  std::vector<Item> items;        // longest rows first
  for (int64_t r : order)
    for (int64_t h = 0; h < kv_heads; h += split ? 1 : kv_heads)
      items.push_back(Item{r, h, split ? h + 1 : kv_heads});
  // Little to read (a decode of one short row): on the calling thread, as waking a pool thread
  // costs about what the work does.
  const int64_t keys = std::accumulate(len, len + rows, int64_t{0}, [](int64_t a, int32_t n) { return a + std::max(n, 0); });
  if (keys * kv_heads * head_size * 2 * (fp8 ? 1 : 4) < kSoloBytes) {
    for (const Item& item : items) attend(problem, item);
    return ffi::Error::Success();
  }
  jaxengine::ParallelFor(pool, static_cast<int64_t>(items.size()),
                         [&](int64_t i) { attend(problem, items[i]); });
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
