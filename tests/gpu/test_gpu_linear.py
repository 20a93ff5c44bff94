"""CupyOps' linear kernels against the numpy reference: GEMV, tensor-core GEMV and GEMM, grouped
linear, embedding; tolerances in gpu_cases.py. Skipped where CuPy or a GPU is absent (CI)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_cases import BF16_TOL, F32_TOL, GEMM_TOL, GPU, REF, RNG, cp, eager_and_replayed, make_weight, rel, rnd

from engine.ops.gpu.ops import CupyOps

# ---- linear ----------------------------------------------------------------------------------
LINEAR_CASES = [
    ("fp8", 1280, 5120, (32, 32), "ue8m0"),   # wq_a
    ("fp8", 5120, 8192, (32, 32), "ue8m0"),   # wo_b
    ("fp8", 512, 4096, (128, 128), "fp32"),   # V4-style blocks with fp32 scales
    ("fp4", 2304, 5120, (1, 32), "ue8m0"),    # expert w1 / w3
    ("fp4", 5120, 2304, (1, 32), "ue8m0"),    # expert w2
    ("bf16", 4096, 5120, None, None),         # head-like
    ("f32", 24, 20480, None, None),           # hc fn
    ("bf16", 100, 72, None, None),            # ragged N, small K
    ("fp8", 100, 272, (32, 32), "ue8m0"),     # ragged N, a partial last K stage
    ("fp8", 200, 1024, (16, 64), "fp32"),     # row blocks inside a 16-row tile, 64-wide K blocks
    ("fp8", 96, 640, (8, 128), "fp32"),       # two row blocks per tile: scales read in place
    ("fp4", 100, 288, (1, 32), "ue8m0"),      # ragged N, scale rows not 8-byte aligned
]


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 17, 32, 77])
@pytest.mark.parametrize("fmt,n,k,block,sfmt", LINEAR_CASES)
def test_linear(fmt, n, k, block, sfmt, m):
    w = make_weight(fmt, n, k, block or (32, 32), sfmt or "ue8m0")
    x = rnd(m, k)
    ref = REF.linear(x, REF.prepare(w))
    got = GPU.linear(cp.asarray(x), GPU.prepare(w))
    exact_bf16 = fmt in ("bf16", "fp4") or (fmt == "fp8" and sfmt == "ue8m0")
    tensor_gemv = fmt in ("fp8", "fp4") and m <= 32
    tol = F32_TOL if m <= 8 or k % 32 or tensor_gemv else GEMM_TOL if exact_bf16 else BF16_TOL
    assert rel(got, ref) < tol


@pytest.mark.parametrize("m", [33, 77, 200])
@pytest.mark.parametrize("fmt,n,k,block,sfmt", [c for c in LINEAR_CASES if c[0] in ("fp8", "fp4") and c[2] % 32 == 0])
def test_gemm_tc(fmt, n, k, block, sfmt, m, monkeypatch):
    """Prompt-sized FP8 / FP4 products on the tensor-core GEMM (gemm_tc): x as two scaled f16 terms,
    so float32-grade like the tensor-core GEMV (F32_TOL, not the bf16 GEMM's), over 64-row segments
    and a ragged last one. (K not a multiple of 32 takes no GEMM kernel at these row counts:
    GpuWeight.kernel_ok.)"""
    from engine.ops.gpu import ops as cupy_ops

    splits = []
    split = cupy_ops.CupyOps._tc_split_x
    spy = staticmethod(lambda a, perm, xq=0: splits.append(a.shape) or split(a, perm, xq))
    monkeypatch.setattr(cupy_ops.CupyOps, "_tc_split_x", spy)
    w = make_weight(fmt, n, k, block, sfmt)
    x = rnd(m, k) * np.exp(RNG.uniform(-8, 8, (m, 1))).astype(np.float32)  # rows of unlike magnitude
    got = cp.asnumpy(GPU.linear(cp.asarray(x), GPU.prepare(w)))
    assert splits == [(m, k)]  # (every case here has scale blocks gemm_tc takes)
    ref = REF.linear(x, REF.prepare(w))
    assert max(rel(got[i], ref[i]) for i in range(m)) < F32_TOL  # row by row


def test_gemm_tc_grouped():
    """A block-diagonal projection (wo_a's form: segments at x columns g * in_g) on gemm_tc."""
    groups, nout, kin, t = 4, 256, 512, 100
    w = make_weight("fp8", groups * nout, kin, (32, 32), "ue8m0")
    x = rnd(t, groups, kin)
    got = GPU.grouped_linear(cp.asarray(x), GPU.prepare(w), groups)
    assert rel(got, REF.grouped_linear(x, REF.prepare(w), groups)) < F32_TOL


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_tensor_gemv_row_scales(fmt):
    """Each row of x is scaled by its own power of two before the f16 split: rows from 1e-30 to
    1e30 (and an all-zero row) keep float32-grade accuracy, row by row."""
    n, k = 384, 2048
    w = make_weight(fmt, n, k, (128, 128), "ue8m0")
    scales = np.array([1e-30, 1e-3, 1.0, 0.0, 7e4, 1e30], np.float32)
    x = rnd(len(scales), k) * scales[:, None]
    x[1, ::7] *= 1e-6  # tiny elements next to ordinary ones in the same row
    ref = REF.linear(x, REF.prepare(w)).astype(np.float64)
    got = cp.asnumpy(GPU.linear(cp.asarray(x), GPU.prepare(w))).astype(np.float64)
    assert np.isfinite(got).all()
    assert (got[3] == 0).all()
    for i in (0, 1, 2, 4, 5):
        assert np.linalg.norm(got[i] - ref[i]) / np.linalg.norm(ref[i]) < F32_TOL, i


GEMVR_CASES = [c for c in LINEAR_CASES if c[0] in ("fp8", "fp4")] + [
    ("fp8", 4096, 7168, (128, 128), "ue8m0"),  # V4-style wide K
    ("fp8", 36, 96, (32, 32), "ue8m0"),       # K short of one 128 unit, two partial tiles
    ("fp8", 64, 1040, (64, 64), "fp32"),      # K ends inside a unit's second granule
    ("fp4", 24, 128, (1, 32), "ue8m0"),       # one unit
]


@pytest.mark.parametrize("fmt,n,k,block,sfmt", GEMVR_CASES)
@pytest.mark.parametrize("scale", [1.0, 1e-30, 0.0, 1e30, "mixed"])
def test_register_tensor_gemv(fmt, n, k, block, sfmt, scale, monkeypatch):
    """gemvr (one row; x scaled from 1e-30 to 1e30, zero, or tiny elements among ordinary ones):
    float32-grade results, bit-identical when replayed in a captured graph (early weight loads, PDL)."""
    _check_gemvr(fmt, n, k, block, sfmt, scale, monkeypatch)


def _gemvr_everywhere(monkeypatch) -> None:
    """gemvr for every one-row launch it can read (the test shapes are below the rule's FP8 sizes)."""
    from engine.ops.gpu import linear

    monkeypatch.setattr(linear, "GEMVR_MIN_BYTES", 0)
    monkeypatch.setattr(linear, "GEMVR_MAX_K", 1 << 30)


def _check_gemvr(fmt, n, k, block, sfmt, scale, monkeypatch):
    _gemvr_everywhere(monkeypatch)
    calls = []
    run_reg = CupyOps._run_reg
    monkeypatch.setattr(CupyOps, "_run_reg", staticmethod(lambda *a, **kw: (calls.append(1), run_reg(*a, **kw))))
    w = make_weight(fmt, n, k, block, sfmt)
    x = rnd(1, k)
    if scale == "mixed":
        x[0, ::7] *= 1e-6
    else:
        x *= np.float32(scale)
    ref = REF.linear(x, REF.prepare(w)).astype(np.float64)
    gw = GPU.prepare(w)
    got = cp.asnumpy(GPU.linear(cp.asarray(x), gw)).astype(np.float64)
    gemvr = fmt == "fp4" and k % 128 == 0 or fmt == "fp8" and block[1] >= 32 and block[0] % 16 == 0
    assert bool(calls) == gemvr
    assert np.isfinite(got).all()
    if scale == 0.0:
        assert (got == 0).all()
    else:
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < F32_TOL
    _, replayed = eager_and_replayed(lambda xd: GPU.linear(xd, gw), x)
    assert np.array_equal(replayed, got.astype(np.float32))


@pytest.mark.parametrize("fmt,n,k", [("fp8", 200, 4096), ("fp4", 2304, 1024), ("fp8", 5120, 4608), ("fp4", 24, 128)])
@pytest.mark.parametrize("device_table", [False, True])
def test_register_gemv_segments(fmt, n, k, device_table, monkeypatch):
    """gemvr over a table of one-row segments (three weights, rows of x and y columns of their own,
    unused slots when the table is built on the device, as moe_group leaves them). Each launch
    equals the reference, and a second launch and a graph replay are bit-identical to the first."""
    _gemvr_everywhere(monkeypatch)
    src = [make_weight(fmt, n, k, (128, 128), "ue8m0") for _ in range(3)]
    ws, refs = [GPU.prepare(w) for w in src], [REF.prepare(w) for w in src]
    x = rnd(4, k)
    segs = [(2, 3, 1, 0, 0), (0, 1, 1, 0, n), (1, 1, 1, 0, 2 * n), (0, 0, 1, 0, 3 * n)]
    if device_table:  # unused slots (rows 0) between and after, as moe_group leaves them
        segs = [segs[0], (1, 0, 0, 0, 0), *segs[1:], (0, 0, 0, 0, 0)]
    wp = cp.asarray(np.array([w.data.data.ptr for w in ws], np.uint64))
    sp = cp.asarray(np.array([w.scale.data.ptr for w in ws], np.uint64))
    xd = cp.asarray(x)
    seg_arg = cp.asarray(np.asarray(segs, np.int32).reshape(-1)) if device_table else segs
    calls = []
    run_reg = CupyOps._run_reg
    monkeypatch.setattr(CupyOps, "_run_reg", staticmethod(lambda *a, **kw: (calls.append(1), run_reg(*a, **kw))))

    def run() -> cp.ndarray:
        y = cp.full((4, 4 * n), np.nan, dtype=cp.float32)
        GPU._run_linear(xd, y, n, k, seg_arg, wp, sp, ws[0], 1)
        return y

    got = cp.asnumpy(run())
    again = cp.asnumpy(run())
    assert calls
    for wi, row, rows, _, col in segs:
        if rows:
            want = REF.linear(x[row:row + 1], refs[wi])
            assert rel(got[row:row + 1, col:col + n], want) < F32_TOL
    assert np.array_equal(got, again, equal_nan=True)
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with stream, cp.cuda.using_allocator(pool.malloc):
        stream.begin_capture()
        y = run()
        graph = stream.end_capture()
        for _ in range(2):
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(cp.asnumpy(y), got, equal_nan=True)


@pytest.mark.parametrize("t", [1, 5, 20, 40])
def test_grouped_linear(t):
    w = make_weight("fp8", 8 * 1024, 4096)
    x = rnd(t, 8, 4096)
    ref = REF.grouped_linear(x, REF.prepare(w), 8)
    got = GPU.grouped_linear(cp.asarray(x), GPU.prepare(w), 8)
    assert rel(got, ref) < (F32_TOL if t <= 32 else GEMM_TOL)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "f32"])
def test_embed(fmt):
    w = make_weight(fmt, 3000, 5120)
    ids = RNG.integers(0, 3000, size=(7, 3))
    assert rel(GPU.embed(GPU.prepare(w), ids), REF.embed(REF.prepare(w), ids)) == 0.0
