"""The embedded demo model's trained DSpark draft (models/demo-v41, trained by
tools/train_dspark.py): it loads, speculation reproduces plain greedy decoding token for token,
and it is a trained draft (a random one keeps almost no drafted token: about 1.0 tokens/step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoint.reader import Checkpoint
from engine.runtime.engine import Engine
from engine.runtime.sampling import SamplingParams
from engine.text.chat_encoding import render_messages

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"

# chat requests of the kind the demo was trained on (a module docstring's first paragraph)
PROMPTS = ["Utilities for parsing command line arguments.",
           "Read and write ZIP files.",
           "A simple HTTP server that serves files from the current directory."]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(DEMO)


def test_the_demo_ships_draft_layers_in_the_release_formats(engine):
    cfg = engine.config
    assert cfg.has_draft and cfg.dspark_layers == 3 and cfg.dspark_block_size == 5
    assert engine.model.model.dspark is not None
    ck = Checkpoint(DEMO)
    assert ck.raw("mtp.0.attn.wq_a.weight").dtype == "F8_E4M3" and ck.has("mtp.0.attn.wq_a.scale")
    assert ck.raw("mtp.1.ffn.experts.3.w2.weight").dtype == "I8"  # FP4, two per byte
    assert ck.raw("mtp.2.markov_head.embed.weight").dtype == "BF16"


def test_speculation_equals_plain_greedy_and_keeps_drafts(engine):
    greedy = SamplingParams(temperature=0.0)
    emitted = steps = 0
    for text in PROMPTS:
        ids = engine.tokenizer.encode_segments(render_messages([{"role": "user", "content": text}],
                                                               arch="v41", thinking=False))
        spec = engine.generate(ids, 64, greedy, speculative=True)
        stats = engine.last_acceptance
        assert spec == engine.generate(ids, 64, greedy, speculative=False)
        emitted, steps = emitted + sum(stats.lengths), steps + stats.steps
    assert emitted / steps > 1.5, f"acceptance {emitted / steps:.2f} tokens/step: the draft is not the trained one"
