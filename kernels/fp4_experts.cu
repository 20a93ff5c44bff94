// The routed experts' FP4 linears of a prompt chunk (--numerics deepseek) on bf16 wgmma, the
// weights as the register operand: Y rows = each MoE pair's act_quant'ed row times its expert's
// e2m1 weight with UE8M0 scales per 32, f32 sums (engine/ops/gpu/fp4_experts.py).
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
// decoded once serves up to 256 tokens. Two ways to the A operand (the weights):
// - FP4 experts (gemm_fp4_experts_sm90, fd_*): the producer also decodes each chunk's 128 weight
//   rows into a bf16 tile of the stage, and the consumers issue both operands from shared memory.
// - FP8 and bf16 weights (gemm_fp8w_bf16_sm90, gemm_bf16w_sm90, bw_*; learned from, not copied: the
//   "weights in registers" mixed-input GEMMs, vLLM's Machete and CUTLASS's sm90 mixed-input
//   mainloop): each consumer loads its rows into registers (bw_load) and converts them there, A
//   from registers.
//
// K order: any order of K that both operands share gives the dot product's terms; each path takes
// the one its weights' decode finds cheapest, and the tokens' bf16 rows are written in it.
// - Register operand (bf16_rows, bw_store_quad): a thread's A fragment for k16 step s holds columns
//   2q, 2q+1, 2q+8, 2q+9 of rows g and g+8 (q = lane % 4, g = lane / 4). Each thread loads 16
//   consecutive weight elements of a 64-wide K chunk for its two rows, physical k = 16q + 4s + 2h +
//   j going to step s, column 2q + 8h + j (logical L = 16s + 8h + 2q + j holds physical 16q + 4s +
//   2h + j).
// - FP4 experts (act_quant_bf16w, fd_store_quad): within each 8 of K, physical j and 4 + j (j = 0..3)
//   at logical 2j and 2j + 1, so that one 32-bit word of codes (8 nibbles) shifted by 4j holds the
//   pair's two nibbles in the two bf16 halves (fd_decode_row).
#include "fp8_mma.cuh"
#include "fp8_wgmma.cuh"

// Four consecutive values of row m, quad c (elements 4c .. 4c + 3), as bf16 at their places in the
// GEMM's K order: physical quad (q, st) = (cb / 4, cb % 4) of the 64-chunk -> logical 16 st + 2 q (+ 8).
__device__ __forceinline__ void bw_store_quad(u32* __restrict__ out, int m, int K, int c, const float (&e)[4]) {
  const int cb = c & 15, L = 16 * (cb & 3) + 2 * (cb >> 2);
  u32* row = out + ((size_t)m * K + 64 * (c >> 4) + L) / 2;
  row[0] = pack_bf16x2(e[0], e[1]);
  row[4] = pack_bf16x2(e[2], e[3]);
}

// Four consecutive values of row m, quad c (elements 4c .. 4c + 3), as bf16 at their places in
// gemm_fp4_experts_sm90's K order: within each 8, element j at logical 2j and 4 + j at 2j + 1.
__device__ __forceinline__ void fd_store_quad(u32* __restrict__ out, int m, int K, int c, const float (&e)[4]) {
  unsigned short* row = (unsigned short*)out + (size_t)m * K + 8 * (c >> 1) + (c & 1);
#pragma unroll
  for (int j = 0; j < 4; ++j) row[2 * j] = (unsigned short)(pack_bf16x2(e[j], 0.f) & 0xffffu);
}

// act_quant_bf16w: the reference's act_quant (as act_quant_fp8) of x [M, K] f32 (bf: rounded to
// bf16 first), written as the bf16 values codes * scale [M, K] (exact) in gemm_fp4_experts_sm90's K
// order within each 8. grid (ceil(M * K / 4 / 256)), block 256; K % 64 == 0.
extern "C" __global__ void act_quant_bf16w(const float* __restrict__ x, int ldx, u32* __restrict__ out, int M,
                                           int K, int bf) {
  const int q4 = K / 4;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = i < (long long)M * q4;
  const int m = live ? (int)(i / q4) : 0, c = live ? (int)(i % q4) : 0;
  const float4 v = live ? __ldg((const float4*)(x + (size_t)m * ldx) + c) : make_float4(0.f, 0.f, 0.f, 0.f);
  float s;
  const u32 w = act_quant4(v, bf, s);
  if (live) {
    float e[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) e[j] = e4m3_raw((w >> (8 * j)) & 0xffu) * (s * 256.f);
    fd_store_quad(out, m, K, c, e);
  }
}

// bf16_rows: x [M, K] f32 rounded to bf16 (round to nearest even), in the GEMM's K order within each
// 64 (gemm_fp8w_bf16_sm90's X). grid (ceil(M * K / 4 / 256)), block 256; K % 64 == 0.
extern "C" __global__ void bf16_rows(const float* __restrict__ x, int ldx, u32* __restrict__ out, int M, int K) {
  const int q4 = K / 4;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)M * q4) return;
  const int m = (int)(i / q4), c = (int)(i % q4);
  const float4 v = __ldg((const float4*)(x + (size_t)m * ldx) + c);
  const float e[4] = {v.x, v.y, v.z, v.w};  // (pack_bf16x2 rounds to nearest even)
  bw_store_quad(out, m, K, c, e);
}

