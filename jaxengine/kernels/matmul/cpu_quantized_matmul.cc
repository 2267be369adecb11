// A matmul of f32 activations with quantized weights on the CPU, called from XLA through the FFI.
// The weights stay quantized in memory; each step reads their bytes, not an f32 copy.
//
// Shapes: x [M, K] f32; q [L, K/P, N]: int8 or float8_e4m3fn values (P = 1), or int4 values 0..15 packed two rows a byte (P = 2: row 2r in the low nibble, row 2r+1
// in the high one); scale [L, K/G, N] and offset [L, K/G, N] (or [0]: none), f16 or f32, one per group of G rows and column; layer [] s32.
// The weight is w[k, n] = scale[k/G, n] * q[k, n] + offset[k/G, n], and out [M, N] = x @ w[layer].
//
// A few rows (a decode step): the scales come out of the sum, group by group,
//   out[m, n] = sum_g scale[g, n] * (sum_{k in g} x[m, k] q[k, n]) + offset[g, n] * (sum_{k in g} x[m, k]),
// so each weight byte is converted once and multiplied into every row: the work per weight is a
// convert and one fused multiply-add per row, and the bytes read are the quantized ones.
// On a CPU with AVX-512 VNNI and VBMI the int8 and int4 values are instead multiplied as bytes:
// each group of a row of x is written as three int8 terms, x ~ d (a + b / 254 + c / 254^2) with
// d = max|x| / 127 (an error of at most 6.2e-8 of the group's largest |x|: float32's accuracy
// for all but values far below the group's largest), and VPDPBUSD multiplies 64 weight bytes by 4
// of x's at a time into 16 columns' int32 sums; each 4 rows of q are turned into [column][4 rows]
// bytes with one VPERMB. The weights are read as bytes once and never converted to float. The
// threads share a product by its groups (rows of q), so each streams its own contiguous part of the
// weight, and their sums are added at the end; they are HotPool's (cpu_pool.h), awake through a
// decode step's products of 5-40 us each. An LM head's rows (tens of thousands of columns) are
// fetched ahead along the columns rather than down the rows. A loaded model's weights are laid out
// once as tiles for these products (``JaxengineCpuTiledMatmuls``, "tiles" below): each thread's
// share one stream, each group's scales beside its values. With AVX2 and no VNNI, tiled weights are
// multiplied as bytes too: VPMADDUBSW and VPMADDWD do VPDPBUSD's work on a word's two halves of 8
// columns (row-major weights take the float loop there: without VPERMB, turning rows into words as
// the product goes costs more than it saves).
// Several weights against the same x (a layer's q, k and v projections; its gate and up) can be one
// call (``...Matmuls``: q, scale and offset per weight, one result each): x's terms are written once
// and every product's chunks go to the threads as one job.
// More rows (a prefill): each thread dequantises its column block to f32, a strip of 32 columns at
// a time, and multiplies the strip into every row from registers (cpu_gemm.h).
//
// The grouped form (a mixture of experts' projections): q [L, E, K/P, N], scale and offset
// [L, E, K/G, N], group_sizes [E] s32; rows of x sorted by expert, group e's rows times expert e's
// weight, rows past the groups 0. Only the experts some row chose are read.
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <numeric>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define JAXENGINE_VNNI 1
#endif
#if defined(JAXENGINE_VNNI) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define JAXENGINE_TILES 1        // tiled weights multiplied as bytes: VPDPBUSD, or AVX2's VPMADDUBSW
#endif

#include "cpu_gemm.h"
#include "cpu_pool.h"
#include "fp8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kFusedRows = 8;        // up to this many rows: the fused loop, else dequantised strips
constexpr int64_t kFewRowBlocks = 32;    // column blocks of a few rows' product not taken as bytes, at most
constexpr int64_t kFewRowColumns = 1536; // ... and at least this many columns each where there are enough
constexpr int64_t kFewRowChunks = 8;     // chunks of groups of a few rows' product as bytes, at most
constexpr int64_t kSoloBytes = 16 << 10; // a few rows' product with fewer weight bytes: on the calling thread

template <typename S>                    // S: the scales' and offsets' type, _Float16 or float
struct Weights {
  const uint8_t* q;                      // int8 / fp8 values as bytes, or int4 values packed in nibbles
  const S* scale;
  const S* offset;                       // nullptr: none
  int64_t k, n, group;
};

typedef float Floats __attribute__((vector_size(32)));          // 8 lanes: AVX2, or two SSE halves
typedef int8_t Bytes __attribute__((vector_size(8)));
typedef uint8_t UBytes __attribute__((vector_size(8)));
typedef _Float16 Halves __attribute__((vector_size(16)));
constexpr int64_t kLanes = 8;

// The values' kinds (the kernels' first template argument): int8, int4 packed two rows a byte,
// float8_e4m3fn. kPack: rows per byte.
constexpr int kInt8 = 1, kInt4 = 2, kFp8 = 3;
template <int V>
constexpr int kPack = V == kInt4 ? 2 : 1;


template <int V>
inline float Value(uint8_t byte, int half) {
  if constexpr (V == kInt8) return static_cast<float>(static_cast<int8_t>(byte));
  if constexpr (V == kFp8) return jaxengine::kFp8Values.value[byte];
  return static_cast<float>(half ? byte >> 4 : byte & 15);
}

template <typename V, typename T>
inline V Load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 8 int8 / uint8 / float16 values as floats. GCC's generic vector conversions of these are done
// one element at a time; AVX2 and F16C convert the 8 at once.
inline Floats SignedBytes(const uint8_t* p) {
#ifdef __AVX2__
  return (Floats)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(Load<Bytes>(p), Floats);
#endif
}

#ifdef __AVX2__
inline Floats Nibbles(__m128i bytes) { return (Floats)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
#endif

inline Floats HalfFloats(const _Float16* p) {
#ifdef __F16C__
  return (Floats)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(Load<Halves>(p), Floats);
#endif
}

inline Floats ScaleFloats(const _Float16* p) { return HalfFloats(p); }
inline Floats ScaleFloats(const float* p) { return Load<Floats>(p); }

// 8 float8_e4m3fn values as floats. AVX2 by bits (a gather from the table is slow on this
// class of CPU): the magnitude shifted into a float's exponent and mantissa, rebiased (7 -> 127);
// subnormals (exponent 0) as m * 2^-9; S.1111.111 NaN; the sign last. Elsewhere: the table.
inline Floats Fp8Floats(const uint8_t* p) {
#ifdef __AVX2__
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512));
  __m256 v = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  v = _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
  return (Floats)_mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24)));
#else
  Floats v;
  for (int i = 0; i < kLanes; ++i) v[i] = jaxengine::kFp8Values.value[p[i]];
  return v;
#endif
}

// The weights of rows kk (and kk + 1 when packed) at 8 columns: (low, high).
template <int V>
inline void LoadValues(const uint8_t* row, Floats* low, Floats* high) {
  if constexpr (V == kInt8) {
    *low = SignedBytes(row);
  } else if constexpr (V == kFp8) {
    *low = Fp8Floats(row);
  } else {
#ifdef __AVX2__
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row));
    *low = Nibbles(_mm_and_si128(b, _mm_set1_epi8(15)));
    *high = Nibbles(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
#else
    const UBytes b = Load<UBytes>(row);
    *low = __builtin_convertvector(b & 15, Floats);
    *high = __builtin_convertvector(b >> 4, Floats);
#endif
  }
}

