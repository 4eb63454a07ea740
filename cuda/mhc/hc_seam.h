// One mHC seam in one launch (docs/model.md §3.4, §3.2): optionally the expansion of the previous sub-layer's output
// into the residual copies, the next sub-layer's mixes (pre, post, comb) from them, and optionally the collapse of
// the copies into that sub-layer's RMS-normed input. Declarations shared by the kernel and the torch binding;
// design: hc_seam.cu; Python wrapper: python/v41/kernels/mhc_cuda.py.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace v41 {

// What the seam collapses the copies with into the sub-layer's input x = rms_norm(Σ_i w[i]·H'[i]) · norm_w.
enum class HcCollapse : int {
  kNone = 0,     // no collapse: the mixes alone
  kGiven = 1,    // w = pre_c, known before the seam (V4.1's delayed pre-mix)
  kFresh = 2,    // w = the pre this seam computes (V4)
};

struct HcSeamParams {
  const __nv_bfloat16* h;       // [T, 4, D] the residual copies (with y: before the expansion)
  const __nv_bfloat16* y;       // [T, D] the previous sub-layer's output (null: no expansion)
  const float* post_in;         // [T, 4] y's weight in each copy (with y)
  const float* comb_in;         // [T, 4, 4] comb[i, j]: copy i → copy j (with y)
  __nv_bfloat16* h_out;         // [T, 4, D] the expanded copies (with y)
  const float* fn;              // [24, 4·D] the mix weights: rows pre (4), post (4), comb (16)
  const float* scale;           // [3]
  const float* base;            // [24]
  float* pre;                   // [T, 4]
  float* post;                  // [T, 4]
  float* comb;                  // [T, 4, 4]
  const float* pre_c;           // [T, 4] the collapse's weights (kGiven)
  const __nv_bfloat16* norm_w;  // [D] the sub-layer's RMSNorm weight (a collapse)
  __nv_bfloat16* x;             // [T, D] the sub-layer's normed input (a collapse)
  float* partial;               // [gridDim.x, T, 32] float32 partial sums per CTA, then [kHcMaxTokens] RMS scales
  int* sync;                    // [2]: an arrival counter (wraps to zero at the last arrival); a generation word
  int T, D, iters;              // tokens (1..kHcMaxTokens), hidden size (a multiple of kHcCols), Sinkhorn iterations
  float norm_eps, hc_eps, x_eps;  // the mixes' RMS eps, mHC's eps, the sub-layer RMSNorm's eps
};

constexpr int kHcMaxTokens = 16;
constexpr int kHcCols = 64;  // columns of each copy per CTA: grid = D / kHcCols
constexpr int kHcFreshMaxD = 8192;  // the largest D collapsed with the seam's own pre (kFresh)

// Launches the kernel on `stream` (grid D / kHcCols); pdl: as a programmatic dependent of the previous kernel
// (common/pdl.cuh). Returns the launch error.
cudaError_t hc_seam_launch(const HcSeamParams& p, HcCollapse collapse, cudaStream_t stream, bool pdl);

// CTAs of the given-weights kernel that can be resident at once on `device` (0 when unknown): its CTAs wait for
// each other, so it needs D / kHcCols of them at once.
int hc_seam_max_ctas(int device);

}  // namespace v41
