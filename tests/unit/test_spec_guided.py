"""Constrained drafting under speculation (engine/runtime/spec_guided.py) on a random tiny V4.1
checkpoint with draft layers: every drafted token is allowed by its position's mask, the masks are
those the grammar gives after the drafts before them, a literal stretch is drafted whole, and the
sequence's own matcher is left as it was. Greedy speculative decoding with these masks emits what
plain masked greedy decoding emits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.checkpoint.tiny_model import write_tiny_model
from engine.runtime.constraint import Constrainer, GrammarSpec
from engine.runtime.engine import Engine
from engine.runtime.sampling import SampleJob, SamplingParams, sample, token_mask
from engine.runtime.spec_decode import SpecJob, SpecStats, draft_of, feed, speculative_steps
from engine.runtime.spec_guided import guided_drafter
from tests.unit.spec_drafts import proposing
from tests.unit.test_speculative_decode import SIZES, X, _prompt

SCHEMA = {"type": "object", "properties": {"a_rather_long_key_name": {"enum": ["some-fixed-value", "b"]},
                                           "n": {"type": "integer"}},
          "required": ["a_rather_long_key_name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("spec_guided"), "v41", seed=13, draft=True, **SIZES)


def _constrainer(eng: Engine) -> Constrainer:
    ids = eng.tokenizer.special_ids
    return Constrainer(eng.ckpt_dir / "tokenizer.json", int(eng.config.vocab_size), sorted(eng.eos_ids),
                       eng.config.arch, ids.get("dsml"), ids.get("think_end"))


def test_drafts_follow_the_grammar_and_leave_the_matcher(ckpt) -> None:
    eng = proposing(ckpt, X)  # its own pick is always X, which the grammar refuses
    dsp, c = draft_of(eng.model), _constrainer(eng)
    tc = c.start(GrammarSpec("json", json.dumps(SCHEMA)), False)
    st, ds = eng.new_state(), dsp.new_state()
    feed(eng.model, dsp, st, ds, _prompt(9), all_logits=False)
    before = c.masks([tc])[0].copy()
    drafts, masks = guided_drafter(tc, c, eng.eos_ids)(dsp, ds, 5, dsp.block_size)
    assert len(drafts) == dsp.block_size and len(masks) == len(drafts) + 1 and X not in drafts
    assert np.array_equal(c.masks([tc])[0], before)  # the sequence's matcher did not move
    walk = tc.fork()
    for d, m in zip(drafts, masks, strict=False):
        assert np.array_equal(m, c.masks([walk])[0]) and token_mask(m, eng.config.vocab_size)[d]
        assert walk.advance(d)
    assert np.array_equal(masks[-1], c.masks([walk])[0])
    # the schema's opening is a literal: the drafts are exactly its tokens
    assert eng.tokenizer.decode(drafts) == '{"a_rather_long_key_name": "some-fixed-value", "n": '[:len(
        eng.tokenizer.decode(drafts))]


def test_greedy_guided_speculation_equals_masked_plain(ckpt) -> None:
    eng = Engine.load(ckpt)
    dsp, c = draft_of(eng.model), _constrainer(eng)
    params, prompt, n = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), _prompt(15), 30

    def plain() -> list:
        tc, st, out, rng = c.start(GrammarSpec("json", json.dumps(SCHEMA)), False), eng.new_state(), [], None
        chunk = prompt
        while len(out) < n and (not out or out[-1][0] not in eng.eos_ids):
            out.append(eng.step_sample([st], [chunk], [SampleJob(0, params, [t for t, *_ in out], rng,
                                                                 c.masks([tc])[0])])[0])
            assert tc.advance(out[-1][0])
            chunk = [out[-1][0]]
        return out

    tc, st, ds = c.start(GrammarSpec("json", json.dumps(SCHEMA)), False), eng.new_state(), dsp.new_state()
    logits = feed(eng.model, dsp, st, ds, prompt, all_logits=False)

    got, stats = [sample(np.asarray(logits), params, [], None, c.masks([tc])[0])], SpecStats()
    assert tc.advance(got[0][0])
    while len(got) < n and got[-1][0] not in eng.eos_ids:
        gen, lps = [t for t, *_ in got], []
        job = SpecJob(st, ds, gen, n - len(gen), params, tuple(eng.eos_ids), None, stats, lps,
                      guided_drafter(tc, c, eng.eos_ids))
        for t, (lp, top) in zip(speculative_steps(eng.model, dsp, [job])[0], lps, strict=True):
            got.append((t, lp, top))
            assert tc.advance(t)
    assert got == plain()
    assert stats.accepted > 0
