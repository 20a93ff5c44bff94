"""DSpark absorbs every sequence's rows at once (DSpark._absorb_rows: one gather per target layer,
one main_x, one rope table, one window_rows per draft layer, the windows grown by one batch of row
copies): on random draft states and target inputs, under both numpy numerics, the windows equal bit
for bit those of per-sequence absorb and of the per-sequence path as it was (_absorb_alone: each
sequence's main_x, rope and window_rows alone, then a concatenation and a trim); the checks come
before any state changes; and the backend calls of one absorb do not grow with the batch."""

from __future__ import annotations

import numpy as np
import pytest

from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.tiny_model import write_tiny_model
from engine.model.config import load_config
from engine.ops.deepseek_ops import DeepseekOps
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner
from engine.state.draft import DraftState


@pytest.fixture(scope="module", params=["exact", "deepseek"])
def dsp(request, tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp(f"absorb-{request.param}"), "v41", seed=5, draft=True, window=8)
    cfg = load_config(d)
    ops = DeepseekOps() if request.param == "deepseek" else NumpyOps()
    dsp = ModelRunner(cfg, Checkpoint(d, block_size=cfg.weight_block_size), ops, d / "tokenizer.json").model.dspark
    assert len(dsp.layers) > 1 and len(dsp.target_layer_ids) > 1 and dsp.cfg.sliding_window == 8
    return dsp


def _absorb_alone(dsp, state: DraftState, targets: dict, n: int) -> None:
    """One sequence's absorb as it ran before the batched path (the reference here)."""
    ops, win, ids = dsp.ops, dsp.cfg.sliding_window, dsp.target_layer_ids
    m = min(targets[i].shape[0] for i in ids)
    assert min(n, win) <= m <= n
    x = ops.cat([targets[i][-m:] if m else targets[i] for i in ids], axis=1)
    main_x = ops.rmsnorm(ops.linear(x, dsp.main_proj), dsp.main_norm, dsp.cfg.rms_norm_eps)
    cos, sin = dsp.rope_host(np.arange(state.position + n - m, state.position + n))
    for i, layer in enumerate(dsp.layers):
        rows = ops.cat([state.windows[i], layer.attn.window_rows(main_x, ops.asarray(cos), ops.asarray(sin))])
        state.windows[i] = rows[max(rows.shape[0] - win, 0):]
    state.position += n


def _states(dsp, rng, fills: list[int]) -> list[DraftState]:
    """Draft states with windows of `fills` random rows (0: empty, the window: full) and positions at
    or past them."""
    d = dsp.cfg.head_dim
    return [DraftState(f + int(rng.integers(0, 40)),
                       [rng.standard_normal((f, d)).astype(np.float32) for _ in dsp.layers]) for f in fills]


def _targets(dsp, rng, rows: dict) -> dict:
    return {i: rng.standard_normal((rows[i], dsp.cfg.hidden_size)).astype(np.float32) for i in dsp.target_layer_ids}


