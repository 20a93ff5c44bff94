// Tensor-core GEMV for decode: y[m, n] = sum_k x[m, k] * W[n, k] for up to 32 rows of x per
// segment, FP8 (e4m3, f32 scale per bn x bk block) and FP4 (e2m1, UE8M0 per 1 x 32) weights.
// Same segment table as kernels/linear.cu (weight index, x row0, rows, x col, y col).
//
// Why tensor cores for a memory-bound product: on CUDA cores, dequantizing and multiplying each
// weight costs 2.5 (FP8) to 4.5 (FP4) instructions, which caps the GEMV well below HBM speed and
// makes 8 rows cost 4-5x one row. Here the weights are the A operand of mma.m16n8k16 (f16 in,
// f32 accumulate), decoded exactly into f16: e4m3 by one cvt per two weights, e2m1 by placing its
// bits (value * 2^-14). The rows of x are the 8 columns of B, so 1 to 8 rows cost the same and
// 32 rows 4 MMAs per weight fragment. The block / group scale multiplies the f32 partial sums.
//
// x is prepared by tc_split_x: each group of 128 elements of a row is scaled by a power of two
// (its max -> below 2^14, the inverse kept in XINV [rows, ceil(lda / 128)]) and split into hi + lo
// f16 terms (22 mantissa bits), so the products are float32-grade (V4.1's FP8/FP4 state rounding
// would amplify bf16-grade activation error into different logits).
// Layouts, 16 bytes per 4 elements of x, in the order the MMA fragments read them:
//   perm 0 (FP8): per 4 elements (hi01, hi23, lo01, lo23), hiAB = f16x2 of elements A, B;
//   perm 1 (FP4): per 8 elements (hi04, hi15, lo04, lo15), (hi26, hi37, lo26, lo37): the nibble
//   pair decode below yields weights (i, i+4) in one f16x2, and the dot product only needs A and
//   B to agree on the order of k.
//
// Each warp streams one 16-row tile of W (a 1/kw share of its K) through an S-deep cp.async ring
// in shared memory, a stage being 16 rows x R * 128 contiguous bytes of each row (128-byte
// segments with chunks XOR-swizzled by row, so that ldmatrix reads are conflict-free); ldmatrix
// hands each lane the A words the MMA expects. The kw warps of a block that share a tile reduce
// through shared memory in a fixed order (deterministic: graphs replay bit-identically).
#include "dsuf_common.cuh"

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// 16-byte asynchronous copy global -> shared; bytes = 0 fills the destination with zeros.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32* d) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

// (not volatile: a pure function of its registers, so the compiler may interleave it with loads)
__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 v) {
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((u16)(v & 0xFFFFu)));
  return r;
}

// Eight e2m1 nibbles (element i in bits 4i..4i+3) -> four f16x2, p[i] = (element i, element i+4),
// each value * 2^-14, exact (f16 subnormals included).
__device__ __forceinline__ void fp4_pairs(u32 w, u32* p) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 mag = i < 3 ? (w << (9 - 4 * i)) : (w >> 3);
    p[i] = (mag & 0x0E000E00u) | ((w << (12 - 4 * i)) & 0x80008000u);
  }
}

__device__ __forceinline__ u32 f2h_rn(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}


