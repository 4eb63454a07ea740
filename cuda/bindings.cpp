// Python bindings of v41._cuda (built by cuda/build.py). Each function checks what the kernel assumes and launches
// on the current CUDA stream, so it can be captured in a CUDA graph; the Python wrappers in python/v41/kernels/ pick
// the launch shapes. Errors are RuntimeError (TORCH_CHECK).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "linear/wstream.h"

#ifndef V41_ARCHS
#error "cuda/build.py defines V41_ARCHS (the compiled architectures, e.g. sm_90a,sm_100a)"
#endif
#define V41_STR2(...) #__VA_ARGS__
#define V41_STR(...) V41_STR2(__VA_ARGS__)

namespace {

template <typename T>
const T* opt_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_index(const c10::optional<at::Tensor>& t, const at::Tensor& like, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device() == like.device(), name,
              " must be a contiguous int64 tensor on ", like.device());
}

// y[p] = x[rows[p]] · W[e]ᵀ for the rows p of expert e (module docstring of python/v41/kernels/wstream.py).
void wstream(const at::Tensor& x, const c10::optional<at::Tensor>& rows, const at::Tensor& w, const at::Tensor& s,
             const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& active, at::Tensor& y,
             const c10::optional<at::Tensor>& partial, const c10::optional<at::Tensor>& counters, int64_t fmt,
             int64_t n_groups, int64_t b0, int64_t sk, int64_t token_groups, int64_t slots, int64_t split,
             int64_t chunks_per_split, bool x_prefetch) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a 2-D bfloat16 CUDA tensor with unit inner stride");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.dim() == 2 && y.stride(1) == 1 && y.device() == x.device(),
              "y must be a 2-D bfloat16 tensor with unit inner stride on x's device");
  TORCH_CHECK(w.device() == x.device() && s.device() == x.device() && s.scalar_type() == at::kByte,
              "w and s (uint8 scales) must be on x's device");
  TORCH_CHECK(w.element_size() == 1 && (w.dim() == 2 || w.dim() == 3) && w.stride(-1) == 1 && s.dim() == w.dim(),
              "w must be a 2-D or 3-D tensor of 1-byte codes with unit inner stride, s of the same rank");
  TORCH_CHECK(fmt == 0 || fmt == 1, "fmt must be 0 (mxfp4) or 1 (fp8)");
  TORCH_CHECK(s.stride(-1) == 1 && (w.dim() == 2 || w.stride(0) % 16 == 0),
              "s needs unit inner stride; 3-D w a 16-byte multiple expert stride");
  TORCH_CHECK(b0 >= 1 && (fmt == 0 ? sk == 32 && b0 == 1 : sk >= 16 && sk % 16 == 0),
              "scale blocks: mxfp4 (1, 32); fp8 inputs per scale a multiple of 16");
  check_index(rows, x, "rows");
  check_index(offsets, x, "offsets");
  check_index(active, x, "active");
  const int64_t n = w.size(-2), k = w.size(-1) * (fmt == 0 ? 2 : 1), p = y.size(0);
  TORCH_CHECK(s.size(-2) >= (n + b0 - 1) / b0 && s.size(-1) >= (k + sk - 1) / sk &&
                  (w.dim() == 2 || s.size(0) == w.size(0)),
              "s must hold a scale byte for every (row block, input block) of w");
  TORCH_CHECK(rows.has_value() || x.size(0) >= p, "without rows, x needs a row per output row");
  TORCH_CHECK(!active.has_value() || active->numel() >= slots, "active needs an entry per slot");
  const int64_t ck = fmt == 0 ? 128 : 64;
  TORCH_CHECK(y.size(1) == n && k % ck == 0 && n_groups > 0 && n_groups % 16 == 0 && n % n_groups == 0,
              "shapes: y [P, N], K a multiple of ", ck, ", groups of whole 16-row tiles");
  TORCH_CHECK(x.size(1) >= (n / n_groups) * k, "x has fewer columns than the groups read");
  TORCH_CHECK(aligned16(x.data_ptr()) && x.stride(0) % 8 == 0 && aligned16(w.data_ptr()) && w.stride(-2) % 16 == 0,
              "x and w must be 16-byte aligned with 16-byte aligned rows");
  TORCH_CHECK(split >= 1 && chunks_per_split >= 1 && split * chunks_per_split >= k / ck,
              "split x chunks_per_split must cover K");
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
  prm.SK = int(sk);
  prm.chunks_per_split = int(chunks_per_split);
  prm.x_prefetch = x_prefetch && token_groups == 1;
  const dim3 grid{static_cast<unsigned>(slots), static_cast<unsigned>(tiles_n), static_cast<unsigned>(split)};
  const cudaError_t err = v41::wstream_launch(prm, fmt == 0 ? v41::WFmt::kMxfp4 : v41::WFmt::kFp8, int(token_groups),
                                              grid, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "wstream launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "v41 CUDA kernels (cuda/; docs/kernels.md)";
  m.def("wstream", &wstream, "weight-streaming W4A16 / W8A16 grouped GEMM (python/v41/kernels/wstream.py)",
        py::arg("x"), py::arg("rows"), py::arg("w"), py::arg("s"), py::arg("offsets"), py::arg("active"),
        py::arg("y"), py::arg("partial"), py::arg("counters"), py::arg("fmt"), py::arg("n_groups"), py::arg("b0"),
        py::arg("sk"), py::arg("token_groups"), py::arg("slots"), py::arg("split"), py::arg("chunks_per_split"),
        py::arg("x_prefetch"));
  // the architectures cuda/build.py compiled for, e.g. "sm_90a" or "sm_90a,sm_100a"
  m.attr("ARCHS") = py::tuple(py::str(V41_STR(V41_ARCHS)).attr("split")(","));
}
