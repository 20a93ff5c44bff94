"""The tensor-parallel code path on one GPU: CupyOps ranks of a sharded model (collectives as
sums on the same device) give the plain GPU path's logits. Skipped where CuPy or a GPU is absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_required import require_gpu

cp = require_gpu()

from engine.backends.cupy_ops import CupyOps  # noqa: E402
from engine.checkpoint import Checkpoint  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.model import Model  # noqa: E402
from engine.tp import SimulatedTP  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo-v41"


@pytest.mark.parametrize("size", [1, 2, 4])
def test_gpu_tp_ranks_match_plain_gpu_path(size: int) -> None:
    cfg = load_config(DEMO)
    ck, tok = Checkpoint(DEMO), DEMO / "tokenizer.json"
    ids = np.random.default_rng(size).integers(3, cfg.vocab_size, size=120).tolist()
    plain = Model(cfg, ck, CupyOps(), tok, store_quantized=False)
    ref = plain.forward([plain.new_state()], [ids], all_logits=True)[0]
    tp = SimulatedTP(cfg, ck, CupyOps, size, tok, store_quantized=False)
    out = tp.forward([tp.new_state()], [ids], all_logits=True)[0]
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    print(f"TP{size} on one GPU vs plain GPU path: relative error {err:.2e}")
    assert err < 1e-3
    assert (out.argmax(-1) == ref.argmax(-1)).mean() > 0.97
