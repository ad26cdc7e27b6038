// CPU kernels for packed weights (AVX2 + FMA + F16C): routed-expert SwiGLU over expert blobs, the quantized
// dense linear, and the decode step built on them (a block's attention and feed-forward, every layer of a step:
// kernels/cpu_decode.py, whose twin is model.py's eager path). Built at first use by kernels/cpu_build.py; the
// pure-PyTorch twins in kernels/cpu_experts.py and kernels/cpu_linear.py define the same math. Weights are decoded
// in registers and never written out:
//   f32   plain fp32 weights (the decode step's unpacked linears, dense fp32 experts)
//   bf16  w = bits << 16                         x in fp32 (even/odd 8-lane halves of each 16-chunk)
//   fp8   e4m3 -> fp32 bits by shifts (= w * 2^-120) against x * 2^100; each 128-block's partial dot times s
//   int4  nibbles (q) against x quantized to int8 per group: s * xs * (sum q*xq - z * sum xq)
//   int8  signed bytes against x quantized to int8 per group: s * xs * sum q*xq
// One row's dot for up to 4 tokens runs the same operations in the same order for each token, so a token's
// result does not depend on how many tokens share the call. Compiled with -ffp-contract=off: the only fused
// multiply-adds are the written ones.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Fmt : int64_t { BF16 = 0, FP8 = 1, INT4 = 2, INT8 = 3, F32 = 4, MXFP4 = 5 };   // F32: plain fp32 weights (dense, the decode step)
constexpr int64_t INT4G32 = 6;   // symmetric int4, group 32, bf16 scales (compressed-tensors' packing): its section below
constexpr int MAX_TOK = 4;       // tokens per row pass
constexpr int FP8_BLOCK = 128;
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096      // weights are read this far ahead of use (measured: 1 thread, int4, 4.2 -> 3.2 ms)
#endif

// weight bytes stream from memory: ask for the line PREFETCH_BYTES ahead (rows are contiguous, so across rows too)
inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
}

// ---- activations, prepared once per (token, matrix input) --------------------------------------------------
// float formats: K floats (bf16: each full 16-chunk as its 8 even then 8 odd elements; fp8: each full 32-chunk as
//   elements 0, 4, .., 28, then 2, 6, .., then 1, 5, .., then 3, 7, .. (fp8x32's order), times 2^e, and 2^(120 - e)
//   after them)
// int8-quantized (int4, int8 weights): xq int8 [Kp] (int4: each 64-chunk as the 32 elements of the low nibbles
//   then the 32 of the high nibbles), xs float [G] (group scale), c float [G] (xs * sum of the group's xq),
//   and for int8 weights |xq| uint8 [Kp].
struct Act {
  float unscale = 1.f;            // fp8: 2^(120 - e), the activation was stored times 2^e
  const float* f = nullptr;
  const int8_t* q = nullptr;
  const uint8_t* aq = nullptr;
  const float* xs = nullptr;
  const float* c = nullptr;
  const int32_t* off = nullptr;   // int4g32 (its section below)
};

struct ActSize;                   // int4g32's activations: defined in its section below
int64_t int4g32_act_bytes(const ActSize& s);
Act int4g32_act_view(uint8_t* base, const ActSize& s);
void int4g32_prepare(const float* x, const ActSize& s, uint8_t* base);

// bytes of one prepared activation of length k
struct ActSize {
  int64_t fmt, k, kp, groups, group;
  int64_t bytes() const {
    if (fmt == INT4G32) return int4g32_act_bytes(*this);
    if (fmt == BF16 || fmt == FP8 || fmt == F32) return ((k * 4 + 4 + 63) / 64) * 64;
    int64_t b = ((kp + 63) / 64) * 64 + ((groups * 8 + 63) / 64) * 64;
    if (fmt == INT8) b += ((kp + 63) / 64) * 64;
    return b;
  }
};

inline ActSize act_size(int64_t fmt, int64_t k, int64_t group) {
  ActSize s{fmt, k, k, 0, group};
  if (fmt == INT4 || fmt == INT8 || fmt == INT4G32) {
    s.kp = (k + group - 1) / group * group;
    s.groups = s.kp / group;
  }
  return s;
}

inline Act act_view(uint8_t* base, const ActSize& s) {
  if (s.fmt == INT4G32) return int4g32_act_view(base, s);
  Act a;
  if (s.fmt == BF16 || s.fmt == FP8 || s.fmt == F32) {
    a.f = reinterpret_cast<const float*>(base);
    if (s.fmt == FP8) a.unscale = a.f[s.k];
    return a;
  }
  int64_t qb = ((s.kp + 63) / 64) * 64;
  a.q = reinterpret_cast<const int8_t*>(base);
  float* xs = reinterpret_cast<float*>(base + qb);
  a.xs = xs;
  a.c = xs + s.groups;
  if (s.fmt == INT8) a.aq = base + qb + ((s.groups * 8 + 63) / 64) * 64;
  return a;
}

// position in the kernel order of element j (int4, within 64-chunks: low-nibble elements then high-nibble ones)
inline int64_t int4_pos(int64_t j, int64_t g) {
  int64_t grp = j / g, in = j % g, half = g / 2;
  int64_t byte = in % half, hi = in / half;            // element j lives in byte `byte` of its group
  int64_t b = grp * half + byte;                       // byte index in the row
  int64_t chunk = b / 32, lane = b % 32;
  return chunk * 64 + hi * 32 + lane;
}

constexpr int FP8_X_EXP = 100;   // activations times 2^100 against weights times 2^-120, unless that overflows

void prepare(const float* x, const ActSize& s, uint8_t* base) {
  if (s.fmt == INT4G32) return int4g32_prepare(x, s, base);
  if (s.fmt == F32) {
    std::memcpy(base, x, s.k * sizeof(float));
    return;
  }
  if (s.fmt == FP8) {
    float* f = reinterpret_cast<float*>(base);
    float amax = 0.f;
    for (int64_t j = 0; j < s.k; ++j) amax = std::max(amax, std::fabs(x[j]));
    int e = FP8_X_EXP;
    if (amax > 0.f) e = std::min(e, 126 - std::ilogb(amax));      // |x| * 2^e < 2^127: finite
    const float up = std::ldexp(1.0f, e);
    int64_t full = s.k / 32 * 32;
    constexpr int byte_of[4] = {0, 2, 1, 3};                    // fp8x32's vector order
    for (int64_t c = 0; c < full; c += 32)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 8; ++i) f[c + 8 * j + i] = x[c + 4 * i + byte_of[j]] * up;
    for (int64_t j = full; j < s.k; ++j) f[j] = x[j] * up;
    f[s.k] = std::ldexp(1.0f, 120 - e);
    return;
  }
  if (s.fmt == BF16) {
    float* f = reinterpret_cast<float*>(base);
    int64_t full = s.k / 16 * 16;
    for (int64_t c = 0; c < full; c += 16)
      for (int i = 0; i < 8; ++i) {
        f[c + i] = x[c + 2 * i];
        f[c + 8 + i] = x[c + 2 * i + 1];
      }
    for (int64_t j = full; j < s.k; ++j) f[j] = x[j];
    return;
  }
  int64_t qb = ((s.kp + 63) / 64) * 64;
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* xs = reinterpret_cast<float*>(base + qb);
  float* c = xs + s.groups;
  uint8_t* aq = s.fmt == INT8 ? base + qb + ((s.groups * 8 + 63) / 64) * 64 : nullptr;
  std::memset(q, 0, qb);
  for (int64_t g = 0; g < s.groups; ++g) {
    int64_t j0 = g * s.group, j1 = std::min(j0 + s.group, s.k);
    float amax = 0.f;
    for (int64_t j = j0; j < j1; ++j) amax = std::max(amax, std::fabs(x[j]));
    float inv = amax > 0.f ? 127.0f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = j0; j < j1; ++j) {
      float v = std::nearbyint(x[j] * inv);
      int8_t qi = static_cast<int8_t>(v);
      sum += qi;
      q[s.fmt == INT4 ? int4_pos(j, s.group) : j] = qi;
    }
    xs[g] = amax / 127.0f;
    c[g] = xs[g] * static_cast<float>(sum);
  }
  if (aq)
    for (int64_t j = 0; j < s.kp; ++j) aq[j] = static_cast<uint8_t>(std::abs(static_cast<int>(q[j])));
}

// ---- horizontal sums ---------------------------------------------------------------------------------------
__attribute__((always_inline)) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- one weight row against nt prepared activations ------------------------------------------------------
// Each returns out[t] = dot(row, x_t) for t < nt.

template <int NT>
void row_bf16(const uint16_t* w, int64_t k, const Act* a, float* out) {
  __m256 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t full = k / 16 * 16;
  for (int64_t c = 0; c < full; c += 16) {
    if (!(c & 31)) prefetch(w + c);
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
    __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
    for (int t = 0; t < NT; ++t) {
      acc0[t] = _mm256_fmadd_ps(we, _mm256_loadu_ps(a[t].f + c), acc0[t]);
      acc1[t] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(a[t].f + c + 8), acc1[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    float s = hsum(_mm256_add_ps(acc0[t], acc1[t]));
    for (int64_t j = full; j < k; ++j) s += bf16_to_f32(w[j]) * a[t].f[j];
    out[t] = s;
  }
}

template <int NT>
void row_f32(const float* w, int64_t k, const Act* a, float* out) {
  __m256 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  int64_t full = k / 16 * 16;
  for (int64_t c = 0; c < full; c += 16) {
    prefetch(w + c);
    __m256 w0 = _mm256_loadu_ps(w + c), w1 = _mm256_loadu_ps(w + c + 8);
    for (int t = 0; t < NT; ++t) {
      acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[t].f + c), acc0[t]);
      acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a[t].f + c + 8), acc1[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    float s = hsum(_mm256_add_ps(acc0[t], acc1[t]));
    for (int64_t j = full; j < k; ++j) s += w[j] * a[t].f[j];
    out[t] = s;
  }
}

// e4m3 in fp32 bits, without F16C: sign to bit 31, the 7 exponent and mantissa bits to bits 26..20, so the float
// is the e4m3 value times 2^-120 exactly (e4m3 subnormals become fp32 subnormals). Activations carry 2^FP8_X_EXP
// (prepare), so products stay normal; 2^(120 - FP8_X_EXP) goes back into the block scale.
inline float fp8_bits_f32(uint8_t b) {
  uint32_t u = (static_cast<uint32_t>(b & 0x7F) << 20) | (static_cast<uint32_t>(b & 0x80) << 24);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 32 e4m3 bytes -> four fp32 vectors. In 16-bit lanes, each byte's sign goes to bit 15 and its 7 other bits to bits
// 10..4: the bf16 of the e4m3 value times 2^-120; a bf16 in the low or high half of a 32-bit lane is an fp32 after
// a shift or a mask. Vector j, lane i holds element 4i + (0, 2, 1, 3)[j] (x is permuted to match).
inline void fp8x32(const uint8_t* p, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi16(static_cast<short>(0x87F0));
  const __m256i hi16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4), mask);   // bytes 0, 2 of a lane
  const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(v, 4), mask);                           // bytes 1, 3
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(even, 16));      // byte 0 of each 32-bit lane
  w1 = _mm256_castsi256_ps(_mm256_and_si256(even, hi16));     // byte 2
  w2 = _mm256_castsi256_ps(_mm256_slli_epi32(odd, 16));       // byte 1
  w3 = _mm256_castsi256_ps(_mm256_and_si256(odd, hi16));      // byte 3
}

