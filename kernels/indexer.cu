// The lightning indexer's scores: out[s, n] = sum_h w[s, h] relu(q[s, h] . k[n]) (scaled), for decode
// (indexer_scores, indexer_scores_spans: CUDA cores) and prompt chunks (indexer_scores_tc1/3 in
// exact numerics, indexer_scores_bf in deepseek numerics: tensor cores).
#include "tc_fragments.cuh"

// Head weight w as the scores take it: w * hscale; with bf, the reference's bf16(bf16(w) * hscale),
// formed as it is loaded so that a decode step launches no passes of its own for the weights.
__device__ __forceinline__ float index_head_weight(float w, float hscale, bool bf) {
  return bf ? round_bf16f(round_bf16f(w) * hscale) : w * hscale;
}

// Keys n0 .. n0 + nk - 1 of kb [N, Dh] bf16 -> shared rows ld apart at dst, in 16-byte cp.async
// chunks by the whole block (zeros past N), as one commit group.
__device__ __forceinline__ void cp_async_key_tile(u32 dst, const u16* __restrict__ kb, int n0, int nk, int N, int Dh,
                                                  int ld) {
  const int c8n = Dh / 8;
  for (int idx = threadIdx.x; idx < nk * c8n; idx += blockDim.x) {
    const int r = idx / c8n, c = 8 * (idx % c8n);
    const bool ok = n0 + r < N;
    cp_async16(dst + 2 * (r * ld + c), kb + (ok ? (size_t)(n0 + r) * Dh + c : 0), ok ? 16 : 0);
  }
  cp_async_commit();
}

// out[s, n] = sum_h w[s, h] * H^-0.5 * relu(q[s, h] . k[n]) * Dh^-0.5
// q [S, H, Dh], k [N, Dh], w [S, H]. Dh % 32 == 0, Dh <= 256. grid (ceil(N/32), S), block 256:
// each warp scores 4 keys; q[s] and w[s] sit in dynamic shared memory. Keys n in [N, ldo) of the
// row (a decode batch's padding) get -inf. Lanes over heads: lane l takes heads l, l + 32, ... and
// dots the key row, staged in the warp's shared memory, with its heads' queries (rows Dh + 1 floats
// apart, so the lanes' reads fall in 32 banks): one warp reduction per key, not one per head.
// bf (--numerics deepseek, the reference's Indexer.forward): each dot rounded to bf16, and each
// relu(dot) * w rounded to bf16, w being the reference's bf16 head weights with both scales folded
// in (index_head_weight; the caller passes dscale = 1 and hscale = Dh^-0.5 * H^-0.5).
// Dynamic shared memory: H * (Dh + 1) + H + 8 * Dh floats.
#define IDX_KPW 4
__device__ __forceinline__ float key_score(const float* __restrict__ kn, const float* qs, const float* ws, float* kw,
                                           int H, int Dh, float dscale, bool bf) {
  const int lane = threadIdx.x & 31;
  for (int i = lane; i < Dh; i += 32) kw[i] = kn[i];
  __syncwarp();
  float acc = 0.f;
  for (int hh = lane; hh < H; hh += 32) {
    const float* qh = qs + hh * (Dh + 1);
    float d = 0.f;
#pragma unroll 8
    for (int i = 0; i < Dh; ++i) d += qh[i] * kw[i];
    acc += bf ? round_bf16f(fmaxf(round_bf16f(d), 0.f) * ws[hh]) : fmaxf(d, 0.f) * dscale * ws[hh];
  }
  __syncwarp();  // (kw is rewritten for the next key)
  return warp_sum(acc);
}

__device__ __forceinline__ void indexer_row(const float* __restrict__ q, const float* __restrict__ k,
                                            const float* __restrict__ w, float* __restrict__ out, int H, int N,
                                            int ldo, int Dh, float dscale, float hscale, bool bf) {
  extern __shared__ __align__(16) float qs[];
  const int qld = Dh + 1;
  float* ws = qs + H * qld;
  const int s = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < H * Dh; i += blockDim.x) qs[(i / Dh) * qld + i % Dh] = q[(size_t)s * H * Dh + i];
  for (int i = threadIdx.x; i < H; i += blockDim.x) ws[i] = index_head_weight(w[(size_t)s * H + i], hscale, bf);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < IDX_KPW; ++j) {
    const int n = blockIdx.x * 32 + warp * IDX_KPW + j;
    if (n >= ldo) break;
    float acc = __int_as_float(0xff800000);
    if (n < N) acc = key_score(k + (size_t)n * Dh, qs, ws, ws + H + warp * Dh, H, Dh, dscale, bf);
    if (lane == 0) out[(size_t)s * ldo + n] = bf ? round_bf16f(acc) : acc;
  }
}

