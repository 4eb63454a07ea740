// Python bindings of v41._cuda (built by cuda/build.py). Each function checks what the kernel assumes and launches
// on the current CUDA stream, so it can be captured in a CUDA graph; the Python wrappers in python/v41/kernels/ pick
// the launch shapes. Errors are RuntimeError (TORCH_CHECK with literal messages). The small kernels between a step's
// GEMMs (mHC seam, router) are bound in bindings_glue.cpp; the shared checks are in binding_util.h.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>


#include "attention/sparse_mqa.h"
#include "binding_util.h"
#include "indexer/index_scores.h"
#include "indexer/select_topk.h"
#include "linear/wstream.h"

#ifndef V41_ARCHS
#error "cuda/build.py defines V41_ARCHS (the compiled architectures, e.g. sm_90a,sm_100a)"
#endif
#define V41_STR2(...) #__VA_ARGS__
#define V41_STR(...) V41_STR2(__VA_ARGS__)

namespace {

using namespace v41_bind;

// y[p] = x[rows[p]] · W[e]ᵀ for the rows p of expert e (module docstring of python/v41/kernels/wstream.py).
void wstream(const at::Tensor& x, const c10::optional<at::Tensor>& rows, const at::Tensor& w, const at::Tensor& s,
             const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& active, at::Tensor& y,
             const c10::optional<at::Tensor>& partial, const c10::optional<at::Tensor>& counters, int64_t fmt,
             int64_t n_groups, int64_t b0, int64_t sk, int64_t slots, int64_t split,
             int64_t chunks_per_split, bool x_prefetch, bool five_ctas, int64_t double_buffer, bool pdl) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a 2-D bfloat16 CUDA tensor with unit inner stride");
  TORCH_CHECK(double_buffer == 0 || (double_buffer == 2 && !x_prefetch),
              "double_buffer must be 0, or 2 without x_prefetch");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.dim() == 2 && y.stride(1) == 1 && y.device() == x.device(),
              "y must be a 2-D bfloat16 tensor with unit inner stride on x's device");
  TORCH_CHECK(w.device() == x.device() && s.device() == x.device() && s.scalar_type() == at::kByte,
              "w and s (uint8 scales) must be on x's device");
  TORCH_CHECK(w.element_size() == 1 && (w.dim() == 2 || w.dim() == 3) && w.stride(-1) == 1 && s.dim() == w.dim(),
              "w must be a 2-D or 3-D tensor of 1-byte codes with unit inner stride, s of the same rank");
  TORCH_CHECK(fmt == 0 || fmt == 1, "fmt must be 0 (mxfp4) or 1 (fp8)");
  TORCH_CHECK(s.stride(-1) == 1 && (w.dim() == 2 || w.stride(0) % 16 == 0),
              "s needs unit inner stride; 3-D w a 16-byte multiple expert stride");
  TORCH_CHECK(b0 >= 1 && (fmt == 0 ? sk == 32 && b0 == 1 : sk >= 16 && (sk & (sk - 1)) == 0),
              "scale blocks: mxfp4 (1, 32); fp8 inputs per scale a power of two, at least 16");
  check_index(rows, x, "rows must be a contiguous int64 tensor on x's device");
  check_index(offsets, x, "offsets must be a contiguous int64 tensor on x's device");
  check_index(active, x, "active must be a contiguous int64 tensor on x's device");
  const int64_t n = w.size(-2), k = w.size(-1) * (fmt == 0 ? 2 : 1), p = y.size(0);
  TORCH_CHECK(s.size(-2) >= (n + b0 - 1) / b0 && s.size(-1) >= (k + sk - 1) / sk &&
                  (w.dim() == 2 || s.size(0) == w.size(0)),
              "s must hold a scale byte for every (row block, input block) of w");
  TORCH_CHECK(rows.has_value() || x.size(0) >= p, "without rows, x needs a row per output row");
  TORCH_CHECK(!active.has_value() || active->numel() >= slots, "active needs an entry per slot");
  const int64_t ck = fmt == 0 ? 128 : 64;
  TORCH_CHECK(y.size(1) == n && k % ck == 0 && n_groups > 0 && n_groups % 16 == 0 && n % n_groups == 0,
              "shapes: y [P, N], K a multiple of 128 (mxfp4) or 64 (fp8), groups of whole 16-row tiles");
  TORCH_CHECK(x.size(1) >= (n / n_groups) * k, "x has fewer columns than the groups read");
  TORCH_CHECK(aligned16(x.data_ptr()) && x.stride(0) % 8 == 0 && aligned16(w.data_ptr()) && w.stride(-2) % 16 == 0,
              "x and w must be 16-byte aligned with 16-byte aligned rows");
  TORCH_CHECK(split >= 1 && chunks_per_split >= 1 && split * chunks_per_split >= k / ck &&
                  (split - 1) * chunks_per_split < k / ck,
              "split x chunks_per_split must cover K, every slice with at least one chunk");
  TORCH_CHECK(offsets.has_value() || slots == 1, "one expert without offsets");
  const int64_t tiles_n = (n + v41::kWStreamRowsPerCta - 1) / v41::kWStreamRowsPerCta;
  if (split > 1) {
    TORCH_CHECK(partial.has_value() && partial->scalar_type() == at::kFloat && partial->is_contiguous() &&
                    partial->numel() >= split * p * n,
                "split > 1 needs a contiguous float32 partial buffer of split x P x N");
    TORCH_CHECK(counters.has_value() && counters->scalar_type() == at::kInt && counters->numel() >= slots * tiles_n,
                "split > 1 needs int32 counters for every tile");
    TORCH_CHECK(partial->device() == x.device() && counters->device() == x.device() && counters->is_contiguous(),
                "partial and counters must be on x's device");
  }
  if (p == 0 || slots == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  v41::WStreamParams prm{};
  prm.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  prm.x_stride = x.stride(0);
  prm.rows = opt_ptr<int64_t>(rows);
  prm.w = reinterpret_cast<const uint8_t*>(w.data_ptr());
  prm.w_stride_e = w.dim() == 3 ? w.stride(0) : 0;
  prm.w_stride_n = w.stride(-2);
  prm.s = s.data_ptr<uint8_t>();
  prm.s_stride_e = s.dim() == 3 ? s.stride(0) : 0;
  prm.s_stride_n = s.stride(-2);
  prm.offsets = opt_ptr<int64_t>(offsets);
  prm.active = opt_ptr<int64_t>(active);
  prm.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  prm.y_stride = y.stride(0);
  prm.partial = split > 1 ? partial->data_ptr<float>() : nullptr;
  prm.counters = split > 1 ? counters->data_ptr<int>() : nullptr;
  prm.P = int(p);
  prm.N = int(n);
  prm.K = int(k);
  prm.NG = int(n_groups);
  prm.B0 = int(b0);
  prm.sk_log2 = 0;
  while ((int64_t(1) << prm.sk_log2) < sk) ++prm.sk_log2;
  prm.chunks_per_split = int(chunks_per_split);
  prm.x_prefetch = x_prefetch;
  const dim3 grid{static_cast<unsigned>(slots), static_cast<unsigned>(tiles_n), static_cast<unsigned>(split)};
  const cudaError_t err = v41::wstream_launch(prm, fmt == 0 ? v41::WFmt::kMxfp4 : v41::WFmt::kFp8, five_ctas,
                                              int(double_buffer), grid, at::cuda::getCurrentCUDAStream(), pdl);
  TORCH_CHECK(launch_ok(err, "wstream launch failed"), "wstream launch failed (the CUDA error is on stderr)");
}

