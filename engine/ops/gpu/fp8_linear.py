"""DeepSeek's FP8 / FP4 linear on the tensor cores (kernels/fp8_gemm.cu), for --numerics deepseek: the
activations quantized to e4m3 per 32 along K with UE8M0 scales (the reference's act_quant), then
one e4m3 x e4m3 MMA per 32-wide step, scaled by both operands' scales into an f32 total.

One kernel per architecture: on sm_90a (H100 / H200) gemm_e4m3_*_sm90, wgmma with a producer
warpgroup feeding a shared-memory ring and two consumer warpgroups, 128 x 128 tiles, 384 threads,
its ring in dynamic shared memory (over the 48 KB default, opted in per kernel); elsewhere
gemm_e4m3_*, mma.sync m16n8k32 on 64 x 64 tiles.

fp8_grouped_linear: the same arithmetic over a MoE's segment table (kernels/fp8_grouped.cu), one
launch for every expert's rows, in segments of up to GROUPED_ROWS rows."""

from __future__ import annotations

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu.common import _c32, k_splits
from engine.ops.gpu.fp4_experts import split_k_launch
from engine.ops.gpu.weights import GpuWeight
from engine.ops.kernels import FMT_FP4, FMT_FP8

TILE = 64  # gemm_e4m3's tile (rows and columns) and K stage; K must be a multiple of it
ACT_BLOCK = 32
# gemm_e4m3_*_sm90 (mirrors kernels/fp8_gemm.cu WG_*; tools/dev/emulate_wgmma_gemm.py checks them):
# a 128 x 128 tile, 384 threads, a ring of stages of 128 bytes of K: two 16 KB operand tiles and two
# 2 KB scale tables, FP4 also 9 KB of staged nibbles and scale bytes and 144 bytes of exponent
# ranges; two mbarriers a stage; 1 KB to align the ring to the 128-byte swizzle's 1024-byte pattern.
WG_TILE, WG_THREADS = 128, 384
WG_STAGES = {FMT_FP8: 6, FMT_FP4: 5}
WG_STAGE_K = 128  # K per ring stage (kernels/fp8_wgmma.cuh WG_BK)
SPLIT_MIN_STAGES = 2  # split K (wg_splits): the fewest stages a split keeps
# Rows per segment of a prompt chunk's routed experts on this path: the wgmma tile's, so a block's
# tile is one segment's (shorter ones only for an expert's last rows) and each expert's weight tile
# is read once per 128 of its rows rather than per 64 (GEMM_TILE, the exact-term GEMM's).
GROUPED_ROWS = WG_TILE


def wgmma_smem(fmt: int) -> int:
    """Dynamic shared memory of gemm_e4m3_*_sm90 for weights of format fmt."""
    stage = 2 * 16384 + 2 * 2048 + (9216 + 144 if fmt == FMT_FP4 else 0)
    return WG_STAGES[fmt] * (stage + 16) + 1024


