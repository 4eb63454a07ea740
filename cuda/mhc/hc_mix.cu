// One mHC seam in one launch (docs/model.md §3.4; docs/kernels.md §2 "mHC, router, compressor"): optionally the
// expansion of the previous sub-layer's output into the residual copies, H'[j] = post[j]·y + Σ_i comb[i, j]·H[i],
// then the next sub-layer's mixes from H' = flatten(H') [4·D]:
//   mixes = fn · (H' · rsqrt(mean(H'²) + eps))          24 dot products of length 4·D per token
//   pre = sigmoid(mixes[0:4]·scale0 + base) + eps, post = 2·sigmoid(mixes[4:8]·scale1 + base),
//   comb = Sinkhorn(softmax(mixes[8:24]·scale2 + base) + eps): one column normalisation, then iters − 1 rounds of
//   row then column normalisation (the reference: python/v41/kernels/mhc.py hc_mixes_ref, hc_expand_ref).
//
// Layout of the work (decode sizes, T ≤ kHcMaxTokens). CTA c owns columns [64c, 64c + 64) of each of the 4 copies;
// thread (copy i, column d) holds fn's 24 weights of flat column i·D + d in registers — loaded before the
// programmatic-dependent wait, so the seam's 2 MB of float32 mix weights stream in while the previous kernel ends —
// and, per token, its one element of H' (computed there when expanding, stored rounded to bf16: the mixes read the
// copies as stored). Its 25 products (24 dots and the square) are summed over the warp by a transposing butterfly
// (31 shuffles: lane l ends with value l's sum), then over the 8 warps in order, and written as the CTA's float32
// partials. The last CTA to arrive (an arrival counter it resets) sums the partials of every CTA in a fixed order
// and finishes each token in one thread: sigmoids, softmax and Sinkhorn in registers. Sums never depend on timing,
// so the results are the same on every run; they differ from the Triton kernels' only in summation order.
#include "../common/pdl.cuh"
#include "hc_mix.h"

namespace v41 {
namespace {

constexpr int kThreads = 4 * kHcCols;  // one thread per (copy, column)
constexpr int kWarps = kThreads / 32;
constexpr int kMix = 24;  // (2 + 4)·4 mixes

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

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Token t's pre, post and comb from its 25 summed values w (24 dots, the sum of squares over K = 4·D inputs).
__device__ void finish_token(const HcMixParams& p, const float* w, int t) {
  const float r = 1.f / sqrtf(w[24] / float(4 * p.D) + p.norm_eps);
  const float s0 = p.scale[0], s1 = p.scale[1], s2 = p.scale[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    p.pre[t * 4 + i] = sigmoid(w[i] * r * s0 + p.base[i]) + p.hc_eps;
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
#pragma unroll
    for (int j = 0; j < 4; ++j) c[i][j] = c[i][j] / sum + p.hc_eps;
  }
  for (int it = 0; it < p.iters; ++it) {  // iters ≥ 1 (the binding checks)
    if (it > 0) {  // rows (over j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float inv = 1.f / (c[i][0] + c[i][1] + c[i][2] + c[i][3] + p.hc_eps);
#pragma unroll
        for (int j = 0; j < 4; ++j) c[i][j] *= inv;
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // columns (over i)
      const float inv = 1.f / (c[0][j] + c[1][j] + c[2][j] + c[3][j] + p.hc_eps);
#pragma unroll
      for (int i = 0; i < 4; ++i) c[i][j] *= inv;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) p.comb[t * 16 + 4 * i + j] = c[i][j];
}

template <bool EXPAND>
__global__ void __launch_bounds__(kThreads) hc_mix_kernel(const HcMixParams p) {
  __shared__ __align__(16) float red[kWarps * kHcMaxTokens * 32];  // per warp and token; then the finish's groups
  __shared__ float tot[kHcMaxTokens * 32];
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int copy = tid / kHcCols, d = blockIdx.x * kHcCols + tid % kHcCols;
  const int64_t K = 4 * int64_t(p.D), k = int64_t(copy) * p.D + d;
  float f[kMix];
#pragma unroll
  for (int m = 0; m < kMix; ++m) f[m] = __ldg(p.fn + m * K + k);  // constants: before the wait
  pdl_wait();
  pdl_launch_dependents();

  float x[kHcMaxTokens];  // this thread's element of each token's flat H' (loads of all tokens issued together)
#pragma unroll
  for (int t = 0; t < kHcMaxTokens; ++t) {
    if (t >= p.T) break;
    const __nv_bfloat16* h = p.h + int64_t(t) * K;
    if constexpr (EXPAND) {
      const float* cb = p.comb_in + t * 16 + copy;  // comb[i, copy] at 4i + copy
      float v = p.post_in[t * 4 + copy] * __bfloat162float(p.y[int64_t(t) * p.D + d]);
#pragma unroll
      for (int i = 0; i < 4; ++i) v = fmaf(cb[4 * i], __bfloat162float(h[int64_t(i) * p.D + d]), v);
      const __nv_bfloat16 hb = __float2bfloat16_rn(v);
      p.h_out[int64_t(t) * K + k] = hb;
      x[t] = __bfloat162float(hb);
    } else {
      x[t] = __bfloat162float(h[k]);
    }
  }
#pragma unroll 1
  for (int t = 0; t < p.T; ++t) {
    float a[32];
    float xt = x[0];
#pragma unroll
    for (int u = 1; u < kHcMaxTokens; ++u) xt = t == u ? x[u] : xt;  // registers, not local memory
#pragma unroll
    for (int m = 0; m < kMix; ++m) a[m] = f[m] * xt;
    a[kMix] = xt * xt;
#pragma unroll
    for (int m = kMix + 1; m < 32; ++m) a[m] = 0.f;
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
  if (tid == 0) is_last = atomicAdd(p.counter, 1) == int(gridDim.x) - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  // The finish. Thread (group g, float4 column q) sums slices g, g + groups, … in that order; then the groups in
  // order; then one thread per token.
  const int n4 = p.T * 8, groups = kThreads / n4, slices = gridDim.x;
  float4* grp = reinterpret_cast<float4*>(red);
  if (tid < groups * n4) {
    const int q = tid % n4, g = tid / n4;
    const float4* part = reinterpret_cast<const float4*>(p.partial) + q;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int s = g;
    for (; s + 3 * groups < slices; s += 4 * groups) {
      float4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = __ldcg(part + int64_t(s + j * groups) * n4);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc = make_float4(acc.x + v[j].x, acc.y + v[j].y, acc.z + v[j].z, acc.w + v[j].w);
    }
    for (; s < slices; s += groups) {
      const float4 v = __ldcg(part + int64_t(s) * n4);
      acc = make_float4(acc.x + v.x, acc.y + v.y, acc.z + v.z, acc.w + v.w);
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
  if (tid < p.T) finish_token(p, tot + tid * 32, tid);
  if (tid == 0) *p.counter = 0;
}

}  // namespace

cudaError_t hc_mix_launch(const HcMixParams& p, cudaStream_t stream, bool pdl) {
  const dim3 grid(p.D / kHcCols), block(kThreads);
  return p.y ? launch_kernel(hc_mix_kernel<true>, grid, block, 0, stream, pdl, p)
             : launch_kernel(hc_mix_kernel<false>, grid, block, 0, stream, pdl, p);
}

}  // namespace v41
