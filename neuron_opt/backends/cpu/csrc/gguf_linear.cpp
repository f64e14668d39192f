// Linears on GGUF blocks as stored (registered as torch.ops.neuron_opt.gguf_linear and friends, built with the other
// operators by neuron_opt/backends/cpu/ops.py; docs/quantization.md, "GGUF blocks as stored").
//
// w uint8 [N, ldw]: output feature n's K input features as the GGUF file stores them, in blocks of kinds[n]'s type
// (int8 [N], GGML type ids: Q8_0 8, Q5_0 6, Q4_K 12, Q5_K 13, Q6_K 14), the row's blocks from byte 0 and any bytes
// after them unused (rows of different types padded to one width, so one tensor holds q/k/v fused, or a
// projection whose type differs between layers). x [M, K] float32 or bfloat16; y [M, N] float32.
//
// Two arithmetics (docs/quantization.md, "GGUF blocks as stored"):
// - gguf_linear (the default, up to 16 rows: decode, verify): llama.cpp's. Each row of x rounded once per call to
//   llama.cpp's 8-bit activation blocks (Q8_K for K-quant rows, Q8_0 for Q8_0 / Q5_0 rows), then integer dot
//   products of the blocks' integers as stored with x's, block decoding fused into the dot product (gguf_q8.h).
//   Output features in tiles of 4 rows of one type, tiles split across threads. Paths "avx512_vnni" (AVX-512
//   BW/VL + VNNI), "avx2", "generic" (scalar integers).
// - gguf_linear_exact (the reference path): x fp32 (a bf16 x widened exactly), each weight decoded to the fp32
//   value gguf-py's reference dequantizer gives (bitwise; gguf_blocks.h) and multiplied in fp32, so a product
//   equals dequantize-then-matmul up to the order of the fp32 sums. Each weight row decoded once per call into a
//   row of fp32 and multiplied into every row of x: per (m, n) two chains of FMAs over k in vector steps, then a
//   fixed horizontal sum. Paths "avx512" (AVX-512 F/BW/VL/DQ, 16 lanes), "avx2" (AVX2 + FMA, 8 lanes), "generic".
// - gguf_linear_widened: many rows (prefills): the whole weight decoded to fp32 once per call (every thread), then
//   one aten fp32 GEMM (the exact arithmetic).
// In both, a row's result does not depend on M or on which rows share the call. Every path is compiled with its own
// target whatever the build's flags and chosen per call from what the CPU runs (cpuid), the widest first;
// gguf_linear_path names one (tests run every path this CPU has).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9))
#include <immintrin.h>
#define NEURON_OPT_GGUF_X86 1
#endif

namespace {

constexpr int kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

inline bool known(int kind) {
  return kind == kQ5_0 || kind == kQ8_0 || kind == kQ4_K || kind == kQ5_K || kind == kQ6_K;
}
inline int64_t block_size(int kind) { return kind == kQ5_0 || kind == kQ8_0 ? 32 : 256; }
inline int64_t block_bytes(int kind) {
  switch (kind) {
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    default: return 210;  // Q6_K
  }
}

namespace generic {
using V = float;
constexpr int64_t VL = 1;
inline V vload(const float* p) { return *p; }
inline V vfma(V a, V b, V c) { return std::fma(a, b, c); }
inline V vzero() { return 0.f; }
inline V vadd(V a, V b) { return a + b; }
inline V vsub(V a, V b) { return a - b; }
inline V vmul(V a, V b) { return a * b; }
inline V vset(float a) { return a; }
inline void vstore(float* p, V a) { *p = a; }
inline float vsum(V a) { return a; }
inline V vbits(const uint8_t* p, int shift, int mask) { return static_cast<float>((p[0] >> shift) & mask); }
inline V vint8(const int8_t* p) { return static_cast<float>(p[0]); }
#include "gguf_blocks.h"
}  // namespace generic

#ifdef NEURON_OPT_GGUF_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using V = __m256;
constexpr int64_t VL = 8;
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vzero() { return _mm256_setzero_ps(); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
// ((p[i] >> shift) & mask) for the 8 bytes at p, as fp32
inline V vbits(const uint8_t* p, int shift, int mask) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, shift), _mm256_set1_epi32(mask)));
}
inline V vint8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#include "gguf_blocks.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
using V = __m512;
constexpr int64_t VL = 16;
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vzero() { return _mm512_setzero_ps(); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
// ((p[i] >> shift) & mask) for the 16 bytes at p, as fp32
inline V vbits(const uint8_t* p, int shift, int mask) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, shift), _mm512_set1_epi32(mask)));
}
inline V vint8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#include "gguf_blocks.h"
}  // namespace avx512
#pragma GCC pop_options