// out[0..M) x columns [c, c + 8 T): each group's sums of x times q stay in registers (M x T of
// them), and each row of q is read 64 bytes (or T vectors) at a time.
template <int V, int M, int T, typename S>
void FusedLanes(const float* x, const Weights<S>& w, const float* sums, float* out, int64_t c) {
  const int64_t k = w.k, n = w.n, g = w.group, groups = k / g;
  Floats res[M][T] = {};
  for (int64_t gi = 0; gi < groups; ++gi) {
    Floats acc[M][T] = {};
    for (int64_t kk = gi * g; kk < (gi + 1) * g; kk += kPack<V>) {
      const uint8_t* row = w.q + (kk / kPack<V>) * n + c;
      for (int t = 0; t < T; ++t) {
        Floats low, high;
        LoadValues<V>(row + t * kLanes, &low, &high);
        for (int r = 0; r < M; ++r) {
          acc[r][t] += x[r * k + kk] * low;
          if constexpr (kPack<V> == 2) acc[r][t] += x[r * k + kk + 1] * high;
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const Floats s = ScaleFloats(w.scale + gi * n + c + t * kLanes);
      for (int r = 0; r < M; ++r) res[r][t] += s * acc[r][t];
      if (w.offset != nullptr) {
        const Floats o = ScaleFloats(w.offset + gi * n + c + t * kLanes);
        for (int r = 0; r < M; ++r) res[r][t] += o * sums[r * groups + gi];
      }
    }
  }
  for (int r = 0; r < M; ++r) std::memcpy(out + r * n + c, res[r], sizeof res[r]);
}

// Columns past the last multiple of 8 of a block, one at a time.
template <int V, typename S>
void FusedColumn(const float* x, const Weights<S>& w, const float* sums, float* out, int64_t m, int64_t c) {
  const int64_t k = w.k, n = w.n, g = w.group, groups = k / g;
  for (int64_t r = 0; r < m; ++r) {
    float total = 0.0f;
    for (int64_t gi = 0; gi < groups; ++gi) {
      float acc = 0.0f;
      for (int64_t kk = gi * g; kk < (gi + 1) * g; ++kk)
        acc += x[r * k + kk] * Value<V>(w.q[(kk / kPack<V>) * n + c], kPack<V> == 2 ? kk & 1 : 0);
      total += static_cast<float>(w.scale[gi * n + c]) * acc;
      if (w.offset != nullptr) total += static_cast<float>(w.offset[gi * n + c]) * sums[r * groups + gi];
    }
    out[r * n + c] = total;
  }
}

template <int V, int M, typename S>
void FusedColumnsOf(const float* x, const Weights<S>& w, const float* sums, float* out, int64_t first, int64_t last) {
  constexpr int T = M >= 8 ? 1 : 8 / M;                 // vectors per row: M x T accumulators
  int64_t c = first;
  for (; c + T * kLanes <= last; c += T * kLanes) FusedLanes<V, M, T, S>(x, w, sums, out, c);
  for (; c + kLanes <= last; c += kLanes) FusedLanes<V, M, 1, S>(x, w, sums, out, c);
  for (; c < last; ++c) FusedColumn<V, S>(x, w, sums, out, M, c);
}

#ifdef JAXENGINE_TILES
// ---------------------------------------------------------------- bytes times bytes
constexpr int kTerms = 3;                // int8 terms per activation: a + b / 254 + c / 254^2
constexpr float kTermScale = 1.0f / 254.0f;

// Rows of q consumed per step (4), and the k values they hold: 8 for int4, 4 for int8.
template <int V>
constexpr int kStepK = 4 * kPack<V>;

// The vector part [begin, vectors) of a group of a row of x, kFillLanes at a time: its largest |x|
// (false: it holds an inf or a NaN), and its three int8 terms (x / d = a + b / 254 + c / 254^2,
// ``inv`` = 1 / d) into terms[t * k + i], summed into sums[t * groups].
#ifdef JAXENGINE_VNNI
constexpr int64_t kFillLanes = 16;

inline bool VectorTop(const float* row, int64_t begin, int64_t vectors, float* top) {
  __m512 top16 = _mm512_setzero_ps();
  __mmask16 not_finite = 0;
  for (int64_t i = begin; i < vectors; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    not_finite |= _mm512_fpclass_ps_mask(v, 0x99);     // a NaN or an infinity
    top16 = _mm512_max_ps(top16, _mm512_abs_ps(v));
  }
  *top = _mm512_reduce_max_ps(top16);
  return !not_finite;
}

inline void VectorTerms(const float* row, int64_t begin, int64_t vectors, float inv, int8_t* terms, int64_t k,
                        int32_t* sums, int64_t groups) {
  const __m512 lowest = _mm512_set1_ps(-127.0f), highest = _mm512_set1_ps(127.0f), next = _mm512_set1_ps(254.0f);
  __m512i term_sums[kTerms];
  for (int t = 0; t < kTerms; ++t) term_sums[t] = _mm512_setzero_si512();
  for (int64_t i = begin; i < vectors; i += 16) {
    __m512 rest = _mm512_mul_ps(_mm512_loadu_ps(row + i), _mm512_set1_ps(inv));
    for (int t = 0; t < kTerms; ++t) {
      const __m512 q = _mm512_roundscale_ps(_mm512_min_ps(_mm512_max_ps(rest, lowest), highest),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i qi = _mm512_cvtps_epi32(q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(terms + t * k + i), _mm512_cvtepi32_epi8(qi));
      term_sums[t] = _mm512_add_epi32(term_sums[t], qi);
      rest = _mm512_mul_ps(_mm512_sub_ps(rest, q), next);
    }
  }
  for (int t = 0; t < kTerms; ++t) sums[t * groups] += _mm512_reduce_add_epi32(term_sums[t]);
}
#else
constexpr int64_t kFillLanes = 8;

inline bool VectorTop(const float* row, int64_t begin, int64_t vectors, float* top) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top8 = _mm256_setzero_ps(), not_finite = _mm256_setzero_ps();
  for (int64_t i = begin; i < vectors; i += 8) {
    const __m256 v = _mm256_and_ps(_mm256_loadu_ps(row + i), magnitude);
    not_finite = _mm256_or_ps(not_finite, _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
    top8 = _mm256_max_ps(top8, v);
  }
  alignas(32) float tops[8];
  _mm256_store_ps(tops, top8);
  *top = *std::max_element(tops, tops + 8);
  return !_mm256_movemask_ps(not_finite);
}

inline void VectorTerms(const float* row, int64_t begin, int64_t vectors, float inv, int8_t* terms, int64_t k,
                        int32_t* sums, int64_t groups) {
  const __m256 lowest = _mm256_set1_ps(-127.0f), highest = _mm256_set1_ps(127.0f), next = _mm256_set1_ps(254.0f);
  __m256i term_sums[kTerms];
  for (int t = 0; t < kTerms; ++t) term_sums[t] = _mm256_setzero_si256();
  for (int64_t i = begin; i < vectors; i += 8) {
    __m256 rest = _mm256_mul_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(inv));
    for (int t = 0; t < kTerms; ++t) {
      const __m256 q = _mm256_round_ps(_mm256_min_ps(_mm256_max_ps(rest, lowest), highest),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i qi = _mm256_cvtps_epi32(q);
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(terms + t * k + i), _mm_packs_epi16(words, words));
      term_sums[t] = _mm256_add_epi32(term_sums[t], qi);
      rest = _mm256_mul_ps(_mm256_sub_ps(rest, q), next);
    }
  }
  for (int t = 0; t < kTerms; ++t) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), term_sums[t]);
    sums[t * groups] += std::accumulate(lanes, lanes + 8, 0);
  }
}
#endif

// x's rows written for VPDPBUSD: per row and group, d (the group's max|x| / 127, its unit) and
// per row, term and step of 4 q-rows, kPack<V> 32-bit words of 4 int8 values each: the k values
// that meet the 4 bytes of a column's word (int4: the low nibbles are k = 8s, 8s+2, 8s+4, 8s+6,
// the high ones 8s+1, 8s+3, ..; int8: k = 4s .. 4s+3). ``qsum``: the terms summed per group (with
// VNNI, int8 weights are offset by 128 to be unsigned, and this takes the offset back out).
template <int V>
struct Activations {
  std::vector<float> unit;               // [m, groups]
  std::vector<int32_t> words;            // [m, kTerms, k / kStepK, kPack]
  std::vector<int32_t> qsum;             // [m, kTerms, groups]
  int64_t groups, steps;

