// Attention-side kernels: MQA with K == V and per-head sinks, and the indexer scores.
#include "tc_fragments.cuh"

// Online-softmax attention of one query (8 heads per block, warp w = one head) over key rows
// [n_begin, n_end) of a K=V source. `row(n, &bias)` gives row n's pointer and its bias (0 or -inf).
// The K=V tile (ATT_TN rows) is staged once in shared memory for all 8 heads (one latent read
// serves every head); tiles with no visible row are skipped, so windowed / top-k masks cost only
// what is visible. qr: this lane's query elements (lane + 32 i); o, m, l: the running state.
// bf (--numerics deepseek, the reference's sparse_attn): K=V rounded to bf16 as staged, and each
// probability rounded to bf16 where it multiplies V (the denominator sums them unrounded).
// Dynamic shared memory: ATT_TN * D floats.
#define ATT_TN 16
#define ATT_DPL 16  // D / 32 at most
template <class Rows>
__device__ __forceinline__ void attend_rows(const float (&qr)[ATT_DPL], float (&o)[ATT_DPL], float& m, float& l,
                                            bool active, int n_begin, int n_end, int D, float scale, bool bf,
                                            Rows row) {
  extern __shared__ __align__(16) float kvs[];
  __shared__ float bs[ATT_TN];
  __shared__ const float* rp[ATT_TN];
  const int lane = threadIdx.x & 31, nd = D / 32, D4 = D >> 2;
  for (int n0 = n_begin; n0 < n_end; n0 += ATT_TN) {
    int vis = 0;
    if (threadIdx.x < ATT_TN) {
      float b = -DSUF_INF;
      const float* p = nullptr;
      if (n0 + (int)threadIdx.x < n_end) p = row(n0 + threadIdx.x, b);
      bs[threadIdx.x] = b;
      rp[threadIdx.x] = b > -DSUF_INF ? p : nullptr;
      vis = b > -DSUF_INF;
    }
    if (!__syncthreads_or(vis)) continue;
    {  // every load of the tile in flight before the first store (a loop with a runtime trip
       // count issued them one L2 round trip at a time); blockDim.x == 256, D <= 32 * ATT_DPL
      constexpr int PER = ATT_TN * ATT_DPL * 8 / 256;  // float4 per thread at the widest D
      float4 v[PER];
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int idx = threadIdx.x + j * 256, r = idx / D4, c = idx - r * D4;
        const float* p = idx < ATT_TN * D4 ? rp[r] : nullptr;
        v[j] = p != nullptr ? __ldg((const float4*)p + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (bf) v[j] = make_float4(round_bf16f(v[j].x), round_bf16f(v[j].y), round_bf16f(v[j].z), round_bf16f(v[j].w));
      }
#pragma unroll
      for (int j = 0; j < PER; ++j)
        if (threadIdx.x + j * 256 < ATT_TN * D4) ((float4*)kvs)[threadIdx.x + j * 256] = v[j];
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
          const float p = expf(sc[r] - mn), pv = bf ? round_bf16f(p) : p;
          l += p;
#pragma unroll
          for (int i = 0; i < ATT_DPL; ++i)
            if (i < nd) o[i] += pv * kvs[r * D + lane + 32 * i];
        }
        m = mn;
      }
    }
    __syncthreads();
  }
}

// bf (--numerics deepseek: sparse_attn takes q in bf16): q rounded as loaded, so the decode step
// launches no rounding pass of its own (idempotent where the caller rounded it already).
__device__ __forceinline__ void load_query(const float* __restrict__ qh, bool active, int nd, bool bf,
                                           float (&qr)[ATT_DPL], float (&o)[ATT_DPL]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < ATT_DPL; ++i) {
    const float v = (active && i < nd) ? qh[lane + 32 * i] : 0.f;
    qr[i] = bf ? round_bf16f(v) : v;
    o[i] = 0.f;
  }
}

// Final normalisation with the head's sink in the denominator: out = o / (l + e^(sink - m)), in
// bf16 with bf (--numerics deepseek).
__device__ __forceinline__ void write_with_sink(float* __restrict__ oh, const float (&o)[ATT_DPL], float m, float l,
                                                float sk, int nd, bool bf) {
  const int lane = threadIdx.x & 31;
  const float mm = fmaxf(m, sk);
  const float em = expf(m - mm);
  const float f = em / (l * em + expf(sk - mm));
#pragma unroll
  for (int i = 0; i < ATT_DPL; ++i)
    if (i < nd) oh[lane + 32 * i] = bf ? round_bf16f(o[i] * f) : o[i] * f;
}

