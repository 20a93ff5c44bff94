"""CupyOps' norms, RoPE, the mHC ops, Engram's gate, pooling and the state quantizers against the numpy
reference; tolerances in gpu_cases.py. Skipped where CuPy or a GPU is absent (CI)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_cases import F32_TOL, GPU, REF, cp, rel, rnd


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
    np.testing.assert_array_equal(cp.asnumpy(got), REF.rope(x, c, s, inverse))  # (no FMA: bit for bit)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("shape", [(4, 64, 512), (3, 5, 96), (6, 64)])
def test_rope_in_place(shape, bf16):
    """rope_tail: the trailing pairs rotated in x (bf16: rounded, as the deepseek numerics' rope),
    the other channels untouched; bit for bit the numpy reference (both round each product, no
    FMA) and the copying rope on the rotated channels."""
    from engine.ops.deepseek_ops import DeepseekOps
    from engine.ops.gpu.deepseek import DeepseekCupyOps

    ref_ops, gpu_ops = (DeepseekOps(), DeepseekCupyOps()) if bf16 else (REF, GPU)
    x = rnd(*shape)
    ang = rnd(shape[0], 16)
    c, s = np.cos(ang), np.sin(ang)
    xd = cp.asarray(x)
    got = gpu_ops.rope(xd, cp.asarray(c), cp.asarray(s), True, in_place=True)
    assert got is xd
    want = ref_ops.rope(x.copy(), c, s, True, in_place=True)
    g = cp.asnumpy(got)
    np.testing.assert_array_equal(g[..., :-32], x[..., :-32])
    np.testing.assert_array_equal(g, want)
    np.testing.assert_array_equal(g[..., -32:], cp.asnumpy(gpu_ops.rope(cp.asarray(x), cp.asarray(c), cp.asarray(s),
                                                                         True))[..., -32:])


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
# d 1000: the last 512-float slice is partial. From HC_ROWS_MIN tokens (a prompt chunk) the partials of
# hc 3 and 4 take hc_mix_partial_rows: 200 tokens (a partial block of 32), d 1000 (a partial 128-float
# slice).
@pytest.mark.parametrize("t,hc,d", [(1, 4, 5120), (6, 4, 5120), (3, 4, 1000), (2, 3, 5120), (2, 8, 5120),
                                    (200, 4, 5120), (70, 4, 1000), (64, 3, 5120), (64, 8, 1024)])
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


# a thread per 4 columns of a token, every stream: widths past one block of 256 x 4 (1028), a
# prompt chunk's tokens, 3 and 8 streams
@pytest.mark.parametrize("t,hc,d", [(1, 4, 256), (300, 4, 1028), (7, 3, 5120), (2, 8, 4096)])
def test_hc_expand_shapes(t, hc, d):
    res, post, comb, out = rnd(t, hc, d), rnd(t, hc), rnd(t, hc, hc), rnd(t, d)
    got = GPU.hc_expand(cp.asarray(out), cp.asarray(res), cp.asarray(post), cp.asarray(comb))
    assert rel(got, REF.hc_expand(out, res, post, comb)) < F32_TOL


def test_engram_mix():
    t, hc, d = 6, 4, 5120
    h, key, value, qk = rnd(t, hc, d), rnd(t, hc, d), rnd(t, d), rnd(hc, d)
    got = GPU.engram_mix(*(cp.asarray(a) for a in (h, key, value, qk)), 1e-20)
    assert rel(got, REF.engram_mix(h, key, value, qk, 1e-20)) < F32_TOL


def test_gated_pool():
    kv, gate = rnd(9, 2, 512), rnd(9, 2, 512)
    gate[0, 0, :5] = -np.inf
    assert rel(GPU.gated_pool(cp.asarray(kv), cp.asarray(gate)), REF.gated_pool(kv, gate)) < 1e-6




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
