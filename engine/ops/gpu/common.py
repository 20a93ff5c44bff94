"""Helpers shared by the GPU backend's op modules: array coercion, kernel arguments, launch sizes."""

from __future__ import annotations

import functools
import math

import cupy as cp
import numpy as np

from engine.ops import kernels as K
from engine.state.rows import Span

F32 = np.float32
_ELT_BLOCK = 256  # threads per block of the elementwise kernels
_NULL = np.uint64(0)  # a null pointer kernel argument


def _c32(x) -> cp.ndarray:
    return cp.ascontiguousarray(x, dtype=F32)


def round_bf16(x: cp.ndarray) -> cp.ndarray:
    """x rounded to bf16 (ties to even), as float32: a new array (kernels/elementwise.cu)."""
    x = _c32(x)
    y = cp.empty_like(x)
    if y.size:
        cols = x.shape[-1] if x.ndim else 1
        K.function("elementwise", "round_bf16_rows")(_grid(y.size), (_ELT_BLOCK,), (
            x, y, np.int64(y.size), np.int32(cols), np.int64(cols), np.int64(cols)))
    return y


def _grid(n: int, block: int = _ELT_BLOCK) -> tuple[int]:
    return (max(1, math.ceil(n / block)),)


def _ptr(a: cp.ndarray | None) -> int:
    return 0 if a is None else int(a.data.ptr)


def _span_ptr(sp: Span, width: int) -> int:
    """Device address of a Span's first row (its buffer: C-contiguous float32 rows of `width`)."""
    buf = sp.buf
    if buf.dtype != F32 or not buf.flags.c_contiguous or buf.ndim != 2 or buf.shape[1] != width \
            or sp.start + sp.n > buf.shape[0]:
        raise ValueError(f"a Span must cover C-contiguous float32 rows of width {width}")
    return int(buf.data.ptr) + sp.start * width * 4


def copy_table(table: list, upload, max_parts: int) -> None:
    """Byte copies (src, dst, bytes), all 16-byte aligned, in one copy_rows launch (kernels/elementwise.cu)
    over the table uploaded with upload(numpy array) -> device array; each copy split over at most
    max_parts blocks of 256 threads."""
    most = max(n for _, _, n in table) // 16
    tab = upload(np.asarray(table, np.int64).reshape(-1))
    if tab.dtype != np.int64 or tab.size != 3 * len(table):  # (the kernel reads 8-byte addresses from it)
        raise TypeError(f"copy_table: upload gave {tab.dtype} x {tab.size}, not int64 x {3 * len(table)}")
    K.function("elementwise", "copy_rows")((len(table), min(max_parts, -(-most // 256))), (_ELT_BLOCK,), (tab,))


@functools.cache
def _sm_count() -> int:
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


def k_splits(blocks: int, steps: int, min_steps: int) -> int:
    """How many parts to split K into for a launch of `blocks` blocks (one per multiprocessor at a
    time) over `steps` steps of K: doubled while the blocks still fit one wave and each part keeps
    at least min_steps steps (a skinny launch otherwise leaves multiprocessors idle while each block
    walks all of K)."""
    s = 1
    while blocks * s * 2 <= _sm_count() and steps >= 2 * s * min_steps:
        s *= 2
    return s


def _smem_function(mod: str, name: str, smem: int):
    """A kernel launched with smem bytes of dynamic shared memory (opted in above the default 48 KB)."""
    return K.function_with_smem(mod, name, smem) if smem > 48 << 10 else K.function(mod, name)