bool cpu_has(const char* what) {
  __builtin_cpu_init();
  if (std::strcmp(what, "avx512_vnni") == 0) return cpu_has("avx512") && __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(what, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

#include "gguf_q8.h"

// the paths this CPU runs for fp32 activations (exact) or 8-bit ones (q8), the widest first
std::vector<std::string> paths(bool exact) {
  std::vector<std::string> out;
#ifdef NEURON_OPT_GGUF_X86
  static const bool has512 = cpu_has("avx512"), has2 = cpu_has("avx2"), vnni = cpu_has("avx512_vnni");
  if (exact && has512) out.emplace_back("avx512");
  if (!exact && vnni) out.emplace_back("avx512_vnni");
  if (has2) out.emplace_back("avx2");
#endif
  out.emplace_back("generic");
  return out;
}

bool exact_activations(const char* op, c10::string_view activations) {
  const std::string a(activations.data(), activations.size());
  TORCH_CHECK(a == "q8" || a == "fp32", op, ": activations must be q8 or fp32, got '", a, "'");
  return a == "fp32";
}

// the weight's checks; returns the row width ldw
int64_t check_weight(const char* op, const at::Tensor& w, const at::Tensor& kinds, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte, op, ": w must be uint8 [N, row bytes], got ",
              w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(kinds.dim() == 1 && kinds.scalar_type() == at::kChar && kinds.size(0) == w.size(0), op,
              ": kinds must be int8 [N] with N = ", w.size(0), ", got ", kinds.scalar_type(), " ", kinds.sizes());
  TORCH_CHECK(w.is_contiguous() && kinds.is_contiguous(), op, ": w and kinds must be contiguous");
  const int8_t* kp = kinds.data_ptr<int8_t>();
  for (int64_t n = 0; n < w.size(0); ++n) {
    const int kind = kp[n];
    TORCH_CHECK(known(kind), op, ": row ", n, " has GGML type id ", kind,
                ", not one of Q5_0 (6), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)");
    TORCH_CHECK(K % block_size(kind) == 0, op, ": ", K, " input features are not a whole number of type ", kind,
                "'s ", block_size(kind), "-value blocks (row ", n, ")");
    TORCH_CHECK(K / block_size(kind) * block_bytes(kind) <= w.size(1), op, ": row ", n, " of type ", kind, " needs ",
                K / block_size(kind) * block_bytes(kind), " bytes for ", K, " values, w has ", w.size(1));
  }
  return w.size(1);
}

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
}

std::string pick(const char* op, c10::string_view path, bool exact) {
  const std::string p(path.data(), path.size());
  const std::vector<std::string> runs = paths(exact);
  if (p.empty()) return runs.front();
  if (exact) {
    TORCH_CHECK(p == "avx512" || p == "avx2" || p == "generic", op,
                ": path must be avx512, avx2 or generic for fp32 activations, got '", p, "'");
  } else {
    TORCH_CHECK(p == "avx512_vnni" || p == "avx2" || p == "generic", op,
                ": path must be avx512_vnni, avx2 or generic for q8 activations, got '", p, "'");
  }
  TORCH_CHECK(std::find(runs.begin(), runs.end(), p) != runs.end(), op, ": path ", p, " does not run on this CPU");
  return p;
}

at::Tensor linear_on(const at::Tensor& x, const at::Tensor& w, const at::Tensor& kinds, const std::string& path) {
  check_x("gguf_linear", x);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t ldw = check_weight("gguf_linear", w, kinds, K);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int8_t* kp = kinds.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
#ifdef NEURON_OPT_GGUF_X86
  if (path == "avx512") {
    avx512::linear(xp, wp, kp, yp, M, K, ldw, N);
    return y;
  }
  if (path == "avx2") {
    avx2::linear(xp, wp, kp, yp, M, K, ldw, N);
    return y;
  }
#endif
  generic::linear(xp, wp, kp, yp, M, K, ldw, N);
  return y;
}

using TileFn = void (*)(int, const uint8_t* const*, const Q8Row&, int64_t, float*);

// x's rows quantized into the activation blocks the weight's types take (Q8_K for K-quants, Q8_0 for Q8_0 and
// Q5_0), once per call; then tiles of 4 output features split across threads, each tile's rows of one type
// multiplied together into each row of x (a tile of mixed types, or the last short one, row by row)
at::Tensor linear_q8_on(const at::Tensor& x, const at::Tensor& w, const at::Tensor& kinds, const std::string& path) {
  check_x("gguf_linear", x);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t ldw = check_weight("gguf_linear", w, kinds, K);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int8_t* kp = kinds.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  bool need_k = false, need_0 = false;
  for (int64_t n = 0; n < N; ++n) (block_size(kp[n]) == 256 ? need_k : need_0) = true;
  std::vector<int8_t> qk(need_k ? M * K : 0), q0(need_0 ? M * K : 0);
  std::vector<float> dk(need_k ? M * K / 256 : 0), d0(need_0 ? M * K / 32 : 0);
  std::vector<int16_t> s16(need_k ? M * K / 16 : 0), s32(need_k ? M * K / 32 : 0);
  std::vector<int32_t> s0(need_0 ? M * K / 32 : 0);
  std::vector<Q8Row> xr(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    Q8Row& r = xr[m];
    r = Q8Row{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
    if (need_k) {
      r.qk = qk.data() + m * K, r.dk = dk.data() + m * K / 256, r.s16 = s16.data() + m * K / 16;
      r.s32 = s32.data() + m * K / 32;
      quantize_q8_k(xp + m * K, K, qk.data() + m * K, dk.data() + m * K / 256, s16.data() + m * K / 16,
                    s32.data() + m * K / 32);
    }
    if (need_0) {
      r.q0 = q0.data() + m * K, r.d0 = d0.data() + m * K / 32, r.s0 = s0.data() + m * K / 32;
      quantize_q8_0(xp + m * K, K, q0.data() + m * K, d0.data() + m * K / 32, s0.data() + m * K / 32);
    }
  }
  TileFn one = &q8_generic::tile<1>, four = &q8_generic::tile<4>;
#ifdef NEURON_OPT_GGUF_X86
  if (path == "avx512_vnni") one = &q8_vnni::tile<1>, four = &q8_vnni::tile<4>;
  if (path == "avx2") one = &q8_avx2::tile<1>, four = &q8_avx2::tile<4>;
#endif
  const int64_t tiles = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (4 * std::max<int64_t>(1, ldw)));
  at::parallel_for(0, tiles, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = 4 * t, nn = std::min<int64_t>(4, N - n0);
      const uint8_t* rows[4];
      for (int64_t j = 0; j < nn; ++j) rows[j] = wp + (n0 + j) * ldw;
      const bool same = nn == 4 && kp[n0] == kp[n0 + 1] && kp[n0] == kp[n0 + 2] && kp[n0] == kp[n0 + 3];
      float out[4];
      for (int64_t m = 0; m < M; ++m) {
        if (same) {
          four(kp[n0], rows, xr[m], K, out);
        } else {
          for (int64_t j = 0; j < nn; ++j) one(kp[n0 + j], rows + j, xr[m], K, out + j);
        }
        for (int64_t j = 0; j < nn; ++j) yp[m * N + n0 + j] = out[j];
      }
    }
  });
  return y;
}

