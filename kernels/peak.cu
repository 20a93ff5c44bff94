// The tensor cores' FP8 rate (e4m3 x e4m3 -> f32), for `bench`'s prefill floor under DeepSeek's
// numerics: every block multiplies operands already in shared memory over and over, with no
// global memory traffic, so the rate is the MMA issue rate alone.
//
// sm_90a: wgmma.mma_async m64n128k32 from shared-memory descriptors (the only instruction that
// reaches Hopper's FP8 rate; mma.sync issues at a fraction of it), two warpgroups a block, each
// chaining its wgmmas into one accumulator as a GEMM's K loop does, waiting once per batch.
// Other targets: mma.sync m16n8k32 e4m3, a lower bound of the rate there (Blackwell's own FP8
// MMA is tcgen05, not written here); bench labels which one ran.
// Descriptor fields follow the PTX ISA's "Matrix Descriptor Format" for wgmma: start address,
// leading- and stride-dimension byte offsets (all >> 4), no swizzle. The operands' contents only
// need to be finite e4m3 codes: the result is discarded.
#include "dsuf_common.cuh"

#define PEAK_TILE 12288  // A: 2 warpgroups x 64 x 32 bytes; B: 128 x 32 bytes
#define PEAK_BATCH 8     // wgmmas issued between waits

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ u64 peak_desc(const void* p, u32 lbo, u32 sbo) {
  const u32 a = (u32)__cvta_generic_to_shared(p);
  return (u64)((a & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

__device__ __forceinline__ void peak_wgmma(float* d, u64 da, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db));
}
#endif

extern "C" __global__ void __launch_bounds__(256) mma_peak_fp8(float* __restrict__ out, int iters) {
  __shared__ __align__(128) u8 tile[PEAK_TILE];
  for (int i = threadIdx.x; i < PEAK_TILE; i += blockDim.x) tile[i] = (u8)((i * 37 + 11) & 0x37);  // |x| < 1
  __syncthreads();
  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // 8-row x 16-byte core matrices, K-major: 2 along K (LBO 128 bytes), then the next 8 rows (SBO 256)
  const u64 da = peak_desc(tile + (threadIdx.x >> 7) * 2048, 128, 256), db = peak_desc(tile + 4096, 128, 256);
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < PEAK_BATCH; ++j) peak_wgmma(d, da, db);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
#else
  const int lane = threadIdx.x & 31;
  const u32* a = (const u32*)tile + (threadIdx.x >> 5) * 64;
  const u32 a0 = a[lane], a1 = a[lane ^ 1], a2 = a[lane ^ 2], a3 = a[lane ^ 3], b0 = a[lane ^ 4], b1 = a[lane ^ 5];
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {  // 16 independent accumulators of 4: 64 registers, as on sm_90a
      float* c = d + 4 * j;
      asm volatile(
          "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
#endif
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += d[i];
  if (s == 1234.5f) out[0] = s;  // (never true in practice; keeps the work from being removed)
}

// Multiply-adds of one block's run of `iters`: what the host divides the time into.
// sm_90a: 2 warpgroups x iters x PEAK_BATCH x (64 x 128 x 32); else: 8 warps x iters x 16 x (16 x 8 x 32).
