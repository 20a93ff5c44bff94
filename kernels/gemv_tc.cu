// Tensor-core GEMV for decode: y[m, n] = sum_k x[m, k] * W[n, k] for up to 32 rows of x per
// segment, FP8 (e4m3, f32 scale per bn x bk block) and FP4 (e2m1, UE8M0 per 1 x 32) weights.
// (At the end: gemm_tc, the same arithmetic at GEMM tiles for prompt chunks.)
// (The one-row GEMV, gemvr_*, is kernels/gemv_reg.cu; both split x with tc_fragments.cuh's
// split_group4.)
// Same segment table as kernels/linear.cu (weight index, x row0, rows, x col, y col).
//
// Why tensor cores for a memory-bound product: on CUDA cores, dequantizing and multiplying each
// weight costs 2.5 (FP8) to 4.5 (FP4) instructions, which caps the GEMV well below HBM speed and
// makes 8 rows cost 4-5x one row. Here the weights are the A operand of mma.m16n8k16 (f16 in,
// f32 accumulate), decoded exactly into f16: e4m3 by one cvt per two weights, e2m1 by placing its
// bits (value * 2^-14). The rows of x are the 8 columns of B, so 1 to 8 rows cost the same and
// 32 rows 4 MMAs per weight fragment. The block / group scale multiplies the f32 partial sums.
//
// x is prepared by tc_split_x: each group of 128 elements of a row is scaled by a power of two
// (its max -> below 2^14, the inverse kept in XINV [rows, ceil(lda / 128)]) and split into hi + lo
// f16 terms (22 mantissa bits), so the products are float32-grade (V4.1's FP8/FP4 state rounding
// would amplify bf16-grade activation error into different logits).
// Layouts, 16 bytes per 4 elements of x, in the order the MMA fragments read them:
//   perm 0 (FP8): per 4 elements (hi01, hi23, lo01, lo23), hiAB = f16x2 of elements A, B;
//   perm 1 (FP4): per 8 elements (hi04, hi15, lo04, lo15), (hi26, hi37, lo26, lo37): the nibble
//   pair decode below yields weights (i, i+4) in one f16x2, and the dot product only needs A and
//   B to agree on the order of k.
//
// Each warp streams one 16-row tile of W (a 1/kw share of its K) through an S-deep cp.async ring
// in shared memory, a stage being 16 rows x 128 contiguous bytes of each row (chunks XOR-swizzled
// by row, so that ldmatrix reads are conflict-free); ldmatrix hands each lane the A words the MMA
// expects. A stage's block scales travel in the ring behind its weights (FP8: the tile's block
// row, when bn is a multiple of 16; FP4: 8 UE8M0 bytes per row, when gk is a multiple of 8): read
// on demand, each stage's first scale waited a full memory latency. The kw warps of a block that
// share a tile reduce through shared memory in a fixed order (deterministic: graphs replay
// bit-identically).
#include "dsuf_common.cuh"
#include "tc_ring.cuh"