template <int NT>
void row_fp8(const uint8_t* w, const float* srow, int64_t k, const Act* a, float* out) {
  // srow: the block scales of this row's 128-row band, one per 128 columns
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  int64_t full = k / 32 * 32;
  for (int64_t b0 = 0; b0 < full; b0 += FP8_BLOCK) {
    int64_t b1 = std::min<int64_t>(b0 + FP8_BLOCK, full);
    __m256 blk0[NT], blk1[NT];
    for (int t = 0; t < NT; ++t) blk0[t] = blk1[t] = _mm256_setzero_ps();
    for (int64_t c = b0; c < b1; c += 32) {
      if (!(c & 63)) prefetch(w + c);
      __m256 w0, w1, w2, w3;
      fp8x32(w + c, w0, w1, w2, w3);
      for (int t = 0; t < NT; ++t) {
        const float* x = a[t].f + c;
        blk0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), blk0[t]);
        blk1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), blk1[t]);
        blk0[t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), blk0[t]);
        blk1[t] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), blk1[t]);
      }
    }
    __m256 s = _mm256_set1_ps(srow[b0 / FP8_BLOCK]);
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(_mm256_add_ps(blk0[t], blk1[t]), s, acc[t]);
  }
  for (int t = 0; t < NT; ++t) {
    float r = hsum(acc[t]);
    if (full < k) {
      float tail = 0.f;
      for (int64_t j = full; j < k; ++j) tail += fp8_bits_f32(w[j]) * a[t].f[j];
      // the tail's block: columns full..k-1 share one block with [full/128*128, ...)
      r += tail * srow[full / FP8_BLOCK];
    }
    out[t] = r * a[t].unscale;
  }
}

// int4: qw [Kp/2] bytes, scales/zeros fp16 [G]; sf/szf: this row's scales and scale*zero as fp32 (caller)
template <int NT, int G>
void row_int4(const uint8_t* qw, const float* sf, const float* szf, int64_t groups, const Act* a, float* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (G == 128) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = qw + g * 64;
      prefetch(p);
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      __m256i l0 = _mm256_and_si256(v0, m4), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
      __m256i l1 = _mm256_and_si256(v1, m4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
      __m256 sv = _mm256_set1_ps(sf[g]);
      for (int t = 0; t < NT; ++t) {
        const __m256i* x = reinterpret_cast<const __m256i*>(a[t].q + g * 128);
        __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(l0, _mm256_loadu_si256(x)),
                                     _mm256_maddubs_epi16(h0, _mm256_loadu_si256(x + 1)));
        d = _mm256_add_epi16(d, _mm256_add_epi16(_mm256_maddubs_epi16(l1, _mm256_loadu_si256(x + 2)),
                                                 _mm256_maddubs_epi16(h1, _mm256_loadu_si256(x + 3))));
        __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones));
        acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(sv, _mm256_set1_ps(a[t].xs[g])), acc[t]);
      }
    }
  } else {  // G == 64: one group per 32-byte load; G == 32: two (s32 lanes 0-3 the first, 4-7 the second)
    constexpr int per = G == 64 ? 1 : 2;
    auto pair = [](const float* v, int64_t g) {
      return per == 1 ? _mm256_set1_ps(v[g]) : _mm256_set_m128(_mm_set1_ps(v[g + 1]), _mm_set1_ps(v[g]));
    };
    for (int64_t g = 0; g < groups; g += per) {
      const uint8_t* p = qw + g * G / 2;
      if (!((g * G / 2) & 63)) prefetch(p);
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      __m256i l = _mm256_and_si256(v, m4), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      __m256 sv = pair(sf, g);
      for (int t = 0; t < NT; ++t) {
        const __m256i* x = reinterpret_cast<const __m256i*>(a[t].q + g * G);
        __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(l, _mm256_loadu_si256(x)),
                                     _mm256_maddubs_epi16(h, _mm256_loadu_si256(x + 1)));
        __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones));
        acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(sv, pair(a[t].xs, g)), acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    // zero-point term: sum_g s_g z_g c_g (c_g = xs_g * sum of the group's xq)
    __m256 zacc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
      zacc = _mm256_fmadd_ps(_mm256_loadu_ps(szf + g), _mm256_loadu_ps(a[t].c + g), zacc);
    float z = hsum(zacc);
    for (; g < groups; ++g) z += szf[g] * a[t].c[g];
    out[t] = hsum(acc[t]) - z;
  }
}

// int8: q [Kp] signed bytes, scales fp32 [G] (group 128)
template <int NT>
void row_int8(const int8_t* qw, const float* sf, int64_t groups, const Act* a, float* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    prefetch(qw + g * 128);
    prefetch(qw + g * 128 + 64);
    __m256i w[4];
    for (int i = 0; i < 4; ++i) w[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * 128 + 32 * i));
    __m256 sv = _mm256_set1_ps(sf[g]);
    for (int t = 0; t < NT; ++t) {
      const __m256i* xq = reinterpret_cast<const __m256i*>(a[t].q + g * 128);
      const __m256i* ax = reinterpret_cast<const __m256i*>(a[t].aq + g * 128);
      __m256i d = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        __m256i sw = _mm256_sign_epi8(w[i], _mm256_loadu_si256(xq + i));      // w * sign(x)
        d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256(ax + i), sw), ones));
      }
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sv, _mm256_set1_ps(a[t].xs[g])), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
}

// ---- int4g32: symmetric int4, group 32, bf16 scales, packed as compressed-tensors packs them ------------------
// (Kimi-K2-Thinking / K2.5's released experts; quant/int4g32.py.) A weight row is K/2 bytes, byte b holding k = 2b in
// its low nibble and 2b + 1 in its high one, each as q + 8; one bf16 scale per 32 k. Activations, per token: xq int8
// [Kp rounded up to 64], each 64-chunk as its 32 even elements then its 32 odd ones (a 32-byte load's low nibbles
// meet the first 32 bytes of its chunk, its high nibbles the next 32); xs4 float and off int32 [Gp * 4] (Gp: the
// groups rounded up to even): group g's xs in lanes 4g..4g+3, and 8 * the sum of its xq in lane 4g, zeros elsewhere.
// A 32-byte load holds two groups, whose integer dots land in int32 lanes 0-3 and 4-7:
//   dot = sum_g s_g * xs_g * (sum_k nibble_k * xq_k - 8 * sum_k xq_k)    (the integer part exact)
// An odd last group runs the same steps on 16 bytes.
inline int64_t int4g32_pos(int64_t j) { return j / 64 * 64 + (j & 1) * 32 + (j % 64) / 2; }

struct Int4g32Sizes {
  int64_t qb, lanes, lane_bytes;   // bytes of xq; lanes of xs4 and off; bytes of each (64-aligned)
};

inline Int4g32Sizes int4g32_sizes(const ActSize& s) {
  const int64_t lanes = (s.groups + 1) / 2 * 8;
  return {(s.kp + 63) / 64 * 64, lanes, (lanes * 4 + 63) / 64 * 64};
}

int64_t int4g32_act_bytes(const ActSize& s) {
  const Int4g32Sizes z = int4g32_sizes(s);
  return z.qb + 2 * z.lane_bytes;
}

Act int4g32_act_view(uint8_t* base, const ActSize& s) {
  const Int4g32Sizes z = int4g32_sizes(s);
  Act a;
  a.q = reinterpret_cast<const int8_t*>(base);
  a.xs = reinterpret_cast<const float*>(base + z.qb);
  a.off = reinterpret_cast<const int32_t*>(base + z.qb + z.lane_bytes);
  return a;
}

// x quantized to int8 per group of 32 as prepare() does for int4 (and cpu_experts.quantize_activation)
void int4g32_prepare(const float* x, const ActSize& s, uint8_t* base) {
  const Int4g32Sizes z = int4g32_sizes(s);
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* xs = reinterpret_cast<float*>(base + z.qb);
  int32_t* off = reinterpret_cast<int32_t*>(base + z.qb + z.lane_bytes);
  std::memset(q, 0, z.qb);
  std::memset(xs, 0, z.lanes * 4);
  std::memset(off, 0, z.lanes * 4);
  for (int64_t g = 0; g < s.groups; ++g) {
    const int64_t j0 = g * 32, j1 = std::min(j0 + 32, s.k);
    float amax = 0.f;
    for (int64_t j = j0; j < j1; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = j0; j < j1; ++j) {
      const int8_t qi = static_cast<int8_t>(std::nearbyint(x[j] * inv));
      sum += qi;
      q[int4g32_pos(j)] = qi;
    }
    for (int l = 0; l < 4; ++l) xs[4 * g + l] = amax / 127.0f;
    off[4 * g] = 8 * sum;
  }
}

// two groups (32 weight bytes) of one row against NT tokens; sv: the groups' scales in lanes 0-3 and 4-7
template <int NT>
__attribute__((always_inline)) inline void int4g32_pair(const uint8_t* qw, int64_t g, __m256 sv, const Act* a,
                                                        __m256* acc) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * 16));
  const __m256i l = _mm256_and_si256(v, m4), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  for (int t = 0; t < NT; ++t) {
    const __m256i* x = reinterpret_cast<const __m256i*>(a[t].q + g * 32);
    const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(l, _mm256_loadu_si256(x)),
                                       _mm256_maddubs_epi16(h, _mm256_loadu_si256(x + 1)));
    const __m256i di = _mm256_sub_epi32(_mm256_madd_epi16(d, ones),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].off + g * 4)));
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(di), _mm256_mul_ps(sv, _mm256_loadu_ps(a[t].xs + g * 4)), acc[t]);
  }
}

// one row: qw [K/2] bytes, s16 its bf16 scales [groups]. Two accumulators per token, taking alternate pairs of
// groups: one multiply-add chain per token would wait on its own latency every 32 bytes.
template <int NT>
void row_int4g32(const uint8_t* qw, const uint16_t* s16, int64_t groups, const Act* a, float* out) {
  __m256 acc[NT], acc2[NT];
  for (int t = 0; t < NT; ++t) acc[t] = acc2[t] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {               // 8 groups: their scales widened once, spread by permutes
    prefetch(qw + g * 16);
    prefetch(qw + g * 16 + 64);
    if (!(g & 31)) prefetch(s16 + g);
    const __m256 s8 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + g))), 16));
    for (int p = 0; p < 4; ++p) {
      const __m256i spread = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
      int4g32_pair<NT>(qw, g + 2 * p, _mm256_permutevar8x32_ps(s8, spread), a, p & 1 ? acc2 : acc);
    }
  }
  for (; g + 2 <= groups; g += 2)
    int4g32_pair<NT>(qw, g, _mm256_set_m128(_mm_set1_ps(bf16_to_f32(s16[g + 1])), _mm_set1_ps(bf16_to_f32(s16[g]))),
                     a, acc);
  if (g < groups) {                               // an odd last group: the same steps on 16 bytes
    const __m128i m4 = _mm_set1_epi8(0x0F), ones = _mm_set1_epi16(1);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qw + g * 16));
    const __m128i l = _mm_and_si128(v, m4), h = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    const __m128 sv = _mm_set1_ps(bf16_to_f32(s16[g]));
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = a[t].q + g * 32;
      const __m128i d = _mm_add_epi16(_mm_maddubs_epi16(l, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x))),
                                      _mm_maddubs_epi16(h, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 32))));
      const __m128i di = _mm_sub_epi32(_mm_madd_epi16(d, ones),
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(a[t].off + g * 4)));
      const __m128 part = _mm_mul_ps(_mm_cvtepi32_ps(di), _mm_mul_ps(sv, _mm_loadu_ps(a[t].xs + g * 4)));
      acc[t] = _mm256_add_ps(acc[t], _mm256_set_m128(_mm_setzero_ps(), part));
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(_mm256_add_ps(acc[t], acc2[t]));
}

