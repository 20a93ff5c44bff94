"""The speculation breakeven by batch (engine/runtime/spec_cost.py) and the scheduler's use of it
(server/speculate.py): which batch a verify step is judged by, that `measure` times steps of that
many sequences and leaves its scratch states behind untouched by any request, and that a sequence
whose acceptance pays alone stops speculating in a batch whose breakeven it does not reach."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.checkpoint.tiny_model import write_tiny_model
from engine.runtime import spec_cost
from engine.runtime.engine import Engine
from engine.runtime.sampling import SamplingParams
from server.speculate import Speculator
from tests.unit.test_speculative_decode import SIZES, _prompt


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return Engine.load(write_tiny_model(tmp_path_factory.mktemp("cost"), "v41", seed=4, draft=True, **SIZES))


def test_batch_bucket_is_the_largest_measured_batch_not_above() -> None:
    assert [spec_cost.batch_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 9, 64)] == [1, 1, 2, 2, 4, 4, 8, 8, 8]
    assert spec_cost.MEASURED_BATCHES[0] == 1


@pytest.mark.parametrize("batch", [1, 3])
def test_measure_times_steps_of_the_batch(engine, batch, monkeypatch) -> None:
    """Each timed forward carries `batch` sequences (1 row each for the step, block + 1 for the
    verify step) and each draft block `batch` sequences; a request decoded afterwards is unchanged."""
    model, dsp = engine.model, engine.model.draft
    prompt = _prompt(9)
    before = engine.generate(prompt, 12, SamplingParams(temperature=0.0), speculative=False)
    forwards, drafts = [], []
    fwd, drf = model.forward, dsp.draft_many

    def forward(states, chunks, **kw):
        forwards.append((len(states), sorted({len(c) for c in chunks}), bool(kw.get("verify"))))
        return fwd(states, chunks, **kw)

    def draft_many(states, last, **kw):
        drafts.append((len(states), len(last)))
        return drf(states, last, **kw)

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(dsp, "draft_many", draft_many)
    cost = spec_cost.measure(model, dsp, batch=batch, runs=2, warmup=1)
    monkeypatch.undo()
    assert cost.step > 0 and cost.verify > 0 and cost.draft > 0 and cost.breakeven > 0
    block = int(dsp.block_size) + 1
    assert forwards[0] == (1, [64], False)  # the one prefill, copied to the others
    timed = forwards[1:]
    assert timed.count((batch, [1], False)) == 3 and timed.count((batch, [block], True)) == 3
    assert len(timed) == 6 and drafts == [(batch, batch)] * 3
    assert engine.generate(prompt, 12, SamplingParams(temperature=0.0), speculative=False) == before
    with pytest.raises(ValueError, match="batch"):
        spec_cost.measure(model, dsp, batch=0)


def test_the_scheduler_judges_a_verify_step_by_its_batch(engine, monkeypatch) -> None:
    """Breakevens are measured once per bucket, at a bucket's first judgement (after the warm-up
    steps). A sequence at 3 tokens per verify step goes on alone (breakeven 2) and stops after its
    warm-up steps in a verify step of 9 sequences (bucket 8, breakeven 4). In one of 2 (breakeven
    7: beyond the block + 1 tokens a verify step can emit) it stops after its warm-up while the
    breakeven is unmeasured, and after its first step once it is measured."""
    import server.speculate as spec_mod

    asked = []
    costs = {1: spec_cost.SpecCost(1.0, 1.0, 1.0), 2: spec_cost.SpecCost(1.0, 5.0, 2.0),
             8: spec_cost.SpecCost(1.0, 3.0, 1.0)}

    def measure(model, dsp, batch=1, **_kw):
        asked.append(batch)
        return costs[batch]

    monkeypatch.setattr(spec_mod.spec_cost, "measure", measure)
    spec = Speculator(engine)
    assert spec.block_size + 1 == 6
    assert spec.breakeven(1) == 2.0 and spec.breakeven(9) == 4.0 and spec.breakeven(20) == 4.0
    assert asked == [1, 8]

    def stops(batch: int, steps: int) -> tuple[list[bool], SimpleNamespace]:
        s = SimpleNamespace(spec_steps=0, spec_tokens=0, speculate=True, draft=object())
        return [spec._judge(s, 3, batch) for _ in range(steps)], s

    warm = spec_cost.WARMUP_STEPS
    alone, s1 = stops(1, warm + 4)
    assert not any(alone) and s1.speculate
    nine, s9 = stops(9, warm)
    assert nine == [False] * (warm - 1) + [True] and not s9.speculate and s9.draft is None
    two, s2 = stops(2, warm)
    assert two == [False] * (warm - 1) + [True] and not s2.speculate
    assert asked == [1, 8, 2]
    again, s2 = stops(2, 1)
    assert again == [True] and not s2.speculate and asked == [1, 8, 2]