extern "C" __global__ void __launch_bounds__(256) indexer_scores(const float* __restrict__ q,
                                                                const float* __restrict__ k,
                                                                const float* __restrict__ w,
                                                                float* __restrict__ out, int S, int H, int N,
                                                                int Dh, float dscale, float hscale, int bf) {
  indexer_row(q, k, w, out, H, N, N, Dh, dscale, hscale, bf != 0);
}

// Prefill: the same scores on tensor cores (mma.m16n8k16, bf16 in, f32 accumulate), for many
// queries against many keys (a prompt chunk against its compressed keys: 4096 x 16384 x 64 heads
// x 128 at a 64k context, 0.55 TFLOP). A block takes QB = 128 / H queries, i.e. 128 (query, head)
// rows, keeps them in shared memory and walks all N keys, 64 at a time (so the keys, a few MB,
// come from L2 and the queries are read once). 8 warps in 4 x 2 over the 128 x 64 tile, each
// 32 rows (one query's heads: H % 32 == 0) x 32 keys. Each operand is held as TERMS bf16 terms
// (bf16_term4): 3 carry an f32 exactly and the products t_i * t_j with i + j < 3 are summed (the
// rest lie below f32 rounding); 1 where the caller knows its values are bf16-exact (the FP4 / FP8
// state codecs: e2m1 or e4m3 times a power of two or an e4m3 scale), the same sums then, 6x fewer
// MMAs. Epilogue per key tile: relu * Dh^-0.5 * w * H^-0.5 per row, summed over the warp's rows by
// shuffles, then over the query's H / 32 warps in a fixed order. Another summation order than the
// CUDA-core kernels. Requires H % 32 == 0, 128 % H == 0, Dh % 16 == 0, Dh <= 128.
// grid (ceil(S / QB)), block 256; dynamic shared memory (128 + 64 * slots) * TERMS * (Dh + 8) * 2 + 1024
// bytes (slots: 2 for TERMS 1, else 1).
#define ITC_ROWS 128
#define ITC_KEYS 64
// TERMS 1 reads the keys as bf16 (kb [N, Dh], the f32 keys' high halves: they are bf16-exact there),
// a key tile at a time through a two-slot cp.async ring, so the next tile's loads are in flight
// while this one's MMAs run, and each tile is half the bytes from L2 (every block walks all N keys).
template <int TERMS>
__device__ __forceinline__ void indexer_tc_body(const float* __restrict__ q, const void* __restrict__ k,
                                                const float* __restrict__ w, float* __restrict__ out, int S, int H,
                                                int N, int Dh, float dscale, float hscale, bool bf) {
  constexpr int SLOTS = TERMS == 1 ? 2 : 1;
  extern __shared__ __align__(16) u16 itc[];
  const int ld = Dh + 8;  // bf16 per shared row: rows 16 B apart mod 128, conflict-free fragment loads
  u16* As = itc;                                      // [TERMS][128][ld] the block's (query, head) rows
  u16* Ks = As + TERMS * ITC_ROWS * ld;               // [SLOTS][TERMS][64][ld] key tiles
  float* red = (float*)(Ks + SLOTS * TERMS * ITC_KEYS * ld);  // [8 warps][32 keys] per-warp sums
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  const int qb = ITC_ROWS / H, s0 = blockIdx.x * qb, rows = min(qb, S - s0) * H, c4n = Dh / 4;
  const int ntiles = (N + ITC_KEYS - 1) / ITC_KEYS;
  // TERMS 1: key tile i -> slot i % 2
  auto load_bf16_tile = [&](int i) {
    cp_async_key_tile(smem_addr(Ks + (i & 1) * ITC_KEYS * ld), (const u16*)k, i * ITC_KEYS, ITC_KEYS, N, Dh, ld);
  };
  if (TERMS == 1 && ntiles > 0) load_bf16_tile(0);
  for (int idx = tid; idx < ITC_ROWS * c4n; idx += blockDim.x) {
    const int r = idx / c4n, c = 4 * (idx % c4n);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < rows) v = __ldg((const float4*)(q + ((size_t)s0 * H + r) * Dh + c));
    float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int term = 0; term < TERMS; ++term) *(uint2*)&As[(term * ITC_ROWS + r) * ld + c] = bf16_term4(e);
  }
  float wr[2][2];  // this thread's rows' head weights: row wm + 16 i + g + 8 h
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm + 16 * i + g + 8 * h;
      wr[i][h] = r < rows ? index_head_weight(w[(size_t)s0 * H + r], hscale, bf) : 0.f;
    }
  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * ITC_KEYS;
    const u16* kt = Ks;
    if (TERMS == 1) {
      cp_async_wait<0>();
      // tile it landed for every thread; every warp is past tile it - 1's MMAs (its slot is
      // refilled next) and the last tile's red reads (and, first, As is written)
      __syncthreads();
      if (it + 1 < ntiles) load_bf16_tile(it + 1);
      kt = Ks + (it & 1) * ITC_KEYS * ld;
    } else {
      __syncthreads();  // the last tile's Ks and red reads are done (and, first, As is written)
      const float* kf = (const float*)k;
      for (int idx = tid; idx < ITC_KEYS * c4n; idx += blockDim.x) {
        const int r = idx / c4n, c = 4 * (idx % c4n);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (n0 + r < N) v = __ldg((const float4*)(kf + (size_t)(n0 + r) * Dh + c));
        float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int term = 0; term < TERMS; ++term) *(uint2*)&Ks[(term * ITC_KEYS + r) * ld + c] = bf16_term4(e);
      }
      __syncthreads();
    }
    float acc[2][4][4] = {};
    mma_warp_32x32<TERMS, TERMS>(acc, As, ITC_ROWS * ld, kt, ITC_KEYS * ld, ld, Dh, wm, wn);
    // acc[i][j][2 h + c]: row wm + 16 i + g + 8 h, key wn + 8 j + 2 t + c
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float p = 0.f;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float d = acc[i][j][2 * h + c];
            p += bf ? round_bf16f(fmaxf(round_bf16f(d), 0.f) * wr[i][h]) : fmaxf(d, 0.f) * dscale * wr[i][h];
          }
        p += __shfl_xor_sync(0xffffffffu, p, 4);
        p += __shfl_xor_sync(0xffffffffu, p, 8);
        p += __shfl_xor_sync(0xffffffffu, p, 16);
        if (g == 0) red[warp * 32 + 8 * j + 2 * t + c] = p;
      }
    __syncthreads();
    const int wpq = H / 32;  // warps (row groups of 32) per query
    for (int idx = tid; idx < qb * ITC_KEYS; idx += blockDim.x) {
      const int qi = idx / ITC_KEYS, kk = idx % ITC_KEYS, n = n0 + kk;
      if (s0 + qi < S && n < N) {
        float sum = 0.f;
        for (int rg = qi * wpq; rg < (qi + 1) * wpq; ++rg) sum += red[(2 * rg + kk / 32) * 32 + kk % 32];
        out[(size_t)(s0 + qi) * N + n] = bf ? round_bf16f(sum) : sum;
      }
    }
  }
}

