"""tools/dev/sass_mix.py's parsing of cuobjdump's SASS listing (the cubin and cuobjdump need the
GPU machine; the histogram does not)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "dev"))

import sass_mix  # noqa: E402

LISTING = """
	code for sm_90a
		Function : tcgemv8_fp4_n1
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                 /* 0x00000a00ff017b82 */
                                                                                          /* 0x000fe40000000800 */
        /*3870*/                   HMMA.16816.F32 R48, R48, R32, RZ ;                     /* 0x000000203030723c */
        /*37f0*/                   F2FP.F16.E4M3.UNPACK_B R32, R53 ;                      /* 0x000000353520723e */
        /*3990*/               @P0 BRA 0x3b30 ;                                           /* 0x0000000000640947 */
        /*39d0*/              @!P1 BRA 0x3b70 ;                                           /* 0x0000000000641947 */
        /*3a80*/                   LDG.E.U8.CONSTANT R48, desc[UR10][R48.64] ;            /* 0x0000000a30307981 */
        /*3b00*/              @UP0 IMAD.SHL.U32 R55, R32, 0x800000, RZ ;                  /* 0x0080000020377824 */
        /*3c00*/                   EXIT ;                                                 /* 0x000000000000794d */
"""


def test_opcode_mix_counts_instruction_lines_by_opcode():
    mix = sass_mix.opcode_mix(LISTING)
    assert mix == {"LDC": 1, "HMMA": 1, "F2FP": 1, "BRA": 2, "LDG": 1, "IMAD": 1, "EXIT": 1}
