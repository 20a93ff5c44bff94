// Row-wise and elementwise ops of the forward pass (float32 in and out, contiguous):
// RMSNorm, interleaved partial RoPE, mHC (mixes + Sinkhorn, collapse, expand), Engram gate,
// softmax-gated pooling, SwiGLU activation and the MoE combine. A kernel's `bf` argument
// (--numerics deepseek) rounds what it stores to bf16, as the reference stores its activations.
#include "dsuf_common.cuh"

__device__ __forceinline__ float4 round_bf16x4(float4 v) {
  return make_float4(round_bf16f(v.x), round_bf16f(v.y), round_bf16f(v.z), round_bf16f(v.w));
}

// y[r, :] = x[r, :] / sqrt(mean(x^2) + eps) * w   (w may be null). grid (rows), block 256.
extern "C" __global__ void rmsnorm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                   int D, float eps, int bf) {
  dsuf_launch_dependents();
  __shared__ float red[33];
  const float* xr = x + (size_t)blockIdx.x * D;
  float* yr = y + (size_t)blockIdx.x * D;
  float s = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) s += xr[i] * xr[i];
  s = block_sum(s, red);
  const float r = 1.f / sqrtf(s / (float)D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float v = xr[i] * r;
    v = w ? v * w[i] : v;
    yr[i] = bf ? round_bf16f(v) : v;
  }
}

// Same for D % 4 == 0 and D <= 8192 (block 256): each thread loads its up to 8 float4 at once and
// keeps them in registers, so a row costs one round trip to memory, not a chain of dependent
// strided loads.
#define RMS_VPT 8
// The end of a row's RMS norm (rmsnorm_v4, hc_collapse_norm): s, this thread's sum of squares of its
// values v (float4 j of them at threadIdx.x + 256 j), summed over the block; then v / rms times w (may
// be null) to yr, rounded to bf16 with bf.
__device__ __forceinline__ void rms_scale_store(const float4 (&v)[RMS_VPT], float s, const float* __restrict__ w,
                                                float4* __restrict__ yr, int n4, int D, float eps, int bf,
                                                float* red) {
  s = block_sum(s, red);
  const float r = 1.f / sqrtf(s / (float)D + eps);
#pragma unroll
  for (int j = 0; j < RMS_VPT; ++j) {
    const int i = threadIdx.x + j * 256;
    if (i < n4) {
      float4 o = make_float4(v[j].x * r, v[j].y * r, v[j].z * r, v[j].w * r);
      if (w) {
        const float4 g = __ldg((const float4*)w + i);
        o.x *= g.x; o.y *= g.y; o.z *= g.z; o.w *= g.w;
      }
      yr[i] = bf ? round_bf16x4(o) : o;
    }
  }
}
extern "C" __global__ void __launch_bounds__(256) rmsnorm_v4(const float* __restrict__ x, const float* __restrict__ w,
                                                             float* __restrict__ y, int D, float eps, int bf) {
  dsuf_launch_dependents();
  __shared__ float red[33];
  const float4* xr = (const float4*)(x + (size_t)blockIdx.x * D);
  float4* yr = (float4*)(y + (size_t)blockIdx.x * D);
  const int n4 = D >> 2;
  float4 v[RMS_VPT];
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < RMS_VPT; ++j) {
    const int i = threadIdx.x + j * 256;
    v[j] = i < n4 ? __ldg(xr + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    s += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  }
  rms_scale_store(v, s, w, yr, n4, D, eps, bf, red);
}

