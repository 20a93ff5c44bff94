// The tensor-core GEMVs' weight ring (kernels/gemv_tc.cu tcgemv_*, kernels/gemv_q8.cu tcgemv8_*):
// each warp streams one 16-row tile of W (stages part, part + kw, ... of its K) through an S-deep
// cp.async ring in shared memory. A stage is 128 contiguous bytes of each of the tile's 16 rows
// (FP8: 128 k, FP4: 256 k; 16-byte chunks XOR-swizzled by row, so that ldmatrix reads are
// conflict-free), then its block scales where they can travel with it ("pre"): FP8 the tile's block
// row (bn a multiple of 16), FP4 8 UE8M0 bytes of each row (gk a multiple of 8).
#pragma once
#include "tc_fragments.cuh"

#define TC_SLOT (2048 + 128)  // weights, then scales (FP4: 16 rows x 8 bytes; FP8 uses 32 bytes)
#define TC_STAGEB 2048

// Stage j of this warp (stage index part + j * kw of the tile's K) into ring slot j % S; past `my`
// only the (empty) commit group, which keeps the wait counts uniform. F8 scales: nsc per stage
// (bk < 128: 128 / bk blocks of the stage, else the one block holding it).
template <bool F8, int S>
__device__ __forceinline__ void tc_issue(u32 ring, int j, int my, int part, int kw, int lane, int n0, int N,
                                         const u8* Wt, int row_bytes, bool pre, const void* Sc, int bn, int bk,
                                         int gk, int nsc) {
  constexpr int KPS = F8 ? 128 : 256;
  if (j < my) {
    const int kb = (part + j * kw) * 128;
    const u32 slot = ring + (j % S) * TC_SLOT;
    // lane's chunk c of rows r0 + 4i. A whole tile and stage (every stage of a tile inside N but
    // a row's last) takes four plain copies 4 rows apart; otherwise a row past N, or a chunk past
    // the row's end, copies nothing (source size 0, from an address inside the tile's first row).
    const int r0 = lane >> 3, c = lane & 7;
    const size_t step = (size_t)4 * row_bytes;
    if (n0 + 16 <= N && kb + 128 <= row_bytes) {
      const u8* src = Wt + (size_t)(n0 + r0) * row_bytes + kb + c * 16;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = r0 + 4 * i;
        cp_async16(slot + r * 128 + ((c ^ (r & 7)) << 4), src + i * step, 16);
      }
    } else {
      const bool in_k = kb + c * 16 < row_bytes;
      const u8* src = Wt + (size_t)min(n0 + r0, N - 1) * row_bytes + (in_k ? kb + c * 16 : 0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = r0 + 4 * i;
        const bool ok = in_k && n0 + r < N;
        cp_async16(slot + r * 128 + ((c ^ (r & 7)) << 4), ok ? src + i * step : src, ok ? 16 : 0);
      }
    }
    if (pre) {
      const int ks = (part + j * kw) * KPS;  // the stage's first k
      if (F8) {  // the block row's scales over the stage: KPS / bk of them, or one
        if (lane < nsc) {
          const int b = (bk < KPS ? (part + j * kw) * nsc : ks / bk) + lane;
          cp_async4(slot + TC_STAGEB + 4 * lane, (const float*)Sc + (size_t)(n0 / bn) * gk + (b < gk ? b : 0),
                    b < gk ? 4 : 0);
        }
      } else if (lane < 16) {  // 8 group scales of each row (zeros past the row's end)
        const int gi = ks / 32, n = n0 + lane < N ? n0 + lane : N - 1;
        const bool in = gi < gk;  // gk and gi are multiples of 8
        cp_async8(slot + TC_STAGEB + 8 * lane, (const u8*)Sc + (size_t)n * gk + (in ? gi : 0), in ? 8 : 0);
      }
    }
  }
  cp_async_commit();
}

// The tile's four 16 x 16-byte chunk pairs of ring slot `slot`: d[c][0] = row g, bytes 4t .. 4t + 3
// of chunk c; d[c][1] the same of row g + 8 (g = lane / 4, t = lane % 4: the MMA A fragment's rows).
__device__ __forceinline__ void tc_load_stage(u32 slot, int lane, u32 (&d)[8][2]) {
  const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = lane >> 4;  // this lane's ldmatrix row, chunk
#pragma unroll
  for (int cp2 = 0; cp2 < 4; ++cp2) {
    u32 w4[4];
    ldsm_x4(slot + lr * 128 + (((2 * cp2 + lc) ^ (lr & 7)) << 4), w4);
    d[2 * cp2][0] = w4[0]; d[2 * cp2][1] = w4[1]; d[2 * cp2 + 1][0] = w4[2]; d[2 * cp2 + 1][1] = w4[3];
  }
}

// The kw warps sharing a tile add their partial sums in a fixed order (deterministic: graph replays
// are bit-identical), through the ring's shared memory once every warp is done with it; then part 0
// stores rows 8j + 2t + (e & 1) of the segment and columns n0 + g (+ 8), bf16-rounded when bf.
template <int NT>
__device__ __forceinline__ void tc_reduce_store(float (&acc)[NT][4], u8* smem, int warp, int lane, int part, int kw,
                                                int n0, int N, int rows, float* Y, int ldy, int row0, int ycol,
                                                int bf) {
  const int g = lane >> 2, t = lane & 3;
  if (kw > 1) {
    __syncthreads();
    float* red = (float*)smem;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[(warp * 32 + lane) * (4 * NT) + 4 * j + e] = acc[j][e];
    __syncthreads();
    if (part != 0) return;
    for (int p = 1; p < kw; ++p)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += red[((warp + p) * 32 + lane) * (4 * NT) + 4 * j + e];
  }
  if (n0 >= N) return;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = 8 * j + 2 * t + (e & 1), n = n0 + g + (e < 2 ? 0 : 8);
      if (m < rows && n < N) Y[(size_t)(row0 + m) * ldy + ycol + n] = bf ? round_bf16f(acc[j][e]) : acc[j][e];
    }
}
