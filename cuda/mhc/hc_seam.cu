// One mHC seam in one launch (docs/model.md §3.4, §3.2; docs/kernels.md §2 "mHC, router, compressor"):
//   expansion (optional): H'[j] = post[j]·y + Σ_i comb[i, j]·H[i]         the previous sub-layer's output y
//   mixes = fn · (flat H' · rsqrt(mean(flat H'²) + eps))                  24 dot products of length 4·D per token
//   pre = sigmoid(mixes[0:4]·scale0 + base) + eps, post = 2·sigmoid(mixes[4:8]·scale1 + base),
//   comb = Sinkhorn(softmax(mixes[8:24]·scale2 + base) + eps): one column normalisation, then iters − 1 rounds of
//          row then column normalisation
//   collapse (optional): x = rms_norm(bf16(Σ_i w[i]·H'[i])) · norm_w, w = the given pre (V4.1's delayed pre-mix) or
//          this seam's pre (V4)
// The references: python/v41/kernels/mhc.py hc_expand_ref, hc_mixes_ref, hc_collapse_norm_ref.
//
// Layout of the work (decode sizes, T ≤ kHcMaxTokens). CTA c owns columns [64c, 64c + 64) of each of the 4 copies;
// thread (copy i, column d) holds fn's 24 weights of flat column i·D + d in registers — loaded before the
// programmatic-dependent wait, so the seam's 2 MB of float32 mix weights stream in while the previous kernel ends —
// and puts its element of H' for each token in shared memory (computed there when expanding and stored rounded to
// bf16: the mixes and the collapse read the copies as stored). With a given collapse weight the threads of copy 0
// form the collapsed column from the four copies' elements, round it to bf16 and square it. Each thread's 26 values
// (24 products, H'², x²) are summed over the warp by a transposing butterfly (31 shuffles: lane l ends with value
// l's sum), then over the 8 warps in order, and written as the CTA's float32 partials. The last CTA to arrive (an
// arrival counter that wraps back to zero at the last arrival) sums every CTA's partials in a fixed order and
// finishes each token in one thread (sigmoids, softmax and Sinkhorn in registers; reciprocals by rcp.approx,
// within an ulp). With a given collapse weight it then publishes each row's RMS scale and moves a generation word
// on; the other CTAs wait for that word after arriving, then read the scales and store their own normalised
// columns. Waiting CTAs hold their SMs, so the whole grid must be resident at once: the binding takes this mode only
// while D / 64 CTAs fit the GPU at the kernel's occupancy (hc_seam_max_ctas), and nothing the waiting CTAs need
// comes from a later kernel. With this seam's pre the last CTA collapses and normalises the whole rows itself (few
// tokens: python/v41/kernels/mhc_cuda.py). Sums never depend on timing, so results repeat
// bit for bit; they differ from the Triton kernels' only in summation order.
#include "../common/bf16.cuh"
#include "../common/pdl.cuh"
#include "hc_seam.h"