  // False (nothing to use) where a row holds an inf or a NaN: the float loop propagates those.
  bool Fill(const float* x, int64_t m, int64_t k, int64_t group) {
    groups = k / group;
    steps = k / kStepK<V>;
    unit.resize(m * groups);
    words.resize(m * kTerms * steps * kPack<V>);
    qsum.assign(m * kTerms * groups, 0);
    thread_local std::vector<int8_t> terms;
    terms.resize(kTerms * k);
    for (int64_t r = 0; r < m; ++r) {
      const float* row = x + r * k;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t begin = g * group, end = begin + group, vectors = begin + group / kFillLanes * kFillLanes;
        float top;
        if (!VectorTop(row, begin, vectors, &top)) return false;
        for (int64_t i = vectors; i < end; ++i) {
          if (!std::isfinite(row[i])) return false;
          top = std::max(top, std::fabs(row[i]));
        }
        const float d = top / 127.0f;
        unit[r * groups + g] = d;
        const float inv = d > 0.0f && std::isfinite(1.0f / d) ? 1.0f / d : 0.0f;   // subnormal groups: 0
        int32_t* sums = qsum.data() + r * kTerms * groups + g;
        VectorTerms(row, begin, vectors, inv, terms.data(), k, sums, groups);
        for (int64_t i = vectors; i < end; ++i) {
          float rest = row[i] * inv;
          for (int t = 0; t < kTerms; ++t) {
            const float q = std::nearbyint(std::clamp(rest, -127.0f, 127.0f));
            terms[t * k + i] = static_cast<int8_t>(q);
            sums[t * groups] += static_cast<int32_t>(q);
            rest = (rest - q) * 254.0f;
          }
        }
      }
      for (int t = 0; t < kTerms; ++t) {
        const int8_t* tk = terms.data() + t * k;
        int32_t* out = words.data() + ((r * kTerms + t) * steps) * kPack<V>;
        if constexpr (V == kInt8) {
          std::memcpy(out, tk, k);                       // word s: k = 4s .. 4s + 3, in order
        } else {                                         // word 2s: k = 8s, 8s+2, 8s+4, 8s+6; 2s+1: the odd ones
          const __m128i evens_then_odds = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
          int64_t i = 0;
          for (; i + 16 <= k; i += 16)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 4),
                             _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tk + i)), evens_then_odds));
          for (; i < k; i += 8) {
            const int8_t b[8] = {tk[i], tk[i + 2], tk[i + 4], tk[i + 6], tk[i + 1], tk[i + 3], tk[i + 5], tk[i + 7]};
            std::memcpy(out + i / 4, b, 8);
          }
        }
      }
    }
    return true;
  }
};

#endif  // JAXENGINE_TILES

#ifdef JAXENGINE_VNNI
constexpr int64_t kPrefetchRows = 16;   // q rows read ahead of the loop
constexpr int64_t kWideColumns = 4096;  // from this many columns, the same rows' next columns instead
constexpr int64_t kPrefetchColumns = 512;

// 16 scales or offsets of a group as floats.
inline __m512 Scales16(const _Float16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 Scales16(const float* p) { return _mm512_loadu_ps(p); }

// Rows [row, row + 4) of q at columns [c, c + 16) as 16 words, word j holding column j's 4 bytes.
inline __m512i ColumnWords(const uint8_t* q, int64_t n, int64_t row, int64_t c) {
  const uint8_t* p = q + row * n + c;
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + n)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * n)), 2);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * n)), 3);
  // byte 4j + i of the result is row i's byte j: index 16 i + j
  const __m512i index = _mm512_set_epi8(
      63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42, 26, 10,
      57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
      51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
  return _mm512_permutexvar_epi8(index, v);
}

// acc[(r * kTerms + u) * stride] += a word of q (16 columns' 4 bytes; int4: two rows a byte, its
// nibbles) times row r's term u of x at ``step``, for rows [0, M).
template <int V, int M>
inline void MultiplyWord(const Activations<V>& a, __m512i bytes, int64_t step, __m512i* acc, int stride) {
  if constexpr (V == kInt4) {
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i low = _mm512_and_si512(bytes, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < kTerms; ++u) {
        const int32_t* xw = a.words.data() + ((r * kTerms + u) * a.steps + step) * 2;
        __m512i& sum = acc[(r * kTerms + u) * stride];
        sum = _mm512_dpbusd_epi32(sum, low, _mm512_set1_epi32(xw[0]));
        sum = _mm512_dpbusd_epi32(sum, high, _mm512_set1_epi32(xw[1]));
      }
  } else {
    const __m512i unsigned_bytes = _mm512_xor_si512(bytes, _mm512_set1_epi8(static_cast<char>(0x80)));   // q + 128
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < kTerms; ++u) {
        __m512i& sum = acc[(r * kTerms + u) * stride];
        sum = _mm512_dpbusd_epi32(sum, unsigned_bytes, _mm512_set1_epi32(a.words[(r * kTerms + u) * a.steps + step]));
      }
  }
}

// Row r's int32 sums of group g (its terms at acc[u * stride]) as x's part of the group's product:
// the terms recombined in float and times the row's unit for the group (int8: less the offset of 128).
template <int V>
inline __m512 GroupProduct(const Activations<V>& a, const __m512i* acc, int stride, int r, int64_t g) {
  __m512 v = _mm512_setzero_ps();
  for (int u = kTerms - 1; u >= 0; --u) {
    __m512i sum = acc[u * stride];
    if constexpr (V == kInt8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * a.qsum[(r * kTerms + u) * a.groups + g]));
    v = _mm512_fmadd_ps(v, _mm512_set1_ps(kTermScale), _mm512_cvtepi32_ps(sum));
  }
  return _mm512_mul_ps(v, _mm512_set1_ps(a.unit[r * a.groups + g]));
}

// out[0..M) x columns [c, c + 16 W) += group g's part: M x kTerms x W int32 sums in registers.
template <int V, int M, int W, typename S>
void VnniGroup(const Activations<V>& a, const Weights<S>& w, const float* sums, float* out, int64_t c, int64_t g) {
  const int64_t n = w.n, groups = a.groups, steps_per_group = w.group / kStepK<V>;
  __m512i acc[M][kTerms][W];
  for (int r = 0; r < M; ++r)
    for (int t = 0; t < kTerms; ++t)
      for (int j = 0; j < W; ++j) acc[r][t][j] = _mm512_setzero_si512();
  for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
    for (int j = 0; j < W; ++j) {
      if (j == 0) {
        if (n < kWideColumns)         // the rows 16 ahead, these columns (measured: 1.5x on K = 1536 at N = 576)
          for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(w.q + (4 * s + kPrefetchRows + i) * n + c), _MM_HINT_T0);
        else                          // a wide weight (an LM head): these rows, kPrefetchColumns ahead
          for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(w.q + (4 * s + i) * n + c + kPrefetchColumns), _MM_HINT_T0);
      }
      MultiplyWord<V, M>(a, ColumnWords(w.q, n, 4 * s, c + 16 * j), s, &acc[0][0][j], W);
    }
  }
  for (int j = 0; j < W; ++j) {
    const __m512 scale = Scales16(w.scale + g * n + c + 16 * j);
    const __m512 offset = w.offset != nullptr ? Scales16(w.offset + g * n + c + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < M; ++r) {
      float* o = out + r * n + c + 16 * j;
      __m512 res = _mm512_fmadd_ps(scale, GroupProduct<V>(a, &acc[r][0][j], W, r, g), _mm512_loadu_ps(o));
      if (w.offset != nullptr) res = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * groups + g]), res);
      _mm512_storeu_ps(o, res);
    }
  }
}

// Groups [g_first, g_last) of every 16-column tile of [first, last), group by group: the q rows of
// a group are read across the block's columns before the next group's, and each row's sums build
// up in out (set to 0 first). Returns the end of the tiles (the columns past it are left alone).
template <int V, int M, typename S>
int64_t VnniGroupsOf(const Activations<V>& a, const Weights<S>& w, const float* sums, float* out, int64_t first,
                     int64_t last, int64_t g_first, int64_t g_last) {
  constexpr int W = M >= 4 ? 1 : 4 / M;                 // 16-column tiles per pass: M x kTerms x W sums
  const int64_t end = first + (last - first) / 16 * 16;
  for (int r = 0; r < M; ++r) std::fill(out + r * w.n + first, out + r * w.n + end, 0.0f);
  for (int64_t g = g_first; g < g_last; ++g) {
    int64_t c = first;
    for (; c + 16 * W <= end; c += 16 * W) VnniGroup<V, M, W, S>(a, w, sums, out, c, g);
    for (; c < end; c += 16) VnniGroup<V, M, 1, S>(a, w, sums, out, c, g);
  }
  return end;
}

template <int V, typename S>
using VnniFn = int64_t (*)(const Activations<V>&, const Weights<S>&, const float*, float*, int64_t, int64_t, int64_t,
                           int64_t);

// VnniGroupsOf for m rows (1 <= m <= kFusedRows).
template <int V, typename S>
VnniFn<V, S> VnniGroupsFor(int64_t m) {
  static constexpr VnniFn<V, S> kByRows[kFusedRows] = {
      VnniGroupsOf<V, 1, S>, VnniGroupsOf<V, 2, S>, VnniGroupsOf<V, 3, S>, VnniGroupsOf<V, 4, S>,
      VnniGroupsOf<V, 5, S>, VnniGroupsOf<V, 6, S>, VnniGroupsOf<V, 7, S>, VnniGroupsOf<V, 8, S>};
  return kByRows[m - 1];
}

#endif  // JAXENGINE_VNNI

