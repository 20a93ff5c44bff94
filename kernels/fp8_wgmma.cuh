// The sm_90a wgmma FP8 GEMM's machinery (kernels/fp8_gemm.cu and kernels/fp8_grouped.cu): one
// block's 128 x 128 tile of Y from a producer warpgroup and two consumer warpgroups.
#pragma once
#include "fp8_mma.cuh"

// A block of 384 threads computes a 128 x 128 tile of Y: warpgroups 0 and 1 (consumers) each own 64
// rows and issue wgmma.mma_async m64n128k32 e4m3 x e4m3 -> f32 with both operands in shared memory;
// warpgroup 2 (producer) fills a WG_STAGES-deep ring of K stages (128 bytes of K per row: one
// 128-byte swizzle row, 4 k32 steps) and hands them over through mbarriers (full: data landed;
// empty: both consumers' wgmmas that read it have completed). setmaxnreg moves registers from the
// producer to the consumers (three 64-float accumulator sets each).
//
// Loads: cp.async 16-byte copies, each written straight to its 128B-swizzled place. TMA
// (cp.async.bulk.tensor) swizzles in hardware from a host-encoded tensor map; kernels/fp4_experts.cu
// takes its tokens so (engine/ops/gpu/tma.py), these kernels not yet. 1-D cp.async.bulk copies land
// linearly (no swizzle) and cannot zero-fill rows past M or N. cp.async takes a source size (0: zeros) and
// reports completion to an mbarrier (cp.async.mbarrier.arrive.noinc), so one thread per row chunk
// needs no wait of its own. Copies land through the generic proxy, wgmma reads through the async
// proxy: each consumer runs fence.proxy.async after its full-barrier wait (PTX ISA, memory
// consistency model: a proxy fence on the causality path orders them).
//
// Promotion: scales change every 32 along K, so each k32 wgmma writes a fresh accumulator
// (scale-d = 0) and the thread adds acc * (sa[row] * sw[col]) to its f32 total. Two accumulator
// sets alternate: wgmma.wait_group 1 leaves step g in flight on the tensor core while step g - 1
// is promoted. FP8 weights in blocks of whole 32-column groups (V4.1's 32 x 32, V4's 128 x 128) take
// one weight scale per 32 columns and step (one FFMA per element); FP4 stages too where the producer
// could fold the weight exponents into the e4m3 codes (see wg_expand_fp4); otherwise a scale per
// column (FMUL + FFMA).
//
// FP4: the producer copies the stage's nibbles (and an aligned 8-byte window around each row's
// four UE8M0 scale bytes) to a staging area with cp.async, and WG_LAG stages later, once its own
// copies have landed (cp.async.wait_group), expands them into e4m3 bytes at their swizzled place
// in the B tile and the scales into f32, then fences (fence.proxy.async) and arrives. The
// producer warpgroup meets at named barrier 1 (bar.sync 1, 128) to share each stage's exponent
// ranges.
//
// Learned from (read, not copied): DeepGEMM's sm90 FP8 GEMMs (deepseek-ai/DeepGEMM,
// impls/sm90_fp8_gemm_1d2d.cuh, sm90_fp8_fp4_gemm_1d2d.cuh: producer and math warpgroups with a
// setmaxnreg split, promotion of per-block scales in registers, e2m1 -> e4m3 by __byte_perm); the PTX ISA
// sections "Asynchronous Warpgroup Level Matrix Multiply-Accumulate" (wgmma.mma_async .e4m3 is
// K-major only, k = 32; wgmma.fence / commit_group / wait_group), "Matrix Descriptor Format" and
// "Shared Memory Matrix Layout" (canonical K-major 128B-swizzle layout, see wg_swz), setmaxnreg,
// cp.async.mbarrier.arrive; CUTLASS's GmmaDescriptor and warpgroup_fence_operand.
#define WG_BM 128  // block rows (2 consumer warpgroups x 64)
#define WG_BN 128  // block columns (the wgmma N)
#define WG_BK 128  // K bytes per stage: one 128-byte swizzle row
#define WG_THREADS 384
#define WG_STAGES_FP8 6
#define WG_STAGES_FP4 5
#define WG_LAG 2                 // FP4: stages between a nibble copy and its expansion
#define WG_TILE_BYTES 16384      // WG_BM (= WG_BN) rows x WG_BK bytes
#define WG_SCALE_BYTES 2048      // [4 k32 steps][128 rows] f32
#define WG_STG_BYTES 9216        // FP4 staging: 128 rows x 64 nibble bytes, 128 x 8 scale bytes
#define WG_SCRATCH_BYTES 144     // FP4: 4 warps x 4 steps of exponent max and min, the fold flag
#define WG_SWIZZLE_MODE 1        // descriptor bits 62-63: 128-byte swizzle
#define WG_LBO 16                // leading byte offset: unused by swizzled K-major layouts
#define WG_SBO 1024              // stride byte offset: 8 rows x 128 bytes between core-matrix groups
// setmaxnreg split of the 168 a thread gets at 384 threads (128 x 56 + 256 x 224 = 384 x 168): the
// FP8 producer's 16 copies in flight spill at 40
#define WG_PRODUCER_REGS 56
#define WG_CONSUMER_REGS 224
// Whether one producer and two consumer warpgroups' setmaxnreg split fits the block's registers at
// launch (threads x the per-thread count the launch bounds allow, in units of 8): setmaxnreg.inc
// waits for registers from the block's own pool, so a split past it hangs every launch.
__host__ __device__ constexpr bool wg_split_fits(int threads, int producer, int consumer) {
  return 128 * producer + 256 * consumer <= threads * (65536 / threads / 8 * 8);
}
static_assert(wg_split_fits(WG_THREADS, WG_PRODUCER_REGS, WG_CONSUMER_REGS), "setmaxnreg split past the registers");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int FMT>
struct WgCfg {
  static constexpr int ST = FMT == FMT_FP8 ? WG_STAGES_FP8 : WG_STAGES_FP4;
  static constexpr u32 A = 0, B = ST * WG_TILE_BYTES, SA = 2 * ST * WG_TILE_BYTES, SW = SA + ST * WG_SCALE_BYTES,
                       STG = SW + ST * WG_SCALE_BYTES,
                       BAR = STG + (FMT == FMT_FP8 ? 0 : ST * WG_STG_BYTES),  // full[ST], then empty[ST]
                       SCR = BAR + 16 * ST;  // FP4: per stage, the exponent ranges and the fold flag
  static constexpr u32 FULL_COUNT = FMT == FMT_FP8 ? 128 : 256;  // FP4: + one plain arrive per producer thread
};

