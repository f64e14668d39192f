// Paged attention for the cpu backend's decode and verify graphs (registered as torch.ops.neuron_opt.paged_attention,
// built at first use by neuron_opt/backends/cpu_ops.py; docs/cpu_backend.md, "Paged attention kernel").
//
// q [B, H, S, D] float32 (S queries per row: 1 for decode, k + 1 for a verify step); k_cache, v_cache
// [num_blocks, n_kv, block_size, D] float32, bfloat16 or float8_e4m3fn; block_tables [B, nb] int64; mask [B, S, Tm] bool (position t
// of row b visible to query s; positions >= Tm are not); returns softmax(q k^T * scale) v per head, [B, H, S, D] fp32.
// paged_attention_softcap: the same with each score s capped to softcap * tanh(s / softcap) before the mask (Gemma 2).
//
// Every query row goes through the same sequence of floating-point operations whatever S is and whichever rows it
// shares a pass with, so a verify step's rows are bitwise the decode step's (the exact verify of
// docs/speculative.md):
// - a score is one chain of FMAs over d = 0..D-1 (vectorised across positions, from K transposed per chunk);
// - softmax per chunk of CHUNK positions (max, exp, sum over the chunk's vectors in a fixed order), the chunks'
//   partial results combined in chunk order;
// - p.V is one chain of FMAs over the chunk's positions per output lane, V read in place from the pool.
// Work is split across threads by (row, kv head, chunk) only, never inside a reduction.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t CHUNK = 256;  // positions per task (whole blocks)

inline float hmax(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, v);
}
inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// n <= 2 * W values of the cache at p, widened to fp32 (lanes past n are 0)
template <typename T>
inline void load2(const T* p, Vec& lo, Vec& hi, int64_t n) {
  constexpr int64_t W = Vec::size();
  float buf[2 * W];
  for (int64_t i = 0; i < 2 * W; ++i) buf[i] = i < n ? static_cast<float>(p[i]) : 0.f;
  lo = Vec::loadu(buf);
  hi = Vec::loadu(buf + W);
}
template <>
inline void load2<float>(const float* p, Vec& lo, Vec& hi, int64_t n) {
  constexpr int64_t W = Vec::size();
  if (n == 2 * W) {
    lo = Vec::loadu(p);
    hi = Vec::loadu(p + W);
  } else {
    lo = Vec::loadu(p, std::min(n, W));
    hi = n > W ? Vec::loadu(p + W, n - W) : Vec(0.f);
  }
}
template <>
inline void load2<c10::BFloat16>(const c10::BFloat16* p, Vec& lo, Vec& hi, int64_t n) {
  using VB = at::vec::Vectorized<c10::BFloat16>;
  std::tie(lo, hi) = at::vec::convert_bfloat16_float(n == VB::size() ? VB::loadu(p) : VB::loadu(p, n));
}
// the transposes' tile: what at::vec transposes in registers (bf16 32 x 32, fp32 16 x 16 on AVX-512; a scalar loop
// elsewhere, any tile)
template <typename T>
constexpr int tile() {
  return std::is_same_v<T, c10::BFloat16> ? 32 : 16;
}

// p.V for 4 rows over NV * W output lanes starting at v (the pool's rows of this kv head at lane d0): each lane a
// chain of FMAs over the chunk's positions, in order; register-resident accumulators (NV <= 4)
template <typename CacheT, int NV>
inline void pv_pass(const CacheT* const* vrows, int64_t nblk, int64_t per, int64_t D, const float* const* pr,
                    Vec (&a)[4][4]) {
  constexpr int64_t W = Vec::size();
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < NV; ++k) a[r][k] = Vec(0.f);
  for (int64_t jb = 0; jb < nblk; ++jb) {
    const CacheT* vb = vrows[jb];
    const int64_t pj = jb * per;
    for (int64_t u = 0; u < per; ++u) {
      Vec v[4];
#pragma GCC unroll 2
      for (int k = 0; k < NV; k += 2) load2<CacheT>(vb + u * D + k * W, v[k], v[k + 1], 2 * W);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const Vec e(pr[r][pj + u]);
#pragma GCC unroll 4
        for (int k = 0; k < NV; ++k) a[r][k] = at::vec::fmadd(e, v[k], a[r][k]);
      }
    }
  }
}