// x[0..n) summed in kLanes lanes (then the lanes, then the tail).
inline float GroupSum(const float* x, int64_t n) {
  Floats lanes = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) lanes += Load<Floats>(x + i);
  float s = 0.0f;
  for (int j = 0; j < kLanes; ++j) s += lanes[j];
  for (; i < n; ++i) s += x[i];
  return s;
}

// Whether a few rows' product with a row-major weight multiplies bytes (VNNI's VPERMB turns its rows
// into words as it goes); tiled weights are multiplied as bytes wherever JAXENGINE_TILES is.
#ifdef JAXENGINE_VNNI
constexpr bool kRowMajorBytes = true;
#else
constexpr bool kRowMajorBytes = false;
#endif

// What a few rows' product needs of x besides x, computed once per call: x summed over each group
// (the offsets' factor) and, where the product multiplies bytes (``as_bytes``), x's int8 terms.
template <int V>
struct FewRows {
  std::vector<float> sums;
#ifdef JAXENGINE_TILES
  Activations<V> bytes;
  bool has_bytes = false;
#endif

  bool AsBytes() const {
#ifdef JAXENGINE_TILES
    return has_bytes;
#else
    return false;
#endif
  }

  void Fill(const float* x, int64_t m, int64_t k, int64_t group, bool as_bytes = kRowMajorBytes) {
    const int64_t groups = k / group;
    sums.resize(m * groups);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups; ++g) sums[r * groups + g] = GroupSum(x + r * k + g * group, group);
#ifdef JAXENGINE_TILES
    has_bytes = as_bytes && V != kFp8 && group % kStepK<V> == 0 && bytes.Fill(x, m, k, group);
#endif
  }
};

// out[0..m) x [first, last) of x @ w, m <= kFusedRows.
template <int V, typename S>
void FusedColumns(const float* x, const Weights<S>& w, const FewRows<V>& rows, float* out, int64_t m, int64_t first,
                  int64_t last) {
  using Fn = void (*)(const float*, const Weights<S>&, const float*, float*, int64_t, int64_t);
  static constexpr Fn kByRows[kFusedRows] = {
      FusedColumnsOf<V, 1, S>, FusedColumnsOf<V, 2, S>, FusedColumnsOf<V, 3, S>, FusedColumnsOf<V, 4, S>,
      FusedColumnsOf<V, 5, S>, FusedColumnsOf<V, 6, S>, FusedColumnsOf<V, 7, S>, FusedColumnsOf<V, 8, S>};
#ifdef JAXENGINE_VNNI
  if (rows.has_bytes) {
    first = VnniGroupsFor<V, S>(m)(rows.bytes, w, rows.sums.data(), out, first, last, 0, rows.bytes.groups);
    if (first >= last) return;
  }
#endif
  kByRows[m - 1](x, w, rows.sums.data(), out, first, last);
}

// Columns [first, last) of w as f32 [K, last - first], 8 columns at a time where it can.
template <int V, typename S>
void Dequantize(const Weights<S>& w, float* buf, int64_t first, int64_t last) {
  const int64_t cols = last - first, n = w.n;
  for (int64_t kk = 0; kk < w.k; kk += kPack<V>) {
    const uint8_t* row = w.q + (kk / kPack<V>) * n + first;
    const S* s = w.scale + (kk / w.group) * n + first;
    const S* o = w.offset ? w.offset + (kk / w.group) * n + first : nullptr;
    float* b = buf + kk * cols;
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {
      Floats low, high;
      LoadValues<V>(row + c, &low, &high);
      const Floats sc = ScaleFloats(s + c), off = o ? ScaleFloats(o + c) : Floats{};
      const Floats lo = sc * low + off;
      std::memcpy(b + c, &lo, sizeof lo);
      if constexpr (kPack<V> == 2) {
        const Floats hi = sc * high + off;
        std::memcpy(b + cols + c, &hi, sizeof hi);
      }
    }
    for (; c < cols; ++c)
      for (int half = 0; half < kPack<V>; ++half)
        b[half * cols + c] = static_cast<float>(s[c]) * Value<V>(row[c], half) + (o ? static_cast<float>(o[c]) : 0.0f);
  }
}

// Columns [first, last) of out [m, n] = x [m, k] @ the weight's f32 values, a strip of
// jaxengine::kPanel columns at a time: ``dequantize(buf, c, end)`` writes columns [c, end) into a
// buffer of the thread's own ([k, end - c], in the core's cache), which cpu_gemm.h multiplies.
template <typename Fill>
void DequantizedProduct(const float* x, int64_t m, int64_t k, int64_t n, float* out, int64_t first, int64_t last,
                        Fill dequantize) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < k * jaxengine::kPanel) buf.resize(k * jaxengine::kPanel);
  for (int64_t c = first; c < last; c += jaxengine::kPanel) {
    const int64_t end = std::min(last, c + jaxengine::kPanel);
    dequantize(buf.data(), c, end);
    jaxengine::Gemm(x, k, m, k, buf.data(), end - c, end - c, out + c, n);
  }
}

// ``rows``: x's FewRows when m <= kFusedRows (nullptr: computed here).
template <int V, typename S>
void MultiplyColumns(const float* x, const Weights<S>& w, float* out, int64_t m, int64_t first, int64_t last,
                     const FewRows<V>* rows = nullptr) {
  if (last <= first) return;
  if (m <= kFusedRows) {
    if (rows != nullptr) return FusedColumns<V, S>(x, w, *rows, out, m, first, last);
    thread_local FewRows<V> own;
    own.Fill(x, m, w.k, w.group);
    return FusedColumns<V, S>(x, w, own, out, m, first, last);
  }
  DequantizedProduct(x, m, w.k, w.n, out, first, last,
                     [&](float* buf, int64_t c, int64_t end) { Dequantize<V, S>(w, buf, c, end); });
}

#ifdef JAXENGINE_VNNI
// outs[j] = x @ ws[j] for the few rows whose bytes ``rows`` holds (every n a multiple of 16), as one
// job for the calling thread and HotPool's helpers: each product's groups (rows of q) in contiguous
// chunks, so that each thread streams its own part of a weight front to back; a product's chunk 0
// sums into its output, the others into buffers added after. Under kSoloBytes of weights in all,
// the caller alone.
template <int V, typename S>
void BytesProducts(jaxengine::HotPool& hot, int64_t pool_threads, int64_t m, const FewRows<V>* rows,
                   const Weights<S>* ws, float* const* outs, int64_t count) {
  struct Part {
    int64_t product, chunk;
    float* out;
  };
  int64_t bytes = 0, buffered = 0;
  for (int64_t j = 0; j < count; ++j) bytes += ws[j].k / kPack<V> * ws[j].n;
  const int64_t threads = bytes < kSoloBytes ? 1 : pool_threads, groups = rows->bytes.groups;
  const int64_t chunks = std::min({groups, 2 * threads, kFewRowChunks});
  for (int64_t j = 0; j < count; ++j) buffered += (chunks - 1) * m * ws[j].n;
  thread_local std::vector<float> partial;
  thread_local std::vector<Part> parts;
  partial.resize(buffered);
  parts.clear();
  float* next = partial.data();
  for (int64_t j = 0; j < count; ++j)
    for (int64_t i = 0; i < chunks; ++i) {
      parts.push_back(Part{j, i, i == 0 ? outs[j] : next});
      if (i > 0) next += m * ws[j].n;
    }
  const Part* all = parts.data();               // (a lambda names a thread_local of its own thread: pass it)
  hot.Run(static_cast<int64_t>(parts.size()), [&, all](int64_t p) {
    const Part& part = all[p];
    const Weights<S>& w = ws[part.product];
    VnniGroupsFor<V, S>(m)(rows->bytes, w, rows->sums.data(), part.out, 0, w.n, part.chunk * groups / chunks,
                           (part.chunk + 1) * groups / chunks);
  });
  for (const Part& part : parts) {
    if (part.chunk == 0) continue;
    float* out = outs[part.product];
    for (int64_t j = 0; j < m * ws[part.product].n; j += 16)
      _mm512_storeu_ps(out + j, _mm512_add_ps(_mm512_loadu_ps(out + j), _mm512_loadu_ps(part.out + j)));
  }
}

#endif  // JAXENGINE_VNNI