// Bytes per record of `fmt` for rows of `d` dims (python/v41/cache/records.py RecordFormat.nbytes), 0 for plain.
int64_t record_bytes(int64_t fmt, int64_t d, int64_t rope) {
  switch (fmt) {
    case 1: return d + d / 32;
    case 2: return d / 2 + d / 16;
    case 4: return (d - rope) + 2 * rope + ((d - rope + 63) / 64 + 7) / 8 * 8;
    default: return 0;
  }
}

v41::MqaSource mqa_source(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& slots, int64_t fmt,
                          int64_t rope) {
  const int64_t d = q.size(2);
  TORCH_CHECK(fmt == 0 || fmt == 1 || fmt == 2 || fmt == 4, "fmt must be 0 (bf16 rows), 1, 2 or 4 (records)");
  TORCH_CHECK(cache.device() == q.device() && cache.dim() == 2 && cache.stride(1) == 1,
              "cache must be a 2-D tensor with unit inner stride on q's device");
  TORCH_CHECK(slots.device() == q.device() && slots.scalar_type() == at::kLong && slots.dim() == 2 &&
                  slots.stride(1) == 1 && slots.size(0) == q.size(0),
              "slots must be int64 [T, n] with unit inner stride on q's device");
  const int64_t row_bytes = cache.stride(0) * cache.element_size();
  if (fmt == 0) {
    TORCH_CHECK(cache.scalar_type() == at::kBFloat16 && cache.size(1) == d, "bf16 rows of q's head dim");
    TORCH_CHECK(row_bytes % 16 == 0, "bf16 rows must start 16-byte aligned");
  } else {
    TORCH_CHECK(cache.scalar_type() == at::kByte && cache.size(1) == record_bytes(fmt, d, rope),
                "records must be uint8 [S, nbytes] of the format's size for q's head dim");
    TORCH_CHECK(fmt != 4 || (rope > 0 && rope < d && (d - rope) % 8 == 0), "swa_v4: coded dims a multiple of 8");
  }
  TORCH_CHECK(aligned16(cache.data_ptr()), "cache must be 16-byte aligned");
  TORCH_CHECK(cache.size(0) < (int64_t(1) << 31), "at most 2^31 - 1 cache rows (slots are staged as int32)");
  v41::MqaSource s{};
  s.cache = reinterpret_cast<const uint8_t*>(cache.data_ptr());
  s.row_bytes = row_bytes;
  s.copy_bytes = fmt == 0 ? 2 * d : cache.size(1);
  s.slots = slots.data_ptr<int64_t>();
  s.slot_stride = slots.stride(0);
  s.n = int(slots.size(1));
  s.fmt = int(fmt);
  s.rope = fmt == 4 ? int(rope) : 0;
  return s;
}