// Decode attention of B sequences (one query each) in one launch, split over the keys.
// Sequence b reads two K=V sources from its table entry tab[6 b ..]: (rows0 ptr, n0, mask0 ptr,
// rows1 ptr, n1, mask1 ptr); a source's rows are [n, D] f32, its mask bool [n] (visible where
// true; a null pointer: all visible). Its keys are source 0's rows then source 1's, so no
// concatenated copy of window + compressed entries is ever made. With `masks` given, source 1's
// mask is row b of masks [B, masks_ld] where the table's mask1 field is non-zero (a decode step's
// published top-k, which the table built on the host cannot point at).
// With `rows1` given (mask_rows below), a masked source 1 is read through row b's list of its
// visible rows instead (cnt1[b] of them, rows1 + b * rows1_ld): tiles of 16 visible rows, where
// walking the mask visits every tile that holds one selected entry (at a long context nearly one
// tile per selected entry, and every tile's mask bytes).
// grid (ceil(H/8), B, nsplit), block 256; split z covers keys [z * chunk, (z + 1) * chunk).
// nsplit == 1 writes out [B, H, D] directly; otherwise each split writes its unnormalised
// partial o to part_o [B, H, nsplit, D] and (m, l) to part_ml [B, H, nsplit, 2] for
// attention_combine.
extern "C" __global__ void __launch_bounds__(256) attention_decode(
    const float* __restrict__ q, const long long* __restrict__ tab, const bool* __restrict__ masks, int masks_ld,
    const float* __restrict__ sinks, float* __restrict__ out, float* __restrict__ part_o,
    float* __restrict__ part_ml, int H, int D, int nsplit, int chunk, float scale, const int* __restrict__ rows1,
    const int* __restrict__ cnt1, int rows1_ld, int bf) {
  const int h = blockIdx.x * 8 + (threadIdx.x >> 5), b = blockIdx.y, z = blockIdx.z, nd = D / 32;
  const bool active = h < H;
  const long long* e = tab + 6 * b;
  const float* r0 = (const float*)e[0];
  const float* r1 = (const float*)e[3];
  const bool* m0 = (const bool*)e[2];
  const bool* m1 = masks == nullptr ? (const bool*)e[5] : e[5] ? masks + (size_t)b * masks_ld : nullptr;
  const int* l1 = rows1 != nullptr && m1 != nullptr ? rows1 + (size_t)b * rows1_ld : nullptr;
  const int n0 = (int)e[1], n1 = (int)e[4], total = n0 + (l1 != nullptr ? cnt1[b] : n1);
  float qr[ATT_DPL], o[ATT_DPL], m = -DSUF_INF, l = 0.f;
  load_query(q + ((size_t)b * H + (active ? h : 0)) * D, active, nd, bf != 0, qr, o);
  const int lo = z * chunk, hi = min(total, lo + chunk);
  attend_rows(qr, o, m, l, active, lo, hi, D, scale, bf != 0, [&](int n, float& bias) {
    const bool in0 = n < n0;
    if (!in0 && l1 != nullptr) {  // the i-th visible row of source 1 (a mask's true past its rows: none)
      const int j = l1[n - n0];
      bias = j < n1 ? 0.f : -DSUF_INF;
      return r1 + (size_t)(j < n1 ? j : 0) * D;
    }
    const int i = in0 ? n : n - n0;
    const bool* mk = in0 ? m0 : m1;
    bias = (mk == nullptr || mk[i]) ? 0.f : -DSUF_INF;
    return (in0 ? r0 : r1) + (size_t)i * D;
  });
  if (!active) return;
  const size_t bh = (size_t)b * H + h;
  if (nsplit == 1) {
    write_with_sink(out + bh * D, o, m, l, sinks[h], nd, bf != 0);
    return;
  }
  const int lane = threadIdx.x & 31;
  float* po = part_o + (bh * nsplit + z) * D;
#pragma unroll
  for (int i = 0; i < ATT_DPL; ++i)
    if (i < nd) po[lane + 32 * i] = o[i];
  if (lane == 0) {
    part_ml[(bh * nsplit + z) * 2] = m;
    part_ml[(bh * nsplit + z) * 2 + 1] = l;
  }
}

