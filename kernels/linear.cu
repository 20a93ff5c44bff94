// Linear layers on weights kept in their stored format: y[m, n] = sum_k x[m, k] * W[n, k].
//
// One launch serves dense, grouped (block-diagonal wo_a) and MoE (per-expert) projections: a
// segment table says, per segment, which weight (index into wptrs/sptrs), which rows of x and y,
// and column offsets into x and y. Three kernels:
//  * gemvx: one row of x, CUDA cores, x staged in shared memory (decode at batch 1; below).
//  * gemv: MT <= 8 rows, CUDA cores. Each warp owns RPW output rows; every weight byte is read
//    once per launch with 16-byte coalesced loads and dequantized in registers (decode).
//  * gemm: 64x64x32 tiles, bf16 mma.sync with f32 accumulation (prefill). Weights are
//    dequantized into shared memory as bf16, exact for fp8*UE8M0, fp4*UE8M0 and bf16. Each f32
//    activation is split into three bf16 terms (hi + mid + lo carry all 24 mantissa bits) and
//    multiplied by three MMAs, so the result is float32-accurate: V4.1's FP8/FP4 state
//    rounding would amplify bf16 activation error into visibly different logits. The kernel is
//    bound by loads and dequantization, not by the MMAs, so the split costs little.
// Formats: FMT_F32, FMT_BF16, FMT_FP8 (e4m3, f32 scale per (bn x bk) block, index
// (n/bn)*gk + k/bk), FMT_FP4 (e2m1 packed low nibble first, UE8M0 byte per (1 x 32), gk=K/32).
#include "dsuf_common.cuh"

template <int FMT> struct Fmt;
template <> struct Fmt<FMT_F32> { static constexpr int EPC = 4; static constexpr int NUM = 4, DEN = 1; };
template <> struct Fmt<FMT_BF16> { static constexpr int EPC = 8; static constexpr int NUM = 2, DEN = 1; };
template <> struct Fmt<FMT_FP8> { static constexpr int EPC = 16; static constexpr int NUM = 1, DEN = 1; };
template <> struct Fmt<FMT_FP4> { static constexpr int EPC = 32; static constexpr int NUM = 1, DEN = 2; };

// Scale of the 16-byte chunk starting at element k0 of row n (raw-decode factor folded in).
template <int FMT>
__device__ __forceinline__ float chunk_scale(const void* S, int n, int k0, int bn, int bk, int gk) {
  if (FMT == FMT_FP8) return ((const float*)S)[(size_t)(n / bn) * gk + k0 / bk] * 256.f;
  if (FMT == FMT_FP4) return e8m0_scaled(((const u8*)S)[(size_t)n * gk + k0 / 32], 14);
  return 1.f;
}

// Elements 4g..4g+3 of a 16-byte chunk, dequantized (times sc).
template <int FMT>
__device__ __forceinline__ void deq4(const uint4& v, int g, float sc, float* o) {
  if (FMT == FMT_F32) {
    o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
    o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
  } else if (FMT == FMT_BF16) {
    u32 a = word(v, 2 * g), b = word(v, 2 * g + 1);
    o[0] = bf16_lo(a); o[1] = bf16_hi(a); o[2] = bf16_lo(b); o[3] = bf16_hi(b);
  } else if (FMT == FMT_FP8) {
    u32 w = word(v, g);
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = e4m3_raw((w >> (8 * j)) & 0xFFu) * sc;
  } else {
    u32 w = word(v, g >> 1) >> (16 * (g & 1));
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = e2m1_raw((w >> (4 * j)) & 0xFu) * sc;
  }
}