at::Tensor dequantize_on(const at::Tensor& w, const at::Tensor& kinds, int64_t K, const std::string& path) {
  TORCH_CHECK(K >= 0, "gguf_dequantize: K must be >= 0, got ", K);
  const int64_t ldw = check_weight("gguf_dequantize", w, kinds, K);
  const int64_t N = w.size(0);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  if (N == 0 || K == 0) return out;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int8_t* kp = kinds.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
#ifdef NEURON_OPT_GGUF_X86
  if (path == "avx512") {
    avx512::dequantize(wp, kp, op, K, ldw, N);
    return out;
  }
  if (path == "avx2") {
    avx2::dequantize(wp, kp, op, K, ldw, N);
    return out;
  }
#endif
  generic::dequantize(wp, kp, op, K, ldw, N);
  return out;
}

}  // namespace

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& kinds) {
  return linear_q8_on(x, w, kinds, paths(false).front());
}

at::Tensor gguf_linear_exact(const at::Tensor& x, const at::Tensor& w, const at::Tensor& kinds) {
  return linear_on(x, w, kinds, paths(true).front());
}

at::Tensor gguf_linear_path(const at::Tensor& x, const at::Tensor& w, const at::Tensor& kinds, c10::string_view path,
                            c10::string_view activations) {
  const bool exact = exact_activations("gguf_linear_path", activations);
  const std::string p = pick("gguf_linear_path", path, exact);
  return exact ? linear_on(x, w, kinds, p) : linear_q8_on(x, w, kinds, p);
}

// Many rows (a prefill): the weight decoded to fp32 once per call, then aten's fp32 GEMM (x widened exactly).
at::Tensor gguf_linear_widened(const at::Tensor& x, const at::Tensor& w, const at::Tensor& kinds) {
  check_x("gguf_linear_widened", x);
  const at::Tensor wf = dequantize_on(w, kinds, x.size(1), paths(true).front());
  return at::linear(x.to(at::kFloat).contiguous(), wf);
}

at::Tensor gguf_dequantize(const at::Tensor& w, const at::Tensor& kinds, int64_t K, c10::string_view path) {
  return dequantize_on(w, kinds, K, pick("gguf_dequantize", path, true));
}

std::vector<std::string> gguf_linear_paths(c10::string_view activations) {
  return paths(exact_activations("gguf_linear_paths", activations));
}

TORCH_LIBRARY_FRAGMENT(neuron_opt, m) {
  m.def("gguf_linear(Tensor x, Tensor w, Tensor kinds) -> Tensor");
  m.def("gguf_linear_exact(Tensor x, Tensor w, Tensor kinds) -> Tensor");
  m.def("gguf_linear_widened(Tensor x, Tensor w, Tensor kinds) -> Tensor");
  m.def("gguf_linear_path(Tensor x, Tensor w, Tensor kinds, str path, str activations) -> Tensor");
  m.def("gguf_dequantize(Tensor w, Tensor kinds, int K, str path) -> Tensor");
  m.def("gguf_linear_paths(str activations) -> str[]", &gguf_linear_paths);
}
TORCH_LIBRARY_IMPL(neuron_opt, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_linear_exact", &gguf_linear_exact);
  m.impl("gguf_linear_widened", &gguf_linear_widened);
  m.impl("gguf_linear_path", &gguf_linear_path);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
