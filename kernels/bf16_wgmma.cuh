// The bf16 wgmma GEMMs' shared machinery (--numerics deepseek): kernels/fp4_experts.cu (FP4 experts
// and FP8 linears, the weights decoded by the producer into shared memory) and
// kernels/bf16_weights.cu (FP8- and bf16-stored weights as the register operand).
//
// Why bf16 and not e4m3 MMAs (kernels/fp8_wgmma.cuh): the activations' scales change every 32
// along K, so an e4m3 MMA's k32 result must be scaled into an f32 total per step, one FFMA per
// accumulator per k32: as many FMA-pipe cycles as the tensor core spends at its FP8 rate, and for
// FP4 the producer's expansion into e4m3 on top. Both operands' values (e4m3 codes times a
// power-of-two scale, e2m1 codes times one) are bf16 numbers exactly, so a bf16 MMA with f32
// accumulation computes the same products with no promotion at all, at half the FP8 rate.
//
// Layout: Y^T = W X^T. Two consumer warpgroups each own 64 weight rows (Y columns) and issue
// wgmma.mma_async m64nNk16 bf16 with B from shared memory (up to 256 token rows, bf16, K-major,
// 128-byte swizzle), filled by a producer warpgroup through an mbarrier ring. A weight element
// decoded once serves up to 256 tokens.
//
// K order: any order of K that both operands share gives the dot product's terms; each kernel
// takes the one its weights' decode finds cheapest, and the tokens' bf16 rows are written in it
// (the two files say which).
#pragma once
#include "fp8_mma.cuh"
#include "fp8_wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BW_BM 128            // weight rows per block: two consumer warpgroups x 64
#define BW_BN 256            // token rows per block: the wgmma N
#define BW_TILE_BYTES 32768  // BW_BN rows x 128 bytes
#define BW_THREADS 384

#define BW_ONE2 0x3f803f80u  // 1.0 as bf16x2
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// 2^(e - 127 + shift) as bf16x2 for a UE8M0 byte e (1 .. 254), e - 127 + shift <= 127.
__device__ __forceinline__ u32 bw_scale2(u32 e, u32 shift) {
  const u32 b = (e + shift) << 7;
  return b | (b << 16);
}

// wgmma m64nNk16 bf16 -> f32 (N = 2 x the accumulators) adding to d: A (4 registers) from this
// thread and B from a descriptor (wgmma_rs), or both from descriptors (wgmma_ss). The asm's
// accumulator operands written once: BW_R*, BW_D*, the register lists; BW_F*, the constraints.
#define BW_R0_31 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define BW_R32_63 \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define BW_R64_127 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, " \
  "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, " \
  "%115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define BW_D32 "{" BW_R0_31 "}"
#define BW_D64 "{" BW_R0_31 ", " BW_R32_63 "}"
#define BW_D128 "{" BW_R0_31 ", " BW_R32_63 ", " BW_R64_127 "}"
#define BW_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
#define BW_F32 BW_F8(0), BW_F8(8), BW_F8(16), BW_F8(24)
#define BW_F64 BW_F32, BW_F8(32), BW_F8(40), BW_F8(48), BW_F8(56)
#define BW_F128 BW_F64, BW_F8(64), BW_F8(72), BW_F8(80), BW_F8(88), BW_F8(96), BW_F8(104), BW_F8(112), BW_F8(120)
__device__ __forceinline__ void wgmma_rs(float (&d)[128], const u32 (&a)[4], u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " BW_D128
               ", {%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"
               : BW_F128 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db) : "memory");
}
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BW_D64
               ", {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
               : BW_F64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db) : "memory");
}
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const u32 (&a)[4], u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " BW_D32
               ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
               : BW_F32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db) : "memory");
}
__device__ __forceinline__ void wgmma_ss(float (&d)[128], u64 da, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " BW_D128 ", %128, %129, 1, 1, 1, 0, 0;\n"
               : BW_F128 : "l"(da), "l"(db) : "memory");
}
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 da, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BW_D64 ", %64, %65, 1, 1, 1, 0, 0;\n"
               : BW_F64 : "l"(da), "l"(db) : "memory");
}
__device__ __forceinline__ void wgmma_ss(float (&d)[32], u64 da, u64 db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " BW_D32 ", %32, %33, 1, 1, 1, 0, 0;\n"
               : BW_F32 : "l"(da), "l"(db) : "memory");
}
#undef BW_R0_31
#undef BW_R32_63
#undef BW_R64_127
#undef BW_D32
#undef BW_D64
#undef BW_D128
#undef BW_F8
#undef BW_F32
#undef BW_F64
#undef BW_F128