// GEMV form of deq4: values without the chunk's scale (the caller applies it once per chunk).
// FP8 goes through the packed e4m3x2 -> f16x2 conversion (sm_89+): 2.5 instructions per weight
// instead of 7, which is what keeps the decode GEMV near memory speed.
template <int FMT>
__device__ __forceinline__ void deq4_unscaled(const uint4& v, int g, float* o) {
  if (FMT == FMT_FP8) {
    const u32 w = word(v, g);
    u32 lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((u16)(w & 0xFFFFu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((u16)(w >> 16)));
    o[0] = h2f(lo & 0xFFFFu); o[1] = h2f(lo >> 16); o[2] = h2f(hi & 0xFFFFu); o[3] = h2f(hi >> 16);
  } else {
    deq4<FMT>(v, g, 1.f, o);
  }
}

// Scale GEMV applies per chunk to deq4_unscaled values (FP8's raw-decode factor is not needed).
// srow: the row's offset into the scale table, hoisted out of the K loop; ksh: log2(bk), or -1 when
// bk is not a power of two (integer division per chunk and row cost as much as the dequantization).
template <int FMT>
__device__ __forceinline__ int gemv_scale_row(int n, int bn, int gk) {
  if (FMT == FMT_FP8) return (n / bn) * gk;
  if (FMT == FMT_FP4) return n * gk;
  return 0;
}
template <int FMT>
__device__ __forceinline__ float gemv_scale(const void* S, int srow, int k0, int bk, int ksh) {
  if (FMT == FMT_FP8) return __ldg((const float*)S + srow + (ksh >= 0 ? k0 >> ksh : k0 / bk));
  if (FMT == FMT_FP4) return e8m0_scaled(__ldg((const u8*)S + srow + (k0 >> 5)), 14);
  return 1.f;
}

// Eight e2m1 nibbles of one word (element i in bits 4i..4i+3) -> values * 2^-14, in element order.
// Nibbles i and i+4 become one f16x2 with two shifts and two masks (half the instructions of
// decoding nibbles one by one: the FP4 GEMV is bound by this arithmetic, not by its loads).
__device__ __forceinline__ void deq8_fp4(u32 w, float* o) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 mag = i < 3 ? (w << (9 - 4 * i)) : (w >> 3);
    const u32 p = (mag & 0x0E000E00u) | ((w << (12 - 4 * i)) & 0x80008000u);
    o[i] = h2f(p & 0xFFFFu);
    o[i + 4] = h2f(p >> 16);
  }
}

// ---------------------------------------------------------------------------------------------
// GEMV: block = 8 warps in 8/KW row groups of RPW consecutive output rows; the KW warps of a
// group split the row's 16-byte chunks (KW = 1, 2, 4 or 8, chosen by the host so that short
// matrices still put enough loads in flight to saturate HBM), then reduce through shared
// memory. Each lane issues U x RPW independent 16-byte weight loads per iteration.
// grid (ceil(N / (RPW * 8 / KW)), nseg). A segment with rows == 0 (unused tail of a
// device-built MoE table) returns at once and reads nothing.

