// Tensor-core GEMV for decode and verify steps under --numerics deepseek: y[m, n] = sum_k x[m, k] *
// W[n, k] for up to 32 rows of x per segment, x on DeepSeek's activation grid (the reference's
// act_quant: e4m3 codes with a power-of-two scale per 32 along K), W FP8 (e4m3, f32 scale per bn x
// bk block) or FP4 (e2m1, UE8M0 per 1 x 32). Same segment table as kernels/linear.cu (weight index,
// x row0, rows, x col, y col) and the same weight ring as the exact GEMV (kernels/tc_ring.cuh).
//
// Each 32-k group of 16 weight rows against 8 rows of x is two f16 m16n8k16 MMAs with a fresh f32
// accumulator; its sums are scaled by the row's weight scale times the x row's scale and added to
// the f32 total, as DeepSeek's own FP8 GEMM promotes its tensor-core sums. e4m3 and e2m1 values
// are exact in f16, so the products are the e4m3 MMA's. Why f16 MMAs rather than the e4m3
// mma.sync: Hopper has none; ptxas converts both operands (A and B, every tile) to f16 and pads
// the sums with adds of a zero accumulator. Here x is converted once, by gemv_q8_x, and only the
// weights are converted in the loop.
//
// tcgemv8_bf16_* (below) is the same GEMV for bf16 weights, which take bf16 x: one bf16 MMA per 16
// k on the ring's words as ldmatrix gives them, accumulated in place.
//
// x as the lanes read it (gemv_q8_x): per row, act_quant's codes with each block of 32 reordered so
// that lane t's eight bytes (one 8-byte load) sit at 8t, in the order its two MMAs take them, and
// padded with zeros (codes and scales) past the row, so that no load needs a bound. A and B only
// need to agree on the order of k within an MMA:
//  * FP8: MMA h of group c takes ring chunk 2c + h (16 k); lane t's A word is k 4t .. 4t + 3 of
//    it, as f16 pairs (4t, 4t + 1) and (4t + 2, 4t + 3); x bytes 8t + 4h .. are x[16h + 4t ..].
//  * FP4: group c is ring chunk c (32 k); lane t's word holds nibbles 8t .. 8t + 7, split into even
//    and odd e4m3 bytes (fp4_e4m3_split: e2m1's 3 magnitude bits placed on e4m3's exponent and
//    mantissa bits, value * 2^-6, sign to bit 7). MMA 0 takes k (8t, 8t + 2) and (8t + 1, 8t + 3),
//    MMA 1 the same + 4; x bytes 8t .. 8t + 7 are x[8t + 0, 2, 1, 3, 4, 6, 5, 7].
#include "tc_ring.cuh"

// x [M, ldx] f32 -> the lanes' codes [M, L] u8 and scales [M, L / 32] f32 (L >= K + the stage, a
// multiple of 32; zeros past K): act_quant_fp8's arithmetic (x rounded to bf16 first when bf), each
// block's bytes in the order above (fp4: the FP4 kernels' order, else the FP8 kernels'). grid
// (ceil(M * L / 4 / 256)), block 256: 8 lanes per block of 32, 4 elements each.
extern "C" __global__ void gemv_q8_x(const float* __restrict__ x, int ldx, int M, int K, u8* __restrict__ codes,
                                     float* __restrict__ scales, int L, int fp4, int bf) {
  const int q4 = L / 4;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = i < (long long)M * q4;  // (dead lanes still join their warp's shuffles)
  const int m = live ? (int)(i / q4) : 0, c = live ? (int)(i % q4) : 0;
  const float4 v = live && 4 * c < K ? __ldg((const float4*)(x + (size_t)m * ldx) + c) : make_float4(0.f, 0.f, 0.f, 0.f);
  float s;
  u32 word = act_quant4(v, bf, s);  // (a block past the row: zero codes, and its scale 0 below)
  if (32 * (c / 8) >= K) s = 0.f;
  // quad cq of its block (elements 4cq .. 4cq + 3): FP8 lane (cq & 3)'s bytes 4 (cq >> 2) ..; FP4
  // lane cq >> 1's half cq & 1, its middle bytes swapped
  const int cq = c & 7;
  const int at = fp4 ? 4 * cq : 8 * (cq & 3) + 4 * (cq >> 2);
  if (fp4) word = __byte_perm(word, 0, 0x3120);
  if (live) {
    *(u32*)(codes + (size_t)m * L + 32 * (c / 8) + at) = word;
    if (cq == 0) scales[(size_t)m * (L / 32) + c / 8] = s;
  }
}

