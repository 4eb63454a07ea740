// The MoE router of a decode step in one launch (docs/model.md §3.8, §4 "MoE"; docs/numerics.md §4 "Router
// numerics"; the reference: python/v41/kernels/router.py route_ref over linear(x, gate) in float32):
//   l = x · gateᵀ (float32 sums of exact bf16 products), log s = ½·log(softplus(l / temp)) (½·l/temp below
//   −20),
//   ids = top-k of s + bias, exact ties to the lower expert id (or the given hash ids),
//   weights = softmax of the selected log s (renorm) or s, times scaling.
//
// Layout of the work. Each expert row is split into kSplit quarters of D, one warp each; a CTA of 8 warps owns 2
// experts, so V4.1's 384 experts make 192 CTAs. A warp streams its quarter in passes of kPieces 16-byte pieces per
// lane whose loads are all issued before the first is used (indices clamped into range, no branch ahead of a load:
// a load behind a branch waits for the one before it), then the matching pieces of each token's x row; the token
// count is a template bucket (1, 2, 4, 8, 16; tokens past T repeat the last row and are not stored), so every
// token's loads are unrolled too. Each warp prefetches its quarter into L2 before the programmatic-dependent wait,
// so the rows load while the previous kernel ends. The quarters' sums meet in shared memory and add in quarter
// order into the float32 logits. The last CTA to arrive (an arrival counter that wraps back to zero at the last
// arrival) routes: a warp per token holds expert lane + 32 j at j < 16 and takes k rounds of two warp reductions
// (redux.sync) over the reference's selection order: the best key (value, NaN above +inf), then the lowest expert
// id holding it. Results repeat bit for bit; the logits differ from the Triton linear's only in summation order.
#include <climits>

#include "../common/bf16.cuh"
#include "../common/pdl.cuh"
#include "router.h"

namespace v41 {
namespace {

constexpr int kThreads = 32 * kRouterWarps;
constexpr int kSplit = 4;                              // warps per expert row
constexpr int kExpertsPerCta = kRouterWarps / kSplit;  // 2
constexpr int kPieces = 5;  // 16-byte pieces per lane per pass: V4.1's D = 5120 in one pass, V4's 4,096 too
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

// The selection order of kernels/topk.py order_keys_ref as an int32: a larger key is a larger score (NaN above
// +inf, −0 = +0); equal keys go to the lower expert id (the round's second reduction). Every key is above INT_MIN.
__device__ __forceinline__ int order_key(float s) {
  const int bits = __float_as_int(s + 0.f);
  return isnan(s) ? INT_MAX : (bits < 0 ? bits ^ 0x7FFFFFFF : bits);
}

// Token t's ids and weights, by one warp. The logits and the bias are loaded at clamped indices, all before any
// is used (the bias and the hash ids behind one branch each).
__device__ void route_token(const RouterParams& p, int t, int lane) {
  constexpr int kTaken = INT_MIN;  // below every key
  float ls[kPerLane], bias[kPerLane];
  int key[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) ls[j] = __ldcg(p.logits + t * p.E + min(lane + 32 * j, p.E - 1));
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) bias[j] = 0.f;
  if (p.bias) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) bias[j] = __ldg(p.bias + min(lane + 32 * j, p.E - 1));
  }
  const int hash_id = p.hash_ids && lane < p.k ? int(p.hash_ids[t * p.k + lane]) : 0;  // lane i: the i-th id
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    const bool in = e < p.E;
    ls[j] = in ? log_sqrt_softplus(ls[j] / p.temp) : 0.f;
    key[j] = in && p.bias ? order_key(expf(ls[j]) + bias[j]) : kTaken;
  }
  int chosen[kRouterMaxK];
  float picked[kRouterMaxK];
