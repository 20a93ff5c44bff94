// Tensor-core GEMV for decode and verify steps under --numerics deepseek: y[m, n] = sum_k x[m, k] *
// W[n, k] for up to 32 rows of x per segment, x already on DeepSeek's activation grid (the
// reference's act_quant: e4m3 codes with a power-of-two scale per 32 along K, from act_quant_fp8),
// W FP8 (e4m3, f32 scale per bn x bk block) or FP4 (e2m1, UE8M0 per 1 x 32). Same segment table as
// kernels/linear.cu (weight index, x row0, rows, x col, y col) and the same weight ring as the exact
// GEMV (kernels/tc_ring.cuh).
//
// Why a kernel of its own: with x on the e4m3 grid, one mma.m16n8k32 e4m3 takes a whole 32-k
// group of 16 weight rows against 8 rows of x, where the exact GEMV (kernels/gemv_tc.cu) needs four
// f16 MMAs (two k16 halves times x's hi and lo terms), and x travels as 1 byte per element instead
// of 4. At a verify step's few rows both GEMVs are bound by instruction issue, not by HBM. (Hopper
// has no e4m3 mma.sync: ptxas converts the operands to f16 and issues two f16 MMAs, so on sm_90a
// this saves less than it would on a chip that runs it natively.)
//
// Each MMA's fresh f32 sums (one 32-k group: x's scale changes every 32) are scaled by the row's
// weight scale times the x row's scale and added to the f32 total, as DeepSeek's own FP8 GEMM
// promotes its tensor-core sums.
//  * FP8: MMA i of a stage (128 k) takes chunks 2i, 2i + 1 of the ldmatrix words; x in order.
//  * FP4: MMA c (one 16-byte chunk, 32 k) takes the lane's two words (rows g, g + 8: nibbles 8t ..
//    8t + 7 of the chunk). Each word decodes in 5 instructions into two e4m3 words, its even and
//    its odd nibbles (fp4_e4m3_split: e2m1's 3 magnitude bits placed on e4m3's exponent and
//    mantissa bits, value * 2^-6, sign to bit 7); x's 8 bytes at 8t are permuted to match with two
//    byte_perms. A and B only need to agree on the order of k within the MMA.
#include "tc_ring.cuh"