// Two f16 m16n8k16 MMAs of one 32-k group, a fresh f32 sum: a the four A words of each (f16 pairs:
// rows g, g + 8 at k slots 2t, then rows g, g + 8 at 2t + 8), x the lane's 8 bytes of x (e4m3).
__device__ __forceinline__ void mma_group(float* c, const u32 (&a)[2][4], uint2 x) {
  c[0] = c[1] = c[2] = c[3] = 0.f;
  mma_f16(c, a[0][0], a[0][1], a[0][2], a[0][3], e4m3x2_to_f16x2(x.x), e4m3x2_hi_to_f16x2(x.x));
  mma_f16(c, a[1][0], a[1][1], a[1][2], a[1][3], e4m3x2_to_f16x2(x.y), e4m3x2_hi_to_f16x2(x.y));
}

// Eight e2m1 nibbles (element i in bits 4i..4i+3) -> e4m3 bytes of value * 2^-6: ev = elements
// (0, 2, 4, 6), od = (1, 3, 5, 7), element 2i / 2i + 1 in byte i. Exact, e2m1's subnormal 0.5
// becoming an e4m3 subnormal.
__device__ __forceinline__ void fp4_e4m3_split(u32 w, u32& ev, u32& od) {
  ev = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
  od = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

// UE8M0 byte i of word w as a float, 2^(byte - 127), in two instructions (byte 0, 2^-127, reads as 0:
// no checkpoint scales its weights that far down).
__device__ __forceinline__ float ue8m0_byte(u32 w, int i) {
  const u32 b = i == 0 ? w << 23 : i == 1 ? w << 15 : i == 2 ? w << 7 : w >> 1;
  return __uint_as_float(b & 0x7F800000u);
}

// grid (ceil(ceil(N / 16) / (W / kw)), nseg), block 32 * W, dynamic shared memory W * S * TC_SLOT
// bytes. NT = 8-row tiles of x (rows per segment <= 8 * NT). XC, XSC: gemv_q8_x's codes [rows of
// x, L] and scales [rows of x, L / 32], L >= every segment's x column + K rounded up to the stage;
// K % 32 == 0, segment x columns multiples of 32; FP8 bk a multiple of 32 dividing 128 or a
// multiple of 128. PRE: the weight scales travel with the stage through the ring (tc_issue's pre).
//
// x is read from global memory (L1 / L2: every warp of a segment reads the same rows) in units of
// HM groups per 8-row tile, each unit loaded while the previous one is multiplied. A lane past the
// segment's rows reads its last row (no predicate; its sums are not stored).
template <int FMT, int NT, int S, int W, bool PRE>
__device__ __forceinline__ void tcgemv8_body(const u8* __restrict__ XC, const float* __restrict__ XSC, int L,
                                             float* __restrict__ Y, int ldy, int N, int K,
                                             const int* __restrict__ segs, const u64* __restrict__ wptrs,
                                             const u64* __restrict__ sptrs, int bn, int bk, int gk, int bf, int kw) {
  extern __shared__ __align__(16) u8 tc_smem[];
  constexpr bool F8 = FMT == FMT_FP8;
  constexpr int KPS = F8 ? 128 : 256;  // k per stage
  constexpr int MPS = KPS / 32;        // 32-k groups per stage
  // groups per x unit: 4 groups' operands of one tile, at most half a stage (the two buffers alternate)
  constexpr int HM = (NT >= 4 ? 1 : 4 / NT) > MPS / 2 ? MPS / 2 : (NT >= 4 ? 1 : 4 / NT);
  constexpr int NU = MPS / HM;  // x units per stage
  static_assert(NU % 2 == 0, "unit u of every stage must live in buffer u & 1");
  const int* sg = segs + 5 * blockIdx.y;
  const int widx = sg[0], row0 = sg[1], rows = sg[2], acol = sg[3], ycol = sg[4];
  const u8* Wt = (const u8*)wptrs[widx];
  const void* Sc = (const void*)sptrs[widx];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int part = warp % kw;
  const int n0 = (blockIdx.x * (W / kw) + warp / kw) * 16;
  const int row_bytes = F8 ? K : K / 2;
  const int nstage = (K + KPS - 1) / KPS;
  const int my = n0 < N ? (nstage - part + kw - 1) / kw : 0;  // stages part, part + kw, ...
  const u32 ring = smem_addr(tc_smem + warp * (S * TC_SLOT));
  const int ng = min(n0 + g, N - 1), ng8 = min(n0 + g + 8, N - 1);  // this lane's two weight rows
  const int nsc = F8 && bk < KPS ? KPS / bk : 1;                     // FP8 scales per stage (PRE)
  const int bsh = F8 && bk < KPS ? __ffs(bk) - 6 : 2;                // FP8: group i -> scale i >> bsh
  const int srow_g = F8 ? (ng / bn) * gk : ng * gk;
  const int srow_g8 = F8 ? (ng8 / bn) * gk : ng8 * gk;
  const int lxs = L / 32;

  // x: this lane feeds B column g of each 8-row tile (x row 8q + g), and scales C columns 2t, 2t + 1
  const u8* xrow[NT];
  const float* xsr[NT][2];
#pragma unroll
  for (int q = 0; q < NT; ++q) {
    xrow[q] = XC + (size_t)(row0 + min(8 * q + g, rows - 1)) * L + acol + 8 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) xsr[q][h] = XSC + (size_t)(row0 + min(8 * q + 2 * t + h, rows - 1)) * lxs + acol / 32;
  }
  // two x units in registers: unit u of a stage lives in buffer u & 1 (the B bytes, the scales)
  uint2 xv[2][HM][NT];
  float xs[2][HM][NT][2];
  auto load_x = [&](int b, int j, int u) {  // buffer b <- unit u of this warp's stage j (stage 0 past the last)
    const int kh = j < my ? (part + j * kw) * KPS + u * HM * 32 : 0;
#pragma unroll
    for (int i = 0; i < HM; ++i) {
#pragma unroll
      for (int q = 0; q < NT; ++q) {
        xv[b][i][q] = __ldg((const uint2*)(xrow[q] + kh + 32 * i));
#pragma unroll
        for (int h = 0; h < 2; ++h) xs[b][i][q][h] = __ldg(xsr[q][h] + kh / 32 + i);
      }
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int q = 0; q < NT; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[q][e] = 0.f;

#pragma unroll
  for (int j = 0; j < S - 1; ++j)
    tc_issue<F8, S>(ring, j, my, part, kw, lane, n0, N, Wt, row_bytes, PRE, Sc, bn, bk, gk, nsc);
  load_x(0, 0, 0);
  for (int j = 0; j < my; ++j) {
    cp_async_wait<S - 2>();
    __syncwarp();
    tc_issue<F8, S>(ring, j + S - 1, my, part, kw, lane, n0, N, Wt, row_bytes, PRE, Sc, bn, bk, gk, nsc);
    const u32 slot = ring + (j % S) * TC_SLOT;
    const u8* ssc = tc_smem + (warp * S + j % S) * TC_SLOT + TC_STAGEB;  // this stage's scales (PRE)
    const int k0 = (part + j * kw) * KPS;
    u32 d[8][2];  // the stage's A words: chunk c, rows g / g + 8
    tc_load_stage(slot, lane, d);
    uint2 sga = make_uint2(0, 0), sgb = sga;  // FP4 (PRE): the stage's UE8M0 bytes of rows g, g + 8
    if (!F8 && PRE) {
      sga = *(const uint2*)(ssc + 8 * g);
      sgb = *(const uint2*)(ssc + 8 * (g + 8));
    }
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const int b = u & 1;
      if (u + 1 < NU) load_x(b ^ 1, j, u + 1);  // the next unit, while this one is multiplied
      else load_x(b ^ 1, j + 1, 0);
#pragma unroll
      for (int i = 0; i < HM; ++i) {
        const int c = u * HM + i, kk = k0 + 32 * c;  // group c of the stage, its first k
        u32 a[2][4];  // the f16 A words of the group's two MMAs
        float sa, sb;  // the weight scales of rows g, g + 8 (FP4: the decoding's 2^-6 is undone at the end)
        if (F8) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const u32 w0 = d[2 * c + h][0], w1 = d[2 * c + h][1];
            a[h][0] = e4m3x2_to_f16x2(w0), a[h][1] = e4m3x2_to_f16x2(w1);
            a[h][2] = e4m3x2_hi_to_f16x2(w0), a[h][3] = e4m3x2_hi_to_f16x2(w1);
          }
          if (PRE) {
            sa = sb = ((const float*)ssc)[c >> bsh];
          } else {
            const bool in = kk < K;
            sa = in ? __ldg((const float*)Sc + srow_g + kk / bk) : 0.f;
            sb = in ? __ldg((const float*)Sc + srow_g8 + kk / bk) : 0.f;
          }
        } else {
          u32 ev0, od0, ev1, od1;
          fp4_e4m3_split(d[c][0], ev0, od0);
          fp4_e4m3_split(d[c][1], ev1, od1);
          a[0][0] = e4m3x2_to_f16x2(ev0), a[0][1] = e4m3x2_to_f16x2(ev1);
          a[0][2] = e4m3x2_to_f16x2(od0), a[0][3] = e4m3x2_to_f16x2(od1);
          a[1][0] = e4m3x2_hi_to_f16x2(ev0), a[1][1] = e4m3x2_hi_to_f16x2(ev1);
          a[1][2] = e4m3x2_hi_to_f16x2(od0), a[1][3] = e4m3x2_hi_to_f16x2(od1);
          if (PRE) {
            sa = ue8m0_byte(c < 4 ? sga.x : sga.y, c & 3);
            sb = ue8m0_byte(c < 4 ? sgb.x : sgb.y, c & 3);
          } else {
            const bool in = kk < K;
            sa = in ? ue8m0_byte(__ldg((const u8*)Sc + srow_g + kk / 32), 0) : 0.f;
            sb = in ? ue8m0_byte(__ldg((const u8*)Sc + srow_g8 + kk / 32), 0) : 0.f;
          }
        }
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          float cc[4];
          mma_group(cc, a, xv[b][i][q]);
          const float x0 = xs[b][i][q][0], x1 = xs[b][i][q][1];
          acc[q][0] += cc[0] * (sa * x0);
          acc[q][1] += cc[1] * (sa * x1);
          acc[q][2] += cc[2] * (sb * x0);
          acc[q][3] += cc[3] * (sb * x1);
        }
      }
    }
  }
  cp_async_wait<0>();
  if (!F8) {  // fp4_e4m3_split's values are value * 2^-6 (exact: a power of two)
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[q][e] *= 64.f;
  }
  tc_reduce_store<NT>(acc, tc_smem, warp, lane, part, kw, n0, N, rows, Y, ldy, row0, ycol, bf);
}

