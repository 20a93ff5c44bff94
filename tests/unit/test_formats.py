"""Number formats against float64 references built from the format definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.checkpoint import formats as F


# ----------------------------------------------------------------------------- references
def ref_fp8_e4m3(code: int) -> float:
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return s * m * 2.0**-9
    return s * (1 + m / 8) * 2.0 ** (e - 7)


def ref_fp4(code: int) -> float:
    s = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return s * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def ref_round_to_set(x: np.ndarray, values: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Nearest of `values` (finite, sorted magnitudes), ties to the even code; saturating."""
    out = np.empty(x.shape, dtype=np.int64)
    for i, v in enumerate(np.abs(x.astype(np.float64)).ravel()):
        d = np.abs(values - v)
        best = np.flatnonzero(d == d.min())
        pick = best[0] if len(best) == 1 else best[codes[best] % 2 == 0][0]
        out.flat[i] = codes[pick]
    return out


def fp8_pos_table():
    codes = np.array([c for c in range(0x7F)])
    return np.array([ref_fp8_e4m3(c) for c in codes]), codes


def rng(seed=0):
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- bf16
def test_bf16_all_codes_decode():
    u = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f = F.bf16_to_f32(u)
    ref = (u.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(f.view(np.uint32), ref.view(np.uint32))
    # every finite code round-trips bit-exactly
    fin = np.isfinite(f)
    assert np.array_equal(F.f32_to_bf16(f[fin]), u[fin])


def test_bf16_rne_ties_and_nan():
    # 1 + 2**-8 lies exactly between bf16 1.0 and 1+2**-7: tie -> even (1.0)
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8)], dtype=np.float32)
    got = F.bf16_to_f32(F.f32_to_bf16(x))
    assert got.tolist() == [1.0, 1 + 2 * 2**-7, 1 + 2**-7, -1.0]
    assert np.isnan(F.bf16_to_f32(F.f32_to_bf16(np.array([np.nan], np.float32))))[0]
    assert F.bf16_to_f32(F.f32_to_bf16(np.array([3.4e38], np.float32)))[0] == np.inf


def test_bf16_random_round_trip_is_nearest():
    x = (rng(1).standard_normal(20000) * 10.0 ** rng(2).integers(-20, 20, 20000)).astype(np.float32)
    b = F.bf16_to_f32(F.f32_to_bf16(x)).astype(np.float64)
    x64 = x.astype(np.float64)
    # error at most half a bf16 ulp (8 bits of precision)
    ulp = np.ldexp(1.0, np.frexp(np.abs(x64))[1] - 8)
    assert np.all(np.abs(b - x64) <= ulp / 2)


# ----------------------------------------------------------------------------- fp8 e4m3
def test_fp8_every_code_decodes():
    codes = np.arange(256, dtype=np.uint8)
    f = F.fp8_e4m3_to_f32(codes)
    for c in range(256):
        r = ref_fp8_e4m3(c)
        assert (math.isnan(r) and np.isnan(f[c])) or f[c] == r, c
    assert f[0x7E] == 448.0 and f[0x01] == 2.0**-9
    # and every non-NaN code encodes back to itself (except -0 -> 0x80 which is itself)
    fin = ~np.isnan(f)
    assert np.array_equal(F.f32_to_fp8_e4m3(f[fin]), codes[fin])
    assert np.array_equal(F.fp8_e4m3_to_f32(codes.view(np.int8)), f, equal_nan=True)


def test_fp8_nan_and_saturation():
    x = np.array([np.nan, -np.nan, 1000.0, -1e6, np.inf, -np.inf, 464.0, 465.0, 449.0], np.float32)
    c = F.f32_to_fp8_e4m3(x)
    assert c[0] & 0x7F == 0x7F and c[1] & 0x7F == 0x7F
    assert F.fp8_e4m3_to_f32(c[2:]).tolist() == [448, -448, 448, -448, 448, 448, 448]


def test_fp8_rne_random_against_reference():
    vals, codes = fp8_pos_table()
    x = (rng(3).standard_normal(4000) * np.exp2(rng(4).integers(-12, 9, 4000))).astype(np.float32)
    # include exact ties: midpoints of adjacent representables
    mids = ((vals[1:] + vals[:-1]) / 2).astype(np.float32)
    x = np.concatenate([x, mids, -mids, vals.astype(np.float32)])
    got = F.f32_to_fp8_e4m3(x)
    ref = ref_round_to_set(x, vals, codes) | np.where(np.signbit(x), 0x80, 0)
    assert np.array_equal(got.astype(np.int64), ref)


# ----------------------------------------------------------------------------- e8m0
def test_e8m0_every_code_and_round_trip():
    c = np.arange(256, dtype=np.uint8)
    f = F.e8m0_to_f32(c)
    for b in range(255):
        assert f[b] == np.float32(2.0 ** (b - 127)), b
    assert np.isnan(f[255])
    assert np.array_equal(F.f32_to_e8m0(f[:255]), c[:255])
    assert F.f32_to_e8m0(np.array([np.nan]))[0] == 255


def test_e8m0_exact_and_ceil():
    with pytest.raises(ValueError):
        F.f32_to_e8m0(np.array([3.0]))
    assert F.f32_to_e8m0(np.array([3.0, 4.0, 0.3]), mode="ceil").tolist() == [129, 129, 126]
    assert F.ue8m0_scale_for(np.array([6.0, 6.1, 3.0, 0.0001]), 6.0).tolist() == [
        1.0,
        2.0,
        0.5,
        2.0 ** math.ceil(math.log2(0.0001 / 6)),
    ]


