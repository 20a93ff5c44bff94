"""engine/state/decode_plan.py on a random 8-layer V4.1 checkpoint (numpy): the plans a decode step
shares between layers, and the step's signature (what keys its CUDA graph) over them."""

from __future__ import annotations

import numpy as np

from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.tiny_model import write_tiny_model
from engine.model.config import load_config
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner as Model
from engine.state.decode_plan import StepInputs, plan_decode


def test_reading_layers_share_plans_and_signatures(tmp_path) -> None:
    """8 layers: a sliding one, a ratio-2 group (its source, then two layers reading it) and a
    ratio-1 group (its source and a re-index layer, then two reading layers): each pair of reading
    layers shares one plan, no layer with state of its own does, and the step's signature is the
    layers' own signatures."""
    path = write_tiny_model(tmp_path / "m", arch="v41", seed=5, layers=8)
    cfg = load_config(path)
    m = Model(cfg, Checkpoint(path, block_size=cfg.weight_block_size), NumpyOps(), path / "tokenizer.json")
    rng = np.random.default_rng(0)
    states = [m.new_state() for _ in range(3)]
    m.forward(states, [rng.integers(3, cfg.vocab_size, n) for n in (40, 9, 70)])
    win, layers = plan_decode(cfg, states, m.ops.xp, [], m.model.rope.compressed, True)
    busy = {li for li in range(cfg.num_layers)
            if cfg.layer_kinds[li] == "source" or li in cfg.index_source_layer_ids}
    by_id: dict = {}
    for li, lp in enumerate(layers):
        by_id.setdefault(id(lp), []).append(li)
    shared = sorted(lis for lis in by_id.values() if len(lis) > 1)
    assert len(shared) == 2 and not busy & {li for lis in shared for li in lis}, (shared, busy)
    inputs = StepInputs(ids=np.zeros(3, np.int64), hash_ids=None, rope=np.zeros((4, 3, 8), np.float32),
                        layers=layers, window=win)
    assert inputs.signature()[-1] == tuple(lp.signature() for lp in layers)
