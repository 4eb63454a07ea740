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
#include "../common/smem.cuh"
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
  __device__ __forceinline__ static void dequant(const uint4& raw, uint32_t byte, uint32_t (&w)[kWords]) {
    const uint32_t q[4] = {raw.x, raw.y, raw.z, raw.w};
    mxfp4_words(q, byte, w);
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
  __device__ __forceinline__ static void dequant(const uint4& raw, uint32_t byte, uint32_t (&w)[kWords]) {
    const uint32_t q[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = fp8_pair<0>(q[i]);
      w[2 * i + 1] = fp8_pair<1>(q[i]);
    }
    ScaleFactor<kFp8Bias>(byte).apply(w);
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
  __device__ __forceinline__ void load_x(const __nv_bfloat16* xr, int c0, int c_hi, int ck) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < XW / 4; ++i)
        x[u][i] = xr && c0 + u < c_hi ? *reinterpret_cast<const uint4*>(xr + int64_t(c0 + u) * ck + 8 * i)
                                      : make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void load(const uint8_t* w0, const uint8_t* w1, const uint8_t* sr0, const uint8_t* sr1,
                                       bool v0, bool v1, int c0, int c_hi, int t, int ck, int kp, int sk) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u;
      r0[u] = r1[u] = make_uint4(0, 0, 0, 0);
      s0[u] = s1[u] = 127;
      if (c < c_hi) {
        const int col = (c * ck + t * kp) / sk;
        if (v0) r0[u] = load_stream(w0 + 64 * int64_t(c)), s0[u] = sr0[col];
        if (v1) r1[u] = load_stream(w1 + 64 * int64_t(c)), s1[u] = sr1[col];
      }
    }
  }
};

