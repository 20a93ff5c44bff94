"""kernels/fp8_grouped.cu (fp8_grouped_linear) against numpy: each segment's rows (w1 / w3: the
tokens' codes gathered into pair order by gather_codes; w2: the hidden rows), times its expert's
dequantized FP4 or FP8 weight, against the product of the fake-quantized rows within the FP8 MMA's
accumulation precision (fp8_mma.py); the outputs start as NaN, so a row or column no segment wrote
fails. Experts with no rows, one row, and more rows than a segment holds (cut into several); a
doubled table whose second half writes the y columns after the first (gate and up in one launch);
unused zero-row slots. Skipped where CuPy or a GPU is absent (CI).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from fp8_mma import assert_fp8_mma_close  # noqa: E402

from engine.checkpoint import formats  # noqa: E402
from engine.ops.gpu.fp8_linear import GROUPED_ROWS, act_quant_fp8, fp8_grouped_linear, gather_codes  # noqa: E402
from engine.ops.gpu.weights import GpuWeight, _host_dequant  # noqa: E402
from engine.ops.kernels import FMT_FP4, FMT_FP8  # noqa: E402
from engine.ops.numpy_ops import NumpyOps  # noqa: E402

COUNTS = [0, 1, 130, 37, 300, 0, 128, 5]  # rows per expert (pair order: expert by expert)


def _weight(fmt: str, n: int, k: int, seed: int) -> GpuWeight:
    rng = np.random.default_rng(seed)
    if fmt == "fp8":
        block = (128, 128)
        data = (rng.integers(0, 256, (n, k)) & 0xF7).astype(np.uint8)  # (no NaN codes)
        scale = (2.0 ** rng.uniform(-10, -5, (-(-n // block[0]), -(-k // block[1])))).astype(np.float32)
        return GpuWeight(FMT_FP8, cp.asarray(data), cp.asarray(scale), (n, k), block)
    data = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    scale = rng.integers(112 + seed % 8, 124 + seed % 8, (n, k // 32)).astype(np.uint8)
    return GpuWeight(FMT_FP4, cp.asarray(data), cp.asarray(scale), (n, k), (1, 32))


def _table(counts: list[int], step: int, halves: int, ycol: int, spare: int = 3) -> np.ndarray:
    """moe_group_large's table: each expert's run cut every `step` rows; a second half (experts E..,
    y column ycol) where halves == 2; `spare` zero-row slots after each half."""
    e_n, rows, starts = len(counts), [], np.r_[0, np.cumsum(counts)[:-1]]
    for e, (c, r0) in enumerate(zip(counts, starts, strict=True)):
        rows += [(e, int(r0) + r, min(step, c - r), 0, 0) for r in range(0, c, step)]
    rows += [(0, 0, 0, 0, 0)] * spare
    if halves == 2:
        rows += [(e + e_n if n else 0, r0, n, 0, ycol if n else 0) for e, r0, n, _, _ in rows]
    return np.asarray(rows, np.int32).reshape(-1)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("n,k", [(320, 1024), (200, 320), (130, 64)])
def test_grouped_gemm_gathered_rows(fmt, n, k):
    """w1 and w3 in one launch: rows gathered from 97 tokens (gather_codes: the codes and scales of
    each pair's token, bit for bit), two weights per expert."""
    rng = np.random.default_rng(n + k)
    e_n, t = len(COUNTS), 97
    p = sum(COUNTS)
    x = (rng.standard_normal((t, k)) * np.exp(rng.uniform(-6, 4, (t, 1)))).astype(np.float32)
    gather = rng.integers(0, t, p).astype(np.int32)
    ws = [_weight(fmt, n, k, seed=j) for j in range(2 * e_n)]
    wptrs = cp.asarray(np.array([w.data.data.ptr for w in ws], np.uint64))
    sptrs = cp.asarray(np.array([w.scale.data.ptr for w in ws], np.uint64))
    segs = cp.asarray(_table(COUNTS, GROUPED_ROWS, 2, n))
    y = cp.full((p, 2 * n), cp.nan, cp.float32)
    codes = act_quant_fp8(cp.asarray(x))
    pairs = gather_codes(codes, cp.asarray(gather))
    for got, want in zip(pairs, codes, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want)[gather])
    fp8_grouped_linear(pairs, segs, wptrs, sptrs, ws[0], y)
    xq = NumpyOps().fake_quant_fp8(x, 32).astype(np.float64)[gather]
    want, mag = np.empty((p, 2 * n)), np.empty((p, 2 * n))
    r0 = 0
    for e, c in enumerate(COUNTS):
        for h in range(2):
            wd = _host_dequant(ws[e + h * e_n]).astype(np.float64)
            want[r0:r0 + c, h * n:(h + 1) * n] = xq[r0:r0 + c] @ wd.T
            mag[r0:r0 + c, h * n:(h + 1) * n] = np.abs(xq[r0:r0 + c]) @ np.abs(wd).T
        r0 += c
    assert_fp8_mma_close(cp.asnumpy(y), want, mag)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_grouped_gemm_rows_in_place(fmt):
    """w2: the rows in pair order (no gather), one weight per expert; also with bf16 output."""
    rng = np.random.default_rng(3)
    n, k, p = 256, 512, sum(COUNTS)
    h = (rng.standard_normal((p, k)) * np.exp(rng.uniform(-4, 4, (p, 1)))).astype(np.float32)
    ws = [_weight(fmt, n, k, seed=j) for j in range(len(COUNTS))]
    wptrs = cp.asarray(np.array([w.data.data.ptr for w in ws], np.uint64))
    sptrs = cp.asarray(np.array([w.scale.data.ptr for w in ws], np.uint64))
    y = cp.full((p, n), cp.nan, cp.float32)
    fp8_grouped_linear(act_quant_fp8(cp.asarray(h)), cp.asarray(_table(COUNTS, GROUPED_ROWS, 1, 0)),
                       wptrs, sptrs, ws[0], y)
    hq = NumpyOps().fake_quant_fp8(h, 32).astype(np.float64)
    want, mag = np.empty((p, n)), np.empty((p, n))
    r0 = 0
    for e, c in enumerate(COUNTS):
        wd = _host_dequant(ws[e]).astype(np.float64)
        want[r0:r0 + c] = hq[r0:r0 + c] @ wd.T
        mag[r0:r0 + c] = np.abs(hq[r0:r0 + c]) @ np.abs(wd).T
        r0 += c
    assert_fp8_mma_close(cp.asnumpy(y), want, mag)
    yb = cp.full((p, n), cp.nan, cp.float32)  # bf16 out: the same sums, rounded as stored
    fp8_grouped_linear(act_quant_fp8(cp.asarray(h)), cp.asarray(_table(COUNTS, GROUPED_ROWS, 1, 0)),
                       wptrs, sptrs, ws[0], yb, bf16=True)
    np.testing.assert_array_equal(cp.asnumpy(yb), formats.round_bf16(cp.asnumpy(y)))
