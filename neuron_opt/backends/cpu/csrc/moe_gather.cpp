// The selected experts of a sparse MoE block for few tokens (registered as torch.ops.neuron_opt.moe_gather, built
// with the other operators by neuron_opt/backends/cpu_ops.py; docs/moe.md, "The sparse block").
//
// t [T, H] float32 or bfloat16; gate_up [E, 2I, H] and down [E, H, I] (the stacked experts of models/moe.py's
// Experts) float32 or bfloat16, one dtype; ids [T, k] int64 in [0, E); weights [T, k] float32. Returns [T, H]
// float32: out[t] = sum_j weights[t, j] * down[e] @ a, with e = ids[t, j], h = gate_up[e] @ t[t] and
// a = silu(h[:I]) * h[I:] rounded to t's dtype, as Experts.gather computes it (every sum in fp32).
//
// What it is for: at decode only the selected experts' weights are read, once per step whichever tokens share an
// expert, and they stream from memory: matrix-vector products over four rows at a time (for two tokens at once),
// with one software prefetch per 64 bytes PF_DIST ahead (without it a core kept too few lines in flight:
// docs/quantization.md). Work is split across threads by (expert, rows); a token's result does not depend on which
// other tokens share the step.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t NR = 4;  // matrix rows per pass
constexpr int64_t PF_DIST = 16384;  // bytes ahead, prefetcht2: as csrc/int8_linear.cpp

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// 2W elements at p as two fp32 vectors
template <typename T>
inline void load2(const T* p, Vec& a, Vec& b);
template <>
inline void load2<float>(const float* p, Vec& a, Vec& b) {
  a = Vec::loadu(p);
  b = Vec::loadu(p + W);
}
template <>
inline void load2<c10::BFloat16>(const c10::BFloat16* p, Vec& a, Vec& b) {
  std::tie(a, b) = at::vec::convert_to_float<c10::BFloat16>(at::vec::Vectorized<c10::BFloat16>::loadu(p));
}

// outs[m][r] = mat[r] . vs[m] (fp32) for rows [r0, r0 + nr) of mat [R, C] and MM vectors (nr <= NR): the rows
// are read once for all MM vectors. Each (vector, row) is two chains of FMAs (the two W-lane halves of each 2W-lane
// step) added and summed horizontally in a fixed order: the same result whatever MM is.
template <typename T, int64_t MM>
inline void rows_dot(const T* mat, int64_t C, const float* const* vs, float* const* outs, int64_t r0, int64_t nr) {
  const int64_t Cv = C / (2 * W) * (2 * W);
  Vec acc[MM][NR][2];
  for (int64_t m = 0; m < MM; ++m)
    for (int64_t j = 0; j < NR; ++j) acc[m][j][0] = acc[m][j][1] = Vec(0.f);
  const T* wr[NR];
  for (int64_t j = 0; j < NR; ++j) wr[j] = mat + (r0 + std::min(j, nr - 1)) * C;  // a short tile repeats its last row
  const char* stream = reinterpret_cast<const char*>(mat + r0 * C) + PF_DIST;  // the tile's rows, in order
  constexpr int64_t step_bytes = NR * 2 * W * static_cast<int64_t>(sizeof(T));
  for (int64_t k = 0; k < Cv; k += 2 * W) {
    const char* s = stream + k / (2 * W) * step_bytes;
    for (int64_t b = 0; b < step_bytes; b += 64) __builtin_prefetch(s + b, 0, 1);
#pragma GCC unroll 4
    for (int64_t j = 0; j < NR; ++j) {
      Vec a, b;
      load2<T>(wr[j] + k, a, b);
#pragma GCC unroll 4
      for (int64_t m = 0; m < MM; ++m) {
        acc[m][j][0] = at::vec::fmadd(a, Vec::loadu(vs[m] + k), acc[m][j][0]);
        acc[m][j][1] = at::vec::fmadd(b, Vec::loadu(vs[m] + k + W), acc[m][j][1]);
      }
    }
  }
  for (int64_t m = 0; m < MM; ++m) {
    for (int64_t j = 0; j < nr; ++j) {
      float s = hsum(acc[m][j][0] + acc[m][j][1]);
      for (int64_t k = Cv; k < C; ++k) s = std::fma(static_cast<float>(wr[j][k]), vs[m][k], s);
      outs[m][r0 + j] = s;
    }
  }
}

