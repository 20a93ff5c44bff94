#!/usr/bin/env python3
"""Compile every kernels/*.cu for sm_90a, sm_100a and sm_103a with NVRTC; no GPU needed.

Uses cuda.bindings.nvrtc directly (CuPy's compiler asks the driver first). Exits non-zero on
any compile error. Pip packages: cuda-bindings, cuda-pathfinder, nvidia-cuda-nvrtc==13.*,
nvidia-cuda-runtime==13.*, nvidia-cuda-cccl==13.*.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.ops import kernels  # noqa: E402


def _include_dirs() -> list[str]:
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return []
    dirs = []
    for lib in ("cudart", "cccl"):
        try:
            d = find_nvidia_header_directory(lib)
        except Exception:  # noqa: BLE001 - a missing optional header set is not fatal
            d = None
        if d:
            dirs.append(str(d))
    return dirs


@contextlib.contextmanager
def _program(name: str, options: tuple[str, ...], extra: tuple[str, ...]):
    """kernels/<name>.cu compiled by NVRTC with `options` (its target among them: -arch=sm_X for a
    cubin, -arch=compute_X for PTX) and `extra`; yields (program, compiled?, log), destroyed after."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(kernels.source(name).encode(), f"{name}.cu".encode(), 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcCreateProgram: {err}")
    opts = [*options, "-ftz=true", *extra] + [f"-I{d}" for d in _include_dirs()]
    try:
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # a fresh mutable buffer: NVRTC writes into it, and `b" " * 1` would be CPython's shared
        # one-byte bytes object (writing a NUL into it corrupts every b" " in the process)
        buf = bytearray(max(size, 1))
        nvrtc.nvrtcGetProgramLog(prog, buf)
        yield prog, res == nvrtc.nvrtcResult.NVRTC_SUCCESS, bytes(buf).decode(errors="replace").strip("\x00 \n")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_one(name: str, arch: str, extra: tuple[str, ...] = ()) -> tuple[bool, str, int]:
    """Compile kernels/<name>.cu for sm_<arch>. Returns (ok, log, cubin bytes)."""
    from cuda.bindings import nvrtc

    try:
        with _program(name, kernels.options(arch), extra) as (prog, ok, log):
            return (True, log, nvrtc.nvrtcGetCUBINSize(prog)[1]) if ok else (False, log, 0)
    except RuntimeError as e:
        return False, str(e), 0


def cubin(name: str, arch: str, extra: tuple[str, ...] = ()) -> bytes:
    """The cubin of kernels/<name>.cu for sm_<arch>, as the runtime builds it (to read its SASS)."""
    from cuda.bindings import nvrtc

    with _program(name, kernels.options(arch), extra) as (prog, ok, log):
        if not ok:
            raise RuntimeError(f"{name}.cu did not compile for sm_{arch}:\n{log}")
        buf = bytearray(nvrtc.nvrtcGetCUBINSize(prog)[1])
        nvrtc.nvrtcGetCUBIN(prog, buf)
        return bytes(buf)


def ptx(name: str, arch: str, extra: tuple[str, ...] = ()) -> str:
    """PTX of kernels/<name>.cu for compute_<arch> (to check what a kernel was compiled to)."""
    from cuda.bindings import nvrtc

    with _program(name, (*kernels.BASE_OPTIONS, f"-arch=compute_{arch}"), extra) as (prog, ok, log):
        if not ok:
            raise RuntimeError(f"{name}.cu did not compile for compute_{arch}:\n{log}")
        buf = bytearray(nvrtc.nvrtcGetPTXSize(prog)[1])
        nvrtc.nvrtcGetPTX(prog, buf)
        return bytes(buf).decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="target(s), default: 90a 100a 103a")
    ap.add_argument("-v", "--verbose", action="store_true", help="print compiler warnings too")
    a = ap.parse_args(argv)
    archs = a.arch or list(kernels.TARGET_ARCHS)
    failures = 0
    for path in kernels.kernel_files():
        for arch in archs:
            ok, log, size = compile_one(path.stem, arch)
            status = f"ok ({size} B cubin)" if ok else "FAILED"
            print(f"{path.name:24s} sm_{arch:5s} {status}")
            if log and (not ok or a.verbose):
                print(log)
            failures += not ok
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
