// Exact top-k selection over float32 score rows (the indexer's §3.7 step 7): declarations shared by the kernels
// (select_topk.cu) and the torch binding. Python wrapper and reference: python/v41/kernels/topk.py
// (select_topk, select_topk_ref); design: docs/kernels.md "Indexer top-k".
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace v41 {

constexpr int kTopkMaxK = 2048;      // largest k the kernels select (ids staged in shared memory)
constexpr int kTopkCap = 2048;       // entries of the last 22-bit key band sorted in shared memory; more → exact
                                     // fallback passes over the row by one CTA
constexpr int kTopkChunk = 4096;     // entries per CTA of the multi-CTA passes
constexpr int kTopkSingleMaxN = 16384;  // rows up to this length: one CTA per row, one launch
constexpr int64_t kTopkMaxN = int64_t(65535) * kTopkChunk;  // grid.y of the passes; ids staged as 2·id + flag
constexpr int kTopkWorkInts = 5136;  // per-row work area of the multi-CTA passes (zeroed by the caller)
constexpr int kTopkOrderedMaxN = 0;  // default TopkParams::ordered_max_n (python/v41/kernels/topk.py ORDERED_MAX_N)

struct TopkParams {
  const float* scores;     // [T, N], row stride `stride`, unit inner stride
  int64_t stride;
  const int64_t* n_valid;  // [T] entries j >= n_valid[t] count as -inf; nullptr = N
  int64_t* out;            // [T, k] contiguous: ids ascending, -1 where the pick is not eligible
  int* work;               // [T, kTopkWorkInts] zeros (multi-CTA path only)
  unsigned long long* cand;  // [T, kTopkCap] (multi-CTA path only)
  int T, N, k;
  int ordered_max_n;       // one-CTA rows up to this length write their picks by an ordered pass, not a sort
};

// Whether rows of length N at T rows take the one-launch path (one CTA per row).
inline bool select_topk_single(int T, int N, int sms) { return N <= kTopkSingleMaxN || T >= sms; }

// Launches the kernels on `stream`: one CTA per row when select_topk_single, else three passes over
// (T, ceil(N / kTopkChunk)) CTAs (a 12-bit then a 10-bit key histogram, then the collect; the last CTA of a row
// finishes it). No host synchronisation. pdl: programmatic dependent launches (common/pdl.cuh).
cudaError_t select_topk_launch(const TopkParams& p, int sms, cudaStream_t stream, bool pdl);

}  // namespace v41