// x [M, ldx] f32 -> bf16 pairs [M, L / 2] u32 as tcgemvbf's lanes read them (L >= K + 64, a multiple of
// 16; zeros past K): x rounded to bf16, each block of 16 laid out so that lane t's MMA operand, the
// pairs at 2t and 2t + 8, is one 8-byte word at 8t. grid (ceil(M * L / 2 / 256)), block 256.
extern "C" __global__ void gemv_bf_x(const float* __restrict__ x, int ldx, int M, int K, u32* __restrict__ xb, int L) {
  const int pairs = L / 2;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)M * pairs) return;
  const int m = (int)(i / pairs), p = (int)(i % pairs), pb = p & 7;  // pair pb of its block of 16
  u32 v = 0;
  if (2 * p < K) {
    const float2 f = __ldg((const float2*)(x + (size_t)m * ldx) + p);
    v = (__float_as_uint(round_bf16f(f.x)) >> 16) | (__float_as_uint(round_bf16f(f.y)) & 0xFFFF0000u);
  }
  xb[(size_t)m * pairs + (p & ~7) + 2 * (pb & 3) + (pb >> 2)] = v;
}

// The bf16 GEMV of 2 to 32 rows (--numerics deepseek: a bf16 weight takes bf16 x, f32 sums): the
// ring streams 64 k of a 16-row tile per stage; each 16 k is one bf16 m16n8k16 MMA whose A words
// are ldmatrix's as they come (chunks 2i, 2i + 1), accumulated in place (no scales). XB: gemv_bf_x's
// pairs [rows of x, L / 2], segment x columns multiples of 16. Otherwise as tcgemv8_body.
template <int NT, int S, int W>
__device__ __forceinline__ void tcgemvbf_body(const u32* __restrict__ XB, int L, float* __restrict__ Y, int ldy, int N,
                                              int K, const int* __restrict__ segs, const u64* __restrict__ wptrs,
                                              int bf, int kw) {
  extern __shared__ __align__(16) u8 tc_smem[];
  constexpr int KPS = 64;      // k per stage (128 bytes of a row)
  constexpr int HM = 2;        // MMAs per x unit
  constexpr int NU = 4 / HM;   // x units per stage
  const int* sg = segs + 5 * blockIdx.y;
  const int widx = sg[0], row0 = sg[1], rows = sg[2], acol = sg[3], ycol = sg[4];
  const u8* Wt = (const u8*)wptrs[widx];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int part = warp % kw;
  const int n0 = (blockIdx.x * (W / kw) + warp / kw) * 16;
  const int nstage = (K + KPS - 1) / KPS;
  const int my = n0 < N ? (nstage - part + kw - 1) / kw : 0;
  const u32 ring = smem_addr(tc_smem + warp * (S * TC_SLOT));
  const uint2* xrow[NT];  // this lane's B column g of each 8-row tile: its words, 16 k each
#pragma unroll
  for (int q = 0; q < NT; ++q) xrow[q] = (const uint2*)(XB + (size_t)(row0 + min(8 * q + g, rows - 1)) * (L / 2) + acol / 2) + t;
  uint2 xv[2][HM][NT];
  auto load_x = [&](int b, int j, int u) {
    const int kh = j < my ? ((part + j * kw) * KPS + u * HM * 16) / 16 : 0;  // in words of 16 k per lane
#pragma unroll
    for (int i = 0; i < HM; ++i)
#pragma unroll
      for (int q = 0; q < NT; ++q) xv[b][i][q] = __ldg(xrow[q] + 4 * (kh + i));
  };
  float acc[NT][4];
#pragma unroll
  for (int q = 0; q < NT; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[q][e] = 0.f;
#pragma unroll
  for (int j = 0; j < S - 1; ++j)
    tc_issue<true, S>(ring, j, my, part, kw, lane, n0, N, Wt, 2 * K, false, nullptr, 1, 1, 1, 1);
  load_x(0, 0, 0);
  for (int j = 0; j < my; ++j) {
    cp_async_wait<S - 2>();
    __syncwarp();
    tc_issue<true, S>(ring, j + S - 1, my, part, kw, lane, n0, N, Wt, 2 * K, false, nullptr, 1, 1, 1, 1);
    u32 d[8][2];
    tc_load_stage(ring + (j % S) * TC_SLOT, lane, d);
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const int b = u & 1;
      if (u + 1 < NU) load_x(b ^ 1, j, u + 1);
      else load_x(b ^ 1, j + 1, 0);
#pragma unroll
      for (int i = 0; i < HM; ++i) {
        const int c = 2 * (u * HM + i);
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          const u32 a[4] = {d[c][0], d[c][1], d[c + 1][0], d[c + 1][1]}, bw[2] = {xv[b][i][q].x, xv[b][i][q].y};
          mma_bf16(acc[q], a, bw);
        }
      }
    }
  }
  cp_async_wait<0>();
  tc_reduce_store<NT>(acc, tc_smem, warp, lane, part, kw, n0, N, rows, Y, ldy, row0, ycol, bf);
}

