"""Whether speculation pays on this backend: its breakeven acceptance.

A speculative step emits `a` tokens (its acceptance: the drafts kept plus the main model's own) for
one draft block and one verify step; plain decoding emits one token per 1-token step. Speculation
pays where a > (draft + verify) / step, the breakeven. On a GPU the verify step reads the same
weights as a 1-token step, so the breakeven lies near 1; on the numpy backend every row costs its
own arithmetic, so it lies near the block size and a typical acceptance does not reach it.

`breakeven` times the three on a scratch state of the model (no request's state is touched),
taking each one's fastest of a few runs after a warm-up (kernels compiled, graphs captured).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.runtime.spec_decode import feed
from engine.state import trial as trials

WARMUP_STEPS = 8  # verify steps a sequence speculates before its acceptance is judged


@dataclass(frozen=True)
class SpecCost:
    """Seconds of a 1-token step, of a verify step of block + 1 rows and of a draft block (batch 1)."""

    step: float
    verify: float
    draft: float

    @property
    def breakeven(self) -> float:
        """The acceptance (tokens per verify step) above which speculating beats plain decoding."""
        return (self.verify + self.draft) / self.step


def _fastest(fn: Callable[[], object], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(model, dsp, context: int = 64, runs: int = 3, warmup: int = 3) -> SpecCost:
    """SpecCost of `model` (a ModelRunner) with its draft `dsp`, at `context` tokens of context."""
    vocab = int(model.cfg.vocab_size)
    ids = [3 + (7 * i) % max(1, vocab - 3) for i in range(context)]
    st, ds = model.new_state(), dsp.new_state()
    feed(model, dsp, st, ds, ids, all_logits=False)
    last = ids[-1]
    block = [last] * (int(dsp.block_size) + 1)

    def step() -> None:
        tr = trials.begin(st)
        model.forward([st], [[last]])
        trials.cut(st, tr, 0)

    def verify() -> None:
        tr = trials.begin(st)
        model.forward([st], [block], all_logits=True, verify=True, targets=dsp.targets)
        trials.cut(st, tr, 0)

    def draft() -> None:
        # (as a greedy served step drafts: its tokens alone; on a GPU the read waits for the block)
        model.ops.to_host(dsp.draft_many([ds.clone()], [last], tokens_only=True)[0].tokens)

    for fn in (step, verify, draft):
        _fastest(fn, warmup)
    return SpecCost(_fastest(step, runs), _fastest(verify, runs), _fastest(draft, runs))


def pays(tokens: int, steps: int, breakeven: Callable[[], float]) -> bool:
    """Whether a sequence that emitted `tokens` in `steps` verify steps should go on speculating:
    yes until WARMUP_STEPS steps have shown its acceptance, then while it exceeds the breakeven
    (called only then: measuring it takes a few steps' time)."""
    return steps < WARMUP_STEPS or tokens > breakeven() * steps
