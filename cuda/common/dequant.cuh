// Exact FP4 (E2M1) / FP8 (E4M3) → bf16 conversion in registers, and the E8M0 block-scale factors
// (docs/model.md §2 "Weight storage dtypes"; formulas: python/v41/quant.py).
//
// The codes are moved bit-for-bit into a bf16's low exponent and high mantissa bits, which gives the value times a
// fixed power of two (2^-126 for E2M1, 2^-120 for E4M3; codes with a zero exponent become bf16 subnormals, which the
// bf16 multiply keeps). The E8M0 scale 2^(byte − 127) and that power of two are applied by one bf16x2 multiply, so
// every product is exact: a code has at most 3 significant bits and the factors are powers of two.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>

namespace v41 {

// Two bf16 of one 32-bit word: the lower half is the first element of a pair.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// bf16 bits of 2^e for e in [-133, 127]; the subnormal range keeps its single mantissa bit.
__device__ __forceinline__ uint32_t bf16_pow2(int e) {
  return e >= -126 ? uint32_t(e + 127) << 7 : 0x40u >> (-127 - e);
}

// Scale factor (bf16x2, both halves equal) for codes stored with a 2^-BIAS offset and an E8M0 byte:
// 2^(byte - 127 + BIAS), or two factors when that overflows bf16 (`hi` = 2^BIAS, `lo` = 2^(byte - 127)).
template <int BIAS>
struct ScaleFactor {
  uint32_t one, two;  // two == 0: a single multiply by `one`
  __device__ __forceinline__ explicit ScaleFactor(uint32_t byte) {
    int e = int(byte) - 127 + BIAS;
    if (e <= 127) {
      uint32_t h = bf16_pow2(e);
      one = h | (h << 16);
      two = 0;
    } else {
      uint32_t h = bf16_pow2(BIAS), l = bf16_pow2(int(byte) - 127);
      one = h | (h << 16);
      two = l | (l << 16);
    }
  }
  // Per word, a select rather than a branch: measured faster on the H200 than one branch per row and chunk.
  template <int N>
  __device__ __forceinline__ void apply(uint32_t (&w)[N]) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t v = bf16x2_mul(w[i], one);
      w[i] = two ? bf16x2_mul(v, two) : v;
    }
  }
};

// The largest scale byte whose factor 2^(byte - 127 + BIAS) is one normal bf16 (for BIAS >= 1 the exponent is
// at least -126): scale bytes up to it take one multiply, `OneFactor`; above it `ScaleFactor` takes two.
template <int BIAS>
constexpr uint32_t kOneFactorMax = 254 - BIAS;

template <int BIAS>
struct OneFactor {
  static_assert(BIAS >= 1, "the factor must be a normal bf16");
  uint32_t one;
  __device__ __forceinline__ explicit OneFactor(uint32_t byte) : one(((byte + BIAS) << 7) * 0x10001u) {}
  template <int N>
  __device__ __forceinline__ void apply(uint32_t (&w)[N]) const {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = bf16x2_mul(w[i], one);
  }
};

// ScaleFactor for any byte (WIDE) or OneFactor for bytes up to kOneFactorMax<BIAS> (the caller checked them).
template <int BIAS, bool WIDE, int N>
__device__ __forceinline__ void apply_scale(uint32_t byte, uint32_t (&w)[N]) {
  if constexpr (WIDE)
    ScaleFactor<BIAS>(byte).apply(w);
  else
    OneFactor<BIAS>(byte).apply(w);
}

// FP4: one 32-bit word holds 8 E2M1 codes, code i (bits 4i..4i+3) = input 8w + i of its row. Word j of the result
// (j = 0..3) pairs codes j (low half) and j + 4 (high half), times 2^-126: sign → bit 15, e1 e0 m → bits 8..6.
template <int J>
__device__ __forceinline__ uint32_t fp4_pair(uint32_t q) {
  constexpr int s_sign = 12 - 4 * J, s_mag = 6 - 4 * J;
  uint32_t sign = s_sign >= 0 ? q << s_sign : q >> -s_sign;
  uint32_t mag = s_mag >= 0 ? q << s_mag : q >> -s_mag;
  return (sign & 0x80008000u) | (mag & 0x01C001C0u);
}

// FP8: bytes (2h, 2h + 1) of q as one bf16x2 word, times 2^-120: sign → bit 15, the 7 other bits → bits 10..4.
template <int H>
__device__ __forceinline__ uint32_t fp8_pair(uint32_t q) {
  uint32_t t = __byte_perm(q, 0u, H == 0 ? 0x1404 : 0x3424);  // [0, b2h, 0, b2h+1]
  return (t & 0x80008000u) | ((t >> 4) & 0x07F007F0u);
}

constexpr int kFp4Bias = 126;
constexpr int kFp8Bias = 120;

// 16 bytes of MXFP4 codes (one E8M0 block of 32 inputs, as 4 little-endian words) with their scale byte → 16
// bf16x2 words, exactly: word 4i + j pairs codes 8i + j and 8i + j + 4 (fp4_pair<j> of word i). WIDE = false:
// the caller checked byte <= kOneFactorMax<kFp4Bias> (one multiply per word instead of two and a select).
template <bool WIDE = true>
__device__ __forceinline__ void mxfp4_words(const uint32_t (&q)[4], uint32_t byte, uint32_t (&w)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[4 * i + 0] = fp4_pair<0>(q[i]);
    w[4 * i + 1] = fp4_pair<1>(q[i]);
    w[4 * i + 2] = fp4_pair<2>(q[i]);
    w[4 * i + 3] = fp4_pair<3>(q[i]);
  }
  apply_scale<kFp4Bias, WIDE>(byte, w);
}

}  // namespace v41