// ---- a weight matrix (one expert matrix, or a dense linear) ----------------------------------------------
struct Mat {
  int64_t fmt = BF16, n = 0, k = 0, group = 0;
  const uint8_t* w = nullptr;     // weight bytes [n, row_bytes]
  const uint8_t* s = nullptr;     // scales: fp8 float32 [ceil(n/128), ceil(k/128)]; int4 fp16 [n, G]; int8 fp32 [n, G]
  const uint8_t* z = nullptr;     // int4 zeros fp16 [n, G]
  int64_t groups() const { return (fmt == INT4 || fmt == INT8 || fmt == INT4G32) ? (k + group - 1) / group : 0; }
  int64_t row_bytes() const {
    switch (fmt) {
      case BF16: return k * 2;
      case F32: return k * 4;
      case FP8: return k;
      case INT4: case INT4G32: return groups() * group / 2;
      default: return groups() * group;
    }
  }
};

// How one-token row dots read a plain weight format: 16 weights as two fp32 vectors (row_f32's / row_bf16's lanes),
// one weight as fp32, a prefetch every `prefetch_every` weights, and the one-row kernel for leftover rows.
struct F32Weights {
  using T = float;
  static constexpr int prefetch_every = 16;
  static void load16(const float* p, __m256& w0, __m256& w1) {
    w0 = _mm256_loadu_ps(p);
    w1 = _mm256_loadu_ps(p + 8);
  }
  static float at(const float* p) { return *p; }
  static void row(const float* w, int64_t k, const Act* a, float* out) { row_f32<1>(w, k, a, out); }
};

struct BF16Weights {
  using T = uint16_t;
  static constexpr int prefetch_every = 32;
  static void load16(const uint16_t* p, __m256& w0, __m256& w1) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static float at(const uint16_t* p) { return bf16_to_f32(*p); }
  static void row(const uint16_t* w, int64_t k, const Act* a, float* out) { row_bf16<1>(w, k, a, out); }
};

// fp32 or bf16 rows against one activation, four rows at a time: four weight streams in flight (one row's stream
// leaves DRAM idle between its prefetches: 17 GB/s against 21-25 for four, fp32, 2 threads, V3's wo / wq_b; bf16
// experts 1.24x). Each row's dot runs the one-row kernel's operations in its order, so the bits are its bits.
template <class W>
void rows_one(const Mat& m, int64_t r0, int64_t r1, const Act* a, float* out) {
  using T = typename W::T;
  const int64_t k = m.k, full = k / 16 * 16;
  const float* x = a[0].f;
  const T* base = reinterpret_cast<const T*>(m.w);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const T* w[4];
    __m256 acc0[4], acc1[4];
    for (int i = 0; i < 4; ++i) {
      w[i] = base + (r + i) * k;
      acc0[i] = acc1[i] = _mm256_setzero_ps();
    }
    for (int64_t c = 0; c < full; c += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
      for (int i = 0; i < 4; ++i) {
        if (!(c % W::prefetch_every)) prefetch(w[i] + c);
        __m256 w0, w1;
        W::load16(w[i] + c, w0, w1);
        acc0[i] = _mm256_fmadd_ps(w0, x0, acc0[i]);
        acc1[i] = _mm256_fmadd_ps(w1, x1, acc1[i]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      float sum = hsum(_mm256_add_ps(acc0[i], acc1[i]));
      for (int64_t j = full; j < k; ++j) sum += W::at(w[i] + j) * x[j];
      out[r + i - r0] = sum;
    }
  }
  for (; r < r1; ++r) W::row(base + r * k, k, a, out + (r - r0));
}

// rows [r0, r1) of m against nt (<= MAX_TOK) activations; out[t * ostride + (r - r0)]
template <int NT>
void rows_nt(const Mat& m, int64_t r0, int64_t r1, const Act* a, float* out, int64_t ostride) {
  if (NT == 1 && (m.fmt == F32 || m.fmt == BF16)) {
    (m.fmt == F32 ? rows_one<F32Weights> : rows_one<BF16Weights>)(m, r0, r1, a, out);
    return;
  }
  const int64_t G = m.groups();
  float sf[1024], szf[1024];         // one row's group scales (and scale * zero) as fp32; G <= 1024 (MAX_GROUPS)
  float res[MAX_TOK];
  const int64_t fp8_cols = (m.k + FP8_BLOCK - 1) / FP8_BLOCK;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = m.w + r * m.row_bytes();
    switch (m.fmt) {
      case BF16:
        row_bf16<NT>(reinterpret_cast<const uint16_t*>(wr), m.k, a, res);
        break;
      case F32:
        row_f32<NT>(reinterpret_cast<const float*>(wr), m.k, a, res);
        break;
      case FP8:
        row_fp8<NT>(wr, reinterpret_cast<const float*>(m.s) + (r / FP8_BLOCK) * fp8_cols, m.k, a, res);
        break;
      case INT4: {
        const uint16_t* s16 = reinterpret_cast<const uint16_t*>(m.s) + r * G;
        const uint16_t* z16 = reinterpret_cast<const uint16_t*>(m.z) + r * G;
        int64_t g = 0;
        for (; g + 8 <= G; g += 8) {
          __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + g)));
          __m256 z = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z16 + g)));
          _mm256_storeu_ps(sf + g, s);
          _mm256_storeu_ps(szf + g, _mm256_mul_ps(s, z));
        }
        for (; g < G; ++g) {
          sf[g] = _cvtsh_ss(s16[g]);
          szf[g] = sf[g] * _cvtsh_ss(z16[g]);
        }
        if (m.group == 128) row_int4<NT, 128>(wr, sf, szf, G, a, res);
        else if (m.group == 64) row_int4<NT, 64>(wr, sf, szf, G, a, res);
        else row_int4<NT, 32>(wr, sf, szf, G, a, res);
        break;
      }
      case INT4G32:
        row_int4g32<NT>(wr, reinterpret_cast<const uint16_t*>(m.s) + r * G, G, a, res);
        break;
      default:
        row_int8<NT>(reinterpret_cast<const int8_t*>(wr), reinterpret_cast<const float*>(m.s) + r * G, G, a, res);
    }
    for (int t = 0; t < NT; ++t) out[t * ostride + (r - r0)] = res[t];
  }
}

void rows(const Mat& m, int64_t r0, int64_t r1, const Act* a, int nt, float* out, int64_t ostride) {
  switch (nt) {
    case 1: rows_nt<1>(m, r0, r1, a, out, ostride); break;
    case 2: rows_nt<2>(m, r0, r1, a, out, ostride); break;
    case 3: rows_nt<3>(m, r0, r1, a, out, ostride); break;
    default: rows_nt<4>(m, r0, r1, a, out, ostride); break;
  }
}

// ---- work distribution: threads take items from a shared counter ----------------------------------------
// OpenMP resolves to the runtime torch already loaded (same soname), so torch.set_num_threads applies here too.
template <class F>
void parallel_items(int64_t n_items, int nthreads, F&& fn) {
  const int nt = static_cast<int>(std::min<int64_t>(nthreads, n_items));
  if (nt <= 1) {
    for (int64_t i = 0; i < n_items; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(nt)
  for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) fn(i);
}

int thread_count(int threads, int64_t bytes_of_work) {
  int n = omp_get_max_threads();
  if (threads > 0) n = std::min(n, threads);
  if (bytes_of_work < (256 << 10)) n = 1;              // waking threads costs more than such work
  return std::max(n, 1);
}

// per-calling-thread scratch that only grows (no allocation per call in steady state)
uint8_t* scratch(std::vector<uint8_t>& buf, int64_t bytes) {
  if (static_cast<int64_t>(buf.size()) < bytes) buf.resize(bytes + 4096);
  return buf.data();
}

thread_local std::vector<uint8_t> tl_acts, tl_hidden, tl_pairs;

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// Expert descriptor (int64 [13]): format, group, inter (I), hidden (D), then for gate, up, down the byte
// offsets inside a blob of weight, scale, zero (-1: absent).
struct Desc {
  int64_t fmt, group, inter, hidden;
  int64_t off[3][3];
};

Desc read_desc(const int64_t* p) {
  Desc r{p[0], p[1], p[2], p[3], {}};
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j) r.off[i][j] = p[4 + 3 * i + j];
  return r;
}

Mat expert_mat(const Desc& d, const uint8_t* blob, int which) {
  Mat m;
  m.fmt = d.fmt;
  m.group = d.fmt == FP8 ? FP8_BLOCK : d.group;
  m.n = which == 2 ? d.hidden : d.inter;
  m.k = which == 2 ? d.inter : d.hidden;
  m.w = blob + d.off[which][0];
  m.s = d.off[which][1] >= 0 ? blob + d.off[which][1] : nullptr;
  m.z = d.off[which][2] >= 0 ? blob + d.off[which][2] : nullptr;
  return m;
}

constexpr int MAX_GROUPS = 1024;

// Work items of the kernels that read weight rows: up to ITEM_BYTES of weights (min_rows..MAX_RB rows), so that
// each thread reads long runs of consecutive rows, which the prefetchers follow (V4's short rows, K = 1024, in
// 32-row items: a second thread ran no faster than one; 1.4-2.1x at 2 threads with these), but at least
// ITEMS_PER_THREAD items a thread while min_rows-row items allow it (many cores: the load stays balanced).
// row_bytes: the bytes an item reads per row; rows: the rows all items cover.
constexpr int64_t ITEM_BYTES = 256 << 10, MAX_RB = 256, ITEMS_PER_THREAD = 4;

int64_t item_rows(int64_t row_bytes, int64_t rows, int nthreads, int64_t min_rows) {
  const int64_t by_bytes = std::clamp<int64_t>(ITEM_BYTES / std::max<int64_t>(1, row_bytes), min_rows, MAX_RB);
  const int64_t balanced = (rows + ITEMS_PER_THREAD * nthreads - 1) / (ITEMS_PER_THREAD * nthreads);
  return std::min(by_bytes, std::max(min_rows, balanced));
}

