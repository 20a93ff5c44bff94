// Fake quantization onto DeepSeek's state grids, bit-exact with engine/formats.py:
// FP8 e4m3 with a UE8M0 scale per block (window KV), FP4 e2m1 with a UE8M0 (MXFP4, indexer
// keys) or e4m3 (compressed KV) scale per block. One thread per block of channels.
#include "dsuf_common.cuh"

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
__device__ __forceinline__ float e4m3_round(float x) {  // x -> nearest e4m3 value (as float)
  const float v = e4m3_raw(e4m3_code(fabsf(x))) * 256.f;
  return (__float_as_uint(x) >> 31) ? -v : v;
}

// e2m1 rounding by thresholds: ties at 0.25, 1.25, 2.5, 5 go down (even code below).
__device__ __forceinline__ float e2m1_round(float x) {
  float mag = fabsf(x);
  if (mag != mag) mag = 6.f;
  u32 c = (mag > 0.25f) + (mag >= 0.75f) + (mag > 1.25f) + (mag >= 1.75f) + (mag > 2.5f) + (mag >= 3.5f) +
          (mag > 5.0f);
  const float v = e2m1_raw(c) * 16384.f;
  return (__float_as_uint(x) >> 31) ? -v : v;
}

extern "C" __global__ void fake_quant_fp8(const float* __restrict__ x, float* __restrict__ y, long long nblocks,
                                          int block) {
  dsuf_launch_dependents();
  const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const float* xb = x + b * block;
  float* yb = y + b * block;
  float amax = 0.f;
  for (int i = 0; i < block; ++i) amax = fmaxf(amax, fabsf(xb[i]));
  const float scale = pow2_ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
  for (int i = 0; i < block; ++i) {
    const float q = fminf(fmaxf(xb[i] / scale, -448.f), 448.f);
    yb[i] = e4m3_round(q) * scale;
  }
}

extern "C" __global__ void fake_quant_fp4(const float* __restrict__ x, float* __restrict__ y, long long nblocks,
                                          int block, int e4m3_scales) {
  dsuf_launch_dependents();
  const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const float* xb = x + b * block;
  float* yb = y + b * block;
  float amax = 0.f;
  for (int i = 0; i < block; ++i) amax = fmaxf(amax, fabsf(xb[i]));
  float scale;
  if (e4m3_scales) {
    scale = e4m3_round(fmaxf(amax, 6.f * 0.001953125f) / 6.f);
  } else {
    scale = pow2_ceil(fmaxf(amax, 6.f * 1.1754943508222875e-38f) * 0.1666666716337204f);
  }
  for (int i = 0; i < block; ++i) {
    const float q = fminf(fmaxf(xb[i] / scale, -6.f), 6.f);
    yb[i] = e2m1_round(q) * scale;
  }
}