#define DEF_INDEXER_TC(TERMS)                                                                             \
  extern "C" __global__ void __launch_bounds__(256)                                                       \
      indexer_scores_tc##TERMS(const float* __restrict__ q, const void* __restrict__ k,                 \
                               const float* __restrict__ w, float* __restrict__ out, int S, int H, int N, \
                               int Dh, float dscale, float hscale, int bf) { \
    indexer_tc_body<TERMS>(q, k, w, out, S, H, N, Dh, dscale, hscale, bf != 0);                          \
  }
DEF_INDEXER_TC(1)
DEF_INDEXER_TC(3)

// Decode: query row s against its own keys, kspan[2 s] = pointer, kspan[2 s + 1] = count; out
// [S, ldo], -inf past each row's count. grid (ceil(ldo / 32), S).
extern "C" __global__ void __launch_bounds__(256) indexer_scores_spans(const float* __restrict__ q,
                                                                      const long long* __restrict__ kspan,
                                                                      const float* __restrict__ w,
                                                                      float* __restrict__ out, int H, int ldo,
                                                                      int Dh, float dscale, float hscale, int bf) {
  const long long* e = kspan + 2 * blockIdx.y;
  indexer_row(q, (const float*)e[0], w, out, H, (int)e[1], ldo, Dh, dscale, hscale, bf != 0);
}