def act_quant_fp8(x: cp.ndarray, bf16: bool = False) -> tuple[cp.ndarray, cp.ndarray]:
    """x [M, K] f32 -> (e4m3 codes uint8 [M, K], f32 power-of-two scales [M, K / 32]); bf16: x rounded
    to bf16 first, in the same pass (the reference quantizes its bf16 activations)."""
    x = _c32(x)
    m, k = x.shape
    if k % ACT_BLOCK:
        raise ValueError(f"act_quant_fp8: K = {k} is not a multiple of {ACT_BLOCK}")
    codes = cp.empty((m, k), cp.uint8)
    scales = cp.empty((m, k // ACT_BLOCK), cp.float32)
    quads = m * (k // 4)
    if quads:
        K.function("fp8_gemm", "act_quant_fp8")((-(-quads // 256),), (256,), (
            x, np.int32(k), codes, scales, np.int32(m), np.int32(k), np.int32(bf16)))
    return codes, scales


def fp8_linear(x: cp.ndarray | None, w: GpuWeight, codes: tuple | None = None, bf16: bool = False) -> cp.ndarray:
    """x [M, K] times an FP8 or FP4 weight [N, K] in DeepSeek's numerics: f32 [M, N] (FP4 values
    decoded exactly into e4m3 in the kernel). codes: x already quantized (act_quant_fp8), when
    several weights read the same activations. bf16: x rounded to bf16 before its quantization and
    the output rounded to bf16 as stored (the reference's linear: bf16 in, bf16 out)."""
    kernel = {FMT_FP8: "gemm_e4m3_fp8", FMT_FP4: "gemm_e4m3_fp4"}.get(w.fmt)
    if kernel is None:
        raise ValueError("fp8_linear takes FP8 or FP4 weights")
    n, k = w.shape
    if k % TILE:
        raise ValueError(f"fp8_linear: K = {k} is not a multiple of {TILE}")
    a, sa = codes if codes is not None else act_quant_fp8(x, bf16)
    m = a.shape[0]
    y = cp.empty((m, n), cp.float32)
    if m:
        bn, bk = w.block
        args = (a, sa, w.data, w.scale, y, np.int32(n), np.int32(m), np.int32(n), np.int32(k), np.int32(bn),
                np.int32(bk), np.int32(w.gk))
        if K.device_arch() == "90a":
            smem = wgmma_smem(w.fmt)
            fn = K.function_with_smem("fp8_gemm", kernel + "_sm90", smem)
            grid = (-(-n // WG_TILE), -(-m // WG_TILE))
            splits = wg_splits(grid[0] * grid[1], -(-k // WG_STAGE_K)) if w.fmt == FMT_FP8 else 1
            split_k_launch(fn, grid, WG_THREADS, args, y, bf16, splits, smem)
        else:
            K.function("fp8_gemm", kernel)((-(-n // TILE), -(-m // TILE)), (128,), (
                *args, np.int32(bf16), y, np.int64(0)))
    return y


def wg_splits(blocks: int, stages: int) -> int:
    """K splits of a gemm_e4m3_fp8_sm90 launch of `blocks` tiles over `stages` stages of K (a verify
    step's rows are two row tiles times N / 128): common.k_splits, SPLIT_MIN_STAGES a split."""
    return k_splits(blocks, stages, SPLIT_MIN_STAGES)


def gather_rows(src: cp.ndarray, rows: cp.ndarray, block: int = 256) -> cp.ndarray:
    """src's rows in the given order (int32 rows on the device), in one gather_rows16 launch where
    they are whole 16-byte chunks of a C-contiguous array (block: threads per row)."""
    idx = cp.ascontiguousarray(rows, dtype=cp.int32)
    dst = cp.empty((idx.size, src.shape[1]), src.dtype)
    n16 = src.shape[1] * src.itemsize // 16
    if idx.size and n16 * 16 == src.shape[1] * src.itemsize and src.flags.c_contiguous:
        K.function("elementwise", "gather_rows16")((idx.size,), (block,), (src, idx, dst, np.int32(n16)))
    elif idx.size:
        dst[...] = src[idx]
    return dst


def gather_codes(codes: tuple[cp.ndarray, cp.ndarray], rows: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """act_quant_fp8's (codes, scales) of the given rows, in their order: a MoE's pairs, which the
    grouped GEMM then reads in place (gathering them in its producer cost it more than this pass)."""
    a, sa = codes
    idx = cp.ascontiguousarray(rows, dtype=cp.int32)
    return gather_rows(a, idx, 256), gather_rows(sa, idx, 64)


def fp8_grouped_linear(codes: tuple[cp.ndarray, cp.ndarray], segs: cp.ndarray, wptrs: cp.ndarray, sptrs: cp.ndarray,
                       w: GpuWeight, y: cp.ndarray, step: int = GROUPED_ROWS, bf16: bool = False) -> None:
    """y[row0 + r, ycol:ycol + N] = A[row0 + r] times expert e's weight, for each segment (e, row0,
    rows <= step, 0, ycol) of segs [nseg * 5] int32; codes = (A e4m3 codes, scales) from
    act_quant_fp8, rows in pair order (gather_codes); wptrs / sptrs [E] uint64: the experts' data and scale
    pointers, each weight of w's shape, format and blocks. Rows no segment covers are not written.
    bf16: y rounded to bf16 as stored."""
    tag = {FMT_FP8: "fp8", FMT_FP4: "fp4"}.get(w.fmt)
    if tag is None:
        raise ValueError("fp8_grouped_linear takes FP8 or FP4 weights")
    n, k = w.shape
    a, sa = codes
    if k % TILE or a.shape[1] != k:
        raise ValueError(f"fp8_grouped_linear: K = {k} (x has {a.shape[1]} columns) is not a multiple of {TILE}")
    nseg = segs.size // 5
    if nseg == 0 or a.shape[0] == 0:
        return
    bn, bk = w.block
    # (FP4 experts on sm_90a run kernels/fp4_experts.cu; the mma.sync kernel takes them here)
    sm90 = K.device_arch() == "90a" and w.fmt == FMT_FP8
    tile = WG_TILE if sm90 else TILE
    mtiles = -(-step // tile)
    args = (a, sa, segs, wptrs, sptrs, y, np.int32(y.shape[1]), np.int32(n),
            np.int32(k), np.int32(bn), np.int32(bk), np.int32(w.gk), np.int32(mtiles), np.int32(bf16))
    grid = (-(-n // tile), nseg * mtiles)
    if sm90:
        smem = wgmma_smem(w.fmt)
        fn = K.function_with_smem("fp8_grouped", f"gemm_e4m3_grouped_{tag}_sm90", smem)
        fn(grid, (WG_THREADS,), args, shared_mem=smem)
    else:
        K.function("fp8_grouped", f"gemm_e4m3_grouped_{tag}")(grid, (128,), args)
