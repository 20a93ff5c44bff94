"""A planted out-of-bounds write, through the backend's allocator: `make gpu-memcheck` runs it under
compute-sanitizer first and requires memcheck to report it, so a clean run of the suite afterwards
means memcheck could see our arrays' bounds (under CuPy's pool it cannot: an overrun lands inside
the pool's chunk). A developer's tool; exits 0 itself."""

from __future__ import annotations

import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.ops.gpu.ops import CupyOps  # noqa: E402

_WRITE_PAST = cp.RawKernel(
    r'extern "C" __global__ void write_past(float* a, int n) { a[n + threadIdx.x] = 1.0f; }',
    "write_past",
)


def main() -> None:
    CupyOps()  # (built as the engine builds it: Settings.from_env(), so DSUF_DIRECT_ALLOC=1 applies)
    n = 33  # 132 bytes: inside the 512-byte unit a pool would hand out
    a = cp.ones(n, cp.float32)
    _WRITE_PAST((1,), (1,), (a, cp.int32(n)))
    cp.cuda.Device().synchronize()
    print(f"wrote a[{n}] of a {n}-float array")


if __name__ == "__main__":
    main()
