// Weight-only int8 linear for few rows (registered as torch.ops.neuron_opt.int8_linear, built with
// paged_attention.cpp by neuron_opt/backends/cpu_ops.py; docs/quantization.md, "How each backend computes").
//
// x [M, K] float32 or bfloat16, w [N, K] int8 (one row per output feature, as stored), scale [N] float32 or
// bfloat16; returns y [M, N] float32 with y[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n], the sum in fp32.
//
// For decode (M = 1 to a few rows) the cost is reading w: each group of W int8 weights is widened to fp32 once
// (sign-extend, convert) and multiplied into every row of x, FMA chains with four output features in flight.
// A row's result does not depend on M or on which rows share the call: every (m, n) is one chain of FMAs over
// k = 0..K-1 in W-lane steps, then a fixed horizontal sum, then the scale. So a speculative verify step's rows
// are bitwise the decode step's. Work is split across threads by output features only.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t NR = 4;  // output features per pass
constexpr int64_t MR = 4;  // rows of x per pass
constexpr int64_t PF_DIST = 16384;  // bytes ahead; prefetcht2 (docs/quantization.md: the sweep over both)

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// W int8 values at p, widened to fp32
inline Vec load_i8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return at::vec::convert<float>(at::vec::convert_to_int32<int8_t>(p));
#else
  float buf[W];
  for (int64_t i = 0; i < W; ++i) buf[i] = static_cast<float>(p[i]);
  return Vec::loadu(buf);
#endif
}

// rows [n0, n0 + nn) of y for rows [m0, m0 + mm) of x (nn <= NR, mm <= MR); Kv = K rounded down to W
template <int64_t MM>
inline void tile(const float* xf, const int8_t* w, const float* sc, float* y, int64_t K, int64_t Kv, int64_t N,
                 int64_t n0, int64_t nn, int64_t m0) {
  Vec acc[MM][NR];
  for (int64_t m = 0; m < MM; ++m)
    for (int64_t j = 0; j < NR; ++j) acc[m][j] = Vec(0.f);
  const int8_t* wr[NR];
  for (int64_t j = 0; j < NR; ++j) wr[j] = w + (n0 + std::min(j, nn - 1)) * K;  // a short tile repeats its last row
  const char* stream = reinterpret_cast<const char*>(w + n0 * K) + PF_DIST;  // the tile's rows, read in order
  for (int64_t k = 0; k < Kv; k += W) {
    __builtin_prefetch(stream + k * NR, 0, 1);
    Vec wv[NR];
    for (int64_t j = 0; j < NR; ++j) wv[j] = load_i8(wr[j] + k);
    for (int64_t m = 0; m < MM; ++m) {
      const Vec xv = Vec::loadu(xf + (m0 + m) * K + k);
      for (int64_t j = 0; j < NR; ++j) acc[m][j] = at::vec::fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int64_t m = 0; m < MM; ++m) {
    const float* xr = xf + (m0 + m) * K;
    for (int64_t j = 0; j < nn; ++j) {
      float s = hsum(acc[m][j]);
      for (int64_t k = Kv; k < K; ++k) s = std::fma(xr[k], static_cast<float>(wr[j][k]), s);
      y[(m0 + m) * N + n0 + j] = s * sc[n0 + j];
    }
  }
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_linear: x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "int8_linear: w must be int8 [N, K], got ",
              w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(w.size(1) == x.size(1), "int8_linear: x has ", x.size(1), " input features, w has ", w.size(1));
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "int8_linear: scale must be float32 or bfloat16 [N] with N = ", w.size(0), ", got ",
              scale.scalar_type(), " ", scale.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), Kv = K / W * W;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wc = w.contiguous();
  const at::Tensor sc = scale.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + NR - 1) / NR;
  // at least 64 KiB of weights per task: a fork costs more than reading less
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, NR * K));
  at::parallel_for(0, tiles, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * NR, nn = std::min(NR, N - n0);
      int64_t m0 = 0;
      for (; m0 + MR <= M; m0 += MR) tile<MR>(xp, wp, sp, yp, K, Kv, N, n0, nn, m0);
      switch (M - m0) {
        case 3: tile<3>(xp, wp, sp, yp, K, Kv, N, n0, nn, m0); break;
        case 2: tile<2>(xp, wp, sp, yp, K, Kv, N, n0, nn, m0); break;
        case 1: tile<1>(xp, wp, sp, yp, K, Kv, N, n0, nn, m0); break;
        default: break;
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(neuron_opt, m) { m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(neuron_opt, CPU, m) { m.impl("int8_linear", &int8_linear); }
