// Shared helpers for dsuf kernels. Self-contained (no CUDA headers): the loaders inline this
// file in place of its #include, so NVRTC needs no include path and CuPy's cache key covers it.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#define DSUF_INF __int_as_float(0x7f800000)

// Programmatic dependent launch (engine/kernels.py launch(pdl=True), sm_90+). A kernel launched
// that way may start while the previous kernel still runs: before dsuf_grid_wait() it may only
// read what no kernel of the step writes (weights, constant tables). dsuf_launch_dependents()
// lets such a successor start now; without a PDL successor both are no-ops.
__device__ __forceinline__ void dsuf_grid_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void dsuf_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Asynchronous prefetch of `bytes` (a multiple of 16, from a 16-byte aligned address) into L2.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Weight storage formats (engine/kernels.py FMT_*).
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_FP8 2
#define FMT_FP4 3

__device__ __forceinline__ float h2f(u32 h16) {
  float f;
  unsigned short h = (unsigned short)h16;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// e4m3 byte -> f16 bits whose value is the e4m3 value * 2^-8 (exact, subnormals included).
// Going through f16 avoids f32 subnormals, which CuPy's -ftz=true would flush.
__device__ __forceinline__ float e4m3_raw(u32 b) {
  return h2f(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}
// e2m1 nibble -> value * 2^-14 (via f16, exact).
__device__ __forceinline__ float e2m1_raw(u32 c) {
  return h2f(((c & 8u) << 12) | ((c & 7u) << 9));
}
// UE8M0 exponent byte -> 2^(e-127) * 2^shift (shift folds the raw-decode factor back in).
__device__ __forceinline__ float e8m0_scaled(u32 e, int shift) {
  int b = (int)e + shift;
  b = b < 1 ? 1 : (b > 254 ? 254 : b);
  return __uint_as_float(((u32)b) << 23);
}

// word i of a 16-byte load; a read-only 16-byte load
__device__ __forceinline__ u32 word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}
__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg((const uint4*)p); }