// A prompt chunk's attention on tensor cores in float32 numerics (--numerics exact; deepseek's is
// attn_sparse_bf below), in three passes over a block of queries: scores (attn_tc_scores), softmax
// with the sink (attn_tc_softmax), then P times V (attn_tc_pv). MQA: every head of a query reads the
// same keys, so a query's 64 heads are the M side of its MMAs. Query s's keys are j = 0 .. L-1
// (attn_key_row): its window, rows lo[s] .. hi[s] - 1 of `keys`, then its entries: through its list
// of selected rows (rows, cnt from mask_rows) or, without lists, every entry e its mask row allows.
// q and P go in as three bf16 terms (an f32's bits), K=V as TK: three, or one where the values lie
// on a state codec's grid. sc [S, H, L] holds the raw dots, then the probabilities (0 for keys not
// visible).
template <class T>
__device__ __forceinline__ const T* attn_key_row(int s, int j, const T* keys, const long long* lo, const long long* hi,
                                                 const T* entries, const int* rows, const int* cnt, int rows_ld,
                                                 const bool* emask, int n_e, int D) {
  const int nw = (int)(hi[s] - lo[s]);
  if (j < nw) return keys + (size_t)(lo[s] + j) * D;
  const int e = j - nw;
  if (rows != nullptr) return e < cnt[s] ? entries + (size_t)rows[(size_t)s * rows_ld + e] * D : nullptr;
  return emask != nullptr && e < n_e && emask[(size_t)s * n_e + e] ? entries + (size_t)e * D : nullptr;
}

#define ATC_LD 40  // bf16 per shared row of a 32-wide K step (16 B pad: conflict-free fragments)
#define ATTN_TC_ARGS                                                                                        \
  const float *__restrict__ q, const float *__restrict__ keys, const long long *__restrict__ lo,            \
      const long long *__restrict__ hi, const float *__restrict__ entries, const int *__restrict__ rows,  \
      const int *__restrict__ cnt, int rows_ld, const bool *__restrict__ emask, int n_e, float *__restrict__ sc, \
      int H, int D, int L
#define ATTN_TC_KEY(s, j) attn_key_row(s, j, keys, lo, hi, entries, rows, cnt, rows_ld, emask, n_e, D)

// 64 heads x 32 floats of row-major src (row stride ld floats) -> T bf16 terms in dst [T][64][ATC_LD]
template <int T>
__device__ __forceinline__ void atc_stage_rows(const float* src, size_t ld, u16* dst) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = threadIdx.x + 128 * i, r = idx >> 3, c4 = idx & 7;
    const float4 v = __ldg((const float4*)(src + r * ld + 4 * c4));
    float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int term = 0; term < T; ++term) *(uint2*)&dst[(term * 64 + r) * ATC_LD + 4 * c4] = bf16_term4(e);
  }
}

// grid (L / 64, S, H / 64), block 128 (4 warps in 2 x 2 over 64 heads x 64 keys); K steps of 32 of D.
template <int TQ, int TK>
__device__ __forceinline__ void attn_tc_scores_body(ATTN_TC_ARGS) {
  __shared__ __align__(16) u16 as[TQ * 64 * ATC_LD];
  __shared__ __align__(16) u16 bs[TK * 64 * ATC_LD];
  __shared__ const float* kp[64];
  const int s = blockIdx.y, j0 = blockIdx.x * 64, h0 = blockIdx.z * 64, tid = threadIdx.x, warp = tid >> 5;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  if (tid < 64) kp[tid] = ATTN_TC_KEY(s, j0 + tid);
  float acc[2][4][4] = {};
  for (int k0 = 0; k0 < D; k0 += 32) {
    __syncthreads();  // (kp written; the last step's tiles read)
    atc_stage_rows<TQ>(q + ((size_t)s * H + h0) * D + k0, D, as);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + 128 * i, r = idx >> 3, c4 = idx & 7;
      const float* p = kp[r];
      const float4 v = p != nullptr ? __ldg((const float4*)(p + k0 + 4 * c4)) : make_float4(0.f, 0.f, 0.f, 0.f);
      float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int term = 0; term < TK; ++term) *(uint2*)&bs[(term * 64 + r) * ATC_LD + 4 * c4] = bf16_term4(e);
    }
    __syncthreads();
    mma_warp_32x32<TQ, TK>(acc, as, 64 * ATC_LD, bs, 64 * ATC_LD, ATC_LD, 32, wm, wn);
  }
  mma_warp_32x32_each(acc, wm, wn, [&](int hh, int kk, float v) {
    sc[((size_t)s * H + h0 + hh) * L + j0 + kk] = kp[kk] != nullptr ? v : -DSUF_INF;
  });
}