// The indexer's prefill scores under --numerics deepseek (Indexer.forward's bf16 rounding points),
// on tensor cores: out[s, n] = bf16(sum_h bf16(relu(bf16(q[s, h] . k[n])) * w[s, h])), q and k on
// bf16's grid (the FP4-quantized values), w the head weights as index_head_weight forms them.
//
// Why its own kernel: at Dh = 128 a score's MMA work is small beside its epilogue (two roundings,
// relu, the weight, the sum over heads), which on CUDA cores costs several times the MMA's issue
// slots. Here the keys are the MMA's M side and the (query, head) rows its N side, so a warp's
// accumulator holds, per key, its heads' dots in exactly the layout of the next MMA's A operand:
// the epilogue packs them to bf16 pairs (cvt, max, mul on bf16x2: the reference's roundings, each
// exact product rounded once) and a second MMA against ones sums them over the heads in f32.
//
// Block: 128 (query, head) rows (128 / H queries), 8 warps in 4 row groups of 32 heads x 2 halves
// of a 128-key tile (each warp 64 keys x 32 heads). Keys stream through a two-slot cp.async ring,
// the next tile's loads in flight while this one's MMAs run. A query's sum over more than 32 heads
// adds its row groups' partial sums through shared memory in a fixed order.
// Requires H % 32 == 0, 128 % H == 0, Dh % 16 == 0, Dh <= 128. grid (ceil(S / (128 / H))), block 256,
// dynamic shared memory IXB_SMEM(Dh) bytes.

#define IXB_ROWS 128
#define IXB_KEYS 128
// bf16 per shared row: Dh + 8 (rows 16 B apart mod 128: conflict-free ldmatrix)
#define IXB_SMEM(dh) ((IXB_ROWS + 2 * IXB_KEYS) * ((dh) + 8) * 2 + 8 * 64 * 4)

__device__ __forceinline__ u32 bf16x2_relu_times(float lo, float hi, u32 w) {
  u32 d = pack_bf16x2(lo, hi);
  asm("max.bf16x2 %0, %0, %1;" : "+r"(d) : "r"(0u));
  asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(d) : "r"(w));
  return d;
}

