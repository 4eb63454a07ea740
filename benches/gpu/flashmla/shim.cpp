// A torch binding of FlashMLA's SM90 sparse kernels for DeepSeek V4 shapes (64 heads, K = V = 512 dims), for the
// public-kernel comparison of benches/gpu/flashmla_compare.py: the FP8 decode over V4's 584-byte records
// ("MODEL1") and the prefill over bf16 rows. Only the glue is ours: it fills FlashMLA's parameter structs
// (csrc/params.h of the staged sources, benches/gpu/flashmla/stage.sh) and launches its kernels — for decode the
// split schedule, the decode and the split combine — as its own interfaces do on SM90. Built on the device by
// benches/gpu/flashmla/flashmla_ext.py; not part of v41.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "sm90/prefill/sparse/phase1.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {

constexpr int kHeads = 64, kDim = 512, kRecordBytes = 448 + 64 * 2 + 7 + 1;
constexpr int kBlockTopk = 64, kFixedOverheadBlocks = 5;  // FlashMLA's SM90 decode schedule constants

int sm_parts(int s_q) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return std::max(sms / s_q, 1);  // 64 heads: one head block per query
}

void check_cache(const at::Tensor& kv, const at::Tensor& idx, int b, int s_q, const char* what) {
  TORCH_CHECK(kv.is_cuda() && kv.scalar_type() == at::kByte && kv.dim() == 4 && kv.size(2) == 1 &&
                  kv.size(3) == kRecordBytes && kv.stride(1) == kRecordBytes && kv.stride(3) == 1,
              what, ": a CUDA uint8 [blocks, block size, 1, 584] cache with contiguous blocks");
  TORCH_CHECK(idx.is_cuda() && idx.scalar_type() == at::kInt && idx.dim() == 3 && idx.size(0) == b &&
                  idx.size(1) == s_q && idx.stride(2) == 1,
              what, ": int32 indices [b, s_q, topk] of unit inner stride");
}

// The split schedule of a step shape: (scheduler metadata, splits per request) for sparse_decode.
std::vector<at::Tensor> plan(const at::Tensor& indices, const at::Tensor& extra_indices) {
  const int b = indices.size(0), s_q = indices.size(1), parts = sm_parts(s_q);
  auto opts = indices.options().dtype(at::kInt);
  at::Tensor meta = torch::empty({parts, int64_t(sizeof(DecodingSchedMeta) / 4)}, opts);
  at::Tensor splits = torch::empty({b + 1}, opts);
  GetDecodeSchedMetaParams p{};
  p.b = b;
  p.s_q = s_q;
  p.block_size_n = kBlockTopk;
  p.fixed_overhead_num_blocks = kFixedOverheadBlocks;
  p.topk = int(indices.size(2));
  p.extra_topk = int(extra_indices.size(2));
  p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(meta.data_ptr());
  p.num_splits_ptr = splits.data_ptr<int>();
  p.num_sm_parts = parts;
  p.stream = at::cuda::getCurrentCUDAStream().stream();
  smxx::decode::run_get_decoding_sched_meta_kernel(p);
  return {meta, splits};
}