// Y[i] = part[i] + part[pstride + i] + ... (splits of them, in that order), rounded to bf16 with bf:
// the split-K sums of gemm_fp8w_bf16_sm90 / gemm_bf16w_sm90 (n = M * ldy). grid (ceil(n / 256)),
// block 256.
extern "C" __global__ void bw_sum_splits(const float* __restrict__ part, long long pstride, int splits,
                                         float* __restrict__ Y, long long n, int bf) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float a = __ldg(part + i);
  for (int z = 1; z < splits; ++z) a += __ldg(part + z * pstride + i);
  Y[i] = bf ? round_bf16f(a) : a;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BW_BM 128            // weight rows per block: two consumer warpgroups x 64
#define BW_BN 256            // token rows per block: the wgmma N
#define BW_STAGES 6          // ring of token tiles, 64 bf16 of K (one 128-byte swizzle row) each
#define BW_TILE_BYTES 32768  // BW_BN rows x 128 bytes
#define BW_THREADS 384
#define BW_PRODUCER_REGS 48  // (its 16 copies in flight spill at 40)
#define BW_CONSUMER_REGS 224  // 128 x 48 + 256 x 224 <= 384 x 168, the block's registers at launch
static_assert(wg_split_fits(BW_THREADS, BW_PRODUCER_REGS, BW_CONSUMER_REGS), "setmaxnreg split past the registers");
#define BW_BAR (BW_STAGES * BW_TILE_BYTES)  // full[ST], then empty[ST]

#define BW_2P112 0x77807780u  // 2^112 as bf16x2
#define BW_ONE2 0x3f803f80u  // 1.0 as bf16x2
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// Two e4m3 codes (bits 0..15) times 2^d as bf16x2 (low code in the low half); sc2: 2^(112 + d) in
// both halves. cvt gives the f16 values exactly (all normals); shifting an f16's exponent and top
// mantissa bits down by 3 makes a bf16 of the value * 2^-112 (a normal again, zero stays zero), and
// one bf16 multiply applies the scale exactly.
__device__ __forceinline__ u32 e4m3x2_bf16x2(u32 w, u32 sc2) {
  u32 h;
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h) : "r"(w));
  const u32 v = ((h & 0x7fff7fffu) >> 3) | (h & 0x80008000u);
  return bf16x2_mul(v, sc2);
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

// A thread's weights for one 64-wide K chunk: 16 elements of rows g and g + 8 of its warp's 16 (FP8:
// 16 bytes each), and their scales' exponent fields (the f32 power-of-two block scale's). bf16: 32
// bytes a row (row g in r0, r1; row g + 8 in r2, r3), no scale.
template <int FMT>
struct BwChunk {
  uint4 r0, r1;
  u32 e0, e1;
};
template <>
struct BwChunk<FMT_BF16> {
  uint4 r0, r1, r2, r3;
};

template <int FMT>
__device__ __forceinline__ void bw_load(BwChunk<FMT>& ch, const u8* w0, const u8* w1, const void* SW, int r0, int r1,
                                        bool ok0, bool ok1, int bn, int bk, int gk, int c, int q) {
  const int k = 64 * c + 16 * q;
  if constexpr (FMT == FMT_BF16) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    ch.r0 = ok0 ? ldg16(w0 + 2 * k) : z;
    ch.r1 = ok0 ? ldg16(w0 + 2 * k + 16) : z;
    ch.r2 = ok1 ? ldg16(w1 + 2 * k) : z;
    ch.r3 = ok1 ? ldg16(w1 + 2 * k + 16) : z;
  } else {
    ch.r0 = ok0 ? ldg16(w0 + k) : make_uint4(0, 0, 0, 0);
    ch.r1 = ok1 ? ldg16(w1 + k) : make_uint4(0, 0, 0, 0);
    // rows g and g + 8 share a block row (bn % 16 == 0); a clamped row's zeros take any scale
    ch.e0 = (__float_as_uint(__ldg((const float*)SW + (size_t)(r0 / bn) * gk + k / bk)) >> 23) & 0xffu;
    ch.e1 = ch.e0;
  }
}

// bf16 weights: physical elements 4s .. 4s + 3 of each row are words 2s, 2s + 1 of its 32 bytes.
// Times 1 in bf16 (exact): with fragments that are plain copies of the loaded words, ptxas reuses
// a word's register for the next chunk's load while the wgmma reading it is still in flight
// (tools/dev/wgmma_hazards.py finds such writes).
__device__ __forceinline__ void bw_bf16_step(u32 (&f)[4], const BwChunk<FMT_BF16>& ch, int s) {
  const uint4& a = s < 2 ? ch.r0 : ch.r1;
  const uint4& b = s < 2 ? ch.r2 : ch.r3;
  const int i = 2 * (s & 1);
  f[0] = bf16x2_mul(word(a, i), BW_ONE2);
  f[1] = bf16x2_mul(word(b, i), BW_ONE2);
  f[2] = bf16x2_mul(word(a, i + 1), BW_ONE2);
  f[3] = bf16x2_mul(word(b, i + 1), BW_ONE2);
}

