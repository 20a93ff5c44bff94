"""CupyOps (our CUDA kernels) against the float32 numpy reference, op by op.

Random non-zero inputs at V4.1-Flash widths (hidden 5120, 64 heads x 512, q_lora 1280, expert
width 2304). Tolerances, as ||gpu - ref|| / ||ref||: 2e-5 for float32 paths (GEMV at <= 8 rows,
norms, attention; only summation order differs), for the tensor-core GEMV on FP8 / FP4 weights
(2 to 32 rows; exact f16 weights, activations as hi + lo f16 terms) and its GEMM form for more rows
(gemm_tc, the same arithmetic); for the bf16 GEMM (gemm) 5e-5 on weights exact in bf16 (activations
split into three bf16 terms), 1e-2 where it rounds the weight to bf16 (f32 weights; fp8 with fp32
scales in blocks gemm_tc does not read); exact for the fake quantizers and routing ids.
Skipped where CuPy or a GPU is absent (CI).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from engine.checkpoint import formats  # noqa: E402
from engine.checkpoint.reader import Weight  # noqa: E402
from engine.ops import kernels as K  # noqa: E402
from engine.ops.gpu.ops import CupyOps  # noqa: E402
from engine.ops.numpy_ops import NumpyOps  # noqa: E402
from engine.state.rows import Span  # noqa: E402

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
    spy = staticmethod(lambda a, fp4: splits.append(a.shape) or split(a, fp4))
    monkeypatch.setattr(cupy_ops.CupyOps, "_tc_split_x", spy)
    w = make_weight(fmt, n, k, block, sfmt)
    x = rnd(m, k) * np.exp(RNG.uniform(-8, 8, (m, 1))).astype(np.float32)  # rows of unlike magnitude
    got = cp.asnumpy(GPU.linear(cp.asarray(x), GPU.prepare(w)))
    assert splits == [(m, k)]  # (every case here has scale blocks gemm_tc takes)
    ref = REF.linear(x, REF.prepare(w))
    assert max(rel(got[i], ref[i]) for i in range(m)) < F32_TOL  # row by row


def test_gemm_tc_moe():
    """The routed experts' grouped GEMMs (segments from the device-built table) on gemm_tc."""
    ref, got, most = _moe_case(150, 6, 4, 1024, 512)
    assert most > 32 and rel(got, ref) < F32_TOL  # (segments past 32 rows: the GEMM, not a GEMV)


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
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with stream:
        xd = cp.asarray(x)
        GPU.linear(xd, gw)  # (kernels loaded before capture)
        with cp.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            y = GPU.linear(xd, gw)
            graph = stream.end_capture()
        y.fill(0)
        graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(cp.asnumpy(y), got.astype(np.float32))


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


# ---- norms, rope, mHC ------------------------------------------------------------------------
@pytest.mark.parametrize("shape,weighted,eps", [((7, 5120), True, 1e-20), ((3, 64, 512), False, 1e-6),
                                                ((5, 1280), True, 1e-6), ((1, 8192), True, 1e-6),
                                                ((2, 6004), False, 1e-6), ((2, 8196), True, 1e-6)])
def test_rmsnorm(shape, weighted, eps):
    x = rnd(*shape)
    w = rnd(shape[-1]) if weighted else None
    got = GPU.rmsnorm(cp.asarray(x), None if w is None else cp.asarray(w), eps)
    assert rel(got, REF.rmsnorm(x, w, eps)) < F32_TOL


@pytest.mark.parametrize("shape,inverse", [((4, 64, 512), False), ((4, 64, 512), True), ((6, 512), False)])
def test_rope(shape, inverse):
    x = rnd(*shape)
    ang = rnd(shape[0], 32)
    c, s = np.cos(ang), np.sin(ang)
    got = GPU.rope(cp.asarray(x), cp.asarray(c), cp.asarray(s), inverse)
    assert rel(got, REF.rope(x, c, s, inverse)) < 1e-6


# (x's shape, RoPE pairs, norm: "w" weighted / "1" unweighted / None, state codec, keep_normed);
# widths 64..512 (8..128 threads a row, partial last blocks), a strided column slice (the K=V half of
# a stacked projection), one width the kernel does not take (the chain of launches instead)
NRQ_CASES = [((3, 512), 32, "w", 1, False), ((5, 512), 32, "w", 2, True), ((4, 128), 32, "w", 3, False),
             ((3, 64, 128), 32, None, 3, False), ((2, 8, 512), 32, "1", 0, False), ((5, 64), 16, "w", 1, True),
             ((7, 256), 32, "w", 2, False), ((2, 100), 16, "w", 0, False)]


@pytest.mark.parametrize("shape,pairs,norm,codec,keep", NRQ_CASES)
@pytest.mark.parametrize("strided", [False, True])
def test_norm_rope_quant(shape, pairs, norm, codec, keep, strided):
    """The fused kernel against the numpy chain (rmsnorm, rope, fake-quant): float32 tolerance
    before the quantization; the quantization itself exact, applied by the reference to the
    kernel's own unquantized result (a value near a rounding boundary may round either way after
    a different summation order, so the chain's quantized values are not compared bit for bit)."""
    if strided and len(shape) != 2:
        pytest.skip("a strided view is a 2-D column slice")
    x = rnd(*shape, scale=3.0)
    xd = cp.asarray(x)
    if strided:  # x as the trailing columns of a wider array, read in place
        wide = cp.asarray(rnd(shape[0], 1024 + shape[1]))
        wide[:, 1024:] = xd
        xd = wide[:, 1024:]
    ang = rnd(shape[0], pairs)
    c, s = np.cos(ang), np.sin(ang)
    w = rnd(shape[-1]) if norm == "w" else None
    nh = None if norm is None else (w, 1e-6)
    nd = None if norm is None else (None if w is None else cp.asarray(w), 1e-6)
    args = (cp.asarray(c), cp.asarray(s), nd)
    plain = GPU.norm_rope_quant(xd, *args, 0, keep)
    ref = REF.norm_rope_quant(x, c, s, nh, 0, keep)
    for g, r in zip(plain if keep else (plain,), ref if keep else (ref,), strict=True):
        assert rel(g, r) < F32_TOL
    got = GPU.norm_rope_quant(xd, *args, codec, keep)
    if keep:
        assert np.array_equal(cp.asnumpy(got[0]), cp.asnumpy(plain[0]))
        got, plain = got[1], plain[1]
    want = {0: lambda a: a, 1: lambda a: REF.fake_quant_fp8(a, 32), 2: lambda a: REF.fake_quant_fp4(a, 16, True),
            3: lambda a: REF.fake_quant_fp4(a, 32)}[codec](cp.asnumpy(plain))
    assert np.array_equal(cp.asnumpy(got), want), np.argwhere(cp.asnumpy(got) != want)[:5]


