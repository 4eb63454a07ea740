// The MoE router of a decode step in one launch (docs/model.md §3.8, §4 "MoE"; docs/numerics.md §4 "Router
// numerics"; the reference: python/v41/kernels/router.py route_ref over linear(x, gate) in float32):
//   l = x · gateᵀ (float32 sums of exact bf16 products), log s = ½·log(softplus(l / temp)) (½·l/temp below −20),
//   ids = top-k of s + bias, exact ties to the lower expert id (or the given hash ids),
//   weights = softmax of the selected log s (renorm) or s, times scaling.
//
// Layout of the work. Warp w of CTA c computes the logits of expert 8c + w for every token: its lanes stream the
// gate row in 16-byte pieces (each warp prefetches its row into L2 before the programmatic-dependent wait, so the
// rows load while the previous kernel ends) against the matching pieces of each token's x row (L1-resident),
// then sum over the warp and store float32 logits. The last CTA to arrive (an arrival counter that wraps back to
// zero at the last arrival) routes: a warp per token holds ceil(E / 32) experts per lane and takes k rounds of a
// warp max over the reference's selection keys (value, NaN above +inf, then the lower id). Results repeat bit for
// bit; the logits differ from the Triton linear's only in summation order.
#include <climits>

#include "../common/bf16.cuh"
#include "../common/pdl.cuh"
#include "router.h"

namespace v41 {
namespace {

constexpr int kThreads = 32 * kRouterWarps;
constexpr int kPerLane = kRouterMaxExperts / 32;

// log(sqrt(softplus(x))), accurate over the float range: softplus = max(x, 0) + log1p(e^-|x|), and ½·x below −20
// (kernels/router.py log_sqrt_softplus)
__device__ __forceinline__ float log_sqrt_softplus(float x) {
  const float z = expf(-fabsf(x));
  const float l1p = log1pf(z);
  const float sp = fmaxf(x, 0.f) + l1p;
  return 0.5f * (x < -20.f ? x : logf(sp));
}

// The value of expert `id` among the lane-strided v (expert lane + 32 j at v[j]), in every lane
__device__ __forceinline__ float lane_value(const float (&v)[kPerLane], int id, int lane) {
  float mine = 0.f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j == id) mine = v[j];
  return __shfl_sync(0xffffffffu, mine, id & 31);
}

// The selection order of kernels/topk.py order_keys_ref: a larger key is a larger score (NaN above +inf, −0 = +0),
// or an equal score at a lower expert id.
__device__ __forceinline__ long long order_key(float s, int id) {
  const int bits = __float_as_int(s + 0.f);
  const long long ordered = isnan(s) ? 0x7FFFFFFFLL : (long long)(bits < 0 ? bits ^ 0x7FFFFFFF : bits);
  return (ordered << 32) | (0xFFFFFFFFLL - id);
}

// Token t's ids and weights, by one warp.
__device__ void route_token(const RouterParams& p, int t, int lane) {
  constexpr long long kTaken = LLONG_MIN;  // below every key
  float ls[kPerLane];
  long long key[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    ls[j] = 0.f;
    key[j] = kTaken;
    if (e < p.E) {
      ls[j] = log_sqrt_softplus(__ldcg(p.logits + t * p.E + e) / p.temp);
      if (p.bias) key[j] = order_key(expf(ls[j]) + p.bias[e], e);
    }
  }
  int64_t chosen[kRouterMaxK];
  float picked[kRouterMaxK];
#pragma unroll
  for (int i = 0; i < kRouterMaxK; ++i) {
    if (i >= p.k) break;
    int id;
    if (p.hash_ids) {
      id = int(p.hash_ids[t * p.k + i]);
    } else {
      long long best = key[0];
#pragma unroll
      for (int j = 1; j < kPerLane; ++j) best = max(best, key[j]);
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
      id = int(0xFFFFFFFFLL - (best & 0xFFFFFFFFLL));  // k ≤ E: always one of the E experts
#pragma unroll
      for (int j = 0; j < kPerLane; ++j)
        if (lane + 32 * j == id) key[j] = kTaken;
    }
    chosen[i] = id;
    picked[i] = lane_value(ls, id, lane);
  }
  if (lane != 0) return;
  float m = -INFINITY, sum = 0.f;  // loops unrolled with static indices: chosen and picked stay in registers
#pragma unroll
  for (int i = 0; i < kRouterMaxK; ++i)
    if (i < p.k) m = fmaxf(m, picked[i]);
#pragma unroll
  for (int i = 0; i < kRouterMaxK; ++i)
    if (i < p.k) sum += expf(picked[i] - m);
#pragma unroll
  for (int i = 0; i < kRouterMaxK; ++i) {
    if (i >= p.k) break;
    const float w = p.renorm ? expf(picked[i] - m) / sum : expf(picked[i]);
    p.ids[t * p.k + i] = chosen[i];
    p.weights[t * p.k + i] = w * p.scaling;
  }
}

__global__ void __launch_bounds__(kThreads) router_kernel(const RouterParams p) {
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int e = blockIdx.x * kRouterWarps + warp;
  const int n16 = p.D / 8;  // 16-byte pieces of a row
  const uint4* wrow = reinterpret_cast<const uint4*>(p.w + int64_t(min(e, p.E - 1)) * p.D);
  for (int c = lane; c < n16; c += 32)  // constants: into L2 before the wait
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(wrow + c));
  pdl_wait();
  pdl_launch_dependents();

  float acc[kRouterMaxTokens];
#pragma unroll
  for (int t = 0; t < kRouterMaxTokens; ++t) acc[t] = 0.f;
  if (e < p.E) {
#pragma unroll 4
    for (int c = lane; c < n16; c += 32) {
      const uint4 wraw = __ldg(wrow + c);
      const Bf4 w0(make_uint2(wraw.x, wraw.y)), w1(make_uint2(wraw.z, wraw.w));
#pragma unroll
      for (int t = 0; t < kRouterMaxTokens; ++t) {
        if (t >= p.T) break;
        const uint4 xraw = *reinterpret_cast<const uint4*>(p.x + t * p.x_stride + 8 * int64_t(c));
        const Bf4 x0(make_uint2(xraw.x, xraw.y)), x1(make_uint2(xraw.z, xraw.w));
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t] = fmaf(w0.v[i], x0.v[i], acc[t]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t] = fmaf(w1.v[i], x1.v[i], acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kRouterMaxTokens; ++t) {
    if (t >= p.T) break;
    float v = acc[t];
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0 && e < p.E) p.logits[t * p.E + e] = v;
  }
  __threadfence();
  __syncthreads();
  // the last arrival also wraps the counter to zero for the next launch
  if (tid == 0) is_last = atomicInc(reinterpret_cast<unsigned*>(p.sync), gridDim.x - 1) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int t = warp; t < p.T; t += kRouterWarps) route_token(p, t, lane);
}

}  // namespace

cudaError_t router_launch(const RouterParams& p, cudaStream_t stream, bool pdl) {
  const dim3 grid((p.E + kRouterWarps - 1) / kRouterWarps), block(kThreads);
  return launch_kernel(router_kernel, grid, block, 0, stream, pdl, p);
}

}  // namespace v41
