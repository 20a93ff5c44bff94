#!/usr/bin/env python3
"""The e4m3 tensor-core GEMV's fragment logic (kernels/gemv_q8.cu tcgemv8_*), checked on the CPU.

For one stage of one 16-row weight tile against 8 rows of x, every lane's registers are built as the
kernel builds them (the ring's XOR swizzle and ldmatrix, fp4_e4m3_split, the
layout gemv_q8_x gives x's codes, the f16 conversions, the A / B / C fragment layouts of the two
mma.m16n8k16 f16 per 32-k group, the scale factors) and the product is
compared with a plain one. A change to the decoding or the operand order that breaks the agreement
between A and B fails here before it reaches a GPU.
"""

from __future__ import annotations

import numpy as np

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def e4m3_value(b: int) -> float:
    """The value of an e4m3 byte (no NaN: the kernel never forms 0x7F / 0xFF)."""
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def e4m3_code(v: float) -> int:
    """The e4m3 byte of a value that e4m3 holds exactly."""
    for b in range(256):
        if b & 0x7F != 0x7F and e4m3_value(b) == v and (b >> 7) == (np.signbit(v)):
            return b
    raise ValueError(v)


def fp4_e4m3_split(w: int) -> tuple[int, int]:
    """kernels/gemv_q8.cu fp4_e4m3_split."""
    ev = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
    od = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    return ev & 0xFFFFFFFF, od & 0xFFFFFFFF


def words(b: bytes) -> list[int]:
    return [int.from_bytes(b[i:i + 4], "little") for i in range(0, len(b), 4)]