// Routed experts of one MoE layer, any blob format: `P` reads the blobs (StdExperts below: the Mat formats;
// MxExperts: MXFP4, in its section). Pairs (t, k) whose expert has a blob are grouped by ascending expert id (then
// t * K + k); phase 1 computes each pair's h = silu(min(gate x, limit)) * clamp(up x, -limit, limit) (limit +inf:
// the plain SwiGLU, the same bits), phase 2 its down projection, summed per token in ascending expert id (dsv3_moe).
template <class P>
int moe_grouped(const P& p, const float* xp, int64_t T, const int64_t* idp, const float* wp, int64_t K,
                const int64_t* pp, int64_t E, float* op, int per_pair, int threads, float limit) {
  using A = typename P::A;
  const int64_t D = p.hidden, I = p.inter, NP = T * K;
  // begin[e]..begin[e + 1] index `order` (pair indices); `used`: the ids with pairs, ascending
  int64_t* begin = reinterpret_cast<int64_t*>(scratch(tl_pairs, (3 * E + 1 + NP) * 8));
  int64_t* cursor = begin + E + 1;
  int64_t* order = cursor + E;
  int64_t* used = order + NP;
  std::fill(begin, begin + E + 1, 0);
  for (int64_t i = 0; i < NP; ++i) {
    if (idp[i] < 0 || idp[i] >= E) return -1;
    begin[idp[i] + 1] += pp[idp[i]] != 0;
  }
  int64_t n_used = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (begin[e + 1]) used[n_used++] = e;
    begin[e + 1] += begin[e];
  }
  const int64_t NU = begin[E];
  std::copy(begin, begin + E, cursor);
  for (int64_t i = 0; i < NP; ++i)             // stable: ascending t * K + k within an expert
    if (pp[idp[i]]) order[cursor[idp[i]]++] = i;
  if (!per_pair) std::memset(op, 0, T * D * sizeof(float));
  if (NU == 0) return 0;

  const int64_t xb = p.act_bytes(false), hb = p.act_bytes(true);
  uint8_t* abuf = scratch(tl_acts, T * xb + NU * hb);
  uint8_t* hprep = abuf + T * xb;
  float* hbuf = reinterpret_cast<float*>(scratch(tl_hidden, NU * I * 4));
  const int nthreads = thread_count(threads, p.expert_bytes() * n_used);
  parallel_items(T, T * D >= 65536 ? nthreads : 1, [&](int64_t t) { p.prepare(xp + t * D, false, abuf + t * xb); });

  // phase 1: gate, up, the (clamped) SwiGLU. Items: (expert, block of RB1 rows of I), sized as a linear's
  const int64_t RB1 = item_rows(2 * p.expert_bytes() / (3 * I), I * n_used, nthreads, 64);
  const int64_t blocks1 = (I + RB1 - 1) / RB1;
  parallel_items(n_used * blocks1, nthreads, [&](int64_t item) {
    const int64_t e = used[item / blocks1], r0 = item % blocks1 * RB1, r1 = std::min(r0 + RB1, I);
    const uint8_t* blob = reinterpret_cast<const uint8_t*>(pp[e]);
    float g[MAX_TOK * MAX_RB], u[MAX_TOK * MAX_RB];
    for (int64_t p0 = begin[e]; p0 < begin[e + 1]; p0 += MAX_TOK) {
      const int nt = static_cast<int>(std::min<int64_t>(MAX_TOK, begin[e + 1] - p0));
      A a[MAX_TOK];
      for (int i = 0; i < nt; ++i) a[i] = p.view(abuf + order[p0 + i] / K * xb, false);
      p.rows(blob, 0, r0, r1, a, nt, g, RB1);
      p.rows(blob, 1, r0, r1, a, nt, u, RB1);
      for (int i = 0; i < nt; ++i)
        for (int64_t r = r0; r < r1; ++r)
          hbuf[(p0 + i) * I + r] = silu(std::min(g[i * RB1 + r - r0], limit)) *
                                   std::min(std::max(u[i * RB1 + r - r0], -limit), limit);
    }
  });
  parallel_items(NU, NU * I >= 16384 ? nthreads : 1,
                 [&](int64_t q) { p.prepare(hbuf + q * I, true, hprep + q * hb); });

  // phase 2: down and the weighted sum. Items: blocks of RB2 rows of D; experts ascending inside each.
  const int64_t RB2 = item_rows(n_used * p.expert_bytes() / (3 * D), D, nthreads, 64);
  parallel_items((D + RB2 - 1) / RB2, nthreads, [&](int64_t item) {
    const int64_t r0 = item * RB2, r1 = std::min(r0 + RB2, D);
    float y[MAX_TOK * MAX_RB];
    for (int64_t j = 0; j < n_used; ++j) {
      const int64_t e = used[j];
      const uint8_t* blob = reinterpret_cast<const uint8_t*>(pp[e]);
      for (int64_t p0 = begin[e]; p0 < begin[e + 1]; p0 += MAX_TOK) {
        const int nt = static_cast<int>(std::min<int64_t>(MAX_TOK, begin[e + 1] - p0));
        A a[MAX_TOK];
        for (int i = 0; i < nt; ++i) a[i] = p.view(hprep + (p0 + i) * hb, true);
        p.rows(blob, 2, r0, r1, a, nt, y, RB2);
        for (int i = 0; i < nt; ++i) {
          const int64_t pair = order[p0 + i];
          const float* yi = y + i * RB2;
          if (per_pair) {
            std::memcpy(op + pair * D + r0, yi, (r1 - r0) * sizeof(float));
          } else {
            float* o = op + pair / K * D;
            const float w = wp[pair];
            for (int64_t r = r0; r < r1; ++r) o[r] = o[r] + yi[r - r0] * w;
          }
        }
      }
    }
  });
  return 0;
}

// moe_grouped's reader of the Mat formats' blobs (bf16, fp8, int4, int8, f32, int4g32)
struct StdExperts {
  using A = Act;
  Desc d;
  int64_t inter, hidden;
  ActSize xsz, hsz;
  explicit StdExperts(const int64_t* desc) : d(read_desc(desc)), inter(d.inter), hidden(d.hidden) {
    const int64_t grp = d.fmt == FP8 ? FP8_BLOCK : d.group;
    xsz = act_size(d.fmt, hidden, grp);
    hsz = act_size(d.fmt, inter, grp);
  }
  bool fits() const { return xsz.groups <= MAX_GROUPS && hsz.groups <= MAX_GROUPS; }
  int64_t act_bytes(bool h) const { return (h ? hsz : xsz).bytes(); }
  int64_t expert_bytes() const { return expert_mat(d, nullptr, 0).row_bytes() * inter * 3; }
  void prepare(const float* x, bool h, uint8_t* base) const { ::prepare(x, h ? hsz : xsz, base); }
  Act view(uint8_t* base, bool h) const { return act_view(base, h ? hsz : xsz); }
  void rows(const uint8_t* blob, int which, int64_t r0, int64_t r1, const Act* a, int nt, float* out,
            int64_t ostride) const {
    ::rows(expert_mat(d, blob, which), r0, r1, a, nt, out, ostride);
  }
};

}  // namespace

extern "C" {

// The code of a weight format by name (quant/table.py's cpu codes; kernels/cpu_abi.py checks them when the library
// loads), -1 for a name this library does not know.
int64_t dsv3_format_code(const char* name) {
  static const struct { const char* name; int64_t code; } codes[] = {
      {"bf16", BF16}, {"fp8", FP8}, {"int4", INT4}, {"int8", INT8}, {"f32", F32}, {"mxfp4", MXFP4},
      {"int4g32", INT4G32}};
  for (const auto& c : codes)
    if (std::strcmp(c.name, name) == 0) return c.code;
  return -1;
}

// dsv3_moe: defined after the MXFP4 section (its reader of MXFP4 blobs lives there)
int dsv3_moe(const float* xp, int64_t T, const int64_t* idp, const float* wp, int64_t K, const int64_t* pp,
             int64_t E, const int64_t* desc, float* op, int per_pair, int threads, float limit, int act);

// Dense linear: out [T, N] = x [T, K] @ W^T for one packed matrix: fmt, group; w the weight bytes, s the scales,
// z the zeros (int4) or null. Returns 0, or -2 for too many groups.
// a linear's work items (rows of m, n_rows of them): item_rows, at least 32 rows
int64_t linear_item_rows(const Mat& m, int64_t n_rows, int nthreads) {
  return item_rows(m.row_bytes(), n_rows, nthreads, 32);
}

int dsv3_linear(const float* xp, int64_t T, int64_t k, int64_t fmt, int64_t group, int64_t n, const void* w,
                const void* s, const void* z, float* op, int threads) {
  Mat m;
  m.fmt = fmt;
  m.n = n;
  m.k = k;
  m.group = fmt == FP8 ? FP8_BLOCK : group;
  m.w = static_cast<const uint8_t*>(w);
  m.s = static_cast<const uint8_t*>(s);
  m.z = static_cast<const uint8_t*>(z);
  if (m.groups() > MAX_GROUPS) return -2;
  const ActSize xsz = act_size(fmt, k, m.group);
  uint8_t* abuf = scratch(tl_acts, T * xsz.bytes());
  const int nthreads = thread_count(threads, m.row_bytes() * n * std::max<int64_t>(1, T / 4));
  parallel_items(T, T * k >= 65536 ? nthreads : 1,
                 [&](int64_t t) { prepare(xp + t * k, xsz, abuf + t * xsz.bytes()); });
  const int64_t RB = linear_item_rows(m, n, nthreads);
  const int64_t tblocks = (T + MAX_TOK - 1) / MAX_TOK, rblocks = (n + RB - 1) / RB;
  // rows outer, tokens inner: a block of weight rows stays in cache while the tokens pass over it
  parallel_items(rblocks, nthreads, [&](int64_t item) {
    const int64_t r0 = item * RB, r1 = std::min(r0 + RB, n);
    float y[MAX_TOK * MAX_RB];
    for (int64_t tb = 0; tb < tblocks; ++tb) {
      const int64_t t0 = tb * MAX_TOK;
      const int nt = static_cast<int>(std::min<int64_t>(MAX_TOK, T - t0));
      Act a[MAX_TOK];
      for (int i = 0; i < nt; ++i) a[i] = act_view(abuf + (t0 + i) * xsz.bytes(), xsz);
      rows(m, r0, r1, a, nt, y, RB);
      for (int i = 0; i < nt; ++i) std::memcpy(op + (t0 + i) * n + r0, y + i * RB, (r1 - r0) * sizeof(float));
    }
  });
  return 0;
}

// FP8 block dequantization to bf16 (checkpoint loading): out[i, j] = bf16(fp32(q[i, j]) * s[i / 128, j / 128]),
// one fp32 multiply and one round-to-nearest-even, NaN codes to the bf16 NaN torch gives them (0xffff). q [n, k]
// e4m3 bytes, s float [ceil(n / 128), ceil(k / 128)], out [n, k] bf16 bits. Rows in parallel.
int dsv3_fp8_dequant(const uint8_t* q, const float* s, uint16_t* out, int64_t n, int64_t k, int threads) {
  float lut[256];
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 15, mant = c & 7;
    float v = (c & 127) == 127 ? NAN : (e == 0 ? std::ldexp(static_cast<float>(mant), -9)
                                                : std::ldexp(static_cast<float>(8 + mant), e - 10));
    lut[c] = (c & 128) ? -v : v;
  }
  const int64_t kb = (k + FP8_BLOCK - 1) / FP8_BLOCK;
  const int nthreads = thread_count(threads, n * k);
  parallel_items(n, nthreads, [&](int64_t i) {
    const uint8_t* qi = q + i * k;
    const float* si = s + (i / FP8_BLOCK) * kb;
    uint16_t* oi = out + i * k;
    for (int64_t j0 = 0; j0 < k; j0 += FP8_BLOCK) {
      const float sc = si[j0 / FP8_BLOCK];
      const int64_t j1 = std::min(j0 + FP8_BLOCK, k);
      for (int64_t j = j0; j < j1; ++j) {
        const float v = lut[qi[j]] * sc;
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        oi[j] = std::isnan(v) ? 0xffff : static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
      }
    }
  });
  return 0;
}

}  // extern "C"

