// The mma.sync FP8 GEMM (sm_100a / sm_103a; kernels/fp8_gemm.cu and kernels/fp8_grouped.cu):
//
// gemm_e4m3_fp8 / _fp4: a block of 128 threads computes a 64 x 64 tile (2 x 2 warps of 32 x 32) in
// K stages of 64; each 32-wide step is one mma.sync m16n8k32 e4m3 per 16 x 8 sub-tile into a fresh
// accumulator, which is then scaled by its row's and column's scales and added to the f32 total
// ("promotion"): the scales change every 32 along K, and the tensor core's FP8 sums are kept to
// one block. Shared-memory rows are 80 bytes so a warp's fragment loads hit 32 distinct banks.
// Both kernels require K % 64 == 0.
#pragma once
#include "dsuf_common.cuh"

#define FG_BM 64
#define FG_BN 64
#define FG_BK 64
#define FG_LDS 80

// c = a (16 x 32 e4m3, row) * b (32 x 8 e4m3, col), a fresh f32 accumulator.
__device__ __forceinline__ void mma_e4m3(float* c, const u32* a, const u32* b) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.f), "f"(0.f), "f"(0.f),
        "f"(0.f));
}

// Four e2m1 nibbles (bits 0..15 of h: element j in bits 4j..4j+3; bits 16..31 ignored) -> four e4m3
// bytes of the same values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), element j in byte j. One
// byte_perm looks up the four magnitudes at once (the table: the e4m3 bytes of the 8 magnitudes;
// selector nibble j is element j's 3 magnitude bits). The signs (bit 3 of each nibble) go to bit 7
// of their bytes: a byte_perm gives bytes (h0, h0, h1, h1), whose bit 3 is the sign of elements 0 and
// 2 (shifted up by 4) and bit 7 that of elements 1 and 3. About 7 instructions for 4 elements.
// (lo, hi): the magnitudes' table, bytes 0..7; E2M1_LO / E2M1_HI, or e2m1_table's scaled one.
#define E2M1_LO 0x3C383000u
#define E2M1_HI 0x4C484440u
__device__ __forceinline__ u32 e2m1x4_to_e4m3(u32 h, u32 lo = E2M1_LO, u32 hi = E2M1_HI) {
  const u32 mag = __byte_perm(lo, hi, h & 0x7777u);
  const u32 u = __byte_perm(h, 0u, 0x1100u);
  const u32 sgn = ((u << 4) & 0x00FF00FFu) | (u & 0xFF00FF00u);
  return mag | (sgn & 0x80808080u);
}

// The magnitudes' table times 2^d: each nonzero e4m3 byte's exponent field plus d (the caller keeps
// every byte a normal, 0x08 .. 0x7E, so no byte carries into or borrows from the next and the whole
// word's sum is exact).
__device__ __forceinline__ void e2m1_table(int d, u32& lo, u32& hi) {
  lo = E2M1_LO + (u32)(8 * d) * 0x01010100u;  // (byte 0, zero, stays zero)
  hi = E2M1_HI + (u32)(8 * d) * 0x01010101u;
}

// 32 e2m1 nibbles (16 bytes; element i in bits 4i..4i+3 of its word) -> 32 e4m3 bytes in order.
__device__ __forceinline__ void e2m1x32_to_e4m3(const uint4 v, u32 (&out)[8], u32 lo = E2M1_LO, u32 hi = E2M1_HI) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const u32 w = word(v, q);  // elements 8q .. 8q + 7
    out[2 * q] = e2m1x4_to_e4m3(w, lo, hi);
    out[2 * q + 1] = e2m1x4_to_e4m3(w >> 16, lo, hi);
  }
}

