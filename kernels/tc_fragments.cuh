// Tensor-core fragment helpers of the GEMVs (kernels/gemv_tc.cu, kernels/gemv_reg.cu, kernels/gemv_q8.cu):
// shared-memory addresses, cp.async and ldmatrix, the f16 MMA, exact FP8 / FP4 -> f16 decoding, f16
// rounding, powers of two, and x's split into power-of-two scaled f16 hi + lo terms (split_group4).
#pragma once
#include "dsuf_common.cuh"

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// 16-byte asynchronous copy global -> shared; bytes = 0 fills the destination with zeros.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
// 16 bytes to a shared-memory address (as cp_async16 names its destination).
__device__ __forceinline__ void st_shared_v4(u32 dst, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
// 4- / 8-byte asynchronous copies through L1 (block scales: small, and shared by a tile's rows)
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async8(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32* d) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

// the same with each 8 x 8 matrix transposed: lane l gets rows 2 (l % 4), 2 (l % 4) + 1 of column l / 4
__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32* d) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

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
// the same of v's high two bytes (the half taken as an operand select, no shift)
__device__ __forceinline__ u32 e4m3x2_hi_to_f16x2(u32 v) {
  u32 r;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }" : "=r"(r) : "r"(v));
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

// x's 128-element groups are scaled by 2^sh, sh bringing the group's max |x| into [2^13, 2^14)
// (0 for a zero or non-finite max: NaN is ignored here and propagates through the products
// instead), then split into f16 hi + lo terms (22 mantissa bits: float32-grade products).
__device__ __forceinline__ int x_group_shift(float m) {
  int sh = 0;
  if (m > 0.f && m <= 3.0e38f) {
    int e;
    frexpf(m, &e);  // m = f * 2^e, f in [0.5, 1)
    sh = 14 - e;
    sh = sh < -125 ? -125 : (sh > 125 ? 125 : sh);
  }
  return sh;
}
// four elements of one group (v) -> f16 hi and lo terms of v * 2^sh; returns 2^-sh (the group's inverse)
__device__ __forceinline__ float split_group4(float4 v, u32* hi, u32* lo) {
  const float m = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  const int sh = x_group_shift(m);
  const float scale = pow2f(sh);
  const float x[4] = {v.x * scale, v.y * scale, v.z * scale, v.w * scale};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    hi[i] = f2h_rn(x[i]);
    lo[i] = f2h_rn(x[i] - h2f(hi[i]));
  }
  return pow2f(-sh);
}