# hc 4: the fused one-launch kernel (hc_mix, also every hc_head_pre); 3, 8: two launches, a serial finish.
# d 1000: the last 512-float slice is partial.
@pytest.mark.parametrize("t,hc,d", [(1, 4, 5120), (6, 4, 5120), (3, 4, 1000), (2, 3, 5120), (2, 8, 5120)])
def test_hc_mixes_and_head(t, hc, d):
    nm = (2 + hc) * hc
    h = rnd(t, hc, d)
    fn, scale, base = rnd(nm, hc * d, scale=0.01), rnd(3), rnd(nm)
    ref = REF.hc_mixes(h, fn, scale, base, 1e-6, 1e-6, 20)
    got = GPU.hc_mixes(*(cp.asarray(a) for a in (h, fn, scale, base)), 1e-6, 1e-6, 20)
    for g, r in zip(got, ref, strict=True):
        assert rel(g, r) < 1e-4
    again = GPU.hc_mixes(*(cp.asarray(a) for a in (h, fn, scale, base)), 1e-6, 1e-6, 20)
    for g, r in zip(again, got, strict=True):  # the fused kernel's block counters reset themselves
        assert cp.array_equal(g, r)
    fn4, base4 = rnd(hc, hc * d, scale=0.01), rnd(hc)
    ref = REF.hc_head_pre(h, fn4, scale, base4, 1e-6, 1e-6)
    got = GPU.hc_head_pre(*(cp.asarray(a) for a in (h, fn4, scale, base4)), 1e-6, 1e-6)
    assert rel(got, ref) < 1e-5


def test_hc_collapse_expand():
    t, hc, d = 5, 4, 5120
    h, pre, post, comb, out = rnd(t, hc, d), rnd(t, hc), rnd(t, hc), rnd(t, hc, hc), rnd(t, d)
    assert rel(GPU._hc_collapse(cp.asarray(h), cp.asarray(pre)), REF.hc_collapse(h, pre)) < F32_TOL
    w = rnd(d)
    for wt in (w, None):  # collapse + RMSNorm in one launch
        got = GPU.hc_collapse_norm(cp.asarray(h), cp.asarray(pre), None if wt is None else cp.asarray(wt), 1e-6)
        assert rel(got, REF.hc_collapse_norm(h, pre, wt, 1e-6)) < F32_TOL
    got = GPU.hc_expand(cp.asarray(out), cp.asarray(h), cp.asarray(post), cp.asarray(comb))
    assert rel(got, REF.hc_expand(out, h, post, comb)) < F32_TOL


def test_engram_mix():
    t, hc, d = 6, 4, 5120
    h, key, value, qk = rnd(t, hc, d), rnd(t, hc, d), rnd(t, d), rnd(hc, d)
    got = GPU.engram_mix(*(cp.asarray(a) for a in (h, key, value, qk)), 1e-20)
    assert rel(got, REF.engram_mix(h, key, value, qk, 1e-20)) < F32_TOL


def test_gated_pool():
    kv, gate = rnd(9, 2, 512), rnd(9, 2, 512)
    gate[0, 0, :5] = -np.inf
    assert rel(GPU.gated_pool(cp.asarray(kv), cp.asarray(gate)), REF.gated_pool(kv, gate)) < 1e-6


# ---- MoE -------------------------------------------------------------------------------------
@pytest.mark.parametrize("scoring,bias,hashed", [("sqrtsoftplus", True, False), ("softmax", False, False),
                                                 ("sigmoid", True, False), ("sqrtsoftplus", False, True)])
def test_route(scoring, bias, hashed):
    """The exact comparison routes 8 tokens (one block), the other 33 (a partial last block)."""
    m = 8
    t, e, k, d = 33, 384, 6, 5120
    x = rnd(t, d)
    gw = make_weight("bf16", e, d)
    b = rnd(e, scale=0.1) if bias else None
    hid = RNG.integers(0, e, size=(t, k)) if hashed else None
    rw, ri = REF.route(x, REF.prepare(gw), b, k, scoring, 1.0, 1.5, True, hid)
    # route the reference's own logits too, so ids compare exactly (the GEMM rounds to bf16)
    gw32 = Weight("w", REF.prepare(gw), "f32", shape=(e, d))
    gwt, git = GPU.route(cp.asarray(x[:m]), GPU.prepare(gw32), None if b is None else cp.asarray(b), k, scoring,
                         1.0, 1.5, True, None if hid is None else hid[:m])
    assert np.array_equal(cp.asnumpy(git), ri[:m])
    assert rel(gwt, rw[:m]) < 1e-5
    gw_, gi_ = GPU.route(cp.asarray(x), GPU.prepare(gw), None if b is None else cp.asarray(b), k, scoring, 1.0,
                         1.5, True, hid)
    assert (cp.asnumpy(gi_) == ri).mean() > 0.99


def test_route_ties_pick_lower_ids():
    """Experts with equal biased scores (repeated router rows) are picked lowest id first, as the
    reference's stable argsort does; 384 experts and 200 (a partial last register) per token."""
    for e in (384, 200):
        t, k, d = 5, 6, 64
        rows = rnd(7, d, scale=0.3)
        gw = Weight("w", rows[np.arange(e) % 7], "f32", shape=(e, d))
        x = rnd(t, d)
        for b in (None, np.repeat(rnd(1), e).astype(np.float32)):
            rw, ri = REF.route(x, REF.prepare(gw), b, k, "sqrtsoftplus", 1.0, 1.5, True)
            gwt, git = GPU.route(cp.asarray(x), GPU.prepare(gw), None if b is None else cp.asarray(b), k,
                                 "sqrtsoftplus", 1.0, 1.5, True)
            assert np.array_equal(cp.asnumpy(git), ri)
            assert rel(gwt, rw) < 1e-5


def test_swiglu_mlp():
    d, inter = 5120, 2304
    w1, w2, w3 = (make_weight("fp8", *s) for s in ((inter, d), (d, inter), (inter, d)))
    for t in (1, 20, 64):  # (gate and up as one launch: gemvx, tensor-core GEMV, GEMM)
        x = rnd(t, d)
        ref = REF.swiglu_mlp(x, *(REF.prepare(w) for w in (w1, w2, w3)), 10.0)
        got = GPU.swiglu_mlp(cp.asarray(x), *(GPU.prepare(w) for w in (w1, w2, w3)), 10.0)
        assert rel(got, ref) < (F32_TOL if t <= 32 else GEMM_TOL)