template <int FMT, int MT, int RPW>
__device__ __forceinline__ void gemv_body(const float* __restrict__ A, int lda, float* __restrict__ Y, int ldy,
                                          int N, int K, const int* __restrict__ segs,
                                          const u64* __restrict__ wptrs, const u64* __restrict__ sptrs,
                                          int bn, int bk, int gk, int bf, int kw) {
  constexpr int EPC = Fmt<FMT>::EPC;
  constexpr int U = MT <= 2 ? 4 : 2;  // chunks per lane in flight per row (registers allow more at small MT)
  __shared__ float red[8][RPW * MT];
  const int* sg = segs + 5 * blockIdx.y;
  const int widx = sg[0], row0 = sg[1], rows = sg[2], acol = sg[3], ycol = sg[4];
  if (rows <= 0) return;  // the whole block: no barrier reached yet
  const u8* W = (const u8*)wptrs[widx];
  const void* S = (const void*)sptrs[widx];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = warp / kw, part = warp - group * kw;
  const int n0 = (blockIdx.x * (8 / kw) + group) * RPW;
  const size_t row_bytes = (size_t)K * Fmt<FMT>::NUM / Fmt<FMT>::DEN;
  float acc[RPW][MT];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  const float* Ab = A + (size_t)row0 * lda + acol;
  const int nchunks = n0 < N ? K / EPC : 0;
  const int ksh = (bk & (bk - 1)) == 0 ? __ffs(bk) - 1 : -1;
  int srow[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) srow[r] = gemv_scale_row<FMT>(n0 + r < N ? n0 + r : 0, bn, gk);
  const int cstep = 32 * kw;
  for (int c = part * 32 + lane; c < nchunks; c += U * cstep) {
    uint4 raw[U][RPW];
    float sc[U][RPW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c + u * cstep;
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const int n = n0 + r;
        const bool ok = cc < nchunks && n < N;
        raw[u][r] = ok ? ldg16(W + (size_t)n * row_bytes + (size_t)cc * 16) : make_uint4(0, 0, 0, 0);
        sc[u][r] = ok ? gemv_scale<FMT>(S, srow[r], cc * EPC, bk, ksh) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c + u * cstep;
      if (cc < nchunks) {
        const int k0 = cc * EPC;
        float dot[RPW][MT];  // this chunk's dot products, scaled once at the end
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
          for (int m = 0; m < MT; ++m) dot[r][m] = 0.f;
        if (FMT == FMT_FP4) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {  // x first, then one row's 8 weights at a time (few registers)
            float4 xa[MT], xb[MT];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              const float* xm = Ab + (size_t)(m < rows ? m : 0) * lda + k0 + 8 * q;
              xa[m] = __ldg((const float4*)xm);
              xb[m] = __ldg((const float4*)(xm + 4));
            }
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
              float w8[8];
              deq8_fp4(word(raw[u][r], q), w8);
#pragma unroll
              for (int m = 0; m < MT; ++m)
                dot[r][m] += w8[0] * xa[m].x + w8[1] * xa[m].y + w8[2] * xa[m].z + w8[3] * xa[m].w +
                             w8[4] * xb[m].x + w8[5] * xb[m].y + w8[6] * xb[m].z + w8[7] * xb[m].w;
            }
          }
        } else
#pragma unroll
        for (int g = 0; g < EPC / 4; ++g) {
          float w4[RPW][4];
#pragma unroll
          for (int r = 0; r < RPW; ++r) deq4_unscaled<FMT>(raw[u][r], g, w4[r]);
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            if (m < rows) {
              const float4 xv = __ldg((const float4*)(Ab + (size_t)m * lda + k0 + 4 * g));
#pragma unroll
              for (int r = 0; r < RPW; ++r)
                dot[r][m] += w4[r][0] * xv.x + w4[r][1] * xv.y + w4[r][2] * xv.z + w4[r][3] * xv.w;
            }
          }
        }
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
          for (int m = 0; m < MT; ++m) acc[r][m] += sc[u][r] * dot[r][m];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = warp_sum(acc[r][m]);
  if (kw > 1) {  // the group's partial sums, in a fixed order (deterministic)
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int m = 0; m < MT; ++m) red[warp][r * MT + m] = acc[r][m];
    }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        float v = red[warp][r * MT + m];
        for (int j = 1; j < kw; ++j) v += red[warp + j][r * MT + m];
        acc[r][m] = v;
      }
  }
  if (lane != 0 || n0 >= N) return;
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m)
      if (m < rows && n0 + r < N) Y[(size_t)(row0 + m) * ldy + ycol + n0 + r] = bf ? round_bf16f(acc[r][m]) : acc[r][m];
}

// bf (--numerics deepseek): the outputs rounded to bf16, as the reference's linear() returns them
#define GEMV_ARGS const float *A, int lda, float *Y, int ldy, int N, int K, const int *segs, \
                  const u64 *wptrs, const u64 *sptrs, int bn, int bk, int gk, int bf
#define GEMV_PASS A, lda, Y, ldy, N, K, segs, wptrs, sptrs, bn, bk, gk, bf
#define DEF_GEMV(NAME, FMT, MT, RPW)                                       \
  extern "C" __global__ void __launch_bounds__(256) NAME(GEMV_ARGS, int kw) { \
    gemv_body<FMT, MT, RPW>(GEMV_PASS, kw);                                  \
  }
