#!/usr/bin/env python3
"""Can one persistent launch stream a decode step's chain of dependent GEMVs at HBM speed? (a
developer's tool for designing the persistent decode kernel; not the runtime).

    python tools/stream_chain.py [--layers 2] [--ahead 0,4,8,16,24] [--per-sm 1,2,4] [--unroll 4]
                                 [--rows 16] [--mode 0-5] [--units 2] [--fine] [--fence-all] [--check]

A b1 decode step is a chain of GEMVs, each reading the previous one's output, with small ops
between them. As one launch per GEMV in a CUDA graph (today's step) each pays a launch ramp and
tail, and HBM idles while the small ops run: the b1 graph is at ~35% of its HBM floor (README). The
persistent design instead runs every GEMV's row tiles in one launch: block b takes items b, b + G,
b + 2G, ... (G blocks, all resident), an item waits until its input's task has finished all its
tiles (a counter per task, bumped after each tile), and before waiting it prefetches its own next
items' weights into L2 (cp.async.bulk.prefetch.L2; they need no input) until --ahead MB (over the
whole GPU) are ahead of the items running. So weights stream from HBM while the chain waits on its
dependencies.

The chain here is one V4.1-Flash layer's GEMV bytes per layer: wq_a -> wq_b -> wo_a (dense here)
-> wo_b -> shared w1 -> shared w2, and wo_b -> experts w1 -> experts w2 (the routed experts' FP4
bytes as rows of the same size), each x the first K values of its input task's output. Both ways
run the same kernel, its consumer chosen by --mode:
  0  FP8, CUDA-core FMAs after a cvt per two weights; a warp's two rows, --unroll 16-byte loads
     per row in flight per lane;
  1  the same bytes as int8 times x rounded to int8, one dp4a per four (timing only): a consumer
     far cheaper than the streaming;
  2  FP8 on tensor cores, gemvr's arithmetic: weights cvt to f16, x as hi + lo f16 terms;
  3  FP8 bytes fed unconverted to mma.m16n8k32.e4m3, x as four scaled e4m3 terms in the B
     columns: does an FP8 GEMV stream faster with no conversion, and how close to float32 are
     its sums?
  4  FP4 (e2m1, UE8M0 per row and 32 k: the routed experts' format) turned into e4m3 bytes by bit
     placement (~1.1 integer ops a weight), then the e4m3 MMA;
  5  FP4 with gemvr's arithmetic (fp4_pairs, ~2.5 ops a weight; f16 MMA): is the FP4 GEMV bound
     by its decoding?
Modes 2-5 take 16-row items whose block of 8 warps splits K (see the kernel), each warp keeping
--units 128-k units (and their weight scales) in flight in a register ring. With --fine an item does
not wait for its whole input: each warp waits for the 128-row groups of the input task that its own
units read (a counter per group) and stages them itself, just before multiplying each, so a GEMV
starts on the first parts of its input while the rest is produced (no block-wide wait or barrier).
In every mode the first weights are loaded before an item waits for its input. FP8 weights carry a
float scale per 128 x 128 block (V4.1's; 32 x 32 at the stop-26 runs).
  graph        one launch per GEMV, captured in a CUDA graph (the dependency: stream order);
  persistent   one launch for the chain, --per-sm resident blocks per SM, --ahead MB prefetched.
Printed: time per chain, its bytes / the copy rate (the floor), and the floor's share of the time;
for each --per-sm, the same launch with no waits (its streaming rate with no dependencies).
--check compares every task's output with numpy (both ways; that --mode, 0 for 1) on a small chain
first.

Measured on the H200 (stop 26, with every thread fencing before an item's counter bump, now
--fence-all; 2 layers, 16 GEMVs, 533 MB, floor ~129 us at ~4.15 TB/s):
  --mode 0 (FP8 on CUDA cores): graph 311-338 us (38-42%); persistent at best 299 us (4 blocks per
    SM, 43.5%); no waits 256 us (51%): the CUDA-core loop itself caps near half the copy rate.
  --mode 1 (dp4a): graph 240 us (53%); persistent 220-225 us at 4-6 blocks per SM (56-58%); no
    waits 185-205 us (61-71%, --rows 16/32/64 alike).
  A dependency costs a persistent chain ~2.5 us (the waits' share over 15 of them), a graph ~3.5 us
    (a launch boundary); an L2 prefetch window (4-24 MB) is slower in every configuration (+35-60
    us); one resident block per SM is far slower (8 warps cannot keep enough loads in flight).
So in that form one launch removed only ~1 us of each GEMV boundary, and even a near-free consumer
with no dependencies streamed at ~70% of the copy rate in 16-64-row items.

Stop 27 (one thread publishes each item; 128 x 128 FP8 scales; `--per-sm 2,3,4 --ahead 0 --check`;
FP8 chains 531 MB, floor ~125 us; FP4 chains the same 10784 items in 282 MB, floor ~66.6 us):
  --mode 2 (gemvr's FP8): graph 270 us (46%); persistent 312 / 264 / 252 us at 2 / 3 / 4 blocks per
    SM (best 49.7%); no waits 255 / 220 / 197 us (best 63.6%). Check 2.2e-06.
  --mode 3 (e4m3 MMA): graph 273 us (46%); persistent 301 / 259 / 246 us (best 50.9%); no waits
    248 / 215 / 195 us (best 64.4%). Check 1.5e-06: four e4m3 terms of x on the FP8 MMA sum as
    accurately as gemvr's hi + lo f16, so precision does not bar that path; it is not faster.
  --mode 4 (FP4 -> e4m3, 66 registers, 3 blocks per SM): graph 313 us (21%); persistent 302 / 286
    us; no waits 254 / 235 us (28%). Check 1.3e-06.
  --mode 5 (gemvr's FP4): graph 240 us (28%); persistent 270 / 236 / 232 us; no waits 222 / 196 /
    183 us (36%). Check 3.3e-07.
So the consumer's arithmetic is not what bounds these loops (modes 2 and 3 alike; 4, with fewer ops
a weight, slower than 5). A chain of FP4 items takes as long as one of FP8 items with twice the
bytes: each warp walks its 128-k units one after another with one unit loaded ahead, 64 bytes a
row for FP8 but 32 for FP4, so the count of dependent unit loads per item (K / 1024 per warp), not
bytes or arithmetic, sets the pace. A streaming GEMV has to keep more of its units in flight per
warp than these do, whatever it computes with (gemvr keeps 2 FP8 / 8 FP4 units per lane). Those
runs also read each unit's weight scales at its use (one more memory latency per unit); since then
the scales travel with the weights, and --units sets the ring's depth (2: the stop-27 form;
registers 48-66 up to 2 units, 74-99 at 3, 106-128 at 4: the tool prints the blocks per SM they
allow).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import kernels  # noqa: E402  (our headers, inlined into SOURCE)

ROWS = 16  # rows per item by default (--rows): 2 per warp of a 256-thread block
SB = 128  # weight scales per SB x SB block (V4.1's FP8)
MAX_K = 8192  # x staged in shared memory (32 KB)

SOURCE = kernels.expand_includes(r"""
#include "dsuf_common.cuh"
#include "tc_fragments.cuh"
#ifndef ROWS
#define ROWS 16
#endif
#define MAX_K 8192
#define SB 128  // weight scale block: SB x SB (V4.1 FP8)
#ifndef UNITS
#define UNITS 2  // (modes 2-5) 128-k units in flight per warp
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef MODE
#define MODE 0
#endif
#ifndef FENCE_ALL
#define FENCE_ALL 0
#endif
#ifndef FINE
#define FINE 0  // (modes 2-5) wait per 128-row group of the input, by each warp (--fine)
#endif
#if FINE && MODE < 2
#error "--fine takes the tensor-core modes (16-row items)"
#endif