// ---------------------------------------------------------------------------------------------
// x [rows, lda] f32 -> XS [rows, lda / 4] uint4 (layout `perm`, above) and XINV [rows, ngx],
// ngx = ceil(lda / 128). One warp per 128-element group: grid (ceil(ngx / 8), rows), block 256;
// lda % (perm ? 8 : 4) == 0.
extern "C" __global__ void __launch_bounds__(256) tc_split_x(const float* __restrict__ A, int lda,
                                                             uint4* __restrict__ XS, float* __restrict__ XINV,
                                                             int perm) {
  const int ngx = (lda + 127) / 128, gi = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (gi >= ngx) return;  // a whole warp
  const int e0 = gi * 128 + 4 * lane;
  const bool ok = e0 < lda;
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (ok) v = __ldg((const float4*)(A + (size_t)blockIdx.y * lda + e0));
  // group max (NaN is ignored here and propagates through the products instead)
  const float m = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  int sh = 0;  // scale 2^sh: the group's max lands in [2^13, 2^14)
  if (m > 0.f && m <= 3.0e38f) {
    int e;
    frexpf(m, &e);  // m = f * 2^e, f in [0.5, 1)
    sh = 14 - e;
    sh = sh < -125 ? -125 : (sh > 125 ? 125 : sh);
  }
  const float scale = __uint_as_float((u32)(127 + sh) << 23);
  if (lane == 0) XINV[(size_t)blockIdx.y * ngx + gi] = __uint_as_float((u32)(127 - sh) << 23);
  const float x[4] = {v.x * scale, v.y * scale, v.z * scale, v.w * scale};
  u32 hi[4], lo[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    hi[i] = f2h_rn(x[i]);
    lo[i] = f2h_rn(x[i] - h2f(hi[i]));
  }
  uint4 o;
  if (perm == 0) {
    o = make_uint4(hi[0] | (hi[1] << 16), hi[2] | (hi[3] << 16), lo[0] | (lo[1] << 16), lo[2] | (lo[3] << 16));
  } else {  // lanes 2j, 2j + 1 hold elements 0-3 and 4-7 of 8-element block j
    u32 ph[4], pl[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      ph[i] = __shfl_xor_sync(0xffffffffu, hi[i], 1);
      pl[i] = __shfl_xor_sync(0xffffffffu, lo[i], 1);
    }
    if ((lane & 1) == 0)  // (hi04, hi15, lo04, lo15)
      o = make_uint4(hi[0] | (ph[0] << 16), hi[1] | (ph[1] << 16), lo[0] | (pl[0] << 16), lo[1] | (pl[1] << 16));
    else  // (hi26, hi37, lo26, lo37)
      o = make_uint4(ph[2] | (hi[2] << 16), ph[3] | (hi[3] << 16), pl[2] | (lo[2] << 16), pl[3] | (lo[3] << 16));
  }
  if (ok) XS[((size_t)blockIdx.y * lda + e0) / 4] = o;
}

