// Sparse MQA decode / prefill with a per-head sink over gathered cache rows, reading bf16 rows or the deployed
// FP8 / FP4 records: declarations shared by the kernel (sparse_mqa.cu) and the torch binding. Python wrapper and
// reference: python/v41/kernels/sparse_mqa.py, python/v41/kernels/sparse_attention.py.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace v41 {

// Row formats: the FMT ids of python/v41/kernels/records.py (3, the index-key record, is not attention's).
enum class KvFmt : int { kPlain = 0, kSwaFp8 = 1, kCkvFp4 = 2, kSwaV4 = 4 };

struct MqaSource {
  const uint8_t* cache;   // row r (bf16 values or one record) at cache + r * row_bytes
  int64_t row_bytes;
  int64_t copy_bytes;     // bytes of a row the kernel stages (2·D for bf16 rows, the record size)
  const int64_t* slots;   // [T, n] cache row of each listed key of each query, -1 = none; row stride slot_stride
  int64_t slot_stride;
  int n;                  // keys listed per query
  int fmt;                // KvFmt
  int rope;               // kSwaV4: trailing bf16 RoPE dims
};

struct MqaParams {
  const __nv_bfloat16* q;  // [T, H, D]
  int64_t q_stride_t, q_stride_h;
  const void* sink;        // [H] bf16 (sink_f32 == 0) or float32
  int sink_f32;
  MqaSource src[2];
  int n_src;
  __nv_bfloat16* out;      // [T, H, D]
  int64_t o_stride_t, o_stride_h;
  float* part_acc;         // [splits, T, H, D] unnormalised partial outputs when splits > 1
  float* part_ml;          // [splits, T, H, 2] (running max, sum of exponentials) when splits > 1
  int T, H;
  float scale;
  int tiles_per_split, splits;
  int raw_stride;          // bytes per staged record row in shared memory (0: no source holds records)
  int stages;              // key tiles in flight (2..4; set by sparse_mqa_launch)
  int kbuf_stages;         // bf16 tile buffers: `stages` when a source holds bf16 rows, else 1 (the decode target)
};

constexpr int kMqaKeysPerTile = 32;
constexpr int kMqaHeadsPerCta = 64;
constexpr int kMqaMaxTilesPerCta = 80;  // the CTA's slots are staged in shared memory (int32, 10 KB at most)

// Launches the split kernel on grid (T, splits, ceil(H / 64)) and, when splits > 1, the combine kernel; D is the
// head dim (64, 128, 256 or 512), tiles_per_split at most kMqaMaxTilesPerCta. Picks the deepest pipeline (up to
// 4 tiles in flight) that fits the device's shared memory per block; cudaErrorInvalidConfiguration when even 2
// do not. pdl: programmatic dependent launches (common/pdl.cuh). Returns the first launch error.
cudaError_t sparse_mqa_launch(MqaParams p, int D, cudaStream_t stream, bool pdl);

}  // namespace v41