// out [b, s_q, 64, 512] bf16 = softmax over the listed rows of kv and extra_kv (and the sink in the normaliser)
// of q · k · sm_scale, times the rows (K = V).
at::Tensor sparse_decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                         const at::Tensor& attn_sink, const at::Tensor& extra_kv, const at::Tensor& extra_indices,
                         const at::Tensor& meta, const at::Tensor& splits, double sm_scale) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 4 && q.size(2) == kHeads &&
                  q.size(3) == kDim && q.stride(3) == 1,
              "q: CUDA bf16 [b, s_q, 64, 512]");
  const int b = q.size(0), s_q = q.size(1), parts = sm_parts(s_q);
  check_cache(kv, indices, b, s_q, "kv");
  check_cache(extra_kv, extra_indices, b, s_q, "extra_kv");
  TORCH_CHECK(attn_sink.is_cuda() && attn_sink.scalar_type() == at::kFloat && attn_sink.numel() == kHeads &&
                  attn_sink.is_contiguous(),
              "attn_sink: CUDA float32 [64]");
  TORCH_CHECK(meta.size(0) == parts && splits.numel() == b + 1, "meta, splits: plan() of this step shape");
  at::cuda::CUDAGuard guard{q.device()};
  auto opts = q.options();
  at::Tensor out = torch::empty({b, s_q, kHeads, kDim}, opts);
  at::Tensor lse = torch::empty({b, s_q, kHeads}, opts.dtype(at::kFloat));
  at::Tensor lse_accum = torch::empty({b + parts, s_q, kHeads}, opts.dtype(at::kFloat));
  at::Tensor o_accum = torch::empty({b + parts, s_q, kHeads, kDim}, opts.dtype(at::kFloat));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  auto bf = [](const at::Tensor& t) { return reinterpret_cast<cutlass::bfloat16_t*>(t.data_ptr()); };
  auto i32 = [](int64_t s) { return int(s); };

  SparseAttnDecodeParams p{};
  p.b = b;
  p.s_q = s_q;
  p.h_q = kHeads;
  p.h_kv = 1;
  p.d_qk = kDim;
  p.d_v = kDim;
  p.sm_scale = float(sm_scale);
  p.sm_scale_div_log2 = float(sm_scale * 1.4426950408889634);
  p.num_blocks = kv.size(0);
  p.page_block_size = kv.size(1);
  p.topk = indices.size(2);
  p.model_type = ModelType::MODEL1;
  p.q = bf(q);
  p.kv = bf(kv);
  p.indices = indices.data_ptr<int>();
  p.topk_length = nullptr;
  p.attn_sink = attn_sink.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.out = bf(out);
  p.extra_num_blocks = extra_kv.size(0);
  p.extra_page_block_size = extra_kv.size(1);
  p.extra_topk = extra_indices.size(2);
  p.extra_kv = bf(extra_kv);
  p.extra_indices = extra_indices.data_ptr<int>();
  p.extra_topk_length = nullptr;
  p.stride_q_b = i32(q.stride(0));
  p.stride_q_s_q = i32(q.stride(1));
  p.stride_q_h_q = i32(q.stride(2));
  p.stride_kv_block = i32(kv.stride(0));
  p.stride_kv_row = i32(kv.stride(1));
  p.stride_indices_b = i32(indices.stride(0));
  p.stride_indices_s_q = i32(indices.stride(1));
  p.stride_lse_b = i32(lse.stride(0));
  p.stride_lse_s_q = i32(lse.stride(1));
  p.stride_o_b = i32(out.stride(0));
  p.stride_o_s_q = i32(out.stride(1));
  p.stride_o_h_q = i32(out.stride(2));
  p.stride_extra_kv_block = i32(extra_kv.stride(0));
  p.stride_extra_kv_row = i32(extra_kv.stride(1));
  p.stride_extra_indices_b = i32(extra_indices.stride(0));
  p.stride_extra_indices_s_q = i32(extra_indices.stride(1));
  p.stream = stream;
  p.lse_accum = lse_accum.data_ptr<float>();
  p.o_accum = o_accum.data_ptr<float>();
  p.stride_lse_accum_split = i32(lse_accum.stride(0));
  p.stride_lse_accum_s_q = i32(lse_accum.stride(1));
  p.stride_o_accum_split = i32(o_accum.stride(0));
  p.stride_o_accum_s_q = i32(o_accum.stride(1));
  p.stride_o_accum_h_q = i32(o_accum.stride(2));
  p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(meta.data_ptr());
  p.num_splits_ptr = splits.data_ptr<int>();
  p.num_sm_parts = parts;
  sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, kHeads>(p);

  CombineParams c{};
  c.b = b;
  c.s_q = s_q;
  c.h_q = kHeads;
  c.d_v = kDim;
  c.lse = p.lse;
  c.out = out.data_ptr();
  c.stride_lse_b = p.stride_lse_b;
  c.stride_lse_s_q = p.stride_lse_s_q;
  c.stride_o_b = p.stride_o_b;
  c.stride_o_s_q = p.stride_o_s_q;
  c.stride_o_h_q = p.stride_o_h_q;
  c.lse_accum = p.lse_accum;
  c.o_accum = p.o_accum;
  c.stride_lse_accum_split = p.stride_lse_accum_split;
  c.stride_lse_accum_s_q = p.stride_lse_accum_s_q;
  c.stride_o_accum_split = p.stride_o_accum_split;
  c.stride_o_accum_s_q = p.stride_o_accum_s_q;
  c.stride_o_accum_h_q = p.stride_o_accum_h_q;
  c.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr;
  c.num_splits_ptr = p.num_splits_ptr;
  c.num_sm_parts = parts;
  c.attn_sink = p.attn_sink;
  c.stream = stream;
  smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
  return out;
}

