// bf16-weight linear for few rows (registered as torch.ops.neuron_opt.bf16_linear, built with paged_attention.cpp
// by neuron_opt/backends/cpu_ops.py; docs/cpu_backend.md, "bf16 one-row GEMMs on a C++ operator").
//
// x [M, K] float32 or bfloat16 (a bf16 row is widened exactly), ws a list of bf16 weights [N_i, K] (one row per
// output feature, as the model holds them: no packing); returns y [M, sum N_i] float32, the outputs of the weights
// side by side (q/k/v or gate/up in one call, like a fused GEMM, with no concatenated copy of the weights),
// y[m, n] = sum_k x[m, k] * w[n, k] in fp32.
//
// For decode (M = 1 to a few rows) the cost is reading the weights: each group of W bf16 weights is widened to
// fp32 once (a shift) and multiplied into every row of x, FMA chains with four output features in flight, the
// weight stream prefetched ahead. A row's result does not depend on M or on which rows share the call: every
// (m, n) is one chain of FMAs over k = 0..K-1 in W-lane steps, then a fixed horizontal sum. Work is split across
// threads by output features only (tiles of four features, none spanning two weights).
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
constexpr int64_t PF_DIST = 16384;  // bytes ahead in the tile's weight rows

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

inline Vec load_bf16(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

// features [n0, n0 + nn) of weight w (rows of K) into y's columns [c0, c0 + nn), rows [m0, m0 + MM) of x
template <int64_t MM>
inline void tile(const float* xf, const c10::BFloat16* w, float* y, int64_t K, int64_t Kv, int64_t Ny, int64_t n0,
                 int64_t nn, int64_t c0, int64_t m0) {
  Vec acc[MM][NR];
  for (int64_t m = 0; m < MM; ++m)
    for (int64_t j = 0; j < NR; ++j) acc[m][j] = Vec(0.f);
  const c10::BFloat16* wr[NR];
  for (int64_t j = 0; j < NR; ++j) wr[j] = w + (n0 + std::min(j, nn - 1)) * K;  // a short tile repeats its last row
  const char* stream = reinterpret_cast<const char*>(w + n0 * K) + PF_DIST;  // the tile's rows, read in order
  for (int64_t k = 0; k < Kv; k += W) {
    __builtin_prefetch(stream + k * NR * 2, 0, 1);
    Vec wv[NR];
    for (int64_t j = 0; j < NR; ++j) wv[j] = load_bf16(wr[j] + k);
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
      y[(m0 + m) * Ny + c0 + j] = s;
    }
  }
}

struct Tile {
  const c10::BFloat16* w;
  int64_t n0, nn, c0;
};

}  // namespace

at::Tensor bf16_linear(const at::Tensor& x, at::TensorList ws) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_linear: x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!ws.empty(), "bf16_linear: no weights");
  const int64_t M = x.size(0), K = x.size(1), Kv = K / W * W;
  std::vector<at::Tensor> wc;
  int64_t Ny = 0;
  for (const auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_linear: weights must be bfloat16 [N, K], got ",
                w.scalar_type(), " ", w.sizes());
    TORCH_CHECK(w.size(1) == K, "bf16_linear: x has ", K, " input features, a weight has ", w.size(1));
    wc.push_back(w.contiguous());
    Ny += w.size(0);
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, Ny}, x.options().dtype(at::kFloat));
  if (M == 0 || Ny == 0) return y;
  std::vector<Tile> tiles;
  int64_t c0 = 0;
  for (const auto& w : wc) {
    const int64_t N = w.size(0);
    for (int64_t n0 = 0; n0 < N; n0 += NR) tiles.push_back({w.data_ptr<c10::BFloat16>(), n0, std::min(NR, N - n0), c0 + n0});
    c0 += N;
  }
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // at least 64 KiB of weights per task: a fork costs more than reading less
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, NR * K * 2));
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const Tile& tl = tiles[t];
      int64_t m0 = 0;
      for (; m0 + MR <= M; m0 += MR) tile<MR>(xp, tl.w, yp, K, Kv, Ny, tl.n0, tl.nn, tl.c0, m0);
      switch (M - m0) {
        case 3: tile<3>(xp, tl.w, yp, K, Kv, Ny, tl.n0, tl.nn, tl.c0, m0); break;
        case 2: tile<2>(xp, tl.w, yp, K, Kv, Ny, tl.n0, tl.nn, tl.c0, m0); break;
        case 1: tile<1>(xp, tl.w, yp, K, Kv, Ny, tl.n0, tl.nn, tl.c0, m0); break;
        default: break;
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(neuron_opt, m) { m.def("bf16_linear(Tensor x, Tensor[] ws) -> Tensor"); }
TORCH_LIBRARY_IMPL(neuron_opt, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