def _same(got: list[DraftState], want: list[DraftState]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.position == w.position
        assert len(g.windows) == len(w.windows)
        for a, b in zip(g.windows, w.windows, strict=True):
            np.testing.assert_array_equal(a, b)


def test_absorb_kept_equals_absorbing_each_sequence_alone(dsp) -> None:
    """Verify steps of 7 sequences (chunks of 1 .. block + 1 rows, each keeping 1 .. all of them),
    windows empty, part-full and full to start with, several steps in a row (windows wrapping):
    absorb_kept == per-sequence absorb == the per-sequence path as it was, bit for bit."""
    rng = np.random.default_rng(0)
    win, block = dsp.cfg.sliding_window, dsp.block_size
    batched = _states(dsp, rng, [0, 1, win - 1, win, 3, win, 0])
    alone, before = [s.clone() for s in batched], [s.clone() for s in batched]
    for step in range(6):
        lengths = [int(x) for x in rng.integers(1, block + 2, len(batched))]
        keeps = [int(rng.integers(1, n + 1)) for n in lengths]
        if step == 0:
            keeps = list(lengths)  # every draft kept: each target layer's rows are used whole
        targets = _targets(dsp, rng, dict.fromkeys(dsp.target_layer_ids, sum(lengths)))
        dsp.absorb_kept(batched, targets, lengths, keeps)
        starts = np.cumsum([0, *lengths])
        for b, k in enumerate(keeps):
            mine = {i: targets[i][starts[b] : starts[b] + k] for i in targets}
            dsp.absorb(alone[b], mine, k)
            _absorb_alone(dsp, before[b], mine, k)
        _same(batched, alone)
        _same(batched, before)
    assert all(w.shape[0] == win for s in batched for w in s.windows)


def test_absorb_many_with_bounded_replay_equals_absorbing_each_sequence_alone(dsp) -> None:
    """Prompt chunks side by side, some longer than the window, one target layer with every row and
    the others with only each chunk's trailing min(n, k) (bounded replay, k >= the window): each
    sequence absorbs the rows every target layer has, as alone."""
    rng = np.random.default_rng(1)
    win = dsp.cfg.sliding_window
    ns = [20, 3, 13, 1, 9, 0]
    bounds = dict(zip(dsp.target_layer_ids, [None, win, win + 2], strict=False))  # (None: every row)
    counts = {i: [min(n, k) if k else n for n in ns] for i, k in bounds.items()}
    batched = _states(dsp, rng, [0, win, 5, win, 2, 3])
    alone, before = [s.clone() for s in batched], [s.clone() for s in batched]
    targets = _targets(dsp, rng, {i: sum(c) for i, c in counts.items()})
    dsp.absorb_many(batched, targets, ns)
    for b, n in enumerate(ns):
        mine = {i: targets[i][sum(c[:b]) : sum(c[:b]) + c[b]] for i, c in counts.items()}
        dsp.absorb(alone[b], mine, n)
        _absorb_alone(dsp, before[b], mine, n)
    _same(batched, alone)
    _same(batched, before)


def test_too_few_target_rows_raise_before_any_state_changes(dsp) -> None:
    rng = np.random.default_rng(2)
    win = dsp.cfg.sliding_window
    states = _states(dsp, rng, [win, 2])
    kept = [s.clone() for s in states]
    ns = [1, 2 * win]
    rows = dict.fromkeys(dsp.target_layer_ids, 1 + win - 1)  # the second chunk: fewer than a window
    with pytest.raises(ValueError, match="target rows"):
        dsp.absorb_many(states, _targets(dsp, rng, rows), ns)
    _same(states, kept)


def _count_calls(ops, monkeypatch) -> dict:
    """Count the ops calls the model makes (an op's own calls of other ops not counted)."""
    calls: dict = {}
    depth = [0]

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if not depth[0]:
                calls[name] = calls.get(name, 0) + 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for name in dir(type(ops)):
        if not name.startswith("_") and callable(getattr(type(ops), name)):
            monkeypatch.setattr(ops, name, wrap(name, getattr(ops, name)))
    return calls


def test_absorb_calls_do_not_grow_with_the_batch(dsp, monkeypatch) -> None:
    """absorb_kept's backend calls: the same for 4 and 16 sequences (one row copy batch, one
    main_proj and one K=V projection per draft layer for all of them; one upload of the kept rows'
    indices), and for one no more (its kept rows are a slice)."""
    rng = np.random.default_rng(3)
    calls = _count_calls(dsp.ops, monkeypatch)
    seen = []
    for bsz in (1, 4, 16):
        states = _states(dsp, rng, [dsp.cfg.sliding_window] * bsz)
        lengths = [dsp.block_size + 1] * bsz
        keeps = [int(rng.integers(1, dsp.block_size + 1)) for _ in range(bsz)]
        targets = _targets(dsp, rng, dict.fromkeys(dsp.target_layer_ids, sum(lengths)))
        calls.clear()
        dsp.absorb_kept(states, targets, lengths, keeps)
        seen.append(dict(calls))
    assert seen[1] == seen[2], seen
    assert all(seen[0].get(k, 0) <= n for k, n in seen[1].items()), seen
    assert seen[0]["copy_rows"] == 1 and seen[0]["linear"] == 1 + len(dsp.layers)


def test_only_the_rows_a_window_keeps_are_projected(dsp, monkeypatch) -> None:
    """A prompt chunk longer than the window: main_x and the K=V projections take the last window
    rows of each sequence only (a window keeps no more), and the windows equal the path that
    projects every row."""
    rng = np.random.default_rng(4)
    win = dsp.cfg.sliding_window
    ns = [3 * win + 5, 2, win + 1]
    batched = _states(dsp, rng, [0, win, 3])
    before = [s.clone() for s in batched]
    targets = _targets(dsp, rng, dict.fromkeys(dsp.target_layer_ids, sum(ns)))
    seen = []
    main_x = dsp.main_x
    monkeypatch.setattr(dsp, "main_x", lambda inputs: seen.append(inputs[0].shape[0]) or main_x(inputs))
    dsp.absorb_many(batched, targets, ns)
    assert seen == [win + 2 + win]
    starts = np.cumsum([0, *ns])
    for b, n in enumerate(ns):
        _absorb_alone(dsp, before[b], {i: targets[i][starts[b] : starts[b] + n] for i in targets}, n)
    _same(batched, before)