def _moe_case(t: int, e: int, k: int, d: int, inter: int, shared: bool = False) -> tuple:
    """(reference, GPU result, the most pairs one expert got) of t tokens through e FP4 experts;
    shared: plus a random addend, the shared expert's output."""
    ws = [tuple(make_weight("fp4", *s) for s in ((inter, d), (d, inter), (inter, d))) for _ in range(e)]
    x = rnd(t, d)
    ids = np.stack([RNG.permutation(e)[:k] for _ in range(t)])
    wts = RNG.random((t, k), dtype=np.float32)
    add = rnd(t, d) if shared else None
    ref = REF.moe(x, [tuple(REF.prepare(w) for w in ex) for ex in ws], wts, ids, 10.0)
    if shared:
        ref = ref + add
    got = GPU.moe(cp.asarray(x), [tuple(GPU.prepare(w) for w in ex) for ex in ws], cp.asarray(wts),
                  cp.asarray(ids), 10.0, cp.asarray(add) if shared else None)
    return ref, got, np.bincount(ids.ravel()).max()


@pytest.mark.parametrize("t", [1, 3, 64])
def test_moe(t):
    ref, got, most = _moe_case(t, 12, 6, 5120, 2304)
    assert rel(got, ref) < (F32_TOL if most <= 8 else GEMM_TOL)


@pytest.mark.parametrize("t", [1, 5])
def test_moe_plus_shared(t):
    """moe() with the shared expert's output, summed after the combine."""
    ref, got, _ = _moe_case(t, 8, 6, 1024, 512, shared=True)
    assert rel(got, ref) < F32_TOL


def test_fork_matches_inline(monkeypatch):
    """CupyOps.fork: the shared expert forked onto the side stream beside the routed experts (as a
    captured decode step forks it) equals both run inline, bit for bit, replayed as a CUDA graph (the
    fork and its join become graph edges; eagerly the fork runs inline); the fork's input is a
    temporary the caller drops at once; moe() joins it after the routed experts' launches; a fork
    whose output nothing reads is joined by join_all."""
    from engine.ops.gpu.graphs import RegionGraphs

    e, k, d, inter = 8, 6, 5120, 2304
    shared = tuple(GPU.prepare(make_weight("fp8", *s)) for s in ((inter, d), (d, inter), (inter, d)))
    experts = [tuple(GPU.prepare(make_weight("fp4", *s)) for s in ((inter, d), (d, inter), (inter, d)))
               for _ in range(e)]
    x = cp.asarray(rnd(1, d))
    ids = cp.asarray(RNG.permutation(e)[:k].reshape(1, k))
    wts = cp.asarray(RNG.random((1, k), dtype=np.float32))

    def inline(a):
        return GPU.moe(a, experts, wts, ids, 10.0) + GPU.swiglu_mlp(a, *shared, 10.0)

    def forked(a):
        b = GPU.fork(GPU.swiglu_mlp, a * 1.0, *shared, 10.0)
        y = GPU.moe(a, experts, wts, ids, 10.0, b)
        GPU.fork(GPU.rmsnorm, a * 2.0, None, 1e-6)  # (read by nothing)
        GPU.join_all()
        assert not GPU._open and not GPU._pending
        return y

    ref = cp.asnumpy(inline(x))
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    assert np.array_equal(cp.asnumpy(forked(x)), ref)
    monkeypatch.setattr(GPU, "_side_stream", None)  # (made on first use: by this capture, below)
    graphs = RegionGraphs(enabled=True)
    for _ in range(4):  # eager, capture, then replays
        assert np.array_equal(cp.asnumpy(graphs("fork", forked, x)), ref)
    assert graphs.captures == 1 and graphs.replays >= 2
    assert GPU._side_stream is not None  # the capture forked


def test_fork_outputs_join_at_the_ops_that_read_them():
    """A forked output passed to an op (also inside a list, or as a view) joins its fork there, and
    only its own: the other fork stays open until join_all. Captured and replayed, the results equal
    the same ops run inline."""
    from engine.ops.gpu.graphs import RegionGraphs

    w = GPU.prepare(make_weight("bf16", 512, 1024))
    x = cp.asarray(rnd(4, 1024))
    opened = []  # the forks open after the first op that read a forked output, per call

    def inline(a):
        n = GPU.rmsnorm(a * 1.0, None, 1e-6)
        m = GPU.rmsnorm(a * 2.0, None, 1e-6)
        return GPU.linear(n[:2], w), GPU.cat([m, n], 0)

    def forked(a):
        n = GPU.fork(GPU.rmsnorm, a * 1.0, None, 1e-6)
        m, none = GPU.fork(lambda v: (GPU.rmsnorm(v, None, 1e-6), None), a * 2.0)
        assert none is None
        y = GPU.linear(n[:2], w)  # (a view of n: joins n's fork)
        opened.append(len(GPU._open))
        z = GPU.cat([m, n], 0)  # (inside a list: joins m's)
        assert not GPU._open
        GPU.join_all()
        return y, z

    ref = [cp.asnumpy(a) for a in inline(x)]
    graphs = RegionGraphs(enabled=True)
    for _ in range(3):  # eager, capture, replay
        got = graphs("fork-join", forked, x)
        assert all(np.array_equal(cp.asnumpy(g), r) for g, r in zip(got, ref, strict=True))
    assert opened == [0, 1]  # (eagerly the forks ran inline; captured, m's stayed open past the linear)


# MoE with the pairs grouped on the device (T * top-k <= MOE_DEVICE_MAX_PAIRS): narrow fp4 experts,
# so that hundreds of them stay cheap to build. At these widths the GEMV never splits K (too few
# chunks), so the device and host paths launch the same per-row arithmetic.
MOE_D, MOE_INTER, MOE_K = 512, 256, 6
_MOE_POOL: list = []  # (stored Weights, GpuWeights) per expert, built on demand


def _moe_experts(e: int) -> tuple[list, list]:
    while len(_MOE_POOL) < e:
        ws = tuple(make_weight("fp4", *s) for s in ((MOE_INTER, MOE_D), (MOE_D, MOE_INTER), (MOE_INTER, MOE_D)))
        _MOE_POOL.append((ws, tuple(GPU.prepare(w) for w in ws)))
    return [p[0] for p in _MOE_POOL[:e]], [p[1] for p in _MOE_POOL[:e]]


