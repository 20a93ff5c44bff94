// Attention-side kernels: MQA with K == V and per-head sinks, and the indexer scores.
#include "dsuf_common.cuh"

// out[s, h, :] = softmax-with-sink over n of (q[s,h].kv[n] * scale + bias[s,n]) applied to kv.
// q [S, H, D], kv [N, D], bias [S, N] (0 or -inf), sinks [H]. D % 32 == 0, D <= 512.
// grid (ceil(H/8), S), block 256: warp w owns head 8*blockIdx.x + w; the K=V tile (TN rows) is
// staged once in shared memory for all 8 heads (one latent read serves every head). Tiles whose
// bias is -inf for this query are skipped, so windowed / top-k masks cost only what is visible.
// Dynamic shared memory: TN * D floats.
#define ATT_TN 16
#define ATT_DPL 16  // D / 32 at most
extern "C" __global__ void __launch_bounds__(256) attention(const float* __restrict__ q, const float* __restrict__ kv,
                                                           const float* __restrict__ bias,
                                                           const float* __restrict__ sinks, float* __restrict__ out,
                                                           int S, int H, int N, int D, float scale) {
  extern __shared__ __align__(16) float kvs[];
  __shared__ float bs[ATT_TN];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.x * 8 + warp, s = blockIdx.y;
  const bool active = h < H;
  const int nd = D / 32;
  float qr[ATT_DPL], o[ATT_DPL];
#pragma unroll
  for (int i = 0; i < ATT_DPL; ++i) {
    qr[i] = (active && i < nd) ? q[((size_t)s * H + h) * D + lane + 32 * i] : 0.f;
    o[i] = 0.f;
  }
  float m = -DSUF_INF, l = 0.f;
  const float* br = bias + (size_t)s * N;
  for (int n0 = 0; n0 < N; n0 += ATT_TN) {
    int vis = 0;
    if (threadIdx.x < ATT_TN) {
      const float b = n0 + (int)threadIdx.x < N ? br[n0 + threadIdx.x] : -DSUF_INF;
      bs[threadIdx.x] = b;
      vis = b > -DSUF_INF;
    }
    if (!__syncthreads_or(vis)) continue;
    const int D4 = D >> 2;
    for (int idx = threadIdx.x; idx < ATT_TN * D4; idx += blockDim.x) {
      const int r = idx / D4, c = idx % D4;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (n0 + r < N) v = __ldg((const float4*)(kv + (size_t)(n0 + r) * D) + c);
      ((float4*)kvs)[idx] = v;
    }
    __syncthreads();
    if (active) {
      float sc[ATT_TN];
      float tmax = -DSUF_INF;
#pragma unroll
      for (int r = 0; r < ATT_TN; ++r) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < ATT_DPL; ++i)
          if (i < nd) d += qr[i] * kvs[r * D + lane + 32 * i];
        d = warp_sum(d);
        sc[r] = d * scale + bs[r];
        tmax = fmaxf(tmax, sc[r]);
      }
      const float mn = fmaxf(m, tmax);
      if (mn > -DSUF_INF) {
        const float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int i = 0; i < ATT_DPL; ++i) o[i] *= corr;
#pragma unroll
        for (int r = 0; r < ATT_TN; ++r) {
          const float p = expf(sc[r] - mn);
          l += p;
#pragma unroll
          for (int i = 0; i < ATT_DPL; ++i)
            if (i < nd) o[i] += p * kvs[r * D + lane + 32 * i];
        }
        m = mn;
      }
    }
    __syncthreads();
  }
  if (!active) return;
  const float sk = sinks[h];
  const float mm = fmaxf(m, sk);
  const float em = expf(m - mm);
  const float f = em / (l * em + expf(sk - mm));
#pragma unroll
  for (int i = 0; i < ATT_DPL; ++i)
    if (i < nd) out[((size_t)s * H + h) * D + lane + 32 * i] = o[i] * f;
}

// out[s, n] = sum_h w[s, h] * H^-0.5 * relu(q[s, h] . k[n]) * Dh^-0.5
// q [S, H, Dh], k [N, Dh], w [S, H]. Dh % 32 == 0, Dh <= 256. grid (ceil(N/32), S), block 256:
// each warp scores 4 keys; q[s] and w[s] sit in dynamic shared memory (H*Dh + H floats).
#define IDX_KPW 4
extern "C" __global__ void __launch_bounds__(256) indexer_scores(const float* __restrict__ q,
                                                                const float* __restrict__ k,
                                                                const float* __restrict__ w,
                                                                float* __restrict__ out, int S, int H, int N,
                                                                int Dh, float dscale, float hscale) {
  extern __shared__ __align__(16) float qs[];
  float* ws = qs + H * Dh;
  const int s = blockIdx.y;
  for (int i = threadIdx.x; i < H * Dh; i += blockDim.x) qs[i] = q[(size_t)s * H * Dh + i];
  for (int i = threadIdx.x; i < H; i += blockDim.x) ws[i] = w[(size_t)s * H + i] * hscale;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nd = Dh / 32;
#pragma unroll
  for (int j = 0; j < IDX_KPW; ++j) {
    const int n = blockIdx.x * 32 + warp * IDX_KPW + j;
    if (n >= N) break;
    float kr[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) kr[i] = i < nd ? k[(size_t)n * Dh + lane + 32 * i] : 0.f;
    float acc = 0.f;
    for (int hh = 0; hh < H; ++hh) {
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i < nd) d += qs[hh * Dh + lane + 32 * i] * kr[i];
      d = warp_sum(d);
      acc += fmaxf(d, 0.f) * dscale * ws[hh];
    }
    if (lane == 0) out[(size_t)s * N + n] = acc;
  }
}
