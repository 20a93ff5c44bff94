// MoE routing: scores (softmax / sigmoid / sqrt(softplus)), top-k of score + bias (ties: lower
// expert id first, like a stable argsort), renormalised weights. One warp per token.
#include "dsuf_common.cuh"

#define ROUTE_MAXE 512
extern "C" __global__ void __launch_bounds__(256) route_topk(const float* __restrict__ logits,
                                                            const float* __restrict__ bias,
                                                            const long long* __restrict__ hash_ids,
                                                            float* __restrict__ wout, long long* __restrict__ iout,
                                                            int T, int E, int K, int scoring, float temp,
                                                            float rscale, int normalise) {
  __shared__ float sc_all[8][ROUTE_MAXE];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * 8 + warp;
  if (t >= T) return;
  float* sc = sc_all[warp];
  const float* lr = logits + (size_t)t * E;
  float mx = -DSUF_INF;
  for (int e = lane; e < E; e += 32) {
    float x = lr[e];
    if (temp != 1.f) x = x / temp;
    sc[e] = x;
    mx = fmaxf(mx, x);
  }
  mx = warp_max(mx);
  if (scoring == 0) {  // softmax
    if (!isfinite(mx)) mx = 0.f;
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) { sc[e] = expf(sc[e] - mx); sum += sc[e]; }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32) sc[e] = sc[e] / sum;
  } else if (scoring == 1) {
    for (int e = lane; e < E; e += 32) sc[e] = sigmoidf_(sc[e]);
  } else {  // sqrt(log(1 + exp(x))), computed stably like np.logaddexp(0, x)
    for (int e = lane; e < E; e += 32) {
      const float x = sc[e];
      sc[e] = sqrtf(fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))));
    }
  }
  __syncwarp();
  // Lane l owns experts l + 32 i: their biased scores sit in registers and a bit of `taken` marks
  // each one picked, so a round is a scan of 16 registers and a warp argmax (the scan over shared
  // memory with a check against every earlier pick cost ~14 us per launch at 384 experts).
  constexpr int PER = ROUTE_MAXE / 32;
  float v[PER];
  unsigned taken = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? (bias ? sc[e] + bias[e] : sc[e]) : 0.f;
    if (e >= E) taken |= 1u << i;
  }
  __shared__ float wk_all[8][16];
  __shared__ long long ik_all[8][16];
  float wsum = 0.f;
  for (int k = 0; k < K && k < 16; ++k) {
    long long best_e;
    if (hash_ids) {
      best_e = hash_ids[(size_t)t * K + k];
    } else {
      float bv = -DSUF_INF;
      int be = 0x7fffffff;
#pragma unroll
      for (int i = 0; i < PER; ++i) {  // ascending expert ids: the first of equal scores wins
        if ((taken >> i) & 1u) continue;
        if (v[i] > bv || be == 0x7fffffff) {
          bv = v[i];
          be = lane + 32 * i;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (ov > bv || (ov == bv && oe < be)) { bv = ov; be = oe; }
      }
      if ((be & 31) == lane) taken |= 1u << (be >> 5);
      best_e = be;
    }
    const float w = sc[best_e];
    if (lane == 0) {
      wk_all[warp][k] = w;
      ik_all[warp][k] = best_e;
    }
    wsum += w;
  }
  __syncwarp();
  if (lane != 0) return;
  for (int k = 0; k < K && k < 16; ++k) {
    const float w = wk_all[warp][k];
    const float out = (normalise && (K > 1 || hash_ids)) ? w / (wsum + 1e-20f) : w;
    wout[(size_t)t * K + k] = out * rscale;
    iout[(size_t)t * K + k] = ik_all[warp][k];
  }
}

