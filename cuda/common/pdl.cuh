// Programmatic dependent launch (PDL, sm_90+; CUDA programming guide "Programmatic Dependent Launch and
// Synchronization", PTX ISA "griddepcontrol"): a kernel launched with the programmatic-stream-serialization
// attribute may start while the kernel before it on the stream is still running, once every CTA of that kernel
// has executed `griddepcontrol.launch_dependents` (or exited). It must execute `griddepcontrol.wait` — which
// returns when the previous kernel has completed and its memory writes are visible — before it reads anything
// that kernel wrote or writes anything that kernel reads. Work that depends on neither (loading constant
// weights) can go before the wait, and so overlaps the previous kernel. CUDA graphs keep these launches as
// programmatic edges. Both instructions are no-ops for a kernel launched without the attribute.
//
// Every kernel of cuda/ calls pdl_wait() before its first dependent access and pdl_launch_dependents() right
// after it; python/v41/kernels/pdl.py says when the attribute is set (launch_kernel's `pdl`).
#pragma once
#include <cuda_runtime.h>

#include <utility>

namespace v41 {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// `kernel<<<grid, block, smem, stream>>>(args...)`, with the programmatic-stream-serialization attribute when
// `pdl`; returns the launch error.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) (void)cudaGetLastError();  // clear it, as cudaGetLastError() after <<<>>> did
  return err;
}

}  // namespace v41
