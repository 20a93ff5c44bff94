"""Emulate kernels/fp8_gemm.cu gemm_e4m3_body in numpy, thread by thread, to check
its index math (fragments, scales, FP4 expansion, epilogue) against a plain product."""

import sys

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from engine.checkpoint import formats


def e2m1_to_e4m3(c):
    lut = [0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C]
    return lut[c & 7] | ((c & 8) << 4)


def e4m3_val(b):
    return float(formats.fp8_e4m3_to_f32(np.array([b], np.uint8))[0])


def mma(a_regs, b_regs):
    # PTX m16n8k32 (8-bit): A reg r byte j -> row g (+8 for r odd), k = 4t + j (+16 for r >= 2)
    A = np.zeros((16, 32))
    B = np.zeros((32, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r in range(4):
            for j in range(4):
                row = g + (8 if r in (1, 3) else 0)
                k = 4 * t + j + (16 if r >= 2 else 0)
                A[row, k] = e4m3_val((a_regs[lane][r] >> (8 * j)) & 0xFF)
        for r in range(2):
            for j in range(4):
                k = 4 * t + j + (16 if r == 1 else 0)
                B[k, g] = e4m3_val((b_regs[lane][r] >> (8 * j)) & 0xFF)
    C = A @ B
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out.append([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])
    return out


def u32(buf, off):
    return int.from_bytes(bytes(buf[off : off + 4]), "little")


def stage_bytes(dst, src, tid, row0, rows, k0):
    # thread tid's two 16-byte loads of a 64 x 64-byte tile (rows row0.., bytes k0..), zero past rows
    for i in range(2):
        idx = tid + 128 * i
        r, c = idx >> 2, idx & 3
        if row0 + r < rows:
            dst[r, 16 * c : 16 * c + 16] = src[row0 + r, k0 + 16 * c : k0 + 16 * c + 16]


def run(Acodes, SA, W, SW, M, N, K, fmt, bn, bk, gk):
    Y = np.zeros((M, N))
    for by in range(-(-M // 64)):
        for bx in range(-(-N // 64)):
            m0, n0 = by * 64, bx * 64
            acc = {}
            for k0 in range(0, K, 64):
                As = np.zeros((64, 80), np.uint8)
                Ws = np.zeros((64, 80), np.uint8)
                sa = np.zeros((64, 2))
                sw = np.zeros((64, 2))
                for tid in range(128):
                    stage_bytes(As, Acodes, tid, m0, M, k0)
                    if fmt == "fp8":
                        stage_bytes(Ws, W, tid, n0, N, k0)
                    else:
                        r = tid >> 1
                        h = tid & 1
                        vw = np.zeros(16, np.uint8)
                        if n0 + r < N:
                            vw = W[n0 + r, k0 // 2 + 16 * h : k0 // 2 + 16 * h + 16]
                        out = []
                        for q in range(4):
                            w = u32(vw, 4 * q)
                            out.append(
                                e2m1_to_e4m3(w)
                                | (e2m1_to_e4m3(w >> 4) << 8)
                                | (e2m1_to_e4m3(w >> 8) << 16)
                                | (e2m1_to_e4m3(w >> 12) << 24)
                            )
                            out.append(
                                e2m1_to_e4m3(w >> 16)
                                | (e2m1_to_e4m3(w >> 20) << 8)
                                | (e2m1_to_e4m3(w >> 24) << 16)
                                | (e2m1_to_e4m3(w >> 28) << 24)
                            )
                        bts = b"".join(int(o).to_bytes(4, "little") for o in out)
                        Ws[r, 32 * h : 32 * h + 32] = np.frombuffer(bts, np.uint8)
                    r = tid >> 1
                    kb = tid & 1
                    k = k0 + 32 * kb
                    sa[r, kb] = SA[m0 + r, k // 32] if m0 + r < M else 0
                    if n0 + r < N:
                        sw[r, kb] = (
                            SW[(n0 + r) // bn, k // bk] if fmt == "fp8" else 2.0 ** (int(SW[n0 + r, k // 32]) - 127)
                        )
                for warp in range(4):
                    wm, wn = (warp >> 1) * 32, (warp & 1) * 32
                    for kb in range(2):
                        ks = 32 * kb
                        for i in range(2):
                            a_regs = []
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                r = wm + 16 * i + g
                                a_regs.append(
                                    [
                                        u32(As[r], ks + 4 * t),
                                        u32(As[r + 8], ks + 4 * t),
                                        u32(As[r], ks + 16 + 4 * t),
                                        u32(As[r + 8], ks + 16 + 4 * t),
                                    ]
                                )
                            for j in range(4):
                                b_regs = []
                                for lane in range(32):
                                    g, t = lane >> 2, lane & 3
                                    n = wn + 8 * j + g
                                    b_regs.append([u32(Ws[n], ks + 4 * t), u32(Ws[n], ks + 16 + 4 * t)])
                                c = mma(a_regs, b_regs)
                                for lane in range(32):
                                    g, t = lane >> 2, lane & 3
                                    r = wm + 16 * i + g
                                    n = wn + 8 * j + 2 * t
                                    s0, s1 = sa[r, kb], sa[r + 8, kb]
                                    w0, w1 = sw[n, kb], sw[n + 1, kb]
                                    key = (warp, i, j, lane)
                                    a_ = acc.setdefault(key, [0.0] * 4)
                                    a_[0] += c[lane][0] * s0 * w0
                                    a_[1] += c[lane][1] * s0 * w1
                                    a_[2] += c[lane][2] * s1 * w0
                                    a_[3] += c[lane][3] * s1 * w1
            for (warp, i, j, lane), a_ in acc.items():
                wm, wn = (warp >> 1) * 32, (warp & 1) * 32
                g, t = lane >> 2, lane & 3
                r = m0 + wm + 16 * i + g
                n = n0 + wn + 8 * j + 2 * t
                for h in range(2):
                    rr = r + 8 * h
                    if rr < M:
                        if n < N:
                            Y[rr, n] = a_[2 * h]
                        if n + 1 < N:
                            Y[rr, n + 1] = a_[2 * h + 1]
    return Y


rng = np.random.default_rng(0)
M, N, K = 70, 72, 128
x = rng.standard_normal((M, K)).astype(np.float32)
# activations: codes and scales as act_quant_fp8 makes them
b = x.reshape(M, K // 32, 32)
amax = np.maximum(np.abs(b).max(-1), np.float32(1e-4))
s = formats.pow2_ceil_f32(amax * np.float32(1 / 448))
codes = formats.f32_to_fp8_e4m3(np.clip(b / s[..., None], -448, 448)).reshape(M, K)
xq = (formats.fp8_e4m3_to_f32(codes).reshape(M, K // 32, 32) * s[..., None]).reshape(M, K)
# FP8 weights, 32x32 blocks
W8 = (rng.integers(0, 256, (N, K)) & 0xF7).astype(np.uint8)
SW8 = (2.0 ** rng.integers(-10, -5, (-(-N // 32), K // 32))).astype(np.float32)
y = run(codes, s, W8, SW8, M, N, K, "fp8", 32, 32, K // 32)
want = xq.astype(np.float64) @ formats.dequant_fp8_blocks(W8, SW8, (32, 32)).astype(np.float64).T
print("fp8 max rel err", np.abs(y - want).max() / np.abs(want).max())
# FP4 weights
W4 = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
SW4 = rng.integers(118, 128, (N, K // 32)).astype(np.uint8)
y = run(codes, s, W4, SW4, M, N, K, "fp4", 1, 32, K // 32)
want = xq.astype(np.float64) @ formats.dequant_fp4_experts(W4, SW4, 32).astype(np.float64).T
print("fp4 max rel err", np.abs(y - want).max() / np.abs(want).max())
