"""Emulate kernels/indexer.cu indexer_scores_bf's warp tile in numpy, lane by lane: its ldmatrix
addresses, the mma.m16n8k16 fragments of keys x (query, head) rows, the epilogue's bf16 pairs
(rounded dot, relu, times the head weight, rounded) as the second MMA's A operand, and the lanes'
sums against ones. Compares each warp's 64 key sums with a plain product; no GPU needed. Exits
non-zero on a mismatch.

    python3 tools/dev/emulate_indexer_bf.py
"""

import sys

import numpy as np

DH, LD = 128, 128 + 8  # head dim, shared row stride (bf16)


def bf16(x) -> np.ndarray:
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def ldsm_x4(smem: np.ndarray, addr: list) -> list:
    """ldmatrix.x4: lanes 8 m .. 8 m + 7 address matrix m's rows; lane l gets, of each matrix, row
    l / 4, elements 2 (l % 4) and + 1."""
    out = [[None] * 4 for _ in range(32)]
    for m in range(4):
        for lane in range(32):
            r, c = addr[8 * m + lane // 4]
            c += 2 * (lane % 4)
            out[lane][m] = (smem[r, c], smem[r, c + 1])
    return out


def b_frags(smem: np.ndarray, row0: int, k0: int) -> list:
    """The B fragments of 4 n8 tiles (rows row0 .. row0 + 31 of a K-major operand, k16 step at k0),
    as two ldmatrix.x4 loads of 16 rows each give them."""
    b = [None] * 4
    for jj in range(2):
        r = ldsm_x4(smem, [(row0 + 16 * jj + (la & 7) + 8 * (la >> 4), k0 + 8 * ((la >> 3) & 1)) for la in range(32)])
        b[2 * jj] = [(r[la][0], r[la][1]) for la in range(32)]
        b[2 * jj + 1] = [(r[la][2], r[la][3]) for la in range(32)]
    return b


def mma(c: list, a: list, b: list) -> None:
    """c += a b, mma.m16n8k16 fragments: a[lane] 4 pairs, b[lane] 2 pairs, c[lane] 4 floats."""
    am, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        am[g, 2 * t:2 * t + 2], am[g + 8, 2 * t:2 * t + 2] = a[lane][0], a[lane][1]
        am[g, 2 * t + 8:2 * t + 10], am[g + 8, 2 * t + 8:2 * t + 10] = a[lane][2], a[lane][3]
        bm[2 * t:2 * t + 2, g], bm[2 * t + 8:2 * t + 10, g] = b[lane][0], b[lane][1]
    d = am @ bm
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane] = [c[lane][0] + d[g, 2 * t], c[lane][1] + d[g, 2 * t + 1],
                   c[lane][2] + d[g + 8, 2 * t], c[lane][3] + d[g + 8, 2 * t + 1]]


def relu_times(x0: float, x1: float, w: tuple) -> tuple:
    """bf16x2_relu_times: cvt.rn.bf16x2, max.bf16x2 with 0, mul.rn.bf16x2 by the weights."""
    return tuple(float(bf16(max(float(bf16(x)), 0.0) * wi)) for x, wi in ((x0, w[0]), (x1, w[1])))


def warp_sums(ks: np.ndarray, qs: np.ndarray, w: np.ndarray, warp: int) -> np.ndarray:
    """The 64 key sums warp `warp` writes, in key order (lane (g, t): keys 16 t + g and + 8)."""
    rg, kh = warp >> 1, warp & 1
    acc = [[[[0.0] * 4 for _ in range(32)] for _ in range(4)] for _ in range(4)]
    for k0 in range(0, DH, 16):
        a = [ldsm_x4(ks, [(64 * kh + 16 * i + (la & 15), k0 + 8 * (la >> 4)) for la in range(32)]) for i in range(4)]
        b = b_frags(qs, 32 * rg, k0)
        for i in range(4):
            for j in range(4):
                mma(acc[i][j], a[i], b[j])
    sums = [[[0.0] * 4 for _ in range(32)] for _ in range(4)]
    ones = [((1.0, 1.0), (1.0, 1.0))] * 32
    for i in range(4):
        for kk in range(2):
            a2 = []
            for lane in range(32):
                t = lane % 4
                wp = [(w[32 * rg + 8 * j + 2 * t], w[32 * rg + 8 * j + 2 * t + 1]) for j in (2 * kk, 2 * kk + 1)]
                c0, c1 = acc[i][2 * kk][lane], acc[i][2 * kk + 1][lane]
                a2.append((relu_times(c0[0], c0[1], wp[0]), relu_times(c0[2], c0[3], wp[0]),
                           relu_times(c1[0], c1[1], wp[1]), relu_times(c1[2], c1[3], wp[1])))
            mma(sums[i], a2, ones)
    out = np.zeros(64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out[16 * t + g], out[16 * t + g + 8] = sums[t][lane][0], sums[t][lane][2]
    return out


def main() -> int:
    rng = np.random.default_rng(0)
    ks, qs = np.zeros((128, LD), np.float32), np.zeros((128, LD), np.float32)
    ks[:, :DH], qs[:, :DH] = bf16(rng.standard_normal((128, DH))), bf16(rng.standard_normal((128, DH)))
    w = bf16(rng.standard_normal(128))
    bad = 0
    for warp in range(8):
        rg, kh = warp >> 1, warp & 1
        dots = ks[64 * kh:64 * kh + 64, :DH].astype(np.float64) @ qs[32 * rg:32 * rg + 32, :DH].T
        want = bf16(np.maximum(bf16(dots), 0) * w[32 * rg:32 * rg + 32]).astype(np.float64).sum(axis=1)
        got = warp_sums(ks, qs, w, warp)
        err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
        print(f"warp {warp} (row group {rg}, keys {64 * kh}..{64 * kh + 63}): max rel err {err:.2e}")
        bad += err > 1e-6
    print("ok" if not bad else f"{bad} warp(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
