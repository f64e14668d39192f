// The integer products of gguf_linear.cpp (activations rounded to llama.cpp's 8-bit blocks): x quantized once per
// call, then per weight block the block's integers (nibbles plus high bits, as stored) multiplied into x's 8-bit
// values as integer dot products inside the block loop, the block's scales applied to the integer sums. Included
// once by gguf_linear.cpp after its type constants; no includes here.
//
// Activations, as llama.cpp's quantize_row_q8_K / quantize_row_q8_0 (x86) make them, so a product is llama.cpp's:
// - Q8_K (for Q4_K, Q5_K, Q6_K): per 256 values the value of largest magnitude `mx`, q = min(127, round(-127 / mx
//   * x)) and d = 1 / (-127 / mx) in fp32, and the sums of each 16 q (the minimums' and Q6_K's offset terms).
// - Q8_0 (for Q8_0, Q5_0): per 32 values amax = max |x|, d = fp16(amax / 127), q = round(x * 127 / amax), and the
//   sum of the 32 q (Q5_0's offset term).
// Rounding is to nearest, ties to even (ggml's nearest_int and _mm256_round_ps). |q| <= 127.
//
// Each kernel multiplies NR weight rows of one type (1 or 4: the rows of a tile) into one row of x: the x vectors
// are loaded once per block and used for every weight row, and each weight row's result is computed by the same
// operations whatever NR is, so a result depends neither on the tile nor on M.

// One row of x in llama.cpp's activation blocks (the parts its weights' types need; others nullptr).
struct Q8Row {
  const int8_t* qk;    // [K] Q8_K quants
  const float* dk;     // [K / 256] Q8_K scales
  const int16_t* s16;  // [K / 16] sums of 16 Q8_K quants
  const int16_t* s32;  // [K / 32] sums of 32 Q8_K quants
  const int8_t* q0;    // [K] Q8_0 quants
  const float* d0;     // [K / 32] Q8_0 scales (fp16 values)
  const int32_t* s0;   // [K / 32] sums of 32 Q8_0 quants
};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline void quantize_q8_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* s16, int16_t* s32) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* xb = x + 256 * b;
    int8_t* qb = q + 256 * b;
    float amax = 0.f, mx = 0.f;
    for (int j = 0; j < 256; ++j) {
      const float ax = std::fabs(xb[j]);
      if (ax > amax) {
        amax = ax;
        mx = xb[j];
      }
    }
    if (amax == 0.f) {
      d[b] = 0.f;
      std::memset(qb, 0, 256);
      std::memset(s16 + 16 * b, 0, 16 * sizeof(int16_t));
      std::memset(s32 + 8 * b, 0, 8 * sizeof(int16_t));
      continue;
    }
    const float iscale = -127.f / mx;
    for (int j = 0; j < 256; ++j) qb[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * xb[j]))));
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += qb[16 * g + j];
      s16[16 * b + g] = static_cast<int16_t>(s);
    }
    for (int g = 0; g < 8; ++g) s32[8 * b + g] = static_cast<int16_t>(s16[16 * b + 2 * g] + s16[16 * b + 2 * g + 1]);
    d[b] = 1.f / iscale;
  }
}

inline void quantize_q8_0(const float* x, int64_t K, int8_t* q, float* d, int32_t* s0) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    d[b] = static_cast<float>(c10::Half(amax / 127.f));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    int s = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * id));
      q[32 * b + j] = static_cast<int8_t>(v);
      s += v;
    }
    s0[b] = s;
  }
}

