// Helpers of the torch bindings (bindings.cpp, bindings_glue.cpp): argument checks and launch errors.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstdio>

namespace v41_bind {

// Messages are literals (or one const char*): on the device machine (torch 2.11) a TORCH_CHECK whose message is
// built from values, or any exception thrown from this library, crashed the process instead of raising. A failed
// launch prints its CUDA error on stderr first.
inline bool launch_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) std::fprintf(stderr, "v41._cuda: %s: %s\n", what, cudaGetErrorString(err));
  return err == cudaSuccess;
}

template <typename T>
const T* opt_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// `what`: the whole message, e.g. "rows must be a contiguous int64 tensor on x's device"
inline void check_index(const c10::optional<at::Tensor>& t, const at::Tensor& like, const char* what) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device() == like.device(), what);
}

// The glue kernels' bindings (bindings_glue.cpp): the mHC seam and the router.
void register_glue(pybind11::module& m);

}  // namespace v41_bind