extern "C" __global__ void __launch_bounds__(256, 2)
    indexer_scores_bf(const float* __restrict__ q, const u16* __restrict__ kb, const float* __restrict__ w,
                      float* __restrict__ out, int S, int H, int N, int Dh, float hscale) {
  extern __shared__ __align__(16) u16 ixb[];
  const int ld = Dh + 8;
  u16* Qs = ixb;                              // [128][ld] the block's (query, head) rows
  u16* Ks = Qs + IXB_ROWS * ld;               // [2][128][ld] key tiles
  float* red = (float*)(Ks + 2 * IXB_KEYS * ld);  // [8 warps][64 keys] sums over a row group's heads
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int rg = warp >> 1, kh = warp & 1;  // row group (32 heads), key half (64 keys)
  const int qb = IXB_ROWS / H, s0 = blockIdx.x * qb, rows = min(qb, S - s0) * H, c8n = Dh / 8;
  const int ntiles = (N + IXB_KEYS - 1) / IXB_KEYS;
  auto load_tile = [&](int i) {
    cp_async_key_tile(smem_addr(Ks + (i & 1) * IXB_KEYS * ld), kb, i * IXB_KEYS, IXB_KEYS, N, Dh, ld);
  };
  if (ntiles > 0) load_tile(0);
  // q's rows as bf16: the f32 values' high halves (exact: they are on bf16's grid)
  for (int idx = tid; idx < IXB_ROWS * c8n; idx += blockDim.x) {
    const int r = idx / c8n, c = 8 * (idx % c8n);
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows) {
      const uint4* p = (const uint4*)(q + ((size_t)s0 * H + r) * Dh + c);
      const uint4 a = __ldg(p), b = __ldg(p + 1);
      v = make_uint4(__byte_perm(a.x, a.y, 0x7632), __byte_perm(a.z, a.w, 0x7632),
                     __byte_perm(b.x, b.y, 0x7632), __byte_perm(b.z, b.w, 0x7632));
    }
    *(uint4*)&Qs[r * ld + c] = v;
  }
  // this lane's head weights, bf16 pairs: rows 32 rg + 8 j + 2 t (low half) and + 1
  u32 wp[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = 32 * rg + 8 * j + 2 * t;
    const float w0 = r < rows ? index_head_weight(w[(size_t)s0 * H + r], hscale, true) : 0.f;
    const float w1 = r + 1 < rows ? index_head_weight(w[(size_t)s0 * H + r + 1], hscale, true) : 0.f;
    wp[j] = pack_bf16x2(w0, w1);
  }
  const u32 ones = 0x3F803F80u;  // bf16 (1, 1): the second MMA's B, every column
  const int query = s0 + (32 * rg) / H;
  const bool whole = H == 32;  // one row group per query: its sums are the scores
  // ldmatrix lane addresses: A (keys) rows kh 64 + 16 i + (lane & 15), column 8 (lane >> 4);
  // B (rows) rows 32 rg + 16 jj + (lane & 7) + 8 (lane >> 4), column 8 ((lane >> 3) & 1)
  const u32 a_lane = 2 * ((64 * kh + (lane & 15)) * ld + 8 * (lane >> 4));
  const u32 b_base = smem_addr(Qs) + 2 * ((32 * rg + (lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1));
  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * IXB_KEYS;
    cp_async_wait<0>();
    // tile it landed for every thread; every warp is past tile it - 1's MMAs (its slot is refilled
    // next) and the last tile's red reads (and, first, Qs is written)
    __syncthreads();
    if (it + 1 < ntiles) load_tile(it + 1);
    const u32 a_base = smem_addr(Ks + (it & 1) * IXB_KEYS * ld) + a_lane;
    float acc[4][4][4] = {};  // [key m16 tile][row n8 tile][C fragment]
#pragma unroll 2
    for (int ks = 0; ks < Dh; ks += 16) {
      u32 a[4][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) ldsm_x4(a_base + 2 * (16 * i * ld + ks), a[i]);
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        u32 r[4];
        ldsm_x4(b_base + 2 * (16 * jj * ld + ks), r);
        b[2 * jj][0] = r[0]; b[2 * jj][1] = r[1]; b[2 * jj + 1][0] = r[2]; b[2 * jj + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], a[i], b[j]);
    }
    // acc[i][j][2 h + c]: key 16 i + g + 8 h, row 8 j + 2 t + c: the A fragment of keys x rows
    float sum[4][4] = {};  // sum[i][2 h + c]: key 16 i + g + 8 h (every column c the same)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const u32 a2[4] = {bf16x2_relu_times(acc[i][2 * kk][0], acc[i][2 * kk][1], wp[2 * kk]),
                           bf16x2_relu_times(acc[i][2 * kk][2], acc[i][2 * kk][3], wp[2 * kk]),
                           bf16x2_relu_times(acc[i][2 * kk + 1][0], acc[i][2 * kk + 1][1], wp[2 * kk + 1]),
                           bf16x2_relu_times(acc[i][2 * kk + 1][2], acc[i][2 * kk + 1][3], wp[2 * kk + 1])};
        const u32 b2[2] = {ones, ones};
        mma_bf16(sum[i], a2, b2);
      }
    // lane (g, t) takes keys 16 t + g and + 8 of its warp's 64
    float v0 = sum[0][0], v1 = sum[0][2];
#pragma unroll
    for (int i = 1; i < 4; ++i)
      if (t == i) v0 = sum[i][0], v1 = sum[i][2];
    const int k0 = 64 * kh + 16 * t + g;
    if (whole) {
      if (query < S) {
        float* o = out + (size_t)query * N + n0;
        if (n0 + k0 < N) o[k0] = round_bf16f(v0);
        if (n0 + k0 + 8 < N) o[k0 + 8] = round_bf16f(v1);
      }
      continue;
    }
    red[warp * 64 + 16 * t + g] = v0;
    red[warp * 64 + 16 * t + g + 8] = v1;
    __syncthreads();
    const int wpq = H / 32;  // row groups per query, added in order
    for (int idx = tid; idx < qb * IXB_KEYS; idx += blockDim.x) {
      const int qi = idx / IXB_KEYS, kk = idx % IXB_KEYS, n = n0 + kk;
      if (s0 + qi < S && n < N) {
        float s = 0.f;
        for (int r = qi * wpq; r < (qi + 1) * wpq; ++r) s += red[(2 * r + kk / 64) * 64 + kk % 64];
        out[(size_t)(s0 + qi) * N + n] = round_bf16f(s);
      }
    }
  }
}