// out[t, h] = sparse MQA with sink over the keys listed by up to two sources (python/v41/kernels/sparse_mqa.py).
void sparse_mqa(const at::Tensor& q, at::Tensor& out, const at::Tensor& sink, const at::Tensor& cache0,
                const at::Tensor& slots0, int64_t fmt0, int64_t rope0, const c10::optional<at::Tensor>& cache1,
                const c10::optional<at::Tensor>& slots1, int64_t fmt1, int64_t rope1, double scale, int64_t splits,
                int64_t tiles_per_split, const c10::optional<at::Tensor>& part_acc,
                const c10::optional<at::Tensor>& part_ml, bool pdl) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.stride(2) == 1,
              "q must be a bfloat16 CUDA tensor [T, H, D] with unit inner stride");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128 || d == 256 || d == 512, "head dim must be 64, 128, 256 or 512");
  TORCH_CHECK(aligned16(q.data_ptr()) && q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0, "q must be 16-byte aligned");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == q.sizes() && out.stride(2) == 1 &&
                  out.device() == q.device() && out.stride(1) % 2 == 0 && out.stride(0) % 2 == 0 &&
                  aligned16(out.data_ptr()),
              "out must be bfloat16 like q, 4-byte aligned pairs");
  TORCH_CHECK(sink.device() == q.device() && sink.is_contiguous() && sink.numel() == h &&
                  (sink.scalar_type() == at::kBFloat16 || sink.scalar_type() == at::kFloat),
              "sink must be a contiguous bf16 or float32 [H] tensor on q's device");
  TORCH_CHECK(cache1.has_value() == slots1.has_value(), "the second source needs a cache and slots");
  TORCH_CHECK(splits >= 1 && tiles_per_split >= 0, "splits >= 1");
  v41::MqaParams p{};
  p.src[0] = mqa_source(q, cache0, slots0, fmt0, rope0);
  p.n_src = 1;
  if (cache1.has_value()) {
    p.src[1] = mqa_source(q, *cache1, *slots1, fmt1, rope1);
    p.n_src = 2;
  }
  const int64_t tiles = (p.src[0].n + v41::kMqaKeysPerTile - 1) / v41::kMqaKeysPerTile +
                        (p.n_src > 1 ? (p.src[1].n + v41::kMqaKeysPerTile - 1) / v41::kMqaKeysPerTile : 0);
  TORCH_CHECK(splits * tiles_per_split >= tiles, "splits x tiles_per_split must cover the key tiles");
  static_assert(v41::kMqaMaxTilesPerCta == 80, "the message below");
  TORCH_CHECK(tiles_per_split <= v41::kMqaMaxTilesPerCta, "at most 80 tiles per split");
  if (splits > 1) {
    TORCH_CHECK(part_acc.has_value() && part_acc->scalar_type() == at::kFloat && part_acc->is_contiguous() &&
                    part_acc->numel() >= splits * t * h * d && part_acc->device() == q.device(),
                "splits > 1 needs a contiguous float32 part_acc of splits x T x H x D");
    TORCH_CHECK(part_ml.has_value() && part_ml->scalar_type() == at::kFloat && part_ml->is_contiguous() &&
                    part_ml->numel() >= splits * t * h * 2 && part_ml->device() == q.device(),
                "splits > 1 needs a contiguous float32 part_ml of splits x T x H x 2");
  }
  if (t == 0) return;
  int64_t raw = 0;
  for (int i = 0; i < p.n_src; ++i)
    if (p.src[i].fmt != 0) raw = std::max<int64_t>(raw, (p.src[i].copy_bytes + 15) / 16 * 16);
  const at::cuda::CUDAGuard guard(q.device());
  p.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.sink = sink.data_ptr();
  p.sink_f32 = sink.scalar_type() == at::kFloat;
  p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.part_acc = splits > 1 ? part_acc->data_ptr<float>() : nullptr;
  p.part_ml = splits > 1 ? part_ml->data_ptr<float>() : nullptr;
  p.T = int(t);
  p.H = int(h);
  p.scale = float(scale);
  p.splits = int(splits);
  p.tiles_per_split = int(tiles_per_split);
  p.raw_stride = int(raw);
  const cudaError_t err = v41::sparse_mqa_launch(p, int(d), at::cuda::getCurrentCUDAStream(), pdl);
  TORCH_CHECK(launch_ok(err, "sparse_mqa launch failed"),
              "sparse_mqa launch failed (the CUDA error is on stderr; invalid configuration: the tiles do not fit "
              "this GPU's shared memory)");
}

