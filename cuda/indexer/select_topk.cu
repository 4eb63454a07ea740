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
#include "../common/pdl.cuh"
#include "select_topk_row.cuh"

namespace v41 {
namespace {

// The band's c2 composites (key << 32) | ~id in s.a.cand sorted descending (padded with zeros, below every real
// one, to a power of two).
__device__ void sort_band(RowSmem& s, int c2) {
  const int p2 = pow2_at_least(c2);
  for (int i = c2 + threadIdx.x; i < p2; i += kThreads) s.a.cand[i] = 0ull;
  __syncthreads();
  bitonic<unsigned long long, true>(s.a.cand, p2);
}

// Heavy ties (a band of more than kTopkCap entries): the full key holding the band's need-th largest key (a
// histogram of bits 9..0); need3 = how many of the picks have exactly that key.
__device__ uint32_t heavy_tie_key(const float* row, int n, uint32_t band, int need, RowSmem& s, int& need3) {
  for (int b = threadIdx.x; b < kBins2; b += kThreads) s.hist2[b] = 0;
  __syncthreads();
  hist_range<3>(row, 0, n, band, s.hist2);
  __syncthreads();
  pick_bin(s.hist2, kBins2, need, s.scan, s.pick);
  need3 = need - s.pick.above;
  return (band << 10) | uint32_t(s.pick.bin);
}

// dst[0, m) = 2·j for the first m eligible entries j whose key is exactly `key`, in index order.
__device__ void take_equal(const float* row, int n, uint32_t key, int m, int* dst, RowSmem& s) {
  ordered_take(0, n, m, 0, [&](int j) { const float f = __ldg(row + j);
                                        return eligible(f) && order_key(f) == key; },
               dst, s.scan);
}

// Block-wide, one CTA per row: s.ids holds s.n_sel selected ids (the entries above the band, or every eligible
// one); s.a.cand the band's c2 entries when c2 <= kTopkCap. Completes the k picks and writes out[0, k).
__device__ void finish_row(const float* row, int n, int k, const RowSel& sel, RowSmem& s, int64_t* out) {
  int n_sel = s.n_sel;
  if (!sel.all) {
    const int need = k - n_sel;
    if (sel.c2 <= kTopkCap) {
      sort_band(s, sel.c2);
      for (int i = threadIdx.x; i < need; i += kThreads) s.ids[n_sel + i] = 2 * int(~uint32_t(s.a.cand[i]));
    } else {  // heavy ties: bits 9..0 of the band, then equal keys by increasing index
      const uint32_t band = (sel.b1 << 10) | sel.b2;
      int need3;
      const uint32_t theta = heavy_tie_key(row, n, band, need, s, need3), b3 = theta & 1023u;
      for (int j = threadIdx.x; j < n; j += kThreads) {
        const float f = __ldg(row + j);
        const uint32_t key = order_key(f);
        if (eligible(f) && (key >> 10) == band && (key & 1023u) > b3) s.ids[atomicAdd(&s.n_sel, 1)] = 2 * j;
      }
      __syncthreads();
      take_equal(row, n, theta, need3, s.ids + s.n_sel, s);
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
    sort_band(s, sel.c2);
    return s.a.cand[need - 1];
  }
  int need3;
  const uint32_t theta = heavy_tie_key(row, n, (sel.b1 << 10) | sel.b2, need, s, need3);
  take_equal(row, n, theta, need3, s.ids, s);
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