// Interleaved-pair RoPE on the trailing 2*P channels of rows of width D. x viewed as
// [T, M, D]; cos/sin [T, P]; sign = -1 rotates back. One thread per (t, m, channel).
extern "C" __global__ void rope(const float* __restrict__ x, const float* __restrict__ cs, const float* __restrict__ sn,
                                float* __restrict__ y, long long total, int M, int D, int P, float sign, int bf) {
  dsuf_launch_dependents();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int d = (int)(i % D);
  const long long row = i / D;
  const int t = (int)(row / M);
  const int off = D - 2 * P;
  if (d < off) {
    y[i] = bf ? round_bf16f(x[i]) : x[i];
    return;
  }
  const int p = (d - off) >> 1;
  const float c = cs[(size_t)t * P + p], s = sign * sn[(size_t)t * P + p];
  float v;  // (products rounded apart, not fused: the numpy reference's arithmetic, bit for bit)
  if (((d - off) & 1) == 0) {
    const float e = x[i], o = x[i + 1];
    v = __fsub_rn(__fmul_rn(e, c), __fmul_rn(o, s));
  } else {
    const float e = x[i - 1], o = x[i];
    v = __fadd_rn(__fmul_rn(e, s), __fmul_rn(o, c));
  }
  y[i] = bf ? round_bf16f(v) : v;
}

// rope in place: the trailing 2*P channels of rows of width D rotated, the others left as they
// are (an attention output whose RoPE is undone before wo_a). One thread per (t, m, pair).
extern "C" __global__ void rope_tail(float* __restrict__ x, const float* __restrict__ cs,
                                     const float* __restrict__ sn, long long pairs, int M, int D, int P, float sign,
                                     int bf) {
  dsuf_launch_dependents();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  const int p = (int)(i % P);
  const long long row = i / P;
  const int t = (int)(row / M);
  float2* px = (float2*)(x + row * D + (D - 2 * P) + 2 * p);
  const float2 v = *px;
  const float c = cs[(size_t)t * P + p], s = sign * sn[(size_t)t * P + p];
  const float e = __fsub_rn(__fmul_rn(v.x, c), __fmul_rn(v.y, s)), o = __fadd_rn(__fmul_rn(v.x, s), __fmul_rn(v.y, c));
  *px = bf ? make_float2(round_bf16f(e), round_bf16f(o)) : make_float2(e, o);
}

// mHC mixes, in two launches so a single token still spreads its fn reads (NM x F floats, 2 MB
// at V4.1-Flash widths) over many SMs:
//  1. hc_mix_partial, grid (T, S): block s dots its slice of F = hc*D (HC_SLICE floats) of the
//     token's streams with every fn row and with itself -> part[t, s, 0..NM] (NM dots, then the
//     sum of squares);
//  2. hc_mixes, grid (T): sums the S partials in a fixed order (deterministic), scales the dots
//     by the RMS norm, then mode 0: NM = 2*hc + hc*hc -> pre, post, comb (Sinkhorn); mode 1
//     (hc_head): NM = hc -> pre only.
#define MAX_MIX 80  // (2 + hc) * hc for hc <= 8
#define HC_SLICE 1024  // floats of F per partial block: 256 threads x 4

extern "C" __global__ void __launch_bounds__(256) hc_mix_partial(const float* __restrict__ h,
                                                                 const float* __restrict__ fn, int F, int NM,
                                                                 float* __restrict__ part) {
  __shared__ float red[8][MAX_MIX + 1];
  const int t = blockIdx.x, s = blockIdx.y, S = gridDim.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i0 = s * HC_SLICE + threadIdx.x * 4;
  float x[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] = i0 + j < F ? h[(size_t)t * F + i0 + j] : 0.f;
  float ss = x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
  ss = warp_sum(ss);
  if (lane == 0) red[warp][NM] = ss;
  for (int m = 0; m < NM; ++m) {
    const float* f = fn + (size_t)m * F;
    float a = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) a += i0 + j < F ? x[j] * f[i0 + j] : 0.f;
    a = warp_sum(a);
    if (lane == 0) red[warp][m] = a;
  }
  __syncthreads();
  for (int m = threadIdx.x; m <= NM; m += blockDim.x) {
    float v = 0.f;
    for (int w = 0; w < 8; ++w) v += red[w][m];
    part[((size_t)t * S + s) * (NM + 1) + m] = v;
  }
}

