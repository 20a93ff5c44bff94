"""TMA tensor maps for the kernels that load tiles with cp.async.bulk.tensor, and their launch.

A tensor map (CUtensorMap, 128 opaque bytes) is encoded on the host by the CUDA driver's
cuTensorMapEncodeTiled and reaches the kernel as a __grid_constant__ parameter, so a captured
CUDA graph keeps it with its launch. CuPy wraps neither: the encoder is called through ctypes on
the driver library CuPy itself runs on, and such kernels are launched with the driver's
cuLaunchKernel (CuPy's launcher takes scalars of at most 32 bytes), on CuPy's current stream.
"""

from __future__ import annotations

import ctypes
import functools

import cupy as cp
import numpy as np
from cupy_backends.cuda.api import driver

_U16 = 1  # CU_TENSOR_MAP_DATA_TYPE_UINT16 (bf16 bits; the copy moves bytes)
_INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZERO = 0, 3, 3, 0


class TensorMap(ctypes.Structure):
    """A CUtensorMap's bytes (the kernel's TmaMap)."""

    _fields_ = [("words", ctypes.c_uint64 * 16)]


@functools.cache
def _encode_tiled():
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.POINTER(TensorMap), ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def bf16_rows_map(x: cp.ndarray, box_rows: int) -> TensorMap:
    """The tensor map of x [rows, cols] (16-bit elements, rows 16-byte aligned): boxes of 64
    elements (128 bytes) x box_rows rows, landing with the 128-byte swizzle (the wgmma operands'
    K-major layout); rows and columns past x's arrive as zeros."""
    rows, cols = x.shape
    if x.dtype.itemsize != 2 or x.strides[1] != 2 or x.strides[0] % 16 or x.data.ptr % 16 or not 1 <= box_rows <= 256:
        raise ValueError(f"bf16_rows_map: 16-bit rows 16-byte aligned, 1..256 rows a box (x {x.shape} {x.strides})")
    m = TensorMap()
    dims = (ctypes.c_uint64 * 2)(cols, max(rows, 1))
    strides = (ctypes.c_uint64 * 1)(x.strides[0])
    box = (ctypes.c_uint32 * 2)(64, box_rows)
    one = (ctypes.c_uint32 * 2)(1, 1)
    rc = _encode_tiled()(ctypes.byref(m), _U16, 2, ctypes.c_void_p(x.data.ptr), dims, strides, box, one,
                         _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZERO)
    if rc:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({rc}) for x {x.shape} {x.strides}")
    return m


def _c_arg(a):
    if isinstance(a, TensorMap):
        return a
    if isinstance(a, cp.ndarray):
        return ctypes.c_uint64(a.data.ptr)
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.int64):
        return ctypes.c_int64(int(a))
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a))
    raise TypeError(f"launch: an argument of type {type(a).__name__}")


def launch(fn, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple, shared_mem: int = 0) -> None:
    """fn (a CuPy RawKernel) over grid x block with args (TensorMap, CuPy arrays as pointers, NumPy
    int32 / int64 / uint64 scalars, in the kernel's order), on the current device and stream."""
    vals = [_c_arg(a) for a in args]
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    driver.launchKernel(fn.kernel.ptr, *grid, *block, shared_mem, cp.cuda.get_current_stream().ptr,
                        ctypes.addressof(ptrs), 0)
