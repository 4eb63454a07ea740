// Sparse MQA with a per-head sink over gathered cache rows (docs/model.md §3.5 steps 4–5; docs/kernels.md §2
// "Sparse MQA"): o_h = Σ_k softmax({q_h·k·scale} ∪ {sink_h})_k · k for the keys k a query lists (K = V), the
// sink in the normaliser only. PyTorch reference: sparse_mqa_sink_ref of python/v41/kernels/sparse_attention.py.
//
// Layout of the work. A CTA owns one query token, up to 64 heads and a range of key tiles (split-KV): grid
// (T, splits, ceil(H / 64)). The CTA first stages the slots of its tiles in shared memory; then each tile of 32
// listed keys is gathered once for all heads of the CTA by cp.async into shared memory (bf16 rows directly;
// records into a staging buffer, then decoded to bf16 in shared memory exactly as RecordFormat.decode of
// python/v41/cache/records.py, with the bit moves of common/dequant.cuh: every value is a code times a power of
// two or an E4M3 scale, exact in bf16), up to 4 tiles in flight so that gathers overlap the math. Warps come in
// pairs per 16 heads (the M side of m16n8k16 bf16 MMAs): the pair splits the head dim in halves, each computes
// its half of the 16 × 32 scores, the two exchange them through shared memory (a + b = b + a, so both hold the
// same sums), run the same online softmax in float32, and each accumulates P · V for its half of the output dims
// (16 × D/2 float32 accumulators per warp). Slot −1 and keys past a query's list are masked; tiles with no valid
// key are skipped. With one split the CTA writes o = acc / (l + e^(sink − m)); with several, each writes its
// unnormalised acc and (m, l) and the combine kernel merges them in split order (deterministic).
#include <cuda_bf16.h>

#include "../common/dequant.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
#include "../common/smem.cuh"
#include "sparse_mqa.h"