// In place: row (s, h) of sc -> e^(x scale - M) / (sum + e^(sink - M)), M = max(x scale, sink); 0 where
// x = -inf. grid (ceil(S * H / 8)), block 256: a warp per row.
extern "C" __global__ void __launch_bounds__(256) attn_tc_softmax(float* __restrict__ sc,
                                                                  const float* __restrict__ sinks, int H, int L,
                                                                  long long nrows, float scale) {
  const long long r = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= nrows) return;
  float* x = sc + r * L;
  const float sk = sinks[r % H];
  float m = sk;
  for (int j = lane; j < L; j += 32) m = fmaxf(m, x[j] * scale);
  m = warp_max(m);
  float sum = 0.f;
  for (int j = lane; j < L; j += 32) sum += expf(x[j] * scale - m);
  sum = warp_sum(sum) + expf(sk - m);
  const float inv = 1.f / sum;
  for (int j = lane; j < L; j += 32) x[j] = expf(x[j] * scale - m) * inv;
}

// out[s, h, d] = sum_j P[s, h, j] V_j(s)[d]. grid
// (D / 64, S, H / 64), block 128 (2 x 2 warps over 64 heads x 64 dims); K steps of 32 keys. V's tile
// goes in transposed ([dim][key]): B's rows are C's columns.
template <int TP, int TV>
__device__ __forceinline__ void attn_tc_pv_body(ATTN_TC_ARGS, float* __restrict__ out) {
  __shared__ __align__(16) u16 as[TP * 64 * ATC_LD];
  __shared__ __align__(16) u16 bs[TV * 64 * ATC_LD];
  __shared__ const float* kp[32];
  const int s = blockIdx.y, d0 = blockIdx.x * 64, h0 = blockIdx.z * 64, tid = threadIdx.x, warp = tid >> 5;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  float acc[2][4][4] = {};
  for (int j0 = 0; j0 < L; j0 += 32) {
    __syncthreads();  // (the last step's tiles and kp read)
    if (tid < 32) kp[tid] = ATTN_TC_KEY(s, j0 + tid);
    atc_stage_rows<TP>(sc + ((size_t)s * H + h0) * L + j0, L, as);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // 32 keys x 64 dims = 512 float4
      const int idx = tid + 128 * i, r = idx >> 4, c4 = idx & 15;
      const float* p = kp[r];
      const float4 v = p != nullptr ? __ldg((const float4*)(p + d0 + 4 * c4)) : make_float4(0.f, 0.f, 0.f, 0.f);
      float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int term = 0; term < TV; ++term) {
        const uint2 w = bf16_term4(e);
        u16* col = bs + (term * 64 + 4 * c4) * ATC_LD + r;  // dims 4 c4 .. 4 c4 + 3, key r
        col[0] = (u16)(w.x & 0xFFFFu);
        col[ATC_LD] = (u16)(w.x >> 16);
        col[2 * ATC_LD] = (u16)(w.y & 0xFFFFu);
        col[3 * ATC_LD] = (u16)(w.y >> 16);
      }
    }
    __syncthreads();
    mma_warp_32x32<TP, TV>(acc, as, 64 * ATC_LD, bs, 64 * ATC_LD, ATC_LD, 32, wm, wn);
  }
  float* o = out + ((size_t)s * H + h0) * D + d0;
  mma_warp_32x32_each(acc, wm, wn, [&](int hh, int dd, float v) { o[(size_t)hh * D + dd] = v; });
}

// attn_tc_{scores,pv}<terms of q and P><terms of K=V>: f32 q and P over bf16-exact or f32 keys.
#define DEF_ATTN_TC(NAME, TQ, TK)                                                                          \
  extern "C" __global__ void __launch_bounds__(128) attn_tc_scores##NAME(ATTN_TC_ARGS) {                 \
    attn_tc_scores_body<TQ, TK>(q, keys, lo, hi, entries, rows, cnt, rows_ld, emask, n_e, sc, H, D, L);   \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(128) attn_tc_pv##NAME(ATTN_TC_ARGS, float* __restrict__ out) { \
    attn_tc_pv_body<TQ, TK>(q, keys, lo, hi, entries, rows, cnt, rows_ld, emask, n_e, sc, H, D, L, out);   \
  }
DEF_ATTN_TC(1, 3, 1)
DEF_ATTN_TC(3, 3, 3)

