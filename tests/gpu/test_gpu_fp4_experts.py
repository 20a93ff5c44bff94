"""kernels/fp4_experts.cu (engine/ops/gpu/fp4_experts.py) against numpy in DeepSeek's numerics:
act_quant_bf16w is act_quant_fp8's codes times scales, bit for bit, in the kernel's K order; the
grouped GEMM (FP4 experts over a MoE's segment table) against the float64 product of the
fake-quantized rows and the dequantized weights. bf16 x bf16 products are exact and the tensor core
sums them in f32, so the bound is far tighter than the e4m3 GEMM's (fp8_mma.py). The outputs start
as NaN, so a row or column no segment wrote fails. Skipped where CuPy or an sm_90a GPU is absent (CI).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from gpu_cases import eager_and_replayed  # noqa: E402
from test_gpu_fp8_grouped import _table  # noqa: E402

from engine.bench import _timeit  # noqa: E402
from engine.checkpoint import formats  # noqa: E402
from engine.ops import kernels as K  # noqa: E402
from engine.ops.gpu.fp4_experts import (  # noqa: E402
    FE_ROWS,
    act_quant_bf16w,
    bf16_rows,
    bf16w_linear,
    bf16w_takes,
    fd_fp8_linear,
    fd_fp8_segments,
    fd_fp8_takes,
    fp4_experts_linear,
    fp8w_bf16_linear,
    fp8w_bf16_segments,
    fp8w_takes,
)
from engine.ops.gpu.fp8_linear import (  # noqa: E402
    GROUPED_ROWS,
    act_quant_fp8,
    fp8_grouped_linear,
    fp8_linear,
    gather_rows,
)
from engine.ops.gpu.weights import GpuWeight, _host_dequant  # noqa: E402
from engine.ops.kernels import FMT_BF16, FMT_FP4, FMT_FP8  # noqa: E402
from engine.ops.numpy_ops import NumpyOps  # noqa: E402

if K.device_arch() != "90a":
    pytest.skip("gemm_fp4_experts_sm90 is an sm_90a kernel", allow_module_level=True)

BF16_MMA_TOL = 2.0**-16  # of sum_k |x_k w_k|: exact products, f32 sums (the e4m3 MMA's bound is 2^-10)
# rows per expert: none, one, each side of the 64 / 128 / 256-row tiles (the wgmma N), several segments
COUNTS = [0, 1, 64, 65, 128, 129, 256, 0, 300, 37, 600]


def _x(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-12, 6, (m, 1)))
         * np.exp(rng.uniform(-3, 3, (1, k)))).astype(np.float32)
    x[:, : min(k, 32)] *= np.float32(1e-7)  # a block under the 1e-4 floor of amax
    if m > 2:
        x[1] = 0.0
    return x


def _weight(n: int, k: int, seed: int, lo: int = 100, hi: int = 140) -> GpuWeight:
    """e2m1 nibbles with UE8M0 exponents drawn from [lo, hi)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    scale = rng.integers(lo, hi, (n, k // 32)).astype(np.uint8)
    return GpuWeight(FMT_FP4, cp.asarray(data), cp.asarray(scale), (n, k), (1, 32))


def _tables(ws: list) -> tuple:
    return (cp.asarray(np.array([w.data.data.ptr for w in ws], np.uint64)),
            cp.asarray(np.array([w.scale.data.ptr for w in ws], np.uint64)))


def _unpermute_fd(xb: np.ndarray) -> np.ndarray:
    """act_quant_bf16w's order back to K's: within each 8, logical 2j holds j and 2j + 1 holds 4 + j."""
    m, k = xb.shape
    return xb.reshape(m, k // 8, 4, 2).transpose(0, 1, 3, 2).reshape(m, k)


def _unpermute(xb: np.ndarray) -> np.ndarray:
    """bf16_rows' order back to K's: logical 16 s + 8 h + 2 q + j holds 16 q + 4 s + 2 h + j."""
    s, h, q, j = np.meshgrid(np.arange(4), np.arange(2), np.arange(4), np.arange(2), indexing="ij")
    logical, phys = (16 * s + 8 * h + 2 * q + j).ravel(), (16 * q + 4 * s + 2 * h + j).ravel()
    out = np.empty_like(xb)
    for c in range(0, xb.shape[1], 64):
        out[:, c + phys] = xb[:, c + logical]
    return out


def _check(y: np.ndarray, xq: np.ndarray, ws: list, counts: list, halves: int = 1) -> None:
    """Each expert's rows of y (halves: w1 then w3 side by side) against float64 products."""
    n, e_n, r0 = ws[0].shape[0], len(counts), 0
    assert np.isfinite(y).all(), "a non-finite output, or a row or column no segment wrote"
    for e, c in enumerate(counts):
        for h in range(halves if c else 0):
            wd = _host_dequant(ws[e + h * e_n]).astype(np.float64)
            want, mag = xq[r0:r0 + c] @ wd.T, np.abs(xq[r0:r0 + c]) @ np.abs(wd).T
            err = np.abs(y[r0:r0 + c, h * n:(h + 1) * n] - want) / np.maximum(mag, 1e-30)
            assert float(err.max()) < BF16_MMA_TOL, f"expert {e}: worst error {err.max():.2e} of the products' sum"
        r0 += c


@pytest.mark.parametrize("m,k", [(1, 64), (5, 2304), (77, 5120)])
@pytest.mark.parametrize("bf", [False, True])
def test_act_quant_bf16w_is_act_quant_fp8_reordered(m, k, bf):
    x = _x(m, k, seed=m)
    xb = formats.bf16_to_f32(cp.asnumpy(act_quant_bf16w(cp.asarray(x), bf)))
    codes, scales = act_quant_fp8(cp.asarray(x), bf)
    want = formats.fp8_e4m3_to_f32(cp.asnumpy(codes)).reshape(m, k // 32, 32) * cp.asnumpy(scales)[:, :, None]
    np.testing.assert_array_equal(_unpermute_fd(xb), want.reshape(m, k))


@pytest.mark.parametrize("n,k", [(320, 1024), (200, 320), (131, 64), (136, 2304)])
def test_gathered_rows_two_weights_per_expert(n, k):
    """w1 and w3 in one launch (the doubled table's second half writes y columns n..), the rows
    gathered from 97 tokens (gather_rows: each pair's token row, bit for bit); weight tiles past N
    (an idle warpgroup), K of one chunk or chunk counts that wrap the ring, and scale bytes that end
    inside a 4-byte word (131 rows x 2)."""
    rng = np.random.default_rng(n + k)
    e_n, t, p = len(COUNTS), 97, sum(COUNTS)
    x = _x(t, k, seed=n)
    gather = rng.integers(0, t, p).astype(np.int32)
    ws = [_weight(n, k, seed=j) for j in range(2 * e_n)]
    y = cp.full((p, 2 * n), cp.nan, cp.float32)
    xb = act_quant_bf16w(cp.asarray(x))
    pairs = gather_rows(xb, cp.asarray(gather))
    np.testing.assert_array_equal(cp.asnumpy(pairs), cp.asnumpy(xb)[gather])
    fp4_experts_linear(pairs, cp.asarray(_table(COUNTS, FE_ROWS, 2, n)), *_tables(ws), ws[0], y)
    _check(cp.asnumpy(y), NumpyOps().fake_quant_fp8(x, 32).astype(np.float64)[gather], ws, COUNTS, halves=2)


def test_rows_in_place_and_bf16_out():
    """w2: the hidden rows in pair order, one weight per expert; with bf16=True the same sums,
    rounded as stored."""
    n, k, p = 256, 512, sum(COUNTS)
    h = _x(p, k, seed=3)
    ws = [_weight(n, k, seed=j) for j in range(len(COUNTS))]
    segs = cp.asarray(_table(COUNTS, FE_ROWS, 1, 0))
    y, yb = cp.full((p, n), cp.nan, cp.float32), cp.full((p, n), cp.nan, cp.float32)
    fp4_experts_linear(act_quant_bf16w(cp.asarray(h)), segs, *_tables(ws), ws[0], y)
    _check(cp.asnumpy(y), NumpyOps().fake_quant_fp8(h, 32).astype(np.float64), ws, COUNTS)
    fp4_experts_linear(act_quant_bf16w(cp.asarray(h)), segs, *_tables(ws), ws[0], yb, bf16=True)
    np.testing.assert_array_equal(cp.asnumpy(yb), formats.round_bf16(cp.asnumpy(y)))


@pytest.mark.parametrize("lo,hi,shift", [(1, 12, 100), (20, 60, 60), (130, 200, -93)])
def test_scales_far_from_one(lo, hi, shift):
    """UE8M0 bytes far below 127 (down to 2^-126: subnormal bf16 weights) and far above (over 128
    the kernel applies a scale as two bf16 factors): e2m1 values times any such scale stay exact; x
    is scaled by 2^shift to keep the products in range."""
    n, k, counts = 136, 256, [70, 0, 200]
    x = _x(sum(counts), k, seed=lo) * np.float32(2.0**shift)
    ws = [_weight(n, k, seed=j + lo, lo=lo, hi=hi) for j in range(len(counts))]
    y = cp.full((sum(counts), n), cp.nan, cp.float32)
    segs = cp.asarray(_table(counts, FE_ROWS, 1, 0))
    fp4_experts_linear(act_quant_bf16w(cp.asarray(x)), segs, *_tables(ws), ws[0], y)
    _check(cp.asnumpy(y), NumpyOps().fake_quant_fp8(x, 32).astype(np.float64), ws, counts)


def test_tokens_outside_the_segments_reach_no_output():
    """The token tiles come by TMA over X's whole extent, so a segment's tile holds the rows after it
    (another segment's, here NaN) up to its wgmma N, and zeros past X: those land in Y columns the
    epilogue skips. Rows no segment covers stay as they were."""
    n, k, counts, pad = 136, 320, [70, 150, 3], 5
    x = _x(pad + sum(counts) + pad, k, seed=11)
    ws = [_weight(n, k, seed=j + 40) for j in range(len(counts))]
    xb = act_quant_bf16w(cp.asarray(x))
    xb[:pad] = 0x7FC0  # bf16 NaN before and after the segments' rows
    xb[pad + sum(counts):] = 0x7FC0
    segs = _table(counts, FE_ROWS, 1, 0, spare=0).reshape(-1, 5).copy()
    segs[:, 1] += pad
    y = cp.full((x.shape[0], n), 7.0, cp.float32)
    fp4_experts_linear(xb, cp.asarray(segs.reshape(-1)), *_tables(ws), ws[0], y)
    got = cp.asnumpy(y)
    assert (got[:pad] == 7.0).all() and (got[pad + sum(counts):] == 7.0).all()
    xq = NumpyOps().fake_quant_fp8(x[pad:pad + sum(counts)], 32).astype(np.float64)
    _check(got[pad:pad + sum(counts)], xq, ws, counts)


def test_fp4_experts_capture_keeps_the_tensor_map():
    """The launch takes X's tensor map as a parameter (engine/ops/gpu/tma.py): a captured graph
    replays it with the pool's X, bit for bit the eager result."""
    n, k, counts = 192, 256, [100, 0, 256]
    ws = [_weight(n, k, seed=j + 60) for j in range(len(counts))]
    segs, tabs = cp.asarray(_table(counts, FE_ROWS, 1, 0)), _tables(ws)

    def run(xd):
        y = cp.full((sum(counts), n), cp.nan, cp.float32)
        fp4_experts_linear(act_quant_bf16w(xd), segs, *tabs, ws[0], y)
        return y

    want, replayed = eager_and_replayed(run, _x(sum(counts), k, seed=12))
    np.testing.assert_array_equal(replayed, want)


def test_rate_against_the_e4m3_gemm():
    """Not a timed assertion: V4.1-Flash's expert shapes over 16 experts of 256 pairs each (4,096
    rows), beside the grouped e4m3 GEMM on the same pairs (mma.sync on sm_90a for FP4, which its
    wgmma kernel no longer serves: the figure is for the record, not a comparison of like kernels)."""
    counts = [256] * 16
    for name, n, k in (("w1 / w3", 2304, 5120), ("w2", 5120, 2304)):
        ws = [_weight(n, k, seed=j) for j in range(len(counts))]
        x = cp.asarray(_x(sum(counts), k, seed=1))
        xb, codes = act_quant_bf16w(x), act_quant_fp8(x)
        y = cp.empty((sum(counts), n), cp.float32)
        segs, tabs = cp.asarray(_table(counts, FE_ROWS, 1, 0, spare=0)), _tables(ws)
        t = _timeit(lambda xb=xb, segs=segs, tabs=tabs, ws=ws, y=y: fp4_experts_linear(xb, segs, *tabs, ws[0], y),
                    iters=10)
        segs8 = cp.asarray(_table(counts, GROUPED_ROWS, 1, 0, spare=0))
        t8 = _timeit(lambda codes=codes, segs8=segs8, tabs=tabs, ws=ws, y=y:
                     fp8_grouped_linear(codes, segs8, *tabs, ws[0], y), iters=10)
        flop = 2 * sum(counts) * n * k
        print(f"experts {name} [{n} x {k}] x 4096 pairs: {t * 1e3:.3f} ms = {flop / t / 1e12:.0f} TFLOP/s "
              f"(grouped e4m3 mma.sync {t8 * 1e3:.3f} ms)")


def _fp8_weight(n: int, k: int, seed: int, block: tuple[int, int] = (128, 128)) -> GpuWeight:
    """e4m3 codes (no NaN) with power-of-two block scales, as V4.1's UE8M0 ones."""
    rng = np.random.default_rng(seed)
    data = (rng.integers(0, 256, (n, k)) & 0xF7).astype(np.uint8)
    e = rng.integers(-14, 4, (-(-n // block[0]), -(-k // block[1])))
    return GpuWeight(FMT_FP8, cp.asarray(data), cp.asarray(np.ldexp(1.0, e).astype(np.float32)), (n, k), block)


def _fp8w(x: cp.ndarray, w: GpuWeight, groups: int, bf16: bool = False) -> cp.ndarray:
    """fp8w_bf16_linear with its tables made here."""
    n = w.shape[0] // groups
    segs = cp.asarray(np.array(fp8w_bf16_segments(x.shape[0], groups, n, w.shape[1]), np.int32).reshape(-1))
    wptrs = [w.data.data.ptr + g * n * w.row_bytes() for g in range(groups)]
    sptrs = [w.scale.data.ptr + (g * n // w.block[0]) * w.gk * 4 for g in range(groups)]
    return fp8w_bf16_linear(x, segs, cp.asarray(np.array(wptrs, np.uint64)), cp.asarray(np.array(sptrs, np.uint64)),
                            w, groups, bf16)


@pytest.mark.parametrize("m,k", [(1, 64), (33, 4096)])
def test_bf16_rows_is_x_rounded_reordered(m, k):
    x = _x(m, k, seed=k)
    xb = formats.bf16_to_f32(cp.asnumpy(bf16_rows(cp.asarray(x))))
    np.testing.assert_array_equal(_unpermute(xb), formats.round_bf16(x))


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("m,n,k,groups", [(33, 64, 64, 1), (300, 520 - 8, 1280, 1), (257, 256, 576, 8),
                                          (600, 128, 320, 2), (70, 1024, 4096, 8)])
def test_fp8w_bf16_matches_numpy(m, n, k, groups, block):
    """gemm_fp8w_bf16 (wo_a's block-diagonal projection, the indexer's wk): x rounded to bf16 times the
    decoded FP8 weight, per group of weight rows on its own x columns; token tiles of 64 / 128 / 256
    rows and their tails, idle weight warpgroups, K of one chunk."""
    if n % block[0]:
        n += block[0] - n % block[0]
    x, w = _x(m, groups * k, seed=n + k), _fp8_weight(groups * n, k, seed=m, block=block)
    assert fp8w_takes(w, groups)
    y = cp.asnumpy(_fp8w(cp.asarray(x), w, groups))
    yb = cp.asnumpy(_fp8w(cp.asarray(x), w, groups, bf16=True))
    assert np.isfinite(y).all()
    xr, wd = formats.round_bf16(x).astype(np.float64), _host_dequant(w).astype(np.float64)
    for g in range(groups):
        xg, wg = xr[:, g * k:(g + 1) * k], wd[g * n:(g + 1) * n]
        err = np.abs(y[:, g * n:(g + 1) * n] - xg @ wg.T) / np.maximum(np.abs(xg) @ np.abs(wg).T, 1e-30)
        assert float(err.max()) < BF16_MMA_TOL, f"group {g}: worst error {err.max():.2e} of the products' sum"
    np.testing.assert_array_equal(yb, formats.round_bf16(y))


def test_fp8w_takes_power_of_two_scales_and_whole_groups():
    w = _fp8_weight(256, 64, seed=1)
    assert fp8w_takes(w) and fp8w_takes(w, 2)
    assert not fp8w_takes(w, 4)  # (64-row groups inside 128-row scale blocks)
    assert not fp8w_takes(GpuWeight(FMT_FP8, w.data, w.scale * np.float32(1.5), w.shape, w.block))
    assert not fp8w_takes(GpuWeight(FMT_FP8, w.data, w.scale, w.shape, (8, 32)))


def test_wo_a_routes_to_the_bf16_kernel_and_matches_cupy_ops():
    """DeepseekCupyOps.grouped_linear on a prompt chunk's rows: the bf16 wgmma kernel, within the same
    bound of CupyOps' GEMM (gemm_tc1: bf16 x, f32 sums) on the same weight."""
    from engine.model.numerics import BF16
    from engine.ops.gpu.deepseek import DeepseekCupyOps
    from engine.ops.gpu.ops import CupyOps

    t, g, k, n = 200, 8, 512, 128
    w = _fp8_weight(g * n, k, seed=5)
    w.use = BF16
    x = cp.asarray(formats.round_bf16(_x(t, g * k, seed=9))).reshape(t, g, k)
    got = cp.asnumpy(DeepseekCupyOps().grouped_linear(x, w, g))
    assert w.__dict__.get("_fp8w") is True, "the bf16 wgmma path was not taken"
    base = CupyOps()
    base.bf16 = True
    want = cp.asnumpy(base.grouped_linear(x, w, g))
    xr, wd = cp.asnumpy(x).astype(np.float64), _host_dequant(w).astype(np.float64).reshape(g, n, k)
    mag = np.einsum("tgi,goi->tgo", np.abs(xr), np.abs(wd))
    assert float((np.abs(got - want) / np.maximum(mag, 1e-30)).max()) < 2 * 2.0**-8  # (both rounded to bf16)


def test_wo_a_on_the_bf16_kernel_captures():
    """A verify or draft step of more than TC_MAX_ROWS rows reaches this path inside a graph capture:
    once warm it copies nothing from the host, and the replay equals the eager result bit for bit."""
    from engine.model.numerics import BF16
    from engine.ops.gpu.deepseek import DeepseekCupyOps

    ops, (t, g, k, n) = DeepseekCupyOps(), (192, 8, 512, 128)
    w = _fp8_weight(g * n, k, seed=6)
    w.use = BF16
    x = formats.round_bf16(_x(t, g * k, seed=4)).reshape(t, g, k)
    want, replayed = eager_and_replayed(lambda xd: ops.grouped_linear(xd, w, g), x)
    np.testing.assert_array_equal(replayed, want)


def _bf16_weight(n: int, k: int, seed: int) -> GpuWeight:
    """bf16 weights of several magnitudes (rows scaled by 2^-8 .. 2^4), subnormals and zeros among them."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * np.exp2(rng.integers(-8, 5, (n, 1)))
    w[:, 3] = 0.0
    w[::7, 5] = 1e-39  # (a bf16 subnormal)
    return GpuWeight(FMT_BF16, cp.asarray(formats.f32_to_bf16(w.astype(np.float32))), None, (n, k))


@pytest.mark.parametrize("m,n,k", [(33, 64, 64), (192, 520 - 8, 1280), (257, 256, 576), (600, 128, 320),
                                   (70, 1024, 4096), (40, 4096, 7168)])
def test_bf16w_matches_numpy(m, n, k):
    """gemm_bf16w (bf16-stored linears past TC_MAX_ROWS rows): x rounded to bf16 times the weight,
    exact products summed in f32; token tiles of 64 / 128 / 256 rows and their tails, several token
    segments, idle weight warpgroups (N not a multiple of 128), K of one chunk and of many."""
    x, w = _x(m, k, seed=n + k), _bf16_weight(n, k, seed=m)
    assert bf16w_takes(w)
    segs = cp.asarray(np.array(fp8w_bf16_segments(m, 1, n, k), np.int32).reshape(-1))
    wptrs = w.ptr_tables()[0]
    y = cp.asnumpy(bf16w_linear(cp.asarray(x), segs, wptrs, w))
    yb = cp.asnumpy(bf16w_linear(cp.asarray(x), segs, wptrs, w, bf16=True))
    assert np.isfinite(y).all()
    xr = formats.round_bf16(x).astype(np.float64)
    wd = formats.bf16_to_f32(cp.asnumpy(w.data)).astype(np.float64)
    err = np.abs(y - xr @ wd.T) / np.maximum(np.abs(xr) @ np.abs(wd).T, 1e-30)
    assert float(err.max()) < BF16_MMA_TOL, f"worst error {err.max():.2e} of the products' sum"
    np.testing.assert_array_equal(yb, formats.round_bf16(y))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_split_k_matches_one_pass(fmt, monkeypatch):
    """A skinny launch (192 rows, 4 weight tiles) split over K (bw_splits: the splits' sums added in a
    fixed order by bw_sum_splits) within the same bound of the reference as one pass over K, and
    rounded to bf16 from the total; the same launch twice gives the same bits."""
    import engine.ops.gpu.fp4_experts as fe

    m, n, k = 192, 512, 4096
    x = cp.asarray(_x(m, k, seed=7))
    w = _bf16_weight(n, k, seed=5) if fmt == "bf16" else _fp8_weight(n, k, seed=5)
    segs = cp.asarray(np.array(fp8w_bf16_segments(m, 1, n, k), np.int32).reshape(-1))

    def run(bf16=False):
        if fmt == "bf16":
            return cp.asnumpy(bf16w_linear(x, segs, w.ptr_tables()[0], w, bf16=bf16))
        return cp.asnumpy(_fp8w(x, w, 1, bf16))

    assert fe.bw_splits(-(-n // fe.FE_COLS), k // fe.CHUNK) > 1
    split, split_bf = run(), run(True)
    np.testing.assert_array_equal(split, run())
    np.testing.assert_array_equal(split_bf, formats.round_bf16(split))
    monkeypatch.setattr(fe, "SPLIT_MIN_CHUNKS", k)
    assert fe.bw_splits(-(-n // fe.FE_COLS), k // fe.CHUNK) == 1
    whole = run()
    xr = formats.round_bf16(cp.asnumpy(x)).astype(np.float64)
    wd = (formats.bf16_to_f32(cp.asnumpy(w.data)) if fmt == "bf16" else _host_dequant(w)).astype(np.float64)
    mag = np.maximum(np.abs(xr) @ np.abs(wd).T, 1e-30)
    for y in (split, whole):
        assert float((np.abs(y - xr @ wd.T) / mag).max()) < BF16_MMA_TOL


@pytest.mark.parametrize("use", ["bf16", "f32"])
def test_bf16_linear_routes_to_the_bf16_kernel_and_captures(use, monkeypatch):
    """DeepseekCupyOps.linear on a bf16-stored weight past TC_MAX_ROWS rows, bf16 in use or fp32 (the
    gate, the heads: bf16 x, f32 out), takes gemm_bf16w: within the bound of CupyOps' GEMM on the
    same weight (rounded to bf16 where the use returns bf16); inside a graph capture it copies nothing
    from the host once warm, and the replay equals the eager result bit for bit."""
    from engine.model.numerics import BF16, F32
    from engine.ops.gpu.deepseek import DeepseekCupyOps
    from engine.ops.gpu.ops import CupyOps

    ops, (t, n, k) = DeepseekCupyOps(), (192, 1024, 4096)
    w = _bf16_weight(n, k, seed=8)
    w.use = BF16 if use == "bf16" else F32
    x = cp.asarray(formats.round_bf16(_x(t, k, seed=3)))
    launched, real = [], K.function_with_smem
    with monkeypatch.context() as m:
        m.setattr(K, "function_with_smem", lambda mod, name, smem: launched.append(name) or real(mod, name, smem))
        got = ops.linear(x, w)
    assert "gemm_bf16w_sm90" in launched, launched
    base = CupyOps()
    base.bf16 = True
    want = cp.asnumpy(base.linear(x, w))
    xr, wd = cp.asnumpy(x).astype(np.float64), formats.bf16_to_f32(cp.asnumpy(w.data)).astype(np.float64)
    mag = np.maximum(np.abs(xr) @ np.abs(wd).T, 1e-30)
    if use == "bf16":
        assert float((np.abs(cp.asnumpy(got) - formats.round_bf16(want)) / mag).max()) < 2 * 2.0**-8
    else:  # (f32 out: both sum exact products in f32)
        assert float((np.abs(cp.asnumpy(got) - want) / mag).max()) < BF16_MMA_TOL

    eager, replayed = eager_and_replayed(lambda xd: ops.linear(xd, w), cp.asnumpy(x))
    np.testing.assert_array_equal(replayed, eager)
    np.testing.assert_array_equal(eager, cp.asnumpy(got))


def test_fp8w_bf16_rate_against_gemm_tc1():
    """Not a timed assertion: V4.1-Flash's wo_a ([8 x 1024] x 4096 per group) at 16384 rows, beside
    CupyOps' grouped_linear (gemm_tc1 on mma.sync)."""
    from engine.model.numerics import BF16
    from engine.ops.gpu.ops import CupyOps

    t, g, k, n = 16384, 8, 4096, 1024
    w = _fp8_weight(g * n, k, seed=2)
    w.use = BF16
    x = cp.asarray(_x(t, g * k, seed=1)).reshape(t, g, k)
    base = CupyOps()
    base.bf16 = True
    tw = _timeit(lambda: _fp8w(x.reshape(t, g * k), w, g, bf16=True), iters=5)
    tb = _timeit(lambda: base.grouped_linear(x, w, g), iters=5)
    flop = 2 * t * g * n * k
    print(f"wo_a [{g} x {n} x {k}] x {t} rows: bf16 wgmma {tw * 1e3:.3f} ms = {flop / tw / 1e12:.0f} TFLOP/s, "
          f"gemm_tc1 {tb * 1e3:.3f} ms = {flop / tb / 1e12:.0f}")


def _fd(xb: cp.ndarray, w: GpuWeight, bf16: bool = False) -> cp.ndarray:
    segs = cp.asarray(np.array(fd_fp8_segments(xb.shape[0]), np.int32).reshape(-1))
    return fd_fp8_linear(xb, segs, w, bf16)


@pytest.mark.parametrize("m,n,k,block", [(1, 64, 64, (128, 128)), (300, 200, 320, (128, 128)),
                                         (77, 136, 2304, (32, 32)), (513, 384, 1280, (32, 32))])
@pytest.mark.parametrize("bf", [False, True])
def test_fd_fp8_matches_numpy(m, n, k, block, bf):
    """gemm_fd_fp8_sm90 (the FP8 weight decoded into shared memory, bf16 wgmma) on act_quant_bf16w's
    rows against the float64 product of the fake-quantized x and the dequantized weight: one row,
    tails in M (64 / 128 / 256-row tiles), N past a tile (an idle warpgroup), K of one chunk or a
    3-stage ring that wraps, 32 x 32 and 128 x 128 blocks; bf16 out as the rounded f32 sums."""
    x, w = _x(m, k, seed=n + k), _fp8_weight(n, k, seed=m, block=block)
    assert fd_fp8_takes(w)
    y = _fd(act_quant_bf16w(cp.asarray(x)), w, bf)
    xq = NumpyOps().fake_quant_fp8(x, 32).astype(np.float64)
    wd = _host_dequant(w).astype(np.float64)
    want, mag = xq @ wd.T, np.abs(xq) @ np.abs(wd).T
    got = cp.asnumpy(y).astype(np.float64)
    tol = 2.0**-8 if bf else BF16_MMA_TOL
    assert np.isfinite(got).all()
    assert float((np.abs(got - want) / np.maximum(mag, 1e-30)).max()) < tol


@pytest.mark.parametrize("lo,hi,shift", [(3, 20, 100), (128, 150, -40)])
def test_fd_fp8_scales_far_from_one(lo, hi, shift):
    """Block scales 2^(e - 127) for e far below 127, down to the least fd_fp8_takes allows (subnormal
    bf16 weights), and above 134 (the decode's two factors); x scaled by 2^shift to keep the products
    in range."""
    m, n, k = 70, 136, 256
    rng = np.random.default_rng(lo)
    data = (rng.integers(0, 256, (n, k)) & 0xF7).astype(np.uint8)
    scale = np.ldexp(1.0, rng.integers(lo, hi, (-(-n // 32), k // 32)) - 127).astype(np.float32)
    w = GpuWeight(FMT_FP8, cp.asarray(data), cp.asarray(scale), (n, k), (32, 32))
    assert fd_fp8_takes(w)
    tiny = w.scale.copy()
    tiny[0, 0] = np.float32(2.0**-125)  # (a code of 2^-9 times it is no bf16 number)
    assert not fd_fp8_takes(GpuWeight(FMT_FP8, w.data, tiny, (n, k), (32, 32)))
    x = _x(m, k, seed=lo) * np.float32(2.0**shift)
    y = cp.asnumpy(_fd(act_quant_bf16w(cp.asarray(x)), w)).astype(np.float64)
    xq, wd = NumpyOps().fake_quant_fp8(x, 32).astype(np.float64), _host_dequant(w).astype(np.float64)
    want, mag = xq @ wd.T, np.abs(xq) @ np.abs(wd).T
    assert float((np.abs(y - want) / np.maximum(mag, 1e-30)).max()) < BF16_MMA_TOL


def test_fd_fp8_rate_against_the_e4m3_gemm():
    """Not a timed assertion: V4.1-Flash's dense FP8 linears at a 4,096-row chunk, gemm_fd_fp8 beside
    the e4m3 GEMM (fp8_linear) on the same rows, both bf16 in and out."""
    m = 4096
    for name, n, k, block in (("wq_b", 32768, 1280, (128, 128)), ("wo_b", 5120, 8192, (128, 128)),
                              ("wo_b 32 x 32", 5120, 8192, (32, 32))):
        w = _fp8_weight(n, k, seed=n, block=block)
        x = cp.asarray(_x(m, k, seed=1))
        xb = act_quant_bf16w(x, True)
        segs = cp.asarray(np.array(fd_fp8_segments(m), np.int32).reshape(-1))
        t = _timeit(lambda xb=xb, w=w, segs=segs: fd_fp8_linear(xb, segs, w, True), iters=10)
        te = _timeit(lambda x=x, w=w: fp8_linear(x, w, bf16=True), iters=10)
        tq = _timeit(lambda x=x: act_quant_bf16w(x, True), iters=10)
        flop = 2 * m * n * k
        print(f"fd fp8 {name} [{n} x {k}] x {m}: {t * 1e3:.3f} ms = {flop / t / 1e12:.0f} TFLOP/s "
              f"(+ act_quant_bf16w {tq * 1e3:.3f} ms); e4m3 GEMM with its act_quant {te * 1e3:.3f} ms = "
              f"{flop / te / 1e12:.0f} TFLOP/s")