// Q4_K and Q5_K: 8 six-bit scales and 8 six-bit minimums packed in 12 bytes (gguf's Q4_K.get_scale_min), unpacked
// as llama.cpp does it, four at a time in 32-bit words: out[0..1] the scales' bytes, out[2..3] the minimums'
inline void unpack_scale_min(const uint8_t* s, uint32_t* out) {
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, s, 12);
  out[0] = u[0] & k1;
  out[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  out[2] = u[1] & k1;
  out[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
}

// sum over sub-blocks of 32 of mn[s] times the sum of x's quants there (the minimums' term of Q4_K and Q5_K)
inline int mins_dot(const uint8_t* mn, const int16_t* s32) {
  int m = 0;
  for (int s = 0; s < 8; ++s) m += mn[s] * s32[s];
  return m;
}

// sum over groups of 16 of Q6_K's signed scale times the sum of x's quants there (its offset 32's term)
inline int scales_dot16(const int8_t* sc, const int16_t* s16) {
  int m = 0;
  for (int g = 0; g < 16; ++g) m += sc[g] * s16[g];
  return m;
}

// Each weight row of a tile is its own stream: the vector kernels prefetch each row kPrefetch bytes ahead of the
// block they read (one prefetcht2 per cache line of a block), as int8_linear prefetches its tile. On weights past
// the last-level cache, one thread: 1 KiB ahead read 10-20% faster than none (a loaded 2-core AVX-512 machine).
constexpr int64_t kPrefetch = 1024;
inline void prefetch_ahead(const uint8_t* bl, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(bl + kPrefetch + o, 0, 1);
}

// Scalar integer kernels (any CPU): the reference form of the vector paths' integer sums.
namespace q8_generic {

// Q4_K (five = false) and Q5_K
template <int NR>
void q4_k(const uint8_t* const* rows, const Q8Row& x, int64_t nb, bool five, float* out) {
  const int64_t bytes = five ? 176 : 144;
  for (int r = 0; r < NR; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bl = rows[r] + b * bytes;
      const int8_t* qx = x.qk + 256 * b;
      uint32_t packed[4];
      unpack_scale_min(bl + 4, packed);
      const uint8_t* sc = reinterpret_cast<const uint8_t*>(packed);
      const uint8_t* mn = sc + 8;
      const uint8_t* qh = bl + 16;
      const uint8_t* qs = bl + (five ? 48 : 16);
      int sumi = 0;
      for (int s = 0; s < 8; ++s) {
        int is = 0;
        for (int l = 0; l < 32; ++l) {
          int q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 15;
          if (five) q |= ((qh[l] >> s) & 1) << 4;
          is += q * qx[32 * s + l];
        }
        sumi += sc[s] * is;
      }
      const float dx = x.dk[b];
      acc += half_to_float(bl) * dx * static_cast<float>(sumi) -
             half_to_float(bl + 2) * dx * static_cast<float>(mins_dot(mn, x.s32 + 8 * b));
    }
    out[r] = acc;
  }
}

template <int NR>
void q6_k(const uint8_t* const* rows, const Q8Row& x, int64_t nb, float* out) {
  for (int r = 0; r < NR; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bl = rows[r] + b * 210;
      const int8_t* qx = x.qk + 256 * b;
      const int8_t* sc = reinterpret_cast<const int8_t*>(bl + 192);
      int sumi = 0;
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t)
          for (int half = 0; half < 2; ++half) {
            int is = 0;
            for (int i = 16 * half; i < 16 * half + 16; ++i) {
              const int lo = (bl[64 * h + 32 * (t & 1) + i] >> (4 * (t >> 1))) & 15;
              const int hi = (bl[128 + 32 * h + i] >> (2 * t)) & 3;
              is += (lo | (hi << 4)) * qx[128 * h + 32 * t + i];
            }
            sumi += sc[8 * h + 2 * t + half] * is;
          }
      sumi -= 32 * scales_dot16(sc, x.s16 + 16 * b);
      acc += half_to_float(bl + 208) * x.dk[b] * static_cast<float>(sumi);
    }
    out[r] = acc;
  }
}

template <int NR>
void q8_0(const uint8_t* const* rows, const Q8Row& x, int64_t nb, float* out) {
  for (int r = 0; r < NR; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bl = rows[r] + b * 34;
      const int8_t* qw = reinterpret_cast<const int8_t*>(bl + 2);
      int sumi = 0;
      for (int j = 0; j < 32; ++j) sumi += qw[j] * x.q0[32 * b + j];
      acc += half_to_float(bl) * x.d0[b] * static_cast<float>(sumi);
    }
    out[r] = acc;
  }
}

template <int NR>
void q5_0(const uint8_t* const* rows, const Q8Row& x, int64_t nb, float* out) {
  for (int r = 0; r < NR; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bl = rows[r] + b * 22;
      uint32_t qh;
      std::memcpy(&qh, bl + 2, 4);
      int sumi = 0;
      for (int j = 0; j < 16; ++j) {
        const int lo = (bl[6 + j] & 15) | static_cast<int>(((qh >> j) & 1) << 4);
        const int hi = (bl[6 + j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
        sumi += lo * x.q0[32 * b + j] + hi * x.q0[32 * b + j + 16];
      }
      sumi -= 16 * x.s0[b];
      acc += half_to_float(bl) * x.d0[b] * static_cast<float>(sumi);
    }
    out[r] = acc;
  }
}

template <int NR>
void tile(int kind, const uint8_t* const* rows, const Q8Row& x, int64_t K, float* out) {
  switch (kind) {
    case kQ4_K: q4_k<NR>(rows, x, K / 256, false, out); break;
    case kQ5_K: q4_k<NR>(rows, x, K / 256, true, out); break;
    case kQ6_K: q6_k<NR>(rows, x, K / 256, out); break;
    case kQ8_0: q8_0<NR>(rows, x, K / 32, out); break;
    default: q5_0<NR>(rows, x, K / 32, out); break;
  }
}

}  // namespace q8_generic

