// A dense f32 matmul on the CPU through OpenBLAS (the scipy-openblas32 build), called from XLA
// through the FFI. XLA's own CPU dot runs a step's skinny matmuls (a few to a few dozen token rows
// against a weight matrix) at a third to a half of OpenBLAS's speed on the same core
// (BENCHMARKS.md, "the matmuls of a step through OpenBLAS"). The output's columns are cut into
// one block per thread of XLA's intra-op pool, and each block is one single-threaded OpenBLAS
// call, so OpenBLAS starts no threads of its own to compete with XLA's.
//
// Shapes: x [M, K], w [L, K, N] (the weights of every layer, stacked as the model's layer scan
// holds them), layer [] or [1], out [M, N] = x @ w[layer]. Taking the stack and the index, not the
// layer's slice, reads the weights where they lie: inside the scan a slice is a copy of them.
// One row is a matrix-vector product (OpenBLAS's gemv).
//
// The grouped matmul of a mixture-of-experts layer: x [M, K] with its rows sorted by expert,
// w [L, E, K, N], group_sizes [E] (rows of each expert, in order), layer as above; out [M, N],
// rows of group e times w[layer, e], rows past the groups zero (padding, routed nowhere). Only
// the experts some row chose are read, each once. XLA's CPU lowering of ragged_dot multiplies
// every row by every expert instead.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "cblas.h"
#include "cpu_gemm.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kFewRows = 8;           // up to this many rows: MultiplyFewRows, not sgemm

// A few rows (an expert's share of a decode step): w streamed once, each group of four of its rows
// added into every output row, which stay in the L1 cache. OpenBLAS's sgemm packs w into a buffer
// first, which for a few rows costs as much again as the product.
void MultiplyFewRows(const float* x, const float* w, float* out, int64_t m, int64_t k, int64_t n,
                     int64_t first, int64_t last) {
  for (int64_t r = 0; r < m; ++r) std::fill(out + r * n + first, out + r * n + last, 0.0f);
  int64_t kk = 0;
  for (; kk + 4 <= k; kk += 4) {
    const float *w0 = w + kk * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k + kk;
      const float a0 = xr[0], a1 = xr[1], a2 = xr[2], a3 = xr[3];
      float* o = out + r * n;
      for (int64_t c = first; c < last; ++c) o[c] += a0 * w0[c] + a1 * w1[c] + a2 * w2[c] + a3 * w3[c];
    }
  }
  for (; kk < k; ++kk)
    for (int64_t r = 0; r < m; ++r) {
      const float a = x[r * k + kk];
      const float* wr = w + kk * n;
      float* o = out + r * n;
      for (int64_t c = first; c < last; ++c) o[c] += a * wr[c];
    }
}

void MultiplyColumns(const float* x, const float* w, float* out, int64_t m, int64_t k, int64_t n,
                     int64_t first, int64_t last) {
  const int64_t cols = last - first;
  if (cols <= 0) return;
  const float* block = w + first;           // columns first..last of w [K, N]
  if (m > 1 && m <= kFewRows)
    MultiplyFewRows(x, w, out, m, k, n, first, last);
  else if (m == 1)
    scipy_cblas_sgemv(CblasRowMajor, CblasTrans, k, cols, 1.0f, block, n, x, 1, 0.0f, out + first, 1);
  else
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, cols, k, 1.0f, x, k, block, n, 0.0f,
                      out + first, n);
}