def _moe_route(t: int, e: int, max_count: int | None = None, min_max: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Distinct experts per token (as routing gives), optionally at most max_count pairs an expert
    and at least one expert with min_max pairs."""
    for _ in range(1000):
        ids = np.stack([RNG.permutation(e)[:MOE_K] for _ in range(t)])
        most = np.bincount(ids.ravel()).max()
        if (max_count is None or most <= max_count) and most >= min_max:
            return ids, RNG.random((t, MOE_K), dtype=np.float32)
    raise AssertionError("no routing within max_count")


def _no_host(self, x):
    raise AssertionError("the device MoE path copied to the host")


def _host_grouping(monkeypatch) -> None:
    """moe() groups the pairs on the host (its path for more experts than moe_group_large takes)."""
    monkeypatch.setattr("engine.ops.gpu.moe.MOE_DEVICE_MAX_PAIRS", 0)
    monkeypatch.setattr("engine.ops.gpu.moe.MOE_GROUP_LARGE_MAXE", 0)


@pytest.mark.parametrize("t,e", [(1, 64), (3, 384), (8, 256), (32, 128), (100, 64), (100, 384)])
def test_moe_device(t, e, monkeypatch):
    ws, gws = _moe_experts(e)
    x = rnd(t, MOE_D)
    ids, wts = _moe_route(t, e)
    used = set(ids.ravel().tolist())
    ref_ex = [tuple(REF.prepare(w) for w in ex) if i in used else None for i, ex in enumerate(ws)]
    ref = REF.moe(x, ref_ex, wts, ids, 10.0)
    monkeypatch.setattr(CupyOps, "to_host", _no_host)
    got = GPU.moe(cp.asarray(x), gws, cp.asarray(wts), cp.asarray(ids), 10.0)
    assert rel(got, ref) < F32_TOL  # GEMV at every T: segments of <= 8 rows


@pytest.mark.parametrize("t,e", [(1, 64), (4, 64), (8, 384), (32, 384)])
def test_moe_device_matches_host(t, e, monkeypatch):
    _, gws = _moe_experts(e)
    x = cp.asarray(rnd(t, MOE_D))
    # the host path stays on the GEMV too, and on the same kernel as the device path's segments of
    # min(8, t) rows: one row at t = 1, else the multi-row tensor-core GEMV (an expert with 2 pairs)
    ids, wts = _moe_route(t, e, max_count=8, min_max=min(t, 2))
    ids, wts = cp.asarray(ids), cp.asarray(wts)
    dev = cp.asnumpy(GPU.moe(x, gws, wts, ids, 10.0))
    _host_grouping(monkeypatch)
    host = cp.asnumpy(GPU.moe(x, gws, wts, ids, 10.0))
    assert np.array_equal(dev, host)


@pytest.mark.parametrize("job", [0, 1, 2])
def test_scatter_rows(job):
    """B rows into state rows at staged addresses (0: none): float4 rows, a column slice read in
    place, and an odd width moved a float at a time."""
    b, width = 5, (512, 256, 130)[job]
    wide = cp.asarray(rnd(b, 256 + 64))
    src = [cp.asarray(rnd(b, 512)), wide[:, 64:], cp.asarray(rnd(b, 130))][job]
    buf = cp.asarray(rnd(9, width))
    rows = RNG.permutation(9)[:b]
    want = cp.asnumpy(buf)
    addr = np.array([buf.data.ptr + int(i) * width * 4 for i in rows], np.int64)
    addr[job % b] = 0  # (that row is skipped)
    for k, i in enumerate(rows):
        if k != job % b:
            want[i] = cp.asnumpy(src[k])
    GPU.scatter_rows(src, cp.asarray(addr))
    assert np.array_equal(cp.asnumpy(buf), want)


def _group_ref(ids: np.ndarray, e: int, step: int, maxseg: int):
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    es = flat[order]
    starts = np.flatnonzero(np.r_[True, es[1:] != es[:-1]])
    counts = np.diff(np.r_[starts, order.size])
    segs = [(int(es[s0]), int(s0) + r, int(min(step, c - r)), 0, 0)
            for s0, c in zip(starts, counts, strict=True) for r in range(0, int(c), step)]
    assert len(segs) <= maxseg
    tab = np.zeros((maxseg, 5), np.int32)
    tab[:len(segs)] = segs
    return order, inv, order // ids.shape[1], tab.reshape(-1)


def _check_group_launch(name: str, ids: np.ndarray, e: int, step: int, smem: int = 0) -> None:
    """The grouping kernel itself, into poisoned buffers with maxseg = P (the tail must come back
    zeroed): the stable argsort's order, inverse, tokens and segments exactly."""
    p = ids.size
    buf = cp.full(8 * p, -1, cp.int32)
    segs, order, inv, gather = buf[:5 * p], buf[5 * p:6 * p], buf[6 * p:7 * p], buf[7 * p:]
    fn = K.function_with_smem("moe", name, smem) if smem else K.function("moe", name)
    fn((1,), (1024,), (cp.asarray(ids), np.int32(p), np.int32(ids.shape[1]), np.int32(e), np.int32(step),
                          np.int32(p), np.int32(0), order, inv, gather, segs), shared_mem=smem)
    for got, ref in zip((order, inv, gather, segs), _group_ref(ids, e, step, p), strict=True):
        assert np.array_equal(cp.asnumpy(got), ref)


def _check_group_helper(ids: np.ndarray, e: int, step: int) -> None:
    """Through the helper moe() uses: its tighter maxseg still holds every segment, plain and doubled
    for gate and up in one launch (the second half w3's: experts e.., y column 77)."""
    ms = CupyOps._moe_max_segments(ids.size, e, step)
    ref = _group_ref(ids, e, step, ms)
    got = GPU._moe_group(cp.asarray(ids), e, step)
    assert got[0].size == 5 * ms
    for g, r in zip(got, (ref[3], ref[2], ref[1], ref[0]), strict=True):
        assert np.array_equal(cp.asnumpy(g), r)
    segs2 = cp.asnumpy(GPU._moe_group(cp.asarray(ids), e, step, 77)[0]).reshape(2, ms, 5)
    assert np.array_equal(segs2[0], ref[3].reshape(ms, 5))
    used = segs2[0][:, 2] > 0
    assert np.array_equal(segs2[1][used], segs2[0][used] + np.array([e, 0, 0, 0, 77]))
    assert not segs2[1][~used].any()


@pytest.mark.parametrize("t,k,e,step", [(1, 1, 8, 1), (1, 6, 256, 1), (3, 6, 64, 3), (100, 6, 8, 8),
                                        (170, 6, 384, 8), (128, 8, 256, 8), (1024, 1, 3, 8), (33, 5, 40, 8)])
def test_moe_group_kernel(t, k, e, step):
    ids = RNG.integers(0, e, (t, k))  # repeats across and within tokens
    _check_group_launch("moe_group", ids, e, step)
    _check_group_helper(ids, e, step)


@pytest.mark.parametrize("t,k,e,step", [(200, 6, 384, 64), (4096, 6, 384, 64), (1500, 1, 3, 8), (333, 8, 1024, 64),
                                        (171, 6, 40, 5), (1025, 1, 1, 64)])
def test_moe_group_large_kernel(t, k, e, step):
    """moe_group_large (above 1024 pairs): moe_group's outputs exactly, stable by pair."""
    ids = RNG.integers(0, e, (t, k))
    _check_group_launch("moe_group_large", ids, e, step, smem=32 * e * 4)
    _check_group_helper(ids, e, step)


@pytest.mark.parametrize("t,e,most", [(400, 16, 65), (700, 64, 65), (700, 384, 9)])
def test_moe_device_large(t, e, most, monkeypatch):
    """A prompt chunk's MoE grouped on the device (moe_group_large, no copy to the host) equals the
    numpy reference; where an expert has more than 64 pairs the host-grouped path launches the same
    64-row GEMM segments, and the two agree bit for bit (with fewer, the host path picks the
    tensor-core GEMV for its largest count and the two differ by rounding only)."""
    ws, gws = _moe_experts(e)
    x = rnd(t, MOE_D)
    ids, wts = _moe_route(t, e, min_max=most)
    used = set(ids.ravel().tolist())
    ref = REF.moe(x, [tuple(REF.prepare(w) for w in ex) if i in used else None for i, ex in enumerate(ws)],
                  wts, ids, 10.0)
    with monkeypatch.context() as m:
        m.setattr(CupyOps, "to_host", _no_host)
        dev = cp.asnumpy(GPU.moe(cp.asarray(x), gws, cp.asarray(wts), cp.asarray(ids), 10.0))
    assert rel(dev, ref) < GEMM_TOL
    _host_grouping(monkeypatch)
    host = cp.asnumpy(GPU.moe(cp.asarray(x), gws, cp.asarray(wts), cp.asarray(ids), 10.0))
    assert np.array_equal(dev, host) if most > 64 else rel(host, ref) < GEMM_TOL


def test_moe_cuda_graph():
    t, e = 4, 64
    _, gws = _moe_experts(e)
    (ids1, w1), (ids2, w2) = _moe_route(t, e), _moe_route(t, e)
    x1, x2 = rnd(t, MOE_D), rnd(t, MOE_D)
    s = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()  # the graph's intermediates: no eager array may land there
    with s:
        xb, ib, wb = cp.asarray(x1), cp.asarray(ids1), cp.asarray(w1)
        x2d, i2d, w2d = cp.asarray(x2), cp.asarray(ids2), cp.asarray(w2)
        ref1 = cp.asnumpy(GPU.moe(xb, gws, wb, ib, 10.0))  # warm: compiles, builds the tables
        ref2 = cp.asnumpy(GPU.moe(x2d, gws, w2d, i2d, 10.0))
        with cp.cuda.using_allocator(pool.malloc):
            s.begin_capture()
            y = GPU.moe(xb, gws, wb, ib, 10.0)
            g = s.end_capture()
        y.fill(0)
        g.launch(s)
        s.synchronize()
        assert np.array_equal(cp.asnumpy(y), ref1)
        xb[...], ib[...], wb[...] = x2d, i2d, w2d  # new inputs and routing, same graph
        g.launch(s)
        s.synchronize()
        assert np.array_equal(cp.asnumpy(y), ref2)


# ---- attention -------------------------------------------------------------------------------
def _mask(s, n, window, p_drop, rng):
    pos = np.arange(n - s, n)
    kpos = np.arange(n)
    vis = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - window)
    vis |= rng.random((s, n)) > p_drop  # extra "compressed" entries
    vis[:, -1] |= True
    return np.where(vis, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


@pytest.mark.parametrize("b,min_split", [(1, 64), (3, 64), (32, 64), (40, 64), (1, 16), (3, 32)])
def test_attention_decode(b, min_split, monkeypatch):
    """Batched decode attention (split over the keys, splits merged with the sinks) equals the
    reference over each sequence's visible rows: windows of different lengths (one empty), compressed
    entries under top-k masks (one selecting nothing, one sequence without entries) and long ones;
    40 sequences fill the GPU without splitting (one split writes the output directly). min_split:
    the fewest keys per split (ATT_MIN_SPLIT; 16: one tile each)."""
    monkeypatch.setattr("engine.ops.gpu.attention.ATT_MIN_SPLIT", min_split)
    h, d = 64, 512
    q, sinks = rnd(b, h, d), rnd(h)
    sources_ref, sources_gpu = [], []
    for i in range(b):
        win = rnd(0 if i == 2 else 128 if i % 5 == 1 else int(RNG.integers(1, 128)), d)
        n = [5000, 0, 700, 1][i % 4]
        srcs = [(win, None)]
        if n:
            mask = RNG.random(n) < (0.0 if i % 7 == 6 else 0.3)
            srcs.append((rnd(n, d), mask))
        sources_ref.append(srcs)
        sources_gpu.append([(cp.asarray(kv), None if m is None else cp.asarray(m)) for kv, m in srcs])
    ref = REF.attention_decode(q, sources_ref, sinks, d**-0.5)
    got = GPU.attention_decode(cp.asarray(q), sources_gpu, cp.asarray(sinks), d**-0.5)
    assert rel(got, ref) < 1e-5


def test_attention_decode_spans():
    """Sources given as Spans (rows of state buffers, read in place) and masks as rows of one
    [B, N] batch mask give the same result as the same rows passed as arrays."""
    b, h, d = 6, 64, 512
    q, sinks = rnd(b, h, d), rnd(h)
    mask = RNG.random((b, 900)) < 0.3
    mask_gpu = cp.asarray(mask)
    ref_src, span_src, gpu_src = [], [], []
    for i in range(b):
        wbuf, ebuf = rnd(200, d), rnd(1000, d)
        w0, wn, e0 = int(RNG.integers(0, 60)), int(RNG.integers(1, 128)), int(RNG.integers(0, 90))
        en = [900, 0, 17, 300, 1, 512][i]
        ref_src.append([(wbuf[w0:w0 + wn], None)] + ([(ebuf[e0:e0 + en], mask[i, :en])] if en else []))
        span_src.append([(Span(wbuf, w0, wn), None)] + ([(Span(ebuf, e0, en), Span(mask, i, en))] if en else []))
        gw, ge = cp.asarray(wbuf), cp.asarray(ebuf)
        gpu_src.append([(Span(gw, w0, wn), None)] + ([(Span(ge, e0, en), Span(mask_gpu, i, en))] if en else []))
    ref = REF.attention_decode(q, ref_src, sinks, d**-0.5)
    np.testing.assert_array_equal(REF.attention_decode(q, span_src, sinks, d**-0.5), ref)
    got = GPU.attention_decode(cp.asarray(q), gpu_src, cp.asarray(sinks), d**-0.5)
    assert rel(got, ref) < 1e-5


def test_indexer_scores_spans():
    """Each decode query against its own keys (rows of a buffer at an offset; one sequence without
    keys yet), -inf past each sequence's count; equal to the single-sequence kernel's rows."""
    h, dh = 32, 128
    counts = [700, 0, 5, 333]
    q, w = rnd(len(counts), h, dh), rnd(len(counts), h)
    bufs = [rnd(n + 50, dh) for n in counts]
    offs = [int(RNG.integers(0, 50)) for _ in counts]
    ref = REF.indexer_scores_spans(q, [Span(bf, o, n) for bf, o, n in zip(bufs, offs, counts, strict=True)], w, h, dh)
    got = GPU.indexer_scores_spans(cp.asarray(q), [Span(cp.asarray(bf), o, n) for bf, o, n in
                                                   zip(bufs, offs, counts, strict=True)], cp.asarray(w), h, dh)
    got = cp.asnumpy(got)
    assert got.shape == (4, 700)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    for i, n in enumerate(counts):
        if n:
            assert rel(got[i, :n], ref[i, :n]) < 1e-5
            assert np.isneginf(ref[i, n:]).all()


def test_copy_rows():
    """Batched row copies: many small aligned ones in one launch, unaligned widths and large ones
    through cudaMemcpyAsync; every byte lands where numpy's copies put it."""
    srcs = [rnd(300, 512), rnd(40, 3), rnd(5000, 128)]
    dsts = [rnd(310, 512), rnd(45, 3), rnd(5100, 128)]
    jobs = [(0, 0, 0, 5, 1), (0, 7, 0, 300, 10), (1, 0, 1, 1, 40), (2, 0, 2, 100, 5000), (0, 299, 0, 0, 1),
            (2, 17, 2, 0, 3), (0, 100, 0, 200, 64)]
    ref_d = [a.copy() for a in dsts]
    gpu_d = [cp.asarray(a) for a in dsts]
    gpu_s = [cp.asarray(a) for a in srcs]
    REF.copy_rows([(srcs[a], sr, ref_d[c], dr, n) for a, sr, c, dr, n in jobs])
    GPU.copy_rows([(gpu_s[a], sr, gpu_d[c], dr, n) for a, sr, c, dr, n in jobs])
    for r, g in zip(ref_d, gpu_d, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(g), r)
    with pytest.raises(ValueError):
        GPU.copy_rows([(gpu_s[0], 299, gpu_d[0], 0, 2)])  # past the source's end


def test_staged_decode_ops(monkeypatch):
    """The ops of a V4.1 decode step's device half (engine/state/decode_plan.py), from a plan staged by
    each backend (the GPU's: one upload of address tables), against the numpy reference: the new
    K=V rows scattered into each sequence's window block, closing groups pooled (one sequence
    without a closing group: a zero row), the indexer over each sequence's keys at a capacity
    width, and the attention over windows and top-k-masked entries (one sequence without entries,
    one whose entry count the mask did not score) sized for a longer capacity than any sequence has,
    split over the keys or not."""
    from engine.state.decode_plan import LayerPlan, StepInputs, WindowPlan, plan_attention

    b, h, d, dh, ratio = 5, 64, 512, 128, 2
    start = np.array([3, 0, 10, 50, 7], np.int64)
    dst = start + np.array([127, 0, 49, 127, 8])
    ns, pub = [600, 0, 37, 1, 257], [600, 0, 37, 2, 257]
    closes = [True, False, True, True, True]
    host = {"blocks": [rnd(1, 200, d) for _ in range(b)], "pend": [rnd(4, d) for _ in range(b)],
            "gate": [rnd(4, d) for _ in range(b)], "ents": [rnd(700, d) for _ in range(b)],
            "keys": [rnd(700, dh) for _ in range(b)]}

    def staged(ops, xp):
        g = {k: [xp.asarray(a) for a in v] for k, v in host.items()}
        plan = LayerPlan(
            ents_from=0, mask_from=0,
            pool_kv=[Span(g["pend"][i], 1, ratio) if closes[i] else None for i in range(b)],
            pool_gate=[Span(g["gate"][i], 1, ratio) if closes[i] else None for i in range(b)],
            entries=[Span(g["ents"][i], 20, ns[i]) for i in range(b)], pub_ns=np.array(pub, np.int64),
            keys=[Span(g["keys"][i], 30, ns[i]) for i in range(b)], keys_cap=1024)
        window = WindowPlan(g["blocks"], start, dst)
        plan_attention([plan], window)
        step = StepInputs(ids=np.arange(b, dtype=np.int64), hash_ids=None, rope=rnd(4, b, 32), layers=[plan],
                          window=window)
        return g, ops.stage(step).layers[0]

    (ref_g, sr), (gpu_g, sg) = staged(REF, np), staged(GPU, cp)
    new = rnd(b, d)
    REF.scatter_rows(new, sr.win_dst)
    GPU.scatter_rows(cp.asarray(new), sg.win_dst)
    for r, g in zip(ref_g["blocks"], gpu_g["blocks"], strict=True):
        np.testing.assert_array_equal(cp.asnumpy(g), r)
    assert all(np.array_equal(ref_g["blocks"][i][0, dst[i]], new[i]) for i in range(b))
    wide = rnd(b, d + 64)  # rows of a column slice (a stacked projection's part), read in place
    REF.scatter_rows(wide[:, 64:], sr.win_dst)
    GPU.scatter_rows(cp.asarray(wide)[:, 64:], sg.win_dst)
    for r, g in zip(ref_g["blocks"], gpu_g["blocks"], strict=True):
        np.testing.assert_array_equal(cp.asnumpy(g), r)
    assert all(np.array_equal(ref_g["blocks"][i][0, dst[i]], wide[i, 64:]) for i in range(b))
    pooled_ref = REF.gated_pool_rows(sr.pool_kv, sr.pool_gate, ratio, d)
    assert not pooled_ref[1].any()
    assert rel(GPU.gated_pool_rows(sg.pool_kv, sg.pool_gate, ratio, d), pooled_ref) < 1e-6
    q, w = rnd(b, 32, dh), rnd(b, 32)
    sc_ref = REF.indexer_scores_spans(q, sr.keys, w, 32, dh, sr.keys_cap)
    sc_gpu = cp.asnumpy(GPU.indexer_scores_spans(cp.asarray(q), sg.keys, cp.asarray(w), 32, dh, sg.keys_cap))
    assert sc_gpu.shape == sc_ref.shape == (b, 1024)
    np.testing.assert_array_equal(np.isneginf(sc_gpu), np.isneginf(sc_ref))
    fin = np.isfinite(sc_ref)
    assert rel(sc_gpu[fin], sc_ref[fin]) < 1e-5
    assert [e is not None for _, e in sr.attend] == [True, False, True, False, True]
    assert sr.mask_cap == sr.attend_cap == 1024  # (128 window rows + 600 entries, the longest)
    mask = RNG.random((b, 1024)) < 0.3
    qa, sinks = rnd(b, h, d), rnd(h)
    ref = REF.attend_decode(qa, sr.attend, mask, sinks, d**-0.5, sr.attend_cap)
    got = GPU.attend_decode(cp.asarray(qa), sg.attend, cp.asarray(mask), cp.asarray(sinks), d**-0.5, sg.attend_cap)
    assert rel(got, ref) < 1e-5
    # a top-k mask (at most 40 true a row; two past each row's entries, which count for nothing), the
    # entries read through each row's list of selected rows
    topk = np.zeros((b, 1024), bool)
    for i, n in enumerate(ns):
        topk[i, RNG.choice(n, min(n, 30), replace=False)] = True
        topk[i, RNG.choice(np.arange(n, 1024), 2, replace=False)] = True
    ref = REF.attend_decode(qa, sr.attend, topk, sinks, d**-0.5, sr.attend_cap)
    for min_split in (64, 1024):  # (7 splits merged by attention_combine; one, written directly)
        monkeypatch.setattr("engine.ops.gpu.attention.ATT_MIN_SPLIT", min_split)
        got = GPU.attend_decode(cp.asarray(qa), sg.attend, cp.asarray(topk), cp.asarray(sinks), d**-0.5,
                                sg.attend_cap, 128, 40)
        assert rel(got, ref) < 1e-5, min_split


@pytest.mark.parametrize("n_state,s,n_e,k", [(127, 300, 900, 40), (0, 70, 0, 0), (20, 200, 50, 0)])
def test_attention_ranges(n_state, s, n_e, k):
    """A prompt chunk's attention (each query: a window range of the keys, then its entries under
    its mask row, at most k true; k 0: a plain causal mask) through the decode kernel (16 heads:
    not the tensor-core kernel's), its entries through row lists where k bounds them, against the
    numpy reference."""
    h, d, win = 16, 512, 128
    keys, q, sinks = rnd(n_state + s, d), rnd(s, h, d), rnd(h)
    i = np.arange(s) + n_state
    lo, hi = np.maximum(i - (win - 1), 0), i + 1
    entries = rnd(n_e, d) if n_e else None
    emask = None
    if n_e:
        emask = np.zeros((s, n_e), bool)
        for r in range(s):
            emask[r, RNG.choice(n_e, min(n_e, k) if k else int(RNG.integers(0, n_e + 1)), replace=False)] = True
    ref = REF.attention_ranges(q, keys, lo, hi, entries, emask, sinks, d**-0.5, k)
    args = (cp.asarray(q), cp.asarray(keys), lo, hi, None if entries is None else cp.asarray(entries),
            None if emask is None else cp.asarray(emask), cp.asarray(sinks), d**-0.5, k)
    assert rel(GPU.attention_ranges(*args), ref) < 1e-5


def _on_fp8_grid(*shape) -> np.ndarray:
    """Random non-zero e4m3-representable values times powers of two: bf16-exact, like FP8 state rows."""
    mant = RNG.integers(8, 16, shape).astype(np.float32) / 8  # 1 + 3 mantissa bits
    sign = RNG.choice(np.array([-1, 1], np.float32), shape)
    return (mant * sign * np.exp2(RNG.integers(-6, 3, shape))).astype(np.float32)


@pytest.mark.parametrize("n_state,s,n_e,k", [(127, 300, 900, 40), (20, 200, 50, 0), (0, 70, 0, 0),
                                             (5, 130, 600, 512)])
def test_attention_ranges_tc(n_state, s, n_e, k):
    """The tensor-core prefill attention (64 heads): each query's window range, then its
    entries through its row list (k 40 of 900), under its mask (k 0: any number; k 512 of 600: too
    many for lists), or none; f32 keys as three bf16 terms within 1e-5 of the reference, and keys on
    codec grids as one term (exact) bit-identical to three and within 1e-5."""
    h, d, win = 64, 512, 128
    q, sinks = rnd(s, h, d), rnd(h)
    i = np.arange(s) + n_state
    lo, hi = np.maximum(i - (win - 1), 0), i + 1
    emask = None
    if n_e:
        emask = np.zeros((s, n_e), bool)
        for r in range(s):
            emask[r, RNG.choice(n_e, min(n_e, k) if k else int(RNG.integers(0, n_e + 1)), replace=False)] = True
    for grid in (False, True):
        keys = _on_fp8_grid(n_state + s, d) if grid else rnd(n_state + s, d)
        entries = (_on_fp4_grid(n_e, d) if grid else rnd(n_e, d)) if n_e else None
        ref = REF.attention_ranges(q, keys, lo, hi, entries, emask, sinks, d**-0.5, k)
        args = (cp.asarray(q), cp.asarray(keys), lo, hi, None if entries is None else cp.asarray(entries),
                None if emask is None else cp.asarray(emask), cp.asarray(sinks), d**-0.5, k)
        three = GPU.attention_ranges(*args)
        assert rel(three, ref) < 1e-5, grid
        if grid:
            one = GPU.attention_ranges(*args, exact=True)
            np.testing.assert_array_equal(cp.asnumpy(one), cp.asnumpy(three))


@pytest.mark.parametrize("b,n,k", [(1, 16384, 512), (5, 1000, 64), (3, 70, 70), (2, 300, 8)])
def test_mask_rows(b, n, k):
    """Each mask row's true positions in order, the first k of them, and how many (at most k)."""
    mask = RNG.random((b, n)) < min(1.0, 1.3 * k / n)
    rows, cnt = GPU._mask_rows(cp.asarray(mask), k)
    rows, cnt = cp.asnumpy(rows), cp.asnumpy(cnt)
    for i in range(b):
        want = np.flatnonzero(mask[i])[:k]
        assert cnt[i] == want.size and np.array_equal(rows[i, :cnt[i]], want), i


@pytest.mark.parametrize("s,n,h,dh", [(1, 2048, 32, 128), (9, 333, 64, 128), (3, 40, 16, 32), (2, 70, 40, 64),
                                     (2, 50, 64, 256)])
def test_indexer_scores(s, n, h, dh):
    """The CUDA-core kernel (fewer queries than the tensor-core path takes; h 40: heads not a
    multiple of the lanes; dh 256: over 48 KB of shared memory)."""
    q, k, w = rnd(s, h, dh), rnd(n, dh), rnd(s, h)
    ref = REF.indexer_scores(q, k, w, h, dh)
    assert rel(GPU.indexer_scores(cp.asarray(q), cp.asarray(k), cp.asarray(w), h, dh), ref) < 1e-5


def _on_fp4_grid(*shape) -> np.ndarray:
    """Random non-zero e2m1 values times powers of two: bf16-exact, like a state codec's rows."""
    mag = RNG.choice(np.array([0.5, 1, 1.5, 2, 3, 4, 6], np.float32), shape)
    sign = RNG.choice(np.array([-1, 1], np.float32), shape)
    return (mag * sign * np.exp2(RNG.integers(-4, 3, shape))).astype(np.float32)


@pytest.mark.parametrize("s,n,h,dh", [(16, 2048, 64, 128), (37, 333, 64, 128), (5, 70, 32, 64), (9, 1000, 128, 32),
                                     (300, 129, 64, 128)])
def test_indexer_scores_tc(s, n, h, dh, monkeypatch):
    """The tensor-core path (from one query on, for these small cases): f32 inputs as three bf16
    terms equal the reference to f32 precision; inputs on a codec's grid as one term (exact=True)
    equal the three-term result bit for bit (the other terms are zeros) and the reference. (s 5,
    h 32: a block of 4 queries with one query; n 129, 333: a part key tile; dh 32 and 64.)"""
    monkeypatch.setattr("engine.ops.gpu.attention.ITC_MIN_QUERIES", 1)
    q, k, w = rnd(s, h, dh), rnd(n, dh), rnd(s, h)
    ref = REF.indexer_scores(q, k, w, h, dh)
    assert rel(GPU.indexer_scores(cp.asarray(q), cp.asarray(k), cp.asarray(w), h, dh), ref) < 1e-5
    qg, kg = _on_fp4_grid(s, h, dh), _on_fp4_grid(n, dh)
    ref = REF.indexer_scores(qg, kg, w, h, dh, exact=True)
    one = GPU.indexer_scores(cp.asarray(qg), cp.asarray(kg), cp.asarray(w), h, dh, exact=True)
    three = GPU.indexer_scores(cp.asarray(qg), cp.asarray(kg), cp.asarray(w), h, dh)
    np.testing.assert_array_equal(cp.asnumpy(one), cp.asnumpy(three))
    assert rel(one, ref) < 1e-5


def test_topk_mask_ties():
    sc = rnd(6, 1000)
    sc[0, :] = 0.0  # all tied: lower index first
    sc[1, ::3] = -np.inf
    sc[2, :] = -np.inf
    sc[3, 100:200] = np.float32(-0.0)
    for k in (1, 64, 512):
        assert np.array_equal(cp.asnumpy(GPU.topk_mask(cp.asarray(sc), k)), REF.topk_mask(sc, k))


def _topk_rows(kind: str, s: int, n: int) -> np.ndarray:
    sc = rnd(s, n)
    if kind == "levels":  # many exact ties, -0.0 among them
        sc = RNG.integers(-3, 4, (s, n)).astype(np.float32)
        sc[RNG.random((s, n)) < 0.3] = np.float32(-0.0)
    elif kind == "neginf":  # most rows have fewer finite values than k
        sc[RNG.random((s, n)) < 0.97] = -np.inf
        sc[0, :] = -np.inf
    elif kind == "pins":  # +inf pinned entries ahead of everything, more pins than some k
        sc[:, RNG.choice(n, min(n, 600), replace=False)] = np.inf
        sc[:, ::5] = -np.inf
    elif kind == "zeros":  # -0.0 / +0.0 tie at the cut, and subnormals that -ftz must not flush
        sc[:, ::2] = np.float32(-0.0)
        sc[:, 1::4] = np.float32(0.0)
        sc[:, 3::8] = np.float32(1e-40)
        sc[:, 7::16] = np.float32(-1e-40)
    return sc


@pytest.mark.parametrize("kind", ["random", "levels", "neginf", "pins", "zeros"])
@pytest.mark.parametrize("s,n", [(1, 7), (3, 1000), (5, 70000), (2, 300000)])
def test_topk_mask_exact(kind, s, n):
    sc = _topk_rows(kind, s, n)
    g = cp.asarray(sc)
    for k in (1, 64, 512, 2048, n + 3):
        ref = REF.topk_mask(sc, k)
        got = cp.asnumpy(GPU.topk_mask(g, k))
        assert np.array_equal(got, ref), (kind, s, n, k, np.flatnonzero((got != ref).any(axis=0))[:8])


# ---- state quantization ----------------------------------------------------------------------
def test_fake_quant_exact():
    x = rnd(17, 512, scale=3.0)
    x[0, :32] = 0.0
    x[1, :32] *= 1e-6  # tiny blocks: subnormal e4m3 codes
    x[2, 5] = 1e4
    for got, ref in [
        (GPU._fake_quant_fp8(cp.asarray(x), 32), REF.fake_quant_fp8(x, 32)),
        (GPU._fake_quant_fp4(cp.asarray(x), 16, True), REF.fake_quant_fp4(x, 16, True)),
        (GPU._fake_quant_fp4(cp.asarray(x), 32), REF.fake_quant_fp4(x, 32)),
    ]:
        g = cp.asnumpy(got)
        assert np.array_equal(g.view(np.uint32), ref.view(np.uint32)) or np.array_equal(g, ref), \
            np.argwhere(g != ref)[:5]


# ---- host <-> device glue --------------------------------------------------------------------
def test_pinned_uploads_survive_ring_wraps():
    from engine.ops.gpu.pinned import PinnedUploader

    up = PinnedUploader(8192)  # 4 KB halves: the 60 uploads below wrap many times
    host = [rnd(50 + 7 * i) for i in range(60)] + [RNG.integers(0, 9, (3, 5)), rnd(5000)]  # last: > a half
    dev = [up.upload(a) for a in host]
    cp.cuda.Device().synchronize()
    for a, d in zip(host, dev, strict=True):
        assert d.dtype == a.dtype and np.array_equal(cp.asnumpy(d), a)
    assert GPU.asarray(np.arange(5), dtype=np.int64).dtype == np.int64


def test_cat_matches_numpy():
    cases = [([rnd(127, 512), rnd(1, 512)], 0), ([rnd(0, 512), rnd(3, 512)], 0), ([rnd(1, 128), rnd(1, 40)], 1),
             ([rnd(3, 128), rnd(3, 40)], 1), ([rnd(4, 6)[:, ::2], rnd(2, 3)], 0)]  # the last two: cupy's path
    for arrays, axis in cases:
        got = GPU.cat([cp.asarray(a) if a.flags.c_contiguous else cp.asarray(a.copy())[:, :] for a in arrays], axis)
        assert np.array_equal(cp.asnumpy(got), np.concatenate(arrays, axis=axis))
    strided = cp.asarray(rnd(4, 6))[:, ::2]
    assert np.array_equal(cp.asnumpy(GPU.cat([strided, strided], 0)), np.concatenate([cp.asnumpy(strided)] * 2))


def test_region_graphs_release():
    """RegionGraphs.release drops every graph and its memory; the region runs eagerly once more,
    is captured anew and replays the same values."""
    from engine.ops.gpu.graphs import RegionGraphs

    graphs = RegionGraphs(enabled=True)
    x = cp.asarray(rnd(4, 256))

    def fn(a):
        return GPU.rmsnorm(a * 2.0, None, 1e-6)

    first = [cp.asnumpy(graphs("r", fn, x)) for _ in range(3)]
    assert graphs.captures == 1
    graphs.release()
    again = [cp.asnumpy(graphs("r", fn, x)) for _ in range(3)]
    assert graphs.captures == 2 and all(np.array_equal(a, first[-1]) for a in again)