// 1'. hc_mix_partial_rows (prompt chunks: T >= HC_ROWS_MIN, NM < 32, F % 4 == 0), grid
//     (ceil(T / HCR_T), ceil(F / HCR_SL)), block 256: the same partials for HCR_T tokens at once, so a
//     slice of fn's rows is read once per HCR_T tokens rather than once per token (hc_mix_partial and
//     hc_mix re-read the 2 MB of fn from L2 for every token). The block stages its tokens' slice of
//     x and the fn rows' slice in shared memory; thread (token r = tid / 8, g = tid % 8) sums values
//     m = g, g + 8, g + 16, g + 24 (m < NM: a dot with fn row m; m == NM: the sum of squares) over the
//     slice in k order.
#define HCR_T 32    // tokens per block
#define HCR_SL 128  // floats of F per block
extern "C" __global__ void __launch_bounds__(256) hc_mix_partial_rows(const float* __restrict__ h,
                                                                      const float* __restrict__ fn, int T, int F,
                                                                      int NM, float* __restrict__ part) {
  constexpr int C4 = HCR_SL / 4;            // float4 columns of the slice
  __shared__ float4 xs[HCR_T][C4 + 1];      // (+1: a row's float4s start 4 banks after the last's)
  __shared__ float4 fs[32][C4 + 1];
  const int t0 = blockIdx.x * HCR_T, s = blockIdx.y, S = gridDim.y, k0 = s * HCR_SL;
  for (int i = threadIdx.x; i < HCR_T * C4; i += 256) {
    const int r = i / C4, c = i % C4, t = t0 + r, k = k0 + 4 * c;
    xs[r][c] = t < T && k < F ? __ldg((const float4*)(h + (size_t)t * F + k)) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int i = threadIdx.x; i < NM * C4; i += 256) {
    const int m = i / C4, c = i % C4, k = k0 + 4 * c;
    fs[m][c] = k < F ? __ldg((const float4*)(fn + (size_t)m * F + k)) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  __syncthreads();
  const int r = threadIdx.x >> 3, g = threadIdx.x & 7;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int c = 0; c < C4; ++c) {
    const float4 x = xs[r][c];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = g + 8 * j;
      if (m <= NM) {
        const float4 f = m < NM ? fs[m][c] : x;
        acc[j] += x.x * f.x + x.y * f.y + x.z * f.z + x.w * f.w;
      }
    }
  }
  const int t = t0 + r;
  if (t < T) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = g + 8 * j;
      if (m <= NM) part[((size_t)t * S + s) * (NM + 1) + m] = acc[j];
    }
  }
}

