// Weight-streaming W4A16 / W8A16 GEMM for few rows per weight (decode): declarations shared by the kernel and the
// torch binding. Design and layouts: wstream.cu; Python wrapper: python/v41/kernels/wstream.py.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace v41 {

enum class WFmt : int { kMxfp4 = 0, kFp8 = 1 };

struct WStreamParams {
  const __nv_bfloat16* x;  // activations, rows of x_stride elements
  int64_t x_stride;
  const int64_t* rows;     // [P] x row of each output row (null: output row p reads x row p)
  const uint8_t* w;        // weight codes; byte strides per expert and per output row
  int64_t w_stride_e, w_stride_n;
  const uint8_t* s;        // E8M0 scale bytes; strides per expert and per scale row
  int64_t s_stride_e, s_stride_n;
  const int64_t* offsets;  // [E + 1] rows of expert e = [offsets[e], offsets[e+1]) (null: one expert, [0, P))
  const int64_t* active;   // [grid.x] expert of each CTA column, -1 = none (null: expert = blockIdx.x)
  __nv_bfloat16* y;        // [P, N] output, row stride y_stride
  int64_t y_stride;
  float* partial;          // [split, P, N] float32 partial sums when split > 1 (else null)
  int* counters;           // [grid.x * grid.y] zeroed arrival counters when split > 1; left zeroed
  int P, N, K, NG;         // NG: output rows per input group (grouped wo_a), N when ungrouped
  int B0, sk_log2;         // scale block: rows, log2 of its inputs (mxfp4: 1, 5)
  int chunks_per_split;    // K chunks (128 inputs mxfp4, 64 fp8) per grid.z slice
  int x_prefetch;          // load the activation pieces with the weights' (more registers)
};

constexpr int kWStreamWarps = 4;
constexpr int kWStreamRowsPerCta = 16 * kWStreamWarps;

// Launches the kernel on `stream`; grid (experts or active slots, ceil(N / 64), split). five_ctas (without
// x_prefetch): registers capped at 96 per thread so 5 CTAs fit per SM instead of 4. double_buffer (0 or 2; without
// x_prefetch): two batches of 2 chunks, the next loading while the current one is converted (registers capped for
// 4 CTAs per SM; five_ctas is then ignored). pdl: launched as a programmatic dependent of the previous kernel on the
// stream (common/pdl.cuh). Returns the launch error.
cudaError_t wstream_launch(const WStreamParams& p, WFmt fmt, bool five_ctas, int double_buffer, dim3 grid,
                           cudaStream_t stream, bool pdl);

}  // namespace v41