namespace v41 {
namespace {

constexpr int kThreads = 4 * kHcCols;  // one thread per (copy, column)
constexpr int kWarps = kThreads / 32;
constexpr int kMix = 24;   // (2 + 4)·4 mixes: value slots 0..23
constexpr int kSqH = 24;   // slot of Σ H'² (the mixes' RMS)
constexpr int kSqX = 25;   // slot of Σ x² (the collapse's RMS, a given weight)

// One step of the transposing butterfly: lanes keep a[0..W) as the half of a[0..2W) that their bit W selects, summed
// with the partner lane's copy of that half.
template <int W>
__device__ __forceinline__ void transpose_step(float (&a)[32], int lane) {
  const bool upper = lane & W;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float send = upper ? a[k] : a[k + W];
    const float keep = upper ? a[k + W] : a[k];
    a[k] = keep + __shfl_xor_sync(0xffffffffu, send, W);
  }
}

// a[0..31] of every lane → lane l returns Σ over the warp of a[l] (31 shuffles)
__device__ __forceinline__ float warp_transpose_sum(float (&a)[32], int lane) {
  transpose_step<16>(a, lane);
  transpose_step<8>(a, lane);
  transpose_step<4>(a, lane);
  transpose_step<2>(a, lane);
  transpose_step<1>(a, lane);
  return a[0];
}

// Σ of v over the CTA, the same value in every thread (fixed order); `scratch` holds kWarps floats.
__device__ __forceinline__ float block_sum(float v, float* scratch, int tid) {
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  if ((tid & 31) == 0) scratch[tid >> 5] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += scratch[w];
  __syncthreads();
  return s;
}

__device__ __forceinline__ float rcp(float x) {  // rcp.approx: within one ulp
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float sigmoid(float x) { return rcp(1.f + expf(-x)); }

// Token t's pre, post and comb from its summed values w (slots above); pre also into pre_s [4].
__device__ void finish_token(const HcSeamParams& p, const float* w, int t, float* pre_s) {
  const float r = 1.f / sqrtf(w[kSqH] / float(4 * p.D) + p.norm_eps);
  const float s0 = p.scale[0], s1 = p.scale[1], s2 = p.scale[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    pre_s[i] = sigmoid(w[i] * r * s0 + p.base[i]) + p.hc_eps;
    p.pre[t * 4 + i] = pre_s[i];
    p.post[t * 4 + i] = 2.f * sigmoid(w[4 + i] * r * s1 + p.base[4 + i]);
  }
  float c[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // softmax over j of row i, then + eps
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[i][j] = w[8 + 4 * i + j] * r * s2 + p.base[8 + 4 * i + j];
      mx = fmaxf(mx, c[i][j]);
    }
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[i][j] = expf(c[i][j] - mx);
      sum += c[i][j];
    }
    const float inv = rcp(sum);
#pragma unroll
    for (int j = 0; j < 4; ++j) c[i][j] = c[i][j] * inv + p.hc_eps;
  }
  for (int it = 0; it < p.iters; ++it) {  // iters ≥ 1 (the binding checks)
    if (it > 0) {  // rows (over j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float inv = rcp(c[i][0] + c[i][1] + c[i][2] + c[i][3] + p.hc_eps);
#pragma unroll
        for (int j = 0; j < 4; ++j) c[i][j] *= inv;
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // columns (over i)
      const float inv = rcp(c[0][j] + c[1][j] + c[2][j] + c[3][j] + p.hc_eps);
#pragma unroll
      for (int i = 0; i < 4; ++i) c[i][j] *= inv;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) p.comb[t * 16 + 4 * i + j] = c[i][j];
}

// With this seam's pre (pre_s [T, 4]): x[t] = rms_norm(bf16(Σ_i pre[t, i]·H'[t, i])) · norm_w, the whole rows in
// the last CTA (H' from h_out, written by every CTA, when expanding). A thread's kChunks chunks of 4 columns
// are loaded together and kept in registers between the sum of squares and the scaling (D ≤ kHcFreshMaxD).
template <bool EXPAND>
__device__ void collapse_rows(const HcSeamParams& p, const float* pre_s, float* scratch, int tid) {
  constexpr int kChunks = kHcFreshMaxD / 4 / kThreads;
  const int n4 = p.D / 4;
  const uint2* h4 = reinterpret_cast<const uint2*>(EXPAND ? p.h_out : p.h);
  uint2* x4 = reinterpret_cast<uint2*>(p.x);
  const uint2* w4 = reinterpret_cast<const uint2*>(p.norm_w);
  for (int t = 0; t < p.T; ++t) {
    uint2 raw[kChunks][4];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = min(tid + j * kThreads, n4 - 1);  // past the row: read again, unused
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint2* src = h4 + (int64_t(t) * 4 + i) * n4 + c;
        raw[j][i] = EXPAND ? __ldcg(src) : *src;
      }
    }
    Bf4 xb[kChunks];
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      Bf4 acc;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const Bf4 hv(raw[j][i]);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc.v[e] = fmaf(pre_s[t * 4 + i], hv.v[e], acc.v[e]);
      }
      xb[j] = Bf4(acc.pack());  // the collapse as stored
      if (tid + j * kThreads < n4)
#pragma unroll
        for (int e = 0; e < 4; ++e) sq = fmaf(xb[j].v[e], xb[j].v[e], sq);
    }
    const float r = 1.f / sqrtf(block_sum(sq, scratch, tid) / float(p.D) + p.x_eps);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = tid + j * kThreads;
      if (c >= n4) break;
      const Bf4 w(__ldg(w4 + c));
#pragma unroll
      for (int e = 0; e < 4; ++e) xb[j].v[e] = (xb[j].v[e] * r) * w.v[e];
      x4[int64_t(t) * n4 + c] = xb[j].pack();
    }
  }
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