#ifdef JAXENGINE_TILES
// ---------------------------------------------------------------- tiles: the decode layout
// A weight laid out for the products above, one block after the other in the order they are
// read: for each tile of 16 columns and each group of rows (``[N / 16][K / G][block]`` bytes per
// layer), the group's steps of 4 rows of q as the 64-byte words ColumnWords makes, then the
// group's 16 scales and, with an offset, its 16 offsets. A thread's share of a product (a run of
// tiles) is then one stream read front to back, and a tile's sums stay in registers across the
// groups, where the row-major layout reads 4 rows a step at N bytes apart and each group's scales
// from elsewhere (measured on the default model's projections: the row-major layout at about half
// of the machine's read bandwidth, the tiles near all of it).
template <typename S>
struct Tiles {
  const uint8_t* p;                      // this layer's blocks
  int64_t k, n, group, block;
  bool offset;
};

constexpr int64_t kTilePrefetch = 2560;  // bytes read ahead of a tile's stream (measured: 1280-5120 alike)

#ifdef JAXENGINE_VNNI
// Rows [0, M) x tiles [t_first, t_last) of x @ w, written whole.
template <int V, int M, typename S>
void TiledColumnsOf(const Activations<V>& a, const Tiles<S>& w, const float* sums, float* out, int64_t t_first,
                    int64_t t_last) {
  const int64_t groups = a.groups, steps_per_group = w.group / kStepK<V>;
  for (int64_t t = t_first; t < t_last; ++t) {
    const uint8_t* b = w.p + t * groups * w.block;
    __m512 res[M];
    for (int r = 0; r < M; ++r) res[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, b += w.block) {
      __m512i acc[M][kTerms];
      for (int r = 0; r < M; ++r)
        for (int u = 0; u < kTerms; ++u) acc[r][u] = _mm512_setzero_si512();
      for (int64_t s = 0; s < steps_per_group; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(b + kTilePrefetch + 64 * s), _MM_HINT_T0);
        MultiplyWord<V, M>(a, _mm512_loadu_si512(b + 64 * s), g * steps_per_group + s, &acc[0][0], 1);
      }
      const S* sc = reinterpret_cast<const S*>(b + steps_per_group * 64);
      const __m512 scale = Scales16(sc), offset = w.offset ? Scales16(sc + 16) : _mm512_setzero_ps();
      for (int r = 0; r < M; ++r) {
        res[r] = _mm512_fmadd_ps(scale, GroupProduct<V>(a, &acc[r][0], 1, r, g), res[r]);
        if (w.offset) res[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * groups + g]), res[r]);
      }
    }
    for (int r = 0; r < M; ++r) _mm512_storeu_ps(out + r * w.n + 16 * t, res[r]);
  }
}

#else
// AVX2 (no VPDPBUSD): a tile's word as two halves of 8 columns; VPMADDUBSW multiplies a half's
// unsigned bytes by 4 of x's signed ones into pairs of 16-bit sums and VPMADDWD adds the pairs into
// the columns' 32-bit sums. No pair overflows 16 bits: int4 values are 0..15 (the low and high
// nibbles' pairs added: at most 2 x 2 x 15 x 127), and int8 values go in as |q| with x taking q's
// sign (at most 2 x 128 x 127).
inline __m256 Scales8(const _Float16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 Scales8(const float* p) { return _mm256_loadu_ps(p); }

// acc[r * kTerms + u] += a half word (8 columns' 4 bytes) times row r's term u of x at ``step``.
template <int V, int M>
inline void MultiplyHalf(const Activations<V>& a, __m256i bytes, int64_t step, __m256i* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (V == kInt4) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i low = _mm256_and_si256(bytes, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < kTerms; ++u) {
        const int32_t* xw = a.words.data() + ((r * kTerms + u) * a.steps + step) * 2;
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(xw[0])),
                                               _mm256_maddubs_epi16(high, _mm256_set1_epi32(xw[1])));
        acc[r * kTerms + u] = _mm256_add_epi32(acc[r * kTerms + u], _mm256_madd_epi16(pairs, ones));
      }
  } else {
    const __m256i magnitude = _mm256_sign_epi8(bytes, bytes);                  // |q|, -128 as 128
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < kTerms; ++u) {
        const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(a.words[(r * kTerms + u) * a.steps + step]), bytes);
        acc[r * kTerms + u] = _mm256_add_epi32(acc[r * kTerms + u], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones));
      }
  }
}

// Row r's int32 sums of group g (its terms at acc[u]) as x's part of the group's product.
template <int V>
inline __m256 GroupProduct8(const Activations<V>& a, const __m256i* acc, int r, int64_t g) {
  __m256 v = _mm256_setzero_ps();
  for (int u = kTerms - 1; u >= 0; --u) v = _mm256_fmadd_ps(v, _mm256_set1_ps(kTermScale), _mm256_cvtepi32_ps(acc[u]));
  return _mm256_mul_ps(v, _mm256_set1_ps(a.unit[r * a.groups + g]));
}

// Rows [0, M) x tiles [t_first, t_last) of x @ w, written whole: each group's words a half at a time.
template <int V, int M, typename S>
void TiledColumnsOf(const Activations<V>& a, const Tiles<S>& w, const float* sums, float* out, int64_t t_first,
                    int64_t t_last) {
  const int64_t groups = a.groups, steps_per_group = w.group / kStepK<V>;
  for (int64_t t = t_first; t < t_last; ++t) {
    const uint8_t* b = w.p + t * groups * w.block;
    __m256 res[M][2];
    for (int r = 0; r < M; ++r) res[r][0] = res[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, b += w.block) {
      const S* sc = reinterpret_cast<const S*>(b + steps_per_group * 64);
      for (int h = 0; h < 2; ++h) {
        __m256i acc[M * kTerms];
        for (int i = 0; i < M * kTerms; ++i) acc[i] = _mm256_setzero_si256();
        for (int64_t s = 0; s < steps_per_group; ++s) {
          if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(b + kTilePrefetch + 64 * s), _MM_HINT_T0);
          MultiplyHalf<V, M>(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * s + 32 * h)),
                             g * steps_per_group + s, acc);
        }
        const __m256 scale = Scales8(sc + 8 * h), offset = w.offset ? Scales8(sc + 16 + 8 * h) : _mm256_setzero_ps();
        for (int r = 0; r < M; ++r) {
          res[r][h] = _mm256_fmadd_ps(scale, GroupProduct8<V>(a, acc + r * kTerms, r, g), res[r][h]);
          if (w.offset) res[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(sums[r * groups + g]), res[r][h]);
        }
      }
    }
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * w.n + 16 * t + 8 * h, res[r][h]);
  }
}
#endif

template <int V, typename S>
using TiledFn = void (*)(const Activations<V>&, const Tiles<S>&, const float*, float*, int64_t, int64_t);

template <int V, typename S>
TiledFn<V, S> TiledColumnsFor(int64_t m) {
  static constexpr TiledFn<V, S> kByRows[kFusedRows] = {
      TiledColumnsOf<V, 1, S>, TiledColumnsOf<V, 2, S>, TiledColumnsOf<V, 3, S>, TiledColumnsOf<V, 4, S>,
      TiledColumnsOf<V, 5, S>, TiledColumnsOf<V, 6, S>, TiledColumnsOf<V, 7, S>, TiledColumnsOf<V, 8, S>};
  return kByRows[m - 1];
}

#ifdef JAXENGINE_VNNI
// Columns [first, last) (multiples of 16) of a tiled w as f32 [K, last - first]: each word turned
// back into 4 rows of 16 bytes by one VPERMB.
template <int V, typename S>
void DequantizeTiles(const Tiles<S>& w, float* buf, int64_t first, int64_t last) {
  const int64_t cols = last - first, groups = w.k / w.group, steps_per_group = w.group / kStepK<V>;
  // byte 16 i + j of the result is word byte 4 j + i: row i, column j
  const __m512i rows = _mm512_set_epi8(
      63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3, 62, 58, 54, 50, 46, 42, 38, 34,
      30, 26, 22, 18, 14, 10, 6, 2, 61, 57, 53, 49, 45, 41, 37, 33, 29, 25, 21, 17, 13, 9, 5, 1,
      60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
  for (int64_t t = first / 16; t < last / 16; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* b = w.p + (t * groups + g) * w.block;
      const S* sc = reinterpret_cast<const S*>(b + steps_per_group * 64);
      const __m512 scale = Scales16(sc), offset = w.offset ? Scales16(sc + 16) : _mm512_setzero_ps();
      for (int64_t s = 0; s < steps_per_group; ++s) {
        alignas(64) uint8_t bytes[64];
        _mm512_store_si512(bytes, _mm512_permutexvar_epi8(rows, _mm512_loadu_si512(b + 64 * s)));
        for (int i = 0; i < 4; ++i) {
          const __m128i row = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes + 16 * i));
          const int64_t kk = (4 * (g * steps_per_group + s) + i) * kPack<V>;       // the row of w
          float* o = buf + kk * cols + (16 * t - first);
          if constexpr (V == kInt4) {
            const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(row, _mm_set1_epi8(15))));
            const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(row, 4), _mm_set1_epi8(15))));
            _mm512_storeu_ps(o, _mm512_fmadd_ps(scale, low, offset));
            _mm512_storeu_ps(o + cols, _mm512_fmadd_ps(scale, high, offset));
          } else {
            _mm512_storeu_ps(o, _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(row)), offset));
          }
        }
      }
    }
}

