"""CUDA kernel sources (kernels/*.cu) and their runtime loading through CuPy RawModule.

Sources are plain CUDA C++ with no CUDA headers. `source()` inlines our own `#include "x.cuh"`
lines, so NVRTC needs no include path and CuPy's on-disk cache (keyed by the source text) sees
header edits. `tools/dev/check_kernels.py` compiles the same text for every target without a GPU.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
# Architectures we build for: Hopper, Blackwell B200/GB200, B300/GB300 ('a' = arch-specific).
TARGET_ARCHS = ("90a", "100a", "103a")
BASE_OPTIONS = ("-std=c++17",)
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

FMT_F32, FMT_BF16, FMT_FP8, FMT_FP4 = 0, 1, 2, 3  # mirror kernels/dsuf_common.cuh
# A prompt chunk's tensor-core attention (kernels/attention.cu attn_tc_*) runs this many queries at a
# time through an [n, heads, keys] float32 score buffer (engine/runtime/memory_plan.py counts it).
ATTEND_TC_QUERIES = 1024


def kernel_files() -> list[Path]:
    """Every kernel translation unit (headers are .cuh and not compiled alone)."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def source(name: str) -> str:
    """Text of kernels/<name>.cu with local includes inlined (each header once)."""
    return expand_includes((KERNEL_DIR / f"{name}.cu").read_text())


def expand_includes(text: str) -> str:
    """CUDA source text with its `#include "x.cuh"` of kernels/ inlined, each header once (also for
    the developer tools' inline kernels, which share our headers)."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def repl(m: re.Match[str]) -> str:
            inc = m.group(1)
            if inc in seen:
                return ""
            seen.add(inc)
            return expand((KERNEL_DIR / inc).read_text())

        return _INCLUDE_RE.sub(repl, text)

    return expand(text)


def options(arch: str) -> tuple[str, ...]:
    """NVRTC options for one target, e.g. arch '90a'."""
    return (*BASE_OPTIONS, f"-arch=sm_{arch}")


def device_arch() -> str:
    """Target of the current device ('90a' on H100/H200)."""
    import cupy

    cc = cupy.cuda.Device().compute_capability  # e.g. '90'
    return f"{cc}a" if cc in ("90", "100", "103") else cc


@functools.cache
def module(name: str):
    """Compiled RawModule of kernels/<name>.cu for this device (compiled once per process).
    RawModule appends its own -arch for the device; ours comes first and is the matching
    arch-specific ('a') variant, so either flag yields the same target."""
    import cupy

    return cupy.RawModule(code=source(name), options=options(device_arch()))


@functools.cache
def function(mod: str, name: str):
    return module(mod).get_function(name)


_SMEM_ALLOWED: dict = {}  # (module, kernel, device) -> the dynamic shared memory it may use now


def function_with_smem(mod: str, name: str, smem_bytes: int):
    """function(), allowed smem_bytes of dynamic shared memory (above the default 48 KB a kernel
    must opt in; per kernel and device: the attribute belongs to the module loaded on the current
    device, and tensor-parallel ranks launch on several). Only ever raised: a launch of a kernel
    with less after one with more must not lower the limit below what the larger one needs."""
    import cupy

    fn = function(mod, name)
    key = (mod, name, cupy.cuda.Device().id)
    if _SMEM_ALLOWED.get(key, 0) < smem_bytes:
        fn.max_dynamic_shared_size_bytes = smem_bytes  # (sets it on the current device's copy)
        _SMEM_ALLOWED[key] = smem_bytes
    return fn


# ---- programmatic dependent launch ------------------------------------------------------------
# While a stream is being captured into a CUDA graph, a kernel launched through launch(pdl=True)
# gets the programmatic-stream-serialization attribute: its blocks may start as soon as the
# previous kernel's blocks have all called dsuf_launch_dependents() (kernels/dsuf_common.cuh), so
# the part before its dsuf_grid_wait() (a GEMV's L2 prefetch of its weights) overlaps the
# previous kernel. Eager launches stay plain CuPy launches (building a launch config from Python
# per call would cost more than a small kernel).
def _passable(a) -> bool:
    """Whether launch() can pass a kernel argument: a CuPy array (its pointer) or a NumPy scalar."""
    return isinstance(a, np.generic) or hasattr(getattr(a, "data", None), "ptr")


def _ctypes_args(args) -> tuple[tuple, tuple]:
    import ctypes

    vals, types = [], []
    for a in args:
        if not _passable(a):
            raise TypeError(f"launch(): unsupported kernel argument {type(a).__name__}")
        if isinstance(a, np.generic):
            vals.append(a.item())
            types.append(np.ctypeslib.as_ctypes_type(a.dtype))
        else:  # a CuPy array: its device pointer
            vals.append(a.data.ptr)
            types.append(ctypes.c_void_p)
    return tuple(vals), tuple(types)


def launch(fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, pdl: bool = False) -> None:
    """Launch a RawKernel on the current stream; pdl=True: as a programmatic dependent launch when
    the stream is capturing (the kernel must call dsuf_grid_wait() before reading its inputs)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if not (pdl and _pdl_ok() and stream.is_capturing()):
        fn(grid, block, args, shared_mem=shared_mem)
        return
    from cuda.bindings import driver as cu

    grid, block = ((*_dims(grid), 1, 1))[:3], ((*_dims(block), 1, 1))[:3]
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = shared_mem
    cfg.hStream = cu.CUstream(stream.ptr)
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    err, = cu.cuLaunchKernelEx(cfg, cu.CUfunction(fn.kernel.ptr), _ctypes_args(args), 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx({fn.name}): {err}")


def _dims(d) -> tuple:
    """A launch dimension as CuPy takes it (an int or a tuple of up to three) -> a tuple."""
    return tuple(int(x) for x in d) if isinstance(d, (tuple, list)) else (int(d),)


@functools.cache
def _pdl_ok() -> bool:
    """PDL needs sm_90+."""
    m = re.match(r"\d+", device_arch())
    return m is not None and int(m.group()) >= 90
