// Fake quantization onto DeepSeek's state grids, bit-exact with engine/formats.py:
// FP8 e4m3 with a UE8M0 scale per block (window KV), FP4 e2m1 with a UE8M0 (MXFP4, indexer
// keys) or e4m3 (compressed KV) scale per block. One thread per block of channels; and
// norm_rope_quant, the RMSNorm -> RoPE -> fake-quant chain of a state row in one launch.
#include "dsuf_common.cuh"

// e2m1 rounding by thresholds: ties at 0.25, 1.25, 2.5, 5 go down (even code below).
__device__ __forceinline__ float e2m1_round(float x) {
  float mag = fabsf(x);
  if (mag != mag) mag = 6.f;
  u32 c = (mag > 0.25f) + (mag >= 0.75f) + (mag > 1.25f) + (mag >= 1.75f) + (mag > 2.5f) + (mag >= 3.5f) +
          (mag > 5.0f);
  const float v = e2m1_raw(c) * 16384.f;
  return (__float_as_uint(x) >> 31) ? -v : v;
}

// One value onto a state codec's grid given its block's amax. mode: the codec (engine/state.py):
// 1 FP8 e4m3 / UE8M0, 2 FP4 e2m1 / e4m3 scale, 3 FP4 e2m1 / UE8M0 (MXFP4).
__device__ __forceinline__ float quant_scale(float amax, int mode) {
  if (mode == 1) return e4m3_block_scale(amax);
  if (mode == 2) return e4m3_round(fmaxf(amax, 6.f * 0.001953125f) / 6.f);
  return pow2_ceil(fmaxf(amax, 6.f * 1.1754943508222875e-38f) * 0.1666666716337204f);
}
__device__ __forceinline__ float quant_value(float v, float scale, int mode) {
  if (mode == 1) return e4m3_value(v, scale);
  return e2m1_round(fminf(fmaxf(v / scale, -6.f), 6.f)) * scale;
}

// Thread b's block of `block` channels onto codec `mode`'s grid; bf: the values rounded to bf16
// first (--numerics deepseek: a linear's bf16 input, quantized as the reference's act_quant does).
__device__ __forceinline__ void fake_quant_block(const float* __restrict__ x, float* __restrict__ y,
                                                 long long nblocks, int block, int mode, bool bf) {
  dsuf_launch_dependents();
  const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const float* xb = x + b * block;
  float* yb = y + b * block;
  float amax = 0.f;
  for (int i = 0; i < block; ++i) amax = fmaxf(amax, fabsf(bf ? round_bf16f(xb[i]) : xb[i]));
  const float scale = quant_scale(amax, mode);
  for (int i = 0; i < block; ++i) yb[i] = quant_value(bf ? round_bf16f(xb[i]) : xb[i], scale, mode);
}

extern "C" __global__ void fake_quant_fp8(const float* __restrict__ x, float* __restrict__ y, long long nblocks,
                                          int block, int bf) {
  fake_quant_block(x, y, nblocks, block, 1, bf != 0);
}

extern "C" __global__ void fake_quant_fp4(const float* __restrict__ x, float* __restrict__ y, long long nblocks,
                                          int block, int e4m3_scales) {
  fake_quant_block(x, y, nblocks, block, e4m3_scales ? 2 : 3, false);
}

// rows of width D (row r at x + r * ldx; D % 4 == 0, TPR = D / 4 a power of two in 8..128):
//   n = norm ? x / sqrt(mean(x^2) + eps) * w : x      (w may be null)
//   r = RoPE of n on its trailing 2P channels (interleaved pairs, (D - 2P) % 4 == 0) with cos / sin
//       row r / M (x viewed as [T, M, D]), sign -1 rotating back
//   y = qmode ? r onto state codec qmode's grid (see quant_scale; its block / 4 <= TPR) : r
//   yn (may be null) = n
// bf (--numerics deepseek): n and r rounded to bf16 (the reference's norm and RoPE store bf16)
// Each thread holds one float4 of a row, so the norm's sum, the rotation of its pairs and its
// quantization block's amax (shuffles among its block / 4 lanes) all stay in registers. block 128:
// 128 / TPR rows per block.
extern "C" __global__ void __launch_bounds__(128) norm_rope_quant(
    const float* __restrict__ x, long long ldx, int rows, int D, int norm, const float* __restrict__ w, float eps,
    const float* __restrict__ cs, const float* __restrict__ sn, int M, int P, float sign, int qmode,
    float* __restrict__ y, float* __restrict__ yn, int bf) {
  dsuf_launch_dependents();
  __shared__ float red[4][4];  // [row in block][warp of the row] (rows of 64 or 128 threads)
  const int tpr = D >> 2, lane_r = threadIdx.x & (tpr - 1), rib = threadIdx.x / tpr;
  const int r = blockIdx.x * (128 / tpr) + rib;
  const bool live = r < rows;
  float4 v = live ? __ldg((const float4*)(x + (size_t)r * ldx) + lane_r) : make_float4(0.f, 0.f, 0.f, 0.f);
  if (norm) {
    float s = v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    for (int o = (tpr < 32 ? tpr : 32) >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (tpr > 32) {  // the row spans tpr / 32 warps: their sums in warp order
      const int wr = lane_r >> 5;
      if ((threadIdx.x & 31) == 0) red[rib][wr] = s;
      __syncthreads();
      s = red[rib][0];
      for (int k = 1; k < (tpr >> 5); ++k) s += red[rib][k];
    }
    const float inv = 1.f / sqrtf(s / (float)D + eps);
    v.x *= inv; v.y *= inv; v.z *= inv; v.w *= inv;
    if (w) {
      const float4 g = __ldg((const float4*)w + lane_r);
      v.x *= g.x; v.y *= g.y; v.z *= g.z; v.w *= g.w;
    }
    if (bf) v = make_float4(round_bf16f(v.x), round_bf16f(v.y), round_bf16f(v.z), round_bf16f(v.w));
  }
  // (no early exit for rows past the end: their lanes still take part in the shuffles below)
  if (yn && live) ((float4*)(yn + (size_t)r * D))[lane_r] = v;
  const int off = D - 2 * P, d0 = lane_r * 4;
  if (live && d0 >= off) {  // two pairs, (x, y) and (z, w)
    const float* c = cs + (size_t)(r / M) * P + ((d0 - off) >> 1);
    const float* sp = sn + (size_t)(r / M) * P + ((d0 - off) >> 1);
    const float c0 = c[0], c1 = c[1], s0 = sign * sp[0], s1 = sign * sp[1];
    const float4 e = v;
    v.x = e.x * c0 - e.y * s0;
    v.y = e.x * s0 + e.y * c0;
    v.z = e.z * c1 - e.w * s1;
    v.w = e.z * s1 + e.w * c1;
  }
  if (bf) v = make_float4(round_bf16f(v.x), round_bf16f(v.y), round_bf16f(v.z), round_bf16f(v.w));
  if (qmode) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    // (lanes of one row and one block are consecutive and aligned: xor stays inside the block)
    for (int o = (qmode == 2 ? 16 : 32) >> 3; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = quant_scale(amax, qmode);
    v.x = quant_value(v.x, scale, qmode);
    v.y = quant_value(v.y, scale, qmode);
    v.z = quant_value(v.z, scale, qmode);
    v.w = quant_value(v.w, scale, qmode);
  }
  if (live) ((float4*)(y + (size_t)r * D))[lane_r] = v;
}