#else
// Columns [first, last) (multiples of 16) of a tiled w as f32 [K, last - first]: each word turned
// back into 4 rows of 16 bytes (a shuffle within each 4 columns, then a 4 x 4 transpose of their
// 32-bit parts).
template <int V, typename S>
void DequantizeTiles(const Tiles<S>& w, float* buf, int64_t first, int64_t last) {
  const int64_t cols = last - first, groups = w.k / w.group, steps_per_group = w.group / kStepK<V>;
  const __m128i by_row = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int64_t t = first / 16; t < last / 16; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* b = w.p + (t * groups + g) * w.block;
      const S* sc = reinterpret_cast<const S*>(b + steps_per_group * 64);
      const __m256 scale[2] = {Scales8(sc), Scales8(sc + 8)};
      const __m256 offset[2] = {w.offset ? Scales8(sc + 16) : _mm256_setzero_ps(),
                                w.offset ? Scales8(sc + 24) : _mm256_setzero_ps()};
      for (int64_t s = 0; s < steps_per_group; ++s) {
        __m128i y[4];                    // y[c]'s 32-bit part i: row i at columns 4c .. 4c + 3
        for (int c = 0; c < 4; ++c)
          y[c] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 * s + 16 * c)), by_row);
        const __m128i t0 = _mm_unpacklo_epi32(y[0], y[1]), t1 = _mm_unpackhi_epi32(y[0], y[1]);
        const __m128i t2 = _mm_unpacklo_epi32(y[2], y[3]), t3 = _mm_unpackhi_epi32(y[2], y[3]);
        const __m128i rows[4] = {_mm_unpacklo_epi64(t0, t2), _mm_unpackhi_epi64(t0, t2), _mm_unpacklo_epi64(t1, t3),
                                 _mm_unpackhi_epi64(t1, t3)};
        for (int i = 0; i < 4; ++i) {
          const int64_t kk = (4 * (g * steps_per_group + s) + i) * kPack<V>;       // the row of w
          float* o = buf + kk * cols + (16 * t - first);
          for (int h = 0; h < 2; ++h) {
            const __m128i eight = h == 0 ? rows[i] : _mm_unpackhi_epi64(rows[i], rows[i]);   // its columns 8h ..
            if constexpr (V == kInt4) {
              const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(eight, _mm_set1_epi8(15))));
              const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(eight, 4), _mm_set1_epi8(15))));
              _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(scale[h], low, offset[h]));
              _mm256_storeu_ps(o + cols + 8 * h, _mm256_fmadd_ps(scale[h], high, offset[h]));
            } else {
              _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(scale[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), offset[h]));
            }
          }
        }
      }
    }
}
#endif

// outs[j] = x @ ws[j] for m rows, every ws[j] tiled with the same k and group. A few rows whose
// bytes ``rows`` holds: each product's tiles in ``threads`` runs, one job for the calling thread
// and HotPool's helpers. Otherwise (more rows, or an inf or a NaN in x): each product's column
// blocks dequantised a strip at a time and multiplied (DequantizedProduct).
template <int V, typename S>
void TiledProducts(ffi::ThreadPool& pool, const float* xp, int64_t m, const Tiles<S>* ws, float* const* outs,
                   int64_t count) {
  const int64_t pool_threads = std::max<int64_t>(1, pool.num_threads());
  jaxengine::HotPool& hot = jaxengine::HotPool::Get(static_cast<int>(pool_threads) - 1);
  if (m <= kFusedRows) {
    thread_local FewRows<V> own;
    own.Fill(xp, m, ws[0].k, ws[0].group, true);
    if (own.AsBytes()) {
      const FewRows<V>* rows = &own;                    // (a lambda names a thread_local of its own thread: pass it)
      int64_t bytes = 0;
      for (int64_t j = 0; j < count; ++j) bytes += ws[j].k / kPack<V> * ws[j].n;
      const int64_t runs = bytes < kSoloBytes ? 1 : pool_threads;
      hot.Run(count * runs, [&, rows](int64_t p) {
        const Tiles<S>& w = ws[p / runs];
        const int64_t tiles = w.n / 16, run = p % runs;
        TiledColumnsFor<V, S>(m)(rows->bytes, w, rows->sums.data(), outs[p / runs], tiles * run / runs,
                                 tiles * (run + 1) / runs);
      });
      return;
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    const Tiles<S>& w = ws[j];
    int64_t blocks;
    const int64_t width = jaxengine::ColumnBlockWidth(w.n, pool_threads, &blocks);
    jaxengine::ParallelFor(pool, blocks, [&, width](int64_t b) {
      const int64_t first = std::min(w.n, b * width), last = std::min(w.n, (b + 1) * width);
      if (last <= first) return;
      DequantizedProduct(xp, m, w.k, w.n, outs[j], first, last,
                         [&](float* buf, int64_t c, int64_t end) { DequantizeTiles<V, S>(w, buf, c, end); });
    });
  }
}
#endif

// out [m, n] = x [m, k] @ w, shapes checked: a few rows by the fused loop, more by dequantised strips.
template <int V, typename S>
void Multiply(ffi::ThreadPool& pool, const float* xp, int64_t m, const Weights<S>& w, float* op) {
  const int64_t k = w.k, n = w.n;
  int64_t blocks;
  if (m <= kFusedRows) {
    // A few rows: shared by the calling thread and HotPool's helpers, which stay awake through a
    // decode step's many short products (a helper still asleep leaves its part to the caller);
    // as bytes in chunks of groups, else in column blocks (16-column aligned, two a thread, at
    // most kFewRowBlocks).
    thread_local FewRows<V> own;                      // (a lambda names a thread_local of its own thread: pass it)
    own.Fill(xp, m, k, w.group);
    const FewRows<V>* rows = &own;
    const int64_t pool_threads = std::max<int64_t>(1, pool.num_threads());
    jaxengine::HotPool& hot = jaxengine::HotPool::Get(static_cast<int>(pool_threads) - 1);
    const int64_t threads = k / kPack<V> * n < kSoloBytes ? 1 : pool_threads;      // 1: the caller alone
#ifdef JAXENGINE_VNNI
    if (own.AsBytes() && n % 16 == 0) return BytesProducts<V, S>(hot, pool_threads, m, rows, &w, &op, 1);
#endif
    const int64_t wanted = threads == 1 ? 1 : std::min<int64_t>(kFewRowBlocks, std::max<int64_t>(2 * threads, n / kFewRowColumns));
    const int64_t width = std::max<int64_t>(16, (n + wanted - 1) / wanted + 15) / 16 * 16;
    blocks = (n + width - 1) / width;
    hot.Run(blocks, [&, width](int64_t b) {
      MultiplyColumns<V, S>(xp, w, op, m, b * width, std::min(n, (b + 1) * width), rows);
    });
    return;
  }
  const int64_t width = jaxengine::ColumnBlockWidth(n, pool.num_threads(), &blocks);
  jaxengine::ParallelFor(pool, blocks, [&, width](int64_t b) {
    MultiplyColumns<V, S>(xp, w, op, m, std::min(n, b * width), std::min(n, (b + 1) * width));
  });
  return;
}

// Several products of the same x (a layer's q, k and v projections; its gate and up): x's terms
// are written once and the products' chunks shared by the threads in one job, where a few rows
// are multiplied as bytes; otherwise one product after the other.
template <int V, typename S>
void MultiplyMany(ffi::ThreadPool& pool, const float* xp, int64_t m, const std::vector<Weights<S>>& ws,
                  const std::vector<float*>& ops) {
#ifdef JAXENGINE_VNNI
  const bool alike = std::all_of(ws.begin(), ws.end(), [&](const Weights<S>& w) {
    return w.n % 16 == 0 && w.k == ws[0].k && w.group == ws[0].group;
  });
  if (m <= kFusedRows && alike) {
    thread_local FewRows<V> own;
    own.Fill(xp, m, ws[0].k, ws[0].group);
    if (own.AsBytes()) {
      const int64_t pool_threads = std::max<int64_t>(1, pool.num_threads());
      return BytesProducts<V, S>(jaxengine::HotPool::Get(static_cast<int>(pool_threads) - 1), pool_threads, m, &own,
                                 ws.data(), ops.data(), static_cast<int64_t>(ws.size()));
    }
  }
#endif
  for (size_t j = 0; j < ws.size(); ++j) Multiply<V, S>(pool, xp, m, ws[j], ops[j]);
}

template <int V, typename QBuffer, ffi::DataType SType, typename S>
ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, QBuffer q,
                               ffi::Buffer<SType> scale, ffi::Buffer<SType> offset,
                               ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu quantized matmul: x [M, K], q [L, K/P, N], scale [L, K/G, N], one layer");
  const int64_t m = xd[0], k = xd[1], n = qd[2], index = layer.typed_data()[0];
  const bool has_offset = offset.element_count() != 0;
  if (qd[1] * kPack<V> != k || sd[0] != qd[0] || sd[2] != n || sd[1] == 0 || k % sd[1] != 0 || (k / sd[1]) % kPack<V> != 0 ||
      (has_offset && offset.element_count() != scale.element_count()))
    return ffi::Error::InvalidArgument("cpu quantized matmul: the shapes of x, q, scale and offset disagree");
  if (index < 0 || index >= qd[0]) return ffi::Error::InvalidArgument("cpu quantized matmul: layer index out of range");
  if (m == 0 || n == 0) return ffi::Error::Success();
  const int64_t groups = sd[1];
  auto typed = [](void* p) { return static_cast<const S*>(p); };
  const Weights<S> w{static_cast<const uint8_t*>(q.untyped_data()) + index * (k / kPack<V>) * n,
                     typed(scale.untyped_data()) + index * groups * n,
                     has_offset ? typed(offset.untyped_data()) + index * groups * n : nullptr, k, n, k / groups};
  Multiply<V, S>(pool, x.typed_data(), m, w, out->typed_data());
  return ffi::Error::Success();
}