// c = a (16 x 32 e4m3, row) * b (32 x 8 e4m3, col), a fresh f32 accumulator.
__device__ __forceinline__ void mma_k32_e4m3(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
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
// bytes. NT = 8-row tiles of x (rows per segment <= 8 * NT). XC [rows of x, lda] e4m3 codes, XSC
// [rows of x, lda / 32] their scales; lda % 32 == 0, K % 32 == 0, segment x columns multiples of
// 32; FP8 bk a multiple of 32 dividing 128 or a multiple of 128.
//
// x is read from global memory (L2) in units of HM MMAs' operands and scales per 8-row tile, each
// unit loaded while the previous one is multiplied.
template <int FMT, int NT, int S, int W>
__device__ __forceinline__ void tcgemv8_body(const u8* __restrict__ XC, const float* __restrict__ XSC, int lda,
                                             float* __restrict__ Y, int ldy, int N, int K,
                                             const int* __restrict__ segs, const u64* __restrict__ wptrs,
                                             const u64* __restrict__ sptrs, int bn, int bk, int gk, int bf, int kw) {
  extern __shared__ __align__(16) u8 tc_smem[];
  constexpr bool F8 = FMT == FMT_FP8;
  constexpr int KPS = F8 ? 128 : 256;  // k per stage
  constexpr int MPS = KPS / 32;        // MMAs per stage
  // MMAs per x unit: 4 MMAs' operands of one tile, at most half a stage (the two buffers alternate)
  constexpr int HM = (NT >= 4 ? 1 : 4 / NT) > MPS / 2 ? MPS / 2 : (NT >= 4 ? 1 : 4 / NT);
  constexpr int NU = MPS / HM;  // x units per stage
  static_assert(NU % 2 == 0, "unit u of every stage must live in buffer u & 1");
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
  const bool pre = F8 ? bn % 16 == 0 : ((gk & 7) == 0 && ((u64)Sc & 7) == 0);
  const int ng = min(n0 + g, N - 1), ng8 = min(n0 + g + 8, N - 1);  // this lane's two weight rows
  const int nsc = F8 && bk < KPS ? KPS / bk : 1;                     // FP8 scales per stage (pre)
  const int bsh = F8 && bk < KPS ? __ffs(bk) - 6 : 2;                // FP8: MMA i -> scale i >> bsh
  const int srow_g = F8 ? (ng / bn) * gk : ng * gk;
  const int srow_g8 = F8 ? (ng8 / bn) * gk : ng8 * gk;
  const int lxs = lda / 32;

  // x: this lane feeds B column g of each 8-row tile (x row 8q + g), and scales C columns 2t, 2t + 1
  const u8* xrow[NT];
  const float* xsr[NT][2];
  bool xok[NT], cok[NT][2];
#pragma unroll
  for (int q = 0; q < NT; ++q) {
    xok[q] = 8 * q + g < rows;
    xrow[q] = XC + (size_t)(row0 + (xok[q] ? 8 * q + g : 0)) * lda + acol + (F8 ? 4 * t : 8 * t);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = 8 * q + 2 * t + h;
      cok[q][h] = m < rows;
      xsr[q][h] = XSC + (size_t)(row0 + (cok[q][h] ? m : 0)) * lxs + acol / 32;
    }
  }
  // two x units in registers: unit u of a stage lives in buffer u & 1 (the B words, the scales)
  uint2 xv[2][HM][NT];
  float xs[2][HM][NT][2];
  auto load_x = [&](int b, int j, int u) {  // buffer b <- unit u of this warp's stage j
    const int kh = (part + j * kw) * KPS + u * HM * 32;
    const bool live = j < my;
#pragma unroll
    for (int i = 0; i < HM; ++i) {
      const int kk = kh + 32 * i;
      const bool in = live && kk < K;
#pragma unroll
      for (int q = 0; q < NT; ++q) {
        if (F8) {
          const bool ok = in && xok[q];
          xv[b][i][q] = make_uint2(ok ? __ldg((const u32*)(xrow[q] + kk)) : 0u,
                                   ok ? __ldg((const u32*)(xrow[q] + kk + 16)) : 0u);
        } else {
          xv[b][i][q] = in && xok[q] ? __ldg((const uint2*)(xrow[q] + kk)) : make_uint2(0, 0);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) xs[b][i][q][h] = in && cok[q][h] ? __ldg(xsr[q][h] + kk / 32) : 0.f;
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
    tc_issue<F8, S>(ring, j, my, part, kw, lane, n0, N, Wt, row_bytes, pre, Sc, bn, bk, gk, nsc);
  load_x(0, 0, 0);
  for (int j = 0; j < my; ++j) {
    cp_async_wait<S - 2>();
    __syncwarp();
    tc_issue<F8, S>(ring, j + S - 1, my, part, kw, lane, n0, N, Wt, row_bytes, pre, Sc, bn, bk, gk, nsc);
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
      for (int i = 0; i < HM; ++i) {
        const int c = u * HM + i, kk = k0 + 32 * c;  // MMA c of the stage, its first k
        u32 a0, a1, a2, a3;
        float sa, sb;  // the weight scales of rows g, g + 8 (FP4: the decoding's 2^-6 is undone at the end)
        if (F8) {
          a0 = d[2 * c][0], a1 = d[2 * c][1], a2 = d[2 * c + 1][0], a3 = d[2 * c + 1][1];
          if (pre) {
            sa = sb = ((const float*)ssc)[c >> bsh];
          } else {
            const bool in = kk < K;
            sa = in ? __ldg((const float*)Sc + srow_g + kk / bk) : 0.f;
            sb = in ? __ldg((const float*)Sc + srow_g8 + kk / bk) : 0.f;
          }
        } else {
          fp4_e4m3_split(d[c][0], a0, a2);
          fp4_e4m3_split(d[c][1], a1, a3);
          if (pre) {
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
          const uint2 x = xv[b][i][q];
          float cc[4];
          if (F8) mma_k32_e4m3(cc, a0, a1, a2, a3, x.x, x.y);
          else mma_k32_e4m3(cc, a0, a1, a2, a3, __byte_perm(x.x, x.y, 0x6420), __byte_perm(x.x, x.y, 0x7531));
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

// bf: the outputs rounded to bf16, as the reference's linear() returns them
#define T8_ARGS const u8 *XC, const float *XSC, int lda, float *Y, int ldy, int N, int K, const int *segs, \
                const u64 *wptrs, const u64 *sptrs, int bn, int bk, int gk, int bf, int kw
#define T8_PASS XC, XSC, lda, Y, ldy, N, K, segs, wptrs, sptrs, bn, bk, gk, bf, kw
// NAME: tcgemv8_<fmt>_n<NT>; the ring's configuration is the exact GEMV's (engine TC_WARPS, TC_SMEM)
#define DEF_T8(TAG, FMT, NT)                                                                   \
  extern "C" __global__ void __launch_bounds__(256) tcgemv8_##TAG##_n##NT(T8_ARGS) {           \
    tcgemv8_body<FMT, NT, 4, 8>(T8_PASS);                                                      \
  }
DEF_T8(fp8, FMT_FP8, 1)
DEF_T8(fp8, FMT_FP8, 2)
DEF_T8(fp8, FMT_FP8, 4)
DEF_T8(fp4, FMT_FP4, 1)
DEF_T8(fp4, FMT_FP4, 2)
DEF_T8(fp4, FMT_FP4, 4)