// scores of RS query rows against the chunk's K (transposed, [D, cpad]): for each pair of position vectors, one
// chain of FMAs over d per row and lane, then * scale (then capped when cap > 0); rows [0, nr) stored to out (row
// stride cpad)
inline Vec capped(const Vec& s, float cap) {
  return cap > 0.f ? (s / Vec(cap)).tanh() * Vec(cap) : s;
}
template <typename CacheT, int RS>
inline void score_pass(const CacheT* kt, int64_t cpad, int64_t lpad, int64_t D, const float* const* qr, float scale,
                       float cap, int64_t nr, float* out) {
  constexpr int64_t W = Vec::size();
  for (int64_t p = 0; p < lpad; p += 2 * W) {
    Vec a0[RS], a1[RS];
#pragma GCC unroll 8
    for (int r = 0; r < RS; ++r) a0[r] = a1[r] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      Vec k0, k1;
      load2<CacheT>(kt + d * cpad + p, k0, k1, 2 * W);
#pragma GCC unroll 8
      for (int r = 0; r < RS; ++r) {
        const Vec qv(qr[r][d]);
        a0[r] = at::vec::fmadd(qv, k0, a0[r]);
        a1[r] = at::vec::fmadd(qv, k1, a1[r]);
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      capped(a0[r] * Vec(scale), cap).store(out + r * cpad + p);
      capped(a1[r] * Vec(scale), cap).store(out + r * cpad + p + W);
    }
  }
}