// ==== the CPU decode step: one block's attention, one block's feed-forward (kernels/cpu_decode.py) =============
// model.py's Block.attention and Block.feed_forward for batch 1 on fp32 activations, a few tokens a call: absorbed
// attention over the layer's latent cache, each token over the rows up to its own; the row dots per token as above.
// So a token's result does not depend on how many tokens share the call (MTP verification gets a decode step's bits).
namespace {

struct Lin {                       // one weight matrix [n, k] in a Mat format (F32 / BF16: a plain tensor)
  int64_t fmt, n, k, group;
  const void* w;
  const void* s;
  const void* z;
};

struct AttnDesc {
  Lin wq_a, wq_b, wkv_a, wo;       // wq_a.w null: no q_lora (wq_b is then wq)
  const float* attn_norm;
  const float* q_norm;
  const float* kv_norm;
  const float* wkv_b;              // [H * (dn + dv), kv_lora]
  int64_t dim, heads, q_lora, dn, dr, dv, kv_lora, cache_dim, interleave;
  float eps, latent_eps, softmax_scale, unused;
};

struct FfnDesc {
  Lin w1, w3, w2;                  // the dense MLP, or the MoE layer's shared experts (w1.w null: none)
  const float* norm;
  const float* gate_w;             // router [E, D] fp32; null: a dense layer
  const float* gate_bias;          // [E] or null
  const int64_t* expert_ptrs;      // [E] blob addresses, as dsv3_moe's
  const int64_t* expert_desc;      // [13], as dsv3_moe's
  int64_t dim, n_experts, topk, n_group, topk_group, softmax, method, norm_topk;   // method: 0 greedy,
  float eps, scaling;                                                             // 1 group-limited, 2 noaux_tc
};

constexpr int MAX_ROPE = 256;            // widths the decode step holds on the stack (kernels/cpu_decode.py)
constexpr int MAX_ROUTER_GROUPS = 1024;

int linear(const Lin& l, const float* x, int64_t T, float* y, int threads) {
  return dsv3_linear(x, T, l.k, l.fmt, l.group, l.n, l.w, l.s, l.z, y, threads);
}

float* floats(std::vector<uint8_t>& buf, int64_t n) { return reinterpret_cast<float*>(scratch(buf, n * 4)); }

thread_local std::vector<uint8_t> tl_step, tl_head;

float dot(const float* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x + j + 8), a1);
  }
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; j < n; ++j) s += w[j] * x[j];
  return s;
}

void axpy(float alpha, const float* w, float* y, int64_t n) {          // y += alpha * w
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(y + j, _mm256_fmadd_ps(a, _mm256_loadu_ps(w + j), _mm256_loadu_ps(y + j)));
  for (; j < n; ++j) y[j] += alpha * w[j];
}

// RMSNorm as model.py's: statistics in fp32, then weight * (x * rsqrt(mean(x^2) + eps)); out may be x
void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; j < n; ++j) ss += x[j] * x[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (j = 0; j < n; ++j) out[j] = w[j] * (x[j] * r);
}

// model.py's apply_rope for one vector of dr values: interleaved pairs (2i, 2i + 1) become [evens | odds] (or NeoX
// halves), then x * cos + swap_halves(x) * sin with Rotary's tables cos = [c | c], sin = [-s | s]
void rope(const float* x, const float* cos, const float* sin, int64_t dr, bool interleave, float* out) {
  const int64_t half = dr / 2;
  float tmp[MAX_ROPE];
  for (int64_t i = 0; i < half; ++i) {
    const float a = interleave ? x[2 * i] : x[i], b = interleave ? x[2 * i + 1] : x[half + i];
    tmp[i] = a * cos[i] + b * sin[i];
    tmp[half + i] = b * cos[half + i] + a * sin[half + i];
  }
  std::memcpy(out, tmp, dr * sizeof(float));
}

// one head's absorbed attention over cache rows [0, T): q_abs = q_nope @ W_UK, scores over [latent | k_pe],
// softmax, the latent-weighted sum, then @ W_UV^T -> o [dv]
void attend_head(const AttnDesc& d, const float* wkv_b, const float* qn, const float* cache, int64_t T,
                 const float* cos, const float* sin, float* o) {
  const int64_t L = d.kv_lora, R = d.dr, C = d.cache_dim;
  float* buf = floats(tl_head, 2 * L + R + T);
  float *qf = buf, *ol = buf + L + R, *s = ol + L;
  std::fill(qf, qf + L, 0.f);
  for (int64_t i = 0; i < d.dn; ++i) axpy(qn[i], wkv_b + i * L, qf, L);
  rope(qn + d.dn, cos, sin, R, d.interleave != 0, qf + L);
  float m = -INFINITY;
  for (int64_t t = 0; t < T; ++t) {
    s[t] = dot(cache + t * C, qf, L + R) * d.softmax_scale;
    m = std::max(m, s[t]);
  }
  float sum = 0.f;
  for (int64_t t = 0; t < T; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  std::fill(ol, ol + L, 0.f);
  for (int64_t t = 0; t < T; ++t) axpy(s[t] / sum, cache + t * C, ol, L);
  for (int64_t v = 0; v < d.dv; ++v) o[v] = dot(wkv_b + (d.dn + v) * L, ol, L);
}

// Block.attention for T tokens at positions start..start + T - 1: the projections for all T at once (weights read once;
// each token's row dots as in a call of its own), every token's cache row, then each token attends to the rows up
// to its own position
int attention(const AttnDesc& d, const float* h, float* out, int64_t T, int64_t start, float* cache,
              const float* cos, const float* sin, int threads) {
  const int64_t D = d.dim, H = d.heads, qk = d.dn + d.dr, L = d.kv_lora, R = d.dr, C = d.cache_dim;
  const int64_t ql = d.wq_a.w ? d.q_lora : 0;
  float* x = floats(tl_step, T * (D + ql + H * qk + L + R + H * d.dv + D));
  float *qa = x + T * D, *q = qa + T * ql, *kv = q + T * H * qk, *o = kv + T * (L + R), *y = o + T * H * d.dv;
  for (int64_t t = 0; t < T; ++t) rmsnorm(h + t * D, d.attn_norm, D, d.eps, x + t * D);
  int rc;
  if (ql) {
    if ((rc = linear(d.wq_a, x, T, qa, threads))) return rc;
    for (int64_t t = 0; t < T; ++t) rmsnorm(qa + t * ql, d.q_norm, ql, d.latent_eps, qa + t * ql);
    if ((rc = linear(d.wq_b, qa, T, q, threads))) return rc;
  } else if ((rc = linear(d.wq_b, x, T, q, threads))) {
    return rc;
  }
  if ((rc = linear(d.wkv_a, x, T, kv, threads))) return rc;
  for (int64_t t = 0; t < T; ++t) {                  // the tokens' cache rows: [normed latent | k_pe]
    float* row = cache + (start + t) * C;
    rmsnorm(kv + t * (L + R), d.kv_norm, L, d.latent_eps, row);
    rope(kv + t * (L + R) + L, cos + t * R, sin + t * R, R, d.interleave != 0, row + L);
  }
  const int nthreads = thread_count(threads, T * H * ((d.dn + d.dv) * L + (start + T) * C * 2) * 4);
  parallel_items(T * H, nthreads, [&](int64_t item) {
    const int64_t t = item / H, hd = item % H;
    attend_head(d, d.wkv_b + hd * (d.dn + d.dv) * L, q + (t * H + hd) * qk, cache, start + t + 1, cos + t * R,
                sin + t * R, o + (t * H + hd) * d.dv);
  });
  if ((rc = linear(d.wo, o, T, y, threads))) return rc;
  for (int64_t j = 0; j < T * D; ++j) out[j] = h[j] + y[j];
  return 0;
}

// indices of the k largest of v[0, n) (ties: the lower index), in descending order; v is consumed
void top_k(float* v, int64_t n, int64_t k, int64_t* idx) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; ++e)
      if (v[e] != -INFINITY && (best < 0 || v[e] > v[best])) best = e;
    if (best < 0) {                                             // fewer than k finite values: the lowest unused
      for (int64_t e = 0; e < n && best < 0; ++e)
        if (std::find(idx, idx + j, e) == idx + j) best = e;
    }
    idx[j] = best;
    v[best] = -INFINITY;
  }
}

// model.py's Gate after its scores: bias-corrected choice, group limit, top k, weights from the unbiased scores
void route(const FfnDesc& d, const float* sc, float* choice, int64_t* ids, float* w) {
  const int64_t E = d.n_experts, K = d.topk, G = d.n_group;
  for (int64_t e = 0; e < E; ++e) choice[e] = d.gate_bias ? sc[e] + d.gate_bias[e] : sc[e];
  if (G > 1 && d.method != 0) {
    const int64_t per = E / G;
    float gs[MAX_ROUTER_GROUPS];
    int64_t keep[MAX_ROUTER_GROUPS];
    for (int64_t g = 0; g < G; ++g) {
      const float* c = choice + g * per;
      if (d.method == 2) {                                      // noaux_tc: the sum of the group's top two
        int64_t i1 = 0;
        for (int64_t i = 1; i < per; ++i) if (c[i] > c[i1]) i1 = i;
        int64_t i2 = i1 == 0 ? 1 : 0;
        for (int64_t i = 0; i < per; ++i) if (i != i1 && c[i] > c[i2]) i2 = i;
        gs[g] = per > 1 ? c[i1] + c[i2] : c[i1];
      } else {
        gs[g] = *std::max_element(c, c + per);
      }
    }
    top_k(gs, G, d.topk_group, keep);
    for (int64_t g = 0; g < G; ++g)
      if (std::find(keep, keep + d.topk_group, g) == keep + d.topk_group)
        std::fill(choice + g * per, choice + (g + 1) * per, -INFINITY);
  }
  top_k(choice, E, K, ids);
  float sum = 0.f;
  for (int64_t k = 0; k < K; ++k) sum += (w[k] = sc[ids[k]]);
  for (int64_t k = 0; k < K; ++k) w[k] = (d.norm_topk ? w[k] / (sum + 1e-20f) : w[k]) * d.scaling;
}

}  // namespace

