// Python bindings of v41._cuda, part 2: the small kernels between a decode step's GEMMs — the mHC seam and the MoE
// router (python/v41/kernels/mhc_cuda.py, router.py). Conventions: bindings.cpp.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "binding_util.h"
#include "mhc/hc_seam.h"
#include "moe/router.h"

namespace v41_bind {
namespace {

// One mHC seam: the expansion, the mixes and the collapse into the sub-layer's normed input, the first and last
// optional (python/v41/kernels/mhc_cuda.py).
void hc_seam(const at::Tensor& h, const c10::optional<at::Tensor>& y, const c10::optional<at::Tensor>& post_in,
             const c10::optional<at::Tensor>& comb_in, const c10::optional<at::Tensor>& h_out, const at::Tensor& fn,
             const at::Tensor& scale, const at::Tensor& base, at::Tensor& pre, at::Tensor& post, at::Tensor& comb,
             at::Tensor& partial, at::Tensor& sync, int64_t collapse, const c10::optional<at::Tensor>& pre_c,
             const c10::optional<at::Tensor>& norm_w, const c10::optional<at::Tensor>& x, int64_t iters,
             double norm_eps, double hc_eps, double x_eps, bool pdl) {
  TORCH_CHECK(h.is_cuda() && h.scalar_type() == at::kBFloat16 && h.dim() == 3 && h.size(1) == 4 && h.is_contiguous() &&
                  (reinterpret_cast<uintptr_t>(h.data_ptr()) & 7) == 0,
              "h must be a contiguous 8-byte aligned bfloat16 CUDA tensor [T, 4, D]");
  const int64_t t = h.size(0), d = h.size(2);
  TORCH_CHECK(t >= 1 && t <= v41::kHcMaxTokens && d % v41::kHcCols == 0 && d > 0,
              "h: T must be 1..kHcMaxTokens and D a positive multiple of kHcCols");
  auto f32 = [&](const at::Tensor& v, int64_t n) {
    return v.scalar_type() == at::kFloat && v.is_contiguous() && v.device() == h.device() && v.numel() == n;
  };
  auto bf16 = [&](const at::Tensor& v, int64_t n, bool aligned8) {
    return v.scalar_type() == at::kBFloat16 && v.is_contiguous() && v.device() == h.device() && v.numel() == n &&
           (!aligned8 || (reinterpret_cast<uintptr_t>(v.data_ptr()) & 7) == 0);
  };
  TORCH_CHECK(f32(fn, 24 * 4 * d) && f32(scale, 3) && f32(base, 24),
              "fn [24, 4D], scale [3] and base [24] must be contiguous float32 tensors on h's device");
  TORCH_CHECK(f32(pre, 4 * t) && f32(post, 4 * t) && f32(comb, 16 * t),
              "pre [T, 4], post [T, 4] and comb [T, 4, 4] must be contiguous float32 tensors on h's device");
  TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous() && partial.device() == h.device() &&
                  partial.numel() >= (d / v41::kHcCols) * t * 32 + v41::kHcMaxTokens,
              "partial must be a contiguous float32 tensor of at least (D / kHcCols) * T * 32 + kHcMaxTokens "
              "elements");
  TORCH_CHECK(sync.scalar_type() == at::kInt && sync.numel() >= 2 && sync.is_contiguous() &&
                  sync.device() == h.device(),
              "sync must be a contiguous int32 tensor of 2 words (arrival counter, generation) on h's device");
  TORCH_CHECK(iters >= 1, "iters must be at least 1");
  const bool expand = y.has_value();
  TORCH_CHECK(expand == post_in.has_value() && expand == comb_in.has_value() && expand == h_out.has_value(),
              "y, post_in, comb_in and h_out are given together or not at all");
  if (expand) {
    TORCH_CHECK(bf16(*y, t * d, false), "y must be a contiguous bfloat16 tensor [T, D] on h's device");
    TORCH_CHECK(f32(*post_in, 4 * t) && f32(*comb_in, 16 * t),
                "post_in [T, 4] and comb_in [T, 4, 4] must be contiguous float32 tensors on h's device");
    TORCH_CHECK(bf16(*h_out, h.numel(), false) && h_out->data_ptr() != h.data_ptr(),
                "h_out must be a contiguous bfloat16 tensor shaped like h, not h itself");
  }
  TORCH_CHECK(collapse >= 0 && collapse <= 2, "collapse must be 0 (none), 1 (given weights) or 2 (this seam's pre)");
  TORCH_CHECK(pre_c.has_value() == (collapse == 1) && norm_w.has_value() == (collapse > 0) &&
                  x.has_value() == (collapse > 0),
              "pre_c goes with collapse 1, norm_w and x with collapse 1 or 2");
  const c10::cuda::CUDAGuard guard(h.device());
  TORCH_CHECK(collapse != 1 || d / v41::kHcCols <= v41::hc_seam_max_ctas(h.get_device()),
              "collapse 1 needs all D / kHcCols CTAs resident at once (hc_seam_max_ctas)");
  if (collapse > 0) {
    TORCH_CHECK(bf16(*norm_w, d, true) && bf16(*x, t * d, true),
                "norm_w [D] and x [T, D] must be contiguous 8-byte aligned bfloat16 tensors on h's device");
    TORCH_CHECK(collapse == 2 || f32(*pre_c, 4 * t), "pre_c must be a contiguous float32 tensor [T, 4]");
    TORCH_CHECK(collapse == 1 || d <= v41::kHcFreshMaxD, "collapse 2 (this seam's pre) takes D up to kHcFreshMaxD");
  }
  v41::HcSeamParams p{};
  p.h = reinterpret_cast<const __nv_bfloat16*>(h.data_ptr());
  p.y = expand ? reinterpret_cast<const __nv_bfloat16*>(y->data_ptr()) : nullptr;
  p.post_in = opt_ptr<float>(post_in);
  p.comb_in = opt_ptr<float>(comb_in);
  p.h_out = expand ? reinterpret_cast<__nv_bfloat16*>(h_out->data_ptr()) : nullptr;
  p.fn = fn.data_ptr<float>();
  p.scale = scale.data_ptr<float>();
  p.base = base.data_ptr<float>();
  p.pre = pre.data_ptr<float>();
  p.post = post.data_ptr<float>();
  p.comb = comb.data_ptr<float>();
  p.pre_c = opt_ptr<float>(pre_c);
  p.norm_w = collapse > 0 ? reinterpret_cast<const __nv_bfloat16*>(norm_w->data_ptr()) : nullptr;
  p.x = collapse > 0 ? reinterpret_cast<__nv_bfloat16*>(x->data_ptr()) : nullptr;
  p.partial = partial.data_ptr<float>();
  p.sync = sync.data_ptr<int>();
  p.T = int(t);
  p.D = int(d);
  p.iters = int(iters);
  p.norm_eps = float(norm_eps);
  p.hc_eps = float(hc_eps);
  p.x_eps = float(x_eps);
  const cudaError_t err =
      v41::hc_seam_launch(p, static_cast<v41::HcCollapse>(collapse), at::cuda::getCurrentCUDAStream(), pdl);
  TORCH_CHECK(launch_ok(err, "hc_seam launch failed"), "hc_seam launch failed (the CUDA error is on stderr)");
}

// The MoE router of a decode step: gate GEMV + routing (python/v41/kernels/router.py route_fused).
void router(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
            const c10::optional<at::Tensor>& hash_ids, at::Tensor& logits, at::Tensor& ids, at::Tensor& weights,
            at::Tensor& sync, double temp, double scaling, bool renorm, bool pdl) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 &&
                  x.stride(0) % 8 == 0 && aligned16(x.data_ptr()),
              "x must be a 2-D bfloat16 CUDA tensor, unit inner stride, 16-byte aligned rows");
  const int64_t t = x.size(0), d = x.size(1), e = w.size(0), k = ids.dim() == 2 ? ids.size(1) : 0;
  TORCH_CHECK(t >= 1 && t <= v41::kRouterMaxTokens && d % 8 == 0,
              "x: T must be 1..kRouterMaxTokens, D a multiple of 8");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) == d &&
                  w.device() == x.device() && aligned16(w.data_ptr()) && e >= 1 && e <= v41::kRouterMaxExperts,
              "w must be a contiguous 16-byte aligned bfloat16 [E, D] gate on x's device, E at most kRouterMaxExperts");
  TORCH_CHECK(k >= 1 && k <= v41::kRouterMaxK && k <= e && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                  ids.size(0) == t && ids.device() == x.device(),
              "ids must be a contiguous int64 [T, k] tensor on x's device, k in 1..kRouterMaxK and at most E");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == ids.sizes() &&
                  weights.device() == x.device(),
              "weights must be a contiguous float32 [T, k] tensor on x's device");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.numel() >= t * e &&
                  logits.device() == x.device(),
              "logits must be a contiguous float32 tensor of at least T * E elements on x's device");
  TORCH_CHECK(sync.scalar_type() == at::kInt && sync.numel() >= 1 && sync.device() == x.device(),
              "sync must be an int32 tensor on x's device");
  TORCH_CHECK(bias.has_value() != hash_ids.has_value(), "exactly one of bias and hash_ids");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == e &&
                    bias->device() == x.device(),
                "bias must be a contiguous float32 [E] tensor on x's device");
  if (hash_ids.has_value())
    TORCH_CHECK(hash_ids->scalar_type() == at::kLong && hash_ids->is_contiguous() && hash_ids->sizes() == ids.sizes() &&
                    hash_ids->device() == x.device(),
                "hash_ids must be a contiguous int64 [T, k] tensor on x's device");
  const c10::cuda::CUDAGuard guard(x.device());
  v41::RouterParams p{};
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.x_stride = x.stride(0);
  p.w = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
  p.bias = opt_ptr<float>(bias);
  p.hash_ids = opt_ptr<int64_t>(hash_ids);
  p.logits = logits.data_ptr<float>();
  p.ids = ids.data_ptr<int64_t>();
  p.weights = weights.data_ptr<float>();
  p.sync = sync.data_ptr<int>();
  p.T = int(t);
  p.D = int(d);
  p.E = int(e);
  p.k = int(k);
  p.temp = float(temp);
  p.scaling = float(scaling);
  p.renorm = renorm ? 1 : 0;
  const cudaError_t err = v41::router_launch(p, at::cuda::getCurrentCUDAStream(), pdl);
  TORCH_CHECK(launch_ok(err, "router launch failed"), "router launch failed (the CUDA error is on stderr)");
}

}  // namespace

