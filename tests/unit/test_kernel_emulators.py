"""The sm_90a wgmma FP8 / FP4 GEMMs' logic, checked on the CPU: tools/dev/emulate_wgmma_gemm.py and
emulate_grouped_gemm.py run the kernels thread by thread in numpy (every copy and its bounds, every
mbarrier phase, descriptor and swizzled address, the FP4 expansion and the promotion) and compare
Y with a plain product. The kernels' constants are parsed from their #defines, so a change to the
ring's layout, the barriers' counts or the producer's copies that breaks the protocol fails here
before it reaches a GPU. tools/dev/emulate_gemv_q8.py builds the e4m3 GEMV's MMA fragments lane by lane
(its FP4 decoding and x permutation, the ring's swizzle and ldmatrix). emulate_indexer_bf.py and
emulate_attn_sparse_bf.py do the same for the indexer's two-MMA scores and the one-pass prompt
attention (ldmatrix and ldmatrix.trans addresses, fragments, the online softmax);
emulate_bf16_wgmma.py for the register-operand bf16 wgmma kernels of kernels/bf16_weights.cu (the rows'
K order, the swizzled token tiles, each thread's weight words and A fragments); emulate_fp4_experts.py
for kernels/fp4_experts.cu's FP4 experts' and FP8 weights' kernel (the producer's copies and decode into shared memory,
the barriers' phases under random interleavings of the roles, operands that must not change while a
wgmma reads them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "dev"))

import emulate_attn_sparse_bf as attn_bf  # noqa: E402
import emulate_bf16_wgmma as bf16_wgmma  # noqa: E402
import emulate_fp4_experts as fp4_experts  # noqa: E402
import emulate_gemv_q8 as gemv_q8  # noqa: E402
import emulate_grouped_gemm as grouped  # noqa: E402
import emulate_indexer_bf as indexer_bf  # noqa: E402
import emulate_wgmma_gemm as dense  # noqa: E402


def _name(fmt: int) -> str:
    return "fp8" if fmt == dense.FMT_FP8 else "fp4"


@pytest.mark.parametrize("case", dense.CASES, ids=lambda c: f"{_name(c[0])}-{c[1]}x{c[2]}x{c[3]}")
def test_wgmma_gemm_emulated(case):
    fmt, m, n, k, extra = case
    if fmt == dense.FMT_FP8:
        dense.check(fmt, m, n, k, extra)
    else:
        dense.check(fmt, m, n, k, exps=extra)


@pytest.mark.parametrize("case", dense.SPLIT_CASES, ids=lambda c: f"{_name(c[0])}-{c[1]}x{c[2]}x{c[3]}-S{c[5]}")
def test_wgmma_gemm_split_k_emulated(case):
    fmt, m, n, k, block, splits = case
    dense.check(fmt, m, n, k, block, splits=splits)


@pytest.mark.parametrize("case", grouped.CASES, ids=lambda c: f"{_name(c[0])}-T{c[1]}")
def test_grouped_gemm_emulated(case):
    grouped.check(*case)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gemv_q8_fragments_emulated(fmt, seed):
    gemv_q8.check(fmt, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_gemv_q8_bf16_fragments_emulated(seed):
    gemv_q8.check_bf16(seed)


@pytest.mark.parametrize("case", attn_bf.CASES, ids=lambda c: f"D{c[0]}-DP{c[1]}-T{c[2]}")
def test_attn_sparse_bf_block_emulated(case):
    attn_bf.check(*case)


@pytest.mark.parametrize("dp", [64, 128, 256, 512])
def test_attn_bf_key_staging_covers_each_row_once(dp):
    attn_bf.check_staging(dp)


def test_indexer_bf_warps_emulated():
    assert indexer_bf.main() == 0


@pytest.mark.parametrize("case", bf16_wgmma.CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}x{c[3]}")
def test_bf16_wgmma_emulated(case):
    bf16_wgmma.check(*case)


@pytest.mark.parametrize("case", fp4_experts.CASES, ids=lambda c: f"T{c[0]}-D{c[3]}-N{c[4]}")
def test_fp4_experts_emulated(case):
    fp4_experts.check(*case)


@pytest.mark.parametrize("case", fp4_experts.FP8_CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}-B{c[3][0]}")
def test_fd_fp8_emulated(case):
    fp4_experts.check_fp8(*case)


def test_fp4_experts_emulator_finds_a_deadlock(monkeypatch):
    """The decode LAG chunks behind its copies needs LAG < the ring's stages: at as many, the producer
    waits for a stage the consumers free only after a chunk it has not decoded yet."""
    cfg = fp4_experts.CFG[fp4_experts.FP4]
    monkeypatch.setattr(cfg, "lag", cfg.st)
    with pytest.raises(AssertionError, match="deadlock"):
        fp4_experts.check(20, 1, 2, 320, 64, (120, 132), False, 0)