// ---------------------------------------------------------------------------------------------
// grid (ceil(ceil(N / 16) / (W / kw)), nseg), block 32 * W, dynamic shared memory
// W * S * R * 2048 bytes. NT = 8-row tiles of x (rows per segment <= 8 * NT). Segment x columns
// (acol) are multiples of 128 (the split's groups).
template <int FMT, int NT, int R, int S, int W>
__device__ __forceinline__ void tcgemv_body(const uint4* __restrict__ XS, const float* __restrict__ XINV, int lda,
                                            float* __restrict__ Y, int ldy, int N, int K,
                                            const int* __restrict__ segs, const u64* __restrict__ wptrs,
                                            const u64* __restrict__ sptrs, int bn, int bk, int gk, int kw) {
  extern __shared__ __align__(16) u8 tc_smem[];
  constexpr int EPC = FMT == FMT_FP8 ? 16 : 32;  // k elements per 16-byte chunk
  constexpr int CPS = 8 * R;                       // chunks per row per stage
  constexpr int KPS = EPC * CPS;                   // k elements per stage
  constexpr int ROWB = 128 * R, STAGEB = 16 * ROWB;
  const int* sg = segs + 5 * blockIdx.y;
  const int widx = sg[0], row0 = sg[1], rows = sg[2], acol = sg[3], ycol = sg[4];
  if (rows <= 0) return;  // an unused segment slot: the whole block, before any barrier
  const u8* Wt = (const u8*)wptrs[widx];
  const void* Sc = (const void*)sptrs[widx];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int part = warp % kw;
  const int n0 = (blockIdx.x * (W / kw) + warp / kw) * 16;
  const int row_bytes = FMT == FMT_FP8 ? K : K / 2;
  const int nstage = (K + KPS - 1) / KPS;
  const int my = n0 < N ? (nstage - part + kw - 1) / kw : 0;  // stages part, part + kw, ...
  const u32 ring = smem_addr(tc_smem + warp * (S * STAGEB));
  const int ng = min(n0 + g, N - 1), ng8 = min(n0 + g + 8, N - 1);  // this lane's two weight rows
  const int ngx = (lda + 127) / 128;

  auto issue = [&](int j) {  // this warp's j-th stage into ring slot j % S
    if (j < my) {
      const int kb = (part + j * kw) * ROWB;
      const u32 slot = ring + (j % S) * STAGEB;
#pragma unroll
      for (int i = 0; i < 4 * R; ++i) {
        const int idx = lane + 32 * i, r = idx / CPS, c = idx % CPS, n = n0 + r;
        const bool ok = n < N && kb + c * 16 < row_bytes;
        const u8* src = ok ? Wt + (size_t)n * row_bytes + kb + c * 16 : Wt;
        cp_async16(slot + r * ROWB + (c >> 3) * 128 + (((c & 7) ^ (r & 7)) << 4), src, ok ? 16 : 0);
      }
    }
    cp_async_commit();  // (an empty group past the end keeps the wait counts uniform)
  };

  // Partial sums of the current scale group in NC independent MMA chains (the MMA latency, not
  // the loads, bounds a warp otherwise): FP8 spreads a block's 2 x 8 MMAs over 4 chains; FP4
  // alternates two sets of 2 chains between consecutive 32-k groups, so that one group's flush
  // (times its scales) overlaps the next group's MMAs.
  constexpr int NC = 4;
  float acc[NT][4], cc[NC][NT][4], xs[NT][2], pend[2][NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[j][e] = pend[0][j][e] = pend[1][j][e] = 0.f;
#pragma unroll
      for (int c = 0; c < NC; ++c) cc[c][j][e] = 0.f;
    }
    xs[j][0] = xs[j][1] = 0.f;
  }
  // x: this lane feeds B column g of each 8-row tile, and scales C columns 2t, 2t + 1
  const uint4* xrow[NT];
  const float* xinv[NT][2];
  bool xok[NT], cok[NT][2];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    xok[j] = 8 * j + g < rows;
    xrow[j] = XS + ((size_t)(row0 + (xok[j] ? 8 * j + g : 0)) * lda + acol) / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = 8 * j + 2 * t + h;
      cok[j][h] = m < rows;
      xinv[j][h] = XINV + (size_t)(row0 + (cok[j][h] ? m : 0)) * ngx + acol / 128;
    }
  }
  const int srow_g = FMT == FMT_FP8 ? (ng / bn) * gk : ng * gk;
  const int srow_g8 = FMT == FMT_FP8 ? (ng8 / bn) * gk : ng8 * gk;
  // ldmatrix source of this lane: row (lane & 7) + 8 * ((lane >> 3) & 1), chunk + (lane >> 4)
  const int lr = (lane & 7) + ((lane >> 3) & 1) * 8, lc = lane >> 4;

  // chains c0 .. c1 - 1 -> acc with factors f (row scale x column scale per C element); zeroed
  auto flush = [&](int c0, int c1, const float (*f)[4]) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = 0.f;
#pragma unroll
        for (int c = 0; c < NC; ++c)
          if (c >= c0 && c < c1) {
            v += cc[c][j][e];
            cc[c][j][e] = 0.f;
          }
        acc[j][e] += v * f[j][e];
      }
  };
  auto factors = [&](float sa, float sb, float (*f)[4]) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      f[j][0] = sa * xs[j][0]; f[j][1] = sa * xs[j][1];
      f[j][2] = sb * xs[j][0]; f[j][3] = sb * xs[j][1];
    }
  };

