"""The routed experts' FP4 linears of a prompt chunk in DeepSeek's numerics on sm_90a
(kernels/fp4_experts.cu): bf16 wgmma with the e2m1 weights decoded exactly into shared memory, the
pairs' act_quant values as bf16 in the kernel's K order. The same products as an e4m3 MMA with its per-32
promotion, summed in f32 without one (the kernel's header says why that is faster on Hopper)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu import tma
from engine.ops.gpu.common import _c32, k_splits
from engine.ops.gpu.weights import GpuWeight
from engine.ops.kernels import FMT_BF16, FMT_FP4, FMT_FP8

FE_ROWS = 256  # token rows per block (the wgmma N at most): a MoE segment's rows on this path
FE_COLS, FE_THREADS, FE_STAGES = 128, 384, 6  # kernels/bf16_wgmma.cuh BW_BM, BW_THREADS; bf16_weights.cu BW_STAGES
# gemm_fp8w_bf16_sm90 / gemm_bf16w_sm90: token tiles of 64 bf16 a row, 2 mbarriers each, alignment
FE_SMEM = FE_STAGES * (FE_ROWS * 128 + 16) + 1024
# gemm_fp4_experts_sm90 / gemm_fd_fp8_sm90 (kernels/fp4_experts.cu FdCfg): a ring of token tiles,
# decoded bf16 weight tiles (128 rows x 128 bytes) and the codes' staging (128 rows of a chunk's codes
# + 128 scale words), 2 mbarriers a stage, and the alignment pad
FD_STAGES = {FMT_FP4: 4, FMT_FP8: 3}
FD_CODES = {FMT_FP4: 32, FMT_FP8: 64}  # code bytes of a weight row's chunk
FD_BOX_ROWS = 64  # token rows of a TMA box (kernels/fp4_experts.cu FD_BOX_ROWS)
FD_SMEM = {f: FD_STAGES[f] * (FE_ROWS * 128 + FE_COLS * 128 + FE_COLS * (FD_CODES[f] + 4) + 16) + 1024
           for f in (FMT_FP4, FMT_FP8)}
# gemm_fd_fp8_sm90 from this many rows (a prompt chunk's): fewer (a verify step's) make too few blocks
# for the multiprocessors without split K, which the e4m3 GEMM has
FD_FP8_MIN_ROWS = 512
CHUNK = 64  # K step of the kernel and of act_quant_bf16w's order
# split K (gemm_fp8w_bf16 / gemm_bf16w; common.k_splits): a skinny linear (a verify step's rows; a
# small N) has fewer blocks than multiprocessors and reads its weight at a fraction of HBM's rate.
# Each split keeps at least this many chunks.
SPLIT_MIN_CHUNKS = 4


def act_quant_bf16w(x: cp.ndarray, bf16: bool = False) -> cp.ndarray:
    """x [M, K] f32 -> the reference's act_quant values (e4m3 code * UE8M0 scale per 32; x rounded
    to bf16 first if bf16) as bf16 bits uint16 [M, K], each 8 of K in gemm_fp4_experts' order."""
    return _bf16_chunk_rows("fp4_experts", "act_quant_bf16w", x, np.int32(bf16))


def fp4_experts_take(w: GpuWeight) -> bool:
    """Whether gemm_fp4_experts takes experts shaped as w on this device: FP4, K whole chunks, sm_90a."""
    return w.fmt == FMT_FP4 and w.shape[1] % CHUNK == 0 and K.device_arch() == "90a"


def fp4_experts_linear(xb: cp.ndarray, segs: cp.ndarray, wptrs: cp.ndarray, sptrs: cp.ndarray, w: GpuWeight,
                       y: cp.ndarray, bf16: bool = False) -> None:
    """y[row0 + r, ycol:ycol + N] = xb[row0 + r] times expert e's FP4 weight, for each segment (e,
    row0, rows <= FE_ROWS, 0, ycol) of segs [nseg * 5] int32; xb from act_quant_bf16w, rows in pair
    order (fp8_linear.gather_rows); wptrs / sptrs [E] uint64: the experts' data and scale pointers, each of
    w's shape. Rows no segment covers are not written. bf16: y rounded to bf16 as stored."""
    n, k = w.shape
    if w.fmt != FMT_FP4 or xb.shape[1] != k or k % CHUNK:
        raise ValueError(f"fp4_experts_linear: FP4 weights [N, K], K a multiple of {CHUNK} (x has {xb.shape[1]})")
    nseg = segs.size // 5
    if nseg == 0 or xb.shape[0] == 0:
        return
    _fd_launch(FMT_FP4, xb, segs, wptrs, sptrs, y, n, k, w.gk, bf16)