// Byte offset of 16-byte chunk c (0..7) of row r in a tile of 128-byte rows, 128B swizzle: the
// chunk index XOR the row's index within its 8-row (1024-byte) group, as the hardware applies it
// to address bits [4, 7) from bits [7, 10) (tiles are 1024-byte aligned).
__device__ __forceinline__ u32 wg_swz(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }

__device__ __forceinline__ u32 wg_smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void wg_cp16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void wg_cp4(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// n (0..4) bytes from src, zero-filled to 4, to shared dst (generic address p): a cp.async for a
// whole word or none (src-size 0, src any valid address); the word an array ends inside by plain
// loads and a shared store, since a cp.async reads its whole word whatever its src-size says (the
// expansion that reads it comes after cp.async.wait_group and a bar.sync of the producer warpgroup)
__device__ __forceinline__ void wg_cp4_clip(u8* p, u32 dst, const u8* src, int n) {
  if (n == 0 || n == 4) {
    wg_cp4(dst, src, n);
  } else {
    u32 v = 0;
    for (int j = 0; j < n; ++j) v |= (u32)src[j] << (8 * j);
    *(u32*)p = v;
  }
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// An arrive-on once all of this thread's earlier cp.async copies have landed (counted in init).
__device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// wgmma matrix descriptor: start address, LBO, SBO (each >> 4), base offset 0 (tiles 1024-aligned,
// k steps move the start by 32 bytes inside the first 128), swizzle mode.
__device__ __forceinline__ u64 wg_desc(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(WG_LBO >> 4) << 16) | ((u64)(WG_SBO >> 4) << 32) |
         ((u64)WG_SWIZZLE_MODE << 62);
}
// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
template <int R>
__device__ __forceinline__ void wg_fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#define WG_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
// d = A (64 x 32, K-major, descriptor da) * B (32 x 128, K-major, descriptor db); scale-d = 0: D is
// not read (a fresh accumulator for the step's promotion).
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], u64 da, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24), WG_F8(32), WG_F8(40), WG_F8(48), WG_F8(56)
      : "l"(da), "l"(db), "r"(0)
      : "memory");
}
#undef WG_F8
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// FP4: expand stage kt's staged nibbles (the chunks this thread copied) into the swizzled e4m3 B
// tile and its scale bytes into f32, then make them visible to the consumers' wgmma. kt: the stage's
// place in K; pos: its place in this block's run of stages (its ring slot).
__device__ __forceinline__ void wg_expand_fp4(u8* smem, u32 base, int kt, int pos, int K, int N, int n0, int gk) {
  using C = WgCfg<FMT_FP4>;
  const int t = threadIdx.x - 256, s = pos % C::ST, k0 = kt * WG_BK, nkk = min(4, (K - k0) / 32);
  const int lane = t & 31, warp = t >> 5;
  const u8* stg = smem + C::STG + s * WG_STG_BYTES;
  u8* bt = smem + C::B + s * WG_TILE_BYTES;
  int* scr = (int*)(smem + C::SCR + s * WG_SCRATCH_BYTES);
  float* sw = (float*)(smem + C::SW + s * WG_SCALE_BYTES);
  // Scale folding: when each step's UE8M0 exponents (clamped to [1, 254], as e8m0_scaled) span at
  // most 11 over the tile's rows, every row's e2m1 values times 2^(e - eref), eref = min(emin + 5,
  // 254), are e4m3 normals (0.5 * 2^-5 .. 6 * 2^6): the exponent moves into the codes exactly, and
  // the consumers promote with one scale 2^(eref - 127) per step (one FFMA per element, not two).
  const bool ok = n0 + t < N;
  const int off = (int)(((size_t)(n0 + t) * gk + k0 / 32) & 3);  // the bytes' place in the 8-byte window
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const u32 e = min(max((u32)stg[8192 + 8 * t + off + kk], 1u), 254u);
    const bool in = ok && kk < nkk;
    const u32 mx = __reduce_max_sync(0xffffffffu, in ? e : 0u), mn = __reduce_min_sync(0xffffffffu, in ? e : 255u);
    if (lane == 0) {
      scr[4 * warp + kk] = (int)mx;
      scr[16 + 4 * warp + kk] = (int)mn;
    }
  }
  asm volatile("bar.sync 1, 128;" ::: "memory");  // the producer warpgroup only
  bool fold = true;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int mx = max(max(scr[kk], scr[4 + kk]), max(scr[8 + kk], scr[12 + kk]));
    const int mn = min(min(scr[16 + kk], scr[20 + kk]), min(scr[24 + kk], scr[28 + kk]));
    if (kk < nkk) fold = fold && mx - mn <= 11;
  }
  const int c = t & 3;  // the k32 step of the 16 nibble bytes this thread copied, of rows r
  const int eref = min(min(min(scr[16 + c], scr[20 + c]), min(scr[24 + c], scr[28 + c])) + 5, 254);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = (t >> 2) + 32 * i;
    if (c < nkk) {
      const uint4 v = *(const uint4*)(stg + 64 * r + 16 * c);
      // folded: row r's table times 2^(e_r - eref), e_r - eref in -5 .. 6, so every nonzero byte's
      // exponent field stays 1 .. 15 (the fold's condition) and the lookup itself applies the scale
      u32 lo = E2M1_LO, hi = E2M1_HI, out[8];
      if (fold) {
        const int off_r = (int)(((size_t)(n0 + r) * gk + k0 / 32) & 3);
        e2m1_table(min(max((int)stg[8192 + 8 * r + off_r + c], 1), 254) - eref, lo, hi);
      }
      e2m1x32_to_e4m3(v, out, lo, hi);  // the step's 32 elements
      *(uint4*)(bt + wg_swz(r, 2 * c)) = make_uint4(out[0], out[1], out[2], out[3]);
      *(uint4*)(bt + wg_swz(r, 2 * c + 1)) = make_uint4(out[4], out[5], out[6], out[7]);
    }
  }
  for (int kk = 0; kk < nkk; ++kk) {
    const int mn = min(min(scr[16 + kk], scr[20 + kk]), min(scr[24 + kk], scr[28 + kk]));
    sw[128 * kk + t] = fold ? __uint_as_float((u32)min(mn + 5, 254) << 23)
                            : (ok ? e8m0_scaled(stg[8192 + 8 * t + off + kk], 0) : 0.f);
  }
  if (t == 0) scr[32] = fold;
  fence_proxy_async();
  mbar_arrive(base + C::BAR + 8 * s);
}