#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue(j);
  for (int j = 0; j < my; ++j) {
    cp_async_wait<S - 2>();
    __syncwarp();
    issue(j + S - 1);  // into the slot consumed last iteration
    const u32 slot = ring + (j % S) * STAGEB;
    const int k0 = (part + j * kw) * KPS;
    // FP4: this stage's UE8M0 bytes of rows g and g + 8, 8 bytes per 128-byte segment when aligned
    const bool sc_vec = FMT == FMT_FP4 && (gk & 7) == 0 && k0 / 32 + CPS <= gk;
#pragma unroll
    for (int sgm = 0; sgm < R; ++sgm) {
      uint2 sga = make_uint2(0, 0), sgb = sga;
      if (FMT == FMT_FP4 && sc_vec) {
        sga = __ldg((const uint2*)((const u8*)Sc + srow_g + k0 / 32 + 8 * sgm));
        sgb = __ldg((const uint2*)((const u8*)Sc + srow_g8 + k0 / 32 + 8 * sgm));
      }
#pragma unroll
      for (int cp2 = 0; cp2 < 4; ++cp2) {
        u32 d[4];
        ldsm_x4(slot + lr * ROWB + sgm * 128 + (((2 * cp2 + lc) ^ (lr & 7)) << 4), d);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = 2 * cp2 + h, kk = k0 + EPC * (8 * sgm + c);
          if (FMT == FMT_FP8) {
            if (c == 0) {  // a new 128-element group of x: its column scales
              const int gx = (kk < K ? kk : 0) / 128;
#pragma unroll
              for (int q = 0; q < NT; ++q) {
                xs[q][0] = cok[q][0] ? __ldg(xinv[q][0] + gx) : 0.f;
                xs[q][1] = cok[q][1] ? __ldg(xinv[q][1] + gx) : 0.f;
              }
            }
            const u32 a0 = e4m3x2_to_f16x2(d[2 * h]), a2 = e4m3x2_to_f16x2(d[2 * h] >> 16);
            const u32 a1 = e4m3x2_to_f16x2(d[2 * h + 1]), a3 = e4m3x2_to_f16x2(d[2 * h + 1] >> 16);
#pragma unroll
            for (int q = 0; q < NT; ++q) {
              uint4 u = make_uint4(0, 0, 0, 0);
              if (xok[q] && kk < K) u = __ldg(xrow[q] + kk / 4 + t);
              mma_f16(cc[(2 * c) % NC][q], a0, a1, a2, a3, u.z, u.w);  // lo and hi terms, own chains
              mma_f16(cc[(2 * c + 1) % NC][q], a0, a1, a2, a3, u.x, u.y);
            }
            // one scale block per flush: bk >= 128 (a multiple) -> every 128 k; else every bk k
            const int fl = bk < 128 ? bk / 16 : 8;
            if ((c + 1) % fl == 0) {
              const int kf = kk - 16 * (fl - 1);  // the block's first chunk
              const bool in = kf < K;
              float f[NT][4];
              factors(in ? __ldg((const float*)Sc + srow_g + kf / bk) : 0.f,
                      in ? __ldg((const float*)Sc + srow_g8 + kf / bk) : 0.f, f);
              flush(0, NC, f);
            }
          } else {  // FP4: 32 k per chunk, one UE8M0 group; set p = c & 1 holds chains 2p, 2p + 1
            const int p = c & 1;
            u32 pg[4], pg8[4];
            fp4_pairs(d[2 * h], pg);
            fp4_pairs(d[2 * h + 1], pg8);
#pragma unroll
            for (int q = 0; q < NT; ++q) {
              uint4 u = make_uint4(0, 0, 0, 0), v = u;
              if (xok[q] && kk < K) {
                u = __ldg(xrow[q] + kk / 4 + 2 * t);
                v = __ldg(xrow[q] + kk / 4 + 2 * t + 1);
              }
              mma_f16(cc[2 * p][q], pg[0], pg8[0], pg[1], pg8[1], u.z, u.w);
              mma_f16(cc[2 * p + 1][q], pg[2], pg8[2], pg[3], pg8[3], v.z, v.w);
              mma_f16(cc[2 * p][q], pg[0], pg8[0], pg[1], pg8[1], u.x, u.y);
              mma_f16(cc[2 * p + 1][q], pg[2], pg8[2], pg[3], pg8[3], v.x, v.y);
            }
            if (c > 0 || sgm > 0) flush(2 * (1 - p), 2 * (1 - p) + 2, pend[1 - p]);  // the previous group
            if (c % 4 == 0) {  // a new 128-element group of x (after the previous group's flush)
              const int gx = (kk < K ? kk : 0) / 128;
#pragma unroll
              for (int q = 0; q < NT; ++q) {
                xs[q][0] = cok[q][0] ? __ldg(xinv[q][0] + gx) : 0.f;
                xs[q][1] = cok[q][1] ? __ldg(xinv[q][1] + gx) : 0.f;
              }
            }
            float sa, sb;
            if (sc_vec) {
              sa = e8m0_scaled(((c < 4 ? sga.x : sga.y) >> (8 * (c & 3))) & 0xFFu, 14);
              sb = e8m0_scaled(((c < 4 ? sgb.x : sgb.y) >> (8 * (c & 3))) & 0xFFu, 14);
            } else {
              const bool in = kk < K;
              sa = in ? e8m0_scaled(__ldg((const u8*)Sc + srow_g + kk / 32), 14) : 0.f;
              sb = in ? e8m0_scaled(__ldg((const u8*)Sc + srow_g8 + kk / 32), 14) : 0.f;
            }
            factors(sa, sb, pend[p]);
          }
        }
      }
    }
    if (FMT == FMT_FP4) flush(2, 4, pend[1]);  // the stage's last group (an odd chunk: set 1)
  }
  cp_async_wait<0>();
  if (kw > 1) {  // the tile's partial sums, in a fixed order (deterministic)
    __syncthreads();  // every warp is done with its ring: reuse it
    float* red = (float*)tc_smem;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[(warp * 32 + lane) * (4 * NT) + 4 * j + e] = acc[j][e];
    __syncthreads();
    if (part != 0) return;
    for (int p = 1; p < kw; ++p)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += red[((warp + p) * 32 + lane) * (4 * NT) + 4 * j + e];
  }
  if (n0 >= N) return;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = 8 * j + 2 * t + (e & 1), n = n0 + g + (e < 2 ? 0 : 8);
      if (m < rows && n < N) Y[(size_t)(row0 + m) * ldy + ycol + n] = acc[j][e];
    }
}

