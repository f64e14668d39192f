// Weight-only int8 linear for few rows (registered as torch.ops.neuron_opt.int8_linear, built with
// paged_attention.cpp by neuron_opt/backends/cpu_ops.py; docs/quantization.md, "How each backend computes").
//
// x [M, K] float32 or bfloat16, w [N, K] int8 (one row per output feature, as stored), scale [N] float32 or
// bfloat16; returns y [M, N] float32 with y[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n], the sum in fp32.
//
// For decode (M = 1 to a few rows) the cost is reading w: each group of W int8 weights is widened to fp32 once
// (sign-extend, convert) and multiplied into every row of x, FMA chains with four output features in flight
// (gemv_tiles.h, the tile loop bf16_linear.cpp shares). A row's result does not depend on M or on which rows share
// the call: every (m, n) is one chain of FMAs over k = 0..K-1 in W-lane steps, then a fixed horizontal sum, then the
// scale. So a speculative verify step's rows are bitwise the decode step's. Work is split across threads by output
// features only.
//
// int8_linear_widened (torch.ops.neuron_opt.int8_linear_widened, same arguments and result) is the many-row
// product of prefills: see its comment below.
#include <torch/extension.h>

#include "gemv_tiles.h"

namespace {

using neuron_opt_gemv::Vec;
using neuron_opt_gemv::W;

struct WidenI8 {
  // W int8 values at p, widened to fp32
  static inline Vec load(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    return at::vec::convert<float>(at::vec::convert_to_int32<int8_t>(p));
#else
    float buf[W];
    for (int64_t i = 0; i < W; ++i) buf[i] = static_cast<float>(p[i]);
    return Vec::loadu(buf);
#endif
  }
  static inline float scalar(int8_t v) { return static_cast<float>(v); }
};

}  // namespace

static void check_args(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, op, ": w must be int8 [N, K], got ", w.scalar_type(), " ",
              w.sizes());
  TORCH_CHECK(w.size(1) == x.size(1), op, ": x has ", x.size(1), " input features, w has ", w.size(1));
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              op, ": scale must be float32 or bfloat16 [N] with N = ", w.size(0), ", got ", scale.scalar_type(), " ",
              scale.sizes());
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check_args("int8_linear", x, w, scale);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wc = w.contiguous();
  const at::Tensor sc = scale.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const std::vector<neuron_opt_gemv::Segment<int8_t>> segs{{wc.data_ptr<int8_t>(), sc.data_ptr<float>(), N, 0}};
  neuron_opt_gemv::run<int8_t, WidenI8>(xf.data_ptr<float>(), segs, y.data_ptr<float>(), M, K, N);
  return y;
}

// Many rows (a prefill): W widened to x's dtype once per call (int8 values are exact in bf16), then one aten GEMM
// over every row (oneDNN's, with fp32 accumulation), scaled per output feature in fp32. Widening costs N * K
// conversions, against M * N * K multiply-adds that run at the bf16 GEMM's speed instead of the per-row one.
at::Tensor int8_linear_widened(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check_args("int8_linear_widened", x, w, scale);
  const at::Tensor y = at::linear(x.contiguous(), w.to(x.scalar_type()));
  return y.to(at::kFloat).mul_(scale.to(at::kFloat));
}

TORCH_LIBRARY_FRAGMENT(neuron_opt, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_linear_widened(Tensor x, Tensor w, Tensor scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(neuron_opt, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_widened", &int8_linear_widened);
}