// k16 step s's fragment of a chunk: {row g cols 2q.., row g+8 cols 2q.., row g cols 2q+8.., row
// g+8 cols 2q+8..}, each a bf16x2 of the thread's physical elements 4s + 2h + (0, 1): FP8 codes to
// bf16 times the row's scale.
template <int FMT>
__device__ __forceinline__ void bw_convert_step(u32 (&f)[4], const BwChunk<FMT>& ch, int s) {
  if constexpr (FMT == FMT_BF16) {
    bw_bf16_step(f, ch, s);
    return;
  } else {
    const u32 w0 = word(ch.r0, s), w1 = word(ch.r1, s);  // 4 e4m3 codes of each row
    if (max(ch.e0, ch.e1) <= 142) {  // 2^(112 + d), d = e - 127 <= 15: one bf16 factor
      const u32 s0 = bw_scale2(ch.e0, 112), s1 = bw_scale2(ch.e1, 112);
      f[0] = e4m3x2_bf16x2(w0, s0);
      f[1] = e4m3x2_bf16x2(w1, s1);
      f[2] = e4m3x2_bf16x2(w0 >> 16, s0);
      f[3] = e4m3x2_bf16x2(w1 >> 16, s1);
    } else {  // scales over 2^15 (no real checkpoint's): 2^112, then 2^d
      const u32 s0 = bw_scale2(ch.e0, 0), s1 = bw_scale2(ch.e1, 0);
      f[0] = bf16x2_mul(e4m3x2_bf16x2(w0, BW_2P112), s0);
      f[1] = bf16x2_mul(e4m3x2_bf16x2(w1, BW_2P112), s1);
      f[2] = bf16x2_mul(e4m3x2_bf16x2(w0 >> 16, BW_2P112), s0);
      f[3] = bf16x2_mul(e4m3x2_bf16x2(w1 >> 16, BW_2P112), s1);
    }
  }
}

// Chunks of weights a consumer thread holds loaded ahead of its wgmmas (a ring in registers): a
// chunk's loads are issued D - 1 chunks before it is converted. A short token tile spends few tensor
// cycles a chunk, so its loads need more chunks ahead to cover DRAM's latency, and it has the
// registers for them (its accumulators are BN / 2).
template <int FMT, int BN>
__device__ constexpr int bw_depth() {
  return BN >= 256 ? 2 : BN >= 128 ? 4 : FMT == FMT_BF16 ? 4 : 8;
}

// Step f = 4c + s of the K loop (chunk c in ring slot i = c % D, k16 step s): issue its wgmma (its
// own commit group), wait for step f - 1, convert step f + 1's fragment (the one step f - 3 read);
// at s == 0 free chunk c - 1's token tile (its last step is f - 1). At s == 3 the next fragment is
// the next chunk's first, from slot (i + 1) % D, and slot i, all of its steps converted, loads chunk
// c + D. (Waiting for f - 1, not f - 3: the fragment converted next is the one step f - 3 read, and
// ptxas serializes every wgmma of the kernel when registers an in-flight wgmma reads are written.)
template <int FMT, int BN, int D>
__device__ __forceinline__ void bw_chunk(float (&d)[BN / 2], u32 (&fr)[4][4], BwChunk<FMT> (&ring)[D], u32 base,
                                         const u8* w0, const u8* w1, const void* SW, int r0, int r1, bool ok0,
                                         bool ok1, int bn, int bk, int gk, int c0, int c, int I, int C, int q) {
  mbar_wait(base + BW_BAR + 8 * (c % BW_STAGES), (c / BW_STAGES) & 1);
  fence_proxy_async();
  const u32 bt = base + (c % BW_STAGES) * BW_TILE_BYTES;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    wgmma_fence();
    wgmma_rs(d, fr[s], wg_desc(bt + 32 * s));
    wgmma_commit();
    wgmma_wait<1>();
    if (s == 0 && c >= 1) {
      __syncwarp();
      if ((threadIdx.x & 31) == 0) mbar_arrive(base + BW_BAR + 8 * (BW_STAGES + (c - 1) % BW_STAGES));
    }
    if (s < 3) {
      bw_convert_step<FMT>(fr[s + 1], ring[I], s + 1);
    } else {
      if (c + 1 < C) bw_convert_step<FMT>(fr[0], ring[(I + 1) % D], 0);
      if (c + D < C) bw_load<FMT>(ring[I], w0, w1, SW, r0, r1, ok0, ok1, bn, bk, gk, c0 + c + D, q);
    }
  }
}

template <int FMT, int BN>
__device__ __forceinline__ void bw_consume(u32 base, const u8* __restrict__ W, const void* __restrict__ SW,
                                           float* __restrict__ Y, int ldy, int M, int N, int K, int bn, int bk,
                                           int gk, int m0, int n0, int bf, int c0, int C) {
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2,
            q = lane & 3;
  const int r0 = n0 + 64 * wg + 16 * warp + g, r1 = r0 + 8;
  const bool ok0 = r0 < N, ok1 = r1 < N;
  const size_t row_bytes = FMT == FMT_BF16 ? (size_t)K * 2 : (size_t)K;
  const int rs0 = min(r0, N - 1), rs1 = min(r1, N - 1);  // (rows past N read row N - 1, as zeros)
  const u8* w0 = W + (size_t)rs0 * row_bytes;
  const u8* w1 = W + (size_t)rs1 * row_bytes;
  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
  u32 fr[4][4];
  constexpr int D = bw_depth<FMT, BN>();
  BwChunk<FMT> ring[D];
#pragma unroll
  for (int i = 0; i < D; ++i)
    if (i < C) bw_load<FMT>(ring[i], w0, w1, SW, rs0, rs1, ok0, ok1, bn, bk, gk, c0 + i, q);
  bw_convert_step<FMT>(fr[0], ring[0], 0);
  // D chunks an iteration, unrolled, so that each one's ring slot is a constant (registers, not local
  // memory)
  for (int cd = 0; cd < C; cd += D) {
#pragma unroll
    for (int i = 0; i < D; ++i)
      if (cd + i < C)
        bw_chunk<FMT, BN, D>(d, fr, ring, base, w0, w1, SW, rs0, rs1, ok0, ok1, bn, bk, gk, c0, cd + i, i, C, q);
  }
  wgmma_wait<0>();
  wg_fence_regs(d);
  bw_store<BN>(d, Y, ldy, M, m0, r0, r1, ok0, ok1, bf, q);
}

