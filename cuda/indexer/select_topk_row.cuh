// Shared pieces of the exact top-k kernels (select_topk.cu, the only file that includes this one): the key
// order, eligibility, the digit histograms and the pick of the bin holding the k-th key, the collect of the
// selected entries and the band, a block bitonic sort and an ordered take. Design: select_topk.cu's header.
#pragma once
#include <cub/block/block_scan.cuh>

#include "select_topk.h"

namespace v41 {
namespace {

constexpr int kThreads = 256;
constexpr int kBins1 = 4096;
constexpr int kBins2 = 1024;
// per-row work area (ints): the two histograms, then counters and the picks of each pass
constexpr int kH1 = 0, kH2 = kBins1, kDone1 = kH2 + kBins2, kDone2 = kDone1 + 1, kDone3 = kDone1 + 2,
              kB1 = kDone1 + 3, kGt1 = kDone1 + 4, kB2 = kDone1 + 5, kC2 = kDone1 + 6, kNOut = kDone1 + 7,
              kNCand = kDone1 + 8;
static_assert(kNCand < kTopkWorkInts, "work area too small");

using Scan = cub::BlockScan<int, kThreads>;

struct Pick {
  int bin;    // the bin holding the need-th largest key, -1 when fewer than need keys were counted
  int above;  // keys in higher bins
  int count;  // keys in `bin`
  int total;  // keys counted
};

struct PassSmem {
  int hist[kBins1];
  typename Scan::TempStorage scan;
  Pick pick;
  int last;
};

struct RowSmem {
  union {
    int hist1[kBins1];
    unsigned long long cand[kTopkCap];  // (key << 32) | ~id of the band's entries
  } a;
  int hist2[kBins2];
  int ids[kTopkMaxK];  // 2·id (+1: ineligible pick, -1 in the output)
  typename Scan::TempStorage scan;
  Pick pick;
  int n_sel, n_cand, last;
};

// What the passes decided for a row.
struct RowSel {
  int all;          // at most k eligible entries: every one is selected
  uint32_t b1, b2;  // key bits 31..20 and 19..10 of the threshold band
  int c2;           // entries in the band
  int above;        // entries selected outright: every eligible one (all), else those above the band
};

__device__ __forceinline__ uint32_t order_key(float f) {
  if (f != f) return 0xFFFFFFFFu;
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool eligible(float f) { return f != __int_as_float(0xff800000); }

__device__ __forceinline__ int row_len(const TopkParams& p, int t) {
  if (p.n_valid == nullptr) return p.N;
  const int64_t v = p.n_valid[t];
  return int(v < 0 ? 0 : (v > p.N ? p.N : v));
}

// kMode 1: bins of bits 31..20; 2: bits 19..10 of keys whose bits 31..20 equal `prefix`; 3: bits 9..0 of keys
// whose bits 31..10 equal `prefix`. `hist` may be shared or global memory.
template <int kMode>
__device__ void hist_range(const float* row, int j0, int j1, uint32_t prefix, int* hist) {
#pragma unroll 4
  for (int j = j0 + threadIdx.x; j < j1; j += kThreads) {
    const float f = __ldg(row + j);
    if (!eligible(f)) continue;
    const uint32_t key = order_key(f);
    if (kMode == 1) {
      atomicAdd(&hist[key >> 20], 1);
    } else if (kMode == 2) {
      if ((key >> 20) == prefix) atomicAdd(&hist[(key >> 10) & 1023u], 1);
    } else {
      if ((key >> 10) == prefix) atomicAdd(&hist[key & 1023u], 1);
    }
  }
}

// Block-wide: the bin of `hist` (shared memory, nbins a multiple of kThreads) holding the need-th largest key.
__device__ void pick_bin(const int* hist, int nbins, int need, typename Scan::TempStorage& scan, Pick& out) {
  const int per = nbins / kThreads;
  const int g = kThreads - 1 - int(threadIdx.x);  // thread 0 owns the highest bins
  int sum = 0;
  for (int i = 0; i < per; ++i) sum += hist[g * per + i];
  if (threadIdx.x == 0) out.bin = -1;
  __syncthreads();
  int above, total;
  Scan(scan).ExclusiveSum(sum, above, total);
  for (int i = per - 1; i >= 0; --i) {
    const int b = g * per + i, h = hist[b];
    if (above < need && above + h >= need) {
      out.bin = b;
      out.above = above;
      out.count = h;
    }
    above += h;
  }
  if (threadIdx.x == 0) out.total = total;
  __syncthreads();
}

// Selected entries → ids[atomicAdd(n_ids)] (2·id) when ids is given; band entries → cand[atomicAdd(n_cand)] when
// cand is given.
template <typename Id>
__device__ void collect_range(const float* row, int j0, int j1, const RowSel& s, Id* ids, int* n_ids,
                              unsigned long long* cand, int* n_cand) {
  for (int j = j0 + threadIdx.x; j < j1; j += kThreads) {
    const float f = __ldg(row + j);
    if (!eligible(f)) continue;
    const uint32_t key = order_key(f);
    if (s.all) {
      if (ids != nullptr) ids[atomicAdd(n_ids, 1)] = Id(2 * j);
      continue;
    }
    const uint32_t d1 = key >> 20, d2 = (key >> 10) & 1023u;
    if (d1 < s.b1 || (d1 == s.b1 && d2 < s.b2)) continue;
    if (d1 > s.b1 || d2 > s.b2) {
      if (ids != nullptr) ids[atomicAdd(n_ids, 1)] = Id(2 * j);
    } else if (cand != nullptr) {
      cand[atomicAdd(n_cand, 1)] = (static_cast<unsigned long long>(key) << 32) | uint32_t(~uint32_t(j));
    }
  }
}

// Block-wide in-place bitonic sort of a[0, n) (n a power of two), ascending or descending.
template <typename T, bool kDesc>
__device__ void bitonic(T* a, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += kThreads) {
        const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
        const bool up = ((lo & size) == 0) != kDesc;
        const T x = a[lo], y = a[hi];
        if ((x > y) == up) {
          a[lo] = y;
          a[hi] = x;
        }
      }
      __syncthreads();
    }
  }
}

__device__ __forceinline__ int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Block-wide: dst[0, m) = 2·j + tag for the first m entries j of [j0, j1) (in index order) where flag(j); returns
// how many were found (at most m).
template <typename Flag>
__device__ int ordered_take(int j0, int j1, int m, int tag, Flag flag, int* dst, typename Scan::TempStorage& scan) {
  int taken = 0;
  for (int base = j0; base < j1 && taken < m; base += kThreads) {
    const int j = base + int(threadIdx.x);
    const int f = (j < j1 && flag(j)) ? 1 : 0;
    int pre, tot;
    Scan(scan).ExclusiveSum(f, pre, tot);
    if (f && taken + pre < m) dst[taken + pre] = 2 * j + tag;
    taken += tot;
    __syncthreads();
  }
  return taken < m ? taken : m;
}


}  // namespace
}  // namespace v41
