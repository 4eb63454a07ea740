// Exact top-k of float32 score rows by radix select (docs/kernels.md "Indexer top-k"; semantics:
// python/v41/kernels/topk.py select_topk_ref, docs/numerics.md §4 "Indexer top-k ties").
//
// A score maps to a 32-bit key that orders like the float (NaN above +inf, -0 = +0); an entry is eligible when its
// score is not -inf and j < n_valid. The k largest eligible keys, exact ties to the lower index, are found by
// histograms over key digits: bits 31..20 (4,096 bins), then 19..10 of the entries in the threshold bin (1,024
// bins). Entries above the threshold band are selected outright; the band's entries (one 22-bit key prefix,
// usually a handful) are sorted by (key, -index) in shared memory and the best `need` taken. A band of more than
// kTopkCap entries (heavy ties) is resolved exactly by one CTA: a histogram of bits 9..0, then an ordered scan
// that takes equal keys by increasing index. When fewer than k entries are eligible, the lowest-index ineligible
// entries fill the list as -1, which is what sorting the stable top-k ascending and masking -inf picks gives.
// The output is sorted ascending; atomics only decide where an id is staged, so results are deterministic. Rows of
// one CTA up to TopkParams::ordered_max_n entries write their picks in index order from one last pass instead of
// sorting them.
#include <cub/block/block_scan.cuh>

#include "../common/pdl.cuh"
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

// Block-wide, one CTA per row: s.ids holds s.n_sel selected ids (the entries above the band, or every eligible
// one); s.a.cand the band's c2 entries when c2 <= kTopkCap. Completes the k picks and writes out[0, k).
__device__ void finish_row(const float* row, int n, int k, const RowSel& sel, RowSmem& s, int64_t* out) {
  int n_sel = s.n_sel;
  if (!sel.all) {
    const int need = k - n_sel;
    if (sel.c2 <= kTopkCap) {
      const int p2 = pow2_at_least(sel.c2);
      for (int i = sel.c2 + threadIdx.x; i < p2; i += kThreads) s.a.cand[i] = 0ull;  // below every real key
      __syncthreads();
      bitonic<unsigned long long, true>(s.a.cand, p2);
      for (int i = threadIdx.x; i < need; i += kThreads) s.ids[n_sel + i] = 2 * int(~uint32_t(s.a.cand[i]));
    } else {  // heavy ties: bits 9..0 of the band, then equal keys by increasing index
      const uint32_t band = (sel.b1 << 10) | sel.b2;
      for (int b = threadIdx.x; b < kBins2; b += kThreads) s.hist2[b] = 0;
      __syncthreads();
      hist_range<3>(row, 0, n, band, s.hist2);
      __syncthreads();
      pick_bin(s.hist2, kBins2, need, s.scan, s.pick);
      const uint32_t b3 = uint32_t(s.pick.bin), theta = (band << 10) | b3;
      const int need3 = need - s.pick.above;
      for (int j = threadIdx.x; j < n; j += kThreads) {
        const float f = __ldg(row + j);
        const uint32_t key = order_key(f);
        if (eligible(f) && (key >> 10) == band && (key & 1023u) > b3) s.ids[atomicAdd(&s.n_sel, 1)] = 2 * j;
      }
      __syncthreads();
      ordered_take(0, n, need3, 0, [&](int j) { const float f = __ldg(row + j);
                                                return eligible(f) && order_key(f) == theta; },
                   s.ids + s.n_sel, s.scan);
    }
    n_sel = k;
  } else if (n_sel < k) {  // fewer than k eligible: the lowest-index ineligible entries, flagged
    const int m = k - n_sel;
    const int got = ordered_take(0, n, m, 1, [&](int j) { return !eligible(__ldg(row + j)); }, s.ids + n_sel,
                                 s.scan);
    for (int i = threadIdx.x; i < m - got; i += kThreads) s.ids[n_sel + got + i] = 2 * (n + i) + 1;
    n_sel = k;
  }
  __syncthreads();
  const int pk = pow2_at_least(k);
  for (int i = k + threadIdx.x; i < pk; i += kThreads) s.ids[i] = 0x7FFFFFFF;
  __syncthreads();
  bitonic<int, false>(s.ids, pk);
  for (int i = threadIdx.x; i < k; i += kThreads) {
    const int v = s.ids[i];
    out[i] = (v & 1) ? -1 : int64_t(v >> 1);
  }
}