template <bool EXPAND, HcCollapse C>
__global__ void __launch_bounds__(kThreads) hc_seam_kernel(const HcSeamParams p) {
  constexpr bool kGiven = C == HcCollapse::kGiven;
  __shared__ __align__(16) float red[kWarps * kHcMaxTokens * 32];  // per warp and token; then the finish's groups
  __shared__ float xv[kHcMaxTokens * kThreads];  // [t][copy][column]: H'; copy 0's slot then the collapsed column
  __shared__ float tot[kHcMaxTokens * 32];
  __shared__ float pre_s[kHcMaxTokens * 4];
  __shared__ float rx[kHcMaxTokens];
  __shared__ int is_last;
  __shared__ unsigned gen0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int copy = tid / kHcCols, col = tid % kHcCols, d = blockIdx.x * kHcCols + col;
  const int64_t D = p.D, K = 4 * D, k = copy * D + d;
  float f[kMix];
#pragma unroll
  for (int m = 0; m < kMix; ++m) f[m] = __ldg(p.fn + m * K + k);  // constants: before the wait
  pdl_wait();
  pdl_launch_dependents();
  unsigned* const arrivals = reinterpret_cast<unsigned*>(p.sync);
  unsigned* const generation = arrivals + 1;
  if (tid == 0) gen0 = ld_acquire(generation);  // before arriving: the finisher moves it on after everyone has

  // H', 4 tokens a round: their loads are issued together (past the last token they read it again, unstored)
  for (int t0 = 0; t0 < p.T; t0 += 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = min(t0 + j, p.T - 1);
      const __nv_bfloat16* h = p.h + t * K;
      float v;
      if constexpr (EXPAND) {
        const float* cb = p.comb_in + t * 16 + copy;  // comb[i, copy] at 4i + copy
        v = p.post_in[t * 4 + copy] * __bfloat162float(p.y[t * D + d]);
#pragma unroll
        for (int i = 0; i < 4; ++i) v = fmaf(cb[4 * i], __bfloat162float(h[i * D + d]), v);
        const __nv_bfloat16 hb = __float2bfloat16_rn(v);
        if (t0 + j < p.T) p.h_out[t * K + k] = hb;
        v = __bfloat162float(hb);
      } else {
        v = __bfloat162float(h[k]);
      }
      if (t0 + j < p.T) xv[t * kThreads + tid] = v;
    }
  }
  __syncthreads();
