"""How each linear computes under `--numerics deepseek`, as DeepSeek's reference declares it.

The reference's `linear()` picks its GEMM from the weight's dtype: an FP8 or FP4 weight takes an
activation quantized to FP8 e4m3 per 32 along K (UE8M0 scales) and returns bf16; a bf16 weight
takes the bf16 activation and returns bf16; an fp32 weight computes in fp32. Most weights keep
the checkpoint's format, but some modules declare their own dtype (convert.py stores them so):
wo_a, the ratio-1 compressor's wkv, the indexer's wk and weights_proj are bf16; the ratio > 1
compressor's wkv / wgate, the gate and the heads (main, Markov, confidence) are fp32.
"""

from __future__ import annotations

import re

from engine.model.config import ModelConfig

QUANT, BF16, F32 = "quant", "bf16", "f32"

_BF16 = ("attn.wo_a.weight", "indexer.wk.weight", "indexer.weights_proj.weight")
_F32 = ("ffn.gate.weight", "compressor.wgate.weight", "markov_head.head.weight", "confidence_head.proj.weight")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def linear_use(cfg: ModelConfig, name: str, fmt: str) -> str:
    """QUANT, BF16 or F32 for the linear weight `name` (schema name) stored in `fmt`."""
    if name == "head.weight" or name.endswith(_F32):
        return F32
    if name.endswith(_BF16):
        return BF16
    if name.endswith("compressor.wkv.weight"):
        m = _LAYER.search(name)
        ratio = cfg.compress_ratios[int(m.group(1))] if m and not name.startswith("mtp.") else 1
        return F32 if ratio > 1 else BF16
    return QUANT if fmt in ("fp8", "fp4") else F32 if fmt == "f32" else BF16
