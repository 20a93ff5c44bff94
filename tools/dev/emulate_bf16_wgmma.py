"""Emulate kernels/bf16_weights.cu's register-operand bf16 wgmma consumer (gemm_fp8w_bf16_sm90,
gemm_bf16w_sm90) in numpy, thread by thread: the rows' K order that act_quant_bf16w / bf16_rows write
(bw_store_quad), the producer's 128-byte-swizzled token tiles (wg_swz) and the B operand its
descriptor names at each k16 step (wg_desc(bt + 32 s)), each thread's weight words (bw_load) and the
A fragments bw_convert_step builds from them (FP8: the codes as loaded times the scale's power of two;
bf16: the words as loaded), the wgmma m64nNk16 product of those fragments, and the epilogue's map
from accumulators to Y. Compares Y with the plain product of the dequantized weight and x; no GPU
needed. Exits non-zero on a mismatch. (The FP4 experts' kernel, whose producer decodes the weights
into shared memory, has its own: tools/dev/emulate_fp4_experts.py.)

    python3 tools/dev/emulate_bf16_wgmma.py
"""

import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulate_wgmma_gemm as wg  # noqa: E402  (wg_desc, the WG_* constants)

formats = wg.formats
# (the kernel, and the geometry it shares with kernels/fp4_experts.cu)
_SRC = "\n".join((wg.ROOT / "kernels" / f).read_text() for f in ("bf16_weights.cu", "bf16_wgmma.cuh"))
BW = {k: int(v) for k, v in re.findall(r"^#define (BW_\w+) +(\d+)", _SRC, re.MULTILINE)}
BM, BN = BW["BW_BM"], BW["BW_BN"]
assert BW["BW_TILE_BYTES"] == BN * 128 and BM == 2 * 64