// ---------------------------------------------------------------------------------------------
// x [rows, lda] f32 -> XS [rows, lda / 4] uint4 (layout `perm`, above) and XINV [rows, ngx],
// ngx = ceil(lda / 128). One warp per 128-element group: grid (ceil(ngx / 8), rows), block 256;
// lda % (perm ? 8 : 4) == 0. xq: x as a linear's input under --numerics deepseek (linear_in4).
// perm 2 (gemm_tc1: bf16 x, one term): XS [rows, lda / 8] uint4 of the hi terms alone, each
// 32-element block's 4-element chunks in the order (0, 4, 1, 5, 2, 6, 3, 7), so that lane t of an
// MMA reads its two k16 steps' words (elements 4t.., 16 + 4t..) as one 16-byte chunk; lda % 32 == 0.
extern "C" __global__ void __launch_bounds__(256) tc_split_x(const float* __restrict__ A, int lda,
                                                             uint4* __restrict__ XS, float* __restrict__ XINV,
                                                             int perm, int xq) {
  const int ngx = (lda + 127) / 128, gi = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (gi >= ngx) return;  // a whole warp
  const int e0 = gi * 128 + 4 * lane;
  const bool ok = e0 < lda;
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (ok) v = __ldg((const float4*)(A + (size_t)blockIdx.y * lda + e0));
  v = linear_in4(v, xq);
  u32 hi[4], lo[4];
  const float inv = split_group4(v, hi, lo);
  if (lane == 0) XINV[(size_t)blockIdx.y * ngx + gi] = inv;
  if (perm == 2) {  // chunk c of its block of 32 -> slot 2 (c % 4) + c / 4
    const int c = lane & 7, e = gi * 128 + 32 * (lane >> 3) + 4 * (2 * (c & 3) + (c >> 2));
    if (ok) ((uint2*)XS)[((size_t)blockIdx.y * lda + e) / 4] = make_uint2(hi[0] | (hi[1] << 16), hi[2] | (hi[3] << 16));
    return;
  }
  uint4 o;
  if (perm == 0) {
    o = make_uint4(hi[0] | (hi[1] << 16), hi[2] | (hi[3] << 16), lo[0] | (lo[1] << 16), lo[2] | (lo[3] << 16));
  } else {  // lanes 2j, 2j + 1 hold elements 0-3 and 4-7 of 8-element block j
    u32 ph[4], pl[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      ph[i] = __shfl_xor_sync(0xffffffffu, hi[i], 1);
      pl[i] = __shfl_xor_sync(0xffffffffu, lo[i], 1);
    }
    if ((lane & 1) == 0)  // (hi04, hi15, lo04, lo15)
      o = make_uint4(hi[0] | (ph[0] << 16), hi[1] | (ph[1] << 16), lo[0] | (pl[0] << 16), lo[1] | (pl[1] << 16));
    else  // (hi26, hi37, lo26, lo37)
      o = make_uint4(ph[2] | (hi[2] << 16), ph[3] | (hi[3] << 16), pl[2] | (lo[2] << 16), pl[3] | (lo[3] << 16));
  }
  if (ok) XS[((size_t)blockIdx.y * lda + e0) / 4] = o;
}

