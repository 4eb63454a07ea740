// Weight-streaming GEMM y = x · Wᵀ for few rows per weight: MXFP4 (W4A16) grouped expert GEMMs and FP8 (W8A16)
// block-scaled linears at decode sizes (docs/kernels.md §2 "Dense FP8 GEMMs" and "MoE").
//
// Layout of the work. A CTA of 4 warps owns 64 output rows of one weight (one expert); each warp 16 rows, which are
// the M side of m16n8k16 bf16 MMAs, and up to 8 activation rows are the N side. Lane (g, t) streams 16 bytes of
// rows g and g + 8 per 64-byte chunk of a row (128 MXFP4 or 64 FP8 inputs), straight from the checkpoint layout,
// without shared memory. The dot product does not depend on the order of K, so each lane's 16 bytes become its own
// A fragments in the order the bit-level conversion produces them (common/dequant.cuh) and the lane reads the
// matching activations for its B fragments: no shuffles, no repacked weights. A thread's 16 bytes of a row lie in
// one scale block (MXFP4: exactly the 32 inputs of one E8M0; FP8: 16 inputs of a 32×32 or 128×128 tile), so one
// bf16 multiply per pair of weights applies the scale exactly. Activation rows are taken 8 at a time
// (`TG` groups per pass over the weights); more rows per expert make more passes, which L2 mostly serves.
//
// Split-K: grid.z slices K; each slice writes float32 partials and the last CTA of a tile to arrive (a counter per
// tile, reset by it) sums them in slice order, so results do not depend on timing.
#include "../common/dequant.cuh"
#include "../common/mma.cuh"
#include "wstream.h"

namespace v41 {
namespace {


__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

template <WFmt F>
struct Fmt;

template <>
struct Fmt<WFmt::kMxfp4> {
  static constexpr int kUnroll = 4;          // chunks whose loads are issued before the first is used
  static constexpr int kInputsPerLane = 32;  // per 16 bytes
  static constexpr int kWords = 16;          // bf16x2 words per 16 bytes
  static constexpr int kSteps = 8;           // MMA k16 steps per chunk
  static constexpr uint32_t kOneFactorMax = v41::kOneFactorMax<kFp4Bias>;
  template <bool WIDE>
  __device__ __forceinline__ static void dequant(const uint4& raw, uint32_t byte, uint32_t (&w)[kWords]) {
    const uint32_t q[4] = {raw.x, raw.y, raw.z, raw.w};
    mxfp4_words<WIDE>(q, byte, w);
  }
  // Step s: word i = s / 2 of the raw data, pairs (jb, jb + 4) and (jb + 1, jb + 5) of its 8 inputs, jb = 2 (s % 2).
  __device__ __forceinline__ static void a_words(const uint32_t (&w)[kWords], int s, uint32_t& lo, uint32_t& hi) {
    lo = w[4 * (s >> 1) + 2 * (s & 1)];
    hi = w[4 * (s >> 1) + 2 * (s & 1) + 1];
  }
  __device__ __forceinline__ static void b_words(const uint32_t (&x)[16], int s, uint32_t& b0, uint32_t& b1) {
    const int i = 4 * (s >> 1) + (s & 1);  // (x0, x1) or (x2, x3) ...
    b0 = __byte_perm(x[i], x[i + 2], 0x5410);
    b1 = __byte_perm(x[i], x[i + 2], 0x7632);
  }
};

template <>
struct Fmt<WFmt::kFp8> {
  static constexpr int kUnroll = 4;
  static constexpr int kInputsPerLane = 16;
  static constexpr int kWords = 8;
  static constexpr int kSteps = 4;
  static constexpr uint32_t kOneFactorMax = v41::kOneFactorMax<kFp8Bias>;
  template <bool WIDE>
  __device__ __forceinline__ static void dequant(const uint4& raw, uint32_t byte, uint32_t (&w)[kWords]) {
    const uint32_t q[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = fp8_pair<0>(q[i]);
      w[2 * i + 1] = fp8_pair<1>(q[i]);
    }
    apply_scale<kFp8Bias, WIDE>(byte, w);
  }
  __device__ __forceinline__ static void a_words(const uint32_t (&w)[kWords], int s, uint32_t& lo, uint32_t& hi) {
    lo = w[2 * s];
    hi = w[2 * s + 1];
  }
  __device__ __forceinline__ static void b_words(const uint32_t (&x)[16], int s, uint32_t& b0, uint32_t& b1) {
    b0 = x[2 * s];
    b1 = x[2 * s + 1];
  }
};

// The raw 16-byte pieces of rows g and g + 8 for U consecutive chunks, with their scale bytes.
// With XPRE (one activation group per pass) the lane's activation pieces of the same chunks are loaded here too,
// so their latency overlaps the weights' instead of following it.
template <int U, int XW, bool XPRE>
struct Batch {
  uint4 r0[U], r1[U];
  uint32_t s0[U], s1[U];
  uint4 x[XPRE ? U : 1][XPRE ? XW / 4 : 1];
  __device__ __forceinline__ bool fits_one_factor(uint32_t max_byte) const {
    uint32_t m = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) m = max(m, max(s0[u], s1[u]));
    return m <= max_byte;
  }
  __device__ __forceinline__ void load_x(const __nv_bfloat16* xr, int c0, int c_hi, int ck) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < XW / 4; ++i)
        x[u][i] = *reinterpret_cast<const uint4*>(xr + int64_t(min(c0 + u, c_hi - 1)) * ck + 8 * i);
  }
  // Chunks past the slice (c_hi) load the slice's last chunk again, unused: no branches, no zeroing.
  __device__ __forceinline__ void load(const uint8_t* w0, const uint8_t* w1, const uint8_t* sr0, const uint8_t* sr1,
                                       int c0, int c_hi, int t, int ck, int kp, int sk_log2) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = min(c0 + u, c_hi - 1);
      const int col = (c * ck + t * kp) >> sk_log2;
      r0[u] = load_stream(w0 + 64 * c);
      r1[u] = load_stream(w1 + 64 * c);
      s0[u] = sr0[col];
      s1[u] = sr1[col];
    }
  }
};

