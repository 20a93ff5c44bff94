"""Shared by the GPU op tests: the backends, random inputs, weights in the stored formats, the error
measure. Tolerances, as ||gpu - ref|| / ||ref||: F32_TOL for float32 paths (GEMV at <= 8 rows,
norms, attention; only summation order differs) and for the tensor-core GEMV / GEMM on FP8 / FP4
weights (exact f16 weights, activations as hi + lo f16 terms); GEMM_TOL for the bf16 GEMM on
weights exact in bf16 (activations split into three bf16 terms); BF16_TOL where it rounds the
weight to bf16; exact for the fake quantizers and routing ids."""

from __future__ import annotations

import numpy as np
from gpu_required import require_gpu

cp = require_gpu()

from engine.checkpoint import formats  # noqa: E402
from engine.checkpoint.reader import Weight  # noqa: E402
from engine.ops.gpu.ops import CupyOps  # noqa: E402
from engine.ops.numpy_ops import NumpyOps  # noqa: E402

F32_TOL, BF16_TOL = 2e-5, 1e-2
GEMM_TOL = 5e-5  # split-bf16 GEMM: f32-accurate products, another summation order
REF, GPU = NumpyOps(), CupyOps()
RNG = np.random.default_rng(1234)


def rnd(*shape, scale=1.0) -> np.ndarray:
    return (RNG.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


def rel(gpu, ref) -> float:
    g = cp.asnumpy(gpu).astype(np.float64) if isinstance(gpu, cp.ndarray) else np.asarray(gpu, np.float64)
    r = np.asarray(ref, np.float64)
    assert g.shape == r.shape, (g.shape, r.shape)
    assert np.isfinite(g).all(), "non-finite output"
    return float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))


def make_weight(fmt: str, n: int, k: int, block=(32, 32), scale_fmt="ue8m0") -> Weight:
    w = rnd(n, k, scale=0.05)
    if fmt == "bf16":
        return Weight("w", formats.f32_to_bf16(w), "bf16", shape=(n, k))
    if fmt == "f32":
        return Weight("w", w, "f32", shape=(n, k))
    if fmt == "fp8":
        q, s = formats.quant_fp8_blocks(w, block, scale_fmt)
        return Weight("w", q, "fp8", s, scale_fmt, block, (n, k))
    q, s = formats.quant_fp4_rows(w, 32)
    return Weight("w", q, "fp4", s, "ue8m0", (1, 32), (n, k))


def eager_and_replayed(fn, *host_inputs) -> tuple[np.ndarray, np.ndarray]:
    """fn on host_inputs copied to the GPU, on a stream of its own: once eagerly (kernels compiled,
    tables made), then captured into a CUDA graph with its memory from a pool of its own; the
    captured output is zeroed and the graph replayed. Returns (eager, replayed) on the host."""
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with stream:
        args = [cp.asarray(a) for a in host_inputs]
        eager = cp.asnumpy(fn(*args))
        with cp.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            y = fn(*args)
            graph = stream.end_capture()
        y.fill(0)
        graph.launch(stream)
        stream.synchronize()
        return eager, cp.asnumpy(y)