// NI 16-byte chunks of tile rows ROWS apart: from src (stride src_step) to dst (stride dst_step), rows
// at or past `rows` zero-filled (src, the first row, is clamped by the caller to one that exists).
template <int NI, int ROWS>
__device__ __forceinline__ void wg_copy_rows(u32 dst, int dst_step, const u8* src, size_t src_step, int rows) {
  const u8* p = src;
#pragma unroll
  for (int i = 0; i < NI; ++i, dst += dst_step, p += src_step) {
    const bool ok = ROWS * i < rows;
    wg_cp16(dst, ok ? p : src, ok ? 16 : 0);
  }
}

// Stages kt0 .. kt1 - 1 of K (all of it: 0 .. ceil(K / WG_BK)); the i-th of them takes ring slot
// i % ST.
template <int FMT>
__device__ __forceinline__ void wg_produce(u8* smem, u32 base, const u8* __restrict__ A, const float* __restrict__ SA,
                                           const u8* __restrict__ W,
                                           const void* __restrict__ SW, int M, int N, int K, int bn, int bk, int gk,
                                           int m0, int n0, int kt0, int kt1) {
  using C = WgCfg<FMT>;
  const int t = threadIdx.x - 256, T = kt1 - kt0, nbk = K / 32;
  // An operand tile is 128 rows x 8 chunks: 8 consecutive threads read one row's 128 bytes, thread t
  // chunk c8 of rows r8 + 16 i (one swizzle phase: 16 i is a multiple of 8). FP4 nibbles, 4 chunks
  // a row: chunk c4 of rows r4 + 32 i. Row t's activation scales and weight scales. Rows past M
  // read row M - 1 with source size 0.
  const int r8 = t >> 3, c8 = t & 7, r4 = t >> 2, c4 = t & 3;
  const u8* a_src = A + (size_t)min(m0 + r8, M - 1) * K + 16 * c8;
  const bool a_ok = m0 + t < M, w_ok = n0 + t < N;
  const float* sa_src = SA + (size_t)(a_ok ? m0 + t : 0) * nbk;
  const u8* w_src = FMT == FMT_FP8 ? W + (size_t)min(n0 + r8, N - 1) * K + 16 * c8
                                   : W + (size_t)min(n0 + r4, N - 1) * (K / 2) + 16 * c4;
  const float* sw_src = (const float*)SW + (FMT == FMT_FP8 && w_ok ? (size_t)((n0 + t) / bn) * gk : 0);
  for (int i = 0; i < T; ++i) {
    const int kt = kt0 + i, s = i % C::ST, k0 = kt * WG_BK, nkk = min(4, (K - k0) / 32);  // nkk: 4, or 2 at a K % 128 tail
    mbar_wait(base + C::BAR + 8 * (C::ST + s), ((i / C::ST) & 1) ^ 1);
    const u32 at = base + C::A + s * WG_TILE_BYTES, bt = base + C::B + s * WG_TILE_BYTES;
    const u32 sa = base + C::SA + s * WG_SCALE_BYTES, sw = base + C::SW + s * WG_SCALE_BYTES;
    if (c8 < 2 * nkk) {
      wg_copy_rows<8, 16>(at + wg_swz(r8, c8), 2048, a_src + k0, (size_t)16 * K, M - m0 - r8);
    }
    for (int kk = 0; kk < nkk; ++kk) wg_cp4(sa + 4 * (128 * kk + t), sa_src + k0 / 32 + kk, a_ok ? 4 : 0);
    if (FMT == FMT_FP8) {
      if (c8 < 2 * nkk) wg_copy_rows<8, 16>(bt + wg_swz(r8, c8), 2048, w_src + k0, (size_t)16 * K, N - n0 - r8);
      for (int kk = 0; kk < nkk; ++kk)
        wg_cp4(sw + 4 * (128 * kk + t), sw_src + (k0 + 32 * kk) / bk, w_ok ? 4 : 0);
      mbar_arrive_cp_async(base + C::BAR + 8 * s);
    } else {
      const u32 stg = base + C::STG + s * WG_STG_BYTES;
      if (c4 < nkk) wg_copy_rows<4, 32>(stg + 64 * r4 + 16 * c4, 2048, w_src + k0 / 2, (size_t)16 * K, N - n0 - r4);
      {  // row t's scale bytes k0/32 .. +3 lie in the 4-aligned 8 bytes from b0, both halves clipped to
         // the array (N * gk bytes, not always a multiple of 4) by wg_cp4_clip, the rest zero-filled
        const size_t b0 = ((size_t)(n0 + t) * gk + k0 / 32) & ~(size_t)3;
        const long long left = (long long)N * gk - (long long)b0;
        const int n0b = w_ok ? (int)(left < 0 ? 0 : (left > 4 ? 4 : left)) : 0;
        const int n1 = w_ok ? (int)(left < 4 ? 0 : (left > 8 ? 4 : left - 4)) : 0;
        u8* sstg = smem + (stg - base) + 8192 + 8 * t;
        wg_cp4_clip(sstg, stg + 8192 + 8 * t, (const u8*)SW + (n0b ? b0 : 0), n0b);
        wg_cp4_clip(sstg + 4, stg + 8192 + 8 * t + 4, (const u8*)SW + (n1 ? b0 + 4 : 0), n1);
      }
      mbar_arrive_cp_async(base + C::BAR + 8 * s);  // the A tile and its scales
      asm volatile("cp.async.commit_group;" ::: "memory");
      if (i >= WG_LAG) {
        asm volatile("cp.async.wait_group %0;" ::"n"(WG_LAG) : "memory");
        wg_expand_fp4(smem, base, kt - WG_LAG, i - WG_LAG, K, N, n0, gk);
      }
    }
  }
  if (FMT == FMT_FP4) {
    asm volatile("cp.async.wait_all;" ::: "memory");
    for (int i = T > WG_LAG ? T - WG_LAG : 0; i < T; ++i) wg_expand_fp4(smem, base, kt0 + i, i, K, N, n0, gk);
  }
}

