"""tools/dev/wgmma_hazards.py: writes to an in-flight wgmma's A registers in SASS, on a listing with
the bug planted, and on our kernels as NVRTC builds them for sm_90a (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "dev"))

import wgmma_hazards as wh  # noqa: E402

# Two RS wgmmas in flight (R160, R152), a wait that retires the older one, then writes: R153 is
# still read by the newer one (a hazard), R161 no longer (the older one retired), R152 through a
# predicated 128-bit load and R150..R153 through an ldmatrix of four matrices (hazards), R10 never
# read; then a full wait.
LISTING = """
		Function : gemm_planted
        /*0010*/                   WARPGROUP.ARRIVE ;                                     /* 0x0 */
        /*0020*/                   HGMMA.64x256x16.F32.BF16 R24, R160, gdesc[UR16], R24, gsb0 ; /* 0x0 */
        /*0030*/                   IMAD.MOV.U32 R163, RZ, RZ, R15 ;                       /* 0x0 */
        /*0040*/                   HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR16], R24, gsb0 ; /* 0x0 */
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                        /* 0x0 */
        /*0060*/                   IMAD.MOV.U32 R161, RZ, RZ, R14 ;                       /* 0x0 */
        /*0070*/                   IMAD.MOV.U32 R153, RZ, RZ, R13 ;                       /* 0x0 */
        /*0080*/              @!P0 LDG.E.128.CONSTANT R148, desc[UR10][R6.64] ;           /* 0x0 */
        /*0090*/              @!P0 LDG.E.128.CONSTANT R152, desc[UR10][R8.64] ;           /* 0x0 */
        /*00a0*/                   ISETP.GE.AND P2, PT, R152, R187, PT ;                  /* 0x0 */
        /*00b0*/                   STS [R155], R10 ;                                      /* 0x0 */
        /*00b8*/                   LDSM.16.M88.4 R150, [R2] ;                             /* 0x0 */
        /*00c0*/                   IADD3 R10, R10, 0x1, RZ ;                              /* 0x0 */
        /*00d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                        /* 0x0 */
        /*00e0*/                   IMAD.MOV.U32 R152, RZ, RZ, R1 ;                        /* 0x0 */
		Function : gemm_other
        /*0010*/                   IMAD.MOV.U32 R160, RZ, RZ, R1 ;                        /* 0x0 */
"""


def test_planted_writes_are_found_and_retired_ones_are_not():
    found = wh.hazards(LISTING)
    assert [h.split(":")[0] for h in found] == ["gemm_planted 0030", "gemm_planted 0070", "gemm_planted 0090",
                                                "gemm_planted 00b8"]
    assert "R163" in found[0] and "HGMMA at 0020" in found[0]
    assert "R153" in found[1] and "HGMMA at 0040" in found[1]
    assert "R152" in found[2]


def _tools_present() -> bool:
    try:
        import check_kernels  # noqa: F401

        return wh.cuobjdump() is not None and check_kernels.compile_one("quant", "90a")[0]
    except Exception:  # noqa: BLE001 - a missing libnvrtc or cuda-bindings shows up here
        return False


@pytest.mark.skipif(not _tools_present(), reason="NVRTC or cuobjdump not installed (requirements.txt has both)")
def test_kernels_with_register_a_wgmma_keep_its_registers():
    """Every kernel with a register-A wgmma (the bf16 wgmma GEMMs of kernels/bf16_weights.cu) as
    NVRTC compiles it for sm_90a."""
    listing = wh.sass("bf16_weights")
    assert wh._RS_HGMMA.search(listing), "no register-A HGMMA left to check"
    assert wh.hazards(listing) == []
