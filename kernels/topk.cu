// Top-k mask: per row, the k largest finite scores (ties: lower index first, like a stable
// descending argsort; -0.0 == +0.0; -inf and NaN never; +inf is a value). One block per row, no
// sort: radix-select the k-th largest key (radix_select.cuh), then write the mask in one more
// pass. No host sync, no scratch memory.

#include "radix_select.cuh"

#define TOPK_THREADS 512

// scores: f32 bits [S, N]; mask: bool [S, N], fully written; 1 <= k <= N. grid = S.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_mask(const u32* __restrict__ scores,
                                                                     u8* __restrict__ mask, int N, int k) {
  __shared__ u64 hist[256 * (TOPK_THREADS / 32)];  // 32 KB
  __shared__ u32 pick[6];
  __shared__ u32 wcnt[TOPK_THREADS / 32];
  const u32* x = scores + (size_t)blockIdx.x * N;
  u8* m = mask + (size_t)blockIdx.x * N;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;
  const RadixPick p = radix_pick<true>(
      N, (u64)k, [&](int i) { return order_key(x[i]); }, [](int, u32) { return 1ull; }, hist, pick);
  const bool all = p.all;
  const u32 pref = p.key, kk = (u32)p.rem;

  // Mask. all: key >= pref. Otherwise pref is the exact k-th key T and only the first kk
  // elements equal to T (index order) are taken: a block prefix count per tile of nt elements,
  // until kk are taken. taken is uniform (every thread adds the same tile total).
  const u32 T = pref;
  u32 taken = 0u;
  for (int base = 0; base < N; base += nt) {
    const int i = base + tid;
    const u32 key = i < N ? order_key(x[i]) : 0u;
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
