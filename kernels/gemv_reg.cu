// Register-fed tensor-core GEMV for decode at one row of x (gemvr_*), FP8 (e4m3) and FP4 (e2m1)
// weights: each lane's weight loads feed mma.m16n8k16 (f16 in, f32 accumulate) straight from
// registers, with no shared-memory ring (that is the multi-row GEMV, kernels/gemv_tc.cu tcgemv_*).
// x is staged per block in shared memory as power-of-two scaled f16 hi + lo terms (split_group4,
// kernels/tc_fragments.cuh). The host side (shapes, configuration, shared memory) is
// engine/ops/gpu/linear.py (_gemvr_*); the scheme is described at gemvr_body below.
#include "dsuf_common.cuh"
#include "tc_fragments.cuh"

// One row of x (K floats) -> shared memory as the one-row GEMVs' B operand: two f16 columns (hi,
// lo terms) cs bytes apart, each 128-k group scaled by a power of two (inverse in xinv[group]),
// half k at byte 2k + 16 (k / 64) of its column (FP4: permuted within each 8, see gemvr). Zeros
// past K. One warp per group, nw warps (this one `warp`), four groups' loads in flight per warp (a
// warp reduction per group kept the loop from overlapping them: one L2 round trip per group). xq: x
// as a linear's input under --numerics deepseek (linear_in4).
template <bool F8>
__device__ __forceinline__ void stage_x_cols(const float* __restrict__ x, int K, u8* cols, int cs, float* xinv,
                                             int warp, int nw, int lane, int xq) {
  const int ngx = (K + 127) / 128;
  for (int g0 = warp; g0 < ngx; g0 += 4 * nw) {
    float4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e0 = (g0 + nw * j) * 128 + 4 * lane;
      v[j] = e0 < K ? __ldg((const float4*)(x + e0)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = linear_in4(v[j], xq);  // (after all four loads: its shuffles wait on them)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int gi = g0 + nw * j, e0 = gi * 128 + 4 * lane;
      if (gi >= ngx) break;  // (uniform over the warp)
      u32 hv[4], lv[4];
      const float inv = split_group4(v[j], hv, lv);
      if (lane == 0) xinv[gi] = inv;
      const int kp = e0 + 8 * (e0 >> 6);  // padded half index of element e0 (16 bytes per 64 halves)
      if (F8) {
        *(uint2*)(cols + 2 * kp) = make_uint2(hv[0] | (hv[1] << 16), hv[2] | (hv[3] << 16));
        *(uint2*)(cols + cs + 2 * kp) = make_uint2(lv[0] | (lv[1] << 16), lv[2] | (lv[3] << 16));
      } else {  // element e of an 8-group at 2e (e < 4) or 2(e - 4) + 1
        u16* hi = (u16*)cols + (kp & ~7) + (lane & 1);
        u16* lo = (u16*)(cols + cs) + (kp & ~7) + (lane & 1);
#pragma unroll
        for (int i = 0; i < 4; ++i) hi[2 * i] = (u16)hv[i], lo[2 * i] = (u16)lv[i];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Register-fed tensor-core GEMV for decode at one row of x, FP8 and FP4 weights. Same arguments
// and segment table as gemvx (kernels/linear.cu); every segment has one row.
//
// Why: the CUDA-core GEMVs spend 2.5 (FP8) to 7 (FP4) instructions per weight byte decoding,
// converting and multiplying, so at one row they are issue-bound at 30-45% of HBM bandwidth. Here
// weight loads feed mma.m16n8k16 (f16 in, f32 accumulate) straight from registers.
//
// A warp owns a 16-row tile (lane g = lane / 4 holds rows g and g + 8) and walks K in units of 128
// = 4 granules of 32 k, each one FP8 scale-block column (bk a power of two >= 32) or one FP4
// UE8M0 group. Lane t = lane % 4 loads granule t of each of its two rows (FP8 32 bytes, FP4 16),
// so every MMA mixes the 4 granules of a unit, one per lane's k-slots. The 8 columns of B keep
// them apart: column 2G + term holds x's hi or lo f16 term on granule G's k-slots and zeros on the
// others (lane (g, t) feeds column g: the lanes with g / 2 == t load x, the rest hold zeros), so C
// columns 2t, 2t + 1, which lane t receives, are its own granule's sums: one scale per lane and
// unit multiplies them, and no lane exchanges weights. A and B only need to agree on the order of
// k within the MMA's slots (2t, 2t + 1, 2t + 8, 2t + 9):
//  * FP8: word w (4 bytes) of the lane's granule is MMA w's slots = k (4w + 0, 1, 2, 3); x in order.
//  * FP4: fp4_pairs turns word w into f16x2 (element i, i + 4); MMA (w, h) takes pairs 2h, 2h + 1,
//    so x is staged permuted within each 8: (0, 4, 1, 5, 2, 6, 3, 7).
// x (f32) is staged per block in shared memory as two f16 columns (hi, lo; 22 mantissa bits: the
// products stay float32-grade), each 128-k group scaled by a power of two (inverse in xinv), half
// k at byte 2k + 16 (k / 64) of its column (the 8 B-loading lanes hit distinct banks). U units are
// in flight per lane; with pf != 0 (segment table and pointers are constants) a block loads its
// first weights before waiting on the previous kernel (PDL). A quad, then the kw warps sharing a
// tile, reduce in a fixed order (graph replays are bit-identical).
// grid (blocks, nseg), block 256, dynamic shared memory: host _gemvr_smem.
template <int FMT, int U, bool PIPE>
__device__ __forceinline__ void gemvr_body(const float* __restrict__ A, int lda, float* __restrict__ Y, int ldy,
                                           int N, int K, const int* __restrict__ segs,
                                           const u64* __restrict__ wptrs, const u64* __restrict__ sptrs,
                                           int bn, int bk, int gk, int bf, int kw, int pf, int xq) {
  extern __shared__ __align__(16) u8 gr_smem[];
  constexpr bool F8 = FMT == FMT_FP8;
  constexpr int NW = F8 ? 8 : 4;  // weight words per lane, row and unit
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tpb = 8 / kw, part = warp % kw;
  const int ngx = (K + 127) / 128;                    // units (= x groups)
  const int cs = ((288 * ngx + 127) & ~127) + 32;     // bytes per staged x column (= 32 mod 128)
  float* xinv = (float*)(gr_smem + 2 * cs);
  float* red = xinv + ngx;
  const int ntiles = (N + 15) / 16, nbi = (ntiles + tpb - 1) / tpb;
  const size_t row_bytes = F8 ? (size_t)K : (size_t)K / 2;
  const int bsh = __ffs(bk) - 1;

  const int* sg = segs + 5 * blockIdx.y;
  int widx = 0, row0 = 0, rows = 0, acol = 0, ycol = 0;
  auto read_seg = [&]() { widx = sg[0]; row0 = sg[1]; rows = sg[2]; acol = sg[3]; ycol = sg[4]; };
  const u8* Wt = nullptr;
  const void* Sc = nullptr;

  u32 wa[U][NW], wb[U][NW];  // granule t of rows g, g + 8
  u32 sa[U], sb[U];          // FP8: the block scale (f32 bits, rows share it); FP4: UE8M0 bytes
  // unit un of tile n0 -> register slot i
  auto load_one = [&](int i, int n0, int un) {
    const int na = min(n0 + g, N - 1), nb = min(n0 + g + 8, N - 1);
    const u8* ra = Wt + (size_t)na * row_bytes;
    const u8* rb = Wt + (size_t)nb * row_bytes;
    const int k = un * 128 + 32 * t;
    const bool live = un < ngx && k < K;
    const uint4 z = make_uint4(0, 0, 0, 0);
    if (F8) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool ok = live && k + 16 * h < K;  // (K % 16 == 0)
        const uint4 pa = ok ? ldg16(ra + k + 16 * h) : z, pb = ok ? ldg16(rb + k + 16 * h) : z;
        wa[i][4 * h] = pa.x; wa[i][4 * h + 1] = pa.y; wa[i][4 * h + 2] = pa.z; wa[i][4 * h + 3] = pa.w;
        wb[i][4 * h] = pb.x; wb[i][4 * h + 1] = pb.y; wb[i][4 * h + 2] = pb.z; wb[i][4 * h + 3] = pb.w;
      }
      sa[i] = sb[i] = live ? __float_as_uint(__ldg((const float*)Sc + (size_t)(n0 / bn) * gk + (k >> bsh))) : 0u;
    } else {  // (K % 128 == 0)
      const uint4 pa = live ? ldg16(ra + k / 2) : z, pb = live ? ldg16(rb + k / 2) : z;
      wa[i][0] = pa.x; wa[i][1] = pa.y; wa[i][2] = pa.z; wa[i][3] = pa.w;
      wb[i][0] = pb.x; wb[i][1] = pb.y; wb[i][2] = pb.z; wb[i][3] = pb.w;
      sa[i] = live ? __ldg((const u8*)Sc + (size_t)na * gk + k / 32) : 0u;
      sb[i] = live ? __ldg((const u8*)Sc + (size_t)nb * gk + k / 32) : 0u;
    }
  };
  // units u0, u0 + kw, ... (U of them) of tile n0 -> registers
  auto load = [&](int n0, int u0) {
#pragma unroll
    for (int i = 0; i < U; ++i) load_one(i, n0, u0 + i * kw);
  };

  bool preloaded = false;
  if (pf) {  // constant tables: the first weights stream in while the previous kernel finishes
    read_seg();
    const int n0 = (blockIdx.x * tpb + warp / kw) * 16;
    if (rows > 0 && n0 < N) {
      Wt = (const u8*)wptrs[widx];
      Sc = (const void*)sptrs[widx];
      load(n0, part);
      preloaded = true;
    }
  }
  dsuf_grid_wait();
  if (!pf) read_seg();
  if (rows <= 0) return;  // an unused segment slot: the whole block, before any barrier
  Wt = (const u8*)wptrs[widx];
  Sc = (const void*)sptrs[widx];
  if (!preloaded) {  // (a table the step built) the first weights load while x is staged
    const int n0 = (blockIdx.x * tpb + warp / kw) * 16;
    if (n0 < N) {
      load(n0, part);
      preloaded = true;
    }
  }

  stage_x_cols<F8>(A + (size_t)row0 * lda + acol, K, gr_smem, cs, xinv, warp, 8, lane, xq);
  __syncthreads();

  const bool feeds = (g >> 1) == t;  // this lane loads B column g = 2t + term (granule t)
  const u8* xc = gr_smem + (g & 1) * cs + 2 * (32 * t + 8 * (t >> 1));
  uint4 xv[4] = {};  // B fragments of the current unit (zeros in the lanes that feed none)
  for (int bi = blockIdx.x; bi < nbi; bi += gridDim.x) {  // uniform over the block (barriers below)
    const int n0 = (bi * tpb + warp / kw) * 16;
    float acc0 = 0.f, acc1 = 0.f;  // granule t's share of rows n0 + g, n0 + g + 8
    if (n0 < N) {
      if (PIPE && !preloaded) load(n0, part);
      for (int u0 = part; u0 < ngx; u0 += U * kw) {
        if (!PIPE && !preloaded) load(n0, u0);
        preloaded = false;
        const int nx = u0 + U * kw;  // the next pass (PIPE: its loads go out unit by unit, below)
#pragma unroll
        for (int i = 0; i < U; ++i) {
          const int un = u0 + i * kw;
          if (un >= ngx) break;
          if (feeds) {
#pragma unroll
            for (int q = 0; q < 4; ++q) xv[q] = *(const uint4*)(xc + un * 288 + 16 * q);
          }
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          if (F8) {
#pragma unroll
            for (int w = 0; w < 8; ++w) {
              const uint4& x = xv[w >> 1];
              mma_f16(c, e4m3x2_to_f16x2(wa[i][w]), e4m3x2_to_f16x2(wb[i][w]), e4m3x2_to_f16x2(wa[i][w] >> 16),
                      e4m3x2_to_f16x2(wb[i][w] >> 16), (w & 1) ? x.z : x.x, (w & 1) ? x.w : x.y);
            }
          } else {
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              u32 pa[4], pb[4];
              fp4_pairs(wa[i][w], pa);
              fp4_pairs(wb[i][w], pb);
              mma_f16(c, pa[0], pb[0], pa[1], pb[1], xv[w].x, xv[w].y);
              mma_f16(c, pa[2], pb[2], pa[3], pb[3], xv[w].z, xv[w].w);
            }
          }
          const float xs = xinv[un];
          const float fa = F8 ? __uint_as_float(sa[i]) * xs : e8m0_scaled(sa[i], 14) * xs;
          const float fb = F8 ? fa : e8m0_scaled(sb[i], 14) * xs;
          acc0 += (c[0] + c[1]) * fa;
          acc1 += (c[2] + c[3]) * fb;
          if (PIPE && nx < ngx) load_one(i, n0, nx + i * kw);  // slot i is free: refill it
        }
      }
    }
    // (a GEMV successor's early part starts once this block's weight loads are all issued)
    if (bi + gridDim.x >= nbi) dsuf_launch_dependents();
    // the quad's 4 granules, then the kw warps of the tile, in a fixed order (deterministic)
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
    if (kw > 1) {
      if (t == 0) {
        red[(warp * 8 + g) * 2] = acc0;
        red[(warp * 8 + g) * 2 + 1] = acc1;
      }
      __syncthreads();
      if (part == 0 && t == 0)
        for (int p = 1; p < kw; ++p) {
          acc0 += red[((warp + p) * 8 + g) * 2];
          acc1 += red[((warp + p) * 8 + g) * 2 + 1];
        }
      __syncthreads();
    }
    if (part == 0 && t == 0 && n0 < N) {
      float* y = Y + (size_t)row0 * ldy + ycol;
      if (n0 + g < N) y[n0 + g] = bf ? round_bf16f(acc0) : acc0;
      if (n0 + g + 8 < N) y[n0 + g + 8] = bf ? round_bf16f(acc1) : acc1;
    }
  }
}

#define GR_ARGS const float *A, int lda, float *Y, int ldy, int N, int K, const int *segs, const u64 *wptrs, \
                const u64 *sptrs, int bn, int bk, int gk, int bf, int kw, int pf, int xq
#define GR_PASS A, lda, Y, ldy, N, K, segs, wptrs, sptrs, bn, bk, gk, bf, kw, pf, xq
// U: units (128 k) in flight per lane; PIPE: each unit's registers reloaded (next pass) as soon as it
// is multiplied, so a lane keeps ~U units in flight instead of draining to none every pass; MINB:
// blocks per SM the registers must allow (engine/ops/gpu/linear.py GEMVR_BLOCKS_PER_SM).
#define DEF_GR(NAME, FMT, U, PIPE, MINB) \
  extern "C" __global__ void __launch_bounds__(256, MINB) NAME(GR_ARGS) { gemvr_body<FMT, U, PIPE>(GR_PASS); }
DEF_GR(gemvr_fp8, FMT_FP8, 2, false, 3)
DEF_GR(gemvr_fp4, FMT_FP4, 8, true, 2)
