"""Number formats of DeepSeek-V4 / V4.1 checkpoints, encoded and decoded in pure numpy.

bf16, float8 e4m3fn, UE8M0 (float8_e8m0fnu) scales and FP4 e2m1 (two per byte, low nibble
first), plus the block-scaled (de)quantizers used for weights. Every encoder rounds to
nearest, ties to even, like the hardware casts DeepSeek's reference relies on.
"""

from __future__ import annotations

import math

import numpy as np

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
# e2m1 magnitudes by 3-bit code; bit 3 of a nibble is the sign.
FP4_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)

__all__ = [
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "FP4_E2M1_VALUES",
    "bf16_to_f32",
    "f32_to_bf16",
    "f16_to_f32",
    "fp8_e4m3_to_f32",
    "f32_to_fp8_e4m3",
    "e8m0_to_f32",
    "f32_to_e8m0",
    "fp4_to_f32",
    "f32_to_fp4",
    "fp4_unpack",
    "fp4_pack",
    "fp4_pack_codes",
    "fp4_unpack_codes",
    "dequant_fp8_blocks",
    "quant_fp8_blocks",
    "dequant_fp4_experts",
    "quant_fp4_rows",
    "ue8m0_scale_for",
]


# ---------------------------------------------------------------------------------------------
# bf16 / f16


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16, or anything viewable as such) -> float32, exact."""
    u = np.asarray(u16)
    if u.dtype != np.uint16:
        u = u.view(np.uint16)
    return (u.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays a (quiet) NaN."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(f)
    if nan.any():
        rounded = np.where(nan, (bits >> 16) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), kept as float32: what storing an
    activation in bf16 does (f32_to_bf16 then bf16_to_f32 in one pass; infinities stay)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = bits >> np.uint32(16)  # one temporary, updated in place: the numpy backend calls this a few
    r &= np.uint32(1)  # hundred times a token, mostly on small rows, where each array allocated costs
    r += np.uint32(0x7FFF)  # as much as the arithmetic
    r += bits
    r &= np.uint32(0xFFFF0000)
    return r.view(np.float32)


def f16_to_f32(u16: np.ndarray) -> np.ndarray:
    u = np.asarray(u16)
    return u.view(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# float8 e4m3fn: bias 7, no infinities, S.1111.111 is NaN, max 448, subnormal step 2**-9.


def _fp8_e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    val = sign * mag
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


_FP8_E4M3_LUT = _fp8_e4m3_table()


def fp8_e4m3_to_f32(u8: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes (uint8 / int8 / any 1-byte view) -> float32."""
    u = np.asarray(u8)
    if u.dtype != np.uint8:
        u = u.view(np.uint8)
    return _FP8_E4M3_LUT[u]


def f32_to_fp8_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> float8 e4m3fn bytes (uint8): RNE, saturating to +-448, NaN -> 0x7f/0xff.

    Works on the float32 bit pattern (fast enough for multi-GB checkpoints): normals round by
    adding the RNE bias below the 3 kept mantissa bits; subnormals (< 2**-6) are an exact
    multiply by 2**9 and np.rint. Inputs are rounded to float32 first."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    sign = ((bits >> 24) & np.uint32(0x80)).astype(np.uint8)
    mag_bits = bits & np.uint32(0x7FFFFFFF)
    mag = mag_bits.view(np.float32)
    # normal path: keep sign-less exponent + 3 mantissa bits, RNE on the 20 dropped bits
    r = (mag_bits + (np.uint32(0x7FFFF) + ((mag_bits >> 20) & np.uint32(1)))) >> 20
    # r = (f32 biased exponent << 3) | mantissa; e4m3 biased exponent = f32 exponent - 120
    code = r.astype(np.int32) - (120 << 3)
    code = np.minimum(code, 0x7E)  # saturate (covers inf: its exponent is 255)
    sub = mag < np.float32(2.0**-6)
    if sub.any():
        code = np.where(sub, np.rint(mag * np.float32(2.0**9)).astype(np.int32), code)
    out = code.astype(np.uint8)
    nan = np.isnan(f)
    if nan.any():
        out = np.where(nan, np.uint8(0x7F), out)
    return out | sign


# ---------------------------------------------------------------------------------------------
# UE8M0 (float8_e8m0fnu): unsigned power-of-two exponent, 2**(b - 127), 0xff is NaN.

_E8M0_LUT = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(np.float32)


def e8m0_to_f32(u8: np.ndarray) -> np.ndarray:
    u = np.asarray(u8)
    if u.dtype != np.uint8:
        u = u.view(np.uint8)
    return _E8M0_LUT[u]