template <typename CacheT>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& mask, double scale_d, double cap_d) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const int64_t n_kv = k_cache.size(1), per = k_cache.size(2), n_blocks = k_cache.size(0);
  const int64_t g = H / n_kv, nb = block_tables.size(1), Tm = mask.size(2);
  const int64_t W = Vec::size(), W2 = 2 * W;
  const int64_t bpc = std::max<int64_t>(1, CHUNK / per);  // blocks per chunk
  const int64_t cpos = bpc * per;
  const int64_t cpad = (cpos + W2 - 1) / W2 * W2;
  const int64_t n_chunks = (nb + bpc - 1) / bpc;
  const int64_t R = g * S;
  const float scale = static_cast<float>(scale_d);
  const float cap = static_cast<float>(cap_d);
  const float ninf = -std::numeric_limits<float>::infinity();
  auto qc = q.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  auto bt = block_tables.contiguous();
  auto mc = mask.contiguous();
  auto out = at::empty({B, H, S, D}, q.options());
  const CacheT* kp = kc.data_ptr<CacheT>();
  const CacheT* vp = vc.data_ptr<CacheT>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const float* qp = qc.data_ptr<float>();
  const bool* mp = mc.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t blk_stride = n_kv * per * D;
  for (int64_t i = 0; i < B * nb; ++i)
    TORCH_CHECK(btp[i] >= 0 && btp[i] < n_blocks, "paged attention: block id ", btp[i], " out of range");
  const int64_t part = D + 2;  // per (row, chunk): unnormalised output [D], max, sum
  static thread_local std::vector<float> part_buf;
  const size_t need = static_cast<size_t>(B * n_kv * n_chunks * R * part);
  if (part_buf.size() < need) part_buf.resize(need);
  float* parts = part_buf.data();
  at::parallel_for(0, B * n_kv * n_chunks, 1, [&](int64_t lo, int64_t hi) {
    static thread_local std::vector<CacheT> kt_buf;
    static thread_local std::vector<float> sc_buf;
    if (kt_buf.size() < static_cast<size_t>(D * cpad)) kt_buf.resize(D * cpad);
    if (sc_buf.size() < static_cast<size_t>(R * cpad)) sc_buf.resize(R * cpad);
    CacheT* kt = kt_buf.data();  // the chunk's K transposed, [D, cpad], in the cache's dtype
    float* sc = sc_buf.data();   // scores, then probabilities, [R, cpad]
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / (n_kv * n_chunks), h = (i / n_chunks) % n_kv, c = i % n_chunks;
      const int64_t j0 = c * bpc, j1 = std::min(nb, j0 + bpc), t0 = j0 * per, len = (j1 - j0) * per;
      const int64_t lpad = (len + W2 - 1) / W2 * W2;
      constexpr int TS = tile<CacheT>();
      for (int64_t j = j0; j < j1; ++j) {
        const CacheT* kb = kp + btp[b * nb + j] * blk_stride + h * per * D;
        const int64_t p0 = (j - j0) * per;
        for (int64_t a = 0; a < per; a += TS)
          for (int64_t d0 = 0; d0 < D; d0 += TS)
            at::vec::transpose_mxn<CacheT>(kb + a * D + d0, D, kt + d0 * cpad + p0 + a, cpad,
                                           static_cast<int>(std::min<int64_t>(TS, per - a)),
                                           static_cast<int>(std::min<int64_t>(TS, D - d0)));
      }
      for (int64_t d = 0; d < D; ++d)
        for (int64_t p = len; p < lpad; ++p) kt[d * cpad + p] = CacheT(0.f);
      // scores: each one a chain of FMAs over d = 0..D-1; RS rows x 2 vectors of positions at a time
      for (int64_t r0 = 0; r0 < R;) {
        const float* qr[8];
        const int64_t rs = R - r0 >= 8 ? 8 : 4;
        for (int64_t r = 0; r < rs; ++r) {
          const int64_t rr = std::min(r0 + r, R - 1);  // spare rows repeat the last one, not stored
          qr[r] = qp + ((b * H + h * g + rr / S) * S + rr % S) * D;
        }
        const int64_t nr = std::min(rs, R - r0);
        float* out_rows = sc + r0 * cpad;
        if (rs == 8)
          score_pass<CacheT, 8>(kt, cpad, lpad, D, qr, scale, cap, nr, out_rows);
        else
          score_pass<CacheT, 4>(kt, cpad, lpad, D, qr, scale, cap, nr, out_rows);
        r0 += rs;
      }
      // softmax over the chunk (masked positions -inf)
      for (int64_t r = 0; r < R; ++r) {
        float* sr = sc + r * cpad;
        const bool* mr = mp + (b * S + r % S) * Tm + t0;
        const int64_t vis = std::max<int64_t>(0, std::min(len, Tm - t0));
        for (int64_t p = 0; p < vis; ++p) sr[p] = mr[p] ? sr[p] : ninf;
        for (int64_t p = vis; p < lpad; ++p) sr[p] = ninf;
        Vec vm(ninf);
        for (int64_t p = 0; p < lpad; p += W) vm = at::vec::maximum(vm, Vec::loadu(sr + p));
        const float m = hmax(vm);
        float* st = parts + (((b * n_kv + h) * n_chunks + c) * R + r) * part;
        st[D] = m;
        if (m == ninf) {  // nothing visible in this chunk
          st[D + 1] = 0.f;
          continue;
        }
        Vec vs(0.f);
        for (int64_t p = 0; p < lpad; p += W) {
          const Vec e = (Vec::loadu(sr + p) - Vec(m)).exp_u20();
          e.store(sr + p);
          vs = vs + e;
        }
        st[D + 1] = hsum(vs);
      }
      // p.V, reading V in place: each output lane a chain of FMAs over positions 0..len-1; 4 rows at a time
      for (int64_t r0 = 0; r0 < R; r0 += 4) {
        const int64_t nr = std::min<int64_t>(4, R - r0);
        const float* pr[4];
        for (int64_t r = 0; r < 4; ++r) pr[r] = sc + std::min(r0 + r, R - 1) * cpad;
        for (int64_t d0 = 0; d0 < D; d0 += 2 * W2) {  // 4 W output lanes per pass (the last pass: what is left)
          const int64_t n = std::min(2 * W2, D - d0), n1 = std::min(W2, n), n2 = n - n1;
          Vec a[4][4];
          if (n == 2 * W2 || n == W2) {  // whole vectors: the register-resident pass
            const CacheT* vrows[CHUNK];
            for (int64_t j = j0; j < j1; ++j) vrows[j - j0] = vp + btp[b * nb + j] * blk_stride + h * per * D + d0;
            if (n == 2 * W2)
              pv_pass<CacheT, 4>(vrows, j1 - j0, per, D, pr, a);
            else
              pv_pass<CacheT, 2>(vrows, j1 - j0, per, D, pr, a);
          } else {
            for (int64_t r = 0; r < 4; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = Vec(0.f);
            for (int64_t j = j0; j < j1; ++j) {
              const CacheT* vb = vp + btp[b * nb + j] * blk_stride + h * per * D + d0;
              const int64_t pj = (j - j0) * per;
              for (int64_t u = 0; u < per; ++u) {
                Vec v0, v1, v2(0.f), v3(0.f);
                load2<CacheT>(vb + u * D, v0, v1, n1);
                if (n2 > 0) load2<CacheT>(vb + u * D + W2, v2, v3, n2);
                for (int64_t r = 0; r < 4; ++r) {
                  const Vec e(pr[r][pj + u]);
                  a[r][0] = at::vec::fmadd(e, v0, a[r][0]);
                  a[r][1] = at::vec::fmadd(e, v1, a[r][1]);
                  a[r][2] = at::vec::fmadd(e, v2, a[r][2]);
                  a[r][3] = at::vec::fmadd(e, v3, a[r][3]);
                }
              }
            }
          }
          for (int64_t r = 0; r < nr; ++r) {
            float* st = parts + (((b * n_kv + h) * n_chunks + c) * R + r0 + r) * part + d0;
            for (int64_t k = 0; k < 4; ++k) {
              const int64_t m = std::min(W, n - k * W);
              if (m > 0) a[r][k].store(st + k * W, m);
            }
          }
        }
      }
    }
  });
  // combine the chunks in order
  at::parallel_for(0, B * n_kv * R, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / (n_kv * R), h = (i / R) % n_kv, r = i % R;
      float* o = op + ((b * H + h * g + r / S) * S + r % S) * D;
      const float* st0 = parts + ((b * n_kv + h) * n_chunks * R + r) * part;
      float M = ninf;
      for (int64_t c = 0; c < n_chunks; ++c) M = std::max(M, st0[c * R * part + D]);
      std::fill(o, o + D, 0.f);
      if (M == ninf) continue;
      float L = 0.f;
      for (int64_t c = 0; c < n_chunks; ++c) {
        const float* st = st0 + c * R * part;
        if (st[D] == ninf) continue;
        const float w = std::exp(st[D] - M);
        L += st[D + 1] * w;
        for (int64_t d = 0; d < D; ++d) o[d] += st[d] * w;
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= L;
    }
  });
  return out;
}

}  // namespace

