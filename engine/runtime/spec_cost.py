"""Whether speculation pays on this backend: its breakeven acceptance.

A speculative step emits `a` tokens (its acceptance: the drafts kept plus the main model's own) for
one draft block and one verify step; plain decoding emits one token per 1-token step. Speculation
pays where a > (draft + verify) / step, the breakeven. On a GPU the verify step reads the same
weights as a 1-token step, so its cost grows slowly with its rows; on the numpy backend every row
costs its own arithmetic, so the breakeven lies near the block size and a typical acceptance does
not reach it.

The breakeven depends on the batch: a step of b sequences amortizes its fixed costs (launches,
Python) over b rows, a verify step over b x (block + 1), so on the numpy backend speculation that
pays for one sequence loses for sixteen. `measure` times the three for `batch` sequences on
scratch states of the model (no request's state is touched), taking each one's fastest of a few
runs after a warm-up (kernels compiled, graphs captured); the scheduler measures each batch of
MEASURED_BATCHES once, when a sequence in a verify step of that many (batch_bucket) is first judged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.runtime.spec_decode import feed
from engine.state import trial as trials

WARMUP_STEPS = 8  # verify steps a sequence speculates before its acceptance is judged
# the batches measured: a larger verify step is judged by the breakeven of the largest (each
# measured sequence is a scratch state that takes state memory while it is measured)
MEASURED_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class SpecCost:
    """Seconds of a 1-token step, of a verify step of block + 1 rows a sequence and of a draft block,
    for one batch of sequences."""

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


def batch_bucket(n: int) -> int:
    """The measured batch whose breakeven judges a verify step of n sequences: the largest of
    MEASURED_BATCHES not above n."""
    return max(b for b in MEASURED_BATCHES if b <= max(1, n))


def measure(model, dsp, batch: int = 1, context: int = 64, runs: int = 3, warmup: int = 3) -> SpecCost:
    """SpecCost of `model` (a ModelRunner) with its draft `dsp` for `batch` sequences, each at
    `context` tokens of context (one prefill, then copies of its state)."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, not {batch}")
    vocab = int(model.cfg.vocab_size)
    ids = [3 + (7 * i) % max(1, vocab - 3) for i in range(context)]
    st, ds = model.new_state(), dsp.new_state()
    feed(model, dsp, st, ds, ids, all_logits=False)
    sts, dss = [st] + [st.clone() for _ in range(batch - 1)], [ds] + [ds.clone() for _ in range(batch - 1)]
    last = ids[-1]
    block = [last] * (int(dsp.block_size) + 1)

    def run(rows: list[int], **kw) -> None:
        marks = [trials.begin(s) for s in sts]
        model.forward(sts, [rows] * batch, **kw)
        for s, tr in zip(sts, marks, strict=True):
            trials.cut(s, tr, 0)

    def step() -> None:
        run([last])

    def verify() -> None:
        run(block, all_logits=True, verify=True, targets=dsp.targets)

    def draft() -> None:
        # (as a greedy served step drafts: its tokens alone; on a GPU the read waits for the block)
        model.ops.to_host(dsp.draft_many([d.clone() for d in dss], [last] * batch, tokens_only=True)[-1].tokens)

    for fn in (step, verify, draft):
        _fastest(fn, warmup)
    return SpecCost(_fastest(step, runs), _fastest(verify, runs), _fastest(draft, runs))


def pays(tokens: int, steps: int, breakeven: Callable[[], float], most: int, measured: bool) -> bool:
    """Whether a sequence that emitted `tokens` in `steps` verify steps, at most `most` a step (the
    block + 1), should go on speculating: yes until WARMUP_STEPS steps have shown its acceptance,
    then while it exceeds the breakeven; never where the breakeven is beyond `most`, which a
    breakeven already `measured` tells before the warm-up ends (an unmeasured one is measured
    only after it: measuring takes a few steps' time)."""
    if steps < WARMUP_STEPS and not measured:
        return True
    b = breakeven()
    return b < most and (steps < WARMUP_STEPS or tokens > b * steps)