__device__ __forceinline__ float2 e4m3x2(u32 v) {  // two e4m3 bytes -> their values, exact
  const u32 h = e4m3x2_to_f16x2(v);
  return make_float2(h2f(h), h2f(h >> 16));
}
__device__ __forceinline__ void red_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Tasks (structure of arrays, T of them): weight W [n, k] e4m3 bytes, scales S [ceil(n / SB),
// ceil(k / SB)] float, input x (k floats: the first k outputs of task dep, or the chain's input), output y [n];
// first[t]: its first item (ROWS rows each); first[T] the item count. done[t]: its finished items.
// Items i0 .. i1 of the list run in this launch (the graph way: one task per launch).
struct Chain {
  const u64* w; const u64* s; const u64* x; const u64* y;
  const int* n; const int* k; const int* dep; const int* first; int T;
};

__device__ __forceinline__ int task_of(const Chain& c, int item) {
  int t = 0;
  while (t + 1 < c.T && c.first[t + 1] <= item) ++t;
  return t;
}

// bytes of a weight row of K values: FP8 (modes 0-3), FP4 (modes 4, 5)
#define WBYTES(kk) (MODE >= 4 ? (kk) / 2 : (kk))

// an item's weight bytes, prefetched into L2 when pf is set
__device__ __forceinline__ u32 item_bytes(const Chain& c, int item, bool pf) {
  const int t = task_of(c, item);
  const int rb = WBYTES(c.k[t]), r0 = (item - c.first[t]) * ROWS;
  const u32 bytes = (u32)(min(ROWS, c.n[t] - r0) * rb);  // (k % 32 == 0)
  if (pf) prefetch_l2((const u8*)c.w[t] + (size_t)r0 * rb, bytes);
  return bytes;
}

// One warp's ROWS / 8 rows of an item, in passes of U 16-byte loads per row per lane. The first
// pass is loaded (load_pass) before the item waits for its input: weights need none.
#define R (ROWS / 8)
struct Rows {
  const uint4* w[R];
  int nch;
};
__device__ __forceinline__ void load_pass(uint4 (&v)[R][UNROLL], const Rows& rw, int c0) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int ch = c0 + 32 * u;
      v[r][u] = ch < rw.nch ? __ldcs(rw.w[r] + ch) : make_uint4(0, 0, 0, 0);  // (read once: evict first)
    }
}

// MODE 0: FP8 e4m3 weights (a float scale per 32 x 32) times float x: cvt + FMAs on CUDA cores.
// MODE 1 (timing only, no check): the same bytes as int8 times x rounded to int8, one dp4a per 4
// weights: a consumer far cheaper than the streaming, so the chain's structure alone sets the pace.
__device__ __forceinline__ void use_pass(const uint4 (&v)[R][UNROLL], float (&acc)[R], const float* xs, const float* S,
                                         int row0, int gk, int c0, int nch) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int ch = c0 + 32 * u;
    if (ch >= nch) break;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const u32 ws[4] = {v[r][u].x, v[r][u].y, v[r][u].z, v[r][u].w};
      const float sc = __ldg(S + (size_t)((row0 + r) / SB) * gk + (16 * ch) / SB);
