"""Trial rows of a sequence state (engine/state/trial.py): a verify step of k decode rows
(ModelRunner.forward(verify=True)) cut back to its first m rows leaves exactly the state that
feeding those m rows plainly (one token a step, as plain decoding does) leaves, byte for byte, for
every m in 0..k; the cut state decodes on exactly like the plain one; and every verify row's
logits are bit for bit those of the plain decode step at its position.

The states before the trial went through a prompt chunk and some decode steps (window blocks and
growth buffers in use), at positions chosen so that window edges (window 8: 7 rows kept) and
compressor group edges (ratio 2 and 1) fall inside the block, and so that the window block and
the entries' and keys' buffers are full and must grow for the verify step.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.checkpoint.tiny_model import write_tiny_model
from engine.runtime.engine import Engine
from engine.state import trial as trials

SIZES = dict(layers=4, hidden=128, heads=2, head_dim=64, q_lora=64, moe_inter=64, experts=4, vocab=1024,
             window=8, index_topk=4, index_heads=4, index_head_dim=32, candidate_blocks=2, engram_vocab=200)
DRAFT = dict(markov_rank=16, draft_layers=2, draft_experts=4)
K = 6  # a verify chunk: the last token and five drafts
# (prompt length, decode steps before the trial): the block starts before the window is full and
# ends past it, starts at odd and even positions (ratio-2 groups close at its first or second row),
# and, after 63 decode steps, needs more rows than the window block and growth buffers hold
CASES = ((1, 0), (2, 1), (3, 2), (5, 0), (9, 2), (14, 3), (30, 1), (121, 3), (9, 63), (10, 63))


def _ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 1000, size=n)]


@pytest.fixture(scope="module", params=[21, 22], ids=lambda p: f"v41-{p}")
def runner(request, tmp_path_factory):
    ckpt = write_tiny_model(tmp_path_factory.mktemp(f"trial-{request.param}"), "v41", seed=request.param,
                            draft=True, **SIZES, **DRAFT)
    return Engine.load(ckpt).model


def _before(runner, prompt: list[int], steps: list[int]):
    st = runner.new_state()
    runner.forward([st], [prompt])
    for t in steps:
        runner.forward([st], [[t]])
    return st


def _decode_on(runner, st, tokens: list[int]) -> list[np.ndarray]:
    return [runner.forward([st], [[t]])[0] for t in tokens]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"p{c[0]}d{c[1]}")
def test_cut_equals_plain_feed(runner, case) -> None:
    plen, dsteps = case
    prompt, steps, block, after = _ids(plen, plen), _ids(dsteps, 100 + plen), _ids(K, 200 + plen), _ids(3, 7)
    plain_logits = _decode_on(runner, _before(runner, prompt, steps), block)
    for m in range(K + 1):
        st = _before(runner, prompt, steps)
        trial = trials.begin(st)
        rows = runner.forward([st], [block], all_logits=True, verify=True)[0]
        np.testing.assert_array_equal(rows, np.stack(plain_logits))
        assert st.trial is trial and len(trial.rows) == K
        trials.cut(st, trial, m)
        assert st.trial is None
        plain = _before(runner, prompt, steps)
        _decode_on(runner, plain, block[:m])
        assert st.position == plain.position == plen + dsteps + m
        assert st.to_bytes() == plain.to_bytes(), f"m={m}"
        # the cut state's bookkeeping (window blocks, growth buffers) carries on like the plain one's
        for a, b in zip(_decode_on(runner, st, after), _decode_on(runner, plain, after), strict=True):
            np.testing.assert_array_equal(a, b)
        assert st.to_bytes() == plain.to_bytes(), f"m={m}, after decoding on"


def test_one_row_trial_kept_or_dropped(runner) -> None:
    """A one-row trial keeps its row or drops it whole, the state then as it was."""
    prompt, steps = _ids(11, 1), _ids(2, 2)
    ref = _before(runner, prompt, steps).to_bytes()
    st = _before(runner, prompt, steps)
    trial = trials.begin(st)
    runner.forward([st], [[55]], all_logits=True, verify=True)
    trials.cut(st, trial, 0)
    assert st.to_bytes() == ref
    plain = _before(runner, prompt, steps)
    for a, b in zip(_decode_on(runner, st, [5, 6, 7]), _decode_on(runner, plain, [5, 6, 7]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert st.to_bytes() == plain.to_bytes()


def test_restore_after_a_failed_forward_and_misuse(runner) -> None:
    st = _before(runner, _ids(10, 3), [])
    ref = st.to_bytes()
    trial = trials.begin(st)
    with pytest.raises(ValueError):
        trials.begin(st)  # one trial at a time
    with pytest.raises(ValueError):
        runner.forward([st], [[1, 2, 10**7]], all_logits=True, verify=True)  # an id outside the vocabulary
    trials.restore(st, trial)
    assert st.trial is None and st.to_bytes() == ref
    trial = trials.begin(st)
    runner.forward([st], [[3, 4, 5]], all_logits=True, verify=True)
    with pytest.raises(ValueError):
        trials.cut(st, trial, 4)  # more rows than the trial fed
    trials.restore(st, trial)
    trial = trials.begin(st)
    runner.forward([st], [[3, 4, 5]], all_logits=True)  # a prompt chunk: no rows to cut back to
    with pytest.raises(ValueError):
        trials.cut(st, trial, 2)


def test_speculative_step_is_one_forward(runner) -> None:
    """A speculative step runs the main model once (the verify chunk, cut back in place), and
    leaves the draft's windows as feeding the kept rows plainly does."""
    from engine.runtime.sampling import SamplingParams
    from engine.runtime.spec_decode import SpecStats, feed, speculative_step

    dsp = runner.model.dspark
    calls = []
    forward = runner.forward

    def counted(*a, **kw):
        calls.append(len(a[1][0]))
        return forward(*a, **kw)

    prompt, params, rng, stats = _ids(13, 5), SamplingParams(temperature=0.0), np.random.default_rng(0), SpecStats()
    st, ds = runner.new_state(), dsp.new_state()
    out = [int(np.argmax(feed(runner, dsp, st, ds, prompt, all_logits=False)))]
    runner.forward = counted
    try:
        while len(out) < 40:
            calls.clear()
            out += speculative_step(runner, dsp, st, ds, out, 40 - len(out) + 1, params, (), rng, stats)
            assert len(calls) == 1
    finally:
        runner.forward = forward
    assert stats.steps and stats.drafted > stats.accepted  # (random drafts: some rows were cut)
    plain, pds = runner.new_state(), dsp.new_state()
    feed(runner, dsp, plain, pds, prompt, all_logits=False)
    for t in out[:-1]:
        feed(runner, dsp, plain, pds, [t], all_logits=False)
    assert st.to_bytes() == plain.to_bytes()
    assert ds.position == pds.position == st.position
    for a, b in zip(ds.windows, pds.windows, strict=True):
        np.testing.assert_array_equal(a, b)