// out[t] = the k best eligible entries of scores[t], ascending, -1 for ineligible picks (python/v41/kernels/topk.py).
void select_topk(const at::Tensor& scores, const c10::optional<at::Tensor>& n_valid, int64_t k, at::Tensor& out,
                 bool pdl, int64_t ordered_max_n) {
  TORCH_CHECK(ordered_max_n >= 0 && ordered_max_n < (int64_t(1) << 31), "ordered_max_n must be in [0, 2^31)");
  TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == at::kFloat && scores.dim() == 2 && scores.stride(1) == 1,
              "scores must be a float32 CUDA tensor [T, N] with unit inner stride");
  const int64_t t = scores.size(0), n = scores.size(1);
  TORCH_CHECK(n <= v41::kTopkMaxN && t < (int64_t(1) << 31), "at most 65535 x 4096 entries per row");
  static_assert(v41::kTopkMaxK == 2048, "the message below");
  TORCH_CHECK(k >= 1 && k <= n && k <= v41::kTopkMaxK, "k must be in [1, min(N, 2048)]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 2 && out.size(0) == t &&
                  out.size(1) == k && out.device() == scores.device(),
              "out must be a contiguous int64 [T, k] tensor on scores' device");
  check_index(n_valid, scores, "n_valid must be a contiguous int64 tensor on scores's device");
  TORCH_CHECK(!n_valid.has_value() || n_valid->numel() == t, "n_valid needs one entry per row");
  if (t == 0) return;
  const at::cuda::CUDAGuard guard(scores.device());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  v41::TopkParams p{};
  p.scores = scores.data_ptr<float>();
  p.stride = scores.stride(0);
  p.n_valid = opt_ptr<int64_t>(n_valid);
  p.out = out.data_ptr<int64_t>();
  p.T = int(t);
  p.N = int(n);
  p.k = int(k);
  p.ordered_max_n = int(ordered_max_n);
  at::Tensor work, cand;
  if (!v41::select_topk_single(p.T, p.N, sms)) {
    work = at::zeros({t, v41::kTopkWorkInts}, scores.options().dtype(at::kInt));
    cand = at::empty({t, v41::kTopkCap}, scores.options().dtype(at::kLong));
    p.work = work.data_ptr<int>();
    p.cand = reinterpret_cast<unsigned long long*>(cand.data_ptr<int64_t>());
  }
  const cudaError_t err = v41::select_topk_launch(p, sms, at::cuda::getCurrentCUDAStream(), pdl);
  TORCH_CHECK(launch_ok(err, "select_topk launch failed"), "select_topk launch failed (the CUDA error is on stderr)");
}