#define TB_ARGS const u32 *XB, const float *unused, int L, float *Y, int ldy, int N, int K, const int *segs, \
                const u64 *wptrs, const u64 *sptrs, int bn, int bk, int gk, int bf, int kw
// NAME: tcgemv8_bf16_n<NT> (tcgemv8's arguments; no scales)
#define DEF_TB(NT)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) tcgemv8_bf16_n##NT(TB_ARGS) {                      \
    if (segs[5 * blockIdx.y + 2] <= 0) return;                                                         \
    tcgemvbf_body<NT, 4, 8>(XB, L, Y, ldy, N, K, segs, wptrs, bf, kw);                                 \
  }
DEF_TB(1)
DEF_TB(2)
DEF_TB(4)

// bf: the outputs rounded to bf16, as the reference's linear() returns them
#define T8_ARGS const u8 *XC, const float *XSC, int L, float *Y, int ldy, int N, int K, const int *segs, \
                const u64 *wptrs, const u64 *sptrs, int bn, int bk, int gk, int bf, int kw
#define T8_PASS XC, XSC, L, Y, ldy, N, K, segs, wptrs, sptrs, bn, bk, gk, bf, kw
// NAME: tcgemv8_<fmt>_n<NT>; the ring's configuration is the exact GEMV's (engine TC_WARPS, TC_SMEM).
// Whether the scales ride the ring is decided once, outside the loop (both loops are compiled).
#define DEF_T8(TAG, FMT, NT)                                                                           \
  extern "C" __global__ void __launch_bounds__(256, NT <= 2 || FMT == FMT_FP4 ? 2 : 1)                  \
      tcgemv8_##TAG##_n##NT(T8_ARGS) {                                                                 \
    if (segs[5 * blockIdx.y + 2] <= 0) return; /* an unused segment slot: the whole block */           \
    const void* Sc = (const void*)sptrs[segs[5 * blockIdx.y]];                                         \
    if (FMT == FMT_FP8 ? bn % 16 == 0 : ((gk & 7) == 0 && ((u64)Sc & 7) == 0))                         \
      tcgemv8_body<FMT, NT, 4, 8, true>(T8_PASS);                                                      \
    else                                                                                               \
      tcgemv8_body<FMT, NT, 4, 8, false>(T8_PASS);                                                     \
  }
DEF_T8(fp8, FMT_FP8, 1)
DEF_T8(fp8, FMT_FP8, 2)
DEF_T8(fp8, FMT_FP8, 4)
DEF_T8(fp4, FMT_FP4, 1)
DEF_T8(fp4, FMT_FP4, 2)
DEF_T8(fp4, FMT_FP4, 4)
