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


def _norm(value, ids: dict):
    """Spans, growth jobs, marks and records with each buffer replaced by its order of first sight
    (two sets of states hold different buffers that must line up one to one)."""
    from engine.state.sequence import HeldRows

    if isinstance(value, tuple) and value and isinstance(value[0], HeldRows):  # (a mark as counters)
        value = value[0].records(*value[1:])
    if isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim >= 2:
        return ("buf", ids.setdefault(id(value), len(ids)), value.shape)
    if isinstance(value, dict):
        return tuple((k, _norm(v, ids)) for k, v in value.items() if k != "spare" and not str(k).startswith("__"))
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v, ids) for v in value)
    if isinstance(value, np.ndarray):
        return ("arr", value.tolist())
    if value is None or isinstance(value, (bool, int, float, str, np.integer, np.floating)):
        return value
    return ("obj", ids.setdefault(id(value), len(ids)), type(value).__name__)  # (a window block)


def test_held_rows_plan_as_the_row_by_row_path(monkeypatch) -> None:
    """The KV sources' rows of a sequence whose growth buffers have room (decode_plan._source_rows_held)
    against the same states planned row by row: equal Spans, pooled groups, RoPE positions, growth
    copies, per-row trial marks and bookkeeping after, over 60 steps of 1-6 rows per sequence
    (verify steps, some cut back to a random row as a rejected draft is) on V4.1-Flash's schedule."""
    from engine.checkpoint.tiny_model import flash_config
    from engine.model.config import parse_config
    from engine.state import decode_plan
    from engine.state.sequence import LayerState, SequenceState, restore_marks

    cfg = parse_config(flash_config())
    real = decode_plan._source_rows_held

    def rope(pos):
        return np.asarray(pos, np.float32)[:, None].repeat(2, 1), -np.asarray(pos, np.float32)[:, None].repeat(2, 1)

    def new_states():
        return [SequenceState(position=0, layers=[LayerState(window=np.zeros((0, cfg.head_dim), np.float32))
                                                  for _ in range(cfg.num_layers)]) for _ in range(4)]

    sets = {"held": new_states(), "rows": new_states()}
    rng = np.random.default_rng(0)
    used = 0
    for step in range(60):
        counts = [int(c) for c in rng.integers(1, 7, 4)] if step % 3 else [1] * 4
        keep = [int(rng.integers(1, c + 1)) for c in counts]
        got = {}
        for name, states in sets.items():
            monkeypatch.setattr(decode_plan, "_source_rows_held",
                                real if name == "held" else (lambda *a: False))
            growth, marks = [], []
            win, layers = plan_decode(cfg, states, np, growth, rope, True, counts, marks)
            plans = [{f: getattr(lp, f) for f in ("pend_kv", "pend_gate", "pool_kv", "pool_gate", "entry_dst",
                                                  "key_dst", "entries", "keys", "pub_ns")}
                     | {"pool_rope": None if lp.pool_rope is None else lp.pool_rope.tolist()} for lp in layers]
            for s, m, c, k in zip(states, marks, counts, keep, strict=True):
                if k < c:
                    restore_marks(m[k - 1])
                s.position += k
            after = [[(ls.__dict__.get("_own_entries"), dict(ls.spare)) for ls in s.layers] for s in states]
            got[name] = _norm([win.start, win.dst, plans, growth, marks, after], {})  # (ids live one step)
        assert got["held"] == got["rows"], step
        used += sum(c for c in counts)
    monkeypatch.setattr(decode_plan, "_source_rows_held", real)
    assert used > 200