// One-CTA rows up to p.ordered_max_n entries finish without sorting the ids: the k-th pick's composite
// theta = (key << 32) | ~id is found (the band's entries sorted, or for heavy ties the last 10 key bits, then the
// need3-th equal key in index order), and one ordered pass over the row writes each eligible entry whose composite
// is at least theta at its place in index order — exactly k of them, the composites being distinct. With fewer than
// k eligible entries (sel.all) every eligible entry is picked and the first k − eligible ineligible ones (entries
// past n last) give −1 at their places. Block scans (two 16-bit counts per int) give the places.
constexpr int kOrderedItems = 4;  // consecutive entries per thread and pass

__device__ unsigned long long band_theta(const float* row, int n, int k, const RowSel& sel, RowSmem& s) {
  const int need = k - sel.above;
  if (sel.c2 <= kTopkCap) {
    const int p2 = pow2_at_least(sel.c2);
    for (int i = sel.c2 + threadIdx.x; i < p2; i += kThreads) s.a.cand[i] = 0ull;
    __syncthreads();
    bitonic<unsigned long long, true>(s.a.cand, p2);
    return s.a.cand[need - 1];
  }
  const uint32_t band = (sel.b1 << 10) | sel.b2;
  for (int b = threadIdx.x; b < kBins2; b += kThreads) s.hist2[b] = 0;
  __syncthreads();
  hist_range<3>(row, 0, n, band, s.hist2);
  __syncthreads();
  pick_bin(s.hist2, kBins2, need, s.scan, s.pick);
  const uint32_t theta = (band << 10) | uint32_t(s.pick.bin);
  const int need3 = need - s.pick.above;
  ordered_take(0, n, need3, 0, [&](int j) { const float f = __ldg(row + j);
                                            return eligible(f) && order_key(f) == theta; },
               s.ids, s.scan);
  return (static_cast<unsigned long long>(theta) << 32) | uint32_t(~uint32_t(s.ids[need3 - 1] >> 1));
}

__device__ void finish_row_ordered(const float* row, int n, int k, const RowSel& sel, RowSmem& s, int64_t* out) {
  const unsigned long long theta = sel.all ? 0ull : band_theta(row, n, k, sel, s);
  const int m = sel.all ? k - sel.above : 0;  // ineligible entries that fill the list
  int picked = 0, filled = 0;              // eligible picks and ineligible entries before this pass
  for (int j0 = 0; j0 < n; j0 += kThreads * kOrderedItems) {
    int v[kOrderedItems], pre[kOrderedItems], total;
#pragma unroll
    for (int i = 0; i < kOrderedItems; ++i) {
      const int j = j0 + int(threadIdx.x) * kOrderedItems + i;
      const float f = j < n ? __ldg(row + j) : 0.f;
      const bool el = j < n && eligible(f);
      const bool pick = el && ((static_cast<unsigned long long>(order_key(f)) << 32) | uint32_t(~uint32_t(j))) >= theta;
      v[i] = int(pick) | (int(j < n && !el && m > 0) << 16);
    }
    Scan(s.scan).ExclusiveSum(v, pre, total);
#pragma unroll
    for (int i = 0; i < kOrderedItems; ++i) {
      const int j = j0 + int(threadIdx.x) * kOrderedItems + i;
      const int a = picked + (pre[i] & 0xFFFF), b = filled + (pre[i] >> 16);
      if (v[i] & 1) out[a + min(b, m)] = j;
      else if ((v[i] >> 16) && b < m) out[a + b] = -1;
    }
    picked += total & 0xFFFF;
    filled += total >> 16;
    __syncthreads();  // the scan's storage is reused
  }
  const int rest = m - min(filled, m);  // entries past n: after every entry below n
  for (int i = threadIdx.x; i < rest; i += kThreads) out[k - rest + i] = -1;
}

