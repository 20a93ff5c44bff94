"""The e4m3 tensor-core GEMV (kernels/gemv_q8.cu tcgemv8_*: 2 to 32 rows of x under --numerics
deepseek, FP8 and FP4 weights) against the product of the same operands in float64. Skipped where
CuPy or a GPU is absent (CI).

Tolerance. x is rounded to bf16 and put on the e4m3 grid per 32 (the reference's act_quant), the
weights are their stored values: the kernel's MMA products are exact (e4m3 and e2m1 values are f16
values), each 32-k group's sum is kept by f16 MMAs with float32 accumulation, the total is float32,
and the output is rounded to bf16 (2^-9 relative). So every element lies within a bf16 step of the
exact product of the quantized operands, measured against the row's largest output (cancellation
makes some outputs small): MAX_TOL. A lane that multiplies the wrong k, row or scale lands O(1) away.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gpu_cases import RNG, cp, make_weight, rnd

from engine.checkpoint.formats import round_bf16
from engine.model.numerics import BF16, F32, QUANT
from engine.ops.gpu import linear as gpu_linear
from engine.ops.gpu.deepseek import DeepseekCupyOps
from engine.ops.gpu.linear import XQ_BF16, XQ_FP8
from engine.ops.numpy_ops import dequantize

GPU = DeepseekCupyOps()
MAX_TOL = 2.0**-8


def _check(fmt: str, m: int, n: int, k: int, block=(128, 128)) -> None:
    w = replace(make_weight(fmt, n, k, block=block if fmt == "fp8" else (32, 32)), use=QUANT)
    x = rnd(m, k) * np.exp(RNG.uniform(-4, 4, (m, 1))).astype(np.float32)
    x[:, RNG.integers(0, k, size=3)] *= 50  # outliers: blocks of 32 with their own scales
    gw = GPU.prepare(w)
    xq = cp.asnumpy(GPU._linear_input(cp.asarray(x), XQ_FP8)).astype(np.float64)
    want = xq @ dequantize(w).astype(np.float64).T
    got = cp.asnumpy(GPU.linear(cp.asarray(x), gw))
    np.testing.assert_array_equal(got, round_bf16(got))  # bf16 out, as the reference's linear()
    err = np.abs(got - want).max(axis=1) / np.maximum(np.abs(want).max(axis=1), 1e-30)
    assert err.max() < MAX_TOL, err


def _spy(monkeypatch, name: str) -> list:
    """Counts the launches of LinearOps.<name> (and makes sure a case runs it)."""
    calls = []
    run = getattr(gpu_linear.LinearOps, name)

    def counted(self, *a, **kw):
        calls.append(a[7].fmt)
        return run(self, *a, **kw)

    monkeypatch.setattr(gpu_linear.LinearOps, name, counted)
    return calls


@pytest.fixture
def spy(monkeypatch):
    """The e4m3 GEMV's launches."""
    return _spy(monkeypatch, "_run_tc8")


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("m", [2, 6, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("n,k", [(320, 1024), (4100, 4096), (72, 4128)])
def test_tcgemv8_matches_the_quantized_product(spy, fmt, m, n, k):
    """Row counts of each tile count (NT 1, 2, 4, partial tiles), N off the 16-row tiles, K off the
    128 / 256-element stages; the K split of the small launches (kw > 1) and the large ones."""
    _check(fmt, m, n, k)
    assert spy, "the e4m3 GEMV did not run"


@pytest.mark.parametrize("block", [(128, 128), (64, 32), (8, 64), (8, 256)])
def test_tcgemv8_fp8_scale_blocks(spy, block):
    """FP8 scale blocks: several per stage (bk 32, 64), one per two stages (bk 256), and rows of one
    tile in different blocks (bn 8: the scales read per row, not through the ring)."""
    _check("fp8", 7, 200, 1024, block)
    assert spy


def test_tcgemv8_fp4_scales_off_the_ring(spy):
    """FP4 rows whose group count is no multiple of 8 (K = 288: 9 groups): the UE8M0 bytes read per
    row from global memory."""
    _check("fp4", 5, 96, 288)
    assert spy


def test_tcgemv8_experts_segments():
    """A verify step's experts: FP4 experts of several rows each, the segment table built on the
    device, against the numpy backend's DeepseekOps (the MoE chain's tolerance)."""
    from engine.ops.deepseek_ops import DeepseekOps

    ref = DeepseekOps()
    e, kk, d, inter = 32, 6, 1024, 512
    ws = [tuple(replace(make_weight("fp4", *s), use=QUANT) for s in ((inter, d), (d, inter), (inter, d)))
          for _ in range(e)]
    t = 6
    x = rnd(t, d)
    ids = np.stack([RNG.permutation(e)[:kk] for _ in range(t)])
    wts = (RNG.random((t, kk), dtype=np.float32) * 2.5).astype(np.float32)
    want = ref.moe(x, [tuple(ref.prepare(w) for w in ex) for ex in ws], wts, ids, 10.0)
    got = GPU.moe(cp.asarray(x), [tuple(GPU.prepare(w) for w in ex) for ex in ws], cp.asarray(wts),
                  cp.asarray(ids), 10.0)
    g = cp.asnumpy(got).astype(np.float64)
    assert np.linalg.norm(g - want) / np.linalg.norm(want) < 1e-2


@pytest.fixture
def spy_bf(monkeypatch):
    """The bf16 tensor-core GEMV's launches."""
    return _spy(monkeypatch, "_run_tcbf")


@pytest.mark.parametrize("use", [BF16, F32])
@pytest.mark.parametrize("m", [2, 6, 9, 17, 32])
@pytest.mark.parametrize("n,k", [(320, 1024), (4100, 512), (72, 4128)])
def test_tcgemv8_bf16_matches_the_product(spy_bf, use, m, n, k):
    """bf16 weights under deepseek numerics (tcgemv8_bf16_*): bf16 x times the stored weight, float32
    sums (the products are exact: 8-bit significands), so within a bf16 step of the float64 product
    where the output is stored as bf16 (BF16 use), and within float32 summation error otherwise (F32
    use: the head). N off the tiles, K off the 64-element stages (4128: half a stage)."""
    _check_bf16(use, m, n, k)
    assert spy_bf, "the bf16 tensor-core GEMV did not run"


def test_tcgemv8_bf16_k_off_the_mma(spy_bf):
    """K = 4104: the last MMA's second 8 k past the row (zeros from the ring and from x's padding);
    up to 8 rows (above them linear() wants K in whole 32-element steps)."""
    _check_bf16(BF16, 6, 72, 4104)
    assert spy_bf


def _check_bf16(use: str, m: int, n: int, k: int) -> None:
    w = replace(make_weight("bf16", n, k), use=use)
    x = rnd(m, k) * np.exp(RNG.uniform(-4, 4, (m, 1))).astype(np.float32)
    gw = GPU.prepare(w)
    xb = cp.asnumpy(GPU._linear_input(cp.asarray(x), XQ_BF16)).astype(np.float64)
    want = xb @ dequantize(w).astype(np.float64).T
    got = cp.asnumpy(GPU.linear(cp.asarray(x), gw))
    err = np.abs(got - want).max(axis=1) / np.maximum(np.abs(want).max(axis=1), 1e-30)
    if use == BF16:
        np.testing.assert_array_equal(got, round_bf16(got))
        assert err.max() < MAX_TOL, err
    else:
        assert err.max() < 1e-5, err


def test_tcgemv8_bf16_segments_columns(spy_bf):
    """Two segments reading different 16-aligned column ranges of x into different output columns
    (a stacked linear's table), against the same product per segment."""
    n, k = 96, 256
    w = replace(make_weight("bf16", n, k), use=BF16)
    gw = GPU.prepare(w)
    x = rnd(5, 2 * k)
    y = cp.zeros((5, 2 * n), cp.float32)
    wp, sp = gw.ptr_tables()
    GPU._run_linear(cp.asarray(x), y, n, k, [(0, 0, 5, 0, 0), (0, 0, 5, k, n)], wp, sp, gw, 5, xq=XQ_BF16)
    xb = cp.asnumpy(GPU._linear_input(cp.asarray(x), XQ_BF16)).astype(np.float64)
    wd = dequantize(w).astype(np.float64)
    want = np.concatenate([xb[:, :k] @ wd.T, xb[:, k:] @ wd.T], axis=1)
    got = cp.asnumpy(y)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    assert spy_bf, "the bf16 tensor-core GEMV did not run"