// A consumer warp's side of the block's kt-th stage (counted from the first of its run, ring slot
// kt % ST): wait until it has landed (full barrier), and release it once the warp is done with it
// (empty barrier: one arrive per consumer warp).
template <int FMT>
__device__ __forceinline__ void wg_wait_full(u32 base, int kt) {
  using C = WgCfg<FMT>;
  mbar_wait(base + C::BAR + 8 * (kt % C::ST), (kt / C::ST) & 1);
}
template <int FMT>
__device__ __forceinline__ void wg_release(u32 base, int kt) {
  using C = WgCfg<FMT>;
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(base + C::BAR + 8 * (C::ST + kt % C::ST));
}

// The scales step kk of ring stage s promotes with, read from shared memory before the wgmma wait
// that precedes their use (read after it, each load's latency stalled the promotion's first
// multiply). G32 (each 32 columns of the tile share one weight scale: FP8 blocks bn a multiple of
// 32, as both releases' 32 x 32 and 128 x 128; FP4 stages whose exponents the producer folded): the
// 2 rows x 4 column groups of scale products; otherwise the two row scales (the weight's come per
// column, in wg_promote).
struct WgScales {
  float a[8];  // (G32: all 8; otherwise a[0], a[1])
};
template <int FMT, bool G32>
__device__ __forceinline__ WgScales wg_scales(const u8* smem, int s, int kk, int rl) {
  using C = WgCfg<FMT>;
  const float* sa = (const float*)(smem + C::SA + s * WG_SCALE_BYTES) + 128 * kk;
  const float s0 = sa[rl], s1 = sa[rl + 8];
  WgScales r = {};
  if (G32) {
    const float* sw = (const float*)(smem + C::SW + s * WG_SCALE_BYTES) + 128 * kk;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const float w = sw[32 * g];
      r.a[2 * g] = s0 * w;
      r.a[2 * g + 1] = s1 * w;
    }
  } else {
    r.a[0] = s0;
    r.a[1] = s1;
  }
  return r;
}