// One CTA per row: both histograms, the collect and the finish in shared memory.
__global__ void __launch_bounds__(kThreads) topk_row_kernel(const __grid_constant__ TopkParams p) {
  pdl_wait();  // common/pdl.cuh: everything below may read the previous kernel's output
  pdl_launch_dependents();
  __shared__ RowSmem s;
  const int t = blockIdx.x, n = row_len(p, t);
  const float* row = p.scores + int64_t(t) * p.stride;
  for (int b = threadIdx.x; b < kBins1; b += kThreads) s.a.hist1[b] = 0;
  if (threadIdx.x == 0) s.n_sel = s.n_cand = 0;
  __syncthreads();
  hist_range<1>(row, 0, n, 0, s.a.hist1);
  __syncthreads();
  pick_bin(s.a.hist1, kBins1, p.k, s.scan, s.pick);
  RowSel sel{};
  sel.all = s.pick.total <= p.k;
  sel.above = s.pick.total;
  if (!sel.all) {
    sel.b1 = uint32_t(s.pick.bin);
    const int gt1 = s.pick.above;
    for (int b = threadIdx.x; b < kBins2; b += kThreads) s.hist2[b] = 0;
    __syncthreads();
    hist_range<2>(row, 0, n, sel.b1, s.hist2);
    __syncthreads();
    pick_bin(s.hist2, kBins2, p.k - gt1, s.scan, s.pick);
    sel.b2 = uint32_t(s.pick.bin);
    sel.c2 = s.pick.count;
    sel.above = gt1 + s.pick.above;
  }
  __syncthreads();  // hist1 is dead: its space holds the band
  const bool ordered = p.ordered_max_n > 0 && n <= p.ordered_max_n;  // (block-uniform)
  unsigned long long* cand = sel.c2 <= kTopkCap ? s.a.cand : nullptr;
  if (!ordered)
    collect_range(row, 0, n, sel, s.ids, &s.n_sel, cand, &s.n_cand);
  else if (!sel.all && cand != nullptr)  // only the band's entries: the picks are written by the ordered pass
    collect_range(row, 0, n, sel, static_cast<int*>(nullptr), &s.n_sel, cand, &s.n_cand);
  __syncthreads();
  if (ordered)
    finish_row_ordered(row, n, p.k, sel, s, p.out + int64_t(t) * p.k);
  else
    finish_row(row, n, p.k, sel, s, p.out + int64_t(t) * p.k);
}

__device__ __forceinline__ bool chunk_active(int c, int n) { return c == 0 || c * kTopkChunk < n; }
__device__ __forceinline__ int active_chunks(int n) { return n > kTopkChunk ? (n + kTopkChunk - 1) / kTopkChunk : 1; }

// Whether this CTA is the last of its row's active CTAs to finish this pass (their global writes visible).
__device__ bool last_cta(int* done, int n_active, int* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(done, 1) == n_active - 1;
  __syncthreads();
  const bool last = *flag;
  if (last) __threadfence();
  return last;
}

// Adds this CTA's histogram to the row's and, in the row's last CTA, loads the row's histogram back for the pick.
__device__ bool flush_hist(PassSmem& s, int nbins, int* ghist, int* done, int n) {
  __syncthreads();
  for (int b = threadIdx.x; b < nbins; b += kThreads)
    if (s.hist[b]) atomicAdd(&ghist[b], s.hist[b]);
  if (!last_cta(done, active_chunks(n), &s.last)) return false;
  for (int b = threadIdx.x; b < nbins; b += kThreads) s.hist[b] = __ldcg(ghist + b);
  __syncthreads();
  return true;
}