// ---------------------------------------------------------------------------------------------
// grid (ceil(ceil(N / 16) / (W / kw)), nseg), block 32 * W, dynamic shared memory W * S * TC_SLOT
// bytes. NT = 8-row tiles of x (rows per segment <= 8 * NT). Segment x columns (acol) are
// multiples of 128 (the split's groups).
//
// A stage is 128 bytes of each of the tile's 16 rows (FP8: 128 k, one group of x; FP4: 256 k,
// two), then its scales. x is read from global memory (L2: every warp on an SM reads other k) in
// units of HC chunks, each unit loaded while the previous one is multiplied: read at its point
// of use, every chunk waited a full L2 latency.
template <int FMT, int NT, int S, int W>
__device__ __forceinline__ void tcgemv_body(const uint4* __restrict__ XS, const float* __restrict__ XINV, int lda,
                                            float* __restrict__ Y, int ldy, int N, int K,
                                            const int* __restrict__ segs, const u64* __restrict__ wptrs,
                                            const u64* __restrict__ sptrs, int bn, int bk, int gk, int bf,
                                            int kw) {
  extern __shared__ __align__(16) u8 tc_smem[];
  constexpr bool F8 = FMT == FMT_FP8;
  constexpr int EPC = F8 ? 16 : 32;  // k elements per 16-byte chunk
  constexpr int KPS = 8 * EPC;       // k elements per stage
  constexpr int XU = F8 ? 1 : 2;                                      // x uint4 per lane, chunk and tile
  constexpr int HC = NT * XU >= 4 ? 1 : (NT * XU == 2 ? 2 : 4);      // chunks per x unit
  constexpr int NU = 8 / HC;                                          // x units per stage
  const int* sg = segs + 5 * blockIdx.y;
  const int widx = sg[0], row0 = sg[1], rows = sg[2], acol = sg[3], ycol = sg[4];
  if (rows <= 0) return;  // an unused segment slot: the whole block, before any barrier
  const u8* Wt = (const u8*)wptrs[widx];
  const void* Sc = (const void*)sptrs[widx];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int part = warp % kw;
  const int n0 = (blockIdx.x * (W / kw) + warp / kw) * 16;
  const int row_bytes = F8 ? K : K / 2;
  const int nstage = (K + KPS - 1) / KPS;
  const int my = n0 < N ? (nstage - part + kw - 1) / kw : 0;  // stages part, part + kw, ...
  const u32 ring = smem_addr(tc_smem + warp * (S * TC_SLOT));
  // scales through the ring (see above); otherwise each is read from global memory when needed
  const bool pre = F8 ? bn % 16 == 0 : ((gk & 7) == 0 && ((u64)Sc & 7) == 0);
  const int ng = min(n0 + g, N - 1), ng8 = min(n0 + g + 8, N - 1);  // this lane's two weight rows
  const int ngx = (lda + 127) / 128;
  // FP8 scale blocks: bk < 128 divides 128 (a power of two): a flush every bk / 16 chunks;
  // bk >= 128 is a multiple of 128: one per stage
  const int flm = F8 ? (bk < 128 ? bk / 16 - 1 : 7) : 0;  // flush after chunk c when (c & flm) == flm
  const int flsh = F8 && bk < 128 ? __ffs(bk) - 5 : 3;    // chunk -> its block within the stage
  const int nsc = F8 && bk < KPS ? KPS / bk : 1;           // FP8 scales per stage

  auto issue = [&](int j) {
    tc_issue<F8, S>(ring, j, my, part, kw, lane, n0, N, Wt, row_bytes, pre, Sc, bn, bk, gk, nsc);
  };

  // x: this lane feeds B column g of each 8-row tile, and scales C columns 2t, 2t + 1
  const uint4* xrow[NT];
  const float* xinv[NT][2];
  bool xok[NT], cok[NT][2];
#pragma unroll
  for (int q = 0; q < NT; ++q) {
    xok[q] = 8 * q + g < rows;
    xrow[q] = XS + ((size_t)(row0 + (xok[q] ? 8 * q + g : 0)) * lda + acol) / 4 + XU * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = 8 * q + 2 * t + h;
      cok[q][h] = m < rows;
      xinv[q][h] = XINV + (size_t)(row0 + (cok[q][h] ? m : 0)) * ngx + acol / 128;
    }
  }
  // two x units in registers: unit u of a stage lives in buffer u & 1
  uint4 xv[2][HC][NT][XU];
  auto load_x = [&](int b, int j, int u) {  // buffer b <- unit u of this warp's stage j
    const int kh = (part + j * kw) * KPS + u * HC * EPC;
    const bool live = j < my;
#pragma unroll
    for (int c = 0; c < HC; ++c) {
      const int kk = kh + c * EPC;
#pragma unroll
      for (int q = 0; q < NT; ++q)
#pragma unroll
        for (int e = 0; e < XU; ++e)
          xv[b][c][q][e] = live && xok[q] && kk < K ? __ldg(xrow[q] + kk / 4 + e) : make_uint4(0, 0, 0, 0);
    }
  };
  // the column scales of x's 128-k groups in a stage (FP8 one, FP4 two), read a stage ahead
  constexpr int GPS = KPS / 128;
  float xi[GPS][NT][2], xin[GPS][NT][2];
  auto load_xi = [&](int j) {  // xin <- stage j's
#pragma unroll
    for (int gi = 0; gi < GPS; ++gi) {
      const int kg = (part + j * kw) * KPS + 128 * gi;
#pragma unroll
      for (int q = 0; q < NT; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          xin[gi][q][h] = j < my && kg < K && cok[q][h] ? __ldg(xinv[q][h] + kg / 128) : 0.f;
    }
  };

  // Partial sums of the current scale group in MMA chains: FP8 two (lo and hi terms); FP4 two
  // sets of 2, alternating between consecutive 32-k groups, so that one group's flush (times
  // its scales) overlaps the next group's MMAs.
  constexpr int NC = F8 ? 2 : 4;
  float acc[NT][4], cc[NC][NT][4], pend[2][NT][4];
#pragma unroll
  for (int q = 0; q < NT; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[q][e] = pend[0][q][e] = pend[1][q][e] = 0.f;
#pragma unroll
      for (int c = 0; c < NC; ++c) cc[c][q][e] = 0.f;
    }
  const int srow_g = F8 ? (ng / bn) * gk : ng * gk;
  const int srow_g8 = F8 ? (ng8 / bn) * gk : ng8 * gk;

  // chains c0 .. c1 - 1 -> acc with factors f (row scale x column scale per C element); zeroed
  auto flush = [&](int c0, int c1, const float (*f)[4]) {
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c)
          if (c >= c0 && c < c1) {
            v += cc[c][q][e];
            cc[c][q][e] = 0.f;
          }
        acc[q][e] += v * f[q][e];
      }
  };
  auto factors = [&](float sa, float sb, const float (*xs)[2], float (*f)[4]) {
#pragma unroll
    for (int q = 0; q < NT; ++q) {
      f[q][0] = sa * xs[q][0]; f[q][1] = sa * xs[q][1];
      f[q][2] = sb * xs[q][0]; f[q][3] = sb * xs[q][1];
    }
  };

