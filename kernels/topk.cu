// Top-k mask: per row, the k largest finite scores (ties: lower index first, like a stable
// descending argsort; -0.0 == +0.0; -inf never; +inf is a value). One block per row, no sort:
// radix-select the k-th largest order-preserving key (4 passes of 8 bits over the row, shared
// histograms), then write the mask in one more pass. No host sync, no scratch memory.
#include "dsuf_common.cuh"

#define TOPK_THREADS 512

// Float bits -> u32 whose unsigned order is the float order. -0.0 folds to +0.0 first (bitwise:
// adding 0.0f would also flush subnormals under -ftz). -inf maps to 0 = "not a candidate";
// every finite value and +inf maps above 0x007fffff.
__device__ __forceinline__ u32 topk_key(u32 u) {
  if (u == 0x80000000u) u = 0u;
  const u32 key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return key <= 0x007fffffu ? 0u : key;
}

// scores: f32 bits [S, N]; mask: bool [S, N], fully written; 1 <= k <= N. grid = S.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_mask(const u32* __restrict__ scores,
                                                                     u8* __restrict__ mask, int N, int k) {
  __shared__ u32 hist[256];
  __shared__ u32 wcnt[TOPK_THREADS / 32];
  __shared__ u32 s_bin, s_kk, s_cnt, s_all;
  const u32* x = scores + (size_t)blockIdx.x * N;
  u8* m = mask + (size_t)blockIdx.x * N;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;

  // Block-uniform state (every thread holds the same copy, so branches on it never split a
  // barrier). Invariant: the k-th largest candidate is the kk-th largest of those whose key
  // matches `pref` on the bits of `pmask`.
  u32 pref = 0u, pmask = 0u, kk = (u32)k;
  bool all = false;  // true: select every candidate with key >= pref (no partial tie group)
  for (int shift = 24; shift >= 0 && !all; shift -= 8) {
    for (int b = tid; b < 256; b += nt) hist[b] = 0u;
    __syncthreads();
    // whole warps iterate together (base is uniform), so __match_any_sync sees all 32 lanes;
    // aggregating equal bins per warp keeps tie-heavy rows off one shared atomic
    for (int base = 0; base < N; base += nt) {
      const int i = base + tid;
      const u32 key = i < N ? topk_key(x[i]) : 0u;
      const bool take = key != 0u && (key & pmask) == pref;
      const u32 bin = take ? (key >> shift) & 255u : 256u;
      const u32 peers = __match_any_sync(0xffffffffu, bin);
      if (take && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (u32)__popc(peers));
    }
    __syncthreads();
    if (warp == 0) {
      // lane l owns bins 255-8l .. 248-8l (descending); inclusive scan of counts from the top
      u32 c[8], sum = 0u;
#pragma unroll
      for (int j = 0; j < 8; ++j) { c[j] = hist[255 - 8 * lane - j]; sum += c[j]; }
      u32 inc = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u32 t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
      }
      const u32 total = __shfl_sync(0xffffffffu, inc, 31);
      const u32 exc = inc - sum;
      if (lane == 0) s_all = kk >= total;  // fewer candidates than kk: take all of them
      if (kk < total && exc < kk && kk <= inc) {  // the one lane whose bins hold the kk-th
        u32 r = kk - exc;
        bool found = false;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (!found && r <= c[j]) {
            s_bin = 255u - 8u * lane - j;
            s_kk = r;
            s_cnt = c[j];
            found = true;
          }
          if (!found) r -= c[j];
        }
      }
    }
    __syncthreads();
    // (the next pass rewrites s_* only after two more barriers, so these reads are safe)
    if (s_all) {
      all = true;
    } else {
      pref |= s_bin << shift;
      pmask |= 255u << shift;
      kk = s_kk;
      all = s_kk == s_cnt;  // the whole bin is taken: no need to split it further
    }
  }

  // Mask. all: key >= pref. Otherwise pref is the exact k-th key T and only the first kk
  // elements equal to T (index order) are taken: a block prefix count per tile of nt elements,
  // until kk are taken. taken is uniform (every thread adds the same tile total).
  const u32 T = pref;
  u32 taken = 0u;
  for (int base = 0; base < N; base += nt) {
    const int i = base + tid;
    const u32 key = i < N ? topk_key(x[i]) : 0u;
    bool sel = key != 0u && (all ? key >= T : key > T);
    if (!all && taken < kk) {
      const bool eq = key == T;  // T != 0 here, so padding lanes (key 0) never match
      const u32 bal = __ballot_sync(0xffffffffu, eq);
      if (lane == 0) wcnt[warp] = (u32)__popc(bal);
      __syncthreads();
      u32 before = taken + (u32)__popc(bal & ((1u << lane) - 1u)), tile = 0u;
      for (int w = 0; w < (nt >> 5); ++w) {
        const u32 c = wcnt[w];
        before += w < warp ? c : 0u;
        tile += c;
      }
      sel = sel || (eq && before < kk);
      taken += tile;
      __syncthreads();  // wcnt is rewritten by the next tile
    }
    if (i < N) m[i] = sel ? 1 : 0;
  }
}