// A producer thread's part of chunk c's token tile at dst (the tile's base): token rows m0 .. m0 +
// 255 of X (bf16 rows of ldx elements, K in the GEMM's order; src: this thread's first 16 bytes of
// chunk 0), each 128-byte row to its swizzled place, rows past M zero-filled.
__device__ __forceinline__ void bw_copy_tokens(u32 dst, const u8* src, int ldx, int M, int m0, int c) {
  const int t = threadIdx.x - 256, r8 = t >> 3, c8 = t & 7;
  wg_copy_rows<16, 16>(dst + wg_swz(r8, c8), 2048, src + 128 * (size_t)c, (size_t)16 * ldx * 2, M - m0 - r8);
}
// This producer thread's first 16 bytes of the token tile (chunk c0 of row m0 + t / 8, clamped to M - 1).
__device__ __forceinline__ const u8* bw_token_src(const u8* X, int ldx, int M, int m0, int c0) {
  const int t = threadIdx.x - 256;
  return X + (size_t)min(m0 + (t >> 3), M - 1) * ldx * 2 + 16 * (t & 7) + 128 * (size_t)c0;
}

// The producer warpgroup: chunks c0 .. c0 + C - 1 of 64 of K, one a stage.
__device__ __forceinline__ void bw_produce(u32 base, const u8* __restrict__ X, int ldx, int M, int c0, int C,
                                           int m0) {
  const u8* src = bw_token_src(X, ldx, M, m0, c0);
  for (int c = 0; c < C; ++c) {
    const int s = c % BW_STAGES;
    mbar_wait(base + BW_BAR + 8 * (BW_STAGES + s), ((c / BW_STAGES) & 1) ^ 1);
    bw_copy_tokens(base + s * BW_TILE_BYTES, src, ldx, M, m0, c);
    mbar_arrive_cp_async(base + BW_BAR + 8 * s);
  }
}

// A consumer warpgroup whose weight rows are all past N: releases each stage for the producer.
__device__ __forceinline__ void bw_idle(u32 base, int C) {
  for (int c = 0; c < C; ++c) {
    mbar_wait(base + BW_BAR + 8 * (c % BW_STAGES), (c / BW_STAGES) & 1);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(base + BW_BAR + 8 * (BW_STAGES + c % BW_STAGES));
  }
}

// K chunks c0 .. c0 + C - 1 (all of K: c0 = 0, C = K / 64).
template <int FMT>
__device__ __forceinline__ void bw_gemm(u8* raw, const u8* X, int ldx, const u8* W, const void* SW, float* Y, int ldy,
                                        int M, int N, int K, int bn, int bk, int gk, int m0, int n0, int bf, int c0,
                                        int C) {
  const u32 raw_addr = wg_smem_u32(raw), pad = (1024u - (raw_addr & 1023u)) & 1023u;
  const u32 base = raw_addr + pad;
  if (threadIdx.x == 0) {
    for (int s = 0; s < BW_STAGES; ++s) {
      mbar_init(base + BW_BAR + 8 * s, 128);
      mbar_init(base + BW_BAR + 8 * (BW_STAGES + s), 8);
    }
  }
  __syncthreads();
  if (threadIdx.x >= 256) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(BW_PRODUCER_REGS));
    bw_produce(base, X, ldx, M, c0, C, m0);
  } else if (n0 + 64 * (int)(threadIdx.x >> 7) >= N) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(BW_PRODUCER_REGS));
    bw_idle(base, C);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(BW_CONSUMER_REGS));
    // the wgmma N by the tile's token rows: a short tile (a MoE segment's last rows, a chunk's
    // tail) computes no more than the next multiple of 64 of them
    const int rows = M - m0;
    if (rows > 128) bw_consume<FMT, 256>(base, W, SW, Y, ldy, M, N, K, bn, bk, gk, m0, n0, bf, c0, C);
    else if (rows > 64) bw_consume<FMT, 128>(base, W, SW, Y, ldy, M, N, K, bn, bk, gk, m0, n0, bf, c0, C);
    else bw_consume<FMT, 64>(base, W, SW, Y, ldy, M, N, K, bn, bk, gk, m0, n0, bf, c0, C);
  }
}