#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue(j);
  load_x(0, 0, 0);
  load_xi(0);
  for (int j = 0; j < my; ++j) {
    cp_async_wait<S - 2>();
    __syncwarp();
    issue(j + S - 1);  // into the slot consumed last iteration
#pragma unroll
    for (int gi = 0; gi < GPS; ++gi)
#pragma unroll
      for (int q = 0; q < NT; ++q) xi[gi][q][0] = xin[gi][q][0], xi[gi][q][1] = xin[gi][q][1];
    load_xi(j + 1);
    const u32 slot = ring + (j % S) * TC_SLOT;
    const u8* ssc = tc_smem + (warp * S + j % S) * TC_SLOT + TC_STAGEB;  // this stage's scales (pre)
    const int k0 = (part + j * kw) * KPS;
    u32 d[8][2];  // the stage's A words: chunk c, rows g / g + 8
    tc_load_stage(slot, lane, d);
    uint2 sga = make_uint2(0, 0), sgb = sga;  // FP4 (pre): the stage's UE8M0 bytes of rows g, g + 8
    if (!F8 && pre) {
      sga = *(const uint2*)(ssc + 8 * g);
      sgb = *(const uint2*)(ssc + 8 * (g + 8));
    }
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const int b = u & 1;
      if (u + 1 < NU) load_x(b ^ 1, j, u + 1);  // the next unit, while this one is multiplied
      else load_x(b ^ 1, j + 1, 0);
#pragma unroll
      for (int ci = 0; ci < HC; ++ci) {
        const int c = u * HC + ci, kk = k0 + EPC * c;
        if (F8) {
          const u32 a0 = e4m3x2_to_f16x2(d[c][0]), a2 = e4m3x2_to_f16x2(d[c][0] >> 16);
          const u32 a1 = e4m3x2_to_f16x2(d[c][1]), a3 = e4m3x2_to_f16x2(d[c][1] >> 16);
#pragma unroll
          for (int q = 0; q < NT; ++q) {
            const uint4 x = xv[b][ci][q][0];
            mma_f16(cc[0][q], a0, a1, a2, a3, x.z, x.w);  // lo and hi terms, own chains
            mma_f16(cc[1][q], a0, a1, a2, a3, x.x, x.y);
          }
          if ((c & flm) == flm) {  // the end of a scale block
            float f[NT][4];
            if (pre) {  // rows g and g + 8 share the tile's block row
              const float sv = ((const float*)ssc)[c >> flsh];
              factors(sv, sv, xi[0], f);
            } else {
              const int kf = kk - 16 * flm, bi = kf / bk;  // the block's first k
              const bool in = kf < K;
              factors(in ? __ldg((const float*)Sc + srow_g + bi) : 0.f,
                      in ? __ldg((const float*)Sc + srow_g8 + bi) : 0.f, xi[0], f);
            }
            flush(0, NC, f);
          }
        } else {  // FP4: 32 k per chunk, one UE8M0 group; set p = c & 1 holds chains 2p, 2p + 1
          const int p = c & 1;
          u32 pg[4], pg8[4];
          fp4_pairs(d[c][0], pg);
          fp4_pairs(d[c][1], pg8);
#pragma unroll
          for (int q = 0; q < NT; ++q) {
            const uint4 x = xv[b][ci][q][0], y = xv[b][ci][q][1];
            mma_f16(cc[2 * p][q], pg[0], pg8[0], pg[1], pg8[1], x.z, x.w);
            mma_f16(cc[2 * p + 1][q], pg[2], pg8[2], pg[3], pg8[3], y.z, y.w);
            mma_f16(cc[2 * p][q], pg[0], pg8[0], pg[1], pg8[1], x.x, x.y);
            mma_f16(cc[2 * p + 1][q], pg[2], pg8[2], pg[3], pg8[3], y.x, y.y);
          }
          if (c > 0) flush(2 * (1 - p), 2 * (1 - p) + 2, pend[1 - p]);  // the previous group
          float sa, sb;
          if (pre) {
            sa = e8m0_scaled(((c < 4 ? sga.x : sga.y) >> (8 * (c & 3))) & 0xFFu, 14);
            sb = e8m0_scaled(((c < 4 ? sgb.x : sgb.y) >> (8 * (c & 3))) & 0xFFu, 14);
          } else {
            const bool in = kk < K;
            sa = in ? e8m0_scaled(__ldg((const u8*)Sc + srow_g + kk / 32), 14) : 0.f;
            sb = in ? e8m0_scaled(__ldg((const u8*)Sc + srow_g8 + kk / 32), 14) : 0.f;
          }
          factors(sa, sb, xi[c / 4], pend[p]);
        }
      }
    }
    if (!F8) flush(2, 4, pend[1]);  // the stage's last group (an odd chunk: set 1)
  }
  cp_async_wait<0>();
  tc_reduce_store<NT>(acc, tc_smem, warp, lane, part, kw, n0, N, rows, Y, ldy, row0, ycol, bf);
}