#if MODE == 0
      const float* xv = xs + 16 * ch;
      float part = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 a = e4m3x2(ws[q]), b = e4m3x2(ws[q] >> 16);
        part = fmaf(a.x, xv[4 * q], part);
        part = fmaf(a.y, xv[4 * q + 1], part);
        part = fmaf(b.x, xv[4 * q + 2], part);
        part = fmaf(b.y, xv[4 * q + 3], part);
      }
      acc[r] = fmaf(part, sc, acc[r]);
#else
      const int* xq = (const int*)xs + 4 * ch;
      int part = 0;
#pragma unroll
      for (int q = 0; q < 4; ++q) part = __dp4a((int)ws[q], xq[q], part);
      acc[r] = fmaf((float)part, sc, acc[r]);
#endif
    }
  }
}

// x (k floats) -> shared memory, as floats (MODE 0) or as int8 values packed 4 per word (MODE 1)
__device__ __forceinline__ void stage_x(float* xs, const float* xin, int kk, int tid) {
#if MODE == 0
  for (int e = tid; e < kk; e += 256) xs[e] = __ldcg(xin + e);  // (L2: another block wrote it)
#else
  for (int e = tid; e < kk / 4; e += 256) {
    const float4 f = __ldcg((const float4*)xin + e);
    const float q[4] = {f.x, f.y, f.z, f.w};
    u32 p = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) p |= ((u32)(int)fminf(fmaxf(rintf(q[i]), -127.f), 127.f) & 0xFFu) << (8 * i);
    ((u32*)xs)[e] = p;
  }
#endif
}

#if MODE >= 2
// ---- tensor-core consumers: an item is one 16-row tile; its block's 8 warps split K in 128-k units
// (warp w: units w, w + 8, ...) and reduce through shared memory in a fixed order. Lane (g, t)
// (g = lane / 4, t = lane % 4) loads 32 bytes of rows g and g + 8 at k = 128u + 32t (64 bytes a
// unit, as gemvr does); the MMA fragments take them in that physical order and x follows it.
//  MODE 2 (gemvr's arithmetic): mma.m16n8k16 f16; weights by cvt.e4m3x2 -> f16x2; x as two f16
//    terms (hi, lo: B columns 0 and 1) of each 128-group scaled by 2^sh (max in [2^13, 2^14)).
//  MODE 3: mma.m16n8k32 e4m3 x e4m3 -> f32: the weights' bytes go in as they are (no conversion);
//    x as NT3 e4m3 terms in B columns 0 .. NT3 - 1, term j of (x 2^sh)'s residual after the terms
//    before it, times 16^j (max of x 2^sh in (224, 448]).
//  MODE 4 (FP4 e2m1 weights, a UE8M0 scale per row and 32 k): each nibble becomes an e4m3 byte by
//    bit placement (value x 2^-6, exact; ~1.1 integer ops a weight), then mma.m16n8k32.e4m3 against
//    x's four e4m3 terms, two MMAs of term pairs, each B column holding one lane's 32-k segment so
//    that every lane applies its own rows' scales (gemvr's way); x staged evens-then-odds per 8 k.
//  MODE 5 (FP4, gemvr's arithmetic): fp4_pairs -> f16x2 (value x 2^-14; ~2.5 ops a weight),
//    mma.m16n8k16 f16 against hi / lo f16 terms per lane segment; x staged in pairs (k, k + 4).
#ifndef NT3
#define NT3 4
#endif
#define XT_BYTES (MAX_K * 4)  // shared memory for x's terms: 2 f16 (MODE 2) or NT3 <= 4 bytes (MODE 3)


// where element k of x lies in the staged terms (the MMA fragments' k order within each 8 k)
__device__ __forceinline__ int xslot(int k) {
#if MODE == 4
  const int j = k & 7;
  return (k & ~7) | ((j & 1) ? 4 + (j >> 1) : (j >> 1));  // evens, then odds
#elif MODE == 5
  const int j = k & 7;
  return (k & ~7) | ((j & 3) * 2 + (j >> 2));  // (0, 4), (1, 5), (2, 6), (3, 7)
#else
  return k;
#endif
}


// x's 128-group gi (of kk floats) -> its terms in shared memory (xt) and its shift (xsh[gi]), by one
// warp, a lane 4 elements
__device__ __forceinline__ void stage_group(u8* xt, int* xsh, const float* xin, int kk, int gi, int lane) {
  {
    const int k0 = gi * 128 + 4 * lane;
    const float4 v = k0 < kk ? __ldcg((const float4*)(xin + k0)) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float m = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    int sh = 0;
    if (m > 0.f && m <= 3.0e38f) {
      int e;
      frexpf(m, &e);  // m = f 2^e, f in [0.5, 1)
      sh = (MODE == 2 || MODE == 5 ? 14 : 8) - e;  // m 2^sh in [2^13, 2^14) (f16), [128, 256) (e4m3: max 448)
      sh = sh < -100 ? -100 : (sh > 100 ? 100 : sh);
    }
    const float x[4] = {v.x * pow2f(sh), v.y * pow2f(sh), v.z * pow2f(sh), v.w * pow2f(sh)};
    if (lane == 0) xsh[gi] = sh;  // (lanes past kk write zero terms: the unit's MMAs read them)
#if MODE == 2 || MODE == 5
    u16* hi = (u16*)xt;
    u16* lo = hi + MAX_K;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 h = f2h_rn(x[i]);
      hi[xslot(k0 + i)] = (u16)h;
      lo[xslot(k0 + i)] = (u16)f2h_rn(x[i] - h2f(h));
    }
#else
    float r[4] = {x[0], x[1], x[2], x[3]};  // (|r| < 256 for every term: a residual is <= 1/16 of its value)
#pragma unroll
    for (int j = 0; j < NT3; ++j) {
      const u32 p = e4m3x2_rn(r[0], r[1]) | ((u32)e4m3x2_rn(r[2], r[3]) << 16);
#if MODE == 4
#pragma unroll
      for (int i = 0; i < 4; ++i) xt[(size_t)j * MAX_K + xslot(k0 + i)] = (u8)(p >> (8 * i));
#else
      *(u32*)(xt + (size_t)j * MAX_K + k0) = p;
#endif
      const u32 q01 = e4m3x2_to_f16x2(p), q23 = e4m3x2_to_f16x2(p >> 16);
      r[0] = (r[0] - h2f(q01)) * 16.f;
      r[1] = (r[1] - h2f(q01 >> 16)) * 16.f;
      r[2] = (r[2] - h2f(q23)) * 16.f;
      r[3] = (r[3] - h2f(q23 >> 16)) * 16.f;
    }
#endif
  }
}

