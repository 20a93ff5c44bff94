// The routed experts' FP4 linears and the FP8 linears of a prompt chunk (--numerics deepseek) on
// bf16 wgmma, the weights decoded by the producer warpgroup into shared memory
// (engine/ops/gpu/fp4_experts.py): Y rows = each row's act_quant'ed values times its weight's
// codes times their power-of-two scales, f32 sums. The machinery shared with
// kernels/bf16_weights.cu, and why bf16: kernels/bf16_wgmma.cuh.
//
// K order (act_quant_bf16w, fd_store_quad): within each 8 of K, physical j and 4 + j (j = 0..3) at
// logical 2j and 2j + 1, so that one 32-bit word of FP4 codes (8 nibbles) shifted by 4j holds the
// pair's two nibbles in the two bf16 halves (fd_row4; FP8: fd_row8).
#include "bf16_wgmma.cuh"

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

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
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
#define FD_BOX_ROWS 64                    // token rows of a TMA box (the tensor map's, tma.py)
#define FD_BOX_BYTES (FD_BOX_ROWS * 128)  // its bytes: 64 bf16 of K a row
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

// Logical chunk b of row t of the A tile at `at`: its four bf16 pairs, magnitudes mag[j] times the
// factors (fa then sc; with ONE sc alone) with the signs sgn[j] put in by XOR (fd_row4, fd_row8).
template <bool ONE>
__device__ __forceinline__ void fd_store_chunk(u8* at, int t, int b, const u32 (&mag)[4], const u32 (&sgn)[4], u32 fa,
                                               u32 sc) {
  u32 o[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = (ONE ? bf16x2_mul(mag[j], sc) : bf16x2_mul(bf16x2_mul(mag[j], fa), sc)) ^ sgn[j];
  *(uint4*)(at + wg_swz(t, b)) = make_uint4(o[0], o[1], o[2], o[3]);
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
    fd_store_chunk<ONE>(at, t, b, mag, sgn, fa, sc);
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
    fd_store_chunk<ONE>(at, t, b, mag, sgn, fa, sc);
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

// The producer warpgroup: for each chunk i of K (64), once its stage is free, the segment's token
// rows by TMA (thread 0: `boxes` boxes of 64 rows, the rows the consumers' wgmma N reads; rows past
// the segment are other segments' or, past X, zeros, and land in Y columns the epilogue never
// stores), weight row n0 + t's code bytes and the aligned 4-byte window holding its two scale bytes
// (zeros past N) to the staging area by cp.async; LAG chunks later, those landed, the decode
// (fd_decode). The full barrier counts 128 cp.async arrives, thread 0's arrival with the tokens'
// bytes as its tx-count, and 128 arrivals after the decode. No deadlock: the stage of chunk i frees
// once the consumers are past chunk i - ST + 1, decoded before iteration i since LAG < ST.
template <int FMT>
__device__ __forceinline__ void fd_produce(u8* smem, u32 base, const TmaMap* xmap, int xcol, int xrow, int boxes,
                                           const u8* __restrict__ W, const u8* __restrict__ SW, int N, int K, int gk,
                                           int n0, int c0, int C) {
  using F = FdCfg<FMT>;
  const int t = threadIdx.x - 256;
  if (t == 0) tma_prefetch_map(xmap);
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
    if (t == 0) {
      mbar_expect_tx(base + F::BAR + 8 * s, boxes * FD_BOX_BYTES);
      for (int j = 0; j < boxes; ++j)
        tma_load_2d(base + s * BW_TILE_BYTES + j * FD_BOX_BYTES, xmap, xcol + 64 * (c0 + i), xrow + FD_BOX_ROWS * j,
                    base + F::BAR + 8 * s);
    }
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

// segs [nseg x 5] int32 (g, first row row0, rows <= 256, x column, y column): Y[row0 + r, ycol + n] =
// X[row0 + r, xcol .. xcol + K) (act_quant_bf16w's bf16 rows, in its K order; xmap: X's tensor map,
// boxes of 64 elements x FD_BOX_ROWS rows with the 128-byte swizzle, engine/ops/gpu/tma.py) times
// weight g's rows: FP4 e2m1 [N, K / 2] (the MoE's experts: X and Y rows in pair order, as
// kernels/fp8_grouped.cu takes them) or FP8 e4m3 [N, K] at wptrs[g], their UE8M0 bytes [N, gk = K /
// 32] at sptrs[g]; bf: Y rounded to bf16 as stored. Block (x, y): segment y, weight rows x * 128...
// grid (ceil(N / 128), nseg), block 384, dynamic shared memory FdCfg<FMT>::SMEM.
template <int FMT>
__device__ __forceinline__ void fd_gemm(const TmaMap* xmap, const int* segs, const u64* wptrs, const u64* sptrs,
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
      mbar_init(base + F::BAR + 8 * s, 257);  // 128 cp.async arrives, the TMA's, 128 after the decode
      mbar_init(base + F::BAR + 8 * (F::ST + s), 8);  // one arrive per consumer warp
    }
  }
  __syncthreads();
  const int M = sg[2], n0 = blockIdx.x * BW_BM, C = K / 64;
  float* Yb = Y + (size_t)sg[1] * ldy + sg[4];
  if (threadIdx.x >= 256) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(FD_PRODUCER_REGS));
    // the token rows the wgmma N reads (fd_consume's choice below), in boxes of FD_BOX_ROWS
    const int boxes = (M > 128 ? 256 : M > 64 ? 128 : 64) / FD_BOX_ROWS;
    fd_produce<FMT>(smem, base, xmap, sg[3], sg[1], boxes, (const u8*)wptrs[sg[0]], (const u8*)sptrs[sg[0]], N,
                    K, gk, n0, 0, C);
  } else if (n0 + 64 * (int)(threadIdx.x >> 7) >= N) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(FD_PRODUCER_REGS));
    bw_idle<F::ST>(base + F::BAR, C);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(FD_CONSUMER_REGS));
    // the wgmma N by the tile's token rows: a short tile computes no more than the next multiple of 64
    if (M > 128) fd_consume<FMT, 256>(base, Yb, ldy, M, N, 0, n0, bf, C);
    else if (M > 64) fd_consume<FMT, 128>(base, Yb, ldy, M, N, 0, n0, bf, C);
    else fd_consume<FMT, 64>(base, Yb, ldy, M, N, 0, n0, bf, C);
  }
}
extern "C" __global__ void __launch_bounds__(BW_THREADS, 1)
    gemm_fp4_experts_sm90(const __grid_constant__ TmaMap xmap, const int* segs, const u64* wptrs, const u64* sptrs,
                          float* Y, int ldy, int N, int K, int gk, int bf) {
  fd_gemm<FMT_FP4>(&xmap, segs, wptrs, sptrs, Y, ldy, N, K, gk, bf);
}
extern "C" __global__ void __launch_bounds__(BW_THREADS, 1)
    gemm_fd_fp8_sm90(const __grid_constant__ TmaMap xmap, const int* segs, const u64* wptrs, const u64* sptrs,
                     float* Y, int ldy, int N, int K, int gk, int bf) {
  fd_gemm<FMT_FP8>(&xmap, segs, wptrs, sptrs, Y, ldy, N, K, gk, bf);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