at::Tensor paged_attention_softcap_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& mask, double scale,
                                        double softcap) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "paged_attention: q must be float32 [B, H, S, D], got ",
              q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: k_cache and v_cache must be [num_blocks, n_kv, block_size, D] of one dtype, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), n_kv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D, "paged_attention: q's head dim ", D, " differs from the cache's ", k_cache.size(3));
  TORCH_CHECK(n_kv > 0 && H % n_kv == 0, "paged_attention: ", H, " query heads do not share ", n_kv, " kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kLong,
              "paged_attention: block_tables must be int64 [B, nb], got ", block_tables.scalar_type(), " ",
              block_tables.sizes());
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == S && mask.scalar_type() == at::kBool,
              "paged_attention: mask must be bool [B, S, kv_len], got ", mask.scalar_type(), " ", mask.sizes());
  switch (k_cache.scalar_type()) {
    case at::kFloat: return attend<float>(q, k_cache, v_cache, block_tables, mask, scale, softcap);
    case at::kBFloat16: return attend<c10::BFloat16>(q, k_cache, v_cache, block_tables, mask, scale, softcap);
    case at::kFloat8_e4m3fn:
      return attend<c10::Float8_e4m3fn>(q, k_cache, v_cache, block_tables, mask, scale, softcap);
    default:
      TORCH_CHECK(false, "paged_attention: cache dtype ", k_cache.scalar_type(),
                  " not supported (float32, bfloat16, float8_e4m3fn)");
  }
}

at::Tensor paged_attention_softcap(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& mask, double scale,
                                   double softcap) {
  TORCH_CHECK(softcap > 0, "paged_attention_softcap: softcap must be positive, got ", softcap);
  return paged_attention_softcap_impl(q, k_cache, v_cache, block_tables, mask, scale, softcap);
}

// softcap 0: no cap (the same code path, `capped` returns the score)
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& mask, double scale) {
  return paged_attention_softcap_impl(q, k_cache, v_cache, block_tables, mask, scale, 0.0);
}

TORCH_LIBRARY(neuron_opt, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor mask, float scale) -> Tensor");
  m.def("paged_attention_softcap(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor mask, "
        "float scale, float softcap) -> Tensor");
}
TORCH_LIBRARY_IMPL(neuron_opt, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_softcap", &paged_attention_softcap);
}