namespace v41 {
namespace {

constexpr int BK = kMqaKeysPerTile;
constexpr float kNoMax = -1.0e30f;  // finite: e^(m − m_new) stays defined while no valid key has been seen

__device__ __forceinline__ float e4m3_value(uint32_t b) {
  const uint32_t e = (b >> 3) & 15, m = b & 7;
  const float mag = e == 0 ? float(m) * 0.001953125f : __uint_as_float(((e + 120) << 23) | (m << 20));
  return (b & 128) ? -mag : mag;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <int D>
struct Smem {
  static constexpr int kRow = D + 8;  // bf16 per staged row: 16 bytes of padding keep ldmatrix conflict-free
  static size_t bytes(int head_groups, const MqaParams& p) {
    return size_t(head_groups) * 16 * kRow * 2 + size_t(p.kbuf_stages) * BK * kRow * 2 +
           size_t(p.stages) * BK * p.raw_stride + size_t(2 * head_groups) * 16 * BK * 4 +
           size_t(p.tiles_per_split) * BK * 4 + 16;
  }
};

// Issues the gather of key tile `tile` (the CTA's `local`-th) into pipeline stage `st` (bf16 rows into kbuf, records
// into raw) and writes its valid-key bit mask (bit i: key i of the tile is listed and its slot is not -1).
template <int D>
__device__ __forceinline__ void load_tile(const MqaParams& p, int local, int tile, int nt0, int st,
                                          __nv_bfloat16* kbuf, uint8_t* raw, uint32_t* vmask, const int* slot_s) {
  constexpr int kRow = Smem<D>::kRow;
  const MqaSource& s = p.src[tile >= nt0];
  const int* slots = slot_s + local * BK;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  if (tid < 32) {
    const uint32_t m = __ballot_sync(0xffffffffu, slots[tid] >= 0);
    if (tid == 0) vmask[st] = m;
  }
  // blockDim.x / 32 threads per key row, each copying a share of the row
  const int per_row = nthreads / BK, r = tid / per_row, sub = tid % per_row;
  const int slot = slots[r];
  const uint8_t* src = s.cache + int64_t(slot >= 0 ? slot : 0) * s.row_bytes;
  const int n = int(s.copy_bytes);
  if (s.fmt == int(KvFmt::kPlain)) {
    uint8_t* dst = reinterpret_cast<uint8_t*>(kbuf + (st * BK + r) * kRow);
    for (int c = sub; c < D * 2 / 16; c += per_row) cp_async<16>(dst + c * 16, src + c * 16, slot >= 0);
  } else {
    uint8_t* dst = raw + (st * BK + r) * p.raw_stride;
    if (s.row_bytes % 16 == 0 && n % 16 == 0) {
      for (int c = sub; c < n / 16; c += per_row) cp_async<16>(dst + c * 16, src + c * 16, slot >= 0);
    } else if (s.row_bytes % 8 == 0 && n % 8 == 0) {
      for (int c = sub; c < n / 8; c += per_row) cp_async<8>(dst + c * 8, src + c * 8, slot >= 0);
    } else {  // rows of small models that no copy width divides: bytes, synchronously
      for (int c = sub; c < n; c += per_row) dst[c] = slot >= 0 ? src[c] : uint8_t(0);
    }
  }
}

// Decodes the staged records of stage `buf` into the bf16 rows `kout` (zero-filled rows decode to zeros).
template <int D>
__device__ __forceinline__ void decode_tile(const MqaSource& s, int raw_stride, int buf, __nv_bfloat16* kout,
                                            const uint8_t* raw) {
  constexpr int kRow = Smem<D>::kRow, kChunks = D / 8;
  const int coded = D - s.rope;
  for (int i = threadIdx.x; i < BK * kChunks; i += blockDim.x) {
    const int r = i / kChunks, d0 = (i % kChunks) * 8;
    const uint8_t* row = raw + (buf * BK + r) * raw_stride;
    uint4 out;
    uint32_t* w = reinterpret_cast<uint32_t*>(&out);
    if (s.fmt == int(KvFmt::kCkvFp4)) {  // E2M1 pairs (0,4) (1,5) (2,6) (3,7) → dim order, × 2^126, × scale
      const uint32_t q = *reinterpret_cast<const uint32_t*>(row + d0 / 2);
      const uint32_t p0 = fp4_pair<0>(q), p1 = fp4_pair<1>(q), p2 = fp4_pair<2>(q), p3 = fp4_pair<3>(q);
      const uint32_t k = bf16_pow2(kFp4Bias) * 0x10001u;
      const __nv_bfloat16 sc = __float2bfloat16_rn(e4m3_value(row[D / 2 + d0 / 16]));  // exact
      const uint32_t s2 = uint32_t(__bfloat16_as_ushort(sc)) * 0x10001u;
      w[0] = bf16x2_mul(bf16x2_mul(__byte_perm(p0, p1, 0x5410), k), s2);
      w[1] = bf16x2_mul(bf16x2_mul(__byte_perm(p2, p3, 0x5410), k), s2);
      w[2] = bf16x2_mul(bf16x2_mul(__byte_perm(p0, p1, 0x7632), k), s2);
      w[3] = bf16x2_mul(bf16x2_mul(__byte_perm(p2, p3, 0x7632), k), s2);
    } else if (s.fmt == int(KvFmt::kSwaV4) && d0 >= coded) {
      const uint2* bf = reinterpret_cast<const uint2*>(row + coded + 2 * (d0 - coded));
      const uint2 lo = bf[0], hi = bf[1];
      out = make_uint4(lo.x, lo.y, hi.x, hi.y);
    } else {  // FP8 codes with E8M0 scales: per 32 dims (swa_fp8) or per 64 after the RoPE dims (swa_v4)
      const uint2 c2 = *reinterpret_cast<const uint2*>(row + d0);
      const uint32_t byte = s.fmt == int(KvFmt::kSwaFp8) ? row[D + d0 / 32] : row[coded + 2 * s.rope + d0 / 64];
      uint32_t v[4] = {fp8_pair<0>(c2.x), fp8_pair<1>(c2.x), fp8_pair<0>(c2.y), fp8_pair<1>(c2.y)};
      ScaleFactor<kFp8Bias>(byte).apply(v);
      w[0] = v[0], w[1] = v[1], w[2] = v[2], w[3] = v[3];
    }
    *reinterpret_cast<uint4*>(kout + r * kRow + d0) = out;
  }
}

template <int D, int HG>
__global__ void __launch_bounds__(64 * HG, 1) sparse_mqa_kernel(const __grid_constant__ MqaParams p) {
  pdl_wait();  // common/pdl.cuh: everything below may read the previous kernel's output
  pdl_launch_dependents();
  constexpr int NW = 2 * HG, DW = D / 2, NDT = DW / 8, kRow = Smem<D>::kRow;
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* kbuf = q_s + HG * 16 * kRow;
  uint8_t* raw = reinterpret_cast<uint8_t*>(kbuf + p.kbuf_stages * BK * kRow);
  float* sx = reinterpret_cast<float*>(raw + p.stages * BK * p.raw_stride);
  int* slot_s = reinterpret_cast<int*>(sx + NW * 16 * BK);
  uint32_t* vmask = reinterpret_cast<uint32_t*>(slot_s + p.tiles_per_split * BK);

  const int t = blockIdx.x, split = blockIdx.y, h0 = blockIdx.z * kMqaHeadsPerCta;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int hg = warp % HG, dh = warp / HG, g = lane / 4, tq = lane % 4;
  const int nt0 = (p.src[0].n + BK - 1) / BK;
  const int nt1 = p.n_src > 1 ? (p.src[1].n + BK - 1) / BK : 0;
  const int first = split * p.tiles_per_split;
  const int n_tiles = max(0, min(nt0 + nt1, first + p.tiles_per_split) - first);
  const int stages = p.stages;

  for (int i = tid; i < HG * 16 * (D / 8); i += blockDim.x) {  // this CTA's heads of q; heads ≥ H read as zeros
    const int r = i / (D / 8), c = i % (D / 8), h = h0 + r;
    const __nv_bfloat16* src = p.q + t * p.q_stride_t + (h < p.H ? h : 0) * p.q_stride_h + c * 8;
    cp_async<16>(q_s + r * kRow + c * 8, src, h < p.H);
  }
  for (int j = tid; j < n_tiles * BK; j += blockDim.x) {  // the slots of this CTA's tiles, -1 past a list's end
    const int tile = first + j / BK, second = tile >= nt0;
    const MqaSource& s = p.src[second];
    const int k = (second ? tile - nt0 : tile) * BK + j % BK;
    slot_s[j] = k < s.n ? int(s.slots[int64_t(t) * s.slot_stride + k]) : -1;
  }
  __syncthreads();
  for (int st = 0; st < stages - 1; ++st) {
    if (st < n_tiles) load_tile<D>(p, st, first + st, nt0, st, kbuf, raw, vmask, slot_s);
    cp_async_commit();
  }

  float m_r[2] = {kNoMax, kNoMax}, l_r[2] = {0.f, 0.f};
  float acc[NDT][4];
#pragma unroll
  for (int n = 0; n < NDT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  for (int it = 0; it < n_tiles; ++it) {
    const int st = it % stages, tile = first + it;
    if (it + stages - 1 < n_tiles) {
      const int ahead = it + stages - 1;
      load_tile<D>(p, ahead, first + ahead, nt0, ahead % stages, kbuf, raw, vmask, slot_s);
    }
    cp_async_commit();
    if (stages == 4) cp_async_wait<3>();
    else if (stages == 3) cp_async_wait<2>();
    else cp_async_wait<1>();
    __syncthreads();
    const uint32_t vm = vmask[st];
    if (vm != 0) {
      const MqaSource& s = p.src[tile >= nt0];
      __nv_bfloat16* K = kbuf + (st % p.kbuf_stages) * BK * kRow;
      if (s.fmt != int(KvFmt::kPlain)) {
        decode_tile<D>(s, p.raw_stride, st, K, raw);
        __syncthreads();
      }
      // scores of this warp's half of the head dim: s[j] = keys 8j..8j+7
      float sc[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < DW / 16; ++kk) {
        const int dim = dh * DW + kk * 16;
        uint32_t a[4];
        ldmatrix_x4(a, q_s + (hg * 16 + (lane & 15)) * kRow + dim + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t b[4];
          const int i = lane >> 3, r = lane & 7;
          ldmatrix_x4(b, K + (np * 16 + (i >> 1) * 8 + r) * kRow + dim + (i & 1) * 8);
          mma_bf16_16816(sc[2 * np], a[0], a[1], a[2], a[3], b[0], b[1]);
          mma_bf16_16816(sc[2 * np + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
      }
      float* mine = sx + warp * 16 * BK;
#pragma unroll
      for (int j = 0; j < 16; ++j) mine[j * 32 + lane] = sc[j / 4][j % 4];
      __syncthreads();
      const float* other = sx + (hg + (1 - dh) * HG) * 16 * BK;
#pragma unroll
      for (int j = 0; j < 16; ++j) sc[j / 4][j % 4] += other[j * 32 + lane];
      // online softmax over rows g (elements 0, 1) and g + 8 (elements 2, 3)
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * 8 + 2 * tq + (e & 1);
          sc[j][e] = (vm >> key) & 1 ? sc[j][e] * p.scale : -INFINITY;
          mx[e / 2] = fmaxf(mx[e / 2], sc[j][e]);
        }
      float alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m_r[r], mx[r]);
        alpha[r] = expf(m_r[r] - m_new);
        m_r[r] = m_new;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[j][e] = expf(sc[j][e] - m_r[e / 2]);
          sum[e / 2] += sc[j][e];
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
        l_r[r] = l_r[r] * alpha[r] + sum[r];
      }
#pragma unroll
      for (int n = 0; n < NDT; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
      }
      // acc += P · V over this warp's half of the dims; P's fragments are the score accumulators in bf16
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const uint32_t a0 = pack_bf16(sc[2 * ks][0], sc[2 * ks][1]), a1 = pack_bf16(sc[2 * ks][2], sc[2 * ks][3]);
        const uint32_t a2 = pack_bf16(sc[2 * ks + 1][0], sc[2 * ks + 1][1]);
        const uint32_t a3 = pack_bf16(sc[2 * ks + 1][2], sc[2 * ks + 1][3]);
#pragma unroll
        for (int np = 0; np < NDT / 2; ++np) {
          uint32_t b[4];
          const int i = lane >> 3, r = lane & 7;
          ldmatrix_x4_trans(b, K + (ks * 16 + (i & 1) * 8 + r) * kRow + dh * DW + np * 16 + (i >> 1) * 8);
          mma_bf16_16816(acc[2 * np], a0, a1, a2, a3, b[0], b[1]);
          mma_bf16_16816(acc[2 * np + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + hg * 16 + g + 8 * r;
    if (h >= p.H) continue;
    if (p.splits == 1) {
      const float sink = p.sink_f32 ? static_cast<const float*>(p.sink)[h]
                                    : __bfloat162float(static_cast<const __nv_bfloat16*>(p.sink)[h]);
      const float denom = l_r[r] + expf(sink - m_r[r]);
      __nv_bfloat16* o = p.out + t * p.o_stride_t + h * p.o_stride_h + dh * DW + 2 * tq;
#pragma unroll
      for (int n = 0; n < NDT; ++n)
        *reinterpret_cast<uint32_t*>(o + n * 8) = pack_bf16(acc[n][2 * r] / denom, acc[n][2 * r + 1] / denom);
    } else {
      const int64_t row = (int64_t(split) * p.T + t) * p.H + h;
      float* o = p.part_acc + row * D + dh * DW + 2 * tq;
#pragma unroll
      for (int n = 0; n < NDT; ++n) *reinterpret_cast<float2*>(o + n * 8) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
      if (dh == 0 && tq == 0) *reinterpret_cast<float2*>(p.part_ml + 2 * row) = make_float2(m_r[r], l_r[r]);
    }
  }
}

// One CTA per (token, head), D / 4 threads of 4 dims: merges the splits in order.
template <int D>
__global__ void __launch_bounds__(D / 4) sparse_mqa_combine(const __grid_constant__ MqaParams p) {
  pdl_wait();  // common/pdl.cuh: everything below may read the previous kernel's output
  pdl_launch_dependents();
  const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x * 4;
  float mx = kNoMax;
  for (int s = 0; s < p.splits; ++s) mx = fmaxf(mx, p.part_ml[2 * ((int64_t(s) * p.T + t) * p.H + h)]);
  float l = 0.f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < p.splits; ++s) {
    const int64_t row = (int64_t(s) * p.T + t) * p.H + h;
    const float2 ml = *reinterpret_cast<const float2*>(p.part_ml + 2 * row);
    const float w = expf(ml.x - mx);
    const float4 a = *reinterpret_cast<const float4*>(p.part_acc + row * D + d);
    l += ml.y * w;
    o.x += a.x * w;
    o.y += a.y * w;
    o.z += a.z * w;
    o.w += a.w * w;
  }
  const float sink = p.sink_f32 ? static_cast<const float*>(p.sink)[h]
                                : __bfloat162float(static_cast<const __nv_bfloat16*>(p.sink)[h]);
  const float denom = l + expf(sink - mx);
  __nv_bfloat16* out = p.out + t * p.o_stride_t + h * p.o_stride_h + d;
  reinterpret_cast<uint32_t*>(out)[0] = pack_bf16(o.x / denom, o.y / denom);
  reinterpret_cast<uint32_t*>(out)[1] = pack_bf16(o.z / denom, o.w / denom);
}

template <int D, int HG>
cudaError_t launch(MqaParams p, cudaStream_t stream, bool pdl) {
  int dev = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return err;
  bool plain = false;
  for (int i = 0; i < p.n_src; ++i) plain = plain || p.src[i].fmt == int(KvFmt::kPlain);
  for (p.stages = 4; p.stages > 2; --p.stages) {
    p.kbuf_stages = plain ? p.stages : 1;
    if (Smem<D>::bytes(HG, p) <= size_t(optin)) break;
  }
  p.kbuf_stages = plain ? p.stages : 1;
  const size_t smem = Smem<D>::bytes(HG, p);
  if (smem > size_t(optin)) return cudaErrorInvalidConfiguration;
  auto kernel = sparse_mqa_kernel<D, HG>;
  // the device's limit rather than this launch's size: concurrent callers set the same value
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
  if (err != cudaSuccess) return err;
  const dim3 grid{unsigned(p.T), unsigned(p.splits), unsigned((p.H + kMqaHeadsPerCta - 1) / kMqaHeadsPerCta)};
  err = launch_kernel(kernel, grid, dim3(64 * HG), smem, stream, pdl, p);
  if (err != cudaSuccess || p.splits == 1) return err;
  return launch_kernel(sparse_mqa_combine<D>, dim3(unsigned(p.T), unsigned(p.H)), dim3(D / 4), 0, stream, pdl, p);
}

template <int D>
cudaError_t launch_d(const MqaParams& p, cudaStream_t stream, bool pdl) {
  const int heads = min(p.H, kMqaHeadsPerCta);
  if (heads <= 16) return launch<D, 1>(p, stream, pdl);
  if (heads <= 32) return launch<D, 2>(p, stream, pdl);
  return launch<D, 4>(p, stream, pdl);
}

}  // namespace

cudaError_t sparse_mqa_launch(MqaParams p, int D, cudaStream_t stream, bool pdl) {
  switch (D) {
    case 64: return launch_d<64>(p, stream, pdl);
    case 128: return launch_d<128>(p, stream, pdl);
    case 256: return launch_d<256>(p, stream, pdl);
    case 512: return launch_d<512>(p, stream, pdl);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace v41