// Sparse attention under --numerics deepseek in one pass over each query's keys, for a prompt
// chunk (attn_sparse_bf<DP>) and for the rows of a decode or verify step (attn_table_bf<DP>): one
// block per (query, 64 heads), 8 warps. The query's keys stream through shared memory in tiles of
// 64 as bf16 rows (the next tile staged while this one is computed), and FlashAttention's online
// softmax runs over them as attend_rows does for a decode step: P = bf16(e^(s - running max)) into
// P V, the denominator summing the unrounded values, the output rescaled as the max grows and
// divided by the denominator (sink included) at the end, then rounded to bf16. Per tile, warp w
// computes the scores of heads 16 (w % 4) .. over keys 32 (w / 4) .. on m16n8k16 bf16 MMAs (q and
// keys by ldmatrix), the tile's row maxima are exchanged through shared memory, P goes to shared
// memory as bf16, and the same warp adds P V for its 16 heads and dims (DP / 2) (w / 4) .. (V by
// ldmatrix.trans from the same key tile: K = V). A tile with no key visible is skipped. q is
// rounded to bf16 as staged; D <= DP (columns past D read as zeros). grid (queries, H / 64), block
// 256, dynamic shared memory ASB_SMEM(DP). Where the keys come from is the Keys class's: count()
// keys, and stage(j, ...) puts key j's bf16 row in place, this thread's 16-byte chunks of it.
#define ASB_PLD 72  // bf16 per shared row of P (64 keys + 8: conflict-free ldmatrix)
#define ASB_SMEM(dp) (3 * 64 * ((dp) + 8) * 2 + 64 * ASB_PLD * 2 + 2 * 64 + 4 * 64 * 4)

// A prompt chunk's keys (attn_key_row: query s's window, then its listed or mask-allowed entries),
// bf16 rows [*, D], copied by cp.async (the next tile in flight while one is computed).
struct AsbPrompt {
  const u16* keys;
  const long long *lo, *hi;
  const u16* entries;
  const int *rows, *cnt;
  int rows_ld;
  const bool* emask;
  int n_e, D, s;
  __device__ __forceinline__ int count() const { return (int)(hi[s] - lo[s]) + (rows != nullptr ? cnt[s] : n_e); }
  template <int DP>
  __device__ __forceinline__ bool stage(int j, int L, u32 dst, int sub) const {
    const u16* p = j < L ? attn_key_row(s, j, keys, lo, hi, entries, rows, cnt, rows_ld, emask, n_e, D) : nullptr;
#pragma unroll
    for (int i = 0; i < DP / 32; ++i) {
      const int c = 8 * (sub + 4 * i);
      const bool in = p != nullptr && c < D;
      cp_async16(dst + 2 * c, in ? (const void*)(p + c) : (const void*)keys, in ? 16 : 0);
    }
    return p != nullptr;
  }
};