// acc * (sa[row] * sw[col]) into tot for k32 step kk of ring stage s (this thread's fragment: d[4i +
// 2h + c] is row 16 warp + lane / 4 + 8h of the warpgroup's 64, column 8i + 2 (lane % 4) + c), the
// step's scales in sc (wg_scales): G32 spends one FFMA per element; otherwise a scale per column
// (FMUL + FFMA).
template <int FMT, bool G32>
__device__ __forceinline__ void wg_promote(float (&tot)[64], const float (&d)[64], const WgScales& sc,
                                           const u8* smem, int s, int kk, int q) {
  using C = WgCfg<FMT>;
  if (G32) {
#pragma unroll
    for (int g = 0; g < 4; ++g) {  // columns 32 g .. 32 g + 31: fragments i = 4 g .. 4 g + 3
      const float a0 = sc.a[2 * g], a1 = sc.a[2 * g + 1];
#pragma unroll
      for (int i = 4 * g; i < 4 * g + 4; ++i) {
        tot[4 * i] += d[4 * i] * a0;
        tot[4 * i + 1] += d[4 * i + 1] * a0;
        tot[4 * i + 2] += d[4 * i + 2] * a1;
        tot[4 * i + 3] += d[4 * i + 3] * a1;
      }
    }
  } else {
    const float* sw = (const float*)(smem + C::SW + s * WG_SCALE_BYTES) + 128 * kk;
    const float s0 = sc.a[0], s1 = sc.a[1];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float2 w = *(const float2*)(sw + 8 * i + 2 * q);
      tot[4 * i] += d[4 * i] * (s0 * w.x);
      tot[4 * i + 1] += d[4 * i + 1] * (s0 * w.y);
      tot[4 * i + 2] += d[4 * i + 2] * (s1 * w.x);
      tot[4 * i + 3] += d[4 * i + 3] * (s1 * w.y);
    }
  }
}

