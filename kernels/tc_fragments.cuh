// Tensor-core fragment helpers shared by kernels/gemv_tc.cu and the developer tools' kernels
// (tools/stream_chain.py): the f16 and e4m3 MMAs, exact FP8 / FP4 -> f16 and FP4 -> e4m3 decoding,
// f16 and e4m3 rounding, powers of two.
#pragma once
#include "dsuf_common.cuh"

// (not volatile: a pure function of its registers, so the compiler may interleave it with loads)
__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 v) {
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((u16)(v & 0xFFFFu)));
  return r;
}

// Eight e2m1 nibbles (element i in bits 4i..4i+3) -> four f16x2, p[i] = (element i, element i+4),
// each value * 2^-14, exact (f16 subnormals included).
__device__ __forceinline__ void fp4_pairs(u32 w, u32* p) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 mag = i < 3 ? (w << (9 - 4 * i)) : (w >> 3);
    p[i] = (mag & 0x0E000E00u) | ((w << (12 - 4 * i)) & 0x80008000u);
  }
}

__device__ __forceinline__ u32 f2h_rn(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float pow2f(int e) { return __uint_as_float((u32)(127 + e) << 23); }

// (m16n8k32, e4m3 x e4m3 -> f32: a lane's A words are 4 bytes of k 4t..4t+3 (a0: row g, a1: row g + 8)
// and of k 16 + 4t.. (a2, a3); its B words the same k of column g)
__device__ __forceinline__ void mma_e4m3(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// two floats -> e4m3 bytes (lo, hi), round to nearest, saturating
__device__ __forceinline__ u16 e4m3x2_rn(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// e2m1 nibbles -> e4m3 bytes (value x 2^-6, exact, subnormals included: the e2m1 exponent and
// mantissa bits become the low exponent bits and the top mantissa bit): of each byte of w, the low
// nibble (elements 0, 2, 4, 6 of the word's 8), and the high one (1, 3, 5, 7)
__device__ __forceinline__ u32 e4m3_lo(u32 w) { return ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4); }
__device__ __forceinline__ u32 e4m3_hi(u32 w) { return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u); }