def test_batched_steps_equal_steps_alone(runner) -> None:
    """speculative_steps over several sequences (one verify forward for all, at different
    positions, with a one-row chunk among them when a sequence has room for one token) emits,
    leaves and counts exactly what each sequence's steps alone do."""
    from engine.runtime.sampling import SamplingParams
    from engine.runtime.spec_decode import SpecJob, SpecStats, feed, speculative_steps

    dsp = runner.model.dspark
    prompts = [_ids(3, 31), _ids(17, 32), _ids(40, 33)]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=50),
              SamplingParams(temperature=0.0, presence_penalty=0.5)]
    limits = [30, 13, 22]

    def start(i):
        st, ds = runner.new_state(), dsp.new_state()
        out = [int(np.argmax(feed(runner, dsp, st, ds, prompts[i], all_logits=False)))]
        return [st, ds, out, np.random.default_rng(i), SpecStats()]

    def job(s, i):
        return SpecJob(s[0], s[1], s[2], limits[i] - len(s[2]), params[i], (), s[3], s[4])

    together = [start(i) for i in range(3)]
    calls = 0
    while live := [i for i in range(3) if len(together[i][2]) < limits[i]]:
        for i, toks in zip(live, speculative_steps(runner, dsp, [job(together[i], i) for i in live]), strict=True):
            together[i][2] += toks
        calls += 1
    for i in range(3):
        alone = start(i)
        while len(alone[2]) < limits[i]:
            alone[2] += speculative_steps(runner, dsp, [job(alone, i)])[0]
        assert together[i][2] == alone[2]
        assert together[i][0].to_bytes() == alone[0].to_bytes()
        for a, b in zip(together[i][1].windows, alone[1].windows, strict=True):
            np.testing.assert_array_equal(a, b)
        assert together[i][4] == alone[4]
    assert calls < sum(len(s[4].lengths) for s in together)  # (steps did share forwards)


def test_verify_rows_of_several_sequences_equal_plain_steps(runner) -> None:
    """One verify step over sequences at different positions, of 6, 1 and 4 rows: every row's
    logits and every state's bytes are those of plain decode steps."""
    starts = [(_ids(9, 41), _ids(2, 42)), (_ids(30, 43), []), (_ids(2, 44), _ids(63, 45))]
    blocks = [_ids(6, 46), _ids(1, 47), _ids(4, 48)]
    states = [_before(runner, p, s) for p, s in starts]
    marks = [trials.begin(st) for st in states]
    rows = runner.forward(states, blocks, all_logits=True, verify=True)
    for (p, s), blk, st, tr, got, m in zip(starts, blocks, states, marks, rows, (3, 1, 4), strict=True):
        plain = _before(runner, p, s)
        np.testing.assert_array_equal(got, np.stack(_decode_on(runner, plain, blk)))
        trials.cut(st, tr, m)
        plain = _before(runner, p, s)
        _decode_on(runner, plain, blk[:m])
        assert st.to_bytes() == plain.to_bytes()