// Issues k32 step kk of ring stage s into d: both operands K-major from the swizzled tiles, the
// descriptors' start moved 32 bytes per step inside the 128-byte row (the hardware swizzles the
// computed address, as the producer did).
__device__ __forceinline__ void wg_issue(float (&d)[64], u32 at, u32 bt, int kk) {
  wg_fence_regs(d);
  wgmma_fence();
  wgmma_m64n128k32(d, wg_desc(at + 32 * kk), wg_desc(bt + 32 * kk));
  wgmma_commit();
}

// One ring stage: its k32 steps alternate between d0 and d1, each promoted while the next is in
// flight (the last one after wait_group 0). A stage is one straight-line stretch: ptxas serializes
// all wgmmas of a function where one is in flight across a loop's back edge.
template <int FMT, bool G32, int NKK>
__device__ __forceinline__ void wg_stage(float (&tot)[64], float (&d0)[64], float (&d1)[64], const u8* smem, u32 base,
                                         int kt, int wg, int rl, int q) {
  using C = WgCfg<FMT>;
  const int s = kt % C::ST;
  wg_wait_full<FMT>(base, kt);
  fence_proxy_async();  // the producer's generic-proxy writes, before the async-proxy reads
  const u32 at = base + C::A + s * WG_TILE_BYTES + 64 * 128 * wg, bt = base + C::B + s * WG_TILE_BYTES;
  WgScales sc = wg_scales<FMT, G32>(smem, s, 0, rl);
  wg_issue(d0, at, bt, 0);
  wg_issue(d1, at, bt, 1);
  wgmma_wait<1>();
  wg_fence_regs(d0);
  wg_promote<FMT, G32>(tot, d0, sc, smem, s, 0, q);
  if (NKK == 4) {
    sc = wg_scales<FMT, G32>(smem, s, 1, rl);
    wg_issue(d0, at, bt, 2);
    wgmma_wait<1>();
    wg_fence_regs(d1);
    wg_promote<FMT, G32>(tot, d1, sc, smem, s, 1, q);
    sc = wg_scales<FMT, G32>(smem, s, 2, rl);
    wg_issue(d1, at, bt, 3);
    wgmma_wait<1>();
    wg_fence_regs(d0);
    wg_promote<FMT, G32>(tot, d0, sc, smem, s, 2, q);
  }
  sc = wg_scales<FMT, G32>(smem, s, NKK - 1, rl);
  wgmma_wait<0>();
  wg_fence_regs(d1);
  wg_promote<FMT, G32>(tot, d1, sc, smem, s, NKK - 1, q);
  wg_release<FMT>(base, kt);  // the stage's operands and scales are free for the producer
}

// FP4: whether the producer folded the stage's weight scales into its codes (one scale per step)
// is known once the stage has landed; the choice is made before any wgmma is in flight.
template <int FMT, bool G32, int NKK>
__device__ __forceinline__ void wg_stage_any(float (&tot)[64], float (&d0)[64], float (&d1)[64], const u8* smem,
                                             u32 base, int kt, int wg, int rl, int q) {
  using C = WgCfg<FMT>;
  if (FMT == FMT_FP4) {
    const int s = kt % C::ST;
    wg_wait_full<FMT>(base, kt);
    if (*(const int*)(smem + C::SCR + s * WG_SCRATCH_BYTES + 128)) {
      wg_stage<FMT, true, NKK>(tot, d0, d1, smem, base, kt, wg, rl, q);
      return;
    }
  }
  wg_stage<FMT, G32, NKK>(tot, d0, d1, smem, base, kt, wg, rl, q);
}