// ---------------------------------------------------------------------------------------------
// Pair grouping for moe() on the device (no host round trip, so a decode step can be captured in
// a CUDA graph). ids [P] (T x top-k pairs, row-major; clamped to [0, E)) -> order [P]: the pairs
// sorted by expert, ties by pair index (a stable sort); inv [P]: its inverse; gather [P] = order / K
// (the token of each sorted pair); segs [maxseg * 5]: each expert's run of sorted pairs cut into
// segments of at most `step` rows, (expert, first sorted row, rows, 0, 0) in sorted order, every
// unused trailing slot (0, 0, 0, 0, 0) (rows = 0: the linear kernels skip it).
// dup_col > 0: segs holds 2 * maxseg slots, the second half repeating the first with expert
// e + E and y column dup_col (w3 after w1 in one pointer table: gate and up in one launch).
// One block of MOE_GROUP_MAXP threads, P <= MOE_GROUP_MAXP, E <= 2^21. Keys expert << 10 | pair
// are unique, so a bitonic sort of them in shared memory is deterministic and stable by pair.
#define MOE_GROUP_MAXP 1024
extern "C" __global__ void __launch_bounds__(MOE_GROUP_MAXP) moe_group(const long long* __restrict__ ids, int P,
                                                                       int K, int E, int step, int maxseg,
                                                                       int dup_col, int* __restrict__ order,
                                                                       int* __restrict__ inv,
                                                                       int* __restrict__ gather, int* __restrict__ segs) {
  __shared__ u32 key[MOE_GROUP_MAXP];
  __shared__ int wcount[MOE_GROUP_MAXP / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (step < 1) step = 1;
  int n = 1;  // sort width: a power of two >= P, padded with keys above every real one
  while (n < P) n <<= 1;
  for (int i = tid; i < n; i += blockDim.x) {
    u32 kv = 0xffffffffu;
    if (i < P) {
      long long e = ids[i];
      e = e < 0 ? 0 : (e >= E ? E - 1 : e);
      kv = ((u32)e << 10) | (u32)i;
    }
    key[i] = kv;
  }
  __syncthreads();
  for (int size = 2; size <= n; size <<= 1)
    for (int j = size >> 1; j > 0; j >>= 1) {
      for (int t = tid; t < (n >> 1); t += blockDim.x) {
        const int i = ((t & ~(j - 1)) << 1) | (t & (j - 1)), l = i | j;  // bit j of i is clear
        const u32 a = key[i], b = key[l];
        if ((a > b) == ((i & size) == 0)) { key[i] = b; key[l] = a; }
      }
      __syncthreads();
    }
  // one thread per sorted position p
  const int p = tid;
  bool first = false;  // p starts a segment
  int e = 0, rows = 0;
  if (p < P) {
    const u32 kv = key[p];
    const int pair = (int)(kv & 1023u);
    e = (int)(kv >> 10);
    order[p] = pair;
    inv[pair] = p;
    gather[p] = pair / K;
    const u32 lo_key = (u32)e << 10, hi_key = lo_key + 1024u;
    int lo = 0, hi = p;  // start of e's run: first position with key >= lo_key
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (key[mid] < lo_key) lo = mid + 1; else hi = mid;
    }
    if ((p - lo) % step == 0) {
      first = true;
      int a = p + 1, b = P;  // end of e's run: first position with key >= hi_key
      while (a < b) {
        const int mid = (a + b) >> 1;
        if (key[mid] < hi_key) a = mid + 1; else b = mid;
      }
      rows = min(step, a - p);
    }
  }
  const u32 ballot = __ballot_sync(0xffffffffu, first);
  if (lane == 0) wcount[warp] = __popc(ballot);
  __syncthreads();
  int base = 0, total = 0;  // segments starting in earlier warps / in all warps
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
    const int c = wcount[w];
    base += w < warp ? c : 0;
    total += c;
  }
  if (first) {
    const int s = base + __popc(ballot & ((1u << lane) - 1u));
    if (s < maxseg) {
      int* sg = segs + 5 * s;
      sg[0] = e; sg[1] = p; sg[2] = rows; sg[3] = 0; sg[4] = 0;
      if (dup_col > 0) {
        sg += 5 * maxseg;
        sg[0] = e + E; sg[1] = p; sg[2] = rows; sg[3] = 0; sg[4] = dup_col;
      }
    }
  }
  for (int q = 5 * total + tid; q < 5 * maxseg; q += blockDim.x) segs[q] = 0;
  if (dup_col > 0)
    for (int q = 5 * total + tid; q < 5 * maxseg; q += blockDim.x) segs[5 * maxseg + q] = 0;
}