#ifdef NEURON_OPT_GGUF_X86
// AVX2: 32 bytes a step, u8 x s8 pair products (maddubs) to int16, times the scales (madd) to int32; llama.cpp's
// AVX2 kernels' arithmetic. Every int16 fits: 2 * 63 * 127 (Q6_K's largest) < 32768; Q8_0 multiplies |w| by x
// with w's sign (2 * 128 * 127).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace q8_avx2 {

inline __m256i ld(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256i shr16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
inline float h2f(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return _cvtsh_ss(b);
}
inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// the minimums' term of a Q4_K / Q5_K block: its 8 minimums (bytes at mn) times x's 8 sums of 32, in 4 int32
inline __m128 mins_term(const uint32_t* mn, const int16_t* s32) {
  const __m128i m = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
  return _mm_cvtepi32_ps(_mm_madd_epi16(m, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s32))));
}

template <int NR>
void q4_k(const uint8_t* const* rows, const Q8Row& x, int64_t nb, bool five, float* out) {
  const int64_t bytes = five ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
  __m256 acc[NR];
  __m128 mins[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qx = x.qk + 256 * b;
    const float dx = x.dk[b];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* bl = rows[r] + b * bytes;
      prefetch_ahead(bl, bytes);
      uint32_t packed[4];
      unpack_scale_min(bl + 4, packed);
      const uint8_t* sc = reinterpret_cast<const uint8_t*>(packed);
      const uint8_t* qs = bl + (five ? 48 : 16);
      const __m256i qh = five ? ld(bl + 16) : _mm256_setzero_si256();
      __m256i sumi = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i q = ld(qs + 32 * c);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(shr16(q, 4), m4);
        if (five) {
          const __m256i bl_ = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
          const __m256i bh_ = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1)));
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl_), bl_), sixteen));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh_), bh_), sixteen));
        }
        const __m256i plo = _mm256_maddubs_epi16(lo, ld(qx + 64 * c));
        const __m256i phi = _mm256_maddubs_epi16(hi, ld(qx + 64 * c + 32));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(plo, _mm256_set1_epi16(sc[2 * c])));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(phi, _mm256_set1_epi16(sc[2 * c + 1])));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(bl) * dx), _mm256_cvtepi32_ps(sumi), acc[r]);
      mins[r] = _mm_fmadd_ps(_mm_set1_ps(h2f(bl + 2) * dx), mins_term(packed + 2, x.s32 + 8 * b), mins[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum(acc[r]) - hsum128(mins[r]);
}

template <int NR>
void q6_k(const uint8_t* const* rows, const Q8Row& x, int64_t nb, float* out) {
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qx = x.qk + 256 * b;
    const float dx = x.dk[b];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* bl = rows[r] + b * 210;
      prefetch_ahead(bl, 210);
      const int8_t* sc = reinterpret_cast<const int8_t*>(bl + 192);
      __m256i sumi = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i H = ld(bl + 128 + 32 * h);
        const __m256i L0 = ld(bl + 64 * h), L1 = ld(bl + 64 * h + 32);
        for (int t = 0; t < 4; ++t) {
          const __m256i lo = _mm256_and_si256(shr16((t & 1) ? L1 : L0, 4 * (t >> 1)), m4);
          const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(shr16(H, 2 * t), m3), 4);
          const __m256i p = _mm256_maddubs_epi16(_mm256_or_si256(lo, hi), ld(qx + 128 * h + 32 * t));
          const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * t + 1]), _mm_set1_epi16(sc[8 * h + 2 * t]));
          sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
        }
      }
      // the offset 32: minus 32 times each group of 16's scale times x's sum there
      const __m256i off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))),
                                            ld(x.s16 + 16 * b));
      sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(off, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(bl + 208) * dx), _mm256_cvtepi32_ps(sumi), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum(acc[r]);
}

// Q5_0's 32 high bits as bytes 0 or 16 (llama.cpp's bytes_from_bits_32)
inline __m256i high_bits(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(v)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16));
}

