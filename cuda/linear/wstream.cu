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
// bf16 multiply per pair of weights applies the scale exactly. Activation rows are taken 8 at a time; more rows
// per expert make more passes over its weights, which L2 mostly serves.
//
// Split-K: grid.z slices K; each slice writes float32 partials and the last CTA of a tile to arrive (a counter per
// tile, reset by it) sums them in slice order, so results do not depend on timing.
#include "../common/dequant.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
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
// With XPRE the lane's activation pieces of the same chunks are loaded here too, so their latency overlaps the
// weights' instead of following it.
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
  // Chunks past the slice (c_hi) load the slice's last chunk again, unused: no branches, no zeroing.
  __device__ __forceinline__ void load_x(const __nv_bfloat16* xr, int c0, int c_hi, int ck) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < XW / 4; ++i)
        x[u][i] = *reinterpret_cast<const uint4*>(xr + int64_t(min(c0 + u, c_hi - 1)) * ck + 8 * i);
  }
  __device__ __forceinline__ void load_scales(const uint8_t* sr0, const uint8_t* sr1, int c0, int c_hi, int t, int ck,
                                              int kp, int sk_log2) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = (min(c0 + u, c_hi - 1) * ck + t * kp) >> sk_log2;
      s0[u] = sr0[col];
      s1[u] = sr1[col];
    }
  }
  __device__ __forceinline__ void load(const uint8_t* w0, const uint8_t* w1, const uint8_t* sr0, const uint8_t* sr1,
                                       int c0, int c_hi, int t, int ck, int kp, int sk_log2) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = min(c0 + u, c_hi - 1);
      r0[u] = load_stream(w0 + 64 * c);
      r1[u] = load_stream(w1 + 64 * c);
    }
    load_scales(sr0, sr1, c0, c_hi, t, ck, kp, sk_log2);
  }
};

// Converts a batch and accumulates its MMAs for the pass's 8 activation rows (xr: this lane's row). WIDE = false:
// every scale byte of the batch takes one multiply (the caller checked them across the warp).
template <WFmt F, bool WIDE, int U, int XW, bool XPRE>
__device__ __forceinline__ void compute(const Batch<U, XW, XPRE>& bt, int c0, int c_hi, const __nv_bfloat16* xr,
                                        float (&acc)[4]) {
  using Traits = Fmt<F>;
  constexpr int CK = 4 * Traits::kInputsPerLane;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u;
    if (c >= c_hi) break;
    uint32_t a0w[Traits::kWords], a1w[Traits::kWords];
    Traits::template dequant<WIDE>(bt.r0[u], bt.s0[u], a0w);
    Traits::template dequant<WIDE>(bt.r1[u], bt.s1[u], a1w);
    uint32_t xw[16];
#pragma unroll
    for (int i = 0; i < XW / 4; ++i) {
      const uint4 v = XPRE ? bt.x[XPRE ? u : 0][XPRE ? i : 0]
                           : *reinterpret_cast<const uint4*>(xr + int64_t(c) * CK + 8 * i);
      xw[4 * i] = v.x, xw[4 * i + 1] = v.y, xw[4 * i + 2] = v.z, xw[4 * i + 3] = v.w;
    }
#pragma unroll
    for (int s = 0; s < Traits::kSteps; ++s) {
      uint32_t a0, a2, a1, a3, b0, b1;
      Traits::a_words(a0w, s, a0, a2);
      Traits::a_words(a1w, s, a1, a3);
      Traits::b_words(xw, s, b0, b1);
      mma_bf16_16816(acc, a0, a1, a2, a3, b0, b1);
    }
  }
}

// Scale bytes above kOneFactorMax (mxfp4: scales of 2^2 and more, not seen in checkpoints) need two bf16
// multiplies per word; a batch takes the one-multiply conversion when no lane of the warp has one.
template <WFmt F, int U, int XW, bool XPRE>
__device__ __forceinline__ void convert_and_mma(const Batch<U, XW, XPRE>& bt, int c0, int c_hi,
                                                const __nv_bfloat16* xr, float (&acc)[4]) {
  if (__all_sync(0xffffffffu, bt.fits_one_factor(Fmt<F>::kOneFactorMax)))
    compute<F, false>(bt, c0, c_hi, xr, acc);
  else
    compute<F, true>(bt, c0, c_hi, xr, acc);
}