// mode-0 finish for hc a power of two with hc*hc <= 32: lane l holds comb[i = l / hc][j = l % hc]; row sums
// are xor-shuffles over offsets < hc, column sums over offsets hc .. hc*hc/2 (both stay inside the active
// lanes, so the idle lanes' values never mix in), instead of one thread's serial chain of Sinkhorn
// rounds; the sums here are trees instead of left-to-right (<= 1 ulp apart).
__device__ __forceinline__ void hc_sinkhorn_warp(const float* mix, const float* __restrict__ scale,
                                                 const float* __restrict__ base, int hc, float hc_eps, int iters,
                                                 int t, float* __restrict__ pre, float* __restrict__ post,
                                                 float* __restrict__ comb) {
  const int l = threadIdx.x, n2 = hc * hc;
  const bool act = l < n2;
  if (l < hc) {
    pre[t * hc + l] = sigmoidf_(mix[l] * scale[0] + base[l]) + hc_eps;
    post[t * hc + l] = 2.f * sigmoidf_(mix[hc + l] * scale[1] + base[hc + l]);
  }
  const float c0 = act ? mix[2 * hc + l] * scale[2] + base[2 * hc + l] : 0.f;
  float m = c0;
  for (int o = 1; o < hc; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!isfinite(m)) m = 0.f;
  const float e = expf(c0 - m);
  float s = e;
  for (int o = 1; o < hc; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  float c = e / s + hc_eps;
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {  // row normalise (the first round starts with the column step)
      s = c;
      for (int o = 1; o < hc; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      c = c / (s + hc_eps);
    }
    s = c;
    for (int o = hc; o < n2; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    c = c / (s + hc_eps);
  }
  if (act) comb[(size_t)t * n2 + l] = c;
}

extern "C" __global__ void hc_mixes(const float* __restrict__ part, int S, const float* __restrict__ scale,
                                    const float* __restrict__ base, int hc, int F, int NM, float norm_eps,
                                    float hc_eps, int iters, int mode, float* __restrict__ pre,
                                    float* __restrict__ post, float* __restrict__ comb) {
  __shared__ float mix[MAX_MIX + 1];
  const float* pt = part + (size_t)blockIdx.x * S * (NM + 1);
  {  // one warp per mix value, lanes over the S partials, then a fixed tree: deterministic, and the
     // loads of a value are spread over 32 lanes instead of chained in one thread
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int m = threadIdx.x >> 5; m <= NM; m += nw) {
      float v = 0.f;
      for (int s = lane; s < S; s += 32) v += pt[(size_t)s * (NM + 1) + m];
      v = warp_sum(v);
      if (lane == 0) mix[m] = v;
    }
  }
  __syncthreads();
  const float rstd = 1.f / sqrtf(mix[NM] / (float)F + norm_eps);
  __syncthreads();
  for (int m = threadIdx.x; m < NM; m += blockDim.x) mix[m] *= rstd;
  __syncthreads();
  const int t = blockIdx.x;
  if (mode == 0 && hc * hc <= 32 && (hc & (hc - 1)) == 0) {  // V4.1 / V4 widths: one lane per comb entry
    if (threadIdx.x < 32) hc_sinkhorn_warp(mix, scale, base, hc, hc_eps, iters, t, pre, post, comb);
    return;
  }
  if (threadIdx.x != 0) return;
  if (mode == 1) {
    for (int i = 0; i < hc; ++i) pre[t * hc + i] = sigmoidf_(mix[i] * scale[0] + base[i]) + hc_eps;
    return;
  }
  for (int i = 0; i < hc; ++i) {
    pre[t * hc + i] = sigmoidf_(mix[i] * scale[0] + base[i]) + hc_eps;
    post[t * hc + i] = 2.f * sigmoidf_(mix[hc + i] * scale[1] + base[hc + i]);
  }
  float c[64];
  for (int i = 0; i < hc; ++i) {
    float m = -DSUF_INF;
    for (int j = 0; j < hc; ++j) {
      c[i * hc + j] = mix[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
      m = fmaxf(m, c[i * hc + j]);
    }
    if (!isfinite(m)) m = 0.f;
    float s = 0.f;
    for (int j = 0; j < hc; ++j) { c[i * hc + j] = expf(c[i * hc + j] - m); s += c[i * hc + j]; }
    for (int j = 0; j < hc; ++j) c[i * hc + j] = c[i * hc + j] / s + hc_eps;
  }
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {  // row normalise (the first round starts with the column step)
      for (int i = 0; i < hc; ++i) {
        float s = 0.f;
        for (int j = 0; j < hc; ++j) s += c[i * hc + j];
        for (int j = 0; j < hc; ++j) c[i * hc + j] /= (s + hc_eps);
      }
    }
    for (int j = 0; j < hc; ++j) {
      float s = 0.f;
      for (int i = 0; i < hc; ++i) s += c[i * hc + j];
      for (int i = 0; i < hc; ++i) c[i * hc + j] /= (s + hc_eps);
    }
  }
  for (int i = 0; i < hc * hc; ++i) comb[(size_t)t * hc * hc + i] = c[i];
}

// Both mHC steps in one launch (NM <= 32, hc a power of two with hc*hc <= 32): grid (T, S), block
// 256, block s dots the 512-float slice s of F (128 float4 positions x 2 halves of the fn rows, every
// load of a thread in flight at once) and writes its partials; the last block of row t to finish
// (counter cnt[t], which it resets to 0) sums the S partials in a fixed order (deterministic) and
// finishes as hc_mixes does. At b = 1 that is 40 blocks, one round trip each, and no second launch.
#define HCF_SLICE 512
#define HCF_ROWS 16  // fn rows per half-block (NM <= 32)
extern "C" __global__ void __launch_bounds__(256) hc_mix(const float* __restrict__ h, const float* __restrict__ fn,
                                                         int F, int NM, float* __restrict__ part,
                                                         int* __restrict__ cnt, const float* __restrict__ scale,
                                                         const float* __restrict__ base, int hc, float norm_eps,
                                                         float hc_eps, int iters, int mode, float* __restrict__ pre,
                                                         float* __restrict__ post, float* __restrict__ comb) {
  __shared__ float red[8][HCF_ROWS + 1];
  __shared__ float fin[8][33];
  __shared__ int last;
  const int t = blockIdx.x, s = blockIdx.y, S = gridDim.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, half = threadIdx.x >> 7;
  const int per = (NM + 1) >> 1, m0 = half * per;
  const int i0 = s * HCF_SLICE + (threadIdx.x & 127) * 4;
  const bool in = i0 < F;  // (F % 4 == 0)
  const float4 x = in ? __ldg((const float4*)(h + (size_t)t * F + i0)) : make_float4(0.f, 0.f, 0.f, 0.f);
  float4 f[HCF_ROWS];
#pragma unroll
  for (int j = 0; j < HCF_ROWS; ++j)
    f[j] = in && j < per && m0 + j < NM ? __ldg((const float4*)(fn + (size_t)(m0 + j) * F + i0))
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
  float v = half == 0 ? x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w : 0.f;
  v = warp_sum(v);
  if (lane == 0) red[warp][HCF_ROWS] = v;
#pragma unroll
  for (int j = 0; j < HCF_ROWS; ++j) {
    if (j < per) {
      float a = x.x * f[j].x + x.y * f[j].y + x.z * f[j].z + x.w * f[j].w;
      a = warp_sum(a);
      if (lane == 0) red[warp][j] = a;
    }
  }
  __syncthreads();
  float* pt = part + (size_t)t * S * (NM + 1);
  if (threadIdx.x <= NM) {  // value m: the 4 warps of its half, in order
    const int m = threadIdx.x, hf = m < NM && m >= per ? 1 : 0, j = m == NM ? HCF_ROWS : m - hf * per;
    float a = 0.f;
    for (int w = 0; w < 4; ++w) a += red[hf * 4 + w][j];
    pt[(size_t)s * (NM + 1) + m] = a;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(cnt + t, 1) == S - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  {  // lane m, warp w: partials s = w, w + 8, ...; then the 8 warps in order
    float a = 0.f;
    if (lane <= NM) {
#pragma unroll 8
      for (int q = warp; q < S; q += 8) a += __ldcg(pt + (size_t)q * (NM + 1) + lane);
    }
    fin[warp][lane] = a;
  }
  __syncthreads();
  if (threadIdx.x == 0) cnt[t] = 0;  // ready for the next launch (and graph replay)
  if (warp != 0) return;
  float mv = 0.f;
  for (int w = 0; w < 8; ++w) mv += fin[w][lane];
  const float rstd = 1.f / sqrtf(__shfl_sync(0xffffffffu, mv, NM) / (float)F + norm_eps);
  fin[0][lane] = mv * rstd;
  __syncwarp();
  if (mode == 1) {
    if (lane < hc) pre[t * hc + lane] = sigmoidf_(fin[0][lane] * scale[0] + base[lane]) + hc_eps;
    return;
  }
  hc_sinkhorn_warp(fin[0], scale, base, hc, hc_eps, iters, t, pre, post, comb);
}

// out[t, :] = rmsnorm(sum_i pre[t, i] * h[t, i, :]) * w: hc_collapse and rmsnorm_v4 in one launch
// (D % 4 == 0, D <= 8192; grid (T), block 256; w may be null).
extern "C" __global__ void __launch_bounds__(256) hc_collapse_norm(const float* __restrict__ h,
                                                                   const float* __restrict__ pre,
                                                                   const float* __restrict__ w,
                                                                   float* __restrict__ y, int hc, int D, float eps,
                                                                   int bf) {
  dsuf_launch_dependents();
  __shared__ float red[33];
  const int t = blockIdx.x, n4 = D >> 2;
  float4 v[RMS_VPT];
#pragma unroll
  for (int j = 0; j < RMS_VPT; ++j) v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int i = 0; i < hc; ++i) {  // (unrolled: the streams' loads in flight together)
    const float p = pre[t * hc + i];
    const float4* hr = (const float4*)(h + ((size_t)t * hc + i) * D);
#pragma unroll
    for (int j = 0; j < RMS_VPT; ++j) {
      const int c = threadIdx.x + j * 256;
      if (c < n4) {
        const float4 a = __ldg(hr + c);
        v[j].x += p * a.x; v[j].y += p * a.y; v[j].z += p * a.z; v[j].w += p * a.w;
      }
    }
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < RMS_VPT; ++j) {
    if (bf) v[j] = round_bf16x4(v[j]);  // (the reference stores the collapse in bf16 before its norm)
    s += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  }
  rms_scale_store(v, s, w, (float4*)(y + (size_t)t * D), n4, D, eps, bf, red);
}

// out[t, d] = sum_i pre[t, i] * h[t, i, d]
extern "C" __global__ void hc_collapse(const float* __restrict__ h, const float* __restrict__ pre,
                                       float* __restrict__ out, long long total, int hc, int D) {
  dsuf_launch_dependents();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long t = i / D;
  const int d = (int)(i % D);
  float s = 0.f;
  for (int j = 0; j < hc; ++j) s += pre[t * hc + j] * h[(t * hc + j) * D + d];
  out[i] = s;
}

// new[t, k, d] = post[t, k] * out[t, d] + sum_j comb[t, j, k] * res[t, j, d] (the sum in order of j).
// grid (T, ceil(D / 4 / 256)), block 256, D % 4 == 0, hc <= 8: a thread takes 4 columns d of token t
// for every k, so each residual and output value is read once (a thread per output element read
// each residual value hc times and divided 64-bit indices).
extern "C" __global__ void __launch_bounds__(256) hc_expand(const float* __restrict__ out,
                                                            const float* __restrict__ res,
                                                            const float* __restrict__ post,
                                                            const float* __restrict__ comb, float* __restrict__ y,
                                                            int hc, int D, int bf) {
  dsuf_launch_dependents();
  const int c = blockIdx.y * blockDim.x + threadIdx.x, D4 = D >> 2;
  if (c >= D4) return;
  const size_t t = blockIdx.x;
  float4 r[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < hc) r[j] = __ldg((const float4*)(res + (t * hc + j) * D) + c);
  const float4 o = __ldg((const float4*)(out + t * D) + c);
  for (int k = 0; k < hc; ++k) {
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < hc) {
        const float w = comb[(t * hc + j) * hc + k];
        s.x += w * r[j].x, s.y += w * r[j].y, s.z += w * r[j].z, s.w += w * r[j].w;
      }
    }
    const float p = post[t * hc + k];
    float4 v = make_float4(p * o.x + s.x, p * o.y + s.y, p * o.z + s.z, p * o.w + s.w);
    if (bf) v = make_float4(round_bf16f(v.x), round_bf16f(v.y), round_bf16f(v.z), round_bf16f(v.w));
    *((float4*)(y + (t * hc + k) * D) + c) = v;
  }
}

