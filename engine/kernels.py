"""CUDA kernel sources (kernels/*.cu) and their runtime loading through CuPy RawModule.

Sources are plain CUDA C++ with no CUDA headers. `source()` inlines our own `#include "x.cuh"`
lines, so NVRTC needs no include path and CuPy's on-disk cache (keyed by the source text) sees
header edits. `tools/check_kernels.py` compiles the same text for every target without a GPU.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
# Architectures we build for: Hopper, Blackwell B200/GB200, B300/GB300 ('a' = arch-specific).
TARGET_ARCHS = ("90a", "100a", "103a")
BASE_OPTIONS = ("-std=c++17",)
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

FMT_F32, FMT_BF16, FMT_FP8, FMT_FP4 = 0, 1, 2, 3  # mirror kernels/dsuf_common.cuh


def kernel_files() -> list[Path]:
    """Every kernel translation unit (headers are .cuh and not compiled alone)."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def source(name: str) -> str:
    """Text of kernels/<name>.cu with local includes inlined (each header once)."""
    seen: set[str] = set()

    def expand(path: Path) -> str:
        text = path.read_text()

        def repl(m: re.Match[str]) -> str:
            inc = m.group(1)
            if inc in seen:
                return ""
            seen.add(inc)
            return expand(KERNEL_DIR / inc)

        return _INCLUDE_RE.sub(repl, text)

    return expand(KERNEL_DIR / f"{name}.cu")


def options(arch: str) -> tuple[str, ...]:
    """NVRTC options for one target, e.g. arch '90a'."""
    return (*BASE_OPTIONS, f"-arch=sm_{arch}")


def device_arch() -> str:
    """Target of the current device ('90a' on H100/H200); DSUF_SM overrides (90a, 100a, 103a)."""
    env = os.environ.get("DSUF_SM")
    if env:
        return env.removeprefix("sm_")
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


@functools.cache
def function_with_smem(mod: str, name: str, smem_bytes: int):
    """function(), allowed smem_bytes of dynamic shared memory (above the default 48 KB a kernel
    must opt in; done once per kernel and size)."""
    fn = function(mod, name)
    fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn
