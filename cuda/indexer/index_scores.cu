// Lightning-indexer scores score[t, j] = Σ_h w[t, h] · ReLU(q[t, h] · k_j) over the paged index-key cache
// (docs/model.md §3.7 steps 2–4; docs/kernels.md "Indexer"), bf16 key rows or MXFP4 key records (idx_mxfp4: 64
// bytes of E2M1 pairs, low nibble first, then one E8M0 byte per 32 dims).
//
// Layout of the work. A CTA owns up to kIdxMaxQueries queries and a range of entries. The queries are staged once
// in shared memory as m16n8k16 A fragments (heads on the M side, 16 per tile) with their head weights. Each warp
// takes 32 entries per pass as four n-tiles of 8 (entries on the N side): lane (g, t) loads 16 bytes of entry g's
// record (dims 32t … 32t + 31: one E8M0 block, so one scale byte) or 64 bytes of its bf16 row, and turns them into
// the B fragments of its 8 k-steps in registers (common/dequant.cuh: exact bit moves and one bf16x2 multiply per
// word). A dot product does not depend on the order of its terms, so each lane's k elements are the dims its bytes
// hold, in the order the conversion produces them, and the query fragments are staged in that same order
// (phys_dim): no shuffles, no shared memory for the keys. A decoded key tile serves every query of the CTA that
// reads the same request; queries of other requests (a CTA straddling requests) take their own pass over the
// entries. After the 8 k-steps of a head tile the lane applies ReLU and the head weights; a reduce-scatter over the
// 8 lanes of a column (7 shuffles) leaves one entry's score per lane, and the 32 lanes write 32 scores.
// Entries at or past the query's n_visible are -inf; unmapped blocks score as zero keys (the reference's gather).
#include "../common/dequant.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
#include "index_scores.h"

namespace v41 {
namespace {

// Dim (0..127) of logical MMA k element (hi, e) — k = 2t + e (hi 0) or 2t + 8 + e (hi 1) — at k-step s for lane
// column t. MXFP4: step s reads converted word 2s (b0) and 2s + 1 (b1); word 4i + j pairs codes 8i + j and
// 8i + j + 4 of the lane's 32 (fp4_pair<j>), so k element (hi, e) is code 8(s/2) + 2(s%2) + hi + 4e. bf16: word i
// of the 64 bytes holds dims 2i, 2i + 1.
template <int FMT>
__device__ __forceinline__ int phys_dim(int t, int s, int hi, int e) {
  return FMT == 1 ? 32 * t + 8 * (s >> 1) + 2 * (s & 1) + hi + 4 * e : 32 * t + 4 * s + 2 * hi + e;
}

__device__ __forceinline__ uint32_t pack_bf16(const __nv_bfloat16* row, int d0, int d1) {
  return uint32_t(__bfloat16_as_ushort(row[d0])) | (uint32_t(__bfloat16_as_ushort(row[d1])) << 16);
}

__device__ __forceinline__ uint32_t load_nc_u32(const uint8_t* p) {
  uint32_t r;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(r) : "l"(p));
  return r;
}

// The 16 B-fragment words of one entry for lane column t (word 2s: b0 of step s, 2s + 1: b1); zeros when !valid.
template <int FMT>
__device__ __forceinline__ void load_key(const uint8_t* rec, bool valid, int t, uint32_t (&w)[16]) {
  if (FMT == 1) {
    uint32_t q[4] = {0, 0, 0, 0}, byte = 127;
    if (valid) {
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = load_nc_u32(rec + 16 * t + 4 * i);  // records are 4-byte aligned
      byte = rec[kIdxDim / 2 + t];
    }
    mxfp4_words(q, byte, w);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = valid ? __ldg(reinterpret_cast<const uint4*>(rec + 64 * t) + i) : make_uint4(0, 0, 0, 0);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  }
}

template <int FMT, int MT>
__global__ void __launch_bounds__(32 * kIdxWarps) index_scores_kernel(const IdxScoreParams p) {
  pdl_wait();  // common/pdl.cuh: everything below may read the previous kernel's output
  pdl_launch_dependents();
  extern __shared__ __align__(16) uint8_t smem[];
  const int QB = p.queries_per_cta;
  uint4* a_frag = reinterpret_cast<uint4*>(smem);  // [QB][MT][8 steps][32 lanes]
  float* w_head = reinterpret_cast<float*>(smem + size_t(QB) * MT * 8 * 32 * 16);  // [QB][16 MT]
  __shared__ int64_t s_req[kIdxMaxQueries];
  __shared__ int s_nvis[kIdxMaxQueries];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int q0 = blockIdx.y * QB, nq = min(QB, p.T - q0);
  const int H = 16 * MT;

  for (int idx = threadIdx.x; idx < QB * MT * 256; idx += blockDim.x) {
    const int ln = idx & 31, s = (idx >> 5) & 7, mt = (idx >> 8) % MT, qi = (idx >> 8) / MT;
    const int lg = ln >> 2, lt = ln & 3;
    uint4 a = make_uint4(0, 0, 0, 0);
    if (qi < nq) {
      const __nv_bfloat16* r0 = p.q + int64_t(q0 + qi) * p.q_stride_t + int64_t(16 * mt + lg) * p.q_stride_h;
      const __nv_bfloat16* r1 = r0 + 8 * p.q_stride_h;
      const int d00 = phys_dim<FMT>(lt, s, 0, 0), d01 = phys_dim<FMT>(lt, s, 0, 1);
      const int d10 = phys_dim<FMT>(lt, s, 1, 0), d11 = phys_dim<FMT>(lt, s, 1, 1);
      a = make_uint4(pack_bf16(r0, d00, d01), pack_bf16(r1, d00, d01), pack_bf16(r0, d10, d11),
                     pack_bf16(r1, d10, d11));
    }
    a_frag[idx] = a;
  }
  for (int idx = threadIdx.x; idx < QB * H; idx += blockDim.x) {
    const int qi = idx / H, h = idx % H;
    w_head[idx] = qi < nq ? p.w[int64_t(q0 + qi) * p.w_stride_t + h] : 0.f;
  }
  if (threadIdx.x < nq) {
    s_req[threadIdx.x] = p.req_index[q0 + threadIdx.x];
    const int64_t nv = p.n_visible[q0 + threadIdx.x];
    s_nvis[threadIdx.x] = int(nv < 0 ? 0 : nv > p.N ? p.N : nv);
  }
  __syncthreads();

  const int cta_lo = blockIdx.x * p.entries_per_cta, cta_hi = min(p.N, cta_lo + p.entries_per_cta);
  uint32_t pending = nq >= 32 ? 0xFFFFFFFFu : (1u << nq) - 1;
  while (pending) {  // one round per request among the CTA's queries (one round unless it straddles requests)
    const int64_t r = s_req[__ffs(pending) - 1];
    uint32_t mine = 0;
    int n_hi = 0;
    for (int qi = 0; qi < nq; ++qi)
      if ((pending >> qi & 1) && s_req[qi] == r) mine |= 1u << qi, n_hi = max(n_hi, s_nvis[qi]);
    pending &= ~mine;
    const int64_t* bt_row = p.block_table + r * p.bt_stride;

    for (int e0 = cta_lo + warp * kIdxEntriesPerWarp; e0 < cta_hi; e0 += kIdxWarps * kIdxEntriesPerWarp) {
      const int mine_entry = e0 + 8 * (g >> 1) + 2 * t + (g & 1);  // the entry this lane writes
      if (e0 >= n_hi) {  // nothing visible here for these queries
        for (int qi = 0; qi < nq; ++qi)
          if ((mine >> qi & 1) && mine_entry < cta_hi)
            p.out[int64_t(q0 + qi) * p.out_stride + mine_entry] = -INFINITY;
        continue;
      }
      uint32_t kw[4][16];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int j = e0 + 8 * nt + g;
        const int blk = j / p.rows_per_block;
        const int64_t phys = j < n_hi && blk < p.NB ? bt_row[blk] : -1;
        const int64_t slot = phys * p.rows_per_block + j % p.rows_per_block;
        const uint8_t* rec = phys >= 0 ? p.keys + slot * p.k_stride : p.keys;
        load_key<FMT>(rec, phys >= 0, t, kw[nt]);
      }
      for (int qi = 0; qi < nq; ++qi) {
        if (!(mine >> qi & 1)) continue;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // v[2 nt + e]: entry 8 nt + 2t + e, this lane's heads
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          float acc[4][4] = {};
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            const uint4 a = a_frag[((qi * MT + mt) * 8 + s) * 32 + lane];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
              mma_bf16_16816(acc[nt], a.x, a.y, a.z, a.w, kw[nt][2 * s], kw[nt][2 * s + 1]);
          }
          const float w0 = w_head[qi * H + 16 * mt + g], w1 = w_head[qi * H + 16 * mt + g + 8];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            v[2 * nt] += fmaxf(acc[nt][0], 0.f) * w0 + fmaxf(acc[nt][2], 0.f) * w1;
            v[2 * nt + 1] += fmaxf(acc[nt][1], 0.f) * w0 + fmaxf(acc[nt][3], 0.f) * w1;
          }
        }
        // reduce-scatter over the column's 8 lanes (g = lane bits 2..4): lane g keeps the sum of v[g]
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const bool up = g & 4;
          const float got = __shfl_xor_sync(0xFFFFFFFFu, up ? v[k] : v[k + 4], 16);
          v[k] = (up ? v[k + 4] : v[k]) + got;
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const bool up = g & 2;
          const float got = __shfl_xor_sync(0xFFFFFFFFu, up ? v[k] : v[k + 2], 8);
          v[k] = (up ? v[k + 2] : v[k]) + got;
        }
        {
          const bool up = g & 1;
          const float got = __shfl_xor_sync(0xFFFFFFFFu, up ? v[0] : v[1], 4);
          v[0] = (up ? v[1] : v[0]) + got;
        }
        if (mine_entry < cta_hi)
          p.out[int64_t(q0 + qi) * p.out_stride + mine_entry] = mine_entry < s_nvis[qi] ? v[0] : -INFINITY;
      }
    }
  }
}

