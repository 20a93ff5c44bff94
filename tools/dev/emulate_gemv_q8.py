#!/usr/bin/env python3
"""The e4m3 tensor-core GEMV's fragment logic (kernels/gemv_q8.cu tcgemv8_*), checked on the CPU.

For one stage of one 16-row weight tile against 8 rows of x, every lane's registers are built as the
kernel builds them (the ring's XOR swizzle and ldmatrix, fp4_e4m3_split, the byte_perms of x, the
MMA's A / B / C fragment layouts of mma.m16n8k32 e4m3, the scale factors) and the product is
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


def byte_perm(x: int, y: int, s: int) -> int:
    """__byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of (y:x)."""
    b = (x | (y << 32)).to_bytes(8, "little")
    return int.from_bytes(bytes(b[(s >> (4 * i)) & 7] for i in range(4)), "little")


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


def mma_k32(a: list[list[int]], b: list[list[int]]) -> np.ndarray:
    """mma.m16n8k32 e4m3 from every lane's (a0..a3), (b0, b1): C [16, 8] (fresh accumulator)."""
    A, B = np.zeros((16, 32)), np.zeros((32, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, k0, reg in ((g, 0, 0), (g + 8, 0, 1), (g, 16, 2), (g + 8, 16, 3)):
            for i, byte in enumerate(a[lane][reg].to_bytes(4, "little")):
                A[r, k0 + 4 * t + i] = e4m3_value(byte)
        for k0, reg in ((0, 0), (16, 1)):
            for i, byte in enumerate(b[lane][reg].to_bytes(4, "little")):
                B[k0 + 4 * t + i, g] = e4m3_value(byte)
    return A @ B


def check(fmt: str, seed: int = 0) -> None:
    """One stage of a tile, 8 x rows, random codes and scales: the kernel's sums against W @ x.T."""
    rng = np.random.default_rng(seed)
    kps = 128 if fmt == "fp8" else 256
    xv = rng.choice([e4m3_value(b) for b in range(256) if b & 0x7F != 0x7F], size=(8, kps))
    xs = 2.0 ** rng.integers(-8, 8, size=(8, kps // 32))  # x's scale per 32
    xc = np.array([[e4m3_code(v) for v in row] for row in xv], np.uint8)
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
    for c in range(kps // 32):  # MMA c of the stage
        a, b = [], []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            xr = xc[g, 32 * c:32 * c + 32].tobytes()
            if fmt == "fp8":
                dd = d[lane]
                a.append([dd[2 * c][0], dd[2 * c][1], dd[2 * c + 1][0], dd[2 * c + 1][1]])
                b.append(words(xr[4 * t:4 * t + 4]) + words(xr[16 + 4 * t:16 + 4 * t + 4]))
            else:
                e0, o0 = fp4_e4m3_split(d[lane][c][0])
                e1, o1 = fp4_e4m3_split(d[lane][c][1])
                a.append([e0, e1, o0, o1])
                u = words(xr[8 * t:8 * t + 8])
                b.append([byte_perm(u[0], u[1], 0x6420), byte_perm(u[0], u[1], 0x7531)])
        cc = mma_k32(a, b)
        dec = 2.0**6 if fmt == "fp4" else 1.0  # fp4_e4m3_split's values are value * 2^-6
        got += cc * (ws[:, c:c + 1] * dec) * xs[None, :, c]
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    if err > 1e-12:
        raise AssertionError(f"{fmt}: relative error {err:.3g}")


if __name__ == "__main__":
    for f in ("fp8", "fp4"):
        for s in range(3):
            check(f, s)
    print("ok")