// 2**ceil(log2 t) from the exponent bits (positive normal t), as DeepSeek's kernel does.
__device__ __forceinline__ float pow2_ceil(float t) {
  const u32 b = __float_as_uint(t);
  int k = (int)((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0);
  k = k < -126 ? -126 : (k > 127 ? 127 : k);
  return __uint_as_float((u32)(k + 127) << 23);
}

// |value| (sign handled by the caller) -> e4m3 code 0..0x7e, round to nearest even, saturating.
__device__ __forceinline__ u32 e4m3_code(float mag) {
  if (mag < 0.015625f) return (u32)rintf(mag * 512.f);
  const u32 mb = __float_as_uint(mag);
  int code = (int)((mb + 0x7FFFFu + ((mb >> 20) & 1u)) >> 20) - (120 << 3);
  return (u32)(code > 0x7E ? 0x7E : code);
}

// f32 -> the nearest bf16 value (ties to even), kept as f32: what storing an activation in bf16
// does (the numpy backend's round_bf16, bit for bit, infinities and NaN included).
__device__ __forceinline__ float round_bf16f(float x) {
  const u32 b = __float_as_uint(x);
  return __uint_as_float((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

__device__ __forceinline__ float e4m3_round(float x) {  // x -> nearest e4m3 value (as float)
  const float v = e4m3_raw(e4m3_code(fabsf(x))) * 256.f;
  return (__float_as_uint(x) >> 31) ? -v : v;
}

// DeepSeek's FP8 block quantization (the reference's act_quant; the state's FP8 codec): a block's
// UE8M0 scale from its amax, and one value onto the block's e4m3 grid (saturating at 448).
__device__ __forceinline__ float e4m3_block_scale(float amax) {
  return pow2_ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
}
// (scale is a power of two, so 1 / scale is exact and v * (1 / scale) is v / scale bit for bit,
// subnormal results included: a block's elements take one division between them, not one each)
__device__ __forceinline__ float e4m3_clip_inv(float v, float inv) { return fminf(fmaxf(v * inv, -448.f), 448.f); }
__device__ __forceinline__ float e4m3_clip(float v, float scale) { return e4m3_clip_inv(v, 1.0f / scale); }
__device__ __forceinline__ float e4m3_value(float v, float scale) { return e4m3_round(e4m3_clip(v, scale)) * scale; }

// A linear's input as --numerics deepseek hands it to the weight, applied by the GEMVs as they
// stage x (no pass of its own): xq 1 rounds to bf16; xq 2 rounds to bf16, then puts each block of
// 32 on the e4m3 grid with its UE8M0 scale (the reference's act_quant; bit for bit
// fake_quant_fp8 with bf16 first). The lane holds 4 consecutive elements and 8 consecutive lanes
// (8j .. 8j + 7 of a warp, all active) one block.
__device__ __forceinline__ float4 linear_in4(float4 v, int xq) {
  if (xq == 0) return v;
  v = make_float4(round_bf16f(v.x), round_bf16f(v.y), round_bf16f(v.z), round_bf16f(v.w));
  if (xq == 2) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = e4m3_block_scale(amax), inv = 1.0f / s;
    v.x = e4m3_round(e4m3_clip_inv(v.x, inv)) * s;
    v.y = e4m3_round(e4m3_clip_inv(v.y, inv)) * s;
    v.z = e4m3_round(e4m3_clip_inv(v.z, inv)) * s;
    v.w = e4m3_round(e4m3_clip_inv(v.w, inv)) * s;
  }
  return v;
}

// The reference's act_quant of 4 consecutive elements of a row (x rounded to bf16 first when bf):
// 8 consecutive lanes (all active) hold one block of 32. Returns the 4 e4m3 codes (element j in
// byte j) and the block's UE8M0 scale in s.
__device__ __forceinline__ u32 act_quant4(float4 v, bool bf, float& s) {
  if (bf) v = make_float4(round_bf16f(v.x), round_bf16f(v.y), round_bf16f(v.z), round_bf16f(v.w));
  float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  s = e4m3_block_scale(amax);
  const float e[4] = {v.x, v.y, v.z, v.w}, inv = 1.0f / s;
  u32 word = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float q = e4m3_clip_inv(e[j], inv);
    word |= (e4m3_code(fabsf(q)) | ((__float_as_uint(q) >> 31) << 7)) << (8 * j);
  }
  return word;
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// two floats -> bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// The next bf16 term of 4 floats, as two bf16x2 words, leaving the remainder in e: three terms
// carry an f32's 24 bits, so tensor-core products of the terms add up to f32 products.
__device__ __forceinline__ uint2 bf16_term4(float* e) {
  const u32 lo = pack_bf16x2(e[0], e[1]), hi = pack_bf16x2(e[2], e[3]);
  e[0] -= bf16_lo(lo); e[1] -= bf16_hi(lo); e[2] -= bf16_lo(hi); e[3] -= bf16_hi(hi);
  return make_uint2(lo, hi);
}

// c += a (16x16 bf16, row) * b (16x8 bf16, col), f32 accumulation: mma.m16n8k16 fragments.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One warp's 32 x 32 tile of C += A * B^T over k_len (a multiple of 16) from shared memory, both
// operands bf16 rows of stride ld (u16): A rows wm.. (TA terms, a_term apart), B rows wn.. (TB terms,
// b_term apart; B's rows are C's columns). Term products ta + tb < max(TA, TB), smallest first (three
// terms carry an f32: the rest lie below its rounding). acc[i][j][2 h + c]: C row wm + 16 i + g + 8 h,
// column wn + 8 j + 2 t + c (g = lane / 4, t = lane % 4), as mma.m16n8k16 lays it out.
template <int TA, int TB>
__device__ __forceinline__ void mma_warp_32x32(float (&acc)[2][4][4], const u16* a, int a_term, const u16* b,
                                               int b_term, int ld, int k_len, int wm, int wn) {
  constexpr int TM = TA > TB ? TA : TB;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 1  // (unrolling lets ptxas spill the one-term indexer kernel)
  for (int ks = 0; ks < k_len; ks += 16) {
#pragma unroll
    for (int tb = TB - 1; tb >= 0; --tb) {
      u32 bf[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u16* br = b + tb * b_term + (wn + 8 * j + g) * ld + ks + 2 * t;
        bf[j][0] = *(const u32*)br;
        bf[j][1] = *(const u32*)(br + 8);
      }
#pragma unroll
      for (int ta = (TA - 1 < TM - 1 - tb ? TA - 1 : TM - 1 - tb); ta >= 0; --ta) {
        u32 af[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const u16* ar = a + ta * a_term + (wm + 16 * i + g) * ld + ks + 2 * t;
          af[i][0] = *(const u32*)ar;
          af[i][1] = *(const u32*)(ar + 8 * ld);
          af[i][2] = *(const u32*)(ar + 8);
          af[i][3] = *(const u32*)(ar + 8 * ld + 8);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], af[i], bf[j]);
      }
    }
  }
}

// f(row, column, value) for each of this lane's 32 values of mma_warp_32x32's tile (its layout).
template <class F>
__device__ __forceinline__ void mma_warp_32x32_each(const float (&acc)[2][4][4], int wm, int wn, F f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(wm + 16 * i + g + 8 * (e >> 1), wn + 8 * j + 2 * t + (e & 1), acc[i][j][e]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Inclusive prefix sum over the lanes of a full warp (int, u64, ...).
template <class T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* red /* >= 33 floats of smem */) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nw ? red[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  return red[32];
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

// silu(min(gate, limit)) * clip(up, -limit, limit)   (no clamp when limit <= 0)
__device__ __forceinline__ float swiglu1(float g, float u, float limit) {
  if (limit > 0.f) {
    u = fminf(fmaxf(u, -limit), limit);
    g = fminf(g, limit);
  }
  return g * sigmoidf_(g) * u;
}