def k_order(x: np.ndarray) -> np.ndarray:
    """bw_store_quad: quad c of a row (elements 4c .. 4c + 3) at logical 64 (c / 16) + L, L + 1, L + 8,
    L + 9 with L = 16 (c % 4) + 2 ((c % 16) / 4)."""
    out = np.zeros_like(x)
    for c in range(x.shape[1] // 4):
        cb = c & 15
        base = 64 * (c >> 4) + 16 * (cb & 3) + 2 * (cb >> 2)
        out[:, [base, base + 1, base + 8, base + 9]] = x[:, 4 * c:4 * c + 4]
    return out


def tile(xl: np.ndarray, m0: int, c: int) -> np.ndarray:
    """bw_produce's stage c: token rows m0 .. m0 + BN - 1 (zeros past M), 64 bf16 of K each, every
    16-byte chunk c8 of row r at r * 128 + ((c8 ^ (r % 8)) << 4)."""
    smem = np.zeros(BN * 128, np.uint8)
    rows = xl[m0:m0 + BN, 64 * c:64 * c + 64]
    bits = np.zeros((BN, 64), np.uint16)
    bits[:rows.shape[0]] = formats.f32_to_bf16(rows)
    raw = bits.view(np.uint8).reshape(BN, 128)
    for r in range(BN):
        for c8 in range(8):
            off = r * 128 + ((c8 ^ (r & 7)) << 4)
            smem[off:off + 16] = raw[r, 16 * c8:16 * c8 + 16]
    return smem


def operand_b(smem: np.ndarray, d: int) -> np.ndarray:
    """The BN x 16 bf16 operand the descriptor d names: K-major, 128-byte swizzle (the address bits
    [4, 7) XOR [7, 10)), SBO between 8-row groups."""
    start, sbo = (d & 0x3FFF) << 4, ((d >> 32) & 0x3FFF) << 4
    assert d >> 62 == 1, "128B swizzle expected"
    n = np.arange(BN)[:, None]
    k = np.arange(16)[None, :]
    addr = start + (n % 8) * 128 + (n // 8) * sbo + 2 * k
    addr = addr ^ (((addr >> 7) & 7) << 4)
    lo, hi = smem[addr].astype(np.uint16), smem[addr + 1].astype(np.uint16)
    return formats.bf16_to_f32(lo | (hi << 8)).astype(np.float64)


def words(raw: np.ndarray) -> list:
    """Little-endian 32-bit words of a thread's loaded bytes (word(ch.r0, i))."""
    return [int(v) for v in raw.view("<u4")]


def e4m3(b: int) -> float:
    return float(formats.fp8_e4m3_to_f32(np.array([b & 0xFF], np.uint8))[0])


def a_fragment(fmt: str, w: np.ndarray, sw: np.ndarray, r: int, c: int, q: int, s: int, bn: int, bk: int) -> list:
    """bw_load + bw_convert_step of weight row r (two bf16 values: the k16 step's columns 2q, 2q + 1
    and then 2q + 8, 2q + 9) -> [(v0, v1), (v8, v9)]."""
    k = 64 * c + 16 * q
    if fmt == "bf16":  # bw_bf16_step: 32 bytes of the row (r0, r1), words 2 (s % 2) and + 1 of r0 or r1
        half = words(w[r, k:k + 16].view(np.uint8))[4 * (s >> 1):4 * (s >> 1) + 4]
        pair = [half[2 * (s & 1)], half[2 * (s & 1) + 1]]
        v = formats.bf16_to_f32(np.array([(p >> (16 * j)) & 0xFFFF for p in pair for j in (0, 1)], np.uint16))
        return [(float(v[0]), float(v[1])), (float(v[2]), float(v[3]))]
    wd = words(w[r, k:k + 16])
    code = wd[s]
    e = (int(np.float32(sw[r // bn, k // bk]).view(np.uint32)) >> 23) & 0xFF
    scale = 2.0 ** (e - 127)
    b = [(code >> (8 * i)) & 0xFF for i in range(4)]
    return [(e4m3(b[0]) * scale, e4m3(b[1]) * scale), (e4m3(b[2]) * scale, e4m3(b[3]) * scale)]


_SPLIT = re.search(r"const int c0 = (.+?), cn = (.+?);", _SRC).groups()  # BW_SPLIT's chunk range of split z_


def split_chunks(chunks: int, splits: int, z: int) -> range:
    """The K chunks split z of `splits` sums (BW_SPLIT, the kernel's own expressions)."""
    env = {"C_": chunks, "S_": splits, "z_": z}
    c0 = eval(_SPLIT[0].replace("/", "//"), {}, env)  # noqa: S307
    cn = eval(_SPLIT[1].replace("/", "//"), {}, {**env, "c0": c0})  # noqa: S307
    return range(c0, c0 + cn)


def gemm(fmt: str, x: np.ndarray, w: np.ndarray, sw: np.ndarray, bn: int = 1, bk: int = 32,
         splits: int = 1) -> np.ndarray:
    """Y [M, N] = x (bf16 values) times the weight, as the kernel's blocks compute it: each split of
    K (BW_SPLIT) into its own partial sums, then the partials added in split order (bw_sum_splits)."""
    m, kdim = x.shape
    n = w.shape[0]
    xl = k_order(x)
    y = np.full((m, n), np.nan)
    for m0 in range(0, m, BN):
        for n0 in range(0, n, BM):
            acc = np.zeros((BM, BN))
            covered = [c for z in range(splits) for c in split_chunks(kdim // 64, splits, z)]
            assert covered == list(range(kdim // 64)), (splits, covered)
            for c in covered:
                smem = tile(xl, m0, c)
                for s in range(4):
                    b = operand_b(smem, wg.desc(32 * s))
                    a = np.zeros((BM, 16))
                    for wgi in range(2):
                        for warp in range(4):
                            for lane in range(32):
                                g, q = lane >> 2, lane & 3
                                for h in range(2):  # rows g, g + 8
                                    row = 64 * wgi + 16 * warp + g + 8 * h
                                    rg = min(n0 + row, n - 1)
                                    f = a_fragment(fmt, w, sw, rg, c, q, s, bn, bk) if n0 + row < n else [(0, 0)] * 2
                                    a[row, 2 * q:2 * q + 2] = f[0]
                                    a[row, 2 * q + 8:2 * q + 10] = f[1]
                    acc += a @ b.T
            rows = min(BN, m - m0)
            cols = min(BM, n - n0)
            y[m0:m0 + rows, n0:n0 + cols] = acc[:cols, :rows].T
    return y


CASES = (("fp8", 70, 160, 128, 0), ("fp8", 257, 128, 64, 1), ("fp8", 33, 144, 192, 2),
         ("bf16", 40, 136, 128, 3), ("bf16", 9, 64, 448, 4, 3))  # (fmt, M, N, K, seed[, splits of K])


def check(fmt: str, m: int, n: int, k: int, seed: int, splits: int = 1) -> float:
    """Random bf16 x and a random bf16 or FP8 (power-of-two 16 x 64 blocks) weight;
    raises AssertionError where the emulated kernel differs from the plain product."""
    rng = np.random.default_rng(seed)
    x = formats.round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    if fmt == "bf16":
        w = formats.f32_to_bf16(rng.standard_normal((n, k)).astype(np.float32))  # uint16 bits
        sw, bn, bk = None, 1, 1
        wd = formats.bf16_to_f32(w)
    else:
        bn, bk = 16, 64
        w = (rng.integers(0, 256, (n, k)) & 0xF7).astype(np.uint8)
        sw = np.ldexp(1.0, rng.integers(-6, 4, (-(-n // bn), k // bk))).astype(np.float32)
        wd = formats.fp8_e4m3_to_f32(w) * np.repeat(np.repeat(sw, bn, 0)[:n], bk, 1)
    want = x.astype(np.float64) @ wd.astype(np.float64).T
    got = gemm(fmt, x, w, sw, bn, bk, splits)
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    assert err < 1e-12, (fmt, m, n, k, err)
    return err


def main() -> int:
    bad = 0
    for case in CASES:
        try:
            print(f"{case[0]} M {case[1]} N {case[2]} K {case[3]}: max rel err {check(*case):.1e}")
        except AssertionError as e:
            print(f"{case[0]} M {case[1]} N {case[2]} K {case[3]}: differs {e}")
            bad += 1
    print("ok" if not bad else f"{bad} case(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
