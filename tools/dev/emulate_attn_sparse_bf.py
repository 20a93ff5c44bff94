"""Emulate kernels/attention.cu attn_sparse_bf's block in numpy, lane by lane: the ldmatrix (and
ldmatrix.trans) addresses of q, the key tiles, P and V, the mma.m16n8k16 fragments of the scores
and of P V, the tile maxima's exchange and the online softmax, for all 8 warps of one (query, 64
heads) block. Compares the output with a plain online softmax over the same tiles and with the
reference's two-pass sparse_attn, and checks that both key sources (AsbPrompt, AsbTable) stage every
chunk of a key row once; no GPU needed. Exits non-zero on a mismatch.

    python3 tools/dev/emulate_attn_sparse_bf.py
"""

import ast
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulate_indexer_bf import b_frags, bf16, ldsm_x4, mma  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_SRC = (ROOT / "kernels" / "attention.cu").read_text()
PLD = int(re.search(r"^#define ASB_PLD (\d+)", _SRC, re.MULTILINE).group(1))  # P's shared row (bf16)
# the kernel's shared memory (ASB_SMEM) holds what this block uses: q, two key tiles, P, the flags,
# the maxima and the sums
_SMEM = re.search(r"^#define ASB_SMEM\(dp\) \((.*)\)$", _SRC, re.MULTILINE).group(1).replace("ASB_PLD", str(PLD))


def ldsm_x4_trans(smem: np.ndarray, addr: list) -> list:
    """ldmatrix.x4.trans: lanes 8 m .. 8 m + 7 address matrix m's rows; lane l gets, of each
    matrix, rows 2 (l % 4) and + 1 of column l / 4."""
    out = [[None] * 4 for _ in range(32)]
    for m in range(4):
        for lane in range(32):
            r0, c0 = addr[8 * m + 2 * (lane % 4)]
            r1, c1 = addr[8 * m + 2 * (lane % 4) + 1]
            out[lane][m] = (smem[r0, c0 + lane // 4], smem[r1, c1 + lane // 4])
    return out


def block(q: np.ndarray, tiles: list, valid: list, sinks: np.ndarray, scale: float, dp: int) -> np.ndarray:
    """The block's output [64, dp]: q [64, dp] bf16 values, tiles[i] [64, dp] bf16 keys, valid[i] [64]."""
    ld = dp + 8
    qs = np.zeros((64, ld), np.float32)
    qs[:, :dp] = q
    nj = dp // 32
    o = [[[[0.0] * 4 for _ in range(32)] for _ in range(2 * nj)] for _ in range(8)]
    m = [[[-1e30, -1e30] for _ in range(32)] for _ in range(8)]
    lsum = [[[0.0, 0.0] for _ in range(32)] for _ in range(8)]
    for kt, ok in zip(tiles, valid, strict=True):
        ks = np.zeros((64, ld), np.float32)
        ks[:, :dp] = kt
        sc, tmx = [None] * 8, np.full((2, 64), -np.inf)
        for w in range(8):
            hg, kh = 16 * (w & 3), w >> 2
            acc = [[[0.0] * 4 for _ in range(32)] for _ in range(4)]
            for k0 in range(0, dp, 16):
                a = ldsm_x4(qs, [(hg + (la & 15), k0 + 8 * (la >> 4)) for la in range(32)])
                b = b_frags(ks, 32 * kh, k0)
                for j in range(4):
                    mma(acc[j], a, b[j])
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(4):
                    for e in range(4):
                        key = 32 * kh + 8 * j + 2 * t + (e & 1)
                        acc[j][lane][e] = np.float32(acc[j][lane][e]) * np.float32(scale) if ok[key] else -np.inf
                        row = hg + g + 8 * (e >> 1)
                        tmx[kh, row] = max(tmx[kh, row], acc[j][lane][e])
            sc[w] = acc
        ps = np.zeros((64, PLD), np.float32)
        corr = [[None] * 32 for _ in range(8)]
        for w in range(8):
            hg, kh = 16 * (w & 3), w >> 2
            for lane in range(32):
                g, t = lane // 4, lane % 4
                n = [max(m[w][lane][h], tmx[0, hg + g + 8 * h], tmx[1, hg + g + 8 * h]) for h in (0, 1)]
                c = [np.exp(np.float32(m[w][lane][h] - n[h])) for h in (0, 1)]
                corr[w][lane] = c
                m[w][lane] = n
                lsum[w][lane] = [lsum[w][lane][h] * c[h] for h in (0, 1)]
                for j in range(4):
                    p = [np.exp(np.float32(sc[w][j][lane][e] - n[e >> 1])) for e in range(4)]
                    lsum[w][lane][0] += p[0] + p[1]
                    lsum[w][lane][1] += p[2] + p[3]
                    col = 32 * kh + 8 * j + 2 * t
                    ps[hg + g, col:col + 2] = bf16(p[0:2])
                    ps[hg + g + 8, col:col + 2] = bf16(p[2:4])
        for w in range(8):
            hg, kh = 16 * (w & 3), w >> 2
            for j in range(2 * nj):
                for lane in range(32):
                    c = corr[w][lane]
                    o[w][j][lane] = [o[w][j][lane][0] * c[0], o[w][j][lane][1] * c[0],
                                     o[w][j][lane][2] * c[1], o[w][j][lane][3] * c[1]]
            for kk in range(4):
                a = ldsm_x4(ps, [(hg + (la & 15), 16 * kk + 8 * (la >> 4)) for la in range(32)])
                for j in range(nj):
                    r = ldsm_x4_trans(ks, [(16 * kk + (la & 7) + 8 * ((la >> 3) & 1),
                                            (dp // 2) * kh + 16 * j + 8 * (la >> 4)) for la in range(32)])
                    mma(o[w][2 * j], a, [(r[la][0], r[la][1]) for la in range(32)])
                    mma(o[w][2 * j + 1], a, [(r[la][2], r[la][3]) for la in range(32)])
    den = np.zeros((2, 64))
    for w in range(8):
        hg, kh = 16 * (w & 3), w >> 2
        for lane in range(32):
            g = lane // 4
            den[kh, hg + g] += lsum[w][lane][0]
            den[kh, hg + g + 8] += lsum[w][lane][1]
    out = np.zeros((64, dp), np.float32)
    for w in range(8):
        hg, kh = 16 * (w & 3), w >> 2
        for lane in range(32):
            g, t = lane // 4, lane % 4
            mm = m[w][lane]
            d = [den[0, hg + g + 8 * h] + den[1, hg + g + 8 * h] + np.exp(sinks[hg + g + 8 * h] - mm[h])
                 for h in (0, 1)]
            for j in range(2 * nj):
                c = (dp // 2) * kh + 8 * j + 2 * t
                v = o[w][j][lane]
                out[hg + g, c:c + 2] = bf16([v[0] / d[0], v[1] / d[0]])
                out[hg + g + 8, c:c + 2] = bf16([v[2] / d[1], v[3] / d[1]])
    return out


def online(q, tiles, valid, sinks, scale):
    """A plain online softmax over the same 64-key tiles (P rounded to bf16 against the running max)."""
    m, den, o = np.full(64, -1e30), np.zeros(64), np.zeros((64, q.shape[1]))
    for kt, ok in zip(tiles, valid, strict=True):
        s = np.where(ok[None, :], (q.astype(np.float64) @ kt.T.astype(np.float64)) * scale, -np.inf)
        n = np.maximum(m, s.max(axis=1))
        c = np.exp(m - n)
        p = np.exp(s - n[:, None])
        den = den * c + p.sum(axis=1)
        o = o * c[:, None] + bf16(p).astype(np.float64) @ kt
        m = n
    return bf16(o / (den + np.exp(sinks - m))[:, None])


def _host_smem(dp: int) -> int:
    """engine/ops/gpu/attention.py's _asb_smem (that module imports CuPy: read, not imported)."""
    tree = ast.parse((ROOT / "engine/ops/gpu/attention.py").read_text())
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_asb_smem"]
    ns: dict = {}
    exec(compile(ast.Module(fn, []), "attention", "exec"), ns)
    return ns["_asb_smem"](dp)


CASES = ((64, 64, 2, 1), (64, 128, 1, 2), (128, 128, 2, 3))  # (D, DP, tiles, seed)
KEY_CLASSES = ("AsbPrompt", "AsbTable")  # where a block's keys come from (prompt chunk; decode table)


def staging(cls: str, dp: int) -> list:
    """For Keys class `cls` (kernels/attention.cu), each of its loops over a key row's 16-byte chunks
    in stage() (the table's: its loads, then its stores), read from the kernel: per loop, the element
    columns c that thread sub = tid % 4 of the row's four writes, [sub][i] -> c."""
    body = _SRC[_SRC.index(f"struct {cls} {{"):]
    body = body[:body.index("\n};")]
    loops = re.findall(r"for \(int i = 0; i < DP / (\d+); \+\+i\) \{\s*const int c = ([^;]+);", body)
    assert loops, f"{cls}: no staging loop found"
    out = []
    for per, expr in loops:
        py = compile(expr.replace("/", "//"), cls, "eval")
        out.append([[eval(py, {}, {"sub": sub, "i": i, "DP": dp}) for i in range(dp // int(per))]  # noqa: S307
                    for sub in range(4)])
    return out


def check_staging(dp: int) -> None:
    """Every Keys class's four threads of a key row stage each of its DP / 8 chunks exactly once, in
    every loop of its stage(): the loads and the stores of a table row agree."""
    for cls in KEY_CLASSES:
        loops = staging(cls, dp)
        for cols in loops:
            flat = sorted(c for row in cols for c in row)
            assert flat == list(range(0, dp, 8)), (cls, dp, flat[:12])
        assert all(cols == loops[0] for cols in loops), (cls, "loops stage different chunks")


def check(d: int, dp: int, ntiles: int, seed: int) -> tuple[float, float]:
    """One block of random bf16 q and keys (some key rows missing); raises AssertionError where the
    block differs from a plain online softmax over the same tiles (beyond f32 noise) or from the
    two-pass reference beyond the GPU test's tolerance. Returns both relative errors (norm)."""
    smem = eval(_SMEM.replace("dp", str(dp)))  # noqa: S307 (the kernel's own arithmetic)
    assert smem == _host_smem(dp), (dp, smem, _host_smem(dp))  # (what the launch asks for)
    rng = np.random.default_rng(seed)
    q = np.zeros((64, dp), np.float32)
    q[:, :d] = bf16(rng.standard_normal((64, d)))
    tiles, valid = [], []
    for _ in range(ntiles):
        k = np.zeros((64, dp), np.float32)
        k[:, :d] = bf16(rng.standard_normal((64, d)))
        ok = rng.random(64) < 0.8
        k[~ok] = 0.0  # (a missing key row lands as zeros)
        tiles.append(k)
        valid.append(ok)
    sinks, scale = rng.standard_normal(64).astype(np.float32), d**-0.5
    got = block(q, tiles, valid, sinks, scale, dp)
    want = online(q, tiles, valid, sinks, scale)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    keys = np.concatenate([k[ok] for k, ok in zip(tiles, valid, strict=True)])
    s = (q.astype(np.float64) @ keys.T) * scale
    mx = np.maximum(s.max(axis=1), -1e30)
    p = np.exp(s - mx[:, None])
    ref = bf16((bf16(p) @ keys) / (p.sum(axis=1) + np.exp(sinks - mx))[:, None])
    rerr = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert err < 1e-3 and rerr < 5e-3, (d, dp, ntiles, err, rerr)  # (5e-3: the GPU test's ONLINE_ATTN_TOL)
    return err, rerr


def main() -> int:
    bad = 0
    for dp in (64, 128, 256, 512):
        try:
            check_staging(dp)
        except AssertionError as e:
            print(f"staging DP {dp}: {e}")
            bad += 1
    for d, dp, ntiles, seed in CASES:
        try:
            err, rerr = check(d, dp, ntiles, seed)
            print(f"D {d} (padded to {dp}), {ntiles} tile(s): rel err (norm) {err:.2e} against the online softmax, "
                  f"{rerr:.2e} against the two-pass reference")
        except AssertionError as e:
            print(f"D {d} (padded to {dp}), {ntiles} tile(s): differs {e}")
            bad += 1
    print("ok" if not bad else f"{bad} case(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