// A consumer thread's accumulators to Y: d[4i + 2h + j] is weight row r0 + 8h (a Y column: r0 or
// r1 = r0 + 8, stored where ok0 / ok1) and token m0 + 8i + 2q + j (a Y row, stored below M); the 8
// lanes of one q write 8 consecutive columns (32 bytes) of a row. bf: rounded to bf16.
template <int BN>
__device__ __forceinline__ void bw_store(const float (&d)[BN / 2], float* __restrict__ Y, int ldy, int M, int m0,
                                         int r0, int r1, bool ok0, bool ok1, int bf, int q) {
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int t = m0 + 8 * i + 2 * q + j;
      if (t < M) {
        float* y = Y + (size_t)t * ldy;
        const float v0 = d[4 * i + j], v1 = d[4 * i + 2 + j];
        if (ok0) y[r0] = bf ? round_bf16f(v0) : v0;
        if (ok1) y[r1] = bf ? round_bf16f(v1) : v1;
      }
    }
  }
}

// A producer thread's part of chunk c's token tile at dst (the tile's base): token rows m0 .. m0 +
// 255 of X (bf16 rows of ldx elements, K in the GEMM's order; src: this thread's first 16 bytes of
// chunk 0), each 128-byte row to its swizzled place, rows past M zero-filled.
__device__ __forceinline__ void bw_copy_tokens(u32 dst, const u8* src, int ldx, int M, int m0, int c) {
  const int t = threadIdx.x - 256, r8 = t >> 3, c8 = t & 7;
  wg_copy_rows<16, 16>(dst + wg_swz(r8, c8), 2048, src + 128 * (size_t)c, (size_t)16 * ldx * 2, M - m0 - r8);
}
// A TMA tensor map (CUtensorMap: 128 opaque bytes, 64-aligned), encoded by the host
// (engine/ops/gpu/tma.py) and passed as a __grid_constant__ parameter.
struct __align__(64) TmaMap {
  u64 w[16];
};
// The tx-count of this phase raised by `bytes` (the copies that will complete it), with an arrival.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// The box of `map` at (x: inner element, y: row) to shared dst (its swizzle as the map's), completing
// `bytes` of bar's tx-count as it lands; elements past the tensor's dimensions arrive as zeros.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int x, int y, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"((u64)map), "r"(x), "r"(y), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"((u64)map) : "memory");
}
// This producer thread's first 16 bytes of the token tile (chunk c0 of row m0 + t / 8, clamped to M - 1).
__device__ __forceinline__ const u8* bw_token_src(const u8* X, int ldx, int M, int m0, int c0) {
  const int t = threadIdx.x - 256;
  return X + (size_t)min(m0 + (t >> 3), M - 1) * ldx * 2 + 16 * (t & 7) + 128 * (size_t)c0;
}
// A consumer warpgroup whose weight rows are all past N, over C chunks of a ring of ST stages (full
// barriers from bar, then the empty ones): waits for each stage and releases it for the producer.
template <int ST>
__device__ __forceinline__ void bw_idle(u32 bar, int C) {
  for (int c = 0; c < C; ++c) {
    mbar_wait(bar + 8 * (c % ST), (c / ST) & 1);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar + 8 * (ST + c % ST));
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