#define TC_ARGS const uint4 *XS, const float *XINV, int lda, float *Y, int ldy, int N, int K, const int *segs, \
                const u64 *wptrs, const u64 *sptrs, int bn, int bk, int gk, int kw
#define TC_PASS XS, XINV, lda, Y, ldy, N, K, segs, wptrs, sptrs, bn, bk, gk, kw
// NAME: tcgemv_<fmt>_n<NT>[_r<R>s<S>w<W>]; the unsuffixed names are the configuration the engine uses.
#define DEF_TC_CFG(NAME, FMT, NT, R, S, W)                                            \
  extern "C" __global__ void __launch_bounds__(32 * W) NAME(TC_ARGS) {               \
    tcgemv_body<FMT, NT, R, S, W>(TC_PASS);                                          \
  }
#define TC_R 1
#define TC_S 4
#define TC_W 8
#define DEF_TC(TAG, FMT, NT) DEF_TC_CFG(tcgemv_##TAG##_n##NT, FMT, NT, TC_R, TC_S, TC_W)
DEF_TC(fp8, FMT_FP8, 1)
DEF_TC(fp8, FMT_FP8, 2)
DEF_TC(fp8, FMT_FP8, 4)
DEF_TC(fp4, FMT_FP4, 1)
DEF_TC(fp4, FMT_FP4, 2)
DEF_TC(fp4, FMT_FP4, 4)