// Q8_0 (five = false) and Q5_0: per block the integer sum in 8 int32 lanes, scaled by d_w d_x
template <int NR>
void q8_0(const uint8_t* const* rows, const Q8Row& x, int64_t nb, bool five, float* out) {
  const int64_t bytes = five ? 22 : 34;
  const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
  __m256 acc[NR];
  float offs[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps(), offs[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xv = ld(x.q0 + 32 * b);
    const float dx = x.d0[b];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* bl = rows[r] + b * bytes;
      prefetch_ahead(bl, bytes);
      const float d = h2f(bl) * dx;
      __m256i p;
      if (five) {
        const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bl + 6));
        const __m256i u = _mm256_or_si256(
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), _mm256_castsi256_si128(m4)),
                             _mm_and_si128(qs, _mm256_castsi256_si128(m4))),
            high_bits(bl + 2));
        p = _mm256_maddubs_epi16(u, xv);
        offs[r] += d * static_cast<float>(16 * x.s0[b]);
      } else {
        const __m256i w = ld(bl + 2);
        p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum(acc[r]) - offs[r];
}

template <int NR>
void tile(int kind, const uint8_t* const* rows, const Q8Row& x, int64_t K, float* out) {
  switch (kind) {
    case kQ4_K: q4_k<NR>(rows, x, K / 256, false, out); break;
    case kQ5_K: q4_k<NR>(rows, x, K / 256, true, out); break;
    case kQ6_K: q6_k<NR>(rows, x, K / 256, out); break;
    case kQ8_0: q8_0<NR>(rows, x, K / 32, false, out); break;
    default: q8_0<NR>(rows, x, K / 32, true, out); break;
  }
}

}  // namespace q8_avx2
#pragma GCC pop_options

// AVX-512 VNNI: 64 bytes a step; K-quants: maddubs to int16, then the scales multiplied and summed into int32 in
// one instruction (vpdpwssd); Q8_0 and Q5_0 (32-byte blocks): u8 x s8 straight to int32 (vpdpbusd, 256 bits).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace q8_vnni {