// bf (--numerics deepseek): the outputs rounded to bf16, as the reference's linear() returns them
#define TC_ARGS const uint4 *XS, const float *XINV, int lda, float *Y, int ldy, int N, int K, const int *segs, \
                const u64 *wptrs, const u64 *sptrs, int bn, int bk, int gk, int bf, int kw
#define TC_PASS XS, XINV, lda, Y, ldy, N, K, segs, wptrs, sptrs, bn, bk, gk, bf, kw
// NAME: tcgemv_<fmt>_n<NT>[_s<S>w<W>]; the unsuffixed names are the configuration the engine uses.
#define DEF_TC_CFG(NAME, FMT, NT, S, W)                                               \
  extern "C" __global__ void __launch_bounds__(32 * W, NT <= 2 ? 2 : 1) NAME(TC_ARGS) { \
    tcgemv_body<FMT, NT, S, W>(TC_PASS);                                             \
  }
#define TC_S 4
#define TC_W 8
#define DEF_TC(TAG, FMT, NT) DEF_TC_CFG(tcgemv_##TAG##_n##NT, FMT, NT, TC_S, TC_W)
DEF_TC(fp8, FMT_FP8, 1)
DEF_TC(fp8, FMT_FP8, 2)
DEF_TC(fp8, FMT_FP8, 4)
DEF_TC(fp4, FMT_FP4, 1)
DEF_TC(fp4, FMT_FP4, 2)
DEF_TC(fp4, FMT_FP4, 4)

