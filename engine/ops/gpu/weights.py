"""Weights on the GPU in their stored formats (GpuWeight) and how a checkpoint's tensors become them.

Weights stay in their stored format on the device (fp8 bytes + block scales, packed fp4 + UE8M0
bytes, bf16 bits, or f32) and are dequantized inside the linear kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy as cp
import numpy as np

from engine.checkpoint import formats
from engine.ops.gpu.common import F32, _c32, _ptr
from engine.ops.kernels import FMT_BF16, FMT_F32, FMT_FP4, FMT_FP8
from engine.parallel.shard import stack_rows

_FMT_TAG = {FMT_F32: "f32", FMT_BF16: "bf16", FMT_FP8: "fp8", FMT_FP4: "fp4"}
_EPC = {FMT_F32: 4, FMT_BF16: 8, FMT_FP8: 16, FMT_FP4: 32}  # elements per 16-byte chunk
GEMV_MAX_ROWS = 8  # up to this many rows per segment: a GEMV, else a GEMM


@dataclass
class GpuWeight:
    """A [N, K] weight on the GPU in its stored format. `scale` is f32 [ceil(N/bn), gk] for fp8
    (UE8M0 scales are widened at load), UE8M0 bytes [N, K/32] for fp4, None otherwise."""

    fmt: int
    data: cp.ndarray
    scale: cp.ndarray | None
    shape: tuple[int, int]
    block: tuple[int, int] = (1, 1)
    # --numerics deepseek (DeepseekCupyOps): how the reference's linear() uses the weight
    # (engine/model/numerics.py QUANT / BF16 / F32; None: an untagged fp32 weight), and for rows
    # stacked from weights of different uses, the output columns [c0, c1) it returns in bf16
    use: str | None = None
    bf16_cols: tuple[tuple[int, int], ...] | None = None

    @property
    def gk(self) -> int:
        return int(self.scale.shape[1]) if self.scale is not None else 1

    def derived(self, key: str, make):
        """make(), made on the first call for this key and kept on the weight (not a field: copies
        and comparisons ignore it)."""
        hit = self.__dict__.get(key)
        if hit is None:
            hit = self.__dict__[key] = make()
        return hit

    def ptr_tables(self) -> tuple[cp.ndarray, cp.ndarray]:
        """Device [1] tables of the data / scale pointers, made once (a host->device copy per
        call would cost more than a decode GEMV)."""

        def make():
            ptrs = cp.asarray(np.array([_ptr(self.data), _ptr(self.scale)], np.uint64))
            return ptrs[:1], ptrs[1:]

        return self.derived("_ptrs", make)

    def row_bytes(self) -> int:
        n, k = self.shape
        return {FMT_F32: 4 * k, FMT_BF16: 2 * k, FMT_FP8: k, FMT_FP4: k // 2}[self.fmt]

    def kernel_ok(self, rows: int = 1) -> bool:
        """Our kernels read 16-byte chunks of a row: K must be a multiple of a chunk (of the
        32-wide K step for the GEMM, used above GEMV_MAX_ROWS rows)."""
        k = self.shape[1]
        if k % _EPC[self.fmt] or (rows > GEMV_MAX_ROWS and k % 32):
            return False
        return self.fmt != FMT_FP8 or self.block[1] % 16 == 0

    def dequant(self) -> cp.ndarray:
        """float32 copy (fallback paths and tests)."""
        return cp.asarray(_host_dequant(self))


def _host_dequant(w: GpuWeight) -> np.ndarray:
    data = cp.asnumpy(w.data)
    if w.fmt == FMT_F32:
        return data
    if w.fmt == FMT_BF16:
        return formats.bf16_to_f32(data)
    if w.fmt == FMT_FP8:
        return formats.dequant_fp8_blocks(data, cp.asnumpy(w.scale), w.block)
    return formats.dequant_fp4_experts(data, cp.asnumpy(w.scale), 32)


class WeightOps:
    """CupyOps' weight preparation (the checkpoint's tensors -> GpuWeight / device tables)."""

    def prepare_rows(self, ws: list) -> GpuWeight:
        """Weights of one input as one, stacked along their output rows (engine/parallel/shard.py stack_rows)."""
        return self.prepare(stack_rows(ws))

    def prepare_table(self, table, scale=None) -> cp.ndarray:
        """An Engram table, dequantized on the host and placed on the device (host-resident
        pinned tables, which the memory plan assumes, are still to come)."""
        from engine.ops.numpy_ops import dequantize_table

        return cp.asarray(np.ascontiguousarray(dequantize_table(table, scale), dtype=F32))

    def prepare(self, weight) -> GpuWeight:
        """Stored-format Weight (or plain array) -> GpuWeight, kept in its stored format."""
        if isinstance(weight, (np.ndarray, cp.ndarray)):
            a = _c32(weight)
            return GpuWeight(FMT_F32, a.reshape(a.shape[0], -1) if a.ndim != 2 else a, None,
                             (a.shape[0], int(np.prod(a.shape[1:]))))
        if weight.fmt == "f32":
            a = cp.asarray(np.ascontiguousarray(weight.data, dtype=F32))
            return GpuWeight(FMT_F32, a, None, tuple(a.shape))
        if weight.fmt == "bf16":
            a = cp.asarray(np.ascontiguousarray(np.asarray(weight.data).view(np.uint16)))
            return GpuWeight(FMT_BF16, a, None, tuple(a.shape))
        if weight.fmt == "fp8":
            data = cp.asarray(np.ascontiguousarray(np.asarray(weight.data).view(np.uint8)))
            n, k = data.shape
            if weight.scale is None:  # unscaled fp8 table: unit scales, one block
                block, scale = (n, k), np.ones((1, 1), F32)
            else:
                block = (int(weight.block[0]), int(weight.block[1]))
                s = np.asarray(weight.scale)
                scale = formats.e8m0_to_f32(s) if s.dtype == np.uint8 else s.astype(F32)
            return GpuWeight(FMT_FP8, data, cp.asarray(np.ascontiguousarray(scale, dtype=F32)), (n, k), block)
        if weight.fmt == "fp4":
            data = cp.asarray(np.ascontiguousarray(np.asarray(weight.data).view(np.uint8)))
            scale = np.ascontiguousarray(np.asarray(weight.scale).view(np.uint8))
            n = data.shape[0]
            return GpuWeight(FMT_FP4, data, cp.asarray(scale), (n, 2 * data.shape[1]), (1, 32))
        raise ValueError(f"{weight.name}: unknown weight format {weight.fmt!r}")