inline __m256i ld(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m512i ld2(const void* a, const void* b) {  // 32 bytes at a, then 32 at b
  return _mm512_inserti64x4(_mm512_castsi256_si512(ld(a)), ld(b), 1);
}
inline float h2f(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return _cvtsh_ss(b);
}
inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m128 mins_term(const uint32_t* mn, const int16_t* s32) {  // as q8_avx2's
  const __m128i m = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
  return _mm_cvtepi32_ps(_mm_madd_epi16(m, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s32))));
}
inline __m512i idx16(int a, int b, int c, int d) {  // int16 lanes: 8 each of a, b, c, d
  return _mm512_set_epi16(d, d, d, d, d, d, d, d, c, c, c, c, c, c, c, c, b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
}

template <int NR>
void q4_k(const uint8_t* const* rows, const Q8Row& x, int64_t nb, bool five, float* out) {
  const int64_t bytes = five ? 176 : 144;
  const __m512i m4 = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
  // int16 lanes 0-15 take the first sub-block's scale, 16-31 the second's: (lo, hi) of steps 0 and 1
  const __m512i ilo[2] = {idx16(0, 0, 2, 2), idx16(4, 4, 6, 6)}, ihi[2] = {idx16(1, 1, 3, 3), idx16(5, 5, 7, 7)};
  __m512i blo[2], bhi[2];  // Q5_K: the high bit of each half's sub-block
  for (int j = 0; j < 2; ++j) {
    blo[j] = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (4 * j))),
                                _mm256_set1_epi8(static_cast<char>(1 << (4 * j + 2))), 1);
    bhi[j] = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (4 * j + 1))),
                                _mm256_set1_epi8(static_cast<char>(1 << (4 * j + 3))), 1);
  }
  __m512 acc[NR];
  __m128 mins[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps(), mins[r] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qx = x.qk + 256 * b;
    const float dx = x.dk[b];
    // step j covers bytes 64 j of the quants: low nibbles sub-blocks 4j and 4j+2, high nibbles 4j+1 and 4j+3
    const __m512i xlo[2] = {ld2(qx, qx + 64), ld2(qx + 128, qx + 192)};
    const __m512i xhi[2] = {ld2(qx + 32, qx + 96), ld2(qx + 160, qx + 224)};
    for (int r = 0; r < NR; ++r) {
      const uint8_t* bl = rows[r] + b * bytes;
      prefetch_ahead(bl, bytes);
      uint32_t packed[4];
      unpack_scale_min(bl + 4, packed);
      const __m512i scv =
          _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed))));
      const uint8_t* qs = bl + (five ? 48 : 16);
      const __m512i qh = five ? _mm512_broadcast_i64x4(ld(bl + 16)) : _mm512_setzero_si512();
      __m512i sumi = _mm512_setzero_si512();
      for (int j = 0; j < 2; ++j) {
        const __m512i q = _mm512_loadu_si512(qs + 64 * j);
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        if (five) {
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, blo[j]), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, bhi[j]), hi, sixteen);
        }
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(lo, xlo[j]), _mm512_permutexvar_epi16(ilo[j], scv));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(hi, xhi[j]), _mm512_permutexvar_epi16(ihi[j], scv));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(h2f(bl) * dx), _mm512_cvtepi32_ps(sumi), acc[r]);
      mins[r] = _mm_fmadd_ps(_mm_set1_ps(h2f(bl + 2) * dx), mins_term(packed + 2, x.s32 + 8 * b), mins[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - hsum128(mins[r]);
}

template <int NR>
void q6_k(const uint8_t* const* rows, const Q8Row& x, int64_t nb, float* out) {
  const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
  // step A: t = 0 (bytes 0-31) and t = 1 (32-63), high bits at shifts 0 and 2; step B: t = 2, 3, shifts 4 and 6
  const __m512i shA = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i shB = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  const __m512i iA = idx16(0, 1, 2, 3), iB = idx16(4, 5, 6, 7);
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qx = x.qk + 256 * b;
    const float dx = x.dk[b];
    const __m512i xv[4] = {_mm512_loadu_si512(qx), _mm512_loadu_si512(qx + 64), _mm512_loadu_si512(qx + 128),
                           _mm512_loadu_si512(qx + 192)};
    for (int r = 0; r < NR; ++r) {
      const uint8_t* bl = rows[r] + b * 210;
      prefetch_ahead(bl, 210);
      const int8_t* sc = reinterpret_cast<const int8_t*>(bl + 192);
      __m512i sumi = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i L = _mm512_loadu_si512(bl + 64 * h);
        const __m512i H = _mm512_broadcast_i64x4(ld(bl + 128 + 32 * h));
        const __m512i scv = _mm512_castsi128_si512(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h))));
        const __m512i qa = _mm512_or_si512(_mm512_and_si512(L, m4),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, shA), m3), 4));
        const __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, shB), m3), 4));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(qa, xv[2 * h]), _mm512_permutexvar_epi16(iA, scv));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(qb, xv[2 * h + 1]), _mm512_permutexvar_epi16(iB, scv));
      }
      const __m256i off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))),
                                            ld(x.s16 + 16 * b));  // the offset 32's term, as q8_avx2's
      sumi = _mm512_sub_epi32(sumi, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(h2f(bl + 208) * dx), _mm512_cvtepi32_ps(sumi), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// one Q8_0 (five = false) or Q5_0 block's 32 weights as u8 (|w|, or Q5_0's q + 16) and x's 32 quants as s8 with
// the signs that make u * s the product (Q5_0: unchanged; its offset 16 is the caller's)
inline void block_u8(const uint8_t* bl, bool five, __m256i xq, __m256i* u, __m256i* s) {
  if (five) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bl + 6));
    const __m128i m4 = _mm_set1_epi8(15);
    uint32_t qh;
    std::memcpy(&qh, bl + 2, 4);
    *u = _mm256_or_si256(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4)),
                         _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(16)));
    *s = xq;
  } else {
    const __m256i w = ld(bl + 2);
    *u = _mm256_abs_epi8(w);
    *s = _mm256_sign_epi8(xq, w);
  }
}

template <int NR>
void q8_0(const uint8_t* const* rows, const Q8Row& x, int64_t nb, bool five, float* out) {
  const int64_t bytes = five ? 22 : 34;
  __m256 acc[NR];
  float offs[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps(), offs[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xv = ld(x.q0 + 32 * b);
    const float dx = x.d0[b];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* bl = rows[r] + b * bytes;
      prefetch_ahead(bl, bytes);
      __m256i u, sx;
      block_u8(bl, five, xv, &u, &sx);
      const float d = h2f(bl) * dx;
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, sx)),
                               acc[r]);
      if (five) offs[r] += d * static_cast<float>(16 * x.s0[b]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    out[r] = hsum128(h) - offs[r];
  }
}

template <int NR>
void tile(int kind, const uint8_t* const* rows, const Q8Row& x, int64_t K, float* out) {
  switch (kind) {
    case kQ4_K: q4_k<NR>(rows, x, K / 256, false, out); break;
    case kQ5_K: q4_k<NR>(rows, x, K / 256, true, out); break;
    case kQ6_K: q6_k<NR>(rows, x, K / 256, out); break;
    case kQ8_0: q8_0<NR>(rows, x, K / 32, false, out); break;
    default: q8_0<NR>(rows, x, K / 32, true, out); break;
  }
}

}  // namespace q8_vnni
#pragma GCC pop_options
#endif
