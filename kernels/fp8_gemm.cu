// DeepSeek's FP8 linear (--numerics deepseek, the reference's act_quant + fp8_gemm) on the tensor
// cores: activations quantized to e4m3 with a UE8M0 scale per 32 along K, times e4m3 weights with
// an f32 scale per (bn x bk) block, f32 out.
//
// act_quant_fp8: 8 lanes per 32-element block of a row, 4 elements each (16-byte loads, 4-byte
// stores): amax, scale = 2**ceil(log2(max(amax, 1e-4) / 448)), codes = e4m3(x / scale) (round to
// nearest even, saturating), bit-exact with engine/ops/numpy_ops.py fake_quant_fp8.
//
// Y[M, N] = sum over K of (A codes * A scales) (W values * W scales), W e4m3 with an f32 scale per
// (bn x bk) block, or e2m1 (FP4 experts) with a UE8M0 scale per row and 32 along K, decoded exactly
// into e4m3 in shared memory (Hopper has no FP4 MMA). Two kernels of the same arguments, one per
// architecture (engine/ops/gpu/fp8_linear.py picks): gemm_e4m3_{fp8,fp4}_sm90 on sm_90a (wgmma,
// warp-specialized, 128 x 128 tiles; kernels/fp8_wgmma.cuh), gemm_e4m3_{fp8,fp4} on the others
// (mma.sync, 64 x 64 tiles; kernels/fp8_mma.cuh). Both require K % 64 == 0.
#include "fp8_mma.cuh"
#include "fp8_wgmma.cuh"

// grid (ceil(M * K / 4 / 256)), block 256; K % 32 == 0, ldx % 4 == 0.
extern "C" __global__ void act_quant_fp8(const float* __restrict__ x, int ldx, u8* __restrict__ codes,
                                         float* __restrict__ scales, int M, int K, int bf) {
  const int q4 = K / 4;  // quads of a row: a multiple of 8, so a block's 8 lanes share a row
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = i < (long long)M * q4;  // (dead lanes still join their warp's shuffles)
  const int m = live ? (int)(i / q4) : 0, c = live ? (int)(i % q4) : 0;
  const float4 v = live ? __ldg((const float4*)(x + (size_t)m * ldx) + c) : make_float4(0.f, 0.f, 0.f, 0.f);
  float s;
  const u32 word = act_quant4(v, bf, s);
  if (live) {
    *(u32*)(codes + (size_t)m * K + 4 * c) = word;
    if ((c & 7) == 0) scales[(size_t)m * (K / 32) + c / 8] = s;
  }
}

// part, pstride (sm_90a FP8, grid z = splits > 1): split z sums K's stages z * T / splits .. into
// part + z * pstride (laid out as Y, unrounded), for bw_sum_splits (kernels/fp4_experts.cu) to add
// up in order; the FP4 and mma.sync kernels take no split.
#define DENSE_ARGS                                                                                            \
  const u8 *A, const float *SA, const u8 *W, const void *SW, float *Y, int ldy, int M, int N, int K, int bn, \
      int bk, int gk, int bf, float *part, long long pstride
#define DENSE_MMA(NAME, FMT)                                                                                  \
  extern "C" __global__ void __launch_bounds__(128) NAME(DENSE_ARGS) {                                        \
    gemm_e4m3_body<FMT>(A, SA, W, SW, Y, ldy, M, N, K, bn, bk, gk, blockIdx.y * FG_BM,                        \
                        blockIdx.x * FG_BN, bf);                                                              \
  }
DENSE_MMA(gemm_e4m3_fp8, FMT_FP8)
DENSE_MMA(gemm_e4m3_fp4, FMT_FP4)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DENSE_WG(NAME, FMT)                                                                                   \
  extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) NAME(DENSE_ARGS) {                              \
    extern __shared__ __align__(1024) u8 wg_smem[];                                                           \
    const int T = (K + WG_BK - 1) / WG_BK, S = FMT == FMT_FP8 ? gridDim.z : 1, z = S > 1 ? blockIdx.z : 0;   \
    wg_gemm<FMT>(wg_smem, A, SA, W, SW, S > 1 ? part + z * pstride : Y, ldy, M, N, K, bn, bk, gk,             \
                 blockIdx.y * WG_BM, blockIdx.x * WG_BN, S > 1 ? 0 : bf, T * z / S, T * (z + 1) / S);        \
  }
DENSE_WG(gemm_e4m3_fp8_sm90, FMT_FP8)
DENSE_WG(gemm_e4m3_fp4_sm90, FMT_FP4)
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