// A decode / verify row's keys from its attention_decode table entry (tab[6 b ..]: source 0's f32
// rows, count and mask, then source 1's; source 1 through the step's mask row b and its list of
// visible rows where given, as attention_decode reads them). f32 rows rounded to bf16 as staged,
// by plain loads: the tile is staged before the one in shared memory is computed.
struct AsbTable {
  const float *r0, *r1;
  const bool *m0, *m1;
  const int* l1;
  int n0, n1, D, total;
  __device__ __forceinline__ AsbTable(const long long* tab, const bool* masks, int masks_ld, const int* rows1,
                                      const int* cnt1, int rows1_ld, int D_, int b) {
    const long long* e = tab + 6 * b;
    r0 = (const float*)e[0];
    r1 = (const float*)e[3];
    m0 = (const bool*)e[2];
    m1 = masks == nullptr ? (const bool*)e[5] : e[5] ? masks + (size_t)b * masks_ld : nullptr;
    l1 = rows1 != nullptr && m1 != nullptr ? rows1 + (size_t)b * rows1_ld : nullptr;
    n0 = (int)e[1];
    n1 = (int)e[4];
    D = D_;
    total = n0 + (l1 != nullptr ? cnt1[b] : n1);
  }
  __device__ __forceinline__ int count() const { return total; }
  template <int DP>
  __device__ __forceinline__ bool stage(int j, int L, u32 dst, int sub) const {
    const float* p = nullptr;
    if (j < L) {
      if (j >= n0 && l1 != nullptr) {  // the (j - n0)-th visible row of source 1 (past its rows: none)
        const int i = l1[j - n0];
        p = i < n1 ? r1 + (size_t)i * D : nullptr;
      } else {
        const int i = j < n0 ? j : j - n0;
        const bool* mk = j < n0 ? m0 : m1;
        p = mk == nullptr || mk[i] ? (j < n0 ? r0 : r1) + (size_t)i * D : nullptr;
      }
    }
    float4 v[DP / 16];  // every load in flight before the first store
#pragma unroll
    for (int i = 0; i < DP / 32; ++i) {
      const int c = 8 * (sub + 4 * i);
      const bool in = p != nullptr && c < D;
      v[2 * i] = in ? __ldg((const float4*)(p + c)) : make_float4(0.f, 0.f, 0.f, 0.f);
      v[2 * i + 1] = in ? __ldg((const float4*)(p + c) + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < DP / 32; ++i) {
      const int c = 8 * (sub + 4 * i);
      const float4 a = v[2 * i], b = v[2 * i + 1];
      st_shared_v4(dst + 2 * c, pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                   pack_bf16x2(b.z, b.w));
    }
    return p != nullptr;
  }
};

template <int DP, class Keys>
__device__ __forceinline__ void attn_bf_body(const Keys& ks, const float* __restrict__ q,
                                             const float* __restrict__ sinks, float* __restrict__ out, int H, int D,
                                             float scale) {
  constexpr int LD = DP + 8, NJ = DP / 32;  // NJ: ldmatrix.trans loads (two n8 tiles each) per k16 of P V
  extern __shared__ __align__(16) u16 asb[];
  u16* Qs = asb;                                 // [64][LD] the heads' q
  u16* Ks = Qs + 64 * LD;                        // [2][64][LD] key tiles
  u16* Ps = Ks + 2 * 64 * LD;                    // [64][ASB_PLD] the tile's P
  bool* kval = (bool*)(Ps + 64 * ASB_PLD);       // [2][64] whether key j of a tile is one
  float* tmx = (float*)(kval + 2 * 64);          // [2][64] the tile's row maxima of each key half
  float* lsum = tmx + 2 * 64;                    // [2][64] the denominators' halves
  const int s = blockIdx.x, h0 = blockIdx.y * 64, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, hg = 16 * (warp & 3), kh = warp >> 2;
  const int L = ks.count();
  const int T = (L + 63) / 64;
  // tile it -> buffer it & 1: thread tid stages key row tid / 4's 16-byte chunks tid % 4 + 4 i;
  // returns whether that row is a key
  auto load_tile = [&](int it) {
    const int r = tid >> 2, b = it & 1;
    const bool ok = ks.template stage<DP>(64 * it + r, L, smem_addr(Ks + (64 * b + r) * LD), tid & 3);
    if ((tid & 3) == 0) kval[64 * b + r] = ok;
    cp_async_commit();
    return ok;
  };
  // whether the row this thread staged of the next tile is a key: the tile's "any key" vote at the
  // next barrier. (Not read back from kval: after a skipped tile no barrier separates another
  // thread's flag store from that read, and a stale flag skipped a tile of keys.)
  bool staged = T > 0 && load_tile(0);
  for (int idx = tid; idx < 64 * (DP / 8); idx += 256) {  // q rounded to bf16 (act()), zeros past D
    const int r = idx / (DP / 8), c = 8 * (idx % (DP / 8));
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (c < D) {
      const float4* p = (const float4*)(q + ((size_t)s * H + h0 + r) * D + c);
      const float4 a = __ldg(p), b = __ldg(p + 1);
      v = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
    }
    *(uint4*)&Qs[r * LD + c] = v;
  }
  // ldmatrix lane addresses: A (q, P) rows hg + (lane & 15), column 8 (lane >> 4); B (keys) rows
  // 32 kh + (lane & 7) + 8 (lane >> 4), column 8 ((lane >> 3) & 1); V^T rows (keys) (lane & 7) + 8
  // ((lane >> 3) & 1), column (DP / 2) kh + 8 (lane >> 4)
  const u32 qa = smem_addr(Qs) + 2 * ((hg + (lane & 15)) * LD + 8 * (lane >> 4));
  const u32 pa = smem_addr(Ps) + 2 * ((hg + (lane & 15)) * ASB_PLD + 8 * (lane >> 4));
  const u32 kb_lane = 2 * ((32 * kh + (lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1));
  const u32 vb_lane = 2 * (((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + (DP / 2) * kh + 8 * (lane >> 4));
  float o[2 * NJ][4];  // P V: head hg + g (+ 8 for [2], [3]), dim (DP / 2) kh + 8 j + 2 t (+ 1)
#pragma unroll
  for (int j = 0; j < 2 * NJ; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;  // rows g, g + 8: running max (the reference's
                                                       // floor -1e30), this warp's keys' denominator
  for (int it = 0; it < T; ++it) {
    cp_async_wait<0>();
    // tile it landed for every thread (and q is staged); every warp is past tile it - 1's P V, so
    // its buffer and Ps may be refilled. A tile of no visible key changes nothing: skipped.
    const bool any = __syncthreads_or(staged ? 1 : 0);
    staged = it + 1 < T && load_tile(it + 1);
    if (!any) continue;
    const u32 kb = smem_addr(Ks + (it & 1) * 64 * LD);
    float sc[4][4] = {};  // scores: head hg + g (+ 8), key 32 kh + 8 j + 2 t (+ 1)
#pragma unroll 4
    for (int ks = 0; ks < DP; ks += 16) {
      u32 a[4], b[4][2], r[4];
      ldsm_x4(qa + 2 * ks, a);
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        ldsm_x4(kb + kb_lane + 2 * (16 * jj * LD + ks), r);
        b[2 * jj][0] = r[0]; b[2 * jj][1] = r[1]; b[2 * jj + 1][0] = r[2]; b[2 * jj + 1][1] = r[3];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_bf16(sc[j], a, b[j]);
    }
    float x0 = -DSUF_INF, x1 = -DSUF_INF;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool ok = kval[64 * (it & 1) + 32 * kh + 8 * j + 2 * t + (e & 1)];
        sc[j][e] = ok ? sc[j][e] * scale : -DSUF_INF;
        if (e < 2) x0 = fmaxf(x0, sc[j][e]);
        else x1 = fmaxf(x1, sc[j][e]);
      }
#pragma unroll
    for (int sh = 1; sh < 4; sh <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, sh));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, sh));
    }
    if (t == 0) tmx[64 * kh + hg + g] = x0, tmx[64 * kh + hg + g + 8] = x1;
    __syncthreads();
    const float n0 = fmaxf(m0, fmaxf(tmx[hg + g], tmx[64 + hg + g]));
    const float n1 = fmaxf(m1, fmaxf(tmx[hg + g + 8], tmx[64 + hg + g + 8]));
    const float c0 = expf(m0 - n0), c1 = expf(m1 - n1);
    m0 = n0, m1 = n1, l0 *= c0, l1 *= c1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = expf(sc[j][0] - n0), p1 = expf(sc[j][1] - n0);
      const float p2 = expf(sc[j][2] - n1), p3 = expf(sc[j][3] - n1);
      l0 += p0 + p1, l1 += p2 + p3;
      const int col = 32 * kh + 8 * j + 2 * t;
      *(u32*)&Ps[(hg + g) * ASB_PLD + col] = pack_bf16x2(p0, p1);
      *(u32*)&Ps[(hg + g + 8) * ASB_PLD + col] = pack_bf16x2(p2, p3);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 2 * NJ; ++j) o[j][0] *= c0, o[j][1] *= c0, o[j][2] *= c1, o[j][3] *= c1;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      u32 a[4], r[4];
      ldsm_x4(pa + 2 * 16 * kk, a);
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        ldsm_x4_trans(kb + vb_lane + 2 * (16 * kk * LD + 16 * j), r);
        const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_bf16(o[2 * j], a, b0);
        mma_bf16(o[2 * j + 1], a, b1);
      }
    }
  }
