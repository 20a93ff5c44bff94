"""The numpy DSpark draft on a `tiny-model` checkpoint (FP8 / FP4 weights, KV sources, Engram,
three draft layers): its window state is the same whether the prompt came at once, in chunks or
token by token (bounded replay included); drafting leaves that state untouched; collecting the
target inputs leaves the main forward unchanged. (Equality with DeepSeek's reference draft:
tests/reference/test_dspark_reference.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.tiny_model import tiny_model_main
from engine.model.config import load_config
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner

PROMPT = [int(t) for t in np.random.default_rng(7).integers(4, 8000, size=21)]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark") / "tiny"
    assert not tiny_model_main([str(d), "--window", "8"])
    cfg = load_config(d)
    return ModelRunner(cfg, Checkpoint(d, block_size=cfg.weight_block_size), NumpyOps(), d / "tokenizer.json")


def _feed(runner, chunks):
    """Feed the chunks to a fresh sequence, the draft absorbing each; (state, draft state, last logits)."""
    dsp = runner.model.dspark
    st, ds = runner.new_state(), dsp.new_state()
    for ch in chunks:
        targets = dsp.targets
        logits = runner.forward([st], [ch], targets=targets)[0]
        dsp.absorb(ds, targets, len(ch))
    return st, ds, logits


def test_draft_is_the_same_after_prefill_chunks_and_token_by_token(runner) -> None:
    dsp = runner.model.dspark
    assert dsp is not None and dsp.block_size == 5
    drafts = []
    for chunks in ([PROMPT], [PROMPT[:5], PROMPT[5:]], [[t] for t in PROMPT]):
        _, ds, logits = _feed(runner, chunks)
        assert ds.position == len(PROMPT)
        assert all(w.shape[0] == runner.cfg.sliding_window for w in ds.windows)
        drafts.append(dsp.draft(ds, int(np.argmax(logits))))
    ref = drafts[0]
    assert ref.tokens.shape == (5,) and ref.logits.shape == (5, runner.cfg.vocab_size)
    assert ref.confidence.shape == (5,)
    for d in drafts[1:]:
        scale = np.abs(ref.logits).max()
        assert np.abs(d.logits - ref.logits).max() < 1e-4 * scale
        assert np.abs(d.confidence - ref.confidence).max() < 1e-4 * max(np.abs(ref.confidence).max(), 1.0)
        assert d.tokens.tolist() == ref.tokens.tolist()


def test_drafting_reads_the_state_and_greedy_follows_the_markov_bias(runner) -> None:
    dsp = runner.model.dspark
    _, ds, logits = _feed(runner, [PROMPT])
    before = [w.copy() for w in ds.windows]
    last = int(np.argmax(logits))
    a, b = dsp.draft(ds, last), dsp.draft(ds, last)
    assert ds.position == len(PROMPT) and all(np.array_equal(x, y) for x, y in zip(before, ds.windows, strict=True))
    assert np.array_equal(a.logits, b.logits) and a.tokens.tolist() == b.tokens.tolist()
    assert a.tokens.tolist() == a.logits.argmax(axis=1).tolist()
    np.testing.assert_allclose(a.probs.sum(axis=1), 1.0, rtol=1e-5)
    # the block starts with the last token: another one changes what is drafted from position 0
    c = dsp.draft(ds, (last + 1) % runner.cfg.vocab_size)
    assert not np.allclose(c.logits[0], a.logits[0])


def test_collecting_targets_leaves_the_main_forward_unchanged(runner) -> None:
    st1, st2 = runner.new_state(), runner.new_state()
    plain = runner.forward([st1], [PROMPT], all_logits=True)[0]
    targets = runner.model.dspark.targets
    asked = runner.forward([st2], [PROMPT], all_logits=True, targets=targets)[0]
    assert np.array_equal(plain, asked)
    assert all(targets[i].shape == (len(PROMPT), runner.cfg.hidden_size) for i in targets)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_draft_draws_each_token_from_the_distribution_it_returns(runner, temperature) -> None:
    """With a generator the draft draws token i from probs[i] = softmax((logits_i + Markov bias of
    token i - 1) / temperature) by the inverse CDF of one uniform per position, in order; the
    logits differ from the greedy draft's only through the Markov bias of the drawn tokens."""
    dsp = runner.model.dspark
    _, ds, logits = _feed(runner, [PROMPT])
    last = int(np.argmax(logits))
    seen = set()
    for seed in range(6):
        d = dsp.draft(ds, last, np.random.default_rng(seed), temperature)
        u = np.random.default_rng(seed).random(dsp.block_size)
        base = dsp.draft(ds, last)  # (no generator: argmax)
        prev = last
        for i in range(dsp.block_size):
            bias, _ = dsp.markov_head(np.array([prev], np.int64))
            want_logits = base.logits[i] - dsp.markov_head(np.array([int(([last, *base.tokens])[i])], np.int64))[0][0] \
                + bias[0]
            np.testing.assert_allclose(d.logits[i], want_logits, rtol=0, atol=1e-5)
            z = np.asarray(d.logits[i], np.float64) / temperature
            q = np.exp(z - z.max())
            q /= q.sum()
            np.testing.assert_allclose(d.probs[i], q, rtol=1e-12, atol=0)
            c = np.cumsum(d.probs[i])
            assert d.tokens[i] == min(np.searchsorted(c, u[i] * c[-1], side="right"), c.size - 1)
            prev = int(d.tokens[i])
        seen.add(tuple(d.tokens.tolist()))
    assert len(seen) > 1  # different generators, different blocks (the draft is not a point mass)