// out [s_q, 64, 512] bf16: the same attention over bf16 rows kv [s_kv, 1, 512], each query's rows listed in
// indices [s_q, 1, topk] (topk a multiple of 128; −1 = none).
at::Tensor sparse_prefill(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                          const at::Tensor& attn_sink, double sm_scale) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(1) == kHeads &&
                  q.size(2) == kDim && q.stride(2) == 1,
              "q: CUDA bf16 [s_q, 64, 512]");
  TORCH_CHECK(kv.is_cuda() && kv.scalar_type() == at::kBFloat16 && kv.dim() == 3 && kv.size(1) == 1 &&
                  kv.size(2) == kDim && kv.stride(2) == 1,
              "kv: CUDA bf16 [s_kv, 1, 512]");
  const int s_q = q.size(0);
  TORCH_CHECK(indices.is_cuda() && indices.scalar_type() == at::kInt && indices.dim() == 3 && indices.size(0) == s_q &&
                  indices.size(1) == 1 && indices.size(2) % 128 == 0 && indices.stride(2) == 1,
              "indices: int32 [s_q, 1, topk], topk a multiple of 128");
  TORCH_CHECK(attn_sink.is_cuda() && attn_sink.scalar_type() == at::kFloat && attn_sink.numel() == kHeads &&
                  attn_sink.is_contiguous(),
              "attn_sink: CUDA float32 [64]");
  at::cuda::CUDAGuard guard{q.device()};
  auto opts = q.options();
  at::Tensor out = torch::empty({s_q, kHeads, kDim}, opts);
  at::Tensor max_logits = torch::empty({s_q, kHeads}, opts.dtype(at::kFloat));
  at::Tensor lse = torch::empty({s_q, kHeads}, opts.dtype(at::kFloat));
  SparseAttnFwdParams p{};
  p.s_q = s_q;
  p.s_kv = kv.size(0);
  p.h_q = kHeads;
  p.h_kv = 1;
  p.d_qk = kDim;
  p.d_v = kDim;
  p.topk = indices.size(2);
  p.sm_scale = float(sm_scale);
  p.sm_scale_div_log2 = float(sm_scale * 1.4426950408889634);
  p.q = reinterpret_cast<cutlass::bfloat16_t*>(q.data_ptr());
  p.kv = reinterpret_cast<cutlass::bfloat16_t*>(kv.data_ptr());
  p.indices = indices.data_ptr<int>();
  p.attn_sink = attn_sink.data_ptr<float>();
  p.topk_length = nullptr;
  p.stride_q_s_q = int(q.stride(0));
  p.stride_q_h_q = int(q.stride(1));
  p.stride_kv_s_kv = int(kv.stride(0));
  p.stride_kv_h_kv = int(kv.stride(1));
  p.stride_indices_s_q = int(indices.stride(0));
  p.stride_indices_h_kv = int(indices.stride(1));
  p.out = reinterpret_cast<cutlass::bfloat16_t*>(out.data_ptr());
  p.max_logits = max_logits.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.num_sm = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  p.stream = at::cuda::getCurrentCUDAStream().stream();
  sm90::fwd::run_fwd_phase1_kernel<kDim, false>(p);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("plan", &plan, "FlashMLA's split schedule for a step shape: (metadata, splits)");
  m.def("sparse_decode", &sparse_decode, "FlashMLA's SM90 sparse FP8 decode of V4 rows (MODEL1, 64 heads)");
  m.def("sparse_prefill", &sparse_prefill, "FlashMLA's SM90 sparse prefill over bf16 rows (64 heads × 512)");
}
