"""bench_spec.verify_ready on the numpy backend: the verify step it sets up leaves the states as
they were, and it reports the distinct experts each MoE layer routed the verify rows to."""

from __future__ import annotations

import numpy as np

from engine.bench_spec import verify_ready
from engine.runtime.engine import Engine
from engine.settings import Settings


def test_verify_ready_counts_the_routed_experts_and_rolls_back():
    eng = Engine.load(None, settings=Settings(numerics="exact"))
    model, cfg = eng.model, eng.model.cfg
    routed: list[int] = []
    states, drafts, last = verify_ready(model, cfg, 2, np.random.default_rng(0), routed)
    moe_layers = sum(1 for layer in model.w.layers if getattr(layer.ffn, "experts", None) is not None)
    rows = 2 * (model.model.dspark.block_size + 1)  # (the verify step: each sequence's last token and drafts)
    assert len(routed) == moe_layers and all(1 <= n <= min(cfg.n_routed_experts, rows * cfg.num_experts_per_tok)
                                             for n in routed)
    assert "route" not in vars(model.ops)  # (the counting wrapper is gone)
    assert all(st.position == cfg.sliding_window + 1 for st in states) and len(drafts) == len(last) == 2


def test_served_step_runs_speculative_steps_on_fresh_sequences():
    """bench_spec.served_step (bench's served column; gpu_profile.py served shares its sequences) on the
    numpy backend: fresh sequences a window into their prompts, their drafts' windows full, each
    step keeping at least one token a sequence; with the verify planned inline too."""
    from engine.bench_spec import served_sequences, served_step

    eng = Engine.load(None, settings=Settings(numerics="exact"))
    model, cfg, dsp = eng.model, eng.model.cfg, eng.model.model.dspark
    seqs = served_sequences(model, dsp, cfg, 2, np.random.default_rng(0))
    assert all(st.position == cfg.sliding_window + 1 and ds.windows[0].shape[0] == cfg.sliding_window
               for st, ds, _, _ in seqs)
    for ahead in (True, False):
        seconds, per_step = served_step(model, dsp, cfg, 2, np.random.default_rng(1), ahead=ahead, steps=1)
        assert seconds > 0 and 1 <= per_step <= dsp.block_size + 1
    assert "prepare_verify" not in vars(model)  # (the inline run's override is gone)