// ---- FP4 and FP8 weights decoded by the producer into shared memory (fd_*) ---------------------
// The consumers of the register-operand design above spent ~70 instructions per FP4 wgmma on the
// decode and its moves (Nsight Compute: issue slots 38% busy, the tensor pipe 40%), and a short tile
// (a segment's remainder, N 64) is all decode. Here the producer warpgroup decodes each chunk's
// 128 weight rows (one row per thread, the codes and scale bytes it copied itself LAG stages
// before) into a bf16 A tile of the stage, K-major with the 128-byte swizzle in the tokens' K order,
// and the consumers issue both operands from shared memory: four wgmmas a chunk, one commit group.
// A stage: tokens 32 KB, decoded weights 16 KB, and the staging of the codes (128 rows x 32 bytes
// of FP4 or 64 of FP8) and of each row's 4-byte window of UE8M0 scale bytes (one per 32 of K: FP4's
// own; an FP8 weight's power-of-two block scales as such bytes, made once by the host). FP4 rings 4
// stages, FP8 (twice the codes) 3: what fits a block's 227 KB.
#define FD_STAGES_FP4 4
#define FD_LAG_FP4 3  // stages between a code copy and its decode (fewer than the stages)
#define FD_STAGES_FP8 3
#define FD_LAG_FP8 2
#define FD_ATILE 16384  // BW_BM rows x 128 bytes of bf16
#define FD_2P127 0x7f007f00u  // 2^127 as bf16x2
// setmaxnreg moves registers within the block's allocation (384 x 168 at launch); setmaxnreg.inc waits
// for registers from that pool, so a split past it would hang every launch.
#define FD_PRODUCER_REGS 96
#define FD_CONSUMER_REGS 200
static_assert(wg_split_fits(BW_THREADS, FD_PRODUCER_REGS, FD_CONSUMER_REGS), "setmaxnreg split past the registers");
template <int FMT>
struct FdCfg {
  static constexpr int ST = FMT == FMT_FP4 ? FD_STAGES_FP4 : FD_STAGES_FP8;
  static constexpr int LAG = FMT == FMT_FP4 ? FD_LAG_FP4 : FD_LAG_FP8;
  static constexpr int CODES = FMT == FMT_FP4 ? 32 : 64;  // code bytes of a row's chunk
  static constexpr int STG = 128 * CODES + 128 * 4;       // staging: codes, then the scale windows
  static constexpr u32 A = ST * BW_TILE_BYTES, S = A + ST * FD_ATILE, BAR = S + ST * STG;  // full[ST], empty[ST]
  static constexpr u32 SMEM = BAR + 16 * ST + 1024;  // (+ the pad to 1024-byte alignment)
  // fd_row4 / fd_row8 make a code's bf16 its value times 2^-126 / 2^-120; the factor to its value
  // times a scale 2^(e - 127) is then the bf16 of exponent field e + BIAS (bw_scale2(e, BIAS))
  static constexpr u32 BIAS = FMT == FMT_FP4 ? 126 : 120;
  // where row t's 16-byte piece p of codes is staged: the pieces of a row rotated by the row, so that
  // the 8 rows a quarter-warp copies or reads hit 8 different 16-byte bank groups (rows CODES apart
  // alone would share 128 / CODES of them)
  static __device__ __forceinline__ int piece(int t, int p) {
    return CODES * t + 16 * (p ^ ((t / (128 / CODES)) & (CODES / 16 - 1)));
  }
};
static_assert(FdCfg<FMT_FP4>::SMEM <= 232448 && FdCfg<FMT_FP8>::SMEM <= 232448, "over a block's shared memory");
static_assert(FD_LAG_FP4 < FD_STAGES_FP4 && FD_LAG_FP8 < FD_STAGES_FP8, "a decode waiting for its own stage");

// x << n for n >= 0, x >> -n otherwise (n a compile-time constant after unrolling)
template <int n>
__device__ __forceinline__ u32 fd_shift(u32 x) {
  if constexpr (n >= 0) return x << n;
  else return x >> -n;
}