// out[t, j] = sum_h w[t, h] relu(q[t, h] . k_j) over the paged index keys, -inf past n_visible[t]
// (python/v41/kernels/indexer.py).
void index_scores(const at::Tensor& q, const at::Tensor& w, const at::Tensor& keys, const at::Tensor& block_table,
                  const at::Tensor& req_index, const at::Tensor& n_visible, at::Tensor& out, int64_t rows_per_block,
                  int64_t fmt, int64_t queries_per_cta, int64_t entries_per_cta, bool pdl) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(2) == v41::kIdxDim &&
                  q.stride(2) == 1,
              "q must be a bfloat16 CUDA tensor [T, H, 128] with unit inner stride");
  const int64_t t = q.size(0), h = q.size(1);
  static_assert(v41::kIdxMaxHeads == 64, "the message below");
  TORCH_CHECK(h >= 16 && h <= v41::kIdxMaxHeads && h % 16 == 0, "q needs 16, 32, 48 or 64 heads");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == t && w.size(1) == h && w.stride(1) == 1 &&
                  w.device() == q.device(),
              "w must be a float32 [T, H] tensor with unit inner stride on q's device");
  TORCH_CHECK(fmt == 0 || fmt == 1, "fmt must be 0 (bf16 rows) or 1 (idx_mxfp4 records)");
  TORCH_CHECK(keys.device() == q.device() && keys.dim() == 2 && keys.stride(1) == 1,
              "keys must be a 2-D tensor with unit inner stride on q's device");
  int64_t k_stride = 0;
  if (fmt == 0) {
    TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && keys.size(1) == v41::kIdxDim && keys.stride(0) % 8 == 0 &&
                    aligned16(keys.data_ptr()),
                "bf16 keys must be [S, 128] rows at 16-byte aligned addresses");
    k_stride = keys.stride(0) * 2;
  } else {
    TORCH_CHECK(keys.scalar_type() == at::kByte && keys.size(1) >= v41::kIdxDim / 2 + v41::kIdxDim / 32 &&
                    keys.stride(0) % 4 == 0 && (reinterpret_cast<uintptr_t>(keys.data_ptr()) & 3) == 0,
                "record keys must be uint8 [S, 68] rows at 4-byte aligned addresses");
    k_stride = keys.stride(0);
  }
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.device() == q.device(),
              "block_table must be an int64 [R, NB] tensor with unit inner stride on q's device");
  check_index(req_index, q, "req_index must be a contiguous int64 tensor on q's device");
  check_index(n_visible, q, "n_visible must be a contiguous int64 tensor on q's device");
  TORCH_CHECK(req_index.numel() == t && n_visible.numel() == t, "req_index and n_visible need one entry per query");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == t && out.stride(1) == 1 &&
                  out.size(1) <= (int64_t(1) << 31) - 8192 && out.device() == q.device(),
              "out must be a float32 [T, N] tensor (N <= 2^31 - 8192) with unit inner stride on q's device");
  TORCH_CHECK(rows_per_block >= 1 && queries_per_cta >= 1 && queries_per_cta <= v41::kIdxMaxQueries &&
                  entries_per_cta >= 1 && entries_per_cta % (v41::kIdxWarps * v41::kIdxEntriesPerWarp) == 0,
              "rows_per_block >= 1, queries_per_cta in [1, 16], entries_per_cta a positive multiple of 128");
  TORCH_CHECK(t < (int64_t(1) << 31) / v41::kIdxMaxQueries && (t + queries_per_cta - 1) / queries_per_cta <= 65535,
              "too many queries for one launch (grid.y)");
  if (t == 0 || out.size(1) == 0) return;
  const at::cuda::CUDAGuard guard(q.device());
  v41::IdxScoreParams p{};
  p.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.w = w.data_ptr<float>();
  p.w_stride_t = w.stride(0);
  p.keys = reinterpret_cast<const uint8_t*>(keys.data_ptr());
  p.k_stride = k_stride;
  p.block_table = block_table.data_ptr<int64_t>();
  p.bt_stride = block_table.stride(0);
  p.req_index = req_index.data_ptr<int64_t>();
  p.n_visible = n_visible.data_ptr<int64_t>();
  p.out = out.data_ptr<float>();
  p.out_stride = out.stride(0);
  p.T = int(t);
  p.H = int(h);
  p.N = int(out.size(1));
  p.NB = int(block_table.size(1));
  p.rows_per_block = int(rows_per_block);
  p.fmt = int(fmt);
  p.queries_per_cta = int(queries_per_cta);
  p.entries_per_cta = int(entries_per_cta);
  const cudaError_t err = v41::index_scores_launch(p, at::cuda::getCurrentCUDAStream(), pdl);
  TORCH_CHECK(launch_ok(err, "index_scores launch failed"),
              "index_scores launch failed (the CUDA error is on stderr; invalid argument: the queries per CTA do "
              "not fit this GPU's shared memory)");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "v41 CUDA kernels (cuda/; docs/kernels.md)";
  m.def("wstream", &wstream, "weight-streaming W4A16 / W8A16 grouped GEMM (python/v41/kernels/wstream.py)",
        py::arg("x"), py::arg("rows"), py::arg("w"), py::arg("s"), py::arg("offsets"), py::arg("active"),
        py::arg("y"), py::arg("partial"), py::arg("counters"), py::arg("fmt"), py::arg("n_groups"), py::arg("b0"),
        py::arg("sk"), py::arg("slots"), py::arg("split"), py::arg("chunks_per_split"),
        py::arg("x_prefetch"), py::arg("five_ctas"), py::arg("double_buffer") = 0, py::arg("pdl") = false);
  m.def("sparse_mqa", &sparse_mqa, "sparse MQA with sink over bf16 rows or records (python/v41/kernels/sparse_mqa.py)",
        py::arg("q"), py::arg("out"), py::arg("sink"), py::arg("cache0"), py::arg("slots0"), py::arg("fmt0"),
        py::arg("rope0"), py::arg("cache1"), py::arg("slots1"), py::arg("fmt1"), py::arg("rope1"), py::arg("scale"),
        py::arg("splits"), py::arg("tiles_per_split"), py::arg("part_acc"), py::arg("part_ml"),
        py::arg("pdl") = false);
  m.def("select_topk", &select_topk, "exact top-k ids of float32 score rows (python/v41/kernels/topk.py)",
        py::arg("scores"), py::arg("n_valid"), py::arg("k"), py::arg("out"), py::arg("pdl") = false,
        py::arg("ordered_max_n") = v41::kTopkOrderedMaxN);
  m.def("index_scores", &index_scores, "indexer scores over the paged index keys (python/v41/kernels/indexer.py)",
        py::arg("q"), py::arg("w"), py::arg("keys"), py::arg("block_table"), py::arg("req_index"),
        py::arg("n_visible"), py::arg("out"), py::arg("rows_per_block"), py::arg("fmt"), py::arg("queries_per_cta"),
        py::arg("entries_per_cta"), py::arg("pdl") = false);
  v41_bind::register_glue(m);
  m.attr("TOPK_MAX_K") = v41::kTopkMaxK;
  m.attr("TOPK_MAX_N") = v41::kTopkMaxN;
  // the architectures cuda/build.py compiled for, e.g. "sm_90a" or "sm_90a,sm_100a"
  m.attr("ARCHS") = py::tuple(py::str(V41_STR(V41_ARCHS)).attr("split")(","));
}
