// bf16-weight linear for few rows (registered as torch.ops.neuron_opt.bf16_linear, built with paged_attention.cpp
// by neuron_opt/backends/cpu_ops.py; docs/cpu_backend.md, "bf16 one-row GEMMs on a C++ operator").
//
// x [M, K] float32 or bfloat16, ws a list of bf16 weights [N_i, K] (one row per output feature, as the model holds
// them: no packing); returns y [M, sum N_i] float32, the outputs of the weights side by side (q/k/v or gate/up in
// one call, like a fused GEMM, with no concatenated copy of the weights), y[m, n] = sum_k x[m, k] * w[n, k] in fp32.
//
// For decode (M = 1 to a few rows) the cost is reading the weights. Two paths, chosen per call from the CPU and
// x's dtype (never from M, so a row's result does not depend on M or on which rows or weights share the call):
// - "avx512_bf16": bf16 x on a CPU with avx512_bf16. VDPBF16PS multiplies 32 bf16 pairs of x and a weight row and
//   adds them into 16 fp32 lanes (each product exact in fp32; inputs and results below fp32's normal range are
//   taken as zero), a chain over k in 32-element steps, the last step masked, then a fixed horizontal sum.
// - "fma": every other case (fp32 x, AVX2 or AVX-512 without bf16 dot products): gemv_tiles.h's loop, each group
//   of W weights widened to fp32 (a shift) and multiplied into every row of x with FMAs, a bf16 row of x widened
//   exactly. The int8 operator runs the same loop.
// Both keep four output features in flight, prefetch the weight stream ahead, and split the work across threads by
// output features only (tiles of four features, none spanning two weights).
#include <torch/extension.h>
#include <c10/util/BFloat16.h>

#include <string>

#include "gemv_tiles.h"

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#define NEURON_OPT_DPBF16 1
#endif

namespace {

using neuron_opt_gemv::LINE;
using neuron_opt_gemv::MR;
using neuron_opt_gemv::NR;
using neuron_opt_gemv::PF_DIST;
using neuron_opt_gemv::Vec;
using BF16 = c10::BFloat16;
using Seg = neuron_opt_gemv::Segment<BF16>;

struct WidenBF16 {
  static inline Vec load(const BF16* p) {
    Vec out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
  }
  static inline float scalar(BF16 v) { return static_cast<float>(v); }
};

constexpr const char* kDot = "avx512_bf16";
constexpr const char* kFma = "fma";

#ifdef NEURON_OPT_DPBF16
#define NEURON_OPT_DPBF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
constexpr int64_t KB = 32;  // bf16 elements per 512-bit step

bool dot_runs() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
}

// features [n0, n0 + nn) of `s` for rows [m0, m0 + MM) of the bf16 x
template <int64_t MM>
NEURON_OPT_DPBF16_TARGET inline void tile_dot(const BF16* xb, const Seg& s, float* y, int64_t K, int64_t ldy,
                                              int64_t n0, int64_t nn, int64_t m0) {
  __m512 acc[MM][NR];
  for (int64_t m = 0; m < MM; ++m)
    for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  const BF16* wr[NR];
  for (int64_t j = 0; j < NR; ++j) wr[j] = s.w + (n0 + std::min(j, nn - 1)) * K;  // a short tile repeats its last row
  const char* stream = reinterpret_cast<const char*>(s.w + n0 * K) + PF_DIST;  // the tile's rows, read in order
  const int64_t Kb = K / KB * KB;
  for (int64_t k = 0; k < Kb; k += KB) {
    const char* p = stream + k * NR * 2;
    for (int64_t b = 0; b < NR * KB * 2; b += LINE) __builtin_prefetch(p + b, 0, 1);
    __m512bh wv[NR];
    for (int64_t j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
    for (int64_t m = 0; m < MM; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (m0 + m) * K + k);
      for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  if (Kb < K) {  // the last K - Kb < 32 elements, the rest of the step zero in both operands
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - Kb)) - 1);
    __m512bh wv[NR];
    for (int64_t j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[j] + Kb);
    for (int64_t m = 0; m < MM; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + (m0 + m) * K + Kb);
      for (int64_t j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int64_t m = 0; m < MM; ++m)
    for (int64_t j = 0; j < nn; ++j) y[(m0 + m) * ldy + s.c0 + n0 + j] = _mm512_reduce_add_ps(acc[m][j]);
}