extern "C" {

// The descriptors' layouts as this compiler lays them out: out = [sizeof, the byte offset of each field in
// declaration order] of the struct called `name` (kernels/cpu_abi.py compares them with its ctypes structs when the
// library loads). Returns the count written, or -1 for an unknown name or too small an `out`.
int64_t dsv3_struct_layout(const char* name, int64_t* out, int64_t cap) {
#define DSV3_AT(S, f) static_cast<int64_t>(offsetof(S, f))
  std::vector<int64_t> v;
  if (std::strcmp(name, "Lin") == 0) {
    v = {sizeof(Lin), DSV3_AT(Lin, fmt), DSV3_AT(Lin, n), DSV3_AT(Lin, k), DSV3_AT(Lin, group), DSV3_AT(Lin, w),
         DSV3_AT(Lin, s), DSV3_AT(Lin, z)};
  } else if (std::strcmp(name, "AttnDesc") == 0) {
    v = {sizeof(AttnDesc), DSV3_AT(AttnDesc, wq_a), DSV3_AT(AttnDesc, wq_b), DSV3_AT(AttnDesc, wkv_a),
         DSV3_AT(AttnDesc, wo), DSV3_AT(AttnDesc, attn_norm), DSV3_AT(AttnDesc, q_norm), DSV3_AT(AttnDesc, kv_norm),
         DSV3_AT(AttnDesc, wkv_b), DSV3_AT(AttnDesc, dim), DSV3_AT(AttnDesc, heads), DSV3_AT(AttnDesc, q_lora),
         DSV3_AT(AttnDesc, dn), DSV3_AT(AttnDesc, dr), DSV3_AT(AttnDesc, dv), DSV3_AT(AttnDesc, kv_lora),
         DSV3_AT(AttnDesc, cache_dim), DSV3_AT(AttnDesc, interleave), DSV3_AT(AttnDesc, eps),
         DSV3_AT(AttnDesc, latent_eps), DSV3_AT(AttnDesc, softmax_scale), DSV3_AT(AttnDesc, unused)};
  } else if (std::strcmp(name, "FfnDesc") == 0) {
    v = {sizeof(FfnDesc), DSV3_AT(FfnDesc, w1), DSV3_AT(FfnDesc, w3), DSV3_AT(FfnDesc, w2), DSV3_AT(FfnDesc, norm),
         DSV3_AT(FfnDesc, gate_w), DSV3_AT(FfnDesc, gate_bias), DSV3_AT(FfnDesc, expert_ptrs),
         DSV3_AT(FfnDesc, expert_desc), DSV3_AT(FfnDesc, dim), DSV3_AT(FfnDesc, n_experts), DSV3_AT(FfnDesc, topk),
         DSV3_AT(FfnDesc, n_group), DSV3_AT(FfnDesc, topk_group), DSV3_AT(FfnDesc, softmax), DSV3_AT(FfnDesc, method),
         DSV3_AT(FfnDesc, norm_topk), DSV3_AT(FfnDesc, eps), DSV3_AT(FfnDesc, scaling)};
  }
#undef DSV3_AT
  if (v.empty() || static_cast<int64_t>(v.size()) > cap) return -1;
  std::copy(v.begin(), v.end(), out);
  return static_cast<int64_t>(v.size());
}

// Block.attention for T tokens at positions start.. (batch 1): out [T, D] = h + attention(attn_norm(h)); writes
// the tokens' rows of cache [Tmax, cache_dim] (this layer's); cos / sin [T, dr] (Rotary's rows for the positions).
int dsv3_attention(const AttnDesc* d, const float* h, float* out, int64_t T, int64_t start, float* cache,
                   const float* cos, const float* sin, int threads) {
  if (d->dr > MAX_ROPE || d->dr % 2) return -3;
  return attention(*d, h, out, T, start, cache, cos, sin, threads);
}

// Block.feed_forward for T tokens: out [T, D] = h + ffn(ffn_norm(h)), ffn the dense MLP, or the routed experts
// (router, dsv3_moe) plus the shared experts; ids [T, K] and scores [T, E] receive the routing (MoE layers).
int dsv3_ffn(const FfnDesc* d, const float* h, float* out, int64_t T, int64_t* ids, float* scores, int threads) {
  const int64_t D = d->dim, E = d->n_experts, K = d->topk, I = d->w1.w ? d->w1.n : 0;
  if (d->gate_w && (d->n_group > MAX_ROUTER_GROUPS || K > E)) return -3;
  float* x = floats(tl_step, T * (3 * D + 2 * I + E + K));
  float *routed = x + T * D, *shared = routed + T * D, *g = shared + T * D, *u = g + T * I, *choice = u + T * I;
  float* w = choice + T * E;
  for (int64_t t = 0; t < T; ++t) rmsnorm(h + t * D, d->norm, D, d->eps, x + t * D);
  int rc;
  if (d->gate_w) {
    const Lin gate{F32, E, D, 0, d->gate_w, nullptr, nullptr};
    if ((rc = linear(gate, x, T, scores, threads))) return rc;
    for (int64_t t = 0; t < T; ++t) {
      float* s = scores + t * E;
      if (d->softmax) {
        const float m = *std::max_element(s, s + E);
        float sum = 0.f;
        for (int64_t e = 0; e < E; ++e) sum += (s[e] = std::exp(s[e] - m));
        for (int64_t e = 0; e < E; ++e) s[e] /= sum;
      } else {
        for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-s[e]));
      }
      route(*d, s, choice, ids + t * K, w + t * K);
    }
    if ((rc = dsv3_moe(x, T, ids, w, K, d->expert_ptrs, E, d->expert_desc, routed, 0, threads, INFINITY, 0)))
      return rc;
  }
  if (I) {
    if ((rc = linear(d->w1, x, T, g, threads)) || (rc = linear(d->w3, x, T, u, threads))) return rc;
    for (int64_t j = 0; j < T * I; ++j) g[j] = silu(g[j]) * u[j];
    if ((rc = linear(d->w2, g, T, shared, threads))) return rc;
  }
  for (int64_t j = 0; j < T * D; ++j)
    out[j] = h[j] + (d->gate_w ? (I ? routed[j] + shared[j] : routed[j]) : shared[j]);
  return 0;
}


// Every main layer of a decode step, in order, in one call: layer i's attention (from h for the first layer, else
// from out) into tmp, then its feed-forward from tmp into out. cache + i * cache_stride is layer i's [Tmax,
// cache_dim]; ids[i] / scores[i] receive layer i's routing (null for a dense layer).
int dsv3_layers(int64_t n, const AttnDesc* const* attn, const FfnDesc* const* ffn, const float* h, float* tmp,
                float* out, int64_t T, int64_t start, float* cache, int64_t cache_stride, const float* cos,
                const float* sin, int64_t* const* ids, float* const* scores, int threads) {
  for (int64_t i = 0; i < n; ++i) {
    int rc = dsv3_attention(attn[i], i == 0 ? h : out, tmp, T, start, cache + i * cache_stride, cos, sin, threads);
    if (rc || (rc = dsv3_ffn(ffn[i], tmp, out, T, ids[i], scores[i], threads))) return rc;
  }
  return 0;
}

}  // extern "C"