void SetSingleThreaded() {
  static std::once_flag once;
  std::call_once(once, [] { scipy_openblas_set_num_threads(1); });
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  SetSingleThreaded();
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu matmul: x [M, K], w [L, K, N] and one layer index");
  const int64_t m = xd[0], k = xd[1], n = wd[2], index = layer.typed_data()[0];
  if (wd[1] != k)
    return ffi::Error::InvalidArgument("cpu matmul: the contracted sizes of x and w differ");
  if (index < 0 || index >= wd[0]) return ffi::Error::InvalidArgument("cpu matmul: layer index out of range");
  if (m == 0 || n == 0) return ffi::Error::Success();
  int64_t blocks;
  const int64_t width = jaxengine::ColumnBlockWidth(n, pool.num_threads(), &blocks);
  const float *xp = x.typed_data(), *wp = w.typed_data() + index * k * n;
  float* op = out->typed_data();
  jaxengine::ParallelFor(pool, blocks, [=](int64_t b) {
    MultiplyColumns(xp, wp, op, m, k, n, std::min(n, b * width), std::min(n, (b + 1) * width));
  });
  return ffi::Error::Success();
}

ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> out) {
  SetSingleThreaded();
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || layer.element_count() != 1 ||
      group_sizes.element_count() != static_cast<size_t>(wd[1]))
    return ffi::Error::InvalidArgument(
        "cpu grouped matmul: x [M, K], w [L, E, K, N], group_sizes [E] and one layer index");
  const int64_t m = xd[0], k = xd[1], experts = wd[1], n = wd[3], index = layer.typed_data()[0];
  if (wd[2] != k) return ffi::Error::InvalidArgument("cpu grouped matmul: the contracted sizes of x and w differ");
  if (index < 0 || index >= wd[0])
    return ffi::Error::InvalidArgument("cpu grouped matmul: layer index out of range");
  std::vector<jaxengine::Group> groups;
  int64_t row;
  if (!jaxengine::RowGroups(group_sizes.typed_data(), experts, m, &groups, &row))
    return ffi::Error::InvalidArgument("cpu grouped matmul: group sizes must be >= 0 and sum to at most M");
  float* op = out->typed_data();
  std::fill(op + row * n, op + m * n, 0.0f);
  if (groups.empty() || n == 0) return ffi::Error::Success();
  const float *xp = x.typed_data(), *wp = w.typed_data() + index * experts * k * n;
  jaxengine::ParallelForGroups(pool, groups, n, [&](const jaxengine::Group& g, int64_t first, int64_t last) {
    MultiplyColumns(xp + g.first_row * k, wp + g.expert * k * n, op + g.first_row * n, g.rows, k, n, first, last);
  });
  return ffi::Error::Success();
}

// x [M, K] @ panels[layer], panels [L, S, K, kPanel]: a weight [K, S * kPanel] laid out as strips
// of kPanel columns, each strip's K rows one contiguous block (``PanelWeight``). The threads take
// contiguous runs of strips, so each streams its part of the weight front to back.
ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 4 || pd[3] != jaxengine::kPanel || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu panel matmul: x [M, K], panels [L, S, K, 32] and one layer index");
  const int64_t m = xd[0], k = xd[1], strips = pd[1], index = layer.typed_data()[0];
  if (pd[2] != k) return ffi::Error::InvalidArgument("cpu panel matmul: the contracted sizes of x and w differ");
  if (index < 0 || index >= pd[0])
    return ffi::Error::InvalidArgument("cpu panel matmul: layer index out of range");
  if (m == 0 || strips == 0) return ffi::Error::Success();
  const int64_t n = strips * jaxengine::kPanel, strip_size = k * jaxengine::kPanel;
  const float *xp = x.typed_data(), *wp = panels.typed_data() + index * strips * strip_size;
  float* op = out->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto strips_of = [=](int64_t blocks) {
    const int64_t per = (strips + blocks - 1) / blocks;
    return [=](int64_t b) {
      const int64_t end = std::min(strips, (b + 1) * per);
      for (int64_t s = b * per; s < end; ++s)              // each strip prefetches the thread's next one
        jaxengine::Gemm(xp, k, m, k, wp + s * strip_size, jaxengine::kPanel, jaxengine::kPanel,
                        op + s * jaxengine::kPanel, n, s + 1 < end ? wp + (s + 1) * strip_size : nullptr,
                        strip_size);
    };
  };
  if (m <= kFewRows) {
    // A decode's few rows: a step makes hundreds of these short products, so they go to HotPool's
    // helpers, which stay awake between them (waking one of XLA's pool threads costs a good part of
    // such a product), in two blocks of strips a thread.
    const int64_t blocks = std::min<int64_t>(strips, 2 * threads);
    jaxengine::HotPool::Get(static_cast<int>(threads) - 1).Run(blocks, strips_of(blocks));
    return ffi::Error::Success();
  }
  const int64_t blocks = std::min<int64_t>(threads, strips);
  jaxengine::ParallelFor(pool, blocks, strips_of(blocks));
  return ffi::Error::Success();
}

// x, a weight (row-major or panels), the layer index -> out: the dense products' arguments.
auto DenseBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuMatmul, MatmulImpl, DenseBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxengineCpuPanelMatmul, PanelMatmulImpl, DenseBinding());
