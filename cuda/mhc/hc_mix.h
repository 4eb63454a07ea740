// One mHC seam in one launch (docs/model.md §3.4): the sub-layer's mixes (pre, post, comb) from the residual copies,
// optionally after expanding the previous sub-layer's output into them. Declarations shared by the kernel and the
// torch binding; design: hc_mix.cu; Python wrapper: python/v41/kernels/mhc_cuda.py.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace v41 {

struct HcMixParams {
  const __nv_bfloat16* h;  // [T, 4, D] the residual copies (with y: before the expansion)
  const __nv_bfloat16* y;  // [T, D] the previous sub-layer's output (null: no expansion, h is the seam's input)
  const float* post_in;    // [T, 4] y's weight in each copy (with y)
  const float* comb_in;    // [T, 4, 4] comb[i, j]: copy i → copy j (with y)
  __nv_bfloat16* h_out;    // [T, 4, D] the expanded copies (with y)
  const float* fn;         // [24, 4·D] the mix weights, rows pre (4), post (4), comb (16)
  const float* scale;      // [3]
  const float* base;       // [24]
  float* pre;              // [T, 4]
  float* post;             // [T, 4]
  float* comb;             // [T, 4, 4]
  float* partial;          // [gridDim.x, T, 32] float32 partial sums (24 dots, the sum of squares, 7 unused)
  int* counter;            // a zeroed arrival counter; the last CTA leaves it zeroed
  int T, D, iters;         // tokens (1..kHcMaxTokens), hidden size (a multiple of kHcCols), Sinkhorn iterations
  float norm_eps, hc_eps;
};

constexpr int kHcMaxTokens = 16;
constexpr int kHcCols = 64;  // columns of each copy per CTA: grid = D / kHcCols

// Launches the kernel on `stream` (grid D / kHcCols); pdl: as a programmatic dependent of the previous kernel
// (common/pdl.cuh). Returns the launch error.
cudaError_t hc_mix_launch(const HcMixParams& p, cudaStream_t stream, bool pdl);

}  // namespace v41