// Engram gate, one (t, stream) row per block: h + sigmoid(signed sqrt(dot)) * value[t].
extern "C" __global__ void engram_mix(const float* __restrict__ h, const float* __restrict__ key,
                                      const float* __restrict__ value, const float* __restrict__ qk,
                                      float* __restrict__ y, int hc, int D, float eps, int bf) {
  __shared__ float red[33];
  const size_t row = blockIdx.x;
  const int t = (int)(row / hc), s = (int)(row % hc);
  const float* hr = h + row * D;
  const float* kr = key + row * D;
  const float* q = qk + (size_t)s * D;
  float hh = 0.f, kk = 0.f, dot = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    hh += hr[i] * hr[i];
    kk += kr[i] * kr[i];
    dot += hr[i] * q[i] * kr[i];
  }
  hh = block_sum(hh, red);
  kk = block_sum(kk, red);
  dot = block_sum(dot, red);
  const float rstd = (1.f / sqrtf(hh / (float)D + eps)) * (1.f / sqrtf(kk / (float)D + eps));
  const float g0 = dot * rstd * rsqrtf((float)D);
  const float mag = sqrtf(fmaxf(fabsf(g0), 1e-6f));
  const float gate = sigmoidf_(copysignf(mag, g0));
  const float* v = value + (size_t)t * D;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float o = hr[i] + gate * v[i];
    y[row * D + i] = bf ? round_bf16f(o) : o;
  }
}

