// The body of gguf_linear.cpp's kernels, included once per code path inside that path's namespace (with the
// path's vector type `V`, lane count `VL`, and its vector helpers `vload`, `vfma`, `vzero`, `vadd`, `vsub`, `vmul`,
// `vset`, `vstore`, `vsum`, `vbits` (VL bytes' bit fields as fp32) and `vint8` (VL int8 as fp32) defined before
// the include, under the path's `#pragma GCC target`). No includes here: gguf_linear.cpp includes what this uses.
//
// decode_block writes one GGUF block's values as fp32, each computed with the same operations, in the same order,
// as gguf-py's reference dequantizer (gguf.quants: the fp16 scales widened, products rounded to fp32 one at a time,
// never fused), so every value equals the reference's bitwise. Integer values (a nibble plus its high bits, minus
// the type's offset) are formed in fp32, where they are exact.

inline float h2f(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K and Q5_K: 8 six-bit scales and 8 six-bit minimums packed in 12 bytes (gguf's Q4_K.get_scale_min)
inline void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[4 + j] & 63;
    sc[4 + j] = (s[8 + j] & 15) | ((s[j] >> 2) & 0x30);
    mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
  }
}

inline void decode_q8_0(const uint8_t* b, float* out) {
  const V d = vset(h2f(b));
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; i += VL) vstore(out + i, vmul(vint8(q + i), d));
}

inline void decode_q5_0(const uint8_t* b, float* out) {
  const float d = h2f(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | static_cast<int>(((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
    out[j] = d * static_cast<float>(lo - 16);
    out[j + 16] = d * static_cast<float>(hi - 16);
  }
}

inline void decode_q4_k(const uint8_t* b, float* out) {
  const float d = h2f(b), dmin = h2f(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const uint8_t* qs = b + 16;
  for (int s = 0; s < 8; ++s) {  // sub-block s: nibble s % 2 of bytes 32 * (s / 2) ...
    const V ds = vset(d * static_cast<float>(sc[s])), dm = vset(dmin * static_cast<float>(mn[s]));
    const uint8_t* q = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    float* o = out + 32 * s;
    for (int l = 0; l < 32; l += VL) vstore(o + l, vsub(vmul(ds, vbits(q + l, shift, 15)), dm));
  }
}

inline void decode_q5_k(const uint8_t* b, float* out) {
  const float d = h2f(b), dmin = h2f(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int s = 0; s < 8; ++s) {
    const V ds = vset(d * static_cast<float>(sc[s])), dm = vset(dmin * static_cast<float>(mn[s]));
    const V sixteen = vset(16.f);
    const uint8_t* q = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    float* o = out + 32 * s;
    for (int l = 0; l < 32; l += VL) {
      const V v = vfma(vbits(qh + l, s, 1), sixteen, vbits(q + l, shift, 15));  // exact: an integer below 32
      vstore(o + l, vsub(vmul(ds, v), dm));
    }
  }
}

inline void decode_q6_k(const uint8_t* b, float* out) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = h2f(b + 208);
  for (int h = 0; h < 2; ++h) {  // half h: values 128 h + 32 t + i, t < 4, i < 32
    for (int t = 0; t < 4; ++t) {
      const uint8_t* ql = b + 64 * h + 32 * (t & 1);  // low 4 bits: nibble t / 2
      const uint8_t* qh = b + 128 + 32 * h;  // high 2 bits: bits 2 t, 2 t + 1
      const int sl = 4 * (t >> 1), sh = 2 * t;
      for (int half = 0; half < 2; ++half) {  // 16 values per scale
        const V ds = vset(d * static_cast<float>(scales[8 * h + 2 * t + half]));
        const V sixteen = vset(16.f), off = vset(32.f);
        float* o = out + 128 * h + 32 * t + 16 * half;
        const uint8_t* l = ql + 16 * half;
        const uint8_t* hb = qh + 16 * half;
        for (int i = 0; i < 16; i += VL) {  // q - 32, exact: an integer in [-32, 31]
          const V q = vsub(vfma(vbits(hb + i, sh, 3), sixteen, vbits(l + i, sl, 15)), off);
          vstore(o + i, vmul(ds, q));
        }
      }
    }
  }
}

inline void decode_block(int kind, const uint8_t* b, float* out) {
  switch (kind) {
    case kQ8_0: decode_q8_0(b, out); break;
    case kQ5_0: decode_q5_0(b, out); break;
    case kQ4_K: decode_q4_k(b, out); break;
    case kQ5_K: decode_q5_k(b, out); break;
    default: decode_q6_k(b, out); break;
  }
}

// one weight row (K values) as fp32
inline void decode_row(int kind, const uint8_t* row, int64_t K, float* out) {
  const int64_t bs = block_size(kind), bb = block_bytes(kind);
  for (int64_t k = 0; k < K; k += bs) decode_block(kind, row + k / bs * bb, out + k);
}

// y[m, n] for rows [m0, m0 + MM) of xf and output feature n, from that feature's decoded row `wf`: ACC chains of
// FMAs per row over k in VL-lane steps, then a fixed horizontal sum. The order depends on neither MM nor the rows
// beside a row: a row's result does not depend on M.
constexpr int ACC = 2;

template <int MM>
inline void rows_dot(const float* xf, const float* wf, float* y, int64_t K, int64_t N, int64_t n, int64_t m0) {
  V acc[MM][ACC];
  for (int m = 0; m < MM; ++m)
    for (int a = 0; a < ACC; ++a) acc[m][a] = vzero();
  for (int64_t k = 0; k < K; k += VL * ACC) {
    V wv[ACC];
    for (int a = 0; a < ACC; ++a) wv[a] = vload(wf + k + a * VL);
    for (int m = 0; m < MM; ++m) {
      const float* xr = xf + (m0 + m) * K + k;
      for (int a = 0; a < ACC; ++a) acc[m][a] = vfma(vload(xr + a * VL), wv[a], acc[m][a]);
    }
  }
  for (int m = 0; m < MM; ++m) {
    V t = acc[m][0];
    for (int a = 1; a < ACC; ++a) t = vadd(t, acc[m][a]);
    y[(m0 + m) * N + n] = vsum(t);
  }
}

// y [M, N] = xf [M, K] times the rows' weights (K a multiple of 32), output features split across threads; each
// weight row is decoded once per call into a buffer of K floats and multiplied into every row of x
inline void linear(const float* xf, const uint8_t* w, const int8_t* kinds, float* y, int64_t M, int64_t K,
                   int64_t ldw, int64_t N) {
  // at least ~64 KiB of blocks per task: a fork costs more than reading less
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(static_cast<size_t>(K));
    float* wf = buf.data();
    for (int64_t n = lo; n < hi; ++n) {
      if (n + 1 < hi) __builtin_prefetch(w + (n + 1) * ldw, 0, 1);
      decode_row(kinds[n], w + n * ldw, K, wf);
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) rows_dot<4>(xf, wf, y, K, N, n, m0);
      switch (M - m0) {
        case 3: rows_dot<3>(xf, wf, y, K, N, n, m0); break;
        case 2: rows_dot<2>(xf, wf, y, K, N, n, m0); break;
        case 1: rows_dot<1>(xf, wf, y, K, N, n, m0); break;
        default: break;
      }
    }
  });
}

// out [N, K] fp32: every row decoded (the many-row product's widened weight; the tests' view of the decoder)
inline void dequantize(const uint8_t* w, const int8_t* kinds, float* out, int64_t K, int64_t ldw, int64_t N) {
  at::parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, K)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t n = lo; n < hi; ++n) decode_row(kinds[n], w + n * ldw, K, out + n * K);
                   });
}