def ldmatrix_stage(rows: np.ndarray) -> list[list[list[int]]]:
    """d[lane][c][0/1] as tc_load_stage hands them out: the stage (16 rows x 128 bytes) written into
    the ring with the XOR swizzle, then ldmatrix x4 per chunk pair."""
    smem = bytearray(16 * 128)
    for r in range(16):
        for c in range(8):
            o = r * 128 + ((c ^ (r & 7)) << 4)
            smem[o:o + 16] = rows[r, 16 * c:16 * c + 16].tobytes()
    d = [[[0, 0] for _ in range(8)] for _ in range(32)]
    for cp2 in range(4):
        mats = []  # matrix i: rows of 16 bytes at the addresses lanes 8i .. 8i + 7 give
        for i in range(4):
            addrs = []
            for lane in range(8 * i, 8 * i + 8):
                lr, lc = (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4
                addrs.append(lr * 128 + (((2 * cp2 + lc) ^ (lr & 7)) << 4))
            mats.append([words(bytes(smem[a:a + 16])) for a in addrs])
        for lane in range(32):
            w4 = [mats[i][lane >> 2][lane & 3] for i in range(4)]
            d[lane][2 * cp2] = [w4[0], w4[1]]
            d[lane][2 * cp2 + 1] = [w4[2], w4[3]]
    return d


def q8_x_order(codes: np.ndarray, fp4: bool) -> np.ndarray:
    """kernels/gemv_q8.cu gemv_q8_x's layout of a row's codes: quad cq of each block of 32 stored at
    byte 4cq (FP4: its middle bytes swapped) or 8 (cq & 3) + 4 (cq >> 2) (FP8)."""
    out = np.empty_like(codes)
    for blk in range(0, codes.shape[-1], 32):
        for cq in range(8):
            q = codes[..., blk + 4 * cq:blk + 4 * cq + 4]
            if fp4:
                out[..., blk + 4 * cq:blk + 4 * cq + 4] = q[..., [0, 2, 1, 3]]
            else:
                at = 8 * (cq & 3) + 4 * (cq >> 2)
                out[..., blk + at:blk + at + 4] = q
    return out


def f16_pair(w: int, hi: bool) -> tuple[float, float]:
    """e4m3x2_to_f16x2 (hi: e4m3x2_hi_to_f16x2): bytes 0, 1 (2, 3) of w as (low, high) f16 values."""
    b = w.to_bytes(4, "little")[2:] if hi else w.to_bytes(4, "little")[:2]
    return e4m3_value(b[0]), e4m3_value(b[1])


def mma_f16(a: list[list[tuple]], b: list[list[tuple]]) -> np.ndarray:
    """mma.m16n8k16 f16 from every lane's four A pairs and two B pairs: C [16, 8]."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for (r, k0), pair in zip(((g, 0), (g + 8, 0), (g, 8), (g + 8, 8)), a[lane], strict=True):
            A[r, k0 + 2 * t:k0 + 2 * t + 2] = pair
        for k0, pair in zip((0, 8), b[lane], strict=True):
            B[k0 + 2 * t:k0 + 2 * t + 2, g] = pair
    return A @ B


def check(fmt: str, seed: int = 0) -> None:
    """One stage of a tile, 8 x rows, random codes and scales: the kernel's sums against W @ x.T."""
    rng = np.random.default_rng(seed)
    kps = 128 if fmt == "fp8" else 256
    xv = rng.choice([e4m3_value(b) for b in range(256) if b & 0x7F != 0x7F], size=(8, kps))
    xs = 2.0 ** rng.integers(-8, 8, size=(8, kps // 32))  # x's scale per 32
    xc = q8_x_order(np.array([[e4m3_code(v) for v in row] for row in xv], np.uint8), fmt == "fp4")
    if fmt == "fp8":
        wv = rng.choice([e4m3_value(b) for b in range(256) if b & 0x7F != 0x7F], size=(16, kps))
        stage = np.array([[e4m3_code(v) for v in row] for row in wv], np.uint8)
        ws = np.full((16, kps // 32), 0.75)  # one block scale for the tile's rows (pre)
    else:
        nib = rng.integers(0, 16, size=(16, kps))
        wv = E2M1[nib]
        stage = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
        ws = 2.0 ** rng.integers(-5, 5, size=(16, kps // 32))  # UE8M0 per row and 32
    want = (wv * np.repeat(ws, 32, axis=1)) @ (xv * np.repeat(xs, 32, axis=1)).T
    d = ldmatrix_stage(stage)
    got = np.zeros((16, 8))
    for c in range(kps // 32):  # group c of the stage: two MMAs
        cc = np.zeros((16, 8))
        for h in range(2):
            a, b = [], []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                if fmt == "fp8":
                    w0, w1 = d[lane][2 * c + h]
                    a.append([f16_pair(w0, False), f16_pair(w1, False), f16_pair(w0, True), f16_pair(w1, True)])
                else:
                    e0, o0 = fp4_e4m3_split(d[lane][c][0])
                    e1, o1 = fp4_e4m3_split(d[lane][c][1])
                    a.append([f16_pair(e0, h == 1), f16_pair(e1, h == 1), f16_pair(o0, h == 1), f16_pair(o1, h == 1)])
                xw = words(xc[g, 32 * c + 8 * t:32 * c + 8 * t + 8].tobytes())[h]
                b.append([f16_pair(xw, False), f16_pair(xw, True)])
            cc += mma_f16(a, b)
        dec = 2.0**6 if fmt == "fp4" else 1.0  # fp4_e4m3_split's values are value * 2^-6
        got += cc * (ws[:, c:c + 1] * dec) * xs[None, :, c]
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    if err > 1e-12:
        raise AssertionError(f"{fmt}: relative error {err:.3g}")


def bf_x_order(x: np.ndarray) -> np.ndarray:
    """kernels/gemv_q8.cu gemv_bf_x's layout of a row's bf16 pairs: pair pb of each block of 16 at
    word 2 (pb & 3) + (pb >> 2)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    out = np.empty_like(pairs)
    for p in range(pairs.shape[-2]):
        pb = p & 7
        out[..., (p & ~7) + 2 * (pb & 3) + (pb >> 2), :] = pairs[..., p, :]
    return out.reshape(x.shape)


def check_bf16(seed: int = 0) -> None:
    """tcgemv8_bf16: one stage (64 k) of a tile against 8 rows of x, A words as ldmatrix gives them."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    wb = (w.view(np.uint32) >> 16).astype(np.uint16)  # (truncated: any bf16 values will do)
    xb = (x.view(np.uint32) >> 16).astype(np.uint16)
    wv = (wb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    xv = (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    d = ldmatrix_stage(wb.view(np.uint8).reshape(16, 128))
    xo = bf_x_order(xb)

    def halves(word: int) -> tuple[float, float]:  # a bf16x2 word's (low, high) values
        return tuple(float(np.array([((word >> s) & 0xFFFF) << 16], np.uint32).view(np.float32)[0]) for s in (0, 16))

    got = np.zeros((16, 8))
    for i in range(4):  # MMA i: chunks 2i, 2i + 1
        a = [[halves(d[lane][2 * i][0]), halves(d[lane][2 * i][1]), halves(d[lane][2 * i + 1][0]),
              halves(d[lane][2 * i + 1][1])] for lane in range(32)]
        b = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            ws = words(xo[g, 16 * i + 4 * t:16 * i + 4 * t + 4].tobytes())
            b.append([halves(ws[0]), halves(ws[1])])
        got += mma_f16(a, b)
    want = wv @ xv.T
    err = np.abs(got - want).max() / np.abs(want).max()
    if err > 1e-12:
        raise AssertionError(f"bf16: relative error {err:.3g}")


if __name__ == "__main__":
    for s in range(3):
        check_bf16(s)
    for f in ("fp8", "fp4"):
        for s in range(3):
            check(f, s)
    print("ok")