// ---- int4 quantization (quant/int4.py's int4_quantize_ref, the same operations in the same order) -----------
// Per group of g consecutive k (g in 32, 64, 128; zero padding past k): lo, hi = min, max; a candidate range
// (lo * r_lo, hi * r_hi) widened to include 0 gives s = f16(max((hi' - lo') / 15, 2^-24)), z = f16((0 - lo') / s)
// and the error sum_i (round(clamp(w_i / s + z, 0, 15)) - (w_i / s + z))^2 over the valid elements, summed by
// halves (element i + h added to element i for h = g/2, g/4, .., 1), times s * s. Candidates in the order of
// _search_scale_zero, each stage's made from the incumbent as it starts; a candidate replaces the incumbent only
// with a smaller error (the first of equal errors wins; NaN as torch's argmin takes it). Every step is one IEEE
// fp32 operation written out (-ffp-contract=off), so any vector width gives the same bits.
namespace {

enum Src : int64_t { SRC_F32 = 0, SRC_BF16 = 1, SRC_F16 = 2, SRC_FP8 = 3 };
constexpr float Q_MAX = 15.0f;
constexpr float F16_TINY = 5.9604644775390625e-08f;   // 2^-24
constexpr float ROUND_MAGIC = 8388608.0f;               // 2^23: (c + 2^23) - 2^23 rounds 0 <= c < 2^22 half-even

#define Q_INLINE inline __attribute__((always_inline))

Q_INLINE float f16_round(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }
Q_INLINE uint16_t f16_bits(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

Q_INLINE float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
Q_INLINE uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct SZ {
  float s, z;
};

// quant/int4.py _scale_zero for one candidate range (torch's clamp keeps NaN: so do these comparisons)
Q_INLINE SZ scale_zero(float lo, float hi) {
  lo = lo > 0.f ? 0.f : lo;
  hi = hi < 0.f ? 0.f : hi;
  float d = (hi - lo) / Q_MAX;
  d = d < F16_TINY ? F16_TINY : d;
  const float s = f16_round(d);
  return {s, f16_round((0.f - lo) / s)};
}

// the code of w before rounding, t = w / s + z, and its squared rounding error (round(clamp(t, 0, 15)) - t)^2
Q_INLINE float sq_error(float w, float s, float z) {
  const float t = w / s + z;
  float c = t < 0.f ? 0.f : t;
  c = c > Q_MAX ? Q_MAX : c;
  const float d = ((c + ROUND_MAGIC) - ROUND_MAGIC) - t;
  return d * d;
}

// squared error of (s, z) on a group x [G] whose first `valid` elements are real (PAD: some are not), summed by
// halves: while the width w > 1, element i + w/2 onto element i. Done as: for each of E lanes
// (E = 16, or 8 for g = 32) the J = G/E elements i + j * E together in registers (j + J/2 onto j, .., j + 1), then
// lane i + 8 onto lane i where E = 16, then hsum's halvings of the last 8 (4, 2, 1): the same additions.
template <int G, bool PAD>
Q_INLINE float group_error(const float* __restrict x, int valid, float s, float z) {
  constexpr int E = G >= 64 ? 16 : 8, J = G / E;
  alignas(64) float e[E];
  static_assert(J == 4 || J == 8, "group sizes 32, 64, 128");
  for (int i = 0; i < E; ++i) {
    float q[J];
    for (int j = 0; j < J; ++j) {
      const float v = sq_error(x[i + j * E], s, z);
      q[j] = PAD && i + j * E >= valid ? 0.f : v;
    }
    if constexpr (J == 8) {                  // written out: loops here would keep the compiler from vectorizing
      const float a0 = q[0] + q[4], a1 = q[1] + q[5], a2 = q[2] + q[6], a3 = q[3] + q[7];
      e[i] = (a0 + a2) + (a1 + a3);
    } else {
      e[i] = (q[0] + q[2]) + (q[1] + q[3]);
    }
  }
  __m256 v = _mm256_load_ps(e);
  if constexpr (E == 16) v = _mm256_add_ps(v, _mm256_load_ps(e + 8));
  return hsum(v) * (s * s);
}

// errors of n candidates
template <int G>
Q_INLINE void candidate_errors(const float* x, int valid, const float* s, const float* z, int n, float* err) {
  if (valid == G)
    for (int i = 0; i < n; ++i) err[i] = group_error<G, false>(x, valid, s[i], z[i]);
  else
    for (int i = 0; i < n; ++i) err[i] = group_error<G, true>(x, valid, s[i], z[i]);
}

struct Search {
  const float* shrink;
  int64_t n_shrink;
  const float* steps;
  int64_t n_steps;
  bool on;
};

Q_INLINE float clamp_ratio(float r) {
  r = r < 0.3f ? 0.3f : r;           // quant/int4.py MIN_RATIO, as float32
  return r > 1.0f ? 1.0f : r;
}

constexpr int MAX_CANDIDATES = 64;        // per stage (quant/int4.py ClipSearch: 1 + shrink, or end steps)

struct Incumbent {
  SZ sz;
  float err, r_lo, r_hi;
};

// torch's argmin order: NaN below everything (the first NaN wins), else the first of equal values
Q_INLINE bool beats(float err, float incumbent) {
  return err != err ? incumbent == incumbent : err < incumbent;
}

// one stage: n candidate ranges (lo * r_lo[i], hi * r_hi[i]), all made before any is tried, then taken in order
// where one is below the incumbent's error (the first of equal errors wins, as in the twin's argmin)
template <int G>
Q_INLINE void stage(Incumbent& b, const float* x, int valid, float lo, float hi, const float* r_lo,
                    const float* r_hi, int n) {
  float s[MAX_CANDIDATES], z[MAX_CANDIDATES], err[MAX_CANDIDATES];
  for (int i = 0; i < n; ++i) {
    const SZ c = scale_zero(lo * r_lo[i], hi * r_hi[i]);
    s[i] = c.s;
    z[i] = c.z;
  }
  candidate_errors<G>(x, valid, s, z, n, err);
  for (int i = 0; i < n; ++i)
    if (beats(err[i], b.err)) b = {{s[i], z[i]}, err[i], r_lo[i], r_hi[i]};
}

template <int G>
Q_INLINE SZ search_group(const float* x, int valid, const Search& sr) {
  // min and max per lane, then across lanes (exact in any order; a zero's sign never matters: see scale_zero)
  __m256 vlo = _mm256_loadu_ps(x), vhi = vlo, vnan = _mm256_cmp_ps(vlo, vlo, _CMP_UNORD_Q);
  for (int i = 8; i < G; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vlo = _mm256_min_ps(vlo, v);
    vhi = _mm256_max_ps(vhi, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float plo[8], phi[8];
  _mm256_store_ps(plo, vlo);
  _mm256_store_ps(phi, vhi);
  float lo = plo[0], hi = phi[0];
  for (int l = 1; l < 8; ++l) {
    lo = std::min(lo, plo[l]);
    hi = std::max(hi, phi[l]);
  }
  const bool nan = _mm256_movemask_ps(vnan) != 0;
  if (nan) lo = hi = NAN;              // torch's amin/amax propagate NaN
  if (!sr.on) return scale_zero(lo, hi);
  // the min/max range and the shrunk ones in one stage: the error of the first is the incumbent's
  float r_lo[MAX_CANDIDATES], r_hi[MAX_CANDIDATES];
  const int n1 = static_cast<int>(1 + sr.n_shrink), n2 = static_cast<int>(sr.n_steps);
  r_lo[0] = r_hi[0] = 1.f;
  for (int i = 1; i < n1; ++i) r_lo[i] = r_hi[i] = sr.shrink[i - 1];
  Incumbent b{{0.f, 0.f}, INFINITY, 1.f, 1.f};      // beaten by the first candidate unless its error is +inf
  stage<G>(b, x, valid, lo, hi, r_lo, r_hi, n1);
  if (b.err == INFINITY) b.sz = scale_zero(lo, hi);    // every error +inf: the min/max range (the twin's first)
  // each stage's candidates are made from the incumbent as the stage starts (as the twin batches them)
  for (int i = 0; i < n2; ++i) {
    r_lo[i] = clamp_ratio(b.r_lo + sr.steps[i]);
    r_hi[i] = b.r_hi;
  }
  stage<G>(b, x, valid, lo, hi, r_lo, r_hi, n2);
  for (int i = 0; i < n2; ++i) {
    r_lo[i] = b.r_lo;
    r_hi[i] = clamp_ratio(b.r_hi + sr.steps[i]);
  }
  stage<G>(b, x, valid, lo, hi, r_lo, r_hi, n2);
  return b.sz;
}

// e4m3 code -> fp32 (NaN codes 0x7f, 0xff to NaN), by integer operations the compiler vectorizes
Q_INLINE float e4m3_f32(uint8_t b) {
  const uint32_t u = b, e = (u >> 3) & 15, m = u & 7, sign = (u & 0x80) << 24;
  const float normal = bits_f32(sign | ((e + 120) << 23) | (m << 20));
  const float sub = static_cast<float>(static_cast<int>(m)) * 0.001953125f;   // m * 2^-9
  float v = e ? normal : (sign ? -sub : sub);
  return (u & 0x7F) == 0x7F ? NAN : v;
}

// bf16(v) as fp32, round to nearest even (NaN stays NaN)
Q_INLINE float bf16_round(float v) {
  const uint32_t u = f32_bits(v);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return v != v ? v : bits_f32(r);
}

// one group of source row `r`, columns [j0, j0 + G) into x (zeros past k); returns the valid count
template <int G>
Q_INLINE int load_group(const void* src, int64_t kind, const float* sinv, int64_t kb, int64_t r, int64_t k,
                        int64_t j0, float* __restrict x) {
  const int valid = static_cast<int>(std::min<int64_t>(G, k - j0));
  if (kind == SRC_F32) {
    std::memcpy(x, static_cast<const float*>(src) + r * k + j0, valid * sizeof(float));
  } else if (kind == SRC_BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(src) + r * k + j0;
    int i = 0;
    for (; i + 8 <= valid; i += 8) {
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
      _mm256_storeu_ps(x + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (; i < valid; ++i) x[i] = bits_f32(static_cast<uint32_t>(p[i]) << 16);
  } else if (kind == SRC_F16) {
    const uint16_t* p = static_cast<const uint16_t*>(src) + r * k + j0;
    int i = 0;
    for (; i + 8 <= valid; i += 8)
      _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    for (; i < valid; ++i) x[i] = _cvtsh_ss(p[i]);
  } else {
    const uint8_t* p = static_cast<const uint8_t*>(src) + r * k + j0;
    if (sinv) {       // a group never straddles two 128-column blocks (128 % G == 0)
      const float sc = sinv[(r / FP8_BLOCK) * kb + j0 / FP8_BLOCK];
      for (int i = 0; i < valid; ++i) x[i] = bf16_round(e4m3_f32(p[i]) * sc);
    } else {
      for (int i = 0; i < valid; ++i) x[i] = e4m3_f32(p[i]);
    }
  }
  for (int i = valid; i < G; ++i) x[i] = 0.f;
  return valid;
}

// round(clamp(w / s + z, 0, 15)) (NaN: 0)
Q_INLINE int code(float w, float s, float z) {
  const float t = w / s + z;
  float c = t < 0.f ? 0.f : t;
  c = c > Q_MAX ? Q_MAX : c;
  return static_cast<int>((c + ROUND_MAGIC) - ROUND_MAGIC) & 15;
}

template <int G>
Q_INLINE void quantize_rows(const void* src, int64_t kind, const float* sinv, int64_t n, int64_t k,
                            const Search& sr, uint8_t* qw, uint16_t* sc, uint16_t* zr, int64_t r0, int64_t r1) {
  const int64_t groups = (k + G - 1) / G, kb = (k + FP8_BLOCK - 1) / FP8_BLOCK;
  alignas(64) float x[G];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int valid = load_group<G>(src, kind, sinv, kb, r, k, g * G, x);
      const SZ b = search_group<G>(x, valid, sr);
      uint8_t* o = qw + (r * groups + g) * (G / 2);
      for (int i = 0; i < G / 2; ++i)     // byte i: element i's code in the low nibble, i + G/2's in the high one
        o[i] = static_cast<uint8_t>(code(x[i], b.s, b.z) | (code(x[i + G / 2], b.s, b.z) << 4));
      sc[r * groups + g] = f16_bits(b.s);
      zr[r * groups + g] = f16_bits(b.z);
    }
  }
}

struct QArgs {
  const void* src;
  int64_t kind;
  const float* sinv;
  int64_t n, k, group;
  Search sr;
  uint8_t* qw;
  uint16_t* sc;
  uint16_t* zr;
};

// the same source compiled twice: for AVX2 (the library's flags) and, where the CPU has it, AVX-512. Every
// operation is an elementwise IEEE one or the written sum by halves, so both give the same bits (tested).
#define Q_ROWS_BODY                                                                                        \
  if (a.group == 128) quantize_rows<128>(a.src, a.kind, a.sinv, a.n, a.k, a.sr, a.qw, a.sc, a.zr, r0, r1);     \
  else if (a.group == 64) quantize_rows<64>(a.src, a.kind, a.sinv, a.n, a.k, a.sr, a.qw, a.sc, a.zr, r0, r1); \
  else quantize_rows<32>(a.src, a.kind, a.sinv, a.n, a.k, a.sr, a.qw, a.sc, a.zr, r0, r1);

// measured per DeepSeek-V3 expert (FP8, the clip search), 1 thread, CPU s: AVX2 0.30-0.36, AVX-512 0.20-0.22
void q_rows_avx2(const QArgs& a, int64_t r0, int64_t r1) { Q_ROWS_BODY }

// kernels/cpu_build.py builds without it (DSV3LITE_NO_AVX512) where a compiler refuses the attribute
#ifndef DSV3LITE_NO_AVX512
#if defined(__clang__)
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#else
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")))
#endif
void q_rows_avx512(const QArgs& a, int64_t r0, int64_t r1) { Q_ROWS_BODY }

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
}
#else
void q_rows_avx512(const QArgs& a, int64_t r0, int64_t r1) { Q_ROWS_BODY }
bool have_avx512() { return false; }
#endif

}  // namespace

extern "C" {

// w [n, k] (kind: 0 fp32, 1 bf16, 2 fp16, 3 e4m3 with sinv its float [ceil(n/128), ceil(k/128)] block grid, or
// null for none) -> qweight [n, Kp/2], scales and zeros fp16 [n, Kp/g] (Kp = k rounded up to g). search 0: plain
// min/max ranges; else shrink [n_shrink] then end steps [n_steps] (quant/int4.py ClipSearch). Rows in parallel.
// isa 0: AVX-512 where the CPU has it, 1: AVX2 only (the same bits). Returns 0, -1 for a group size other than
// 32, 64, 128, or -2 for more than MAX_CANDIDATES candidates in a stage.
int dsv3_int4_quantize(const void* w, int64_t kind, const float* sinv, int64_t n, int64_t k, int64_t group,
                       int search, const float* shrink, int64_t n_shrink, const float* steps, int64_t n_steps,
                       uint8_t* qw, uint16_t* sc, uint16_t* zr, int threads, int isa) {
  if (group != 32 && group != 64 && group != 128) return -1;
  if (n_shrink + 1 > MAX_CANDIDATES || n_steps > MAX_CANDIDATES) return -2;
  const QArgs a{w, kind, sinv, n, k, group, Search{shrink, n_shrink, steps, n_steps, search != 0}, qw, sc, zr};
  const bool wide = isa != 1 && have_avx512();
  constexpr int64_t RB = 4;                                // rows per work item
  const int64_t items = (n + RB - 1) / RB;
  const int nthreads = thread_count(threads, n * k * (search ? 8 : 1));
  parallel_items(items, nthreads, [&](int64_t item) {
    const int64_t r0 = item * RB, r1 = std::min(r0 + RB, n);
    if (wide) q_rows_avx512(a, r0, r1);
    else q_rows_avx2(a, r0, r1);
  });
  return 0;
}

}  // extern "C"

// ==== MXFP4 routed experts (DeepSeek-V4's released format; quant/mxfp4.py, kernels/cpu_experts.py) ==============
// A blob holds per matrix codes [n, kp/2] (two e2m1 per byte, the low nibble the even k) and scales [n, kp/32]
// (ue8m0 bytes), kp = k rounded up to 32 (zero padding; released checkpoints need none). 32 code bytes (64
// weights, two 32-blocks) decode by one table lookup per nibble into doubled e2m1 values (integers -12..12, exact):
// the low nibbles are the two blocks' even elements, the high nibbles their odd ones. Activations are prepared per
// token in that order, as (act 0) int8 per 32-block (symmetric, amax / 127, half-even, as the int8 kernel rounds)
// multiplied in integers with the values plus 12 (unsigned, for maddubs) and 12 * sum(xq) taken off again, each
// block's sum times s_w / 2 * s_x (measured faster at 1, 4 and 32 tokens: benchmarks/mxfp4_cpu.py); or (act 1)
// fp32, each block's partial dot times s_w / 2. Grouped per layer by moe_grouped, as every format (dsv3_moe).
namespace {

alignas(32) constexpr int8_t E2M1_X2[32] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int MX_OFFSET = 12;            // E2M1_X2 + 12 >= 0: maddubs' unsigned operand
alignas(32) constexpr uint8_t E2M1_X2_OFF[32] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                                 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

struct Ue8m0Half {                  // 2^(b - 127) / 2 for every byte b (the value table is doubled); 0xFF NaN
  float v[256];
  Ue8m0Half() {
    for (int b = 0; b < 256; ++b) v[b] = b == 255 ? NAN : std::ldexp(1.0f, b - 128);
  }
};

const float* ue8m0_half() {
  static const Ue8m0Half table;
  return table.v;
}

// one token's prepared activation: int8 q [chunks * 64] with, as 8 lanes per chunk (4 for the first block, 4 for
// the second), the offset's correction (3 x the block's sum of q: 12 x the sum over the 4 lanes) and the block
// scales; or fp32 f [chunks * 64]
struct MxAct {
  const int8_t* q = nullptr;
  const int32_t* corr = nullptr;
  const float* xs8 = nullptr;
  const float* f = nullptr;
};

struct MxActSize {
  int64_t k, chunks;
  bool f32;
  int64_t bytes() const { return f32 ? chunks * 64 * 4 : chunks * (64 + 32 + 32); }
};

inline int64_t mx_padded(int64_t k) { return (k + 31) / 32 * 32; }

inline MxActSize mx_act_size(int64_t k, int act) { return MxActSize{k, (mx_padded(k) + 63) / 64, act == 1}; }

inline MxAct mx_view(uint8_t* base, const MxActSize& s) {
  MxAct a;
  if (s.f32) {
    a.f = reinterpret_cast<const float*>(base);
  } else {
    a.q = reinterpret_cast<const int8_t*>(base);
    a.corr = reinterpret_cast<const int32_t*>(base + s.chunks * 64);
    a.xs8 = reinterpret_cast<const float*>(base + s.chunks * 96);
  }
  return a;
}

// slot of element e in the prepared order: per 64-chunk, the low nibbles' elements (block 0's, then block 1's),
// then the high nibbles'
inline int64_t mx_slot(int64_t e) {
  const int64_t in = e % 64, blk = in / 32, j = in % 32;
  return e / 64 * 64 + (j & 1) * 32 + blk * 16 + j / 2;
}

void mx_prepare(const float* x, const MxActSize& s, uint8_t* base) {
  if (s.f32) {
    float* f = reinterpret_cast<float*>(base);
    std::memset(f, 0, s.chunks * 64 * sizeof(float));
    for (int64_t e = 0; e < s.k; ++e) f[mx_slot(e)] = x[e];
    return;
  }
  int8_t* q = reinterpret_cast<int8_t*>(base);
  int32_t* corr = reinterpret_cast<int32_t*>(base + s.chunks * 64);
  float* xs8 = reinterpret_cast<float*>(base + s.chunks * 96);
  std::memset(q, 0, s.chunks * 64);
  std::memset(corr, 0, s.chunks * 8 * sizeof(int32_t));
  std::memset(xs8, 0, s.chunks * 8 * sizeof(float));
  for (int64_t b = 0; b < mx_padded(s.k) / 32; ++b) {
    const float* xb = x + b * 32;
    const int n = static_cast<int>(std::min<int64_t>(32, s.k - b * 32));     // the last block may be partial
    float amax = 0.f;
    for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < n; ++j) {
      const int8_t v = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      q[mx_slot(b * 32 + j)] = v;
      sum += v;
    }
    for (int i = 0; i < 4; ++i) {
      corr[b / 2 * 8 + b % 2 * 4 + i] = MX_OFFSET / 4 * sum;
      xs8[b / 2 * 8 + b % 2 * 4 + i] = amax / 127.0f;
    }
  }
}

inline __m256 mx_i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// out[t] = dot(row, x_t) for t < NT: w the row's k/2 code bytes, sb its k/32 scale bytes (k a multiple of 32)
template <int NT, bool F32ACT>
void mx_row(const uint8_t* w, const uint8_t* sb, int64_t k, const MxAct* a, float* out) {
  const float* tab = ue8m0_half();
  const void* table = F32ACT ? static_cast<const void*>(E2M1_X2) : static_cast<const void*>(E2M1_X2_OFF);
  const __m256i lut = _mm256_load_si256(static_cast<const __m256i*>(table));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks = k / 32, full = k / 64;
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  auto chunk = [&](int64_t c, __m256i v) {
    const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));
    const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    const float s0 = tab[sb[2 * c]], s1 = 2 * c + 1 < blocks ? tab[sb[2 * c + 1]] : 0.f;
    if constexpr (!F32ACT) {
      const __m256 sw = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
      for (int t = 0; t < NT; ++t) {
        const __m256i* xq = reinterpret_cast<const __m256i*>(a[t].q + c * 64);
        const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(wl, _mm256_loadu_si256(xq)),
                                           _mm256_maddubs_epi16(wh, _mm256_loadu_si256(xq + 1)));
        const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].corr + c * 8));
        // lanes 0-3: block 0, 4-7: block 1 (exact integers: |sum| < 2^24)
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_madd_epi16(d, ones), corr));
        acc[t] = _mm256_fmadd_ps(sums, _mm256_mul_ps(sw, _mm256_loadu_ps(a[t].xs8 + c * 8)), acc[t]);
      }
    } else {
      const __m128i l0 = _mm256_castsi256_si128(wl), l1 = _mm256_extracti128_si256(wl, 1);
      const __m128i h0 = _mm256_castsi256_si128(wh), h1 = _mm256_extracti128_si256(wh, 1);
      const __m256 w0[4] = {mx_i8_to_ps(l0), mx_i8_to_ps(_mm_srli_si128(l0, 8)), mx_i8_to_ps(h0),
                            mx_i8_to_ps(_mm_srli_si128(h0, 8))};                          // block 0
      const __m256 w1[4] = {mx_i8_to_ps(l1), mx_i8_to_ps(_mm_srli_si128(l1, 8)), mx_i8_to_ps(h1),
                            mx_i8_to_ps(_mm_srli_si128(h1, 8))};                          // block 1
      const __m256 sv0 = _mm256_set1_ps(s0), sv1 = _mm256_set1_ps(s1);
      for (int t = 0; t < NT; ++t) {
        const float* x = a[t].f + c * 64;      // block 0 even, block 1 even, block 0 odd, block 1 odd
        __m256 b0 = _mm256_mul_ps(w0[0], _mm256_loadu_ps(x));
        __m256 b1 = _mm256_mul_ps(w1[0], _mm256_loadu_ps(x + 16));
        b0 = _mm256_fmadd_ps(w0[1], _mm256_loadu_ps(x + 8), b0);
        b1 = _mm256_fmadd_ps(w1[1], _mm256_loadu_ps(x + 24), b1);
        b0 = _mm256_fmadd_ps(w0[2], _mm256_loadu_ps(x + 32), b0);
        b1 = _mm256_fmadd_ps(w1[2], _mm256_loadu_ps(x + 48), b1);
        b0 = _mm256_fmadd_ps(w0[3], _mm256_loadu_ps(x + 40), b0);
        b1 = _mm256_fmadd_ps(w1[3], _mm256_loadu_ps(x + 56), b1);
        acc[t] = _mm256_fmadd_ps(b1, sv1, _mm256_fmadd_ps(b0, sv0, acc[t]));
      }
    }
  };
  for (int64_t c = 0; c < full; ++c) {
    prefetch(w + c * 32);
    chunk(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32)));
  }
  if (blocks % 2)                    // a last single block: its 16 bytes, the second half zero (weights 0)
    chunk(full, _mm256_inserti128_si256(_mm256_setzero_si256(),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + full * 32)), 0));
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
}

