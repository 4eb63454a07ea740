// Lightning-indexer scores over the paged index-key cache (docs/model.md §3.7 steps 2–4): declarations shared by
// the kernel (index_scores.cu) and the torch binding. Python wrapper and reference: python/v41/kernels/indexer.py
// (index_scores, index_scores_ref); design: docs/kernels.md "Indexer".
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace v41 {

constexpr int kIdxDim = 128;          // index head dim the kernel takes (V4 and V4.1)
constexpr int kIdxMaxHeads = 64;      // heads: a multiple of 16 up to this
constexpr int kIdxMaxQueries = 16;    // queries per CTA (a bit mask of the CTA's queries)
constexpr int kIdxEntriesPerWarp = 32;  // entries a warp decodes per pass: 4 n-tiles of 8
constexpr int kIdxWarps = 4;

struct IdxScoreParams {
  const __nv_bfloat16* q;  // [T, H, 128], strides q_stride_t, q_stride_h, unit inner stride
  int64_t q_stride_t, q_stride_h;
  const float* w;          // [T, H] head weights (already scaled), row stride w_stride_t
  int64_t w_stride_t;
  const uint8_t* keys;     // fmt 0: bf16 rows [S, 128]; fmt 1: idx_mxfp4 records [S, 68]; row stride k_stride bytes
  int64_t k_stride;
  const int64_t* block_table;  // [R, NB] physical block of each logical block (-1 = none), row stride bt_stride
  int64_t bt_stride;
  const int64_t* req_index;    // [T] request row of each query
  const int64_t* n_visible;    // [T] entries j < n_visible[t] are scored; the rest are -inf
  float* out;              // [T, N] float32, row stride out_stride
  int64_t out_stride;
  int T, H, N, NB, rows_per_block;
  int fmt;                 // 0: bf16 rows, 1: idx_mxfp4 records
  int queries_per_cta;     // 1..kIdxMaxQueries
  int entries_per_cta;     // a multiple of kIdxWarps * kIdxEntriesPerWarp
};

// Dynamic shared memory of a launch: the CTA's queries as MMA A fragments plus their head weights.
inline size_t index_scores_smem(int heads, int queries) {
  return size_t(queries) * (heads / 16) * 8 * 32 * 16 + size_t(queries) * heads * 4;
}

// Launches grid (ceil(N / entries_per_cta), ceil(T / queries_per_cta)) CTAs of kIdxWarps warps on `stream`;
// returns the launch error (cudaErrorInvalidValue for a shared-memory size past this GPU's opt-in limit). pdl: a
// programmatic dependent launch (common/pdl.cuh).
cudaError_t index_scores_launch(const IdxScoreParams& p, cudaStream_t stream, bool pdl);

}  // namespace v41
