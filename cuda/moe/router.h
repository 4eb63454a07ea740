// The MoE router of a decode step in one launch (docs/model.md §3.8): the gate GEMV (bf16 weights, float32 logits)
// and the routing (sqrt-softplus scores, top-k with exact ties to the lower expert id or the given hash ids,
// weights). Declarations shared by the kernel and the torch binding; design: router.cu; Python wrapper:
// python/v41/kernels/router.py (route_fused).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace v41 {

struct RouterParams {
  const __nv_bfloat16* x;   // [T, D] the MoE input, rows x_stride elements apart (a multiple of 8)
  int64_t x_stride;
  const __nv_bfloat16* w;   // [E, D] the gate
  const float* bias;        // [E] the selection bias (null: hash routing)
  const int64_t* hash_ids;  // [T, k] the experts of hash routing (null: top-k of the scores + bias)
  float* logits;            // [T, E] float32 scratch: the gate's output
  int64_t* ids;             // [T, k] the selected experts, in selection order
  float* weights;           // [T, k] their weights
  int* sync;                // an arrival counter: zero before and after (wraps at the last arrival)
  int T, D, E, k;           // tokens (1..kRouterMaxTokens), hidden (a multiple of 8), experts (≤ kRouterMaxExperts),
                            // top-k (1..kRouterMaxK, ≤ E)
  float temp, scaling;      // the gate temperature; the weights' scale
  int renorm;               // weights = softmax of the selected log-scores (else their exp)
};

constexpr int kRouterMaxTokens = 16;
constexpr int kRouterMaxK = 16;
constexpr int kRouterMaxExperts = 512;
constexpr int kRouterWarps = 8;  // warps per CTA (2 experts of 4 warps each: grid = ceil(E / 2))

// Launches the kernel on `stream`; pdl: as a programmatic dependent of the previous kernel (common/pdl.cuh).
cudaError_t router_launch(const RouterParams& p, cudaStream_t stream, bool pdl);

}  // namespace v41
