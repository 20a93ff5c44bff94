"""DSpark draft layers on the GPU backend: load_weights uploads them (ops.prepare per tensor,
like the main layers) and the main model's logits are those of the same checkpoint without them."""

from __future__ import annotations

import numpy as np
from gpu_required import require_gpu

cp = require_gpu()

from engine.checkpoint.reader import Checkpoint  # noqa: E402
from engine.checkpoint.tiny_model import write_tiny_model  # noqa: E402
from engine.model.config import load_config  # noqa: E402
from engine.ops.gpu.ops import CupyOps, GpuWeight  # noqa: E402
from engine.runtime.runner import ModelRunner as Model  # noqa: E402


def test_draft_layers_upload_and_leave_the_main_model_alone(tmp_path):
    logits = {}
    for draft in (True, False):
        d = write_tiny_model(tmp_path / str(draft), "v41", seed=6, draft=draft)
        cfg = load_config(d)
        m = Model(cfg, Checkpoint(d, block_size=cfg.weight_block_size), CupyOps(), d / "tokenizer.json")
        if draft:
            ds = m.w.dspark
            assert isinstance(ds.main_proj, GpuWeight) and isinstance(ds.markov_head.head, GpuWeight)
            assert isinstance(ds.layers[2].ffn.experts[3][1], GpuWeight)
            assert isinstance(ds.main_norm, cp.ndarray) and len(ds.layers) == cfg.dspark_layers
        else:
            assert m.w.dspark is None
        ids = list(np.random.default_rng(0).integers(10, cfg.vocab_size, 20))
        logits[draft] = cp.asnumpy(cp.asarray(m.forward([m.new_state()], [ids], all_logits=True)[0]))
    assert np.array_equal(logits[True], logits[False])