#pragma unroll 1
  for (int t = 0; t < p.T; ++t) {
    const float xt = xv[t * kThreads + tid];
    float a[32];
#pragma unroll
    for (int m = 0; m < kMix; ++m) a[m] = f[m] * xt;
    a[kSqH] = xt * xt;
    a[kSqX] = 0.f;
    if (kGiven && copy == 0) {  // the collapsed column, rounded as stored; kept in copy 0's slot
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc = fmaf(p.pre_c[t * 4 + i], xv[t * kThreads + i * kHcCols + col], acc);
      const float xb = __bfloat162float(__float2bfloat16_rn(acc));
      xv[t * kThreads + col] = xb;
      a[kSqX] = xb * xb;
    }
#pragma unroll
    for (int m = kSqX + 1; m < 32; ++m) a[m] = 0.f;
    red[(warp * kHcMaxTokens + t) * 32 + lane] = warp_transpose_sum(a, lane);
  }
  __syncthreads();
  for (int i = tid; i < p.T * 32; i += kThreads) {  // the CTA's partials: warps in order
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[w * kHcMaxTokens * 32 + i];
    p.partial[int64_t(blockIdx.x) * p.T * 32 + i] = s;
  }
  __threadfence();
  __syncthreads();
  // the last arrival also wraps the counter to zero for the next launch (a stale count heals after one)
  if (tid == 0) is_last = atomicInc(arrivals, gridDim.x - 1) == gridDim.x - 1;
  __syncthreads();
  const int slices = gridDim.x;
  float* rx_out = p.partial + int64_t(slices) * p.T * 32;  // the rows' RMS scales, published by the finisher
  if (!is_last) {
    if constexpr (!kGiven) return;
    // wait for the finisher and read its scales (the whole grid is resident at once: the binding checks
    // hc_seam_max_ctas, so the finisher is not kept off an SM by a waiting CTA)
    if (tid == 0)
      while (ld_acquire(generation) == gen0) __nanosleep(32);
    __syncthreads();
    if (tid < p.T) rx[tid] = __ldcg(rx_out + tid);
    __syncthreads();
  } else {
    __threadfence();
    // The finish. Thread (group g, float4 column q) sums slices g, g + groups, … in that order (16 loads in
    // flight); then the groups in order; then one thread per token.
    const int n4 = p.T * 8, groups = kThreads / n4;
    float4* grp = reinterpret_cast<float4*>(red);
    if (tid < groups * n4) {
      const int q = tid % n4, g = tid / n4;
      const float4* part = reinterpret_cast<const float4*>(p.partial) + q;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s0 = g; s0 < slices; s0 += 16 * groups) {
        float4 v[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int s = s0 + j * groups;
          v[j] = s < slices ? __ldcg(part + int64_t(s) * n4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < 16; ++j)
          if (s0 + j * groups < slices)
            acc = make_float4(acc.x + v[j].x, acc.y + v[j].y, acc.z + v[j].z, acc.w + v[j].w);
      }
      grp[g * n4 + q] = acc;
    }
    __syncthreads();
    for (int i = tid; i < p.T * 32; i += kThreads) {
      float s = 0.f;
      for (int g = 0; g < groups; ++g) s += red[g * n4 * 4 + i];
      tot[i] = s;
    }
    __syncthreads();
    if (tid < p.T) {
      finish_token(p, tot + tid * 32, tid, pre_s + tid * 4);
      if constexpr (kGiven) rx_out[tid] = rx[tid] = 1.f / sqrtf(tot[tid * 32 + kSqX] / float(p.D) + p.x_eps);
    }
    __threadfence();
    __syncthreads();
    if (kGiven && tid == 0) st_release(generation, gen0 + 1u);  // release the waiting CTAs
    if constexpr (C == HcCollapse::kFresh) collapse_rows<EXPAND>(p, pre_s, tot, tid);
  }
  if constexpr (kGiven) {  // every CTA scales its own collapsed columns
    if (copy == 0) {
      const float w = __bfloat162float(p.norm_w[d]);
      for (int t = 0; t < p.T; ++t) p.x[t * D + d] = __float2bfloat16_rn((xv[t * kThreads + col] * rx[t]) * w);
    }
  }
}

template <bool EXPAND>
cudaError_t launch_expand(const HcSeamParams& p, HcCollapse collapse, cudaStream_t stream, bool pdl) {
  const dim3 grid(p.D / kHcCols), block(kThreads);
  switch (collapse) {
    case HcCollapse::kGiven:
      return launch_kernel(hc_seam_kernel<EXPAND, HcCollapse::kGiven>, grid, block, 0, stream, pdl, p);
    case HcCollapse::kFresh:
      return launch_kernel(hc_seam_kernel<EXPAND, HcCollapse::kFresh>, grid, block, 0, stream, pdl, p);
    default:
      return launch_kernel(hc_seam_kernel<EXPAND, HcCollapse::kNone>, grid, block, 0, stream, pdl, p);
  }
}

}  // namespace

int hc_seam_max_ctas(int device) {
  static int known[64] = {};  // by device (the binding checks every given-weights launch against it); threads that
                              // race here store the same value
  if (device >= 0 && device < 64 && known[device] > 0) return known[device];
  int per_sm = 0, sms = 0, current = -1;
  // the occupancy query answers for the current device: ask it on `device` (switching only when another device
  // is current, so no other device's context is created), then restore the caller's
  bool ok = cudaGetDevice(&current) == cudaSuccess;
  const bool other = ok && current != device;
  ok = ok && (!other || cudaSetDevice(device) == cudaSuccess) &&
       cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, hc_seam_kernel<true, HcCollapse::kGiven>, kThreads,
                                                     0) == cudaSuccess &&
       cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess;
  if (other) (void)cudaSetDevice(current);
  if (!ok) {
    (void)cudaGetLastError();
    return 0;
  }
  if (device >= 0 && device < 64) known[device] = per_sm * sms;
  return per_sm * sms;
}

cudaError_t hc_seam_launch(const HcSeamParams& p, HcCollapse collapse, cudaStream_t stream, bool pdl) {
  return p.y ? launch_expand<true>(p, collapse, stream, pdl) : launch_expand<false>(p, collapse, stream, pdl);
}

}  // namespace v41
