"""A speculative verify step planned while the draft runs (ModelRunner.prepare_verify, offered to
DSpark.draft_many by spec_decode.speculative_steps): the same tokens, the same states byte for
byte and the same draft windows as planning it inline, the plan made ahead taken at every step
that drafts, and dropped where the verify step is not the one it was made for.

The comparison runs the same engine with prepare_verify hidden (an instance attribute the test
sets), so that speculative_steps offers nothing ahead and every verify step is planned inline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.tiny_model import write_tiny_model
from engine.runtime.engine import Engine
from engine.runtime.sampling import SamplingParams, sample
from engine.runtime.spec_decode import SpecJob, SpecStats, feed, speculative_steps
from engine.state import trial as trials
from tests.unit.spec_drafts import proposing
from tests.unit.test_speculative_decode import SIZES, X

GREEDY = SamplingParams(temperature=0.0)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 1000, size=n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("verify_ahead"), "v41", seed=11, draft=True, **SIZES)


@pytest.fixture(scope="module")
def engine(ckpt) -> Engine:
    return Engine.load(ckpt)


@pytest.fixture(scope="module")
def agreeing(ckpt) -> Engine:
    return proposing(ckpt, X)


def _serve(eng: Engine, cases: list, ahead: bool, guided: dict | None = None) -> tuple[list, int, int]:
    """Speculative generation of every case (prompt, params, max tokens, eos ids) in one batch,
    sequences leaving as they finish: each one's (tokens, state bytes, draft windows, stats), the
    verify steps that took a plan made ahead, and the steps that drafted (those that can)."""
    runner, dsp = eng.model, eng.model.draft
    if not ahead:
        runner.prepare_verify = None  # (hidden: speculative_steps offers no plan ahead)
    try:
        seqs = []
        for i, (prompt, params, _, _) in enumerate(cases):
            st, ds, rng = runner.new_state(), dsp.new_state(), np.random.default_rng(100 + i)
            out = [sample(feed(runner, dsp, st, ds, prompt, all_logits=False), params, [], rng)[0]]
            seqs.append((st, ds, out, rng, SpecStats()))
        used, drafting = runner.ahead_used, 0
        while live := [i for i, (_, _, out, _, _) in enumerate(seqs)
                       if len(out) < cases[i][2] and out[-1] not in cases[i][3]]:
            jobs = []
            for i in live:
                st, ds, out, rng, stats = seqs[i]
                _, params, limit, eos = cases[i]
                jobs.append(SpecJob(st, ds, out, limit - len(out), params, eos, rng, stats, None,
                                    (guided or {}).get(i)))
            drafting += any(j.room > 1 for j in jobs)
            for i, toks in zip(live, speculative_steps(runner, dsp, jobs), strict=True):
                seqs[i][2].extend(toks)
        got = [(out, st.to_bytes(), [np.array(w) for w in ds.windows], stats) for st, ds, out, _, stats in seqs]
        return got, runner.ahead_used - used, drafting
    finally:
        if not ahead:
            del runner.prepare_verify


def _same(a: list, b: list) -> None:
    for (ta, sa, wa, ca), (tb, sb, wb, cb) in zip(a, b, strict=True):
        assert ta == tb
        assert sa == sb
        assert ca == cb
        for x, y in zip(wa, wb, strict=True):
            np.testing.assert_array_equal(x, y)


def _both(eng: Engine, cases: list) -> list:
    """The run with the plan made ahead and the run without it agree; every drafting step took it."""
    inline, used, _ = _serve(eng, cases, ahead=False)
    assert used == 0
    got, used, drafting = _serve(eng, cases, ahead=True)
    _same(got, inline)
    assert used == drafting > 0
    return got


def test_greedy_and_sampled_alone(engine) -> None:
    sampled = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.2, seed=5)
    for length, params in ((3, GREEDY), (21, GREEDY), (45, sampled), (21, sampled)):
        _both(engine, [(_prompt(length, length), params, 150, ())])


def test_mixed_batch_sequences_finishing_inside_blocks(engine, agreeing) -> None:
    """Greedy and seeded sampled sequences at different positions in one batch, leaving it at their
    max_tokens (inside a block: the block is shortened to what may still be emitted) or at a stop
    id drawn inside a block of kept drafts, the others going on."""
    steer = SamplingParams(temperature=0.0, logit_bias=((X, 100.0),))
    eos = agreeing.eos_ids[0]
    stopping = SamplingParams(temperature=0.0, frequency_penalty=1.0, logit_bias=((X, 60.0), (eos, 55.5)))
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=7, logit_bias=((X, 6.0),))
    cases = [(_prompt(3, 1), GREEDY, 120, ()), (_prompt(17, 2), steer, 23, ()),
             (_prompt(40, 3), sampled, 31, ()), (_prompt(21, 4), stopping, 40, (eos,)),
             (_prompt(9, 5), steer, 2, ())]
    for eng in (engine, agreeing):
        got = _both(eng, cases)
    assert got[3][0][-1] == eos and 2 < len(got[3][0]) < 40  # (stopped inside a block of kept X's)
    assert len(got[1][0]) == 23 and got[1][3].accepted > 0


def test_a_guided_sequence_plans_inline(ckpt) -> None:
    """A constrained sequence's draft may end early, so its step is planned after drafting: a batch
    with one offers no plan ahead, and runs as before."""
    import json

    from engine.runtime.constraint import GrammarSpec
    from engine.runtime.spec_guided import guided_drafter
    from tests.unit.test_spec_guided import SCHEMA, _constrainer

    eng = Engine.load(ckpt)
    c = _constrainer(eng)
    tc = c.start(GrammarSpec("json", json.dumps(SCHEMA)), False)
    cases = [(_prompt(15, 6), GREEDY, 8, ()), (_prompt(5, 7), GREEDY, 40, ())]  # (the guided one outlives)
    inline, _, _ = _serve(eng, cases, ahead=False, guided={1: guided_drafter(tc, c, ())})
    got, used, _ = _serve(eng, cases, ahead=True, guided={1: guided_drafter(tc, c, ())})
    assert used == 0 and len(got[1][0]) == 40
    _same(got, inline)


def test_a_plan_made_ahead_for_another_step_is_dropped(engine) -> None:
    """forward(verify=True) takes a plan only for its own call: other row counts, other states or
    a decode step's plan leave it unused, and the step's logits and state bytes are those of
    planning inline."""
    runner = engine.model
    blocks = [_prompt(4, 8), _prompt(6, 9)]

    def ready() -> list:
        states = []
        for n in (13, 30):
            st = runner.new_state()
            runner.forward([st], [_prompt(n, n)])
            states.append(st)
        return states

    def verify(states, prepare=None) -> tuple:
        marks = [trials.begin(st) for st in states]
        if prepare is not None:
            prepare(states)
        used = runner.ahead_used
        rows = runner.forward(states, blocks, all_logits=True, verify=True)
        for st, tr in zip(states, marks, strict=True):
            trials.cut(st, tr, 3)
        return [r.copy() for r in rows], [st.to_bytes() for st in states], runner.ahead_used - used

    want_rows, want_bytes, used = verify(ready())
    assert used == 0
    other = ready()
    for prepare, taken in ((lambda s: runner.prepare_verify(s, [4, 6]), 1),
                           (lambda s: runner.prepare_verify(s, [4, 5]), 0),
                           (lambda s: runner.prepare_verify(s[::-1], [6, 4]), 0),
                           (lambda s: runner.prepare_verify(other, [4, 6]), 0),
                           (lambda s: runner.prepare_next(s), 0)):
        rows, got, used = verify(ready(), prepare)
        assert used == taken
        assert got == want_bytes
        for a, b in zip(rows, want_rows, strict=True):
            np.testing.assert_array_equal(a, b)