#define DEF_GEMV_FMT(TAG, FMT)                 \
  DEF_GEMV(gemv_##TAG##_m1, FMT, 1, 4)         \
  DEF_GEMV(gemv_##TAG##_m2, FMT, 2, 4)         \
  DEF_GEMV(gemv_##TAG##_m4, FMT, 4, 4)         \
  DEF_GEMV(gemv_##TAG##_m8, FMT, 8, 4)
DEF_GEMV_FMT(f32, FMT_F32)
DEF_GEMV_FMT(bf16, FMT_BF16)
DEF_GEMV_FMT(fp8, FMT_FP8)
DEF_GEMV_FMT(fp4, FMT_FP4)

// ---------------------------------------------------------------------------------------------
// GEMM: 64 (rows of x) x 64 (rows of W) tiles, K step 32, 4 warps in 2x2, each 32x32 via
// mma.m16n8k16 bf16. grid (ceil(N/64), nseg); every segment has <= 64 rows.

#define BM 64
#define BN 64
#define BK 32
#define LDS (BK + 8)  // bf16 elements per smem row: 80 B, conflict-free fragment loads

template <int FMT>
__device__ __forceinline__ void gemm_body(GEMV_ARGS) {
  constexpr int EPC = Fmt<FMT>::EPC;
  constexpr int CPR = BK / EPC > 0 ? BK / EPC : 1;  // 16-byte chunks per tile row (fp4: 1 = 32 elements)
  __shared__ __align__(16) u16 As[3][BM][LDS];  // hi, mid, lo bf16 terms of the activations
  __shared__ __align__(16) u16 Ws[BN][LDS];
  const int* sg = segs + 5 * blockIdx.y;
  const int widx = sg[0], row0 = sg[1], rows = sg[2], acol = sg[3], ycol = sg[4];
  if (rows <= 0) return;  // an unused segment slot: the whole block, before any barrier
  const u8* W = (const u8*)wptrs[widx];
  const void* S = (const void*)sptrs[widx];
  const int nb = blockIdx.x * BN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  const int g = lane >> 2, t = lane & 3;
  const size_t row_bytes = (size_t)K * Fmt<FMT>::NUM / Fmt<FMT>::DEN;
  float acc[2][4][4] = {};

  for (int k0 = 0; k0 < K; k0 += BK) {
    // activations: 64 rows x 32 f32 = 512 float4, 4 per thread
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + 128 * i, r = idx >> 3, c4 = idx & 7;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r < rows) v = __ldg((const float4*)(A + (size_t)(row0 + r) * lda + acol + k0 + 4 * c4));
      float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int term = 0; term < 3; ++term) *(uint2*)&As[term][r][4 * c4] = bf16_term4(e);
    }
    // weights: 64 rows x CPR chunks, dequantized to bf16
    for (int idx = tid; idx < BN * CPR; idx += 128) {
      const int r = idx / CPR, c = idx % CPR, n = nb + r;
      uint4 raw = make_uint4(0, 0, 0, 0);
      float sc = 0.f;
      if (n < N) {
        raw = ldg16(W + (size_t)n * row_bytes + (size_t)k0 * Fmt<FMT>::NUM / Fmt<FMT>::DEN + (size_t)c * 16);
        sc = chunk_scale<FMT>(S, n, k0 + c * EPC, bn, bk, gk);
      }
#pragma unroll
      for (int q = 0; q < EPC / 4; ++q) {
        float o[4];
        deq4<FMT>(raw, q, sc, o);
        *(uint2*)&Ws[r][c * EPC + 4 * q] = make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
      }
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
      u32 b[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = wn + 8 * j + g;
        b[j][0] = *(const u32*)&Ws[n][ks + 2 * t];
        b[j][1] = *(const u32*)&Ws[n][ks + 2 * t + 8];
      }
#pragma unroll
      for (int term = 2; term >= 0; --term) {  // smallest term first
        u32 a[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = wm + 16 * i + g;
          a[i][0] = *(const u32*)&As[term][r][ks + 2 * t];
          a[i][1] = *(const u32*)&As[term][r + 8][ks + 2 * t];
          a[i][2] = *(const u32*)&As[term][r][ks + 2 * t + 8];
          a[i][3] = *(const u32*)&As[term][r + 8][ks + 2 * t + 8];
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], a[i], b[j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = wm + 16 * i + g, n = nb + wn + 8 * j + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = r + 8 * h;
        if (rr < rows) {
          float* y = Y + (size_t)(row0 + rr) * ldy + ycol;
          if (n < N) y[n] = bf ? round_bf16f(acc[i][j][2 * h]) : acc[i][j][2 * h];
          if (n + 1 < N) y[n + 1] = bf ? round_bf16f(acc[i][j][2 * h + 1]) : acc[i][j][2 * h + 1];
        }
      }
    }
}

#define DEF_GEMM(TAG, FMT) \
  extern "C" __global__ void __launch_bounds__(128) gemm_##TAG(GEMV_ARGS) {      \
    gemm_body<FMT>(GEMV_PASS);                                                 \
  }
DEF_GEMM(f32, FMT_F32)
DEF_GEMM(bf16, FMT_BF16)
DEF_GEMM(fp8, FMT_FP8)
DEF_GEMM(fp4, FMT_FP4)

// ---------------------------------------------------------------------------------------------
// Row gather with dequantization (embedding tables): out[i, :] = dequant(W[ids[i], :]).
// grid (n_ids), block 128; requires K % EPC == 0.
template <int FMT>
__device__ __forceinline__ void gather_body(const u8* W, const void* S, const long long* ids, float* out, int K,
                                            int bn, int bk, int gk) {
  constexpr int EPC = Fmt<FMT>::EPC;
  const long long n = ids[blockIdx.x];
  const size_t row_bytes = (size_t)K * Fmt<FMT>::NUM / Fmt<FMT>::DEN;
  for (int c = threadIdx.x; c < K / EPC; c += blockDim.x) {
    const uint4 raw = ldg16(W + (size_t)n * row_bytes + (size_t)c * 16);
    const float sc = chunk_scale<FMT>(S, (int)n, c * EPC, bn, bk, gk);
#pragma unroll
    for (int q = 0; q < EPC / 4; ++q) {
      float o[4];
      deq4<FMT>(raw, q, sc, o);
      *(float4*)(out + (size_t)blockIdx.x * K + c * EPC + 4 * q) = make_float4(o[0], o[1], o[2], o[3]);
    }
  }
}
#define DEF_GATHER(TAG, FMT)                                                                       \
  extern "C" __global__ void gather_##TAG(const u8* W, const void* S, const long long* ids, float* out, \
                                          int K, int bn, int bk, int gk) { \
    gather_body<FMT>(W, S, ids, out, K, bn, bk, gk);                                               \
  }
DEF_GATHER(f32, FMT_F32)
DEF_GATHER(bf16, FMT_BF16)
DEF_GATHER(fp8, FMT_FP8)
DEF_GATHER(fp4, FMT_FP4)
// ---- one-row GEMV with x staged in shared memory, permuted (decode at batch 1) -------------------
// The CUDA-core GEMVs above read x from L1 at a 4 * EPC-byte stride between lanes (lane l holds
// weight chunk c + l): each float4 load of x touches 16 (FP8) cache lines, so the x reads, not the
// weights, saturate the L1 pipeline (FP8 carries 16 weights per 16 bytes, so x is 4x the weight
// bytes). Here each block first copies its segment's row of x into shared memory in chunk-major
// order, float4 i of chunk c at ((c / 32) * (EPC / 4) + i) * 32 + c % 32, so that the warp's float4
// reads for one i are 512 contiguous bytes (4 wavefronts, conflict-free), and each x read serves
// RPW weight rows. Blocks stride over groups of 8 / kw row groups; the kw warps of a row group
// split its 32-chunk slices and reduce through shared memory in a fixed order.
// xq: x as a linear's input under --numerics deepseek, applied as it is staged (linear_in4).
// grid (blocks, nseg), block 256, dynamic shared memory ceil(K / (32 EPC)) * 32 EPC * 4 bytes.
template <int FMT, int RPW, int PC>
__device__ __forceinline__ void gemvx_body(const float* __restrict__ A, int lda, float* __restrict__ Y, int ldy,
                                           int N, int K, const int* __restrict__ segs,
                                           const u64* __restrict__ wptrs, const u64* __restrict__ sptrs,
                                           int bn, int bk, int gk, int bf, int kw, int pf, int xq) {
  extern __shared__ __align__(16) float xsh[];
  __shared__ float red[8][RPW];
  constexpr int EPC = Fmt<FMT>::EPC, Q = EPC / 4;
  const int gpb = 8 / kw;
  if (pf > 0 && threadIdx.x == 0) {  // (pf > 0: segs and wptrs are constant tables, see launch())
    // this block's first pf row groups into L2 while the previous kernel finishes
    const int* sg = segs + 5 * blockIdx.y;
    const u8* W = (const u8*)wptrs[sg[0]];
    const size_t rb = (size_t)K * Fmt<FMT>::NUM / Fmt<FMT>::DEN;
    const int step = gpb * RPW;
    for (int i = 0, n0 = blockIdx.x * step; i < pf && n0 < N; ++i, n0 += gridDim.x * step)
      prefetch_l2(W + n0 * rb, (u32)((min(N, n0 + step) - n0) * rb));
  }
  dsuf_grid_wait();
  const int* sg = segs + 5 * blockIdx.y;
  const int widx = sg[0], row0 = sg[1], rows = sg[2], acol = sg[3], ycol = sg[4];
  if (rows <= 0) return;
  const u8* W = (const u8*)wptrs[widx];
  const void* S = (const void*)sptrs[widx];
  const int nch = K / EPC, slices = (nch + 31) / 32;
  {
    // XB float4s of x per thread in flight, then linear_in4 (its shuffles would otherwise wait on
    // each load in turn: one L2 round trip per float4)
    constexpr int XB = 4;
    const float* xg = A + (size_t)row0 * lda + acol;
    const int nx = slices * 32 * Q;  // (a multiple of 32: j's warp is whole; 8 lanes a block of 32)
    for (int j0 = threadIdx.x; j0 < nx; j0 += XB * blockDim.x) {  // j: float4 index of x, in k order
      float4 v[XB];
#pragma unroll
      for (int u = 0; u < XB; ++u) {
        const int j = j0 + u * blockDim.x;
        v[u] = j < nx && j / Q < nch ? __ldg((const float4*)(xg + 4 * j)) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < XB; ++u) {
        const int j = j0 + u * blockDim.x, c = j / Q, i = j - c * Q;
        if (j < nx) *(float4*)(xsh + (((c >> 5) * Q + i) * 32 + (c & 31)) * 4) = linear_in4(v[u], xq);
      }
    }
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = warp / kw, part = warp - group * kw;
  const size_t row_bytes = (size_t)K * Fmt<FMT>::NUM / Fmt<FMT>::DEN;
  const int ksh = (bk & (bk - 1)) == 0 ? __ffs(bk) - 1 : -1;
  const int ngroups = (N + RPW - 1) / RPW, nbi = (ngroups + gpb - 1) / gpb;
  for (int bi = blockIdx.x; bi < nbi; bi += gridDim.x) {  // uniform over the block (barriers below)
    const int n0 = (bi * gpb + group) * RPW;
    int srow[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) srow[r] = gemv_scale_row<FMT>(n0 + r < N ? n0 + r : 0, bn, gk);
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    for (int s0 = part * PC; s0 < (n0 < N ? slices : 0); s0 += kw * PC) {
      uint4 raw[PC][RPW];
      float sc[PC][RPW];
#pragma unroll
      for (int p = 0; p < PC; ++p) {
        const int c = (s0 + p) * 32 + lane;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const bool ok = s0 + p < slices && c < nch && n0 + r < N;
          raw[p][r] = ok ? ldg16(W + (size_t)(n0 + r) * row_bytes + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
          sc[p][r] = ok ? gemv_scale<FMT>(S, srow[r], c * EPC, bk, ksh) : 0.f;
        }
      }
#pragma unroll
      for (int p = 0; p < PC; ++p) {
        const float* xs = xsh + (size_t)(s0 + p) * Q * 128 + lane * 4;  // (zeros past nch)
        float dot[RPW];
#pragma unroll
        for (int r = 0; r < RPW; ++r) dot[r] = 0.f;
        if (s0 + p < slices) {
          if (FMT == FMT_FP4) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const float4 xa = *(const float4*)(xs + (2 * q) * 128), xb = *(const float4*)(xs + (2 * q + 1) * 128);
#pragma unroll
              for (int r = 0; r < RPW; ++r) {
                float w8[8];
                deq8_fp4(word(raw[p][r], q), w8);
                dot[r] += w8[0] * xa.x + w8[1] * xa.y + w8[2] * xa.z + w8[3] * xa.w +
                          w8[4] * xb.x + w8[5] * xb.y + w8[6] * xb.z + w8[7] * xb.w;
              }
            }
          } else {
#pragma unroll
            for (int g = 0; g < Q; ++g) {
              const float4 xv = *(const float4*)(xs + g * 128);
#pragma unroll
              for (int r = 0; r < RPW; ++r) {
                float w4[4];
                deq4_unscaled<FMT>(raw[p][r], g, w4);
                dot[r] += w4[0] * xv.x + w4[1] * xv.y + w4[2] * xv.z + w4[3] * xv.w;
              }
            }
          }
        }
#pragma unroll
        for (int r = 0; r < RPW; ++r) acc[r] += sc[p][r] * dot[r];
      }
    }
    // (a GEMV successor's prefetch starts once this block's weight loads are all issued: launched
    // at our start it would compete with them)
    if (bi + gridDim.x >= nbi) dsuf_launch_dependents();
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = warp_sum(acc[r]);
    if (kw > 1) {  // the row group's partial sums, in a fixed order (deterministic)
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) red[warp][r] = acc[r];
      }
      __syncthreads();
      if (part == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          float v = red[warp][r];
          for (int j = 1; j < kw; ++j) v += red[warp + j][r];
          acc[r] = v;
        }
      }
      __syncthreads();
    }
    if (part == 0 && lane == 0) {
#pragma unroll
      for (int r = 0; r < RPW; ++r)
        if (n0 + r < N) Y[(size_t)row0 * ldy + ycol + n0 + r] = bf ? round_bf16f(acc[r]) : acc[r];
    }
  }
}

// Three blocks per SM (<= 85 registers; without the bound the compiler takes more and two blocks
// fit); FP8 with 2 rows per warp instead of 4 (4 rows spill at that bound).
#define DEF_GEMVX(NAME, FMT, RPW, PC) \
  extern "C" __global__ void __launch_bounds__(256, 3) NAME(GEMV_ARGS, int kw, int pf, int xq) { \
    gemvx_body<FMT, RPW, PC>(GEMV_PASS, kw, pf, xq);                                    \
  }
DEF_GEMVX(gemvx_f32, FMT_F32, 4, 2)
DEF_GEMVX(gemvx_bf16, FMT_BF16, 4, 2)
DEF_GEMVX(gemvx_fp8, FMT_FP8, 2, 2)
DEF_GEMVX(gemvx_fp4, FMT_FP4, 2, 2)  // (FP4's dequantization needs the registers of 4 rows)