def f32_to_e8m0(x: np.ndarray, mode: str = "exact") -> np.ndarray:
    """Positive scales -> UE8M0 bytes. mode 'exact': every value must be a power of two in
    [2**-127, 2**127] (ValueError otherwise); 'ceil': round up to the next power of two, as
    DeepSeek derives its scales. NaN -> 255."""
    f = np.asarray(x, dtype=np.float64)
    nan = np.isnan(f)
    safe = np.where(nan, 1.0, f)
    if np.any(safe <= 0):
        raise ValueError("e8m0 scales must be positive")
    m, e = np.frexp(safe)  # safe = m * 2**e, m in [0.5, 1)
    exp = e - 1
    if mode == "exact":
        if np.any(m != 0.5):
            raise ValueError("e8m0 scale is not a power of two")
    elif mode == "ceil":
        exp = np.where(m != 0.5, exp + 1, exp)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    if np.any((exp < -127) | (exp > 127)):
        raise ValueError("e8m0 scale out of range [2**-127, 2**127]")
    return np.where(nan, 255, exp + 127).astype(np.uint8)


def pow2_ceil_f32(t: np.ndarray) -> np.ndarray:
    """2**ceil(log2 t) for positive float32 t, from the exponent bits (as DeepSeek's kernels round
    their UE8M0 scales; float32 in, float32 out)."""
    bits = np.asarray(t, dtype=np.float32).view(np.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
    return np.ldexp(np.float32(1.0), k).astype(np.float32)


def ue8m0_scale_for(amax: np.ndarray, qmax: float) -> np.ndarray:
    """DeepSeek's power-of-two scale: 2**ceil(log2(amax / qmax)) (float64, computed exactly)."""
    a = np.asarray(amax, dtype=np.float64) / qmax
    m, e = np.frexp(a)
    exp = np.where(m == 0.5, e - 1, e)
    return np.ldexp(1.0, exp)


# ---------------------------------------------------------------------------------------------
# FP4 e2m1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; codes are 4-bit nibbles.

_FP4_LUT = np.concatenate([FP4_E2M1_VALUES, -FP4_E2M1_VALUES]).astype(np.float32)


def fp4_to_f32(codes: np.ndarray) -> np.ndarray:
    """4-bit e2m1 codes (one per element, 0..15) -> float32."""
    return _FP4_LUT[np.asarray(codes).astype(np.uint8) & 0xF]


# Rounding thresholds between adjacent e2m1 magnitudes: a magnitude's code is the number of
# thresholds it reaches. Midpoints whose lower neighbour has an even code (0.25, 1.25, 2.5, 5)
# round down on a tie, so their threshold sits one float32 ulp above the midpoint.
_FP4_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_FP4_THRESH = np.where(
    np.arange(7) % 2 == 0, np.nextafter(_FP4_MIDS, np.float32(np.inf)), _FP4_MIDS
).astype(np.float32)


def f32_to_fp4(x: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 codes (uint8 0..15): RNE, saturating to +-6. NaN maps to code 7/15 (6.0):
    e2m1 has no NaN; callers never feed one."""
    f = np.asarray(x, dtype=np.float32)
    mag = np.abs(f)
    mag = np.where(np.isnan(mag), np.float32(FP4_E2M1_MAX), mag)
    code = np.searchsorted(_FP4_THRESH, mag, side="right").astype(np.uint8)
    return code | (np.signbit(f).astype(np.uint8) << 3)


def fp4_pack_codes(codes: np.ndarray) -> np.ndarray:
    """codes [..., K] (K even) -> packed int8 [..., K/2], element 2i in the LOW nibble."""
    c = np.asarray(codes).astype(np.uint8) & 0xF
    if c.shape[-1] % 2:
        raise ValueError("fp4 packing needs an even last dimension")
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return packed.astype(np.uint8).view(np.int8)


def fp4_unpack_codes(packed: np.ndarray) -> np.ndarray:
    """packed [..., K/2] (int8 or uint8) -> codes uint8 [..., K]."""
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        p = p.view(np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


# byte -> (low-nibble value, high-nibble value): unpacking is then one gather
_FP4_PAIR_LUT = np.stack([np.tile(_FP4_LUT, 16), np.repeat(_FP4_LUT, 16)], axis=-1)


def fp4_unpack(packed: np.ndarray) -> np.ndarray:
    """packed e2m1 [..., K/2] -> float32 [..., K] (low nibble first)."""
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        p = p.view(np.uint8)
    return _FP4_PAIR_LUT[p].reshape(p.shape[:-1] + (p.shape[-1] * 2,))


def fp4_pack(x: np.ndarray) -> np.ndarray:
    """float32 values that are already e2m1-representable -> packed int8 [..., K/2]."""
    f = np.asarray(x, dtype=np.float32)
    codes = f32_to_fp4(f)
    if not np.array_equal(fp4_to_f32(codes), f):
        raise ValueError("fp4_pack: values are not representable in e2m1 (use f32_to_fp4)")
    return fp4_pack_codes(codes)


# ---------------------------------------------------------------------------------------------
# Block-scaled weights.


def _scale_to_f32(scale: np.ndarray) -> np.ndarray:
    s = np.asarray(scale)
    if s.dtype == np.uint8:
        return e8m0_to_f32(s)
    return s.astype(np.float32)


def _blocked(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, int, int]:
    """View (or padded copy) of 2-D `w` as [gn, bn, gk, bk] blocks; ragged edges zero-padded."""
    n, k = w.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    if (gn * bn, gk * bk) != (n, k):
        pad = np.zeros((gn * bn, gk * bk), dtype=w.dtype)
        pad[:n, :k] = w
        w = pad
    return w.reshape(gn, bn, gk, bk), gn, gk


def _check_scale(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> None:
    want = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {scale.shape} != {want} for weight {shape} block {block}")


def dequant_fp8_blocks(w_u8: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """e4m3 weight [N, K] with per-(bn x bk) scales [ceil(N/bn), ceil(K/bk)] (UE8M0 uint8 or
    float) -> float32 [N, K]. Edge blocks may be ragged."""
    w = fp8_e4m3_to_f32(w_u8)
    if w.ndim != 2:
        raise ValueError("dequant_fp8_blocks expects a 2-D weight")
    block = (int(block[0]), int(block[1]))
    s = _scale_to_f32(scale)
    _check_scale(s, w.shape, block)
    n, k = w.shape
    b, _, _ = _blocked(w, block)
    out = (b * s[:, None, :, None]).reshape(b.shape[0] * block[0], b.shape[2] * block[1])
    return out[:n, :k] if out.shape != (n, k) else out


def quant_fp8_blocks(
    w_f32: np.ndarray, block: tuple[int, int], scale_fmt: str = "ue8m0"
) -> tuple[np.ndarray, np.ndarray]:
    """float [N, K] -> (e4m3 uint8 [N, K], scale [ceil(N/bn), ceil(K/bk)]). 'ue8m0' scales are
    2**ceil(log2(amax/448)) stored as uint8 exponents; 'fp32' scales are amax/448 as float32.
    Computed in float32 like DeepSeek's reference quantizer."""
    w = np.asarray(w_f32, dtype=np.float32)
    n, k = w.shape
    block = (int(block[0]), int(block[1]))
    b, gn, gk = _blocked(w, block)
    amax = np.abs(b).max(axis=(1, 3))
    amax = np.maximum(amax, np.float32(1e-4))  # all-zero blocks still get a finite scale
    if scale_fmt == "ue8m0":
        s = ue8m0_scale_for(amax, FP8_E4M3_MAX).astype(np.float32)
        scale = f32_to_e8m0(s)
    elif scale_fmt == "fp32":
        s = (amax / np.float32(FP8_E4M3_MAX)).astype(np.float32)
        scale = s
    else:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}")
    q = f32_to_fp8_e4m3(b / s[:, None, :, None]).reshape(gn * block[0], gk * block[1])
    return (q[:n, :k].copy() if q.shape != (n, k) else q), scale


def dequant_fp4_experts(packed: np.ndarray, scale_e8m0: np.ndarray, group: int = 32) -> np.ndarray:
    """packed e2m1 [N, K/2] with UE8M0 scales [N, K/group] -> float32 [N, K]."""
    w = fp4_unpack(packed)
    n, k = w.shape
    s = _scale_to_f32(scale_e8m0)
    if k % group or s.shape != (n, k // group):
        raise ValueError(f"fp4 scale shape {s.shape} != {(n, k // group)} (K={k}, group {group})")
    return (w.reshape(n, k // group, group) * s[:, :, None]).reshape(n, k)


def quant_fp4_rows(w_f32: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """float [N, K] -> (packed int8 [N, K/2], UE8M0 uint8 scales [N, K/group]) with
    scale = 2**ceil(log2(amax/6)) per row per `group` elements, as DeepSeek quantizes experts."""
    w = np.asarray(w_f32, dtype=np.float32)
    n, k = w.shape
    if k % group:
        raise ValueError(f"K={k} is not a multiple of the fp4 group {group}")
    g = w.reshape(n, k // group, group)
    amax = np.maximum(np.abs(g).max(axis=2), np.float32(1e-4))
    s = ue8m0_scale_for(amax, FP4_E2M1_MAX).astype(np.float32)
    codes = f32_to_fp4(g / s[:, :, None]).reshape(n, k)  # exact: s is a power of two
    return fp4_pack_codes(codes), f32_to_e8m0(s)