// y[p] = mats[ids[p]] @ xs[p / per_x] for every pair p (per_x pairs share one vector of xs). The pairs that select the same expert share one read of its rows
// (two at a time, from cache after the first); work is split across threads by (expert, rows)
template <typename T>
void products(const T* mats, int64_t R, int64_t C, const int64_t* ids, const float* xs, int64_t per_x, float* y,
              int64_t P) {
  std::vector<int64_t> order(P);
  for (int64_t p = 0; p < P; ++p) order[p] = p;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<int64_t> starts;  // each expert's run in `order`
  for (int64_t i = 0; i < P; ++i)
    if (i == 0 || ids[order[i]] != ids[order[i - 1]]) starts.push_back(i);
  starts.push_back(P);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1, tiles = (R + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, NR * C * sizeof(T)));
  at::parallel_for(0, groups * tiles, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t g = i / tiles, r0 = (i % tiles) * NR, nr = std::min(NR, R - r0);
      const T* mat = mats + ids[order[starts[g]]] * R * C;
      for (int64_t q = starts[g]; q < starts[g + 1]; q += 2) {
        const int64_t mm = std::min<int64_t>(2, starts[g + 1] - q);
        const float* vs[2];
        float* outs[2];
        for (int64_t m = 0; m < mm; ++m) {
          vs[m] = xs + order[q + m] / per_x * C;
          outs[m] = y + order[q + m] * R;
        }
        if (mm == 2) {
          rows_dot<T, 2>(mat, C, vs, outs, r0, nr);
        } else {
          rows_dot<T, 1>(mat, C, vs, outs, r0, nr);
        }
      }
    }
  });
}

template <typename T>
at::Tensor gather(const at::Tensor& t, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& ids,
                  const at::Tensor& weights) {
  const int64_t Tn = t.size(0), H = t.size(1), k = ids.size(1), I = down.size(2), P = Tn * k;
  const at::Tensor x = t.to(at::kFloat).contiguous();  // [T, H]
  const at::Tensor idc = ids.contiguous(), wc = weights.contiguous();
  const int64_t* idp = idc.data_ptr<int64_t>();
  std::vector<float> h(P * 2 * I), a(P * I), y(P * H);
  products<T>(gate_up.data_ptr<T>(), 2 * I, H, idp, x.data_ptr<float>(), k, h.data(), P);  // pair p: token p / k
  const bool round_bf16 = t.scalar_type() == at::kBFloat16;
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t i = 0; i < I; ++i) {
      const float g = h[p * 2 * I + i], u = h[p * 2 * I + I + i];
      const float v = g / (1.f + std::exp(-g)) * u;
      a[p * I + i] = round_bf16 ? static_cast<float>(c10::BFloat16(v)) : v;
    }
  }
  products<T>(down.data_ptr<T>(), H, I, idp, a.data(), 1, y.data(), P);
  at::Tensor out = at::empty({Tn, H}, t.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  for (int64_t r = 0; r < Tn; ++r) {
    for (int64_t c = 0; c < H; ++c) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += y[(r * k + j) * H + c] * wp[r * k + j];
      op[r * H + c] = s;
    }
  }
  return out;
}

}  // namespace

at::Tensor moe_gather(const at::Tensor& t, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& ids,
                      const at::Tensor& weights) {
  TORCH_CHECK(t.dim() == 2 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              "moe_gather: t must be float32 or bfloat16 [T, H], got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == down.scalar_type() &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "moe_gather: gate_up [E, 2I, H] and down [E, H, I] must be float32 or bfloat16 of one dtype, got ",
              gate_up.scalar_type(), " ", gate_up.sizes(), " and ", down.scalar_type(), " ", down.sizes());
  const int64_t E = gate_up.size(0), H = t.size(1), I = down.size(2);
  TORCH_CHECK(down.size(0) == E && down.size(1) == H && gate_up.size(1) == 2 * I && gate_up.size(2) == H,
              "moe_gather: shapes do not fit: t ", t.sizes(), ", gate_up ", gate_up.sizes(), " (want [E, 2I, H]), down ",
              down.sizes(), " (want [E, H, I])");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == t.size(0) && ids.scalar_type() == at::kLong,
              "moe_gather: ids must be int64 [T, k], got ", ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_gather: weights must be float32 of ids' shape ", ids.sizes(), ", got ", weights.scalar_type(), " ",
              weights.sizes());
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < E, "moe_gather: expert id out of range [0, ", E, "): ", lo < 0 ? lo : hi);
  }
  const at::Tensor gu = gate_up.contiguous(), dn = down.contiguous();
  if (gu.scalar_type() == at::kBFloat16) return gather<c10::BFloat16>(t, gu, dn, ids, weights);
  return gather<float>(t, gu, dn, ids, weights);
}

TORCH_LIBRARY_FRAGMENT(neuron_opt, m) {
  m.def("moe_gather(Tensor t, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) -> Tensor");
}
TORCH_LIBRARY_IMPL(neuron_opt, CPU, m) { m.impl("moe_gather", &moe_gather); }