# ----------------------------------------------------------------------------- fp4 e2m1
def test_fp4_every_code_decodes_and_packs_low_nibble_first():
    codes = np.arange(16, dtype=np.uint8)
    f = F.fp4_to_f32(codes)
    assert f.tolist() == [ref_fp4(c) for c in range(16)]
    assert f[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    # every byte: low nibble is element 0
    b = np.arange(256, dtype=np.uint8).view(np.int8)[:, None]
    u = F.fp4_unpack(b)
    for byte in range(256):
        assert u[byte].tolist() == [ref_fp4(byte & 15), ref_fp4(byte >> 4)]
    assert np.array_equal(F.fp4_pack(u), b)
    assert F.fp4_pack(np.array([[1.0, -6.0]], np.float32)).view(np.uint8)[0, 0] == 0x2 | (0xF << 4)
    with pytest.raises(ValueError):
        F.fp4_pack(np.array([[2.5, 0.0]], np.float32))


def test_fp4_rne_ties_and_saturation():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.25, -5.0, 0.26], np.float32)
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0, 0.5]
    assert F.fp4_to_f32(F.f32_to_fp4(x)).tolist() == want


def test_fp4_random_against_reference():
    vals = F.FP4_E2M1_VALUES.astype(np.float64)
    codes = np.arange(8)
    x = (rng(5).standard_normal(3000) * 3).astype(np.float32)
    got = F.f32_to_fp4(x).astype(np.int64)
    ref = ref_round_to_set(x, vals, codes) | np.where(np.signbit(x), 8, 0)
    assert np.array_equal(got, ref)


# ----------------------------------------------------------------------------- block dequant
@pytest.mark.parametrize("shape,block", [((64, 96), (32, 32)), ((70, 45), (32, 32)),
                                         ((300, 260), (128, 128)), ((33, 17), (16, 8))])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_fp8_blocks_dequant_and_quant(shape, block, scale_fmt):
    r = rng(6)
    n, k = shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    codes = r.integers(0, 256, size=shape).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaNs
    if scale_fmt == "ue8m0":
        scale = r.integers(110, 135, size=(gn, gk)).astype(np.uint8)
        sref = 2.0 ** (scale.astype(np.float64) - 127)
    else:
        scale = r.uniform(1e-3, 1.0, size=(gn, gk)).astype(np.float32)
        sref = scale.astype(np.float64)
    got = F.dequant_fp8_blocks(codes, scale, block)
    ref = np.empty(shape)
    for i in range(n):
        for j in range(k):
            ref[i, j] = ref_fp8_e4m3(int(codes[i, j])) * sref[i // bn, j // bk]
    # products of two floats are rounded once to float32
    assert got.dtype == np.float32 and np.array_equal(got, ref.astype(np.float32))

    # quantizer: decodes within half an fp8 ulp (relative 2**-4) of the block scale grid
    w = (r.standard_normal(shape) * np.exp2(r.integers(-6, 4, size=(gn, gk)))
         .repeat(bn, 0).repeat(bk, 1)[:n, :k]).astype(np.float32)
    q, s = F.quant_fp8_blocks(w, block, scale_fmt)
    assert q.dtype == np.uint8 and s.shape == (gn, gk)
    assert s.dtype == (np.uint8 if scale_fmt == "ue8m0" else np.float32)
    back = F.dequant_fp8_blocks(q, s, block).astype(np.float64)
    sfull = (F.e8m0_to_f32(s) if scale_fmt == "ue8m0" else s).astype(np.float64)
    sfull = sfull.repeat(bn, 0).repeat(bk, 1)[:n, :k]
    assert np.all(np.abs(back - w) <= np.maximum(np.abs(w) * 2.0**-4, sfull * 2.0**-10) * 1.0001)
    assert np.all(np.abs(back) <= 448 * sfull * (1 + 2.0**-20))


def test_fp4_experts_dequant_and_quant():
    r = rng(7)
    n, k = 40, 128
    packed = r.integers(-128, 128, size=(n, k // 2)).astype(np.int8)
    scale = r.integers(115, 135, size=(n, k // 32)).astype(np.uint8)
    got = F.dequant_fp4_experts(packed, scale)
    pu = packed.view(np.uint8)
    for i in range(n):
        for j in range(k):
            byte = int(pu[i, j // 2])
            c = byte & 15 if j % 2 == 0 else byte >> 4
            assert got[i, j] == ref_fp4(c) * 2.0 ** (int(scale[i, j // 32]) - 127)

    w = (r.standard_normal((n, k)) * 0.02).astype(np.float32)
    p, s = F.quant_fp4_rows(w)
    assert p.dtype == np.int8 and p.shape == (n, k // 2) and s.dtype == np.uint8 and s.shape == (n, 4)
    amax = np.abs(w.reshape(n, 4, 32)).max(axis=2).astype(np.float64)
    assert np.array_equal(F.e8m0_to_f32(s).astype(np.float64), 2.0 ** np.ceil(np.log2(amax / 6)))
    back = F.dequant_fp4_experts(p, s)
    sfull = F.e8m0_to_f32(s).repeat(32, 1)
    assert np.all(np.abs(back - w) <= sfull * 1.0 + 1e-12)  # half of the widest e2m1 step (2)
    # exactly representable data survive a round trip
    vals = F.fp4_to_f32(r.integers(0, 16, size=(n, k))) * sfull
    p2, s2 = F.quant_fp4_rows(vals)
    ok = np.abs(vals.reshape(n, 4, 32)).max(axis=2) == 6 * F.e8m0_to_f32(s)
    assert np.array_equal(F.dequant_fp4_experts(p2, s2)[ok.repeat(32, 1)], vals[ok.repeat(32, 1)])