// Converts a batch and accumulates its MMAs over the activation groups of this pass. WIDE = false: every scale
// byte of the batch takes one multiply (the caller checked them across the warp).
template <WFmt F, bool WIDE, int TG, int U, int XW, bool XPRE>
__device__ __forceinline__ void compute(const Batch<U, XW, XPRE>& bt, int c0, int c_hi, int64_t m0, int64_t end,
                                        const __nv_bfloat16* const (&xr)[TG], float (&acc)[TG][4]) {
  using Traits = Fmt<F>;
  constexpr int CK = 4 * Traits::kInputsPerLane;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u;
    if (c >= c_hi) break;
    uint32_t a0w[Traits::kWords], a1w[Traits::kWords];
    Traits::template dequant<WIDE>(bt.r0[u], bt.s0[u], a0w);
    Traits::template dequant<WIDE>(bt.r1[u], bt.s1[u], a1w);
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) {
      if (m0 + tg * 8 >= end) break;  // warp-uniform
      uint32_t xw[16];
#pragma unroll
      for (int i = 0; i < XW / 4; ++i) {
        const uint4 v = XPRE ? bt.x[XPRE ? u : 0][XPRE ? i : 0]
                             : *reinterpret_cast<const uint4*>(xr[tg] + int64_t(c) * CK + 8 * i);
        xw[4 * i] = v.x, xw[4 * i + 1] = v.y, xw[4 * i + 2] = v.z, xw[4 * i + 3] = v.w;
      }
#pragma unroll
      for (int s = 0; s < Traits::kSteps; ++s) {
        uint32_t a0, a2, a1, a3, b0, b1;
        Traits::a_words(a0w, s, a0, a2);
        Traits::a_words(a1w, s, a1, a3);
        Traits::b_words(xw, s, b0, b1);
        mma_bf16_16816(acc[tg], a0, a1, a2, a3, b0, b1);
      }
    }
  }
}