// FP4: weight row t's 8 logical 16-byte chunks of a stage's A tile at `at`: chunk b from code word w[b]
// (physical elements 8b .. 8b + 7, element i in bits 4i .. 4i + 3), bf16 pair j of it from nibbles j
// and 4 + j (the K order of act_quant_bf16w). A nibble's magnitude bits (e, m: e2m1 without its
// sign) placed at bf16 bits 6 .. 8 are a bf16 of its value times 2^-126: its exponent field e, its
// mantissa's top bit m, the subnormal e = 0 (0, 0.5) included. One bf16 multiply by 2^(e_s - 1)
// (ONE: the scale's exponent e_s <= 128; otherwise by 2^127, then 2^(e_s - 128)) makes it the
// value times the scale, exactly (a bf16 with at most 2 significant bits times a power of two);
// the sign goes in last (bit 15 of each half). f[0], f[1]: the first 32 of K's factors (f[0] 1 or
// 2^127, unused with ONE), f[2], f[3] the second 32's.
template <bool ONE>
__device__ __forceinline__ void fd_row4(u8* at, const u32 (&w)[8], const u32 (&f)[4], int t) {
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const u32 fa = b < 4 ? f[0] : f[2], sc = b < 4 ? f[1] : f[3], x = w[b];
    const u32 mag[4] = {fd_shift<6>(x) & 0x01c001c0u, fd_shift<2>(x) & 0x01c001c0u, fd_shift<-2>(x) & 0x01c001c0u,
                        fd_shift<-6>(x) & 0x01c001c0u};
    const u32 sgn[4] = {fd_shift<12>(x) & 0x80008000u, fd_shift<8>(x) & 0x80008000u, fd_shift<4>(x) & 0x80008000u,
                        x & 0x80008000u};
    u32 o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = (ONE ? bf16x2_mul(mag[j], sc) : bf16x2_mul(bf16x2_mul(mag[j], fa), sc)) ^ sgn[j];
    *(uint4*)(at + wg_swz(t, b)) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// FP8: weight row t's 8 logical 16-byte chunks from its 64 code bytes w (chunk b: physical elements
// 8b .. 8b + 7, words 2b and 2b + 1), bf16 pair j from codes j and 4 + j (act_quant_bf16w's K order):
// __byte_perm puts codes j of both words in the low (j even) or high bytes of the two bf16 halves.
// A code's magnitude bits (e4m3 without its sign) moved to bf16 bits 4 .. 10 are a bf16 of its
// value times 2^-120 (exponent field e, mantissa's top 3 bits m; the subnormal e = 0 included); the
// factors and the sign as fd_row4's.
template <bool ONE>
__device__ __forceinline__ void fd_row8(u8* at, const u32 (&w)[16], const u32 (&f)[4], int t) {
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const u32 fa = b < 4 ? f[0] : f[2], sc = b < 4 ? f[1] : f[3];
    const u32 v01 = __byte_perm(w[2 * b], w[2 * b + 1], 0x5410), v23 = __byte_perm(w[2 * b], w[2 * b + 1], 0x7632);
    const u32 mag[4] = {(v01 << 4) & 0x07f007f0u, (v01 >> 4) & 0x07f007f0u, (v23 << 4) & 0x07f007f0u,
                        (v23 >> 4) & 0x07f007f0u};
    const u32 sgn[4] = {(v01 << 8) & 0x80008000u, v01 & 0x80008000u, (v23 << 8) & 0x80008000u, v23 & 0x80008000u};
    u32 o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = (ONE ? bf16x2_mul(mag[j], sc) : bf16x2_mul(bf16x2_mul(mag[j], fa), sc)) ^ sgn[j];
    *(uint4*)(at + wg_swz(t, b)) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// Stage i's weight row t (the producer thread's own): its codes of chunk c0 + i and their two UE8M0
// bytes e0, e1, copied LAG stages before (this thread's cp.async groups have landed), decoded into
// row t of the stage's A tile (physical elements 0 .. 31 take 2^(e0 - 127), 32 .. 63 2^(e1 - 127)).
// ONE: both factors are bf16 numbers (e + BIAS <= 254: FP4 scales up to 2^1, FP8 up to 2^7; no real
// checkpoint's are larger); otherwise a larger one goes as 2^127, then the rest. Then the writes are
// made visible to the wgmmas' async proxy and the stage's full barrier gets this thread's second arrive.
template <int FMT>
__device__ __forceinline__ void fd_decode(u8* smem, u32 base, int i, int n0, int N, int gk, int c0) {
  using C = FdCfg<FMT>;
  const int t = threadIdx.x - 256, s = i % C::ST;
  const u8* stg = smem + C::S + s * C::STG;
  u32 w[C::CODES / 4];
#pragma unroll
  for (int p = 0; p < C::CODES / 16; ++p) {
    const uint4 v = *(const uint4*)(stg + C::piece(t, p));
    w[4 * p] = v.x, w[4 * p + 1] = v.y, w[4 * p + 2] = v.z, w[4 * p + 3] = v.w;
  }
  const int off = (int)(((size_t)min(n0 + t, N - 1) * gk + 2 * (c0 + i)) & 3);  // (0 or 2: gk is even)
  const u32 sb = *(const u32*)(stg + 128 * C::CODES + 4 * t) >> (8 * off);
  const u32 e0 = min(max(sb & 0xffu, 1u), 254u), e1 = min(max((sb >> 8) & 0xffu, 1u), 254u);
  u8* at = smem + C::A + s * FD_ATILE;
  const bool big0 = e0 + C::BIAS > 254, big1 = e1 + C::BIAS > 254;
  if (!big0 && !big1) {
    const u32 f[4] = {BW_ONE2, bw_scale2(e0, C::BIAS), BW_ONE2, bw_scale2(e1, C::BIAS)};
    if constexpr (FMT == FMT_FP4) fd_row4<true>(at, w, f, t);
    else fd_row8<true>(at, w, f, t);
  } else {
    const u32 f[4] = {big0 ? FD_2P127 : BW_ONE2, bw_scale2(e0, big0 ? C::BIAS - 127 : C::BIAS),
                      big1 ? FD_2P127 : BW_ONE2, bw_scale2(e1, big1 ? C::BIAS - 127 : C::BIAS)};
    if constexpr (FMT == FMT_FP4) fd_row4<false>(at, w, f, t);
    else fd_row8<false>(at, w, f, t);
  }
  fence_proxy_async();
  mbar_arrive(base + C::BAR + 8 * s);
}

// The producer warpgroup: for each chunk i of K (64), once its stage is free, the token rows m0 ..
// m0 + 255 (bw_copy_tokens), weight row n0 + t's code bytes and the aligned 4-byte window holding
// its two scale bytes (zeros past N) to the staging area; LAG chunks later, those landed, the decode
// (fd_decode). The full barrier counts both: 128 cp.async arrives and 128 plain ones. No deadlock:
// the stage of chunk i frees once the consumers are past chunk i - ST + 1, decoded before iteration
// i since LAG < ST.
template <int FMT>
__device__ __forceinline__ void fd_produce(u8* smem, u32 base, const u8* __restrict__ X, int ldx, int M, int m0,
                                           const u8* __restrict__ W, const u8* __restrict__ SW, int N, int K, int gk,
                                           int n0, int c0, int C) {
  using F = FdCfg<FMT>;
  const int t = threadIdx.x - 256;
  const u8* src = bw_token_src(X, ldx, M, m0, c0);
  const bool wok = n0 + t < N;
  const int row = min(n0 + t, N - 1);
  const u8* wsrc = W + (size_t)row * (K / 64 * F::CODES) + F::CODES * (size_t)c0;
  const long long sbytes = (long long)N * gk;
  for (int i = 0; i < C; ++i) {
    // first the decode of chunk i - LAG (its copies landed: LAG - 1 later groups may pend), so that
    // it never waits for a free stage; then chunk i's copies once its stage is free
    if (i >= F::LAG) {
      asm volatile("cp.async.wait_group %0;" ::"n"(F::LAG - 1) : "memory");
      fd_decode<FMT>(smem, base, i - F::LAG, n0, N, gk, c0);
    }
    const int s = i % F::ST;
    mbar_wait(base + F::BAR + 8 * (F::ST + s), ((i / F::ST) & 1) ^ 1);
    bw_copy_tokens(base + s * BW_TILE_BYTES, src, ldx, M, m0, i);
    const u32 st = base + F::S + s * F::STG;
#pragma unroll
    for (int p = 0; p < F::CODES / 16; ++p)
      wg_cp16(st + F::piece(t, p), wsrc + F::CODES * (size_t)i + 16 * p, wok ? 16 : 0);
    {  // the scale bytes 2 (c0 + i), + 1 of row n0 + t lie in the 4-aligned word from b0; the word the
       // array ends inside by plain loads (wg_cp4_clip)
      const long long b0 = ((long long)row * gk + 2 * (c0 + i)) & ~3LL;
      const long long left = sbytes - b0;
      const int n = wok ? (int)(left > 4 ? 4 : left) : 0;
      wg_cp4_clip(smem + (st - base) + 128 * F::CODES + 4 * t, st + 128 * F::CODES + 4 * t, SW + (n ? b0 : 0), n);
    }
    mbar_arrive_cp_async(base + F::BAR + 8 * s);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  for (int i = C > F::LAG ? C - F::LAG : 0; i < C; ++i) fd_decode<FMT>(smem, base, i, n0, N, gk, c0);
}

// A consumer warpgroup: per chunk, once its stage is full, four wgmmas (k16 steps: 32 bytes into
// both tiles' 128-byte rows) as one commit group; waiting for the chunk before frees that one's stage.
template <int FMT, int BN>
__device__ __forceinline__ void fd_consume(u32 base, float* __restrict__ Y, int ldy, int M, int N, int m0, int n0,
                                           int bf, int C) {
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2,
            q = lane & 3;
  const int r0 = n0 + 64 * wg + 16 * warp + g, r1 = r0 + 8;
  const bool ok0 = r0 < N, ok1 = r1 < N;
  using F = FdCfg<FMT>;
  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
  for (int i = 0; i < C; ++i) {
    const int s = i % F::ST;
    mbar_wait(base + F::BAR + 8 * s, (i / F::ST) & 1);
    fence_proxy_async();
    const u32 at = base + F::A + s * FD_ATILE + 8192 * wg, bt = base + s * BW_TILE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) wgmma_ss(d, wg_desc(at + 32 * k), wg_desc(bt + 32 * k));
    wgmma_commit();
    wgmma_wait<1>();
    if (i >= 1) {
      __syncwarp();
      if (lane == 0) mbar_arrive(base + F::BAR + 8 * (F::ST + (i - 1) % F::ST));
    }
  }
  wgmma_wait<0>();
  wg_fence_regs(d);
  bw_store<BN>(d, Y, ldy, M, m0, r0, r1, ok0, ok1, bf, q);
}

// A consumer warpgroup whose weight rows are all past N: releases each stage.
template <int FMT>
__device__ __forceinline__ void fd_idle(u32 base, int C) {
  using F = FdCfg<FMT>;
  for (int i = 0; i < C; ++i) {
    mbar_wait(base + F::BAR + 8 * (i % F::ST), (i / F::ST) & 1);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(base + F::BAR + 8 * (F::ST + i % F::ST));
  }
}

// segs [nseg x 5] int32 (g, first row row0, rows <= 256, x column, y column): Y[row0 + r, ycol + n] =
// X[row0 + r, xcol .. xcol + K) (act_quant_bf16w's bf16 rows of ldx elements, in its K order) times
// weight g's rows: FP4 e2m1 [N, K / 2] (the MoE's experts: X and Y rows in pair order, as
// kernels/fp8_grouped.cu takes them) or FP8 e4m3 [N, K] at wptrs[g], their UE8M0 bytes [N, gk = K /
// 32] at sptrs[g]; bf: Y rounded to bf16 as stored. Block (x, y): segment y, weight rows x * 128...
// grid (ceil(N / 128), nseg), block 384, dynamic shared memory FdCfg<FMT>::SMEM.
template <int FMT>
__device__ __forceinline__ void fd_gemm(const u8* X, int ldx, const int* segs, const u64* wptrs, const u64* sptrs,
                                        float* Y, int ldy, int N, int K, int gk, int bf) {
  using F = FdCfg<FMT>;
  extern __shared__ __align__(1024) u8 bw_smem[];
  const int* sg = segs + 5 * blockIdx.y;
  if (sg[2] == 0) return;  // an unused slot
  const u32 raw_addr = wg_smem_u32(bw_smem), pad = (1024u - (raw_addr & 1023u)) & 1023u;
  const u32 base = raw_addr + pad;
  u8* smem = bw_smem + pad;
  if (threadIdx.x == 0) {
    for (int s = 0; s < F::ST; ++s) {
      mbar_init(base + F::BAR + 8 * s, 256);  // 128 cp.async arrives + 128 after the decode
      mbar_init(base + F::BAR + 8 * (F::ST + s), 8);  // one arrive per consumer warp
    }
  }
  __syncthreads();
  const int M = sg[2], n0 = blockIdx.x * BW_BM, C = K / 64;
  float* Yb = Y + (size_t)sg[1] * ldy + sg[4];
  if (threadIdx.x >= 256) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(FD_PRODUCER_REGS));
    fd_produce<FMT>(smem, base, X + ((size_t)sg[1] * ldx + sg[3]) * 2, ldx, M, 0, (const u8*)wptrs[sg[0]],
                    (const u8*)sptrs[sg[0]], N, K, gk, n0, 0, C);
  } else if (n0 + 64 * (int)(threadIdx.x >> 7) >= N) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(FD_PRODUCER_REGS));
    fd_idle<FMT>(base, C);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(FD_CONSUMER_REGS));
    // the wgmma N by the tile's token rows: a short tile computes no more than the next multiple of 64
    if (M > 128) fd_consume<FMT, 256>(base, Yb, ldy, M, N, 0, n0, bf, C);
    else if (M > 64) fd_consume<FMT, 128>(base, Yb, ldy, M, N, 0, n0, bf, C);
    else fd_consume<FMT, 64>(base, Yb, ldy, M, N, 0, n0, bf, C);
  }
}
extern "C" __global__ void __launch_bounds__(BW_THREADS, 1)
    gemm_fp4_experts_sm90(const u8* X, int ldx, const int* segs, const u64* wptrs, const u64* sptrs, float* Y,
                          int ldy, int N, int K, int gk, int bf) {
  fd_gemm<FMT_FP4>(X, ldx, segs, wptrs, sptrs, Y, ldy, N, K, gk, bf);
}
extern "C" __global__ void __launch_bounds__(BW_THREADS, 1)
    gemm_fd_fp8_sm90(const u8* X, int ldx, const int* segs, const u64* wptrs, const u64* sptrs, float* Y, int ldy,
                     int N, int K, int gk, int bf) {
  fd_gemm<FMT_FP8>(X, ldx, segs, wptrs, sptrs, Y, ldy, N, K, gk, bf);
}