def _fd_launch(fmt: int, xb: cp.ndarray, segs: cp.ndarray, wptrs: cp.ndarray, sptrs: cp.ndarray, y: cp.ndarray,
               n: int, k: int, gk: int, bf16: bool) -> None:
    """fd_gemm<fmt>'s kernel over segs: grid (ceil(N / 128), segments), FD_SMEM[fmt] of shared memory, the
    tokens xb by TMA (their tensor map a parameter)."""
    smem = FD_SMEM[fmt]
    name = "gemm_fp4_experts_sm90" if fmt == FMT_FP4 else "gemm_fd_fp8_sm90"
    tma.launch(K.function_with_smem("fp4_experts", name, smem), (-(-n // FE_COLS), segs.size // 5, 1),
               (FE_THREADS, 1, 1), (tma.bf16_rows_map(xb, FD_BOX_ROWS), segs, wptrs, sptrs, y, np.int32(y.shape[1]),
                                    np.int32(n), np.int32(k), np.int32(gk), np.int32(bf16)), smem)


def fd_fp8_takes(w: GpuWeight) -> bool:
    """Whether gemm_fd_fp8 takes an FP8 weight on this device: K whole chunks, blocks of whole 32-wide
    K groups, power-of-two block scales (_pow2_scales) of at least 2^-124 (so that each code times its
    scale is a bf16 number, the smallest code 2^-9 included: bf16's least is 2^-133), sm_90a."""
    if w.fmt != FMT_FP8 or w.shape[1] % CHUNK or w.block[1] % 32 or K.device_arch() != "90a":
        return False
    return w.derived("_fd", lambda: _pow2_scales(w) and bool(cp.all((w.scale.view(cp.uint32) >> 23) >= 3)))


def _pow2_scales(w: GpuWeight) -> bool:
    """Whether an FP8 weight's f32 block scales are all positive powers of two, normal (each code times
    its scale exactly a bf16 number); checked once per weight, kept on it."""
    def make() -> bool:
        bits = w.scale.view(cp.uint32)
        return bool(cp.all(((bits & 0x807FFFFF) == 0) & (bits != 0)))

    return w.derived("_pow2", make)


def fd_scale_bytes(w: GpuWeight) -> cp.ndarray:
    """An FP8 weight's power-of-two f32 block scales as UE8M0 bytes per row and 32 of K [N, K / 32]
    (their exponent fields): gemm_fd_fp8's scale layout, FP4's. Made once per weight, kept on it."""
    def make() -> cp.ndarray:
        n, k = w.shape
        bn, bk = w.block
        e8 = ((w.scale.view(cp.uint32) >> 23) & 0xFF).astype(cp.uint8)  # [ceil(n / bn), gk]
        cols = cp.arange(k // 32) * 32 // bk
        return cp.ascontiguousarray(cp.repeat(e8[:, cols], bn, axis=0)[:n])

    return w.derived("_fd_e8", make)


def fd_fp8_tables(w: GpuWeight) -> tuple[cp.ndarray, cp.ndarray]:
    """gemm_fd_fp8's pointer tables [1] uint64 of an FP8 weight: its data's (ptr_tables) and
    fd_scale_bytes(w)'s; made once per weight, kept on it (the first call runs eagerly, before any
    graph capture)."""
    return w.derived("_fd_tabs", lambda: (w.ptr_tables()[0],
                                          cp.asarray(np.array([fd_scale_bytes(w).data.ptr], np.uint64))))


def fd_fp8_segments(rows: int) -> list[tuple[int, int, int, int, int]]:
    """gemm_fd_fp8's segments (0, row0, rows, 0, 0) of a dense linear: one per FE_ROWS rows."""
    return [(0, r, min(FE_ROWS, rows - r), 0, 0) for r in range(0, rows, FE_ROWS)]


def fd_fp8_linear(xb: cp.ndarray, segs: cp.ndarray, w: GpuWeight, bf16: bool = False) -> cp.ndarray:
    """y [M, N] = xb (act_quant_bf16w's rows [M, K]) times the FP8 weight w [N, K] (fd_fp8_takes) on
    gemm_fd_fp8_sm90: the products exact in bf16, summed in f32. segs: fd_fp8_segments(M) on the
    device. bf16: y rounded to bf16 as stored."""
    n, k = w.shape
    m = xb.shape[0]
    if not fd_fp8_takes(w) or xb.shape[1] != k:
        raise ValueError(f"fd_fp8_linear: FP8 weights [N, K] with power-of-two scales, K a multiple of {CHUNK}")
    y = cp.empty((m, n), cp.float32)
    if m:
        _fd_launch(FMT_FP8, xb, segs, *fd_fp8_tables(w), y, n, k, k // 32, bf16)
    return y


def bf16_rows(x: cp.ndarray) -> cp.ndarray:
    """x [M, K] f32 -> x rounded to bf16 (ties to even) as bits uint16 [M, K], each 64 of K in the
    kernels' order (gemm_fp8w_bf16's X)."""
    return _bf16_chunk_rows("bf16_weights", "bf16_rows", x)


def _bf16_chunk_rows(mod: str, kernel: str, x: cp.ndarray, *extra) -> cp.ndarray:
    """x [M, K] f32 through `kernel` of kernels/<mod>.cu (a thread per 4 elements) into bf16 bits
    uint16 [M, K] in the K order of the GEMM that reads them."""
    x = _c32(x)
    m, k = x.shape
    if k % CHUNK:
        raise ValueError(f"{kernel}: K = {k} is not a multiple of {CHUNK}")
    out = cp.empty((m, k), cp.uint16)
    quads = m * (k // 4)
    if quads:
        K.function(mod, kernel)((-(-quads // 256),), (256,), (
            x, np.int32(x.strides[0] // 4), out, np.int32(m), np.int32(k), *extra))
    return out


def fp8w_takes(w: GpuWeight, groups: int = 1) -> bool:
    """Whether gemm_fp8w_bf16 takes an FP8 weight of `groups` row groups on this device: K whole
    chunks, block rows of whole 16-row pairs, each group whole block rows, and power-of-two block
    scales (exactly bf16 with their codes; checked once per weight, kept on it)."""
    if w.fmt != FMT_FP8 or w.shape[1] % CHUNK or w.block[0] % 16 or (w.shape[0] // groups) % w.block[0]:
        return False
    return w.derived("_fp8w", lambda: K.device_arch() == "90a" and _pow2_scales(w))


def bw_splits(blocks: int, chunks: int) -> int:
    """K splits for a launch of `blocks` blocks over `chunks` 64-wide chunks of K (SPLIT_MIN_CHUNKS)."""
    return k_splits(blocks, chunks, SPLIT_MIN_CHUNKS)


def sum_splits(part: cp.ndarray, y: cp.ndarray, bf16: bool) -> None:
    """y = the split-K sums part [splits, *y.shape] added in split order (kernels/bf16_weights.cu
    bw_sum_splits), rounded to bf16 with bf16."""
    K.function("bf16_weights", "bw_sum_splits")((-(-y.size // 256),), (256,), (
        part, np.int64(y.size), np.int32(part.shape[0]), y, np.int64(y.size), np.int32(bf16)))


def split_k_launch(fn, grid: tuple[int, int], threads: int, args: tuple, y: cp.ndarray, bf16: bool, splits: int,
                   smem: int) -> None:
    """One launch of a kernel whose arguments end in (bf, part, pstride) after `args` (which write y):
    grid z = splits. One split writes y itself (rounded to bf16 with bf16); more sum their shares of
    K into a buffer laid out as [splits, *y.shape], which sum_splits adds up in order."""
    if splits == 1:
        fn((*grid, 1), (threads,), (*args, np.int32(bf16), y, np.int64(0)), shared_mem=smem)
        return
    part = cp.empty((splits, *y.shape), cp.float32)
    fn((*grid, splits), (threads,), (*args, np.int32(0), part, np.int64(y.size)), shared_mem=smem)
    sum_splits(part, y, bf16)


def _bw_launch(name: str, args_before_y: tuple, y: cp.ndarray, args_after_y: tuple, blocks_x: int, nseg: int,
               k: int, bf16: bool) -> None:
    """A gemm_fp8w_bf16 / gemm_bf16w launch writing y [M, ldy] (rounded to bf16 with bf16), split
    over K where the launch is short of blocks (bw_splits)."""
    split_k_launch(K.function_with_smem("bf16_weights", name, FE_SMEM), (blocks_x, nseg), FE_THREADS,
                   (*args_before_y, y, *args_after_y), y, bf16, bw_splits(blocks_x * nseg, k // CHUNK), FE_SMEM)


def fp8w_bf16_segments(rows: int, groups: int, n: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """gemm_fp8w_bf16's segments (g, row0, rows, x column, y column) for `rows` rows of a linear of
    `groups` row groups of [n, k] each."""
    return [(g, r, min(FE_ROWS, rows - r), g * k, g * n) for g in range(groups) for r in range(0, rows, FE_ROWS)]


def fp8w_bf16_linear(x: cp.ndarray, segs: cp.ndarray, wptrs: cp.ndarray, sptrs: cp.ndarray, w: GpuWeight,
                     groups: int = 1, bf16: bool = False) -> cp.ndarray:
    """x [M, groups * K] f32 times the block-diagonal FP8 weight w [groups * N, K] (fp8w_takes) with x
    rounded to bf16: y [M, groups * N] f32, group g's columns from x's columns g * K .. on weight rows
    g * N ..; segs (fp8w_bf16_segments) and the groups' data / scale pointers [groups] uint64 on the
    device; bf16: y rounded to bf16 as stored."""
    gn, k = w.shape
    n, m = gn // groups, x.shape[0]
    y = cp.empty((m, gn), cp.float32)
    if m == 0:
        return y
    bn, bk = w.block
    _bw_launch("gemm_fp8w_bf16_sm90", (bf16_rows(x), np.int32(groups * k), segs, wptrs, sptrs), y,
               (np.int32(gn), np.int32(n), np.int32(k), np.int32(bn), np.int32(bk), np.int32(w.gk)),
               -(-n // FE_COLS), segs.size // 5, k, bf16)
    return y


def bf16w_takes(w: GpuWeight) -> bool:
    """Whether gemm_bf16w takes a bf16-stored weight on this device: K whole chunks, sm_90a."""
    return w.fmt == FMT_BF16 and w.shape[1] % CHUNK == 0 and K.device_arch() == "90a"


def bf16w_linear(x: cp.ndarray, segs: cp.ndarray, wptrs: cp.ndarray, w: GpuWeight, groups: int = 1,
                 bf16: bool = False) -> cp.ndarray:
    """x [M, groups * K] f32 rounded to bf16 times the bf16 weight w [groups * N, K] (bf16w_takes): y
    [M, groups * N] f32 (the products exact, f32 sums), group g's columns from x's columns g * K ..
    on weight rows g * N ..; segs (fp8w_bf16_segments) and the groups' data pointers [groups] uint64
    on the device; bf16: y rounded to bf16 as stored."""
    gn, k = w.shape
    n, m = gn // groups, x.shape[0]
    y = cp.empty((m, gn), cp.float32)
    if m == 0:
        return y
    _bw_launch("gemm_bf16w_sm90", (bf16_rows(x), np.int32(groups * k), segs, wptrs), y,
               (np.int32(gn), np.int32(n), np.int32(k)), -(-n // FE_COLS), segs.size // 5, k, bf16)
    return y
