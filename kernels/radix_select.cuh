// Block-wide radix selection over one row of float keys: the k-th largest (weights 1) or the
// key where the probability mass summed from the top reaches a target (weights e^x). 4 passes of
// 8 bits over the row with a 256-bin histogram per warp in shared memory; no sort, no atomics, no
// scratch memory.
// Used by topk.cu (indexer top-k) and sampling.cu (top-k / top-p / top logprobs).
#pragma once
#include "dsuf_common.cuh"

// Float bits -> u32 whose unsigned order is the float order. -0.0 folds to +0.0 first (bitwise:
// adding 0.0f would also flush subnormals under -ftz). -inf and NaN map to 0 = "not a
// candidate"; every finite value and +inf maps above 0x007fffff.
__device__ __forceinline__ u32 order_key(u32 u) {
  if (u == 0x80000000u) u = 0u;
  const u32 key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return key <= 0x007fffffu || key > 0xff800000u ? 0u : key;
}
// The float a non-zero key came from.
__device__ __forceinline__ float key_value(u32 key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Weights are integers: counts, or probability mass in fixed point (RADIX_ONE = 1.0), so every
// sum is exact and the selection does not depend on the order of the additions.
#define RADIX_ONE 1099511627776.0f  // 2^40: a weight is at most 2^40, a row sums below 2^57

struct RadixPick {
  u32 key;  // exact key t of the crossing element, or (all) a key prefix: take every key >= it
  u64 rem;    // weight still needed from the candidates with key == t (exact case)
  bool all;   // the selection is "key >= key": fewer than target in total (key 0: every
              // candidate), or the crossing bin is taken whole
};

// Among candidates (key != 0) with weights in [0, 2^40], the key t where the weight summed from
// the largest key down first reaches target (> 0): W(key > t) < target <= W(key >= t).
// key_of(i) -> u32 (0: not a candidate); weight_of(i, key) -> u64 (UNIT: every weight is 1).
// Every thread of the block must call it; it returns the same value to all. smem: hist >= 256 u64
// per warp, pick >= 6 words, both unused by the caller meanwhile.
template <bool UNIT, class KeyF, class WeightF>
__device__ RadixPick radix_pick(int N, u64 target, KeyF key_of, WeightF weight_of, u64* hist, u32* pick) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x, nw = nt >> 5;
  u64* own = hist + 256 * warp;  // this warp's histogram: no atomics, no contention between warps
  // Block-uniform state. Invariant: the crossing element is among the keys matching `pref` on
  // the bits of `pmask`, and `rem` is the weight still needed from them.
  u32 pref = 0u, pmask = 0u;
  u64 rem = target;
  bool all = false;
  for (int shift = 24; shift >= 0 && !all; shift -= 8) {
    for (int b = tid; b < 256 * nw; b += nt) hist[b] = 0ull;
    __syncthreads();
    // whole warps iterate together (base is uniform), so __match_any_sync sees all 32 lanes; the
    // lanes of one bin add up first (two 32-bit warp reductions of the high and low 20 bits of
    // the weights), then one lane per distinct bin adds to the warp's own histogram
    for (int base = 0; base < N; base += nt) {
      const int i = base + tid;
      const u32 key = i < N ? key_of(i) : 0u;
      const bool take = key != 0u && (key & pmask) == pref;
      const u32 bin = take ? (key >> shift) & 255u : 256u;
      const u32 peers = __match_any_sync(0xffffffffu, bin);
      u64 sum;
      if (UNIT) {
        sum = (u64)__popc(peers);
      } else {
        const u64 w = take ? weight_of(i, key) : 0ull;
        sum = ((u64)__reduce_add_sync(peers, (u32)(w >> 20)) << 20) + __reduce_add_sync(peers, (u32)w & 0xfffffu);
      }
      if (take && lane == __ffs(peers) - 1) own[bin] += sum;
    }
    __syncthreads();
    for (int b = tid; b < 256; b += nt) {  // the warps' histograms into the first one
      u64 t = hist[b];
      for (int w = 1; w < nw; ++w) t += hist[256 * w + b];
      hist[b] = t;
    }
    __syncthreads();
    if (warp == 0) {
      // lane l owns bins 255-8l .. 248-8l (descending); inclusive scan of weights from the top
      u64 c[8], sum = 0ull;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[255 - 8 * lane - j];
        sum += c[j];
      }
      u64 inc = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
      }
      const u64 total = __shfl_sync(0xffffffffu, inc, 31);
      const u64 exc = inc - sum;
      if (lane == 0) pick[0] = total < rem;  // short of the target: take every candidate left
      if (!(total < rem) && exc < rem && rem <= inc) {  // the one lane whose bins cross
        u64 r = rem - exc;
        bool found = false;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (!found && r <= c[j]) {
            pick[1] = 255u - 8u * lane - j;
            pick[2] = (u32)r;
            pick[3] = (u32)(r >> 32);
            pick[4] = (u32)c[j];
            pick[5] = (u32)(c[j] >> 32);
            found = true;
          }
          if (!found) r -= c[j];
        }
      }
    }
    __syncthreads();
    if (pick[0]) {
      all = true;  // the prefix so far (0 on the first pass) selects every remaining candidate
    } else {
      const u64 r = ((u64)pick[3] << 32) | pick[2], cnt = ((u64)pick[5] << 32) | pick[4];
      pref |= pick[1] << shift;
      pmask |= 255u << shift;
      rem = r;
      all = r == cnt;  // the crossing bin is taken whole
    }
    __syncthreads();  // pick[] is rewritten by the next pass
  }
  return RadixPick{pref, rem, all};
}