// Segments (g, row0, rows <= 256, xcol, ycol) [nseg x 5] of a block-diagonal (grouped) linear on bf16
// x: Y[row0 + r, ycol + n] = X[row0 + r, xcol .. xcol + K) (bf16_rows' rows of ldx elements) times
// group g's FP8 weight rows [N, K] at wptrs[g], whose f32 block scales [ceil(N / bn), gk] at sptrs[g]
// are powers of two (bn % 16 == 0); bf: Y rounded to bf16 as stored. grid (ceil(N / 128), nseg,
// splits), block 384, the same shared memory as gemm_fp4_experts_sm90. Split K (BW_SPLIT_ARGS):
// with splits > 1, split z sums its share of K's chunks into part + z * pstride (laid out as Y,
// unrounded) and bw_sum_splits adds them up into Y.
#define BW_SPLIT_ARGS float *part, long long pstride
#define BW_SPLIT(Yrow)                                                                           \
  const int C_ = K / 64, S_ = gridDim.z, z_ = blockIdx.z;                                        \
  const int c0 = C_ * z_ / S_, cn = C_ * (z_ + 1) / S_ - c0;                                     \
  float* Yd = S_ > 1 ? part + z_ * pstride + (Yrow) : Y + (Yrow);                                \
  const int bfd = S_ > 1 ? 0 : bf;