struct MxMat {
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t n, kp;                      // rows, padded row length
};

// rows [r0, r1) of m against nt (<= MAX_TOK) activations; out[t * ostride + (r - r0)]
template <int NT, bool F32ACT>
void mx_rows_nt(const MxMat& m, int64_t r0, int64_t r1, const MxAct* a, float* out, int64_t ostride) {
  float res[MAX_TOK];
  for (int64_t r = r0; r < r1; ++r) {
    mx_row<NT, F32ACT>(m.codes + r * (m.kp / 2), m.scales + r * (m.kp / 32), m.kp, a, res);
    for (int t = 0; t < NT; ++t) out[t * ostride + (r - r0)] = res[t];
  }
}

template <bool F32ACT>
void mx_rows_act(const MxMat& m, int64_t r0, int64_t r1, const MxAct* a, int nt, float* out, int64_t ostride) {
  switch (nt) {
    case 1: mx_rows_nt<1, F32ACT>(m, r0, r1, a, out, ostride); break;
    case 2: mx_rows_nt<2, F32ACT>(m, r0, r1, a, out, ostride); break;
    case 3: mx_rows_nt<3, F32ACT>(m, r0, r1, a, out, ostride); break;
    default: mx_rows_nt<4, F32ACT>(m, r0, r1, a, out, ostride); break;
  }
}

void mx_rows(const MxMat& m, int64_t r0, int64_t r1, const MxAct* a, int nt, bool f32act, float* out,
             int64_t ostride) {
  if (f32act) mx_rows_act<true>(m, r0, r1, a, nt, out, ostride);
  else mx_rows_act<false>(m, r0, r1, a, nt, out, ostride);
}

// matrix `which` (0 gate, 1 up, 2 down) of an expert blob; desc as dsv3_moe's (codes, scales offsets per matrix)
MxMat mx_mat(const int64_t* desc, const uint8_t* blob, int which) {
  const int64_t inter = desc[2], hidden = desc[3];
  return MxMat{blob + desc[4 + 3 * which], blob + desc[5 + 3 * which], which == 2 ? hidden : inter,
               mx_padded(which == 2 ? inter : hidden)};
}

// moe_grouped's reader of MXFP4 blobs; act 0: int8 activations per 32-block, 1: fp32
struct MxExperts {
  using A = MxAct;
  const int64_t* desc;
  int64_t inter, hidden;
  MxActSize xsz, hsz;
  bool f32act;
  MxExperts(const int64_t* d, int act)
      : desc(d), inter(d[2]), hidden(d[3]), xsz(mx_act_size(d[3], act)), hsz(mx_act_size(d[2], act)),
        f32act(act == 1) {}
  int64_t act_bytes(bool h) const { return (h ? hsz : xsz).bytes(); }
  int64_t expert_bytes() const { return inter * hidden * 3 / 2; }
  void prepare(const float* x, bool h, uint8_t* base) const { mx_prepare(x, h ? hsz : xsz, base); }
  MxAct view(uint8_t* base, bool h) const { return mx_view(base, h ? hsz : xsz); }
  void rows(const uint8_t* blob, int which, int64_t r0, int64_t r1, const MxAct* a, int nt, float* out,
            int64_t ostride) const {
    mx_rows(mx_mat(desc, blob, which), r0, r1, a, nt, f32act, out, ostride);
  }
};

}  // namespace

extern "C" {

// Routed experts of one MoE layer for tokens x [T, D] fp32 with routing ids [T, K] int64 and weights [T, K] fp32.
// ptrs [E]: address of expert e's blob (0: not computed here); desc: the blobs' layout (kernels/cpu_experts.py
// layout_desc). Pairs (t, k) whose expert has a blob are grouped by ascending expert id (then t * K + k). per_pair 0:
// out [T, D] = sum over those pairs, in ascending expert id, of weights[t, k] * y (each product added to the running
// sum). per_pair 1: out [T * K, D] gets the unweighted y at row t * K + k (other rows untouched). The SwiGLU is
// clamped at `limit` (DeepSeek-V4's swiglu_limit; +inf: none); act: MXFP4's activations (0 int8, 1 fp32; the other
// formats' are fixed by the format). Returns 0, or -1 for an expert id out of range, -2 for too many groups.
int dsv3_moe(const float* xp, int64_t T, const int64_t* idp, const float* wp, int64_t K, const int64_t* pp,
             int64_t E, const int64_t* desc, float* op, int per_pair, int threads, float limit, int act) {
  if (desc[0] == MXFP4)
    return moe_grouped(MxExperts(desc, act), xp, T, idp, wp, K, pp, E, op, per_pair, threads, limit);
  const StdExperts std_experts(desc);
  if (!std_experts.fits()) return -2;
  return moe_grouped(std_experts, xp, T, idp, wp, K, pp, E, op, per_pair, threads, limit);
}

}  // extern "C"
