"""The warm-up before a server reports ready: what it runs, that it leaves no trace, that serve runs it."""

from __future__ import annotations

import types

from engine.runtime.engine import Engine, warm_up
from engine.runtime.sampling import SamplingParams


def test_warm_up_runs_two_chunks_and_a_decode_step(engine, monkeypatch):
    rows, draws = [], []
    fwd, sample = engine.model.forward, engine.model.step_sample
    monkeypatch.setattr(engine.model, "forward",
                        lambda st, ch, **kw: rows.append([len(c) for c in ch]) or fwd(st, ch, **kw))
    monkeypatch.setattr(engine.model, "step_sample",
                        lambda st, ch, jobs: draws.append([len(c) for c in ch]) or sample(st, ch, jobs))
    seconds = warm_up(engine.model, engine.config.vocab_size, 24, engine.context_length)
    assert seconds > 0
    assert rows == [[24], [24], [1]] and draws == [[1]]  # (the decode step's forward among them)
    rows.clear()
    warm_up(engine.model, engine.config.vocab_size, 4096, 40)  # a short context bounds the chunks
    assert rows == [[19], [19], [1]]


def test_warm_up_leaves_no_trace(engine):
    prompt = engine.tokenizer.encode("The warm-up runs on a scratch sequence")
    greedy = SamplingParams(temperature=0.0)
    before = engine.generate(prompt, 12, greedy, speculative=False)
    warm_up(engine.model, engine.config.vocab_size, 32, engine.context_length)
    assert engine.generate(prompt, 12, greedy, speculative=False) == before


def test_numpy_engine_has_nothing_to_warm(engine):
    assert engine.device is None and engine.warm_up() == 0.0


def test_serve_warms_the_engine_before_it_is_ready(engine, monkeypatch):
    from server import lifecycle

    calls = []
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: engine))
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append(self) or 1.5)
    opts = types.SimpleNamespace(load_delay_s=0.0, numerics="deepseek", gpus=None, ckpt=None, backend="numpy")
    assert lifecycle._load_engine(opts) is engine
    assert calls == [engine]
