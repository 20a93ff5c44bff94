// DeepSeek's FP8 linear over a MoE's routed experts (--numerics deepseek, prompt chunks): one launch
// multiplies every expert's rows by that expert's FP8 or FP4 weight, the pairs grouped by expert
// (engine/ops/gpu/moe.py: kernels/moe.cu moe_group_large's segment table).
//
// segs [nseg x 5] int32: (expert e, first row row0, rows, x column (0), y column). Segment s's rows
// are rows row0 .. row0 + rows of Y and of A, both in pair order (w1 / w3: the tokens' codes gathered
// beforehand, fp8_linear.py gather_codes; w2: the hidden rows); its weight is wptrs[e] (data) and
// sptrs[e] (scales), all of one shape [N, K] and format. A block
// computes the tile of segment blockIdx.y / mtiles at rows (blockIdx.y % mtiles) * tile.. (none
// past the segment's rows: that block returns at once, as do unused, zero-row slots) and columns
// blockIdx.x * tile..; the tile's arithmetic is the dense GEMM's (kernels/fp8_gemm.cu), one e4m3
// MMA per 32-wide step promoted in f32, on wgmma (sm_90a, kernels/fp8_wgmma.cuh, 128-row tiles)
// or mma.sync (kernels/fp8_mma.cuh, 64-row tiles). A is act_quant_fp8's codes [*, K], SA its scales.
//
// Learned from (read, not copied): DeepGEMM's grouped "contiguous" layout (deepseek-ai/DeepGEMM:
// the rows of all experts in one M, each expert's run padded to the tile so a block's rows share a
// weight); here a segment table cuts each expert's run into tiles instead of padding. The rows are
// permuted beforehand: gathering them in the producer (4 row lookups a stage, FP4 expansion
// beside them) made w1 / w3 the slowest of the grouped GEMMs per FLOP.
#include "fp8_mma.cuh"
#include "fp8_wgmma.cuh"

// The block's segment and row offset: the pointers moved to the segment's first row, M its rows, m0
// the tile's first row within it; false for a block past the segment's rows.
template <int BM>
__device__ __forceinline__ bool grouped_tile(const int* __restrict__ segs, const u64* __restrict__ wptrs,
                                             const u64* __restrict__ sptrs, int mtiles, int K, int ldy, const u8*& A,
                                             const float*& SA, const u8*& W, const void*& SW, float*& Y, int& M,
                                             int& m0) {
  const int* sg = segs + 5 * (blockIdx.y / mtiles);
  const int e = sg[0], row0 = sg[1];
  M = sg[2];
  m0 = (int)(blockIdx.y % mtiles) * BM;
  if (m0 >= M) return false;
  A += (size_t)row0 * K;
  SA += (size_t)row0 * (K / 32);
  W = (const u8*)wptrs[e];
  SW = (const void*)sptrs[e];
  Y += (size_t)row0 * ldy + sg[4];
  return true;
}

#define GROUPED_ARGS                                                                                          \
  const u8 *A, const float *SA, const int *segs, const u64 *wptrs, const u64 *sptrs, float *Y,                \
      int ldy, int N, int K, int bn, int bk, int gk, int mtiles, int bf
#define GROUPED_MMA(NAME, FMT)                                                                                \
  extern "C" __global__ void __launch_bounds__(128) NAME(GROUPED_ARGS) {                                      \
    const u8* W;                                                                                              \
    const void* SW;                                                                                           \
    int M, m0;                                                                                                \
    if (!grouped_tile<FG_BM>(segs, wptrs, sptrs, mtiles, K, ldy, A, SA, W, SW, Y, M, m0)) return;             \
    gemm_e4m3_body<FMT>(A, SA, W, SW, Y, ldy, M, N, K, bn, bk, gk, m0, blockIdx.x * FG_BN, bf);               \
  }
GROUPED_MMA(gemm_e4m3_grouped_fp8, FMT_FP8)
GROUPED_MMA(gemm_e4m3_grouped_fp4, FMT_FP4)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GROUPED_WG(NAME, FMT)                                                                                 \
  extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) NAME(GROUPED_ARGS) {                            \
    extern __shared__ __align__(1024) u8 wg_smem[];                                                           \
    const u8* W;                                                                                              \
    const void* SW;                                                                                           \
    int M, m0;                                                                                                \
    if (!grouped_tile<WG_BM>(segs, wptrs, sptrs, mtiles, K, ldy, A, SA, W, SW, Y, M, m0)) return;             \
    wg_gemm<FMT>(wg_smem, A, SA, W, SW, Y, ldy, M, N, K, bn, bk, gk, m0, blockIdx.x * WG_BN, bf, 0,           \
                 (K + WG_BK - 1) / WG_BK);                                                                        \
  }
GROUPED_WG(gemm_e4m3_grouped_fp8_sm90, FMT_FP8)  // (FP4 experts on sm_90a: kernels/fp4_experts.cu)
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
