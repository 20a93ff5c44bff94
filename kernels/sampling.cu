// Token sampling on the GPU: engine/sampling.py's sample() for one row per block, so that only
// the drawn token (and logprobs) leave the device instead of [batch, vocab] logits.
//
// Per job: x = logits + penalty/bias deltas (unique ids, merged on the host); greedy = argmax
// (first index on ties). Otherwise, on the temperature-scaled distribution e_i = exp((x_i - max)/T):
// top-k keeps every key >= the k-th largest (ties included, as numpy's `scaled >= kth`); min-p
// keeps e_i >= min_p (p_i >= min_p * p_max); top-p keeps the shortest prefix of the tokens in
// descending order (ties by id) whose mass reaches top_p; the argmax always survives. The draw
// is the inverse CDF over the allowed ids in id order at the host generator's uniform u.
// Logprobs are the log-softmax of the raw logits: the token's and the n largest (ties by id).
//
// Warp w owns a contiguous segment of ids for the id-order passes (tie ranks, CDF), read 32
// consecutive ids at a time (coalesced; ranks within them by ballot, sums by warp scan); the
// other passes stride over the row. Probability mass is summed in 2^-40 fixed point
// (radix_select.cuh), so every sum is exact and a job draws the same token whatever the order of
// the additions. The exponentials are float32: a draw may differ from the float64 reference only
// where u*W lies within rounding of a CDF step or a top-p sum of top_p.
#include "radix_select.cuh"

#define SMP_THREADS 1024
#define SMP_TOPN 20  // OpenAI's top_logprobs limit (server/protocol.py MAX_TOP_LOGPROBS)

// job header: int32 words (floats by bit pattern) -- engine/ops/gpu/sampling.py JOB_*
#define J_ROW 0    // logits row
#define J_TOPK 1   // 0: off
#define J_NTOP 2   // -1: no logprobs; else how many top logprobs (<= SMP_TOPN)
#define J_PEN0 3   // deltas pen[PEN0:PEN1] (ids, then values) apply to this row
#define J_PEN1 4
#define J_WORK 5   // row of the scratch buffer for x when it has deltas, else -1 (x = logits)
#define J_TEMP 6   // f32; <= 0: greedy
#define J_TOPP 7   // f32; >= 1: off
#define J_MINP 8   // f32; <= 0: off
#define J_MASK 9   // -1: unconstrained; else offset in masks of this row's packed token mask
                   // (bit i of word w allows id 32w+i; needs J_WORK >= 0)
#define J_U 10     // f64 uniform in [0, 1) (words 10-11: 8-byte aligned)
#define J_MODE 12  // SMP_DRAW, SMP_VERIFY or SMP_KEEP
#define J_DRAFT 13 // SMP_VERIFY: the draft token to test, -1 for the bonus row (a plain draw)
#define J_Q 14     // u64 device address (words 14-15) of a float32 row [V]: the draft's q (read by
                   // SMP_VERIFY, written by SMP_KEEP); 0: none
#define J_UA 16    // f64 (words 16-17): SMP_VERIFY's uniform testing the draft
#define J_WORDS 18
#define SMP_DRAW 0
#define SMP_VERIFY 1
#define SMP_KEEP 2
// output: int32 words per job
#define O_TOKEN 0
#define O_LP 1                 // f32
#define O_IDS 2                // SMP_TOPN ids
#define O_LPS (2 + SMP_TOPN)  // SMP_TOPN f32
#define O_ACCEPT (2 + 2 * SMP_TOPN)  // SMP_VERIFY: 1 if the draft is kept (O_TOKEN is then the draft)
#define O_WORDS (3 + 2 * SMP_TOPN)

// max key with the smallest index: (key << 32) | ~index, maximized over the block
__device__ __forceinline__ u64 block_max_u64(u64 v, u64* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const u64 t = __shfl_xor_sync(0xffffffffu, v, o);
    v = t > v ? t : v;
  }
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    u64 t = lane < (int)(blockDim.x >> 5) ? red[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const u64 s = __shfl_xor_sync(0xffffffffu, t, o);
      t = s > t ? s : t;
    }
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  return red[32];
}