// Stages kt0 .. kt1 - 1 of K, the i-th in ring slot i % ST (as wg_produce fills them).
template <int FMT, bool G32>
__device__ __forceinline__ void wg_consume(const u8* smem, u32 base, float* __restrict__ Y, int ldy, int M, int N,
                                           int K, int m0, int n0, int bf, int kt0, int kt1) {
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, q = lane & 3;
  const int rl = 64 * wg + 16 * warp + (lane >> 2);  // this thread's first row in the block
  float tot[64] = {}, d0[64] = {}, d1[64] = {};
  const int T4 = min(kt1, K / WG_BK) - kt0;  // whole stages; then half a stage when K % 128 == 64
  for (int i = 0; i < T4; ++i) wg_stage_any<FMT, G32, 4>(tot, d0, d1, smem, base, i, wg, rl, q);
  if (kt0 + T4 < kt1) wg_stage_any<FMT, G32, 2>(tot, d0, d1, smem, base, T4, wg, rl, q);

  const bool pairs = (ldy & 1) == 0 && ((size_t)Y & 7) == 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int n = n0 + 8 * i + 2 * q;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + rl + 8 * h;
      if (r < M && n < N) {
        float* y = Y + (size_t)r * ldy + n;
        const float y0 = tot[4 * i + 2 * h], y1 = tot[4 * i + 2 * h + 1];
        const float v0 = bf ? round_bf16f(y0) : y0, v1 = bf ? round_bf16f(y1) : y1;
        if (pairs && n + 1 < N) {
          *(float2*)y = make_float2(v0, v1);
        } else {
          y[0] = v0;
          if (n + 1 < N) y[1] = v1;
        }
      }
    }
  }
}

// A consumer warpgroup with no rows (a MoE segment of at most 64 rows): the other one's wgmmas get the
// tensor core to themselves; the ring's protocol still runs (its warps release each stage).
template <int FMT>
__device__ __forceinline__ void wg_idle(u32 base, int stages) {
  for (int i = 0; i < stages; ++i) {
    wg_wait_full<FMT>(base, i);
    wg_release<FMT>(base, i);
  }
}

// The tile of Y at rows m0.., columns n0.. (from A's rows m0..) over K's stages kt0 .. kt1 - 1 (all
// of K: 0 .. ceil(K / WG_BK); split K sums a part of it); bf: Y rounded to bf16 as stored.
template <int FMT>
__device__ __forceinline__ void wg_gemm(u8* raw, const u8* A, const float* SA, const u8* W,
                                        const void* SW, float* Y, int ldy, int M, int N, int K, int bn, int bk, int gk,
                                        int m0, int n0, int bf, int kt0, int kt1) {
  using C = WgCfg<FMT>;
  const u32 raw_addr = wg_smem_u32(raw), pad = (1024u - (raw_addr & 1023u)) & 1023u;  // swizzle atoms: 1024-aligned
  u8* smem = raw + pad;
  const u32 base = raw_addr + pad;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::ST; ++s) {
      mbar_init(base + C::BAR + 8 * s, C::FULL_COUNT);
      mbar_init(base + C::BAR + 8 * (C::ST + s), 8);  // one arrive per consumer warp
    }
  }
  __syncthreads();
  if (threadIdx.x >= 256) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WG_PRODUCER_REGS));
    wg_produce<FMT>(smem, base, A, SA, W, SW, M, N, K, bn, bk, gk, m0, n0, kt0, kt1);
  } else if (m0 + 64 * (int)(threadIdx.x >> 7) >= M) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WG_PRODUCER_REGS));
    wg_idle<FMT>(base, kt1 - kt0);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(WG_CONSUMER_REGS));
    // one weight scale per 32 columns and k32 step when the (bn x bk) blocks are whole 32-column groups
    if (FMT == FMT_FP8 && bn % 32 == 0) wg_consume<FMT, true>(smem, base, Y, ldy, M, N, K, m0, n0, bf, kt0, kt1);
    else wg_consume<FMT, false>(smem, base, Y, ldy, M, N, K, m0, n0, bf, kt0, kt1);
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