// A: codes [M, K] (row stride K), SA [M, K / 32]. FP8 W: codes [N, K], SW f32 [ceil(N / bn), gk]
// (the scale of rows n and columns k: SW[n / bn, k / bk]); FP4 W: nibbles [N, K / 2] (element i
// of a word in bits 4i..4i+3), SW UE8M0 bytes [N, gk = K / 32]. Y [M, N] (row stride ldy).
// The block's tile: rows m0.., columns n0.. (from A's rows m0..); bf: Y rounded to bf16 as stored
// (the reference's linear returns bf16).
template <int FMT>
__device__ __forceinline__ void gemm_e4m3_body(const u8* __restrict__ A, const float* __restrict__ SA,
                                               const u8* __restrict__ W,
                                               const void* __restrict__ SW, float* __restrict__ Y, int ldy, int M,
                                               int N, int K, int bn, int bk, int gk, int m0, int n0, int bf) {
  __shared__ __align__(16) u8 As[FG_BM][FG_LDS];
  __shared__ __align__(16) u8 Ws[FG_BN][FG_LDS];
  __shared__ float sa[FG_BM][2], sw[FG_BN][2];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32, nbk = K / 32;
  float acc[2][4][4] = {};

  for (int k0 = 0; k0 < K; k0 += FG_BK) {
    // 64 rows x 64 bytes of activations: 256 16-byte loads, 2 per thread
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int idx = tid + 128 * i, r = idx >> 2, c = idx & 3;
      uint4 va = make_uint4(0, 0, 0, 0);
      if (m0 + r < M) va = ldg16(A + (size_t)(m0 + r) * K + k0 + 16 * c);
      *(uint4*)&As[r][16 * c] = va;
    }
    if (FMT == FMT_FP8) {  // 64 rows x 64 e4m3 bytes
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int idx = tid + 128 * i, r = idx >> 2, c = idx & 3;
        uint4 vw = make_uint4(0, 0, 0, 0);
        if (n0 + r < N) vw = ldg16(W + (size_t)(n0 + r) * K + k0 + 16 * c);
        *(uint4*)&Ws[r][16 * c] = vw;
      }
    } else {  // 64 rows x 32 bytes of nibbles: one 16-byte load a thread, 32 e4m3 bytes out
      const int r = tid >> 1, h = tid & 1;
      uint4 vw = make_uint4(0, 0, 0, 0);
      if (n0 + r < N) vw = ldg16(W + (size_t)(n0 + r) * (K / 2) + k0 / 2 + 16 * h);
      u32 out[8];
      e2m1x32_to_e4m3(vw, out);  // this half's 32 elements
      *(uint4*)&Ws[r][32 * h] = make_uint4(out[0], out[1], out[2], out[3]);
      *(uint4*)&Ws[r][32 * h + 16] = make_uint4(out[4], out[5], out[6], out[7]);
    }
    {  // the stage's scales: 64 rows x 2 blocks of 32, of each operand
      const int r = tid >> 1, kb = tid & 1, k = k0 + 32 * kb;
      sa[r][kb] = m0 + r < M ? SA[(size_t)(m0 + r) * nbk + k / 32] : 0.f;
      float s = 0.f;
      if (n0 + r < N) {
        if (FMT == FMT_FP8) s = ((const float*)SW)[(size_t)((n0 + r) / bn) * gk + k / bk];
        else s = e8m0_scaled(((const u8*)SW)[(size_t)(n0 + r) * gk + k / 32], 0);
      }
      sw[r][kb] = s;
    }
    __syncthreads();
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
      const int ks = 32 * kb;
      u32 a[2][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wm + 16 * i + g;
        a[i][0] = *(const u32*)&As[r][ks + 4 * t];
        a[i][1] = *(const u32*)&As[r + 8][ks + 4 * t];
        a[i][2] = *(const u32*)&As[r][ks + 16 + 4 * t];
        a[i][3] = *(const u32*)&As[r + 8][ks + 16 + 4 * t];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = wn + 8 * j + g;
        b[j][0] = *(const u32*)&Ws[n][ks + 4 * t];
        b[j][1] = *(const u32*)&Ws[n][ks + 16 + 4 * t];
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wm + 16 * i + g;
        const float s0 = sa[r][kb], s1 = sa[r + 8][kb];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float c[4];
          mma_e4m3(c, a[i], b[j]);
          const int n = wn + 8 * j + 2 * t;  // this thread's columns: n and n + 1
          const float w0 = sw[n][kb], w1 = sw[n + 1][kb];
          acc[i][j][0] += c[0] * (s0 * w0);
          acc[i][j][1] += c[1] * (s0 * w1);
          acc[i][j][2] += c[2] * (s1 * w0);
          acc[i][j][3] += c[3] * (s1 * w1);
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = m0 + wm + 16 * i + g, n = n0 + wn + 8 * j + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = r + 8 * h;
        if (rr < M) {
          const float y0 = acc[i][j][2 * h], y1 = acc[i][j][2 * h + 1];
          if (n < N) Y[(size_t)rr * ldy + n] = bf ? round_bf16f(y0) : y0;
          if (n + 1 < N) Y[(size_t)rr * ldy + n + 1] = bf ? round_bf16f(y1) : y1;
        }
      }
    }
}