template <WFmt F, int TG, bool XPRE>
__global__ void __launch_bounds__(32 * kWStreamWarps) wstream_kernel(const WStreamParams p) {
  using Traits = Fmt<F>;
  constexpr int KP = Traits::kInputsPerLane;
  constexpr int CK = 4 * KP;  // inputs per 64-byte chunk of a row
  constexpr int kUnroll = Traits::kUnroll;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;

  const int64_t e = p.active ? p.active[blockIdx.x] : int64_t(blockIdx.x);
  if (e < 0) return;
  const int64_t start = p.offsets ? p.offsets[e] : 0, end = p.offsets ? p.offsets[e + 1] : p.P;
  if (start >= end) return;

  const int n_base = (blockIdx.y * kWStreamWarps + warp) * 16;
  const int r0 = n_base + g, r1 = r0 + 8;
  const uint8_t* w0 = p.w + e * p.w_stride_e + int64_t(r0) * p.w_stride_n + 16 * t;
  const uint8_t* w1 = w0 + 8 * p.w_stride_n;
  const uint8_t* s0 = p.s + e * p.s_stride_e + int64_t(r0 / p.B0) * p.s_stride_n;
  const uint8_t* s1 = p.s + e * p.s_stride_e + int64_t(r1 / p.B0) * p.s_stride_n;
  const int64_t x_col = int64_t(n_base / p.NG) * p.K + t * KP;
  const int c_lo = blockIdx.z * p.chunks_per_split;
  const int c_hi = min(p.K / CK, c_lo + p.chunks_per_split);

  // N is a whole number of 16-row warp tiles (the binding checks it): a warp past N only joins the split-K sum.
  for (int64_t m0 = start; m0 < end && n_base < p.N; m0 += 8 * TG) {
    float acc[TG][4];
    const __nv_bfloat16* xr[TG];
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) {
      acc[tg][0] = acc[tg][1] = acc[tg][2] = acc[tg][3] = 0.f;
      const int64_t pp = m0 + tg * 8 + g;
      // lanes past the pass's rows read x row 0: their MMA columns are never stored (no zeroing, no branch)
      xr[tg] = p.x + (pp < end ? (p.rows ? p.rows[pp] : pp) * p.x_stride : 0) + x_col;
    }
    // A batch of kUnroll chunks: its loads are all issued before the first is used. (Two batches in flight,
    // one loading while the other computes, measured slower on the H200: the registers cost CTAs per SM.)
    for (int c0 = c_lo; c0 < c_hi; c0 += kUnroll) {
      Batch<kUnroll, KP / 2, XPRE> bt;
      bt.load(w0, w1, s0, s1, c0, c_hi, t, CK, KP, p.sk_log2);
      if (XPRE) bt.load_x(xr[0], c0, c_hi, CK);
      // Scale bytes above kOneFactorMax (mxfp4: scales of 2^2 and more, not seen in checkpoints) need two bf16
      // multiplies per word; the batch takes the one-multiply conversion when no lane of the warp has one.
      if (__all_sync(0xffffffffu, bt.fits_one_factor(Traits::kOneFactorMax)))
        compute<F, false, TG>(bt, c0, c_hi, m0, end, xr, acc);
      else
        compute<F, true, TG>(bt, c0, c_hi, m0, end, xr, acc);
    }
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) {
      const int64_t q0 = m0 + tg * 8 + 2 * t;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t q = q0 + (i & 1);
        const int r = i < 2 ? r0 : r1;
        if (q >= end || r >= p.N) continue;
        if (p.partial)
          p.partial[(int64_t(blockIdx.z) * p.P + q) * p.N + r] = acc[tg][i];
        else
          p.y[q * p.y_stride + r] = __float2bfloat16_rn(acc[tg][i]);
      }
    }
  }

  if (!p.partial) return;
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  const int tile = blockIdx.x * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) is_last = atomicAdd(p.counters + tile, 1) == int(gridDim.z) - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int n0 = blockIdx.y * kWStreamRowsPerCta;
  const int width = min(kWStreamRowsPerCta, p.N - n0);
  const int64_t count = (end - start) * width;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t q = start + i / width;
    const int n = n0 + int(i % width);
    float sum = 0.f;
    for (int z = 0; z < int(gridDim.z); ++z) sum += __ldcg(p.partial + (int64_t(z) * p.P + q) * p.N + n);
    p.y[q * p.y_stride + n] = __float2bfloat16_rn(sum);
  }
  if (threadIdx.x == 0) p.counters[tile] = 0;
}

template <WFmt F>
cudaError_t launch_fmt(const WStreamParams& p, int token_groups, dim3 grid, cudaStream_t stream) {
  const dim3 block(32 * kWStreamWarps);
  switch (token_groups) {
    case 1:
      if (p.x_prefetch)
        wstream_kernel<F, 1, true><<<grid, block, 0, stream>>>(p);
      else
        wstream_kernel<F, 1, false><<<grid, block, 0, stream>>>(p);
      break;
    case 2: wstream_kernel<F, 2, false><<<grid, block, 0, stream>>>(p); break;
    case 4: wstream_kernel<F, 4, false><<<grid, block, 0, stream>>>(p); break;
    case 8: wstream_kernel<F, 8, false><<<grid, block, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t wstream_launch(const WStreamParams& p, WFmt fmt, int token_groups, dim3 grid, cudaStream_t stream) {
  return fmt == WFmt::kMxfp4 ? launch_fmt<WFmt::kMxfp4>(p, token_groups, grid, stream)
                             : launch_fmt<WFmt::kFp8>(p, token_groups, grid, stream);
}

}  // namespace v41