// Index of the largest order_key(v[i]) over the block, the first on ties (every thread gets it).
__device__ __forceinline__ int block_argmax(const float* v, int V, u64* red) {
  u64 best = 0ull;  // (key << 32) | ~index
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const u64 t = ((u64)order_key(__float_as_uint(v[i])) << 32) | (u64)(0xffffffffu - (u32)i);
    best = t > best ? t : best;
  }
  best = block_max_u64(best, red);
  return (int)(0xffffffffu - (u32)(best & 0xffffffffull));
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// v: a per-warp value (the same in every lane). Returns the sum over the warps before this one;
// *total gets the sum over all warps. Every thread of the block must call it.
__device__ __forceinline__ u64 warp_offsets(u64 v, u64* red, u64* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  const u64 r = lane < nw ? red[lane] : 0ull;
  *total = warp_sum_u64(r);
  return warp_sum_u64(lane < warp ? r : 0ull);
}

__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* red) {
  u64 total;
  warp_offsets(warp_sum_u64(v), red, &total);
  return total;
}

// logits: [rows, V] f32; jobs: [J, J_WORDS]; pen_ids / pen_val: the deltas; masks: the packed
// token masks of constrained rows ((V + 31) / 32 words each); work: [*, V] f32 scratch for rows
// with deltas or a mask; out: [J, O_WORDS]. grid = J, block = SMP_THREADS, dynamic shared
// memory SMP_SMEM (the radix histograms, one per warp).
#define SMP_SMEM (256 * (SMP_THREADS / 32) * 8)
#define SMP_GROUPS 128  // per warp: group sums and tie counts fit SMP_SMEM (V <= 131072 at 1024 threads)
extern "C" __global__ void __launch_bounds__(SMP_THREADS) sample_rows(
    const float* __restrict__ logits, int V, const int* __restrict__ jobs, const int* __restrict__ pen_ids,
    const float* __restrict__ pen_val, const unsigned* __restrict__ masks, float* __restrict__ work,
    int* __restrict__ out) {
  extern __shared__ u64 hist[];
  __shared__ u32 pick[6];
  __shared__ float red[33];
  __shared__ u64 red64[33];
  __shared__ int s_tok;
  __shared__ int top_ids[SMP_TOPN];
  __shared__ float top_val[SMP_TOPN];
  __shared__ int s_ntop;
  __shared__ u64 s_wd;  // SMP_VERIFY: the draft token's weight

  const int* jb = jobs + (size_t)blockIdx.x * J_WORDS;
  int* o = out + (size_t)blockIdx.x * O_WORDS;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const u32 lt = (1u << lane) - 1u;  // lanes below this one
  const float* raw = logits + (size_t)jb[J_ROW] * V;
  const float* x = raw;
  if (jb[J_WORK] >= 0) {  // penalties / logit_bias / a token mask: x = masked raw + deltas in scratch
    float* w = work + (size_t)jb[J_WORK] * V;
    const int mo = jb[J_MASK];
    if (mo < 0) {
      for (int i = tid; i < V; i += nt) w[i] = raw[i];
    } else {  // (a disallowed id stays -inf whatever delta it gets)
      const unsigned* mk = masks + mo;
      for (int i = tid; i < V; i += nt) w[i] = (mk[i >> 5] >> (i & 31)) & 1u ? raw[i] : __int_as_float(0xff800000);
    }
    __syncthreads();
    for (int p = jb[J_PEN0] + tid; p < jb[J_PEN1]; p += nt) w[pen_ids[p]] += pen_val[p];
    __syncthreads();  // (global writes of this block are visible to it after the barrier)
    x = w;
  }
  // this warp's ids [s0, s1), visited 32 at a time
  const int nw = nt >> 5, S = (V + 32 * nw - 1) / (32 * nw) * 32;
  const int s0 = min(V, warp * S), s1 = min(V, s0 + S);

  const int amax = block_argmax(x, V, red64);
  const float temp = __int_as_float(jb[J_TEMP]);
  int token = amax;

  const int mode = jb[J_MODE], draft = jb[J_DRAFT];
  float* q = (float*)(*(const unsigned long long*)(jb + J_Q));
  bool accept = false;

  if (temp > 0.f && order_key(__float_as_uint(x[amax])) != 0u) {  // (not a row of -inf / NaN only)
    const float m = x[amax], inv_t = 1.f / temp;
    const float top_p = __int_as_float(jb[J_TOPP]), min_p = __int_as_float(jb[J_MINP]);
    const int top_k = jb[J_TOPK];
    // top-k: every key >= the k-th largest
    u32 kth = 0u;
    if (top_k > 0 && top_k < V) {
      const RadixPick pk = radix_pick<true>(
          V, (u64)top_k, [&](int i) { return order_key(__float_as_uint(x[i])); },
          [](int, u32) { return 1ull; }, hist, pick);
      kth = pk.key;  // (all: a prefix of the k-th key; the same set)
    }
    auto key_k = [&](int i) {  // key if i survives top-k, else 0
      const u32 key = order_key(__float_as_uint(x[i]));
      return key >= kth ? key : 0u;
    };
    auto e_of = [&](float v) { return expf((v - m) * inv_t); };  // p_i / p_max, in (0, 1]
    auto mass = [&](float e) { return (u64)__float2ull_rn(e * RADIX_ONE); };
    u64 z = 0ull;
    for (int i = tid; i < V; i += nt) z += key_k(i) ? mass(e_of(x[i])) : 0ull;
    z = block_sum_u64(z, red64);
    // top-p: the crossing key t; keys above it are in, and the first `need` of its ties by id
    u32 pt = 0u;
    bool p_all = true;
    u64 need = 0ull;
    const u64 want = (u64)ceil((double)top_p * (double)z);
    if (top_p < 1.f && want < z) {
      const RadixPick pp = radix_pick<false>(
          V, want > 0ull ? want : 1ull, key_k, [&](int i, u32) { return mass(e_of(x[i])); }, hist, pick);
      pt = pp.key;
      p_all = pp.all;
      if (!p_all) {
        const u64 et = mass(e_of(key_value(pt)));  // > 0: the crossing bin has weight
        need = et ? (pp.rem + et - 1ull) / et : 1ull;
      }
    }
    const u32 tie_key = p_all ? 0xffffffffu : pt;  // (no key is all ones: no ties to rank)
    // ties of pt in the warps before this one (id order)
    u64 tie0 = 0ull, tot;
    if (!p_all) {
      u64 cnt = 0ull;
      for (int base = s0; base < s1; base += 32) {
        const int i = base + lane;
        cnt += __popc(__ballot_sync(0xffffffffu, i < s1 && key_k(i) == tie_key));
      }
      tie0 = warp_offsets(cnt, red64, &tot);
    }
    // mass of id i if allowed (rank: its rank among the ties of pt), else 0
    auto weight = [&](int i, u32 key, u64 rank) {
      if (key == 0u) return 0ull;  // (the argmax always has a key)
      bool ok = p_all ? key >= pt : (key > pt || (key == pt && rank < need));
      const float e = e_of(x[i]);
      ok = ok && (min_p <= 0.f || e >= min_p);
      return ok || i == amax ? mass(e) : 0ull;
    };
    // one group of 32 ids of this warp's segment: the lane's weight; ties advances
    auto group = [&](int base, u64& ties) {
      const int i = base + lane;
      const u32 key = i < s1 ? key_k(i) : 0u;
      const u32 bal = __ballot_sync(0xffffffffu, key == tie_key);
      const u64 w = weight(i, key, ties + __popc(bal & lt));
      ties += __popc(bal);
      return w;
    };
    // CDF over the allowed ids in id order of weights tf(i, weight): the warps' sums (each group's
    // sum and tie count kept in shared memory, in the radix histograms' space), their offsets, then
    // the warp whose segment holds floor(u * W) finds its group and scans only that (integer sums:
    // exact). tf: the weight itself, or a verify row's residual.
    const int G = S / 32;  // groups of 32 ids per warp
    const bool keep = G <= SMP_GROUPS;
    u64* gsum = hist + warp * SMP_GROUPS;
    u64* gtie = hist + (nw + warp) * SMP_GROUPS;
    u64 part = 0ull, before = 0ull, total = 0ull;
    auto sums = [&](auto tf) {  // part, before, total (and gsum / gtie) of tf's weights
      u64 ties = tie0;
      part = 0ull;
      for (int base = s0, g = 0; base < s1; base += 32, ++g) {
        const u64 t0 = ties;
        const u64 gs = warp_sum_u64(tf(base + lane, group(base, ties)));
        if (keep && lane == 0) {
          gsum[g] = gs;
          gtie[g] = t0;
        }
        part += gs;
      }
      before = warp_offsets(part, red64, &total);  // (syncs gsum / gtie too)
    };
    auto draw = [&](auto tf, double u) {  // the id whose CDF step holds u * total, into s_tok
      u = fmin(fmax(u, 0.0), 0.9999999);
      const u64 target = (u64)(u * (double)total);  // < total
      if (before <= target && target < before + part) {  // warp-uniform
        u64 acc = before, ties = tie0;
        int from = s0;  // the first group that may hold the target
        if (keep) {
          const int gw = (s1 - s0 + 31) / 32;  // this warp's groups (the last segments are shorter)
          for (int c = 0; c < gw; c += 32) {
            const u64 v = c + lane < gw ? gsum[c + lane] : 0ull, inc = warp_inclusive_scan(v);
            const u32 hit = __ballot_sync(0xffffffffu, acc + inc > target);
            if (hit) {
              const int l = __ffs(hit) - 1, g = c + l;
              acc += __shfl_sync(0xffffffffu, inc - v, l);
              from = s0 + 32 * g;
              ties = gtie[g];
              break;
            }
            acc += __shfl_sync(0xffffffffu, inc, 31);
          }
        }
        for (int base = from; base < s1; base += 32) {
          const u64 inc = warp_inclusive_scan(tf(base + lane, group(base, ties)));
          const u32 hit = __ballot_sync(0xffffffffu, acc + inc > target);
          if (hit) {
            if (lane == 0) s_tok = base + __ffs(hit) - 1;
            break;
          }
          acc += __shfl_sync(0xffffffffu, inc, 31);
        }
      }
      __syncthreads();
    };
    const bool test = mode == SMP_VERIFY && draft >= 0;
    auto plain = [&](int i, u64 w) {
      if (test && i == draft) s_wd = w;
      return w;
    };
    if (tid == 0) {
      s_tok = amax;  // (the argmax alone weighs 2^40: a total is never 0)
      s_wd = 0ull;
    }
    __syncthreads();
    sums(plain);
    const double u = *(const double*)(jb + J_U);
    if (!test) {
      draw(plain, u);
    } else {
      // keep d with probability min(1, p(d) / q(d)): u_a * q(d) < w(d) / W
      const double qd = q ? (double)q[draft] : 0.0, big_w = (double)total;
      accept = qd > 0.0 && *(const double*)(jb + J_UA) * qd * big_w < (double)s_wd;
      if (accept) {
        if (tid == 0) s_tok = draft;
        __syncthreads();
      } else {
        bool residual = qd > 0.0;
        if (residual) {  // norm(max(p - q, 0)), p = w / W
          auto minus_q = [&](int i, u64 w) {
            const double r = i < s1 ? (double)w / big_w - (double)q[i] : 0.0;
            return r > 0.0 ? (u64)(r * (double)RADIX_ONE + 0.5) : 0ull;
          };
          sums(minus_q);
          residual = total > 0ull;
          if (residual) draw(minus_q, u);
        }
        if (!residual) {  // p itself (the sums again: the residual's overwrote them)
          sums(plain);
          draw(plain, u);
        }
      }
    }
    token = s_tok;
    if (mode == SMP_KEEP && q) {  // the draw's distribution, for verify (no truncation: ranks unused)
      const double inv = 1.0 / (double)total;
      for (int i = tid; i < V; i += nt) q[i] = (float)((double)weight(i, key_k(i), 0ull) * inv);
    }
  } else if (mode == SMP_VERIFY && draft >= 0) {  // greedy: kept where the argmax is the draft
    accept = token == draft;
  }

  // ---- logprobs of the raw logits ----
  const int ntop = jb[J_NTOP];
  if (ntop >= 0) {
    const float mr = raw[x == raw ? amax : block_argmax(raw, V, red64)];
    float zr = 0.f;
    for (int i = tid; i < V; i += nt) zr += expf(raw[i] - mr);
    zr = block_sum(zr, red);
    const float lse = mr + logf(zr);
    if (ntop > 0) {
      const int n = min(ntop, min(SMP_TOPN, V));
      auto rkey = [&](int i) { return order_key(__float_as_uint(raw[i])); };
      const RadixPick pn = radix_pick<true>(V, (u64)n, rkey, [](int, u32) { return 1ull; }, hist, pick);
      if (tid == 0) s_ntop = 0;
      __syncthreads();
      // keys above the n-th (all: at or above its prefix), then its first ties by id
      for (int i = tid; i < V; i += nt) {
        const u32 k = rkey(i);
        if (k != 0u && (pn.all ? k >= pn.key : k > pn.key)) {
          const int s = atomicAdd(&s_ntop, 1);
          if (s < SMP_TOPN) {
            top_ids[s] = i;
            top_val[s] = raw[i];
          }
        }
      }
      if (!pn.all) {
        u64 cnt = 0ull, tot;
        for (int base = s0; base < s1; base += 32) {
          const int i = base + lane;
          cnt += __popc(__ballot_sync(0xffffffffu, i < s1 && rkey(i) == pn.key));
        }
        u64 r = warp_offsets(cnt, red64, &tot);  // (syncs s_ntop too)
        const int above = s_ntop, want = (int)pn.rem;
        for (int base = s0; base < s1 && r < (u64)want; base += 32) {
          const int i = base + lane;
          const bool eq = i < s1 && rkey(i) == pn.key;
          const u32 bal = __ballot_sync(0xffffffffu, eq);
          const u64 rank = r + __popc(bal & lt);
          if (eq && rank < (u64)want && above + (int)rank < SMP_TOPN) {
            top_ids[above + rank] = i;
            top_val[above + rank] = raw[i];
          }
          r += __popc(bal);
        }
        __syncthreads();
        if (tid == 0) s_ntop = min(SMP_TOPN, above + want);
      }
      __syncthreads();
      if (tid == 0) {  // at most 20: insertion sort by value descending, id ascending
        const int cnt = min(s_ntop, n);
        for (int a = 1; a < cnt; ++a) {
          const int id = top_ids[a];
          const float v = top_val[a];
          int b = a - 1;
          while (b >= 0 && (top_val[b] < v || (top_val[b] == v && top_ids[b] > id))) {
            top_ids[b + 1] = top_ids[b];
            top_val[b + 1] = top_val[b];
            --b;
          }
          top_ids[b + 1] = id;
          top_val[b + 1] = v;
        }
        for (int a = 0; a < SMP_TOPN; ++a) {
          o[O_IDS + a] = a < cnt ? top_ids[a] : -1;
          o[O_LPS + a] = __float_as_int(a < cnt ? top_val[a] - lse : 0.f);
        }
      }
    }
    if (tid == 0) o[O_LP] = __float_as_int(raw[token] - lse);
  }
  if (tid == 0) {
    o[O_TOKEN] = token;
    o[O_ACCEPT] = accept ? 1 : 0;
  }
}

