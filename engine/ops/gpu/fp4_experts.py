"""The routed experts' FP4 linears of a prompt chunk in DeepSeek's numerics on sm_90a
(kernels/fp4_experts.cu): bf16 wgmma with the e2m1 weights decoded exactly in registers, the pairs'
act_quant values as bf16 in the kernel's K order. The same products as an e4m3 MMA with its per-32
promotion, summed in f32 without one (the kernel's header says why that is faster on Hopper)."""

from __future__ import annotations

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.ops.gpu.common import _c32
from engine.ops.gpu.weights import GpuWeight
from engine.ops.kernels import FMT_FP4

FE_ROWS = 256  # token rows per block (the wgmma N at most): a MoE segment's rows on this path
FE_COLS, FE_THREADS, FE_STAGES = 128, 384, 6  # kernels/fp4_experts.cu BW_BM, BW_THREADS, BW_STAGES
FE_SMEM = FE_STAGES * (FE_ROWS * 128 + 16) + 1024  # token tiles of 64 bf16 a row, 2 mbarriers each, alignment
CHUNK = 64  # K step of the kernel and of act_quant_bf16w's order


def act_quant_bf16w(x: cp.ndarray, bf16: bool = False) -> cp.ndarray:
    """x [M, K] f32 -> the reference's act_quant values (e4m3 code * UE8M0 scale per 32; x rounded
    to bf16 first if bf16) as bf16 bits uint16 [M, K], each 64 of K in gemm_fp4_experts' order."""
    x = _c32(x)
    m, k = x.shape
    if k % CHUNK:
        raise ValueError(f"act_quant_bf16w: K = {k} is not a multiple of {CHUNK}")
    out = cp.empty((m, k), cp.uint16)
    quads = m * (k // 4)
    if quads:
        K.function("fp4_experts", "act_quant_bf16w")((-(-quads // 256),), (256,), (
            x, np.int32(x.strides[0] // 4), out, np.int32(m), np.int32(k), np.int32(bf16)))
    return out


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
    fn = K.function_with_smem("fp4_experts", "gemm_fp4_experts_sm90", FE_SMEM)
    fn((-(-n // FE_COLS), nseg), (FE_THREADS,), (
        xb, segs, wptrs, sptrs, y, np.int32(y.shape[1]), np.int32(n), np.int32(k), np.int32(w.gk),
        np.int32(bf16)), shared_mem=FE_SMEM)