def test_draft_many_equals_drafts_alone():
    """Several sequences drafted in one forward (greedy and sampled side by side, windows of
    different lengths) get exactly the blocks each gets alone: tokens, logits, distributions,
    confidence, and the same uniforms taken from each generator."""
    from engine.runtime.engine import Engine
    from engine.runtime.spec_decode import feed

    eng = Engine.load()
    model, dsp = eng.model, eng.model.model.dspark
    prompts = [[5, 6, 7], list(range(20, 60)), list(range(300, 310))]
    states = []
    for p in prompts:
        st, ds = model.new_state(), dsp.new_state()
        feed(model, dsp, st, ds, p, all_logits=False)
        states.append(ds)
    last, temps = [11, 12, 13], [1.0, 0.7, 1.0]
    seeds = [None, 3, 4]
    many = dsp.draft_many(states, last, [None if s is None else np.random.default_rng(s) for s in seeds], temps)
    for b, ds in enumerate(states):
        rng = None if seeds[b] is None else np.random.default_rng(seeds[b])
        alone = dsp.draft(ds, last[b], rng, temps[b])
        for got, want in zip(many[b], alone, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_draft_layers_run_as_the_runners_region_once_windows_are_full():
    """DSpark.forward hands its draft layers to the runner's region (a CUDA graph on the GPU) only
    where every window is full, so the shapes repeat; the blocks are the same either way."""
    from engine.runtime.engine import Engine
    from engine.runtime.spec_decode import feed

    eng = Engine.load()
    model, dsp = eng.model, eng.model.model.dspark
    win = dsp.cfg.sliding_window
    calls = []

    def region(key, fn, *arrays, rows=None):
        calls.append((key, rows))
        return fn(*arrays)

    states = []
    for n in (win + 3, 7):
        st, ds = model.new_state(), dsp.new_state()
        feed(model, dsp, st, ds, [10 + i % 500 for i in range(n)], all_logits=False)
        states.append(ds)
    plain = [dsp.draft_many(states[:1], [5]), dsp.draft_many(states, [5, 6])]
    dsp.region = region
    try:
        full, partial = dsp.draft_many(states[:1], [5]), dsp.draft_many(states, [5, 6])
    finally:
        dsp.region = None
    assert len(calls) == 1 and calls[0][1] == dsp.block_size and calls[0][0][0] == "draft"
    for got, want in zip((full, partial), plain, strict=True):
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prompt_chunks_of_several_sequences_in_one_forward(runner) -> None:
    """Chunks of several sequences in one forward (the server's speculating prefills), each draft
    absorbing its own rows (absorb_many), leave every draft state as feeding each alone does: long
    chunks, whose target layers bounded replay trims to their trailing rows, beside short ones, and
    sequences with history."""
    from engine.model.dspark import _rows_per_chunk

    dsp = runner.model.dspark
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(4, 8000, size=n)] for n in (40, 3, 25, 1)]
    alone = [_feed(runner, [p[:2], p[2:]] if len(p) > 2 else [p]) for p in prompts]
    sts, dss = [], []
    for p in prompts:  # the first two rows alone, then every sequence's rest in one forward
        st, ds, _ = _feed(runner, [p[:2]]) if len(p) > 2 else (runner.new_state(), dsp.new_state(), None)
        sts.append(st)
        dss.append(ds)
    rests = [p[2:] if len(p) > 2 else p for p in prompts]
    targets = dsp.targets
    logits = runner.forward(sts, rests, targets=targets)
    trimmed = any(targets[i].shape[0] < sum(map(len, rests)) for i in dsp.target_layer_ids)
    assert trimmed, "bounded replay trimmed no target layer: the case is not covered"
    dsp.absorb_many(dss, targets, [len(r) for r in rests])
    for (st, ds, lg), st2, ds2, lg2 in zip(alone, sts, dss, logits, strict=True):
        assert ds2.position == ds.position and st2.to_bytes() == st.to_bytes()
        for w, w2 in zip(ds.windows, ds2.windows, strict=True):
            np.testing.assert_array_equal(w2, w)
        np.testing.assert_array_equal(lg2, lg)
    assert _rows_per_chunk([40, 3, 25, 1], 69) == [40, 3, 25, 1]
    assert _rows_per_chunk([40, 3, 25, 1], 4 + 3 + 4 + 1) == [4, 3, 4, 1]
    with pytest.raises(ValueError):
        _rows_per_chunk([2, 2], 3)  # min(2, k) + min(2, k) is even


def test_tokens_only_drafts_the_same_tokens(runner) -> None:
    """A served greedy step's draft (tokens_only) proposes the tokens of the full greedy draft and
    carries none of the outputs it skips."""
    dsp = runner.model.dspark
    (_, a, la), (_, b, lb) = _feed(runner, [PROMPT]), _feed(runner, [PROMPT[:7]])
    last = [int(np.argmax(la)), int(np.argmax(lb))]
    full = dsp.draft_many([a, b], last)
    only = dsp.draft_many([a, b], last, tokens_only=True)
    for f, o in zip(full, only, strict=True):
        assert f.tokens.tolist() == o.tokens.tolist()
        assert o.logits is None and o.probs is None and o.confidence is None
