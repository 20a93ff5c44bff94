"""add_argmax (kernels/sampling.cu): a greedy draft position's Markov bias added in place and each
row's argmax, against NumpyOps.add_argmax (numpy's argmax: the first on ties, NaN above every
number). The sums are one float32 add each, so x must come out bit-identical (NaN payloads aside;
no denormals, which the GPU's adds flush) and the indices equal.
Skipped where CuPy or a GPU is absent (CI)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from engine.ops.gpu import sampling as cupy_sampling  # noqa: E402
from engine.ops.numpy_ops import NumpyOps  # noqa: E402


def _both(logits: np.ndarray, bias: np.ndarray | None, i: int) -> None:
    """Position i of logits [rows, n, vocab] on both backends, out a strided column of [n, rows]."""
    rows, n, _ = logits.shape
    ref_x, ref_out = logits.copy(), np.full((n, rows), -1, np.int64)
    NumpyOps().add_argmax(ref_x[:, i], bias, ref_out[i])
    dev_x, dev_out = cp.asarray(logits), cp.full((rows, n), -1, cp.int64)
    counters = cp.zeros(cupy_sampling.ARGMAX_ROWS, cp.int32)
    got = cupy_sampling.add_argmax(dev_x[:, i], None if bias is None else cp.asarray(bias), dev_out[:, i], counters)
    assert got.data.ptr == dev_out[:, i].data.ptr
    got_x = cp.asnumpy(dev_x)
    nan = np.isnan(ref_x)
    np.testing.assert_array_equal(np.isnan(got_x), nan)  # (a NaN's payload may change in an add)
    np.testing.assert_array_equal(got_x[~nan].view(np.uint32), ref_x[~nan].view(np.uint32))
    np.testing.assert_array_equal(cp.asnumpy(dev_out)[:, i], ref_out[i])
    assert (cp.asnumpy(dev_out)[:, [j for j in range(n) if j != i]] == -1).all()  # (only column i written)
    assert not cp.asnumpy(counters).any()  # (left zeroed for the next launch)


@pytest.mark.parametrize("rows,vocab", [(1, 8192), (5, 8192), (3, 129280), (33, 5000), (2, 7), (4, 2049)])
def test_random_rows_equal_numpy(rows: int, vocab: int) -> None:
    rng = np.random.default_rng(rows * vocab)
    logits = rng.standard_normal((rows, 5, vocab)).astype(np.float32) * 4
    bias = rng.standard_normal((rows, vocab)).astype(np.float32)
    for i in (0, 3):
        _both(logits, bias, i)
    _both(logits, None, 4)


def test_ties_nan_and_signed_zero() -> None:
    """Ties across block slices take the first index; NaN wins (its first); -0 equals +0; a row of
    -inf gives 0."""
    vocab, rows = 3 * cupy_sampling.ARGMAX_SLICE + 5, 6
    x = np.full((rows, 1, vocab), -1.0, np.float32)
    x[0, 0, [2047, 2048, 5000]] = 7.0  # a tie across the first two blocks
    x[1, 0, [vocab - 1, 4096]] = 3.0  # the last block holds the later one
    x[2, 0, [10, 6000]] = np.nan
    x[2, 0, 20] = np.inf
    x[3, 0, :] = 0.0
    x[3, 0, :100] = -0.0
    x[4, 0, :] = -np.inf
    x[5, 0, 3000] = np.float32(1e-45)  # a denormal above -1, compared as it lies
    _both(x, None, 0)
    x[5, 0, 3000] = 0.5  # (an add flushes a denormal to 0: CuPy compiles kernels with -ftz=true)
    bias = np.zeros((rows, vocab), np.float32)
    bias[0, 5000] = 1.0  # the bias moves the max
    _both(x, bias, 0)


def test_replayed_in_a_graph() -> None:
    """Captured once and replayed on new inputs: the counters reset themselves."""
    rng = np.random.default_rng(3)
    rows, vocab = 4, 20000
    x, bias = cp.zeros((rows, vocab), cp.float32), cp.zeros((rows, vocab), cp.float32)
    out, counters = cp.zeros(rows, cp.int64), cp.zeros(cupy_sampling.ARGMAX_ROWS, cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cupy_sampling.add_argmax(x, bias, out, counters)  # (the module loaded before the capture)
        stream.begin_capture()
        cupy_sampling.add_argmax(x, bias, out, counters)
        graph = stream.end_capture()
    for _ in range(3):
        hx = rng.standard_normal((rows, vocab)).astype(np.float32)
        hb = rng.standard_normal((rows, vocab)).astype(np.float32)
        x[...] = cp.asarray(hx)
        bias[...] = cp.asarray(hb)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), np.argmax(hx + hb, axis=1))