extern "C" __global__ void __launch_bounds__(BW_THREADS, 1)
    gemm_fp8w_bf16_sm90(const u8* X, int ldx, const int* segs, const u64* wptrs, const u64* sptrs, float* Y,
                        int ldy, int N, int K, int bn, int bk, int gk, int bf, BW_SPLIT_ARGS) {
  extern __shared__ __align__(1024) u8 bw_smem[];
  const int* sg = segs + 5 * blockIdx.y;
  if (sg[2] == 0) return;
  BW_SPLIT((size_t)sg[1] * ldy + sg[4])
  bw_gemm<FMT_FP8>(bw_smem, X + ((size_t)sg[1] * ldx + sg[3]) * 2, ldx, (const u8*)wptrs[sg[0]],
                   (const void*)sptrs[sg[0]], Yd, ldy, sg[2], N, K, bn, bk, gk, 0, blockIdx.x * BW_BM, bfd, c0, cn);
}

// Segments (g, row0, rows <= 256, xcol, ycol) [nseg x 5] of a block-diagonal (grouped) linear on bf16
// weights: Y[row0 + r, ycol + n] = X[row0 + r, xcol .. xcol + K) (bf16_rows' rows of ldx elements)
// times group g's bf16 weight rows [N, K] at wptrs[g]; bf: Y rounded to bf16 as stored. grid
// (ceil(N / 128), nseg, splits), block 384, the same shared memory and split K as gemm_fp8w_bf16_sm90.
extern "C" __global__ void __launch_bounds__(BW_THREADS, 1)
    gemm_bf16w_sm90(const u8* X, int ldx, const int* segs, const u64* wptrs, float* Y, int ldy, int N, int K,
                    int bf, BW_SPLIT_ARGS) {
  extern __shared__ __align__(1024) u8 bw_smem[];
  const int* sg = segs + 5 * blockIdx.y;
  if (sg[2] == 0) return;
  BW_SPLIT((size_t)sg[1] * ldy + sg[4])
  bw_gemm<FMT_BF16>(bw_smem, X + ((size_t)sg[1] * ldx + sg[3]) * 2, ldx, (const u8*)wptrs[sg[0]], nullptr, Yd, ldy,
                    sg[2], N, K, 1, 1, 1, 0, blockIdx.x * BW_BM, bfd, c0, cn);
}
#undef BW_SPLIT
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