// One lane's view of its CTA's work: the expert and its rows of x, this lane's weight rows and scale rows, the
// CTA's K slice.
template <WFmt F>
struct Tile {
  static constexpr int KP = Fmt<F>::kInputsPerLane, CK = 4 * KP;  // inputs per lane and per 64-byte chunk
  int64_t e, start, end;  // expert and its rows [start, end) of x / y
  int n0, n_base, r0, r1, c_lo, c_hi;
  int64_t x_col;
  const uint8_t *s0, *s1;
  __device__ __forceinline__ bool init(const WStreamParams& p, int warp, int g, int t) {
    e = p.active ? p.active[blockIdx.x] : int64_t(blockIdx.x);
    if (e < 0) return false;
    start = p.offsets ? p.offsets[e] : 0;
    end = p.offsets ? p.offsets[e + 1] : p.P;
    n0 = blockIdx.y * kWStreamRowsPerCta;
    n_base = n0 + warp * 16;
    r0 = n_base + g, r1 = r0 + 8;
    s0 = p.s + e * p.s_stride_e + int64_t(r0 / p.B0) * p.s_stride_n;
    s1 = p.s + e * p.s_stride_e + int64_t(r1 / p.B0) * p.s_stride_n;
    x_col = int64_t(n_base / p.NG) * p.K + t * KP;
    c_lo = blockIdx.z * p.chunks_per_split;
    c_hi = min(p.K / CK, c_lo + p.chunks_per_split);
    return start < end;
  }
  // This lane's x row for the pass at m0; lanes past the pass's rows read x row 0: their MMA columns are never
  // stored (no zeroing, no branch).
  __device__ __forceinline__ const __nv_bfloat16* x_row(const WStreamParams& p, int64_t m0, int g) const {
    const int64_t pp = m0 + g;
    return p.x + (pp < end ? (p.rows ? p.rows[pp] : pp) * p.x_stride : 0) + x_col;
  }
  __device__ __forceinline__ void store(const WStreamParams& p, const float (&acc)[4], int64_t m0, int t) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t q = m0 + 2 * t + (i & 1);
      const int r = i < 2 ? r0 : r1;
      if (q >= end || r >= p.N) continue;
      if (p.partial)
        p.partial[(int64_t(blockIdx.z) * p.P + q) * p.N + r] = acc[i];
      else
        p.y[q * p.y_stride + r] = __float2bfloat16_rn(acc[i]);
    }
  }
  // Split-K: the last CTA of the tile to arrive sums the slices' partials in slice order and resets the counter.
  __device__ __forceinline__ void sum_partials(const WStreamParams& p) const {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    const int tile = blockIdx.x * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) is_last = atomicAdd(p.counters + tile, 1) == int(gridDim.z) - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const int width = min(kWStreamRowsPerCta, p.N - n0);
    const int64_t count = (end - start) * width;
    constexpr int kLoads = 8;  // partials loaded before they are added: one L2 round trip per 8 slices, not per slice
    const int split = int(gridDim.z);
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
      const int64_t q = start + i / width;
      const int n = n0 + int(i % width);
      const float* part = p.partial + q * p.N + n;
      float sum = 0.f;
      for (int z0 = 0; z0 < split; z0 += kLoads) {
        float v[kLoads];
#pragma unroll
        for (int j = 0; j < kLoads; ++j) v[j] = z0 + j < split ? __ldcg(part + int64_t(z0 + j) * p.P * p.N) : 0.f;
#pragma unroll
        for (int j = 0; j < kLoads; ++j)
          if (z0 + j < split) sum += v[j];  // slice order, as before: the same bits
      }
      p.y[q * p.y_stride + n] = __float2bfloat16_rn(sum);
    }
    if (threadIdx.x == 0) p.counters[tile] = 0;
  }
};

