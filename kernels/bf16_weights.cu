// FP8- and bf16-stored weights on bf16 wgmma, the weights as the register operand
// (engine/ops/gpu/fp4_experts.py: gemm_fp8w_bf16_sm90 for the FP8 linears the reference runs in bf16,
// gemm_bf16w_sm90 for bf16 ones, both past TC_MAX_ROWS rows; learned from, not copied: the "weights
// in registers" mixed-input GEMMs, vLLM's Machete and CUTLASS's sm90 mixed-input mainloop). The
// machinery they share with kernels/fp4_experts.cu, and why bf16: kernels/bf16_wgmma.cuh. Each
// consumer loads its rows into registers (bw_load) and converts them there, A from registers.
//
// K order: a thread's A fragment for k16 step s holds columns 2q, 2q+1, 2q+8, 2q+9 of rows g and
// g+8 (q = lane % 4, g = lane / 4). Each thread loads 16 consecutive weight elements of a 64-wide K
// chunk for its two rows, physical k = 16q + 4s + 2h + j going to step s, column 2q + 8h + j
// (logical L = 16s + 8h + 2q + j holds physical 16q + 4s + 2h + j): bf16_rows writes x in it
// (bw_store_quad).
#include "bf16_wgmma.cuh"

// Four consecutive values of row m, quad c (elements 4c .. 4c + 3), as bf16 at their places in the
// GEMM's K order: physical quad (q, st) = (cb / 4, cb % 4) of the 64-chunk -> logical 16 st + 2 q (+ 8).
__device__ __forceinline__ void bw_store_quad(u32* __restrict__ out, int m, int K, int c, const float (&e)[4]) {
  const int cb = c & 15, L = 16 * (cb & 3) + 2 * (cb >> 2);
  u32* row = out + ((size_t)m * K + 64 * (c >> 4) + L) / 2;
  row[0] = pack_bf16x2(e[0], e[1]);
  row[4] = pack_bf16x2(e[2], e[3]);
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
#define BW_STAGES 6          // ring of token tiles, 64 bf16 of K (one 128-byte swizzle row) each
#define BW_PRODUCER_REGS 48  // (its 16 copies in flight spill at 40)
#define BW_CONSUMER_REGS 224  // 128 x 48 + 256 x 224 <= 384 x 168, the block's registers at launch
static_assert(wg_split_fits(BW_THREADS, BW_PRODUCER_REGS, BW_CONSUMER_REGS), "setmaxnreg split past the registers");
#define BW_BAR (BW_STAGES * BW_TILE_BYTES)  // full[ST], then empty[ST]

#define BW_2P112 0x77807780u  // 2^112 as bf16x2
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
    bw_idle<BW_STAGES>(base + BW_BAR, C);
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