#pragma unroll
  for (int sh = 1; sh < 4; sh <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, sh);
    l1 += __shfl_xor_sync(0xffffffffu, l1, sh);
  }
  if (t == 0) lsum[64 * kh + hg + g] = l0, lsum[64 * kh + hg + g + 8] = l1;
  __syncthreads();
  const int ha = hg + g, hb = ha + 8;
  const float d0 = lsum[ha] + lsum[64 + ha] + expf(sinks[h0 + ha] - m0);
  const float d1 = lsum[hb] + lsum[64 + hb] + expf(sinks[h0 + hb] - m1);
  float* oa = out + ((size_t)s * H + h0 + ha) * D;
  float* ob = out + ((size_t)s * H + h0 + hb) * D;
#pragma unroll
  for (int j = 0; j < 2 * NJ; ++j) {
    const int c = (DP / 2) * kh + 8 * j + 2 * t;
    if (c < D) {
      *(float2*)(oa + c) = make_float2(round_bf16f(o[j][0] / d0), round_bf16f(o[j][1] / d0));
      *(float2*)(ob + c) = make_float2(round_bf16f(o[j][2] / d1), round_bf16f(o[j][3] / d1));
    }
  }
}

#define ASB_ARGS                                                                                              \
  const float *q, const u16 *keys, const long long *lo, const long long *hi, const u16 *entries, const int *rows, \
      const int *cnt, int rows_ld, const bool *emask, int n_e, const float *sinks, float *out, int H, int D,     \
      float scale
