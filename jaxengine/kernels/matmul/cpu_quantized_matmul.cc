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
// More rows (a prefill): each thread dequantises its column block to f32 once and hands it to
// OpenBLAS's sgemm, whose blocking serves many rows better than the loop above.
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
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cblas.h"
#include "cpu_pool.h"
#include "fp8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kFusedRows = 8;        // up to this many rows: the fused loop, else dequantise + sgemm

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

// out[0..m) x [first, last) of x @ w, m <= kFusedRows.
template <int V, typename S>
void FusedColumns(const float* x, const Weights<S>& w, float* out, int64_t m, int64_t first, int64_t last) {
  const int64_t groups = w.k / w.group;
  std::vector<float> sums(m * groups, 0.0f);          // x summed over each group (the offsets' factor)
  for (int64_t r = 0; r < m; ++r)
    for (int64_t kk = 0; kk < w.k; ++kk) sums[r * groups + kk / w.group] += x[r * w.k + kk];
  using Fn = void (*)(const float*, const Weights<S>&, const float*, float*, int64_t, int64_t);
  static constexpr Fn kByRows[kFusedRows] = {
      FusedColumnsOf<V, 1, S>, FusedColumnsOf<V, 2, S>, FusedColumnsOf<V, 3, S>, FusedColumnsOf<V, 4, S>,
      FusedColumnsOf<V, 5, S>, FusedColumnsOf<V, 6, S>, FusedColumnsOf<V, 7, S>, FusedColumnsOf<V, 8, S>};
  kByRows[m - 1](x, w, sums.data(), out, first, last);
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

template <int V, typename S>
void MultiplyColumns(const float* x, const Weights<S>& w, float* out, int64_t m, int64_t first, int64_t last) {
  if (last <= first) return;
  if (m <= kFusedRows) return FusedColumns<V, S>(x, w, out, m, first, last);
  thread_local std::vector<float> buf;
  buf.resize(w.k * (last - first));
  Dequantize<V, S>(w, buf.data(), first, last);
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, last - first, w.k, 1.0f, x, w.k, buf.data(),
                    last - first, 0.0f, out + first, w.n);
}

void SetSingleThreaded() {
  static std::once_flag once;
  std::call_once(once, [] { scipy_openblas_set_num_threads(1); });
}

template <int V, typename QBuffer, ffi::DataType SType, typename S>
ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, QBuffer q,
                               ffi::Buffer<SType> scale, ffi::Buffer<SType> offset,
                               ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  SetSingleThreaded();
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
  int64_t blocks;
  const int64_t width = jaxengine::ColumnBlockWidth(n, pool.num_threads(), &blocks);
  const float* xp = x.typed_data();
  float* op = out->typed_data();
  jaxengine::ParallelFor(pool, blocks, [&, width](int64_t b) {
    MultiplyColumns<V, S>(xp, w, op, m, std::min(n, b * width), std::min(n, (b + 1) * width));
  });
  return ffi::Error::Success();
}


template <int V, typename QBuffer, ffi::DataType SType, typename S>
ffi::Error GroupedQuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, QBuffer q,
                                      ffi::Buffer<SType> scale, ffi::Buffer<SType> offset,
                                      ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> layer,
                                      ffi::ResultBuffer<ffi::F32> out) {
  SetSingleThreaded();
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
