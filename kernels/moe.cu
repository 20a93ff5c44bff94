// MoE routing: scores (softmax / sigmoid / sqrt(softplus)), top-k of score + bias (ties: lower
// expert id first, like a stable argsort), renormalised weights. One warp per token.
#include "dsuf_common.cuh"

#define ROUTE_MAXE 512
extern "C" __global__ void __launch_bounds__(256) route_topk(const float* __restrict__ logits,
                                                            const float* __restrict__ bias,
                                                            const long long* __restrict__ hash_ids,
                                                            float* __restrict__ wout, long long* __restrict__ iout,
                                                            int T, int E, int K, int scoring, float temp,
                                                            float rscale, int normalise) {
  __shared__ float sc_all[8][ROUTE_MAXE];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * 8 + warp;
  if (t >= T) return;
  float* sc = sc_all[warp];
  const float* lr = logits + (size_t)t * E;
  float mx = -DSUF_INF;
  for (int e = lane; e < E; e += 32) {
    float x = lr[e];
    if (temp != 1.f) x = x / temp;
    sc[e] = x;
    mx = fmaxf(mx, x);
  }
  mx = warp_max(mx);
  if (scoring == 0) {  // softmax
    if (!isfinite(mx)) mx = 0.f;
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) { sc[e] = expf(sc[e] - mx); sum += sc[e]; }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32) sc[e] = sc[e] / sum;
  } else if (scoring == 1) {
    for (int e = lane; e < E; e += 32) sc[e] = sigmoidf_(sc[e]);
  } else {  // sqrt(log(1 + exp(x))), computed stably like np.logaddexp(0, x)
    for (int e = lane; e < E; e += 32) {
      const float x = sc[e];
      sc[e] = sqrtf(fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))));
    }
  }
  __syncwarp();
  float wsum = 0.f, wk[16];
  long long ik[16];
  for (int k = 0; k < K && k < 16; ++k) {
    long long best_e;
    if (hash_ids) {
      best_e = hash_ids[(size_t)t * K + k];
    } else {
      float bv = -DSUF_INF;
      int be = 0x7fffffff;
      for (int e = lane; e < E; e += 32) {
        bool taken = false;
        for (int j = 0; j < k; ++j) taken |= (ik[j] == e);
        if (taken) continue;
        const float v = bias ? sc[e] + bias[e] : sc[e];
        if (v > bv || (be == 0x7fffffff)) { bv = v; be = e; }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (ov > bv || (ov == bv && oe < be)) { bv = ov; be = oe; }
      }
      best_e = be;
    }
    ik[k] = best_e;
    wk[k] = sc[best_e];
    wsum += wk[k];
  }
  if (lane != 0) return;
  for (int k = 0; k < K && k < 16; ++k) {
    const float v = (normalise && (K > 1 || hash_ids)) ? wk[k] / (wsum + 1e-20f) : wk[k];
    wout[(size_t)t * K + k] = v * rscale;
    iout[(size_t)t * K + k] = ik[k];
  }
}