// attn_table_bf: B rows' queries q [B, H, D] over their attention_decode table (tab, masks, rows1 /
// cnt1 as attention_decode takes them), out [B, H, D] in bf16; grid (B, H / 64).
#define ATB_ARGS                                                                                               \
  const float *q, const long long *tab, const bool *masks, int masks_ld, const int *rows1, const int *cnt1,       \
      int rows1_ld, const float *sinks, float *out, int H, int D, float scale
#define DEF_ASB(DP)                                                                                            \
  extern "C" __global__ void __launch_bounds__(256, 1) attn_sparse_bf##DP(ASB_ARGS) {                          \
    const AsbPrompt ks{keys, lo, hi, entries, rows, cnt, rows_ld, emask, n_e, D, (int)blockIdx.x};             \
    attn_bf_body<DP>(ks, q, sinks, out, H, D, scale);                                                          \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256, 1) attn_table_bf##DP(ATB_ARGS) {                           \
    const AsbTable ks(tab, masks, masks_ld, rows1, cnt1, rows1_ld, D, (int)blockIdx.x);                        \
    attn_bf_body<DP>(ks, q, sinks, out, H, D, scale);                                                          \
  }
DEF_ASB(64)
DEF_ASB(128)
DEF_ASB(256)
DEF_ASB(512)

// The positions of each row's true values in ascending order: masks [B, N] bool -> rows [B, K]
// (the first K of them), cnt[B]. grid (B), block 256: thread t counts its contiguous slice of the
// row, an exclusive scan over the threads gives its offset, then it writes its positions.
extern "C" __global__ void __launch_bounds__(256) mask_rows(const bool* __restrict__ masks, int N, int* __restrict__ rows,
                                                          int* __restrict__ cnt, int K) {
  __shared__ int warp_tot[8];
  const bool* m = masks + (size_t)blockIdx.x * N;
  const int per = (N + 255) / 256, c0 = threadIdx.x * per, c1 = min(N, c0 + per);
  int n = 0;
  for (int c = c0; c < c1; ++c) n += m[c];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int incl = warp_inclusive_scan(n);  // within the warp, then the warps' totals
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  int off = incl - n;
  for (int w = 0; w < warp; ++w) off += warp_tot[w];
  int* r = rows + (size_t)blockIdx.x * K;
  for (int c = c0; c < c1 && off < K; ++c)
    if (m[c]) r[off++] = c;
  if (threadIdx.x == 255) {
    int total = 0;
    for (int w = 0; w < 8; ++w) total += warp_tot[w];
    cnt[blockIdx.x] = min(total, K);
  }
}

// out[b, h] = sum_z e^(m_z - M) o_z / (sum_z e^(m_z - M) l_z + e^(sink - M)), M = max(m_z, sink):
// the splits of attention_decode merged in a fixed order. grid (ceil(B * H / 8)), block 256: a
// warp per (b, h).
extern "C" __global__ void __launch_bounds__(256) attention_combine(const float* __restrict__ part_o,
                                                                   const float* __restrict__ part_ml,
                                                                   const float* __restrict__ sinks,
                                                                   float* __restrict__ out, int BH, int H, int D,
                                                                   int nsplit, int bf) {
  const int bh = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31, nd = D / 32;
  if (bh >= BH) return;
  const float* ml = part_ml + (size_t)bh * nsplit * 2;
  const float sk = sinks[bh % H];
  float mx = sk;
  for (int z = 0; z < nsplit; ++z) mx = fmaxf(mx, ml[2 * z]);
  float o[ATT_DPL], den = expf(sk - mx);
#pragma unroll
  for (int i = 0; i < ATT_DPL; ++i) o[i] = 0.f;
  for (int z = 0; z < nsplit; ++z) {
    const float f = expf(ml[2 * z] - mx);  // 0 for a split with nothing visible (m = -inf)
    den += f * ml[2 * z + 1];
    const float* po = part_o + ((size_t)bh * nsplit + z) * D;
#pragma unroll
    for (int i = 0; i < ATT_DPL; ++i)
      if (i < nd) o[i] += f * po[lane + 32 * i];
  }
  const float inv = 1.f / den;
#pragma unroll
  for (int i = 0; i < ATT_DPL; ++i)
    if (i < nd) out[(size_t)bh * D + lane + 32 * i] = bf ? round_bf16f(o[i] * inv) : o[i] * inv;
}
