"""engine/ops/gpu/staging.py: a decode step's packed tables decode back to its plan. Packed
here from numpy states (host addresses), checked against addresses computed from the Spans that the
numpy backend's staging reads (decode_plan.with_spans)."""

from __future__ import annotations

import numpy as np

from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.tiny_model import write_tiny_model
from engine.model.config import load_config
from engine.ops.gpu import staging as cupy_staging
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner as Model
from engine.state.decode_plan import F32, HOST, I64, ROWS, SPANS, LayerPlan, with_spans

_FIELDS = [(name, kind) for name, kind in cupy_staging._LAYER_FIELDS]


def _addr(sp) -> int:
    return 0 if sp is None or sp.buf is None else int(sp.buf.ctypes.data) + sp.start * sp.buf.strides[0]


def _steps(tmp_path) -> list:
    """The StepInputs of decode steps of an 8-layer V4.1 model (groups with reading layers):
    three sequences, one too short for entries at first, stepped across a pooled group."""
    path = write_tiny_model(tmp_path / "m", arch="v41", seed=5, layers=8)
    cfg = load_config(path)
    m = Model(cfg, Checkpoint(path, block_size=cfg.weight_block_size), NumpyOps(), path / "tokenizer.json")
    seen: list = []
    real = m.ops.stage
    m.ops.stage = lambda inputs: (seen.append(inputs), real(inputs))[1]
    rng = np.random.default_rng(0)
    states = [m.new_state() for _ in range(3)]
    m.forward(states, [rng.integers(3, cfg.vocab_size, n) for n in (40, 1, 70)])
    for _ in range(5):
        m.forward(states, [[int(t)] for t in rng.integers(3, cfg.vocab_size, 3)])
    return [s for s in seen if s.layers is not None]


def test_packed_tables_decode_to_the_plan(tmp_path) -> None:
    steps = _steps(tmp_path)
    assert len(steps) == 6  # (the prompt step too: its one-token sequence decodes beside the chunks)
    for inputs in steps:
        i64, f32, layout = cupy_staging.pack(inputs)
        got, ref = layout.views(i64, f32), with_spans(inputs)
        np.testing.assert_array_equal(got.ids, inputs.ids)
        np.testing.assert_array_equal(got.rope, inputs.rope)
        np.testing.assert_array_equal(got.hash_ids, inputs.hash_ids)
        assert (got.dec_rows is None) == (inputs.dec_rows is None)
        if inputs.dec_rows is not None:
            np.testing.assert_array_equal(got.dec_rows, inputs.dec_rows)
        for lp, plan, spans in zip(got.layers, inputs.layers, ref.layers, strict=True):
            assert isinstance(lp, LayerPlan) and lp.static() == plan.static()
            for name, kind in _FIELDS:
                want, have = getattr(plan, name), getattr(lp, name)
                if want is None or kind == HOST:
                    assert have is None, name
                elif kind == ROWS:
                    np.testing.assert_array_equal(have, [_addr(sp) for sp in want], err_msg=name)
                elif kind == SPANS:
                    np.testing.assert_array_equal(have, [(_addr(sp), 0 if sp is None else sp.n) for sp in want],
                                                  err_msg=name)
                else:
                    assert kind in (F32, I64)
                    np.testing.assert_array_equal(have, want, err_msg=name)
            np.testing.assert_array_equal(lp.win_dst, [_addr(sp) for sp in spans.win_dst])
            want_att = [(_addr(w), w.n, 0, _addr(e), 0 if e is None else e.n, int(e is not None))
                        for w, e in spans.attend]
            np.testing.assert_array_equal(lp.attend, want_att)
    # the steps attend entries, pool groups and write keys: every kind of table was checked
    kinds = {(name, getattr(lp, name) is not None) for s in steps for lp in s.layers for name, _ in _FIELDS}
    assert {("pool_kv", True), ("key_dst", True), ("keys", True), ("entry_dst", True)} <= kinds
    assert any(e is not None for s in steps for lp in with_spans(s).layers for _, e in lp.attend)