// sum_r softmax_r(gate[r * D]) * kv[r * D]: one column of a group's R rows
__device__ __forceinline__ float pool_column(const float* __restrict__ kr, const float* __restrict__ gr, int R, int D) {
  float m = -DSUF_INF;
  for (int r = 0; r < R; ++r) m = fmaxf(m, gr[(size_t)r * D]);
  if (!isfinite(m)) m = 0.f;
  float s = 0.f;
  for (int r = 0; r < R; ++r) s += expf(gr[(size_t)r * D] - m);
  float acc = 0.f;
  for (int r = 0; r < R; ++r) acc += kr[(size_t)r * D] * (expf(gr[(size_t)r * D] - m) / s);
  return acc;
}

// kv, gate [G, R, D] -> out[g, d] = sum_r softmax_r(gate[g, :, d]) * kv[g, r, d]
extern "C" __global__ void gated_pool(const float* __restrict__ kv, const float* __restrict__ gate,
                                      float* __restrict__ out, long long total, int R, int D, int bf) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long g = i / D;
  const int d = (int)(i % D);
  const float o = pool_column(kv + g * R * D + d, gate + g * R * D + d, R, D);
  out[i] = bf ? round_bf16f(o) : o;
}

// Decode: the same for the group of sequence b, whose R rows start at kvs[2 b] / gates[2 b] (span
// tables: address, count); a zero address (no group closes) gives a zero row. out [B, D].
extern "C" __global__ void gated_pool_rows(const long long* __restrict__ kvs, const long long* __restrict__ gates,
                                           float* __restrict__ out, long long total, int R, int D, int bf) {
  dsuf_launch_dependents();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long b = i / D;
  const int d = (int)(i % D);
  const float* kr = (const float*)kvs[2 * b];
  const float* gr = (const float*)gates[2 * b];
  const float o = kr == nullptr ? 0.f : pool_column(kr + d, gr + d, R, D);
  out[i] = bf ? round_bf16f(o) : o;
}