#pragma unroll
  for (int i = 0; i < kRouterMaxK; ++i) {
    if (i >= p.k) break;
    int id;
    if (p.hash_ids) {
      id = __shfl_sync(0xffffffffu, hash_id, i);
    } else {
      // two warp reductions (redux.sync): the best key, then the lowest expert id holding it (k ≤ E: one exists)
      int best = key[0];
#pragma unroll
      for (int j = 1; j < kPerLane; ++j) best = max(best, key[j]);
      best = __reduce_max_sync(0xffffffffu, best);
      int mine = INT_MAX;
#pragma unroll
      for (int j = kPerLane - 1; j >= 0; --j)
        if (key[j] == best) mine = lane + 32 * j;
      id = __reduce_min_sync(0xffffffffu, mine);
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

// acc[t] += this lane's pieces [c0 + 32 u] of the weight row · token t's x row, for a pass of kPieces pieces.
template <int NT>
__device__ __forceinline__ void gemv_pass(const RouterParams& p, const uint4* wrow, int c0, int hi,
                                          float (&acc)[NT]) {
  uint4 wv[kPieces];
#pragma unroll
  for (int u = 0; u < kPieces; ++u) wv[u] = __ldg(wrow + min(c0 + 32 * u, hi - 1));
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const uint4* xr = reinterpret_cast<const uint4*>(p.x + int64_t(min(t, p.T - 1)) * p.x_stride);
    uint4 xv[kPieces];
#pragma unroll
    for (int u = 0; u < kPieces; ++u) xv[u] = xr[min(c0 + 32 * u, hi - 1)];
#pragma unroll
    for (int u = 0; u < kPieces; ++u) {
      if (c0 + 32 * u >= hi) continue;  // a clamped repeat: loaded, not added
      const Bf4 w0(make_uint2(wv[u].x, wv[u].y)), w1(make_uint2(wv[u].z, wv[u].w));
      const Bf4 x0(make_uint2(xv[u].x, xv[u].y)), x1(make_uint2(xv[u].z, xv[u].w));
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t] = fmaf(w0.v[i], x0.v[i], acc[t]);
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t] = fmaf(w1.v[i], x1.v[i], acc[t]);
    }
  }
}

// NT: the token bucket (T ≤ NT).
template <int NT>
__global__ void __launch_bounds__(kThreads, 2) router_kernel(const RouterParams p) {
  __shared__ float part[kRouterWarps][NT];
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int e = blockIdx.x * kExpertsPerCta + warp / kSplit;
  const int n16 = p.D / 8;  // 16-byte pieces of a row
  const int per = (n16 + kSplit - 1) / kSplit;
  const int lo = (warp % kSplit) * per, hi = min(n16, lo + per);  // this warp's quarter (empty when lo ≥ hi)
  const uint4* wrow = reinterpret_cast<const uint4*>(p.w + int64_t(min(e, p.E - 1)) * p.D);
  for (int c = lo + lane; c < hi; c += 32)  // constants: into L2 before the wait
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(wrow + c));
  pdl_wait();
  pdl_launch_dependents();

  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  for (int c0 = lo + lane; c0 < hi; c0 += 32 * kPieces) gemv_pass<NT>(p, wrow, c0, hi, acc);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float v = acc[t];
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[warp][t] = v;
  }
  __syncthreads();
  if (tid < kExpertsPerCta * NT) {  // thread (slot, t) adds its expert's quarters in order
    const int slot = tid / NT, t = tid % NT, es = blockIdx.x * kExpertsPerCta + slot;
    float v = 0.f;
#pragma unroll
    for (int q = 0; q < kSplit; ++q) v += part[slot * kSplit + q][t];
    if (t < p.T && es < p.E) p.logits[t * p.E + es] = v;
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

template <int NT>
cudaError_t launch_bucket(const RouterParams& p, cudaStream_t stream, bool pdl) {
  const dim3 grid((p.E + kExpertsPerCta - 1) / kExpertsPerCta), block(kThreads);
  return launch_kernel(router_kernel<NT>, grid, block, 0, stream, pdl, p);
}

}  // namespace

cudaError_t router_launch(const RouterParams& p, cudaStream_t stream, bool pdl) {
  static_assert(kRouterMaxTokens == 16, "the token buckets below end at 16");
  if (p.T < 1 || p.T > kRouterMaxTokens || p.E < 1 || p.E > kRouterMaxExperts || p.k < 1 || p.k > kRouterMaxK ||
      p.k > p.E)
    return cudaErrorInvalidValue;
  if (p.T <= 1) return launch_bucket<1>(p, stream, pdl);
  if (p.T <= 2) return launch_bucket<2>(p, stream, pdl);
  if (p.T <= 4) return launch_bucket<4>(p, stream, pdl);
  if (p.T <= 8) return launch_bucket<8>(p, stream, pdl);
  return launch_bucket<16>(p, stream, pdl);
}

}  // namespace v41
