// bf16 ↔ float32 in groups of four (8-byte loads and stores), for the small kernels between the GEMMs
// (mhc/hc_seam.cu, moe/router.cu).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace v41 {

struct Bf4 {  // 4 bf16 ↔ 4 floats
  float v[4];
  __device__ __forceinline__ explicit Bf4(uint2 raw) {
    const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    v[0] = __low2float(a), v[1] = __high2float(a), v[2] = __low2float(b), v[3] = __high2float(b);
  }
  __device__ __forceinline__ Bf4() : v{0.f, 0.f, 0.f, 0.f} {}
  __device__ __forceinline__ uint2 pack() const {
    const __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
    return make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
  }
};

}  // namespace v41