// The same products of one x by several weights of one format (args: q, scale, offset for each;
// one result each), their stacks read at the same layer.
template <int V, ffi::DataType SType, typename S>
ffi::Error QuantizedMatmulManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                                   ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto xd = x.dimensions();
  const size_t count = rets.size();
  if (xd.size() != 2 || layer.element_count() != 1 || count == 0 || args.size() != 3 * count)
    return ffi::Error::InvalidArgument("cpu quantized matmuls: x [M, K], one layer, then q, scale and offset per result");
  const int64_t m = xd[0], k = xd[1], index = layer.typed_data()[0];
  const ffi::DataType q_type = V == kInt8 ? ffi::DataType::S8 : ffi::DataType::U8;
  std::vector<Weights<S>> ws;
  std::vector<float*> ops;
  for (size_t j = 0; j < count; ++j) {
    auto q = args.get<ffi::AnyBuffer>(3 * j), scale = args.get<ffi::AnyBuffer>(3 * j + 1);
    auto offset = args.get<ffi::AnyBuffer>(3 * j + 2);
    auto out = rets.get<ffi::Buffer<ffi::F32>>(j);
    if (q.has_error() || scale.has_error() || offset.has_error() || out.has_error())
      return ffi::Error::InvalidArgument("cpu quantized matmuls: buffers expected");
    auto qd = q->dimensions(), sd = scale->dimensions(), od = (*out)->dimensions();
    const bool has_offset = offset->element_count() != 0;
    if (q->element_type() != q_type || scale->element_type() != SType ||
        (has_offset && (offset->element_type() != SType || offset->element_count() != scale->element_count())) ||
        qd.size() != 3 || sd.size() != 3 || od.size() != 2 || qd[1] * kPack<V> != k || sd[0] != qd[0] ||
        sd[2] != qd[2] || sd[1] == 0 || k % sd[1] != 0 || (k / sd[1]) % kPack<V> != 0 || od[0] != m || od[1] != qd[2])
      return ffi::Error::InvalidArgument("cpu quantized matmuls: the shapes or types of x, q, scale, offset and out disagree");
    if (index < 0 || index >= qd[0]) return ffi::Error::InvalidArgument("cpu quantized matmuls: layer index out of range");
    const int64_t n = qd[2], groups = sd[1];
    const S* sp = static_cast<const S*>(scale->untyped_data());
    ws.push_back(Weights<S>{static_cast<const uint8_t*>(q->untyped_data()) + index * (k / kPack<V>) * n,
                            sp + index * groups * n,
                            has_offset ? static_cast<const S*>(offset->untyped_data()) + index * groups * n : nullptr,
                            k, n, k / groups});
    ops.push_back((*out)->typed_data());
  }
  if (m == 0) return ffi::Error::Success();
  MultiplyMany<V, S>(pool, x.typed_data(), m, ws, ops);
  return ffi::Error::Success();
}


template <int V, typename QBuffer, ffi::DataType SType, typename S>
ffi::Error GroupedQuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, QBuffer q,
                                      ffi::Buffer<SType> scale, ffi::Buffer<SType> offset,
                                      ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> layer,
                                      ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 4 || sd.size() != 4 || layer.element_count() != 1 ||
      group_sizes.element_count() != static_cast<size_t>(qd[1]))
    return ffi::Error::InvalidArgument(
        "cpu grouped quantized matmul: x [M, K], q [L, E, K/P, N], scale [L, E, K/G, N], group_sizes [E], one layer");
  const int64_t m = xd[0], k = xd[1], experts = qd[1], n = qd[3], index = layer.typed_data()[0];
  const bool has_offset = offset.element_count() != 0;
  if (qd[2] * kPack<V> != k || sd[0] != qd[0] || sd[1] != experts || sd[3] != n || sd[2] == 0 || k % sd[2] != 0 ||
      (k / sd[2]) % kPack<V> != 0 || (has_offset && offset.element_count() != scale.element_count()))
    return ffi::Error::InvalidArgument("cpu grouped quantized matmul: the shapes of x, q, scale and offset disagree");
  if (index < 0 || index >= qd[0])
    return ffi::Error::InvalidArgument("cpu grouped quantized matmul: layer index out of range");
  std::vector<jaxengine::Group> groups;
  int64_t row;
  if (!jaxengine::RowGroups(group_sizes.typed_data(), experts, m, &groups, &row))
    return ffi::Error::InvalidArgument("cpu grouped quantized matmul: group sizes must be >= 0 and sum to at most M");
  float* op = out->typed_data();
  std::fill(op + row * n, op + m * n, 0.0f);
  if (groups.empty() || n == 0) return ffi::Error::Success();
  const int64_t num_groups = sd[2], per_expert_q = (k / kPack<V>) * n, per_expert_s = num_groups * n;
  auto typed = [](void* p) { return static_cast<const S*>(p); };
  const uint8_t* qp = static_cast<const uint8_t*>(q.untyped_data()) + index * experts * per_expert_q;
  const S* sp = typed(scale.untyped_data()) + index * experts * per_expert_s;
  const S* offp = has_offset ? typed(offset.untyped_data()) + index * experts * per_expert_s : nullptr;
  const float* xp = x.typed_data();
  jaxengine::ParallelForGroups(pool, groups, n, [&](const jaxengine::Group& g, int64_t first, int64_t last) {
    const Weights<S> w{qp + g.expert * per_expert_q, sp + g.expert * per_expert_s,
                       offp ? offp + g.expert * per_expert_s : nullptr, k, n, k / num_groups};
    MultiplyColumns<V, S>(xp + g.first_row * k, w, op + g.first_row * n, g.rows, first, last);
  });
  return ffi::Error::Success();
}