// all of x: warp w takes groups w, w + 8, ... (the units it multiplies)
__device__ __forceinline__ void stage_x_terms(u8* xt, int* xsh, const float* xin, int kk, int warp, int lane) {
  for (int gi = warp; gi * 128 < kk; gi += 8) stage_group(xt, xsh, xin, kk, gi, lane);
}

// 32 bytes of rows ra, rb at k (zeros past kk; kk % 16 == 0)
__device__ __forceinline__ void load_unit(uint4 (&a)[2], uint4 (&b)[2], const u8* ra, const u8* rb, int k, int kk) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool ok = k + 16 * h < kk;
    a[h] = ok ? __ldcs((const uint4*)(ra + k + 16 * h)) : make_uint4(0, 0, 0, 0);
    b[h] = ok ? __ldcs((const uint4*)(rb + k + 16 * h)) : make_uint4(0, 0, 0, 0);
  }
}

// FP4: 16 bytes (32 k) of rows ra, rb at k (zeros past kk; kk % 32 == 0)
__device__ __forceinline__ void load_unit4(uint4& a, uint4& b, const u8* ra, const u8* rb, int k, int kk) {
  const bool ok = k < kk;
  a = ok ? __ldcs((const uint4*)(ra + k / 2)) : make_uint4(0, 0, 0, 0);
  b = ok ? __ldcs((const uint4*)(rb + k / 2)) : make_uint4(0, 0, 0, 0);
}


// FP4 unit: lane (g, t)'s 32-k segment of rows g, g + 8 (a, b), their UE8M0 scales (sa, sb); the
// partial sums of its own segment, scaled (summed over t later)
__device__ __forceinline__ void mma_unit4(const uint4& a, const uint4& b, u32 sa, u32 sb, const u8* xt, int kbase,
                                          int g, int t, float& acc0, float& acc1, float xinv) {
  const u32 wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
  const bool feeds = (g >> 1) == t;  // this lane fills B column g = 2t + term with its own segment
  float p0 = 0.f, p1 = 0.f;
#if MODE == 4
  float c[NT3 / 2][4] = {};  // per pair of terms
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const u32 la = e4m3_lo(wa[q]), ha = e4m3_hi(wa[q]), lb = e4m3_lo(wb[q]), hb = e4m3_hi(wb[q]);
#pragma unroll
    for (int pr = 0; pr < NT3 / 2; ++pr) {
      const u8* xterm = xt + (size_t)(2 * pr + (g & 1)) * MAX_K + kbase + 8 * q;
      const u32 b0 = feeds ? *(const u32*)xterm : 0u, b1 = feeds ? *(const u32*)(xterm + 4) : 0u;
      mma_e4m3(c[pr], la, lb, ha, hb, b0, b1);
    }
  }
#pragma unroll
  for (int pr = 0; pr < NT3 / 2; ++pr) {
    const float s0 = pow2f(-8 * pr), s1 = pow2f(-8 * pr - 4);  // columns 2t, 2t + 1: terms 2pr, 2pr + 1
    p0 += c[pr][0] * s0 + c[pr][1] * s1;
    p1 += c[pr][2] * s0 + c[pr][3] * s1;
  }
  const int esh = 6;  // e4m3 = e2m1 x 2^-6
#else
  const u16* xterm = (const u16*)xt + (g & 1) * MAX_K + kbase;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    u32 pa[4], pb[4];
    fp4_pairs(wa[q], pa);
    fp4_pairs(wb[q], pb);
    const uint4 xq = feeds ? *(const uint4*)(xterm + 8 * q) : make_uint4(0, 0, 0, 0);
    mma_f16(c, pa[0], pb[0], pa[1], pb[1], xq.x, xq.y);
    mma_f16(c, pa[2], pb[2], pa[3], pb[3], xq.z, xq.w);
  }
  p0 = c[0] + c[1];  // hi + lo
  p1 = c[2] + c[3];
  const int esh = 14;  // fp4_pairs: e2m1 x 2^-14
#endif
  acc0 += p0 * pow2f((int)sa - 127 + esh) * xinv;
  acc1 += p1 * pow2f((int)sb - 127 + esh) * xinv;
}