extern "C" __global__ void swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                  float* __restrict__ y, long long total, float limit) {
  dsuf_launch_dependents();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  y[i] = swiglu1(gate[i], up[i], limit);
}

// swiglu of a fused gate / up output: gu [rows, 2 * inter] (gate columns, then up) -> y [rows, inter]
extern "C" __global__ void swiglu_pairs(const float* __restrict__ gu, float* __restrict__ y, long long total,
                                        int inter, float limit) {
  dsuf_launch_dependents();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long r = i / inter;
  const int c = (int)(i - r * inter);
  y[i] = swiglu1(gu[r * 2 * inter + c], gu[r * 2 * inter + inter + c], limit);
}

// y[t, d] = sum_s w[t, s] * out[inv[t, s], d]   (inv: row of pair (t, s) in expert order), then
// + shared[t, d] (the shared expert's output; nullptr: none) and, with bf (--numerics deepseek),
// rounded to bf16: the MoE's whole tail in one launch (not an add and a rounding pass of their own),
// bit for bit what those computed: the experts' sum first, then the shared row.
extern "C" __global__ void moe_combine(const float* __restrict__ out, const float* __restrict__ w,
                                       const int* __restrict__ inv, const float* __restrict__ shared,
                                       float* __restrict__ y, long long total, int K, int D, int bf) {
  dsuf_launch_dependents();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long t = i / D;
  const int d = (int)(i % D);
  float s = 0.f;
  for (int k = 0; k < K; ++k) s += out[(size_t)inv[t * K + k] * D + d] * w[t * K + k];
  if (shared != nullptr) s += shared[i];
  y[i] = bf ? round_bf16f(s) : s;
}