// Products of one x by several tiled weights of one format at one layer (args: each weight's
// tiles, uint8 [L, N / 16, K / G, block]; one result [M, N] each). Attributes: the values' bits
// (4, 8), the scales' bytes (2: float16, 4: float32), whether blocks hold offsets, and the group.
template <int V, typename S>
ffi::Error TiledMatmulsOf(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, int64_t index, bool offset, int64_t group,
                          ffi::RemainingArgs& args, ffi::RemainingRets& rets) {
#ifdef JAXENGINE_TILES
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], count = static_cast<int64_t>(rets.size());
  if (group <= 0 || k % group != 0 || group % kStepK<V> != 0)
    return ffi::Error::InvalidArgument("cpu tiled matmuls: the group must divide K and be a multiple of the step");
  const int64_t block = group / kStepK<V> * 64 + 16 * static_cast<int64_t>(sizeof(S)) * (offset ? 2 : 1);
  std::vector<Tiles<S>> ws;
  std::vector<float*> ops;
  for (int64_t j = 0; j < count; ++j) {
    auto tiles = args.get<ffi::Buffer<ffi::U8>>(j);
    auto out = rets.get<ffi::Buffer<ffi::F32>>(j);
    if (tiles.has_error() || out.has_error()) return ffi::Error::InvalidArgument("cpu tiled matmuls: uint8 tiles expected");
    auto td = tiles->dimensions(), od = (*out)->dimensions();
    if (td.size() != 4 || td[2] != k / group || td[3] != block || od.size() != 2 || od[0] != m || od[1] != 16 * td[1])
      return ffi::Error::InvalidArgument("cpu tiled matmuls: tiles [L, N / 16, K / G, block] and out [M, N] expected");
    if (index < 0 || index >= td[0]) return ffi::Error::InvalidArgument("cpu tiled matmuls: layer index out of range");
    ws.push_back(Tiles<S>{tiles->typed_data() + index * td[1] * td[2] * block, k, 16 * td[1], group, block, offset});
    ops.push_back((*out)->typed_data());
  }
  if (m > 0) TiledProducts<V, S>(pool, x.typed_data(), m, ws.data(), ops.data(), count);
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("cpu tiled matmuls: this CPU lacks AVX2 (tiles are not made for it)");
#endif
}

ffi::Error TiledMatmulsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, int64_t bits,
                            int64_t scale_bytes, bool offset, int64_t group, ffi::RemainingArgs args,
                            ffi::RemainingRets rets) {
  if (x.dimensions().size() != 2 || layer.element_count() != 1 || rets.size() == 0 || args.size() != rets.size())
    return ffi::Error::InvalidArgument("cpu tiled matmuls: x [M, K], one layer, then one weight's tiles per result");
  const int64_t index = layer.typed_data()[0];
  if (bits == 4 && scale_bytes == 2) return TiledMatmulsOf<kInt4, _Float16>(pool, x, index, offset, group, args, rets);
  if (bits == 4 && scale_bytes == 4) return TiledMatmulsOf<kInt4, float>(pool, x, index, offset, group, args, rets);
  if (bits == 8 && scale_bytes == 2) return TiledMatmulsOf<kInt8, _Float16>(pool, x, index, offset, group, args, rets);
  if (bits == 8 && scale_bytes == 4) return TiledMatmulsOf<kInt8, float>(pool, x, index, offset, group, args, rets);
  return ffi::Error::InvalidArgument("cpu tiled matmuls: int4 or int8 values with float16 or float32 scales");
}

}  // namespace

// int8 / int4 values, float16 scales (as GGUF stores them) or float32 ones; fp8 values, float32 scales
#define JAXENGINE_QUANTIZED_MATMUL(name, V, QType, SType, S)                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (QuantizedMatmulImpl<V, QType, SType, S>),            \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()                            \
                                    .Arg<QType>()                                           \
                                    .Arg<ffi::Buffer<SType>>()                               \
                                    .Arg<ffi::Buffer<SType>>()                               \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());

JAXENGINE_QUANTIZED_MATMUL(JaxengineCpuInt8Matmul, 1, ffi::Buffer<ffi::S8>, ffi::F16, _Float16)
JAXENGINE_QUANTIZED_MATMUL(JaxengineCpuInt4Matmul, 2, ffi::Buffer<ffi::U8>, ffi::F16, _Float16)
JAXENGINE_QUANTIZED_MATMUL(JaxengineCpuInt8MatmulF32, 1, ffi::Buffer<ffi::S8>, ffi::F32, float)
JAXENGINE_QUANTIZED_MATMUL(JaxengineCpuInt4MatmulF32, 2, ffi::Buffer<ffi::U8>, ffi::F32, float)
JAXENGINE_QUANTIZED_MATMUL(JaxengineCpuFp8Matmul, 3, ffi::AnyBuffer, ffi::F32, float)   // the FFI has no float8 Buffer<>

#define JAXENGINE_GROUPED_QUANTIZED_MATMUL(name, V, QType, SType, S)                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (GroupedQuantizedMatmulImpl<V, QType, SType, S>),     \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()                            \
                                    .Arg<QType>()                                           \
                                    .Arg<ffi::Buffer<SType>>()                               \
                                    .Arg<ffi::Buffer<SType>>()                               \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Ret<ffi::Buffer<ffi::F32>>());

JAXENGINE_GROUPED_QUANTIZED_MATMUL(JaxengineCpuGroupedInt8Matmul, 1, ffi::Buffer<ffi::S8>, ffi::F16, _Float16)
JAXENGINE_GROUPED_QUANTIZED_MATMUL(JaxengineCpuGroupedInt4Matmul, 2, ffi::Buffer<ffi::U8>, ffi::F16, _Float16)
JAXENGINE_GROUPED_QUANTIZED_MATMUL(JaxengineCpuGroupedInt8MatmulF32, 1, ffi::Buffer<ffi::S8>, ffi::F32, float)
JAXENGINE_GROUPED_QUANTIZED_MATMUL(JaxengineCpuGroupedInt4MatmulF32, 2, ffi::Buffer<ffi::U8>, ffi::F32, float)
JAXENGINE_GROUPED_QUANTIZED_MATMUL(JaxengineCpuGroupedFp8Matmul, 3, ffi::AnyBuffer, ffi::F32, float)

#define JAXENGINE_QUANTIZED_MATMULS(name, V, SType, S)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (QuantizedMatmulManyImpl<V, SType, S>),               \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .RemainingArgs()                                         \
                                    .RemainingRets());

JAXENGINE_QUANTIZED_MATMULS(JaxengineCpuInt8Matmuls, 1, ffi::F16, _Float16)
JAXENGINE_QUANTIZED_MATMULS(JaxengineCpuInt4Matmuls, 2, ffi::F16, _Float16)
JAXENGINE_QUANTIZED_MATMULS(JaxengineCpuInt8MatmulsF32, 1, ffi::F32, float)
JAXENGINE_QUANTIZED_MATMULS(JaxengineCpuInt4MatmulsF32, 2, ffi::F32, float)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuTiledMatmuls, TiledMatmulsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("scale_bytes")
                                  .Attr<bool>("offset")
                                  .Attr<int64_t>("group")
                                  .RemainingArgs()
                                  .RemainingRets());

// Lays ``layers`` weights out as tiles (``Tiles``): q [layers, rows, n] bytes (rows = K / P),
// scale and offset (nullptr: none) [layers, groups, n] of ``scale_bytes`` each, into out
// [layers, n / 16, groups, block]. Returns 0, or -1 where this build has no tiles or the shapes
// do not divide.
extern "C" int JaxengineCpuTile(const uint8_t* q, const uint8_t* scale, const uint8_t* offset, int64_t layers,
                                int64_t rows, int64_t n, int64_t groups, int64_t scale_bytes, uint8_t* out) {
#ifdef JAXENGINE_TILES
  if (n % 16 != 0 || groups <= 0 || rows % (4 * groups) != 0) return -1;
  const int64_t steps_per_group = rows / 4 / groups, sb = 16 * scale_bytes;
  const int64_t block = steps_per_group * 64 + sb * (offset ? 2 : 1);
  for (int64_t l = 0; l < layers; ++l) {
    const uint8_t* ql = q + l * rows * n;
    for (int64_t t = 0; t < n / 16; ++t)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* b = out + ((l * (n / 16) + t) * groups + g) * block;
        for (int64_t s = 0; s < steps_per_group; ++s) {
#ifdef JAXENGINE_VNNI
          _mm512_storeu_si512(b + 64 * s, ColumnWords(ql, n, 4 * (g * steps_per_group + s), 16 * t));
#else
          for (int64_t j = 0; j < 16; ++j)      // byte 4 j + i: row i's byte of column j
            for (int64_t i = 0; i < 4; ++i) b[64 * s + 4 * j + i] = ql[(4 * (g * steps_per_group + s) + i) * n + 16 * t + j];
#endif
        }
        const int64_t at = ((l * groups + g) * n + 16 * t) * scale_bytes;
        std::memcpy(b + steps_per_group * 64, scale + at, sb);
        if (offset) std::memcpy(b + steps_per_group * 64 + sb, offset + at, sb);
      }
  }
  return 0;
#else
  return -1;
#endif
}

// 1 where this build multiplies tiled weights as bytes (AVX-512 VNNI and VBMI, or AVX2): the tiled
// layout serves only there.
extern "C" int JaxengineCpuTiles() {
#ifdef JAXENGINE_TILES
  return 1;
#else
  return 0;
#endif
}