// ---------------------------------------------------------------------------------------------
// Tensor-core GEMM for prompt chunks, FP8 / FP4 weights: the tensor-core GEMV's arithmetic (weights
// decoded exactly into f16 as the A operand; x as tc_split_x's scaled hi + lo f16 terms, in its
// perm layout, as B; the weight scales and x's group inverses applied to the f32 partial sums of
// every 32 k) over tiles of GT_BN weight rows x GT_BM rows of x, both staged through a GT_S-deep
// cp.async ring in shared memory: each weight byte is decoded once per 64 rows of x and each x term
// read from memory once per 128 weight rows. The GEMM it replaces (kernels/linear.cu gemm) splits
// f32 x into three bf16 terms and dequantizes the weights element by element in every block, on
// CUDA cores; here a weight costs one cvt per two (FP8) and x two MMA terms, not three.
// 8 warps in 4 (weight rows) x 2 (x rows), each a 32 x 32 tile of 2 x 4 m16n8k16 MMAs.
// grid (ceil(N / GT_BN), nseg), block 256, dynamic shared memory GT_SMEM. Segments: <= GT_BM rows,
// x columns (acol) multiples of 128 (the split's groups). FP8: K % 16 == 0, bk % 32 == 0 (one scale
// per 32 k); FP4: K % 32 == 0.
//
// A stage: x (64 rows), weights (128 rows), x's group inverse per row (a 64-k stage lies inside
// one 128-element group), then 8 bytes of weight scales per row (FP8: the two 32-k groups' floats;
// FP4: the aligned 8-byte window holding the row's two UE8M0 bytes), all through the ring, so the
// promotions read shared memory instead of waiting on global loads. Rows are padded so that the
// fragment reads are conflict-free: a weight row is 64 (FP8) or 32 (FP4) bytes + 16; an x row 64
// elements x 2 terms = 256 bytes + 64 (FP8, lanes read 16-byte chunk t) or + 16 (FP4, chunks 2t and
// 2t + 1).
//
// gemm_tc1_fp8 (TERMS 1): x as one f16 term (tc_split_x perm 2), for bf16 x under --numerics
// deepseek (the bf16-use weights stored in FP8: wo_a, the indexer's wk). A bf16 value scaled into
// its group's [2^13, 2^14) range is an f16 exactly unless it lies below 2^-30 of the group's max
// (f16 subnormals), where its rounding moves the sum by less than the f32 accumulation's own
// rounding: the lo term is zero or negligible, so half the MMAs and half the x bytes, float32-grade
// still. An x row is 64 elements x 2 bytes = 128 + 64 (lanes read 16-byte chunk t: rows g, g + 1
// fill the 32 banks). The smaller stage leaves room for GT1_S stages in the same shared memory.
#define GT_BN 128
#define GT_BM 64
#define GT_BK 64
#define GT_S 3
#define GT1_S 4
#define GT_SMEM (GT_S * (GT_BM * 320 + GT_BN * 80 + GT_BM * 4 + GT_BN * 8))
template <int FMT, int TERMS>
__device__ __forceinline__ void gemm_tc_body(const uint4* __restrict__ XS, const float* __restrict__ XINV, int lda,
                                             float* __restrict__ Y, int ldy, int N, int K,
                                             const int* __restrict__ segs, const u64* __restrict__ wptrs,
                                             const u64* __restrict__ sptrs, int bn, int bk, int gk, int bf) {
  constexpr bool F8 = FMT == FMT_FP8, ONE = TERMS == 1;
  static_assert(F8 || !ONE, "gemm_tc1: FP8 weights");
  constexpr int S = ONE ? GT1_S : GT_S;
  constexpr int WB = F8 ? GT_BK : GT_BK / 2;  // weight bytes per row per stage
  constexpr int WROW = WB + 16, XROW = ONE ? 192 : F8 ? 320 : 272;
  constexpr int XE = ONE ? 8 : 4;  // x elements per 16-byte chunk
  constexpr int SCALES = GT_BN * WROW + GT_BM * 4;  // offset of the weight scales from the weights
  constexpr int STAGE = GT_BM * XROW + SCALES + GT_BN * 8;
  static_assert(S * STAGE <= GT_SMEM, "gemm_tc: shared memory");
  extern __shared__ __align__(16) u8 gts[];
  const int* sg = segs + 5 * blockIdx.y;
  const int widx = sg[0], row0 = sg[1], rows = sg[2], acol = sg[3], ycol = sg[4];
  if (rows <= 0) return;  // an unused segment slot: the whole block, before any barrier
  const u8* W = (const u8*)wptrs[widx];
  const void* Sc = (const void*)sptrs[widx];
  const int nb = blockIdx.x * GT_BN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = (warp & 3) * 32, wm = (warp >> 2) * 32;  // this warp's weight rows, x rows
  const size_t row_bytes = F8 ? (size_t)K : (size_t)K / 2;
  const int ngx = (lda + 127) / 128, nk = (K + GT_BK - 1) / GT_BK;
  const u32 base = smem_addr(gts);

  auto load = [&](int kt) {
    const int k0 = kt * GT_BK;
    const u32 xs = base + (kt % S) * STAGE, ws = xs + GT_BM * XROW;
    for (int i = tid; i < GT_BM * (GT_BK / XE); i += 256) {  // x: 4 elements (two terms) or 8 a chunk
      const int r = i / (GT_BK / XE), c = i % (GT_BK / XE), k = k0 + XE * c;
      const bool ok = r < rows && k < K;  // (ONE: K % 32 == 0, so a permuted block is whole or out)
      cp_async16(xs + r * XROW + c * 16, XS + (ok ? ((size_t)(row0 + r) * lda + acol + k) / XE : 0), ok ? 16 : 0);
    }
    constexpr int CPR = WB / 16;
    for (int i = tid; i < GT_BN * CPR; i += 256) {  // weights: 16 (FP8) or 32 (FP4) k a chunk
      const int r = i / CPR, c = i % CPR, n = nb + r;
      const size_t off = (F8 ? (size_t)k0 : (size_t)k0 / 2) + (size_t)c * 16;
      const bool ok = n < N && off < row_bytes;
      cp_async16(ws + r * WROW + c * 16, W + (ok ? (size_t)n * row_bytes + off : 0), ok ? 16 : 0);
    }
    if (tid < GT_BM) {
      const bool ok = tid < rows;
      cp_async4(ws + GT_BN * WROW + 4 * tid, XINV + (ok ? (size_t)(row0 + tid) * ngx + (acol + k0) / 128 : 0),
                ok ? 4 : 0);
    }
    {  // thread -> row tid / 2, half q: FP8 the scale of k group q, FP4 word q of the window
      const int r = tid >> 1, q = tid & 1, n = nb + r;
      const u32 dst = ws + SCALES + 8 * r + 4 * q;
      if (F8) {
        const int k = k0 + 32 * q;
        const bool ok = n < N && k < K;
        cp_async4(dst, (const float*)Sc + (ok ? (size_t)(n / bn) * gk + k / bk : 0), ok ? 4 : 0);
      } else {  // (bounded by the table's end: N rows of gk bytes)
        const size_t end = (size_t)Sc + (size_t)N * gk;
        const size_t w0 = (((size_t)Sc + (size_t)(n < N ? n : 0) * gk + k0 / 32) & ~(size_t)3) + 4 * q;
        const int bytes = n < N && w0 < end ? (int)min((size_t)4, end - w0) : 0;
        cp_async4(dst, bytes ? (const void*)w0 : Sc, bytes);
      }
    }
  };

  float acc[2][4][4] = {};
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < nk) load(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<S - 2>();
    __syncthreads();  // stage kt visible to all; every warp is past stage kt - 1, whose slot is refilled
    if (kt + S - 1 < nk) load(kt + S - 1);
    cp_async_commit();
    const u8* xs = gts + (kt % S) * STAGE;
    const u8* ws = xs + GT_BM * XROW;
    float xi[4][2];  // x's group inverses of this lane's columns
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) xi[j][e] = ((const float*)(ws + GT_BN * WROW))[wm + 8 * j + 2 * t + e];
#pragma unroll
    for (int h = 0; h < GT_BK / 32; ++h) {  // one scale group of 32 k
      const int k32 = kt * GT_BK + 32 * h;
      if (k32 >= K) break;
      float part[2][4][4] = {};
      uint4 b1[4];  // ONE: lane t's x words of both k16 steps, (hi01, hi23) of elements 4t.., then 16 + 4t..
      if (ONE)
#pragma unroll
        for (int j = 0; j < 4; ++j) b1[j] = *(const uint4*)(xs + (wm + 8 * j + g) * XROW + 64 * h + 16 * t);
#pragma unroll
      for (int s16 = 0; s16 < 2; ++s16) {
        u32 a[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const u8* r0 = ws + (wn + 16 * i + g) * WROW;
          if (F8) {  // lane t: k 4t..4t+3 of the 16, as (a0, a2) = (k 4t, 4t+1), (4t+2, 4t+3)
            const u32 w0 = *(const u32*)(r0 + 32 * h + 16 * s16 + 4 * t);
            const u32 w1 = *(const u32*)(r0 + 8 * WROW + 32 * h + 16 * s16 + 4 * t);
            a[i][0] = e4m3x2_to_f16x2(w0); a[i][2] = e4m3x2_to_f16x2(w0 >> 16);
            a[i][1] = e4m3x2_to_f16x2(w1); a[i][3] = e4m3x2_to_f16x2(w1 >> 16);
          } else {  // lane t: k 8t..8t+7 of the 32; step 0 takes pairs (0,4), (1,5), step 1 (2,6), (3,7)
            u32 p0[4], p1[4];
            fp4_pairs(*(const u32*)(r0 + 16 * h + 4 * t), p0);
            fp4_pairs(*(const u32*)(r0 + 8 * WROW + 16 * h + 4 * t), p1);
            a[i][0] = p0[2 * s16]; a[i][2] = p0[2 * s16 + 1];
            a[i][1] = p1[2 * s16]; a[i][3] = p1[2 * s16 + 1];
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // x's 16-byte chunk of 4 elements, (hi, hi, lo, lo) in the order a's k pairs take them:
          // FP8 elements 32h + 16 s16 + 4t.., FP4 the half s16 of elements 32h + 8t..; ONE: the hi
          // words of FP8's elements from b1
          uint4 b;
          if (ONE)
            b = s16 ? make_uint4(b1[j].z, b1[j].w, 0u, 0u) : make_uint4(b1[j].x, b1[j].y, 0u, 0u);
          else
            b = *(const uint4*)(xs + (wm + 8 * j + g) * XROW + 16 * (F8 ? 8 * h + 4 * s16 + t : 8 * h + 2 * t + s16));
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            if (!ONE) mma_f16(part[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b.z, b.w);  // lo term first
            mma_f16(part[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b.x, b.y);
          }
        }
      }
      // promote: the weight scales of this lane's rows, times x's group inverses of its columns
      float sw[2][2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = wn + 16 * i + g + 8 * e;
          const u8* sr = ws + SCALES + 8 * r;
          if (F8) {
            sw[i][e] = ((const float*)sr)[h];
          } else {  // the row's byte sits at its address' offset in the aligned window
            const int o = (int)(((size_t)Sc + (size_t)(nb + r) * gk + kt * GT_BK / 32) & 3);
            sw[i][e] = e8m0_scaled(sr[o + h], 14);
          }
        }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] = fmaf(part[i][j][e], sw[i][e >> 1] * xi[j][e & 1], acc[i][j][e]);
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = nb + wn + 16 * i + g + 8 * (e >> 1), r = wm + 8 * j + 2 * t + (e & 1);
        if (r < rows && n < N) Y[(size_t)(row0 + r) * ldy + ycol + n] = bf ? round_bf16f(acc[i][j][e]) : acc[i][j][e];
      }
}

#define GT_ARGS                                                                                           \
  const uint4 *__restrict__ XS, const float *__restrict__ XINV, int lda, float *__restrict__ Y, int ldy, int N, \
      int K, const int *__restrict__ segs, const u64 *__restrict__ wptrs, const u64 *__restrict__ sptrs, int bn,  \
      int bk, int gk, int bf
#define GT_PASS XS, XINV, lda, Y, ldy, N, K, segs, wptrs, sptrs, bn, bk, gk, bf
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tc_fp8(GT_ARGS) { gemm_tc_body<FMT_FP8, 2>(GT_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tc_fp4(GT_ARGS) { gemm_tc_body<FMT_FP4, 2>(GT_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) gemm_tc1_fp8(GT_ARGS) { gemm_tc_body<FMT_FP8, 1>(GT_PASS); }