void register_glue(pybind11::module& m) {
  namespace py = pybind11;
  m.def("hc_seam", &hc_seam, "one mHC seam: expansion, mixes, collapse + RMSNorm (python/v41/kernels/mhc_cuda.py)",
        py::arg("h"), py::arg("y"), py::arg("post_in"), py::arg("comb_in"), py::arg("h_out"), py::arg("fn"),
        py::arg("scale"), py::arg("base"), py::arg("pre"), py::arg("post"), py::arg("comb"), py::arg("partial"),
        py::arg("sync"), py::arg("collapse"), py::arg("pre_c"), py::arg("norm_w"), py::arg("x"), py::arg("iters"),
        py::arg("norm_eps"), py::arg("hc_eps"), py::arg("x_eps"), py::arg("pdl") = false);
  m.def("hc_seam_max_ctas", &v41::hc_seam_max_ctas, "CTAs of the given-weights seam resident at once on a device",
        py::arg("device"));
  m.def("router", &router, "the MoE router of a decode step: gate GEMV + routing (python/v41/kernels/router.py)",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("hash_ids"), py::arg("logits"), py::arg("ids"),
        py::arg("weights"), py::arg("sync"), py::arg("temp"), py::arg("scaling"), py::arg("renorm"),
        py::arg("pdl") = false);
  m.attr("ROUTER_MAX_TOKENS") = v41::kRouterMaxTokens;
  m.attr("ROUTER_MAX_K") = v41::kRouterMaxK;
  m.attr("ROUTER_MAX_EXPERTS") = v41::kRouterMaxExperts;
  m.attr("HC_MAX_TOKENS") = v41::kHcMaxTokens;
  m.attr("HC_COLS") = v41::kHcCols;
  m.attr("HC_FRESH_MAX_D") = v41::kHcFreshMaxD;
}

}  // namespace v41_bind