// Histogram pass kPass (1: key bits 31..20 of every eligible entry; 2: bits 19..10 within the pass-1 bin); the
// row's last CTA picks the bin holding the k-th key and records it in the row's work area.
template <int kPass>
__global__ void __launch_bounds__(kThreads) topk_hist_pass(const __grid_constant__ TopkParams p) {
  pdl_wait();  // common/pdl.cuh: everything below may read the previous kernel's output
  pdl_launch_dependents();
  constexpr int kBins = kPass == 1 ? kBins1 : kBins2;
  __shared__ PassSmem s;
  const int t = blockIdx.x, c = blockIdx.y, n = row_len(p, t);
  int* w = p.work + int64_t(t) * kTopkWorkInts;
  const int b1 = kPass == 1 ? 0 : w[kB1];
  if (!chunk_active(c, n) || b1 < 0) return;
  const float* row = p.scores + int64_t(t) * p.stride;
  for (int b = threadIdx.x; b < kBins; b += kThreads) s.hist[b] = 0;
  __syncthreads();
  hist_range<kPass>(row, c * kTopkChunk, min(n, (c + 1) * kTopkChunk), uint32_t(b1), s.hist);
  if (!flush_hist(s, kBins, w + (kPass == 1 ? kH1 : kH2), w + (kPass == 1 ? kDone1 : kDone2), n)) return;
  const int gt1 = kPass == 1 ? 0 : w[kGt1];
  pick_bin(s.hist, kBins, p.k - gt1, s.scan, s.pick);
  if (threadIdx.x != 0) return;
  if (kPass == 1) {
    w[kB1] = s.pick.total <= p.k ? -1 : s.pick.bin;
    w[kGt1] = s.pick.above;
  } else {
    w[kB2] = s.pick.bin;
    w[kC2] = s.pick.count;
  }
}

__global__ void __launch_bounds__(kThreads) topk_collect_pass(const __grid_constant__ TopkParams p) {
  pdl_wait();  // common/pdl.cuh: everything below may read the previous kernel's output
  pdl_launch_dependents();
  __shared__ RowSmem s;
  const int t = blockIdx.x, c = blockIdx.y, n = row_len(p, t);
  if (!chunk_active(c, n)) return;
  const float* row = p.scores + int64_t(t) * p.stride;
  int* w = p.work + int64_t(t) * kTopkWorkInts;
  int64_t* out = p.out + int64_t(t) * p.k;
  unsigned long long* cand = p.cand + int64_t(t) * kTopkCap;
  RowSel sel{};
  sel.all = w[kB1] < 0;
  if (!sel.all) {
    sel.b1 = uint32_t(w[kB1]);
    sel.b2 = uint32_t(w[kB2]);
    sel.c2 = w[kC2];
  }
  collect_range(row, c * kTopkChunk, min(n, (c + 1) * kTopkChunk), sel, out, w + kNOut,
                sel.c2 <= kTopkCap ? cand : nullptr, w + kNCand);
  if (!last_cta(w + kDone3, active_chunks(n), &s.last)) return;
  const int n_out = __ldcg(w + kNOut);
  for (int i = threadIdx.x; i < n_out; i += kThreads) s.ids[i] = int(__ldcg(out + i));
  if (!sel.all && sel.c2 <= kTopkCap)
    for (int i = threadIdx.x; i < sel.c2; i += kThreads) s.a.cand[i] = __ldcg(cand + i);
  if (threadIdx.x == 0) s.n_sel = n_out;
  __syncthreads();
  finish_row(row, n, p.k, sel, s, out);
}

}  // namespace

cudaError_t select_topk_launch(const TopkParams& p, int sms, cudaStream_t stream, bool pdl) {
  if (p.T == 0) return cudaSuccess;
  if (select_topk_single(p.T, p.N, sms))
    return launch_kernel(topk_row_kernel, dim3(p.T), dim3(kThreads), 0, stream, pdl, p);
  const dim3 grid(p.T, (p.N + kTopkChunk - 1) / kTopkChunk);
  cudaError_t err = launch_kernel(topk_hist_pass<1>, grid, dim3(kThreads), 0, stream, pdl, p);
  if (err == cudaSuccess) err = launch_kernel(topk_hist_pass<2>, grid, dim3(kThreads), 0, stream, pdl, p);
  if (err == cudaSuccess) err = launch_kernel(topk_collect_pass, grid, dim3(kThreads), 0, stream, pdl, p);
  return err;
}

}  // namespace v41