// tiles [lo, hi) of the segments (neuron_opt_gemv::for_tiles's order)
NEURON_OPT_DPBF16_TARGET void tiles_dot(const BF16* xb, const std::vector<Seg>& segs, float* y, int64_t M, int64_t K,
                                        int64_t ldy, int64_t lo, int64_t hi) {
  int64_t first = 0;
  for (const Seg& s : segs) {
    const int64_t count = (s.N + NR - 1) / NR;
    for (int64_t t = std::max(lo, first); t < std::min(hi, first + count); ++t) {
      const int64_t n0 = (t - first) * NR, nn = std::min(NR, s.N - n0);
      int64_t m0 = 0;
      for (; m0 + MR <= M; m0 += MR) tile_dot<MR>(xb, s, y, K, ldy, n0, nn, m0);
      switch (M - m0) {
        case 3: tile_dot<3>(xb, s, y, K, ldy, n0, nn, m0); break;
        case 2: tile_dot<2>(xb, s, y, K, ldy, n0, nn, m0); break;
        case 1: tile_dot<1>(xb, s, y, K, ldy, n0, nn, m0); break;
        default: break;
      }
    }
    first += count;
  }
}
#else
bool dot_runs() { return false; }
#endif

// the paths this machine runs for an x of `dtype`, the default first
std::vector<std::string> paths_for(at::ScalarType dtype) {
  std::vector<std::string> out;
  if (dtype == at::kBFloat16 && dot_runs()) out.push_back(kDot);
  out.push_back(kFma);
  return out;
}

at::Tensor linear(const at::Tensor& x, at::TensorList ws, bool dot) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_linear: x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!ws.empty(), "bf16_linear: no weights");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> wc;
  std::vector<Seg> segs;
  int64_t Ny = 0;
  for (const auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_linear: weights must be bfloat16 [N, K], got ",
                w.scalar_type(), " ", w.sizes());
    TORCH_CHECK(w.size(1) == K, "bf16_linear: x has ", K, " input features, a weight has ", w.size(1));
    wc.push_back(w.contiguous());
    segs.push_back({wc.back().data_ptr<BF16>(), nullptr, w.size(0), Ny});
    Ny += w.size(0);
  }
  at::Tensor y = at::empty({M, Ny}, x.options().dtype(at::kFloat));
  if (M == 0 || Ny == 0) return y;
  float* yp = y.data_ptr<float>();
#ifdef NEURON_OPT_DPBF16
  if (dot) {
    const at::Tensor xb = x.contiguous();
    const BF16* xp = xb.data_ptr<BF16>();
    at::parallel_for(0, neuron_opt_gemv::tile_count(segs), neuron_opt_gemv::tile_grain<BF16>(K),
                     [&](int64_t lo, int64_t hi) { tiles_dot(xp, segs, yp, M, K, Ny, lo, hi); });
    return y;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  neuron_opt_gemv::run<BF16, WidenBF16>(xf.data_ptr<float>(), segs, yp, M, K, Ny);
  return y;
}

}  // namespace

at::Tensor bf16_linear(const at::Tensor& x, at::TensorList ws) {
  return linear(x, ws, x.scalar_type() == at::kBFloat16 && dot_runs());
}

// the same product on a named path (tests and benchmarks compare the paths on one machine)
at::Tensor bf16_linear_path(const at::Tensor& x, at::TensorList ws, c10::string_view path) {
  const std::string p(path.data(), path.size());
  const bool dot = p == kDot;
  TORCH_CHECK(dot || p == kFma, "bf16_linear_path: path must be ", kDot, " or ", kFma, ", got '", p, "'");
  TORCH_CHECK(!dot || x.scalar_type() == at::kBFloat16, "bf16_linear_path: path ", kDot, " takes a bfloat16 x, got ",
              x.scalar_type());
  TORCH_CHECK(!dot || dot_runs(), "bf16_linear_path: path ", kDot, " does not run on this CPU (it needs avx512_bf16)");
  return linear(x, ws, dot);
}

// the paths this CPU runs for an x like `x`, the one bf16_linear takes first
std::vector<std::string> bf16_linear_paths(const at::Tensor& x) { return paths_for(x.scalar_type()); }

TORCH_LIBRARY_FRAGMENT(neuron_opt, m) {
  m.def("bf16_linear(Tensor x, Tensor[] ws) -> Tensor");
  m.def("bf16_linear_path(Tensor x, Tensor[] ws, str path) -> Tensor");
  m.def("bf16_linear_paths(Tensor x) -> str[]");
}
TORCH_LIBRARY_IMPL(neuron_opt, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_linear_path", &bf16_linear_path);
  m.impl("bf16_linear_paths", &bf16_linear_paths);
}