// Batched row copies: job j moves tab[3j + 2] bytes from tab[3j] to tab[3j + 1] (addresses and
// sizes multiples of 16: the host sends anything else through cudaMemcpyAsync). grid (jobs, parts).
extern "C" __global__ void copy_rows(const long long* __restrict__ tab) {
  const long long* t = tab + 3 * blockIdx.x;
  const uint4* __restrict__ src = (const uint4*)t[0];
  uint4* __restrict__ dst = (uint4*)t[1];
  const long long n = t[2] / 16;
  for (long long i = (long long)blockIdx.y * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.y * blockDim.x)
    dst[i] = src[i];
}

// dst row r = src row idx[r], rows of n16 16-byte words (a MoE's quantized token rows in pair
// order, for the grouped GEMM to read in place). grid (rows), any block.
extern "C" __global__ void gather_rows16(const uint4* __restrict__ src, const int* __restrict__ idx,
                                         uint4* __restrict__ dst, int n16) {
  const uint4* s = src + (size_t)idx[blockIdx.x] * n16;
  uint4* d = dst + (size_t)blockIdx.x * n16;
  for (int i = threadIdx.x; i < n16; i += blockDim.x) d[i] = s[i];
}

// Row b of src [B, W] (rows ld floats apart) to the address dst[b], skipped where it is 0: a decode
// step's new state rows, each into its own sequence's buffer. vec4: W, ld and the addresses are
// multiples of 4 floats. grid (B), block 128.
extern "C" __global__ void scatter_rows(const float* __restrict__ src, const long long* __restrict__ dst, int W,
                                        int ld, int vec4) {
  dsuf_launch_dependents();
  float* d = (float*)dst[blockIdx.x];
  if (d == nullptr) return;
  const float* s = src + (size_t)blockIdx.x * ld;
  if (vec4) {
    for (int i = threadIdx.x; i < W / 4; i += blockDim.x) ((float4*)d)[i] = ((const float4*)s)[i];
  } else {
    for (int i = threadIdx.x; i < W; i += blockDim.x) d[i] = s[i];
  }
}

// --numerics deepseek: y = x rounded to bf16 (round_bf16f), rows of `cols` floats, ldx / ldy floats
// apart (a column slice of a stacked projection is rounded in place).
extern "C" __global__ void round_bf16_rows(const float* __restrict__ x, float* __restrict__ y, long long total,
                                           int cols, long long ldx, long long ldy) {
  dsuf_launch_dependents();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long r = i / cols;
  const int c = (int)(i - r * cols);
  y[r * ldy + c] = round_bf16f(x[r * ldx + c]);
}

// --numerics deepseek, the experts' hidden rows in expert order: h[r, c] = bf16(h[r, c] * w[order[r]])
// (the routing weight of pair order[r] scales the hidden state before w2, as the reference's
// Expert.forward does).
extern "C" __global__ void moe_weight_rows(float* __restrict__ h, const float* __restrict__ w,
                                           const int* __restrict__ order, long long total, int inter) {
  dsuf_launch_dependents();
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  h[i] = round_bf16f(h[i] * w[order[i / inter]]);
}