template <int FMT>
cudaError_t launch_fmt(const IdxScoreParams& p, cudaStream_t stream, bool pdl) {
  const dim3 grid((p.N + p.entries_per_cta - 1) / p.entries_per_cta, (p.T + p.queries_per_cta - 1) / p.queries_per_cta);
  const size_t smem = index_scores_smem(p.H, p.queries_per_cta);
  auto kernel = p.H == 16 ? index_scores_kernel<FMT, 1>
              : p.H == 32 ? index_scores_kernel<FMT, 2>
              : p.H == 48 ? index_scores_kernel<FMT, 3>
                          : index_scores_kernel<FMT, 4>;
  if (smem > 48 * 1024) {
    int device = 0, optin = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    if (smem + 2 * kIdxMaxQueries * sizeof(int64_t) > size_t(optin)) return cudaErrorInvalidValue;  // + static
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  return launch_kernel(kernel, grid, dim3(32 * kIdxWarps), smem, stream, pdl, p);
}

}  // namespace

cudaError_t index_scores_launch(const IdxScoreParams& p, cudaStream_t stream, bool pdl) {
  if (p.H % 16 != 0 || p.H < 16 || p.H > kIdxMaxHeads || p.queries_per_cta < 1 ||
      p.queries_per_cta > kIdxMaxQueries || p.entries_per_cta < 1 ||
      p.entries_per_cta % (kIdxWarps * kIdxEntriesPerWarp) != 0)
    return cudaErrorInvalidValue;
  if (p.T == 0 || p.N == 0) return cudaSuccess;
  return p.fmt == 1 ? launch_fmt<1>(p, stream, pdl) : launch_fmt<0>(p, stream, pdl);
}

}  // namespace v41