// Register batches: each lane loads its own 16-byte pieces of kUnroll chunks, then converts them. (Staging the
// CTA's rows in shared memory through per-row bulk copies and mbarriers measured 2-3x slower on the H200, a
// per-lane cp.async ring 5-60 % slower: benches/RESULTS.md.)
// MIN_CTAS > 1 caps the registers so that many CTAs fit per SM (5: 96 per thread, no spills without XPRE).
// DBU > 0 (double-buffered): two batches of DBU chunks in registers, the next one's loads issued before the current
// one is converted, so a warp keeps loads in flight while it computes; for small grids (decode at one row), where
// the registers cost no CTAs.
template <WFmt F, bool XPRE, int MIN_CTAS, int DBU>
__global__ void __launch_bounds__(32 * kWStreamWarps, MIN_CTAS) wstream_kernel(const WStreamParams p) {
  using Traits = Fmt<F>;
  constexpr int KP = Tile<F>::KP, CK = Tile<F>::CK, kUnroll = DBU > 0 ? DBU : Traits::kUnroll;
  constexpr bool DB = DBU > 0;
  static_assert(!(DB && XPRE), "double-buffered batches load no activations");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // Programmatic dependent launch (common/pdl.cuh): a dense linear's tile depends on nothing the previous kernel
  // writes, so its first batch of weights is loaded before the wait and overlaps that kernel; an expert GEMM's
  // tile comes from the routing (active, offsets, rows), so it waits first.
  const bool routed = p.active != nullptr || p.offsets != nullptr || p.rows != nullptr;
  if (routed) pdl_wait();
  Tile<F> tl;
  if (!tl.init(p, warp, g, t)) return;
  const uint8_t* w0 = p.w + tl.e * p.w_stride_e + int64_t(tl.r0) * p.w_stride_n + 16 * t;
  const uint8_t* w1 = w0 + 8 * p.w_stride_n;
  Batch<kUnroll, KP / 2, XPRE> bt, nx;
  const auto load = [&](Batch<kUnroll, KP / 2, XPRE>& b, int c0) {
    b.load(w0, w1, tl.s0, tl.s1, c0, tl.c_hi, t, CK, KP, p.sk_log2);
  };
  bool preloaded = !routed && tl.n_base < p.N;
  if (preloaded) load(bt, tl.c_lo);
  if (!routed) pdl_wait();
  pdl_launch_dependents();

  // N is a whole number of 16-row warp tiles (the binding checks it): a warp past N only joins the split-K sum.
  for (int64_t m0 = tl.start; m0 < tl.end && tl.n_base < p.N; m0 += 8) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const __nv_bfloat16* xr = tl.x_row(p, m0, g);
    if (!DB) {
      // A batch of kUnroll chunks: its loads are all issued before the first is used.
      for (int c0 = tl.c_lo; c0 < tl.c_hi; c0 += kUnroll) {
        if (!preloaded) load(bt, c0);
        preloaded = false;
        if (XPRE) bt.load_x(xr, c0, tl.c_hi, CK);
        convert_and_mma<F>(bt, c0, tl.c_hi, xr, acc);
      }
    } else {
      // Ping-pong: bt holds chunks c0.., nx chunks c0 + kUnroll..; each is loaded a batch ahead of its use.
      if (!preloaded) load(bt, tl.c_lo);
      preloaded = false;
      for (int c0 = tl.c_lo; c0 < tl.c_hi; c0 += 2 * kUnroll) {
        const int c1 = c0 + kUnroll, c2 = c1 + kUnroll;
        if (c1 < tl.c_hi) load(nx, c1);
        convert_and_mma<F>(bt, c0, tl.c_hi, xr, acc);
        if (c2 < tl.c_hi) load(bt, c2);
        if (c1 < tl.c_hi) convert_and_mma<F>(nx, c1, tl.c_hi, xr, acc);
      }
    }
    tl.store(p, acc, m0, t);
  }
  if (p.partial) tl.sum_partials(p);
}

template <WFmt F>
cudaError_t launch_fmt(const WStreamParams& p, bool five_ctas, int double_buffer, dim3 grid, cudaStream_t stream,
                       bool pdl) {
  auto kernel = p.x_prefetch       ? wstream_kernel<F, true, 1, 0>
              : double_buffer == 2 ? wstream_kernel<F, false, 4, 2>
              : five_ctas          ? wstream_kernel<F, false, 5, 0>
                                   : wstream_kernel<F, false, 1, 0>;
  return launch_kernel(kernel, grid, dim3(32 * kWStreamWarps), 0, stream, pdl, p);
}

}  // namespace

cudaError_t wstream_launch(const WStreamParams& p, WFmt fmt, bool five_ctas, int double_buffer, dim3 grid,
                           cudaStream_t stream, bool pdl) {
  return fmt == WFmt::kMxfp4 ? launch_fmt<WFmt::kMxfp4>(p, five_ctas, double_buffer, grid, stream, pdl)
                             : launch_fmt<WFmt::kFp8>(p, five_ctas, double_buffer, grid, stream, pdl);
}

}  // namespace v41