// one 128-k unit of the tile: the partial sums of rows g and g + 8 (per lane; summed over t later)
__device__ __forceinline__ void mma_unit(const uint4 (&a)[2], const uint4 (&b)[2], const u8* xt, int kbase, int g,
                                         int t, float& acc0, float& acc1, float unit_scale) {
  const u32 wa[8] = {a[0].x, a[0].y, a[0].z, a[0].w, a[1].x, a[1].y, a[1].z, a[1].w};
  const u32 wb[8] = {b[0].x, b[0].y, b[0].z, b[0].w, b[1].x, b[1].y, b[1].z, b[1].w};
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#if MODE == 2
  const u16* xterm = (const u16*)xt + (g & 1) * MAX_K + kbase;  // (column g: hi, lo)
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    const u32 b0 = g < 2 ? *(const u32*)(xterm + 4 * w) : 0u, b1 = g < 2 ? *(const u32*)(xterm + 4 * w + 2) : 0u;
    mma_f16(c, e4m3x2_to_f16x2(wa[w]), e4m3x2_to_f16x2(wb[w]), e4m3x2_to_f16x2(wa[w] >> 16),
            e4m3x2_to_f16x2(wb[w] >> 16), b0, b1);
  }
  // columns 0 (hi) and 1 (lo) lie in lanes t == 0; the other lanes' columns are zero
  acc0 += (c[0] + c[1]) * unit_scale;
  acc1 += (c[2] + c[3]) * unit_scale;
#else
  const u8* xterm = xt + (size_t)min(g, NT3 - 1) * MAX_K + kbase;  // (column g: term g)
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const u32 b0 = g < NT3 ? *(const u32*)(xterm + 8 * q) : 0u, b1 = g < NT3 ? *(const u32*)(xterm + 8 * q + 4) : 0u;
    mma_e4m3(c, wa[2 * q], wb[2 * q], wa[2 * q + 1], wb[2 * q + 1], b0, b1);
  }
  // columns 2t, 2t + 1: terms scaled by 16^-(2t), 16^-(2t+1)
  const float s0 = pow2f(-8 * t) * unit_scale, s1 = pow2f(-8 * t - 4) * unit_scale;
  acc0 += c[0] * s0 + c[1] * s1;
  acc1 += c[2] * s0 + c[3] * s1;
#endif
}
#endif