// Converts one chunk of rows g and g + 8 (raw bytes and scale bytes) and accumulates its MMAs over the activation
// groups of this pass; `xpre` (one group per pass): the lane's activation pieces of the chunk, already loaded.
template <WFmt F, int TG>
__device__ __forceinline__ void chunk_mma(const uint4& raw0, const uint4& raw1, uint32_t sb0, uint32_t sb1, int c,
                                          int64_t m0, int64_t end, const __nv_bfloat16* const (&xr)[TG],
                                          const uint4* xpre, float (&acc)[TG][4]) {
  using Traits = Fmt<F>;
  constexpr int CK = 4 * Traits::kInputsPerLane;
  constexpr int XW = Traits::kInputsPerLane / 2;
  uint32_t a0w[Traits::kWords], a1w[Traits::kWords];
  Traits::dequant(raw0, sb0, a0w);
  Traits::dequant(raw1, sb1, a1w);
#pragma unroll
  for (int tg = 0; tg < TG; ++tg) {
    if (m0 + tg * 8 >= end) break;  // warp-uniform
    uint32_t xw[16];
#pragma unroll
    for (int i = 0; i < XW / 4; ++i) {
      const uint4 v = xpre ? xpre[i]
                           : xr[tg] ? *reinterpret_cast<const uint4*>(xr[tg] + int64_t(c) * CK + 8 * i)
                                    : make_uint4(0, 0, 0, 0);
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

// Converts a batch and accumulates its MMAs over the activation groups of this pass.
template <WFmt F, int TG, int U, int XW, bool XPRE>
__device__ __forceinline__ void compute(const Batch<U, XW, XPRE>& bt, int c0, int c_hi, int64_t m0, int64_t end,
                                        const __nv_bfloat16* const (&xr)[TG], float (&acc)[TG][4]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (c0 + u >= c_hi) break;
    chunk_mma<F, TG>(bt.r0[u], bt.r1[u], bt.s0[u], bt.s1[u], c0 + u, m0, end, xr, XPRE ? bt.x[XPRE ? u : 0] : nullptr,
                     acc);
  }
}

// One warp's ring of DEPTH chunks for the cp.async stream: stage d holds each lane's 16 bytes of rows g and g + 8
// (rows in separate planes, so a quarter-warp's 16-byte reads hit distinct banks) and the 4-byte-aligned words
// holding their scale bytes.
template <int DEPTH>
struct PipeRing {
  uint4 w[DEPTH][2][32];
  uint32_t s[DEPTH][2][32];
};

__device__ __forceinline__ uint32_t byte_of(uint32_t word, const uint8_t* at) {
  return (word >> (8 * (reinterpret_cast<uintptr_t>(at) & 3))) & 0xFFu;
}

// One pass over chunks [c_lo, c_hi) with DEPTH − 1 chunks in flight per lane through cp.async, so the registers
// hold one chunk, not a batch (with one activation group, also the next chunk's activation pieces): each lane
// copies exactly the bytes it later reads, so no barrier is needed between lanes, only the lane's own wait. `base`
// is any valid weight address (the source of zero-filled copies).
template <WFmt F, int TG, int DEPTH>
__device__ __forceinline__ void pipelined_pass(PipeRing<DEPTH>& ring, const uint8_t* base, const uint8_t* w0,
                                               const uint8_t* w1, const uint8_t* s0, const uint8_t* s1, bool v0,
                                               bool v1, int c_lo, int c_hi, int t, int sk, int lane, int64_t m0,
                                               int64_t end, const __nv_bfloat16* const (&xr)[TG],
                                               float (&acc)[TG][4]) {
  static_assert(DEPTH >= 2 && (DEPTH & (DEPTH - 1)) == 0, "DEPTH: a power of two");
  constexpr int KP = Fmt<F>::kInputsPerLane, CK = 4 * KP;
  auto issue = [&](int c) {
    if (c < c_hi) {
      const int d = (c - c_lo) & (DEPTH - 1), col = (c * CK + t * KP) / sk;
      cp_async<16>(&ring.w[d][0][lane], v0 ? w0 + 64 * int64_t(c) : base, v0);
      cp_async<16>(&ring.w[d][1][lane], v1 ? w1 + 64 * int64_t(c) : base, v1);
      const auto word = [](const uint8_t* at) {  // the 4-byte-aligned word holding byte `at`
        return reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(at) & ~uintptr_t(3));
      };
      cp_async<4>(&ring.s[d][0][lane], v0 ? word(s0 + col) : base, v0);
      cp_async<4>(&ring.s[d][1][lane], v1 ? word(s1 + col) : base, v1);
    }
    cp_async_commit();
  };
  // One activation group: the lane's activation pieces of the next chunk are loaded while this one computes.
  constexpr int XV = KP / 8;  // uint4 of bf16 activations per lane and chunk
  uint4 x_next[XV];
  const auto load_x = [&](int c) {
#pragma unroll
    for (int i = 0; i < XV; ++i)
      x_next[i] = TG == 1 && xr[0] && c < c_hi ? *reinterpret_cast<const uint4*>(xr[0] + int64_t(c) * CK + 8 * i)
                                               : make_uint4(0, 0, 0, 0);
  };
  if constexpr (TG == 1) load_x(c_lo);
  for (int d = 0; d < DEPTH - 1; ++d) issue(c_lo + d);
  for (int c = c_lo; c < c_hi; ++c) {
    compiler_fence();  // the previous chunk's reads of the stage refilled here stay before the copy
    issue(c + DEPTH - 1);
    cp_async_wait<DEPTH - 1>();
    compiler_fence();
    const int d = (c - c_lo) & (DEPTH - 1), col = (c * CK + t * KP) / sk;
    const uint4 raw0 = ring.w[d][0][lane], raw1 = ring.w[d][1][lane];
    const uint32_t sb0 = v0 ? byte_of(ring.s[d][0][lane], s0 + col) : 127u;
    const uint32_t sb1 = v1 ? byte_of(ring.s[d][1][lane], s1 + col) : 127u;
    if constexpr (TG == 1) {
      uint4 x_cur[XV];
#pragma unroll
      for (int i = 0; i < XV; ++i) x_cur[i] = x_next[i];
      load_x(c + 1);
      chunk_mma<F, TG>(raw0, raw1, sb0, sb1, c, m0, end, xr, x_cur, acc);
    } else {
      chunk_mma<F, TG>(raw0, raw1, sb0, sb1, c, m0, end, xr, nullptr, acc);
    }
  }
  cp_async_wait<0>();
  compiler_fence();
}

template <WFmt F, int TG, bool XPRE, int DEPTH>
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
  const bool v0 = r0 < p.N, v1 = r1 < p.N;
  const uint8_t* w0 = p.w + e * p.w_stride_e + int64_t(r0) * p.w_stride_n + 16 * t;
  const uint8_t* w1 = w0 + 8 * p.w_stride_n;
  const uint8_t* s0 = p.s + e * p.s_stride_e + int64_t(r0 / p.B0) * p.s_stride_n;
  const uint8_t* s1 = p.s + e * p.s_stride_e + int64_t(r1 / p.B0) * p.s_stride_n;
  const int64_t x_col = int64_t(n_base / p.NG) * p.K + t * KP;
  const int c_lo = blockIdx.z * p.chunks_per_split;
  const int c_hi = min(p.K / CK, c_lo + p.chunks_per_split);

  for (int64_t m0 = start; m0 < end; m0 += 8 * TG) {
    float acc[TG][4];
    const __nv_bfloat16* xr[TG];
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) {
      acc[tg][0] = acc[tg][1] = acc[tg][2] = acc[tg][3] = 0.f;
      const int64_t pp = m0 + tg * 8 + g;
      // warps past the last row tile read no activations (their group column would be past x's end)
      xr[tg] = pp < end && n_base < p.N ? p.x + (p.rows ? p.rows[pp] : pp) * p.x_stride + x_col : nullptr;
    }
    if constexpr (DEPTH > 0) {
      __shared__ PipeRing<DEPTH> rings[kWStreamWarps];
      pipelined_pass<F, TG, DEPTH>(rings[warp], p.w, w0, w1, s0, s1, v0, v1, c_lo, c_hi, t, p.SK, lane, m0, end,
                                   xr, acc);
    } else {
      // A batch of kUnroll chunks: its loads are all issued before the first is used. (Two register batches in
      // flight, one loading while the other computes, measured slower on the H200: the registers cost CTAs per SM.)
      for (int c0 = c_lo; c0 < c_hi; c0 += kUnroll) {
        Batch<kUnroll, KP / 2, XPRE> bt;
        bt.load(w0, w1, s0, s1, v0, v1, c0, c_hi, t, CK, KP, p.SK);
        if (XPRE) bt.load_x(xr[0], c0, c_hi, CK);
        compute<F, TG>(bt, c0, c_hi, m0, end, xr, acc);
      }
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

template <WFmt F, int DEPTH>
cudaError_t launch_depth(const WStreamParams& p, int token_groups, dim3 grid, cudaStream_t stream) {
  const dim3 block(32 * kWStreamWarps);
  switch (token_groups) {
    case 1:
      if constexpr (DEPTH == 0) {  // the ring streams activations after the weights: no prefetch variant
        if (p.x_prefetch) {
          wstream_kernel<F, 1, true, 0><<<grid, block, 0, stream>>>(p);
          break;
        }
      }
      wstream_kernel<F, 1, false, DEPTH><<<grid, block, 0, stream>>>(p);
      break;
    case 2: wstream_kernel<F, 2, false, DEPTH><<<grid, block, 0, stream>>>(p); break;
    case 4: wstream_kernel<F, 4, false, DEPTH><<<grid, block, 0, stream>>>(p); break;
    case 8: wstream_kernel<F, 8, false, DEPTH><<<grid, block, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <WFmt F>
cudaError_t launch_fmt(const WStreamParams& p, int token_groups, dim3 grid, cudaStream_t stream) {
  switch (p.pipeline) {
    case 0: return launch_depth<F, 0>(p, token_groups, grid, stream);
    case 4: return launch_depth<F, 4>(p, token_groups, grid, stream);
    case 8: return launch_depth<F, 8>(p, token_groups, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t wstream_launch(const WStreamParams& p, WFmt fmt, int token_groups, dim3 grid, cudaStream_t stream) {
  return fmt == WFmt::kMxfp4 ? launch_fmt<WFmt::kMxfp4>(p, token_groups, grid, stream)
                             : launch_fmt<WFmt::kFp8>(p, token_groups, grid, stream);
}

}  // namespace v41