// A draft block's greedy position (engine/model/dspark.py): x[r, :] += b[r, :] in place (b may be
// null), then out[r * os] = the index of x[r]'s largest value, the first on ties, NaN above every
// number and -0 equal to +0: numpy's argmax. Grid (S, R), block 256: block s reads its AA_SLICE
// columns of row r (every load of a thread in flight at once) and writes its best to part[r * S + s];
// the last of row r's blocks (counter cnt[r], which it resets) takes the best of the S. Many
// blocks a row, since one block's strided pass over a 129K vocabulary waits on memory.
#define AA_SLICE 2048
#define AA_THREADS 256
__device__ __forceinline__ u32 argmax_key(u32 u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;  // NaN
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

extern "C" __global__ void __launch_bounds__(AA_THREADS) add_argmax(float* __restrict__ x, long long xs,
                                                                    const float* __restrict__ b, long long bs,
                                                                    int V, u64* __restrict__ part,
                                                                    int* __restrict__ cnt, long long* __restrict__ out,
                                                                    long long os) {
  __shared__ u64 red[33];
  __shared__ int last;
  const int r = blockIdx.y, s = blockIdx.x, S = gridDim.x;
  float* xr = x + (size_t)r * xs;
  const float* br = b ? b + (size_t)r * bs : nullptr;
  float v[AA_SLICE / AA_THREADS];
#pragma unroll
  for (int j = 0; j < AA_SLICE / AA_THREADS; ++j) {
    const int i = s * AA_SLICE + j * AA_THREADS + threadIdx.x;
    v[j] = i < V ? xr[i] : 0.f;
    if (br && i < V) v[j] += __ldg(br + i);
  }
  u64 best = 0ull;  // (key << 32) | ~index
#pragma unroll
  for (int j = 0; j < AA_SLICE / AA_THREADS; ++j) {
    const int i = s * AA_SLICE + j * AA_THREADS + threadIdx.x;
    if (i < V) {
      if (br) xr[i] = v[j];
      const u64 t = ((u64)argmax_key(__float_as_uint(v[j])) << 32) | (u64)(0xffffffffu - (u32)i);
      best = t > best ? t : best;
    }
  }
  best = block_max_u64(best, red);
  if (threadIdx.x == 0) {
    part[(size_t)r * S + s] = best;
    __threadfence();
    last = atomicAdd(cnt + r, 1) == S - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  best = 0ull;
  for (int q = threadIdx.x; q < S; q += AA_THREADS) {
    const u64 t = __ldcg(part + (size_t)r * S + q);
    best = t > best ? t : best;
  }
  best = block_max_u64(best, red);
  if (threadIdx.x == 0) {
    out[(size_t)r * os] = (long long)(0xffffffffu - (u32)(best & 0xffffffffull));
    cnt[r] = 0;  // ready for the next launch (and graph replay)
  }
}
