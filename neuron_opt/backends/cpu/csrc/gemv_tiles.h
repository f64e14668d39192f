// The tile loop of the weight-streaming linears for few rows (int8_linear.cpp, bf16_linear.cpp): y = x W^T where
// W is read once per call and x has M = 1 to a few rows. Each weight type supplies how W lanes of its elements
// widen to fp32 (`Widen`); the loop, the prefetch and the split across threads are shared.
//
// Every (m, n) is one chain of FMAs over k = 0..K-1 in W-lane steps, then a fixed horizontal sum, then the scalar
// tail and the row's scale: a row's result does not depend on M or on which rows or weights share the call.
// Work is split across threads by output features only, in tiles of NR features that never span two weights.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace neuron_opt_gemv {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t NR = 4;  // output features per pass
constexpr int64_t MR = 4;  // rows of x per pass
constexpr int64_t PF_DIST = 16384;  // bytes ahead in the tile's weight rows (docs/quantization.md: the sweep)
constexpr int64_t LINE = 64;

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// One weight of a call: N rows of K elements, an optional per-row scale, and its first column in y.
template <class T>
struct Segment {
  const T* w;
  const float* scale;  // nullptr: none
  int64_t N, c0;
};

// features [n0, n0 + nn) of `s` for rows [m0, m0 + MM) of x; Kv = K rounded down to W
template <class T, class Widen, int64_t MM>
inline void tile(const float* xf, const Segment<T>& s, float* y, int64_t K, int64_t Kv, int64_t ldy, int64_t n0,
                 int64_t nn, int64_t m0) {
  constexpr int64_t step_bytes = NR * W * static_cast<int64_t>(sizeof(T));  // weight bytes one k step reads
  Vec acc[MM][NR];
  for (int64_t m = 0; m < MM; ++m)
    for (int64_t j = 0; j < NR; ++j) acc[m][j] = Vec(0.f);
  const T* wr[NR];
  for (int64_t j = 0; j < NR; ++j) wr[j] = s.w + (n0 + std::min(j, nn - 1)) * K;  // a short tile repeats its last row
  // the tile's rows are one range of NR * K elements; prefetch it in order, as far ahead as the k steps read
  const char* stream = reinterpret_cast<const char*>(s.w + n0 * K) + PF_DIST;
  for (int64_t k = 0; k < Kv; k += W) {
    const char* p = stream + k * NR * static_cast<int64_t>(sizeof(T));
    for (int64_t b = 0; b < step_bytes; b += LINE) __builtin_prefetch(p + b, 0, 1);
    Vec wv[NR];
    for (int64_t j = 0; j < NR; ++j) wv[j] = Widen::load(wr[j] + k);
    for (int64_t m = 0; m < MM; ++m) {
      const Vec xv = Vec::loadu(xf + (m0 + m) * K + k);
      for (int64_t j = 0; j < NR; ++j) acc[m][j] = at::vec::fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int64_t m = 0; m < MM; ++m) {
    const float* xr = xf + (m0 + m) * K;
    for (int64_t j = 0; j < nn; ++j) {
      float v = hsum(acc[m][j]);
      for (int64_t k = Kv; k < K; ++k) v = std::fma(xr[k], Widen::scalar(wr[j][k]), v);
      y[(m0 + m) * ldy + s.c0 + n0 + j] = s.scale != nullptr ? v * s.scale[n0 + j] : v;
    }
  }
}

// Tiles of NR features over the segments, in order; `fn(segment, n0, nn)` for each tile in [lo, hi).
template <class T, class Fn>
inline void for_tiles(const std::vector<Segment<T>>& segs, int64_t lo, int64_t hi, const Fn& fn) {
  int64_t first = 0;  // the first tile index of segment i
  for (const Segment<T>& s : segs) {
    const int64_t count = (s.N + NR - 1) / NR;
    for (int64_t t = std::max(lo, first); t < std::min(hi, first + count); ++t) {
      const int64_t n0 = (t - first) * NR;
      fn(s, n0, std::min(NR, s.N - n0));
    }
    first += count;
  }
}

template <class T>
inline int64_t tile_count(const std::vector<Segment<T>>& segs) {
  int64_t n = 0;
  for (const Segment<T>& s : segs) n += (s.N + NR - 1) / NR;
  return n;
}

// at least 64 KiB of weights per task: a fork costs more than reading less
template <class T>
inline int64_t tile_grain(int64_t K) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, NR * K * static_cast<int64_t>(sizeof(T))));
}

// y [M, ldy] (columns of each segment at its c0) = xf [M, K] fp32 times the segments' weights
template <class T, class Widen>
void run(const float* xf, const std::vector<Segment<T>>& segs, float* y, int64_t M, int64_t K, int64_t ldy) {
  const int64_t Kv = K / W * W;
  at::parallel_for(0, tile_count(segs), tile_grain<T>(K), [&](int64_t lo, int64_t hi) {
    for_tiles(segs, lo, hi, [&](const Segment<T>& s, int64_t n0, int64_t nn) {
      int64_t m0 = 0;
      for (; m0 + MR <= M; m0 += MR) tile<T, Widen, MR>(xf, s, y, K, Kv, ldy, n0, nn, m0);
      switch (M - m0) {
        case 3: tile<T, Widen, 3>(xf, s, y, K, Kv, ldy, n0, nn, m0); break;
        case 2: tile<T, Widen, 2>(xf, s, y, K, Kv, ldy, n0, nn, m0); break;
        case 1: tile<T, Widen, 1>(xf, s, y, K, Kv, ldy, n0, nn, m0); break;
        default: break;
      }
    });
  });
}

}  // namespace neuron_opt_gemv