// ---------------------------------------------------------------------------------------------
// moe_group for any number of pairs (a prompt chunk's: T x top-k, thousands), the same outputs as
// moe_group (stable by pair within each expert, the same segments and zeroed tail), so that moe()
// need not copy the routing to the host to group it. One block of 1024 threads, a counting sort:
// warp w takes the contiguous pairs [w P / 32, (w + 1) P / 32), counts them per expert into its
// own row of hist [32][E] (dynamic shared memory, E <= MOE_GROUP_LARGE_MAXE), then each expert's
// column becomes the warps' offsets within its run, and each warp scatters its pairs in order (a
// lane's rank among the warp's lanes with its expert: __match_any_sync). Deterministic: no atomics.
#define MOE_GROUP_LARGE_MAXE 1024
__device__ __forceinline__ int block_exclusive_scan(int v, int* wsum, int* total) {  // 1024 threads
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int x = warp_inclusive_scan(v);
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  if (warp == 0) wsum[lane] = warp_inclusive_scan(wsum[lane]);  // inclusive over warps
  __syncthreads();
  const int before = (warp ? wsum[warp - 1] : 0) + x - v;
  *total = wsum[31];
  __syncthreads();  // (wsum is reused by the next scan)
  return before;
}

extern "C" __global__ void __launch_bounds__(1024) moe_group_large(const long long* __restrict__ ids, int P, int K,
                                                                   int E, int step, int maxseg, int dup_col,
                                                                   int* __restrict__ order, int* __restrict__ inv,
                                                                   int* __restrict__ gather, int* __restrict__ segs) {
  extern __shared__ int hist[];  // [32][E]: warp w's count, then its offset, per expert
  __shared__ int base[MOE_GROUP_LARGE_MAXE], cnt[MOE_GROUP_LARGE_MAXE];
  __shared__ int wsum[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (step < 1) step = 1;
  for (int i = tid; i < 32 * E; i += 1024) hist[i] = 0;
  __syncthreads();
  const int p0 = (int)((long long)P * warp / 32), p1 = (int)((long long)P * (warp + 1) / 32);
  const unsigned below = (1u << lane) - 1u;
  for (int q = p0; q < p1; q += 32) {  // (the warp's lanes stay together: p1 - q may be < 32)
    const int p = q + lane;
    const bool live = p < p1;
    long long e64 = live ? ids[p] : 0;
    const int e = live ? (int)(e64 < 0 ? 0 : (e64 >= E ? E - 1 : e64)) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (live && (same & below) == 0) hist[warp * E + e] += __popc(same);  // (the group's lowest lane)
    __syncwarp();  // (the next round's leader for e may be another lane)
  }
  __syncthreads();
  // per expert: the warps' counts -> their offsets within its run; the run's length
  for (int e = tid; e < E; e += 1024) {
    int run = 0;
    for (int w = 0; w < 32; ++w) {
      const int c = hist[w * E + e];
      hist[w * E + e] = run;
      run += c;
    }
    cnt[e] = run;
  }
  __syncthreads();
  // runs and their segments, in expert order (E <= 1024: one expert per thread)
  const int c = tid < E ? cnt[tid] : 0;
  int nrows, nsegs;
  const int b = block_exclusive_scan(c, wsum, &nrows);
  const int s = block_exclusive_scan((c + step - 1) / step, wsum, &nsegs);
  if (tid < E) base[tid] = b;  // (the segments below use this thread's own s)
  __syncthreads();
  for (int q = p0; q < p1; q += 32) {
    const int p = q + lane;
    const bool live = p < p1;
    long long e64 = live ? ids[p] : 0;
    const int e = live ? (int)(e64 < 0 ? 0 : (e64 >= E ? E - 1 : e64)) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int off = live ? hist[warp * E + e] : 0;
    __syncwarp();
    if (live) {
      const int pos = base[e] + off + __popc(same & below);
      order[pos] = p;
      inv[p] = pos;
      gather[pos] = p / K;
      if ((same & below) == 0) hist[warp * E + e] = off + __popc(same);
    }
    __syncwarp();
  }
  if (tid < E) {
    for (int r = 0; r * step < c; ++r) {
      const int sg = s + r;
      if (sg >= maxseg) break;
      int* o = segs + 5 * sg;
      o[0] = tid; o[1] = b + r * step; o[2] = min(step, c - r * step); o[3] = 0; o[4] = 0;
      if (dup_col > 0) {
        o += 5 * maxseg;
        o[0] = tid + E; o[1] = b + r * step; o[2] = min(step, c - r * step); o[3] = 0; o[4] = dup_col;
      }
    }
  }
  const int used = min(nsegs, maxseg);
  for (int q = 5 * used + tid; q < 5 * maxseg; q += 1024) segs[q] = 0;
  if (dup_col > 0)
    for (int q = 5 * used + tid; q < 5 * maxseg; q += 1024) segs[5 * maxseg + q] = 0;
  (void)nrows;
}
