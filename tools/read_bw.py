#!/usr/bin/env python3
"""How to read HBM at full speed on this GPU: read bandwidth of plain loads and of copy-engine
streams, by how many bytes each SM keeps in flight and in what pieces (a developer's tool for
designing the decode GEMVs; not the runtime).

    python tools/read_bw.py [--gib 2]

Prints, for a buffer far larger than L2, TB/s and the percentage of the device-to-device copy rate
(engine/bench.py copy_bandwidth, the yardstick of every floor dsuf prints) for:
  ldg      every thread U independent 16-byte loads in flight, W warps per SM, grid-stride (the
           ideal access order: each pass reads one contiguous span);
  ldg-warp the same, each warp reading its own contiguous share (a K-split GEMV's order);
  ldg-rows gemvr's order: a warp's 16-row tile of a row-major matrix, 32 bytes of two rows per lane
           and 128-k unit, U units in flight per lane;
  bulk     one thread per block streaming its tiles through S shared-memory slots by
           cp.async.bulk, each stage P copies of C bytes: P = 1 is one contiguous piece (weights
           stored tile by tile), P = 16 pieces at a row stride (16 rows of a row-major matrix, as
           the removed gemvb copied them).
With --spans, reads of a decode GEMV's size instead: one launch per span, back to back in a CUDA
graph, each span past L2 (H200: 32 MB spans 87% of the copy rate, 8 MB 59%: a launch costs ~1.6 us).
The one-row GEMVs reach 35-50% of the copy rate (README); this says which of these gets ~90% and
with how much in flight, before the next GEMV is designed around it. Measured on the H200: every
order (ldg-rows included) passes 90% with >= 16 warps per SM and >= 32 KB in flight per SM; bulk
copies need >= 64 KB per SM in flight, in pieces of >= 1 KB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

template <int U, bool WARP>
__device__ __forceinline__ void ldg_body(const uint4* __restrict__ p, long long n, u32* out) {
  u32 acc = 0;
  if (WARP) {  // warp w reads [w * share, (w + 1) * share), 32 lanes x U loads per pass
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32, share = n / warps;
    const uint4* q = p + w * share + (threadIdx.x & 31);
    for (long long i = 0; i + 32 * (U - 1) < share; i += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int j = 0; j < U; ++j) v[j] = __ldg(q + i + 32 * j);
#pragma unroll
      for (int j = 0; j < U; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
  } else {
    const long long nt = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i + (U - 1) * nt < n; i += U * nt) {
      uint4 v[U];
#pragma unroll
      for (int j = 0; j < U; ++j) v[j] = __ldg(p + i + j * nt);
#pragma unroll
      for (int j = 0; j < U; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;  // (keeps the loads)
}
#define LDG(U)                                                                                           \
  extern "C" __global__ void ldg_u##U(const uint4* p, long long n, u32* out) { ldg_body<U, false>(p, n, out); } \
  extern "C" __global__ void ldgw_u##U(const uint4* p, long long n, u32* out) { ldg_body<U, true>(p, n, out); }
LDG(1)
LDG(2)
LDG(4)
LDG(8)
LDG(16)

// gemvr's order: warp w takes 16-row tiles w, w + warps, ... of a row-major matrix (rows of L bytes)
// and walks K in 128-byte units, lane (g, t) loading 32 bytes of rows g and g + 8 at 32 t; U units in
// flight per lane (U x 64 bytes)
template <int U>
__device__ __forceinline__ void ldgr_body(const unsigned char* __restrict__ p, int tiles, int L, u32* out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int warps = gridDim.x * blockDim.x / 32, w = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  u32 acc = 0;
  for (int tile = w; tile < tiles; tile += warps) {
    const unsigned char* ra = p + (size_t)(tile * 16 + g) * L + 32 * t;
    const unsigned char* rb = ra + (size_t)8 * L;
    for (int k = 0; k + 128 * (U - 1) < L; k += 128 * U) {
      uint4 v[U][4];
#pragma unroll
      for (int j = 0; j < U; ++j) {
        v[j][0] = __ldg((const uint4*)(ra + k + 128 * j));
        v[j][1] = __ldg((const uint4*)(ra + k + 128 * j + 16));
        v[j][2] = __ldg((const uint4*)(rb + k + 128 * j));
        v[j][3] = __ldg((const uint4*)(rb + k + 128 * j + 16));
      }
#pragma unroll
      for (int j = 0; j < U; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc ^= v[j][q].x ^ v[j][q].y ^ v[j][q].z ^ v[j][q].w;
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
#define LDGR(U)                                                                   \
  extern "C" __global__ void ldgr_u##U(const unsigned char* p, int tiles, int L, u32* out) { \
    ldgr_body<U>(p, tiles, L, out);                                                          \
  }
LDGR(1)
LDGR(2)
LDGR(4)

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// tiles of P rows x L bytes (row r of tile t at p + (t * P + r) * L), block b taking tiles b, b + G, ...;
// a stage = columns [j C, (j + 1) C) of the tile's rows: P bulk copies of C bytes into one of S slots
extern "C" __global__ void bulk(const unsigned char* p, int tiles, int P, int L, int C, int S, u32* out) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) u64 bar[16];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < S; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar + s)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int per_tile = L / C;
  const int mine = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  const long long n = (long long)mine * per_tile;  // this block's stages
  auto issue = [&](long long i) {
    const int s = (int)(i % S);
    const long long t = blockIdx.x + (i / per_tile) * gridDim.x;
    const int j = (int)(i % per_tile);
    const u32 b = smem_u32(bar + s);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(P * C) : "memory");
    for (int r = 0; r < P; ++r)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(smem_u32(sm + (s * P + r) * C)), "l"(p + (t * P + r) * (long long)L + (long long)j * C),
                   "r"(C), "r"(b) : "memory");
  };
  for (long long i = 0; i < S && i < n; ++i) issue(i);
  u32 acc = 0;
  for (long long i = 0; i < n; ++i) {
    const int s = (int)(i % S);
    const u32 b = smem_u32(bar + s), par = (u32)((i / S) & 1);
    asm volatile("{\n .reg .pred q;\n W:\n mbarrier.try_wait.parity.shared::cta.b64 q, [%0], %1;\n @!q bra W;\n}\n"
                 ::"r"(b), "r"(par) : "memory");
    acc ^= *(const u32*)(sm + s * P * C);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // (the read before the slot's refill)
    if (i + S < n) issue(i + S);
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def _time(fn, iters: int = 10) -> float:
    import cupy as cp

    fn()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / 1e3 / iters


def _spans(mod, buf, out, sms: int, copy: float, span: int, row) -> None:
    """Reads of `span` bytes as a decode step makes them: one launch per weight, back to back in a
    CUDA graph, each on a slice of the buffer not in L2 (what a GEMV of that size can reach)."""
    import cupy as cp
    import numpy as np

    slices = min(32, buf.nbytes // span)
    stream = cp.cuda.Stream(non_blocking=True)
    for warps, u in ((16, 2), (32, 1), (32, 2), (64, 2)):  # (the grid-stride order: every warp busy)
        fn = mod.get_function(f"ldg_u{u}")
        grid = sms * warps // 8
        with stream:
            stream.begin_capture()
            for i in range(slices):
                fn((grid,), (256,), (buf[i * span:(i + 1) * span], np.int64(span // 16), out))
            g = stream.end_capture()
            t = _time(lambda g=g: g.launch(stream)) / slices
        row("ldg", f"{span >> 20} MB spans, {warps} warps/SM, {u} x 16 B", warps * 32 * u * 16, t, span)


def main() -> int:
    import cupy as cp
    import numpy as np

    from engine import kernels as K
    from engine.bench import copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="buffer size (far above L2)")
    ap.add_argument("--spans", default="", help="comma-separated MB: instead of the sweep, read spans of these"
                    " sizes (a decode GEMV's weight) in a CUDA graph of launches on rotating slices")
    a = ap.parse_args()
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17", f"-arch=sm_{K.device_arch()}"))
    sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    nbytes = int(a.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    buf = cp.random.default_rng(0).integers(0, 255, nbytes, dtype=cp.uint8)
    out = cp.zeros(1, cp.uint32)
    copy = copy_bandwidth()
    print(f"copy rate {copy / 1e12:.2f} TB/s (read + write); buffer {nbytes / 2**30:.1f} GiB; {sms} SMs")
    print(f"{'kernel':10s} {'config':44s} {'in flight/SM':>12s} {'TB/s':>6s} {'% copy':>7s}")

    def row(name: str, cfg: str, inflight: float, seconds: float, moved: int) -> None:
        bw = moved / seconds
        print(f"{name:10s} {cfg:44s} {inflight / 1024:10.0f} KB {bw / 1e12:6.2f} {100 * bw / copy:6.1f}%")

    if a.spans:
        for mb in (float(x) for x in a.spans.split(",")):
            _spans(mod, buf, out, sms, copy, int(mb * (1 << 20)) // (16 * 8192) * (16 * 8192), row)
        return 0
    n16 = nbytes // 16
    for warps in (8, 16, 32, 64):
        for u in (1, 2, 4, 8, 16):
            if warps * 32 * (4 * u + 16) > 65536:  # (registers: all of the warps resident)
                continue
            grid = sms * warps // 8
            threads = grid * 256
            for name, fn_name in (("ldg", f"ldg_u{u}"), ("ldg-warp", f"ldgw_u{u}")):
                fn = mod.get_function(fn_name)
                if name == "ldg":
                    moved = n16 // (u * threads) * u * threads * 16
                else:
                    share = n16 // (threads // 32)
                    moved = share // (32 * u) * 32 * u * (threads // 32) * 16
                t = _time(lambda fn=fn, grid=grid: fn((grid,), (256,), (buf, np.int64(n16), out)))
                row(name, f"{warps} warps/SM, {u} x 16 B per thread", warps * 32 * u * 16, t, moved)
    row_len = 8192  # wo_b's K in FP8 bytes
    tiles = nbytes // (16 * row_len)
    for warps in (8, 16, 24, 32):
        for u in (1, 2, 4):
            if warps * 32 * (16 * u + 16) > 65536:
                continue
            fn = mod.get_function(f"ldgr_u{u}")
            grid = sms * warps // 8
            t = _time(lambda fn=fn, grid=grid: fn((grid,), (256,), (buf, np.int32(tiles), np.int32(row_len), out)))
            row("ldg-rows", f"{warps} warps/SM, {u} x 128 k of 16 rows per warp", warps * 32 * u * 64, t,
                tiles * 16 * (row_len // (128 * u) * 128 * u))
    fn = mod.get_function("bulk")
    for p, c in ((1, 8192), (1, 32768), (16, 512), (16, 1024), (16, 2048)):
        for s in (2, 4, 8):
            for bps in (1, 2, 4):
                smem = s * p * c
                if smem * bps > 200 << 10 or smem > 200 << 10:
                    continue
                fn.max_dynamic_shared_size_bytes = smem
                row_len = 8192 if p == 16 else 65536  # a tile: 16 rows of 8 KB (wo_b's K), or 64 KB contiguous
                tiles = nbytes // (p * row_len)
                grid = sms * bps
                t = _time(lambda grid=grid, smem=smem, p=p, c=c, s=s, tiles=tiles, row_len=row_len: fn(
                    (grid,), (32,), (buf, np.int32(tiles), np.int32(p), np.int32(row_len), np.int32(c), np.int32(s),
                                     out), shared_mem=smem))
                row("bulk", f"{bps} blocks/SM, {s} stages of {p} x {c} B", bps * smem, t, tiles * p * row_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