// Block b runs items i0 + b, i0 + b + G, ... (G = gridDim.x, every block resident). Per item: its
// first weights are loaded, its own next items are prefetched into L2 until `ahead` bytes of
// them are in flight or landed (per block), then it waits for its input task, stages x (only when
// the task changed since the block's last item) and streams the rest.
extern "C" __global__ void __launch_bounds__(256) chain_run(const u64* w, const u64* s, const u64* x, const u64* y,
                                                            const int* n, const int* k, const int* dep,
                                                            const int* first, int T, int* done, int i0, int i1,
                                                            u32 ahead, int wait, int* timeouts, int* gdone,
                                                            const int* gfirst) {
  const Chain c{w, s, x, y, n, k, dep, first, T};
  __shared__ __align__(16) float xs[MAX_K];
#if MODE >= 2
  static_assert(ROWS == 16, "the tensor-core consumers take 16-row items");
  __shared__ int xsh[MAX_K / 128];
  __shared__ float red[8][16];
  const int g = (threadIdx.x & 31) >> 2, tq = threadIdx.x & 3;
#endif
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, G = gridDim.x;
  int pf = i0 + blockIdx.x;  // (thread 0's) next item of this block to prefetch
  u32 pf_bytes = 0;          // bytes prefetched for items not yet started
  int staged = -1;           // the task whose x is in shared memory
  for (int item = i0 + blockIdx.x; item < i1; item += G) {
    const int t = task_of(c, item);
    const int nn = c.n[t], kk = c.k[t], d = c.dep[t];
    const int gk = (kk + SB - 1) / SB;  // (FP8 scale blocks per row block)
    (void)gk;
#if MODE >= 2
    const int n0 = (item - c.first[t]) * 16, nunits = (kk + 127) / 128;
    const int ga = min(n0 + g, nn - 1), gb = min(n0 + g + 8, nn - 1);
    const u8* ra = (const u8*)c.w[t] + (size_t)ga * WBYTES(kk);
    const u8* rb = (const u8*)c.w[t] + (size_t)gb * WBYTES(kk);
    // a ring of UNITS units in flight per warp (slot i: units u with (u - warp) / 8 = i mod UNITS);
    // units carry their weight scales with them (read at use, each would wait a memory latency;
    // at stop 27 they were: FP4's UE8M0 bytes per lane, FP8's block scale per unit)
    uint4 ca[UNITS][2], cb[UNITS][2];
    u32 sa4[UNITS], sb4[UNITS];
    float sf[UNITS];
    (void)sa4; (void)sb4; (void)sf;
    auto load_slot = [&](int i, int u) {
#if MODE >= 4
      load_unit4(ca[i][0], cb[i][0], ra, rb, u * 128 + 32 * tq, kk);
      const u8* S4 = (const u8*)c.s[t];  // [n, kk / 32] UE8M0
      const int gk32 = kk / 32, sk = u * 4 + tq;
      sa4[i] = sk < gk32 ? __ldg(S4 + (size_t)ga * gk32 + sk) : 127u;
      sb4[i] = sk < gk32 ? __ldg(S4 + (size_t)gb * gk32 + sk) : 127u;
#else
      load_unit(ca[i], cb[i], ra, rb, u * 128 + 32 * tq, kk);
      sf[i] = __ldg((const float*)c.s[t] + (size_t)(n0 / SB) * gk + (u * 128) / SB);
#endif
    };
#pragma unroll
    for (int i = 0; i < UNITS; ++i)
      if (warp + 8 * i < nunits) load_slot(i, warp + 8 * i);
#else
    const int row0 = (item - c.first[t]) * ROWS + warp * R;
    Rows rw;
    rw.nch = kk / 16;
#pragma unroll
    for (int r = 0; r < R; ++r) rw.w[r] = (const uint4*)((const u8*)c.w[t] + (size_t)min(row0 + r, nn - 1) * kk);
    uint4 v[R][UNROLL];
    load_pass(v, rw, lane);
#endif
    if (tid == 0 && ahead > 0) {
      if (pf > item) pf_bytes -= item_bytes(c, item, false);  // (this item's bytes leave the window)
      else pf = item + G;                                    // (never prefetch the item about to run)
      while (pf < i1 && pf_bytes < ahead) {
        pf_bytes += item_bytes(c, pf, true);
        pf += G;
      }
    }
#if FINE
    // each warp waits for, and stages, the groups of x its own units read, just before it multiplies
    // each one (below): no block-wide wait or barrier, and the chain's next GEMV starts on the first
    // parts of its input while the rest is still being produced
    const bool fresh = t != staged;
    staged = t;
#else
    if (t != staged) {
      if (d >= 0 && wait && tid == 0) {  // wait for the input's every item (bounded: a bug must not hang the GPU)
        const int need = c.first[d + 1] - c.first[d];
        long long spins = 0;
        while (ld_acquire(done + d) < need) {
          __nanosleep(32);
          if (++spins > (1ll << 24)) { atomicAdd(timeouts, 1); break; }
        }
      }
      __syncthreads();  // (also: every warp is done with the previous task's x)
#if MODE >= 2
      stage_x_terms((u8*)xs, xsh, (const float*)c.x[t], kk, warp, lane);
#else
      stage_x(xs, (const float*)c.x[t], kk, tid);
#endif
      staged = t;
      __syncthreads();
    }
#endif
#if MODE >= 2
    float acc0 = 0.f, acc1 = 0.f;
    for (int u0 = warp; u0 < nunits; u0 += 8 * UNITS) {
#pragma unroll
      for (int i = 0; i < UNITS; ++i) {  // (constant slots: the ring stays in registers)
        const int u = u0 + 8 * i;
        if (u >= nunits) break;
#if FINE
        if (fresh) {  // group u of x: the 8 (or fewer, at its end) 16-row items of task d holding it
          if (d >= 0 && wait && lane == 0) {
            const int need = min(8, c.first[d + 1] - c.first[d] - 8 * u);
            long long spins = 0;
            while (ld_acquire(gdone + gfirst[d] + u) < need) {
              __nanosleep(32);
              if (++spins > (1ll << 24)) { atomicAdd(timeouts, 1); break; }
            }
          }
          __syncwarp();
          stage_group((u8*)xs, xsh, (const float*)c.x[t], kk, u, lane);
          __syncwarp();
        }
#endif
#if MODE >= 4
        mma_unit4(ca[i][0], cb[i][0], sa4[i], sb4[i], (const u8*)xs, u * 128 + 32 * tq, g, tq, acc0, acc1,
                  pow2f(-xsh[u]));
#else
        mma_unit(ca[i], cb[i], (const u8*)xs, u * 128 + 32 * tq, g, tq, acc0, acc1, sf[i] * pow2f(-xsh[u]));
#endif
        if (u + 8 * UNITS < nunits) load_slot(i, u + 8 * UNITS);  // slot i is free: its next unit
      }
    }
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
    if (tq == 0) {
      red[warp][g] = acc0;
      red[warp][g + 8] = acc1;
    }
    __syncthreads();
    if (tid < 16 && n0 + tid < nn) {
      float sum = 0.f;
#pragma unroll
      for (int wi = 0; wi < 8; ++wi) sum += red[wi][tid];  // (fixed order)
      ((float*)c.y[t])[n0 + tid] = sum;
    }
#else
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int c0 = lane;; ) {
      use_pass(v, acc, xs, (const float*)c.s[t], row0, gk, c0, rw.nch);
      c0 += 32 * UNROLL;
      if (c0 >= rw.nch) break;
      load_pass(v, rw, c0);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
      if (lane == 0 && row0 + r < nn) ((float*)c.y[t])[row0 + r] = acc[r];
    }
#endif
    // every warp's outputs before the counter that publishes them: the barrier orders them before
    // thread 0's release (cumulative), so one thread fences, not 256 (FENCE_ALL=1: each thread
    // fences first, as the stop-26 measurements did)
#if FENCE_ALL
    __threadfence();
#endif
    __syncthreads();
    if (tid == 0) {
      red_release(done + t, 1);
#if MODE >= 2
      red_release(gdone + gfirst[t] + n0 / 128, 1);  // (its 128-row group, for FINE consumers)
#endif
    }
  }
}
""")


def layer_shapes() -> list[tuple[str, int, int, int]]:
    """(name, n, k, input task offset within the layer, -1: the previous layer's last output) of one
    V4.1-Flash layer's GEMVs; FP4 experts as FP8 rows of the same bytes."""
    return [("wq_a", 1280, 5120, -1), ("wq_b", 32768, 1280, 0), ("wo_a", 8192, 4096, 1), ("wo_b", 5120, 8192, 2),
            ("shared w1", 4608, 5120, 3), ("shared w2", 5120, 2304, 4),
            ("experts w1", 6 * 4608 // 2, 5120, 3), ("experts w2", 6 * 5120 // 2, 2304, 6)]


def build_chain(layers: int, scale: int = 1) -> list[tuple[str, int, int, int]]:
    """Tasks (name, n, k, dep) of `layers` layers; scale > 1 divides n (a small chain for --check)."""
    tasks: list[tuple[str, int, int, int]] = []
    for li in range(layers):
        base = len(tasks)
        for name, n, k, dep in layer_shapes():
            d = base + dep if dep >= 0 else (base - 1 if li else -1)  # (a layer starts from the experts' output)
            tasks.append((f"L{li} {name}", max(32, n // scale // 32 * 32), k, d))
    for i, (_, _, k, d) in enumerate(tasks):  # an input must be at least k wide
        if d >= 0 and tasks[d][1] < k:
            tasks[i] = (tasks[i][0], tasks[i][1], tasks[d][1] // 16 * 16, d)
    return tasks


class ChainRun:
    """The chain's buffers on the device and both ways of running it."""

    def __init__(self, tasks: list, seed: int = 0, unroll: int = 4, mode: int = 0, rows: int = ROWS,
                 fence_all: bool = False, units: int = 2, fine: bool = False) -> None:
        import cupy as cp

        self.tasks = tasks
        self.mod = cp.RawModule(code=SOURCE, options=("-std=c++17", f"-arch=sm_{kernels.device_arch()}",
                                                          f"-DUNROLL={unroll}", f"-DMODE={mode}", f"-DUNITS={units}",
                                                          f"-DROWS={rows}", f"-DFENCE_ALL={int(fence_all)}",
                                                          f"-DFINE={int(fine)}"))
        self.fn = self.mod.get_function("chain_run")
        rng = np.random.default_rng(seed)
        self.w, self.s, self.y = [], [], []
        kmax = max(k for _, _, k, _ in tasks)
        self.x0 = cp.asarray(rng.standard_normal(kmax).astype(np.float32))
        self.fp4 = mode >= 4
        for _, n, k, _ in tasks:
            if self.fp4:  # e2m1 nibbles (every code a value), UE8M0 scales per row and 32 k around 2^-9
                self.w.append(cp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)))
                self.s.append(cp.asarray(rng.integers(116, 122, (n, k // 32), dtype=np.uint8)))
            else:  # e4m3 codes with exponent fields < 15 (no NaN), either sign; a float per SB x SB
                self.w.append(cp.asarray(rng.integers(0, 256, (n, k), dtype=np.uint8) & np.uint8(0xF7)))
                sc = rng.uniform(0.5, 2.0, (-(-n // SB), -(-k // SB))).astype(np.float32) / np.float32(k)
                self.s.append(cp.asarray(sc))
            self.y.append(cp.zeros(n, cp.float32))
        first = np.cumsum([0] + [-(-n // rows) for _, n, _, _ in tasks]).astype(np.int32)
        self.items = int(first[-1])
        ptr = lambda a: a.data.ptr  # noqa: E731
        xs = [ptr(self.x0) if d < 0 else ptr(self.y[d]) for _, _, _, d in tasks]
        self.arrays = [cp.asarray(np.array(v, np.uint64)) for v in
                       ([ptr(a) for a in self.w], [ptr(a) for a in self.s], xs, [ptr(a) for a in self.y])]
        self.ints = [cp.asarray(np.array(v, np.int32)) for v in
                     ([n for _, n, _, _ in tasks], [k for _, _, k, _ in tasks], [d for *_, d in tasks], first)]
        self.first = first
        self.done = cp.zeros(len(tasks), cp.int32)
        # per task, a counter for each 128 rows of its output (items done there: --fine's waits)
        gfirst = np.cumsum([0] + [-(-n // 128) for _, n, _, _ in tasks]).astype(np.int32)
        self.gfirst, self.gdone = cp.asarray(gfirst), cp.zeros(int(gfirst[-1]), cp.int32)
        self.timeouts = cp.zeros(1, cp.int32)
        self.sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
        # blocks of 256 threads an SM holds at once (registers, 32 KB of shared memory each): a
        # persistent launch must not exceed it, or its items wait on blocks that never start
        regs = -(-max(self.fn.num_regs, 1) // 8) * 8
        self.resident = max(1, min(65536 // (256 * regs), (228 << 10) // (33 << 10), 8))
        self.nbytes = sum(w.nbytes + sc.nbytes for w, sc in zip(self.w, self.s, strict=True))

    def _chain(self) -> tuple:
        return (*self.arrays, *self.ints, np.int32(len(self.tasks)))

    def persistent(self, ahead_mb: float, per_sm: int = 2, wait: bool = True) -> None:
        """The chain in one launch of per_sm resident blocks per SM, ahead_mb MB of weights
        prefetched into L2 ahead of the items running (split evenly over the blocks). wait=False:
        no item waits for its input (wrong outputs; the streaming rate without dependencies)."""
        self.done.fill(0)
        self.gdone.fill(0)
        g = self.sms * min(per_sm, self.resident)
        self.fn((g,), (256,), (*self._chain(), self.done, np.int32(0), np.int32(self.items),
                               np.uint32(int(ahead_mb * 1e6) // g), np.int32(wait), self.timeouts, self.gdone,
                               self.gfirst))

    def per_task(self) -> None:
        """One launch per task, in stream order (its inputs are complete before it starts)."""
        self.done.fill(0)
        self.gdone.fill(0)
        for t in range(len(self.tasks)):
            i0, i1 = int(self.first[t]), int(self.first[t + 1])
            self.fn((min(i1 - i0, 4 * self.sms),), (256,), (*self._chain(), self.done, np.int32(i0), np.int32(i1),
                                                            np.uint32(0), np.int32(1), self.timeouts, self.gdone,
                                                            self.gfirst))

    def reference(self) -> list[np.ndarray]:
        """Every task's output in numpy, from the same weights and input."""
        from engine.formats import fp8_e4m3_to_f32

        outs: list[np.ndarray] = []
        x0 = self.x0.get()
        e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
        for t, (_, _n, k, d) in enumerate(self.tasks):
            if self.fp4:  # element 2j: byte j's low nibble, 2j + 1: its high one
                b = self.w[t].get()
                w = e2m1[np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1)]
                s = np.repeat(np.exp2(self.s[t].get().astype(np.float64) - 127), 32, 1)[:, :k]
            else:
                w = fp8_e4m3_to_f32(self.w[t].get()).astype(np.float64)
                s = np.repeat(np.repeat(self.s[t].get().astype(np.float64), SB, 0), SB, 1)[:w.shape[0], :w.shape[1]]
            x = x0[:k] if d < 0 else outs[d][:k]
            outs.append((w * s) @ x.astype(np.float64))
        return outs


CHECK_TOL = {0: 1e-4, 2: 1e-4, 3: 1e-3, 4: 1e-3, 5: 1e-4}  # 3, 4: x as four e4m3 terms and FP8 MMA sums


def check(mode: int = 0, units: int = 2, fine: bool = False) -> bool:
    """Both ways against numpy on a small two-layer chain (n / 16); prints the worst error relative to
    each task's largest output. (--mode 1 is timing only.)"""
    import cupy as cp

    run = ChainRun(build_chain(2, scale=16), mode=mode, units=units, fine=fine)
    ref = run.reference()
    ok = True
    for way, go in (("persistent", lambda: run.persistent(8.0)), ("graph", run.per_task)):
        run.timeouts.fill(0)
        for y in run.y:
            y.fill(np.nan)
        go()
        cp.cuda.Device().synchronize()
        worst = max(float(np.abs(y.get() - r).max() / max(np.abs(r).max(), 1e-30))
                    for y, r in zip(run.y, ref, strict=True))
        to = int(run.timeouts.get()[0])
        print(f"check mode {mode}{' fine' if fine else ''} {way}: worst relative error {worst:.2e} "
              f"over {len(ref)} tasks, timeouts {to}")
        ok = ok and worst < CHECK_TOL[mode] and to == 0
    return ok


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    from engine.bench import _timeit, copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="layers of GEMVs in the chain (2: past L2)")
    ap.add_argument("--ahead", default="0,4,8,16,24", help="MB of weights prefetched into L2 ahead (whole GPU)")
    ap.add_argument("--per-sm", default="1,2,4", help="resident blocks per SM of the persistent launch")
    ap.add_argument("--unroll", type=int, default=4, help="16-byte loads per row in flight per lane")
    ap.add_argument("--units", type=int, default=2,
                    help="modes 2-5: 128-k units in flight per warp (a register ring; 2 as measured at stop 27)")
    ap.add_argument("--fine", action="store_true",
                    help="modes 2-5: each warp waits only for the 128-row groups of the input its units read")
    ap.add_argument("--rows", type=int, default=ROWS, choices=(8, 16, 32, 64), help="weight rows per item")
    ap.add_argument("--fence-all", action="store_true",
                    help="every thread fences before an item's counter is bumped (as measured at stop 26)")
    ap.add_argument("--mode", type=int, default=0, choices=range(6),
                    help="0: FP8 x float on CUDA cores; 1: the same bytes as int8 by dp4a (timing only); "
                         "2: FP8, f16 MMA (gemvr's arithmetic); 3: FP8, e4m3 MMA, x as e4m3 terms; "
                         "4: FP4 -> e4m3 bytes, e4m3 MMA; 5: FP4, f16 MMA (gemvr's)")
    ap.add_argument("--check", action="store_true", help="first compare both ways with numpy")
    a = ap.parse_args(argv)
    if a.mode >= 2 and a.rows != 16:
        ap.error("--mode 2 to 5 take 16-row items")
    if a.fine and a.mode < 2:
        ap.error("--fine takes --mode 2 to 5")
    if a.check and not check(a.mode if a.mode != 1 else 0, a.units, a.fine):
        print("check FAILED")
        return 1
    bw = copy_bandwidth()
    run = ChainRun(build_chain(a.layers), unroll=a.unroll, mode=a.mode, rows=a.rows,
                   fence_all=a.fence_all, units=a.units, fine=a.fine)
    floor = run.nbytes / bw
    print(f"copy rate {bw / 1e12:.2f} TB/s; chain: {len(run.tasks)} GEMVs, {run.items} items of {a.rows} rows, "
          f"{run.nbytes / 1e6:.0f} MB, floor {floor * 1e6:.1f} us; {run.sms} blocks")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        run.per_task()
        stream.begin_capture()
        run.per_task()
        graph = stream.end_capture()
        t = _timeit(lambda: graph.launch(stream), iters=10, warmup=1)
    print(f"graph, one launch per GEMV: {t * 1e6:8.1f} us  ({100 * floor / t:5.1f}% of floor)")
    print(f"{run.fn.num_regs} registers: {run.resident} blocks per SM resident")
    for per_sm in sorted({min(int(v), run.resident) for v in a.per_sm.split(",")}):
        for mb in (float(v) for v in a.ahead.split(",")):
            run.timeouts.fill(0)
            t = _timeit(lambda mb=mb, per_sm=per_sm: run.persistent(mb, per_sm), iters=10, warmup=1)
            to = int(run.timeouts.get()[0])
            print(f"persistent, {per_sm} blocks/SM, {mb:4.0f} MB ahead: {t * 1e6:8.1f} us  "
                  f"({100 * floor / t:5.1f}% of floor)" + (f"  TIMEOUTS {to}" if to else ""))
        t = _timeit(lambda per_sm=per_sm: run.persistent(0, per_sm, wait=False), iters=10, warmup=1)
        print(f"  the same launch with no waits (streaming alone): {t * 1e6:8.1f} us  ({100 * floor / t:5.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
