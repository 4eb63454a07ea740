// Warp-level bf16 tensor-core MMA, m16n8k16, float32 accumulators (PTX ISA "mma.sync.aligned.m16n8k16").
//
// Fragments, lane = 4·g + t: A (16×16, row-major) a0 = (row g, cols 2t, 2t+1), a1 = (row g+8, cols 2t, 2t+1),
// a2 = (row g, cols 2t+8, 2t+9), a3 = (row g+8, cols 2t+8, 2t+9); B (16×8) b0 = (rows 2t, 2t+1, col g),
// b1 = (rows 2t+8, 2t+9, col g); C (16×8) c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1).
// The lower half of a 32-bit register is the lower index.
#pragma once
#include <cstdint>

namespace v41 {

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace v41
