"""Trial rows of a sequence state: speculative decoding's verify step feeds [last token, drafts]
and then keeps only the first m rows (engine/runtime/spec_decode.py), with no copy of the state
and no second forward.

`begin(state)` marks the state: the position, the Engram look-back and each layer's bookkeeping
(its fields as references, its growth-buffer records, its window block's counters), O(layers),
no array copied. The verify step (ModelRunner.forward(verify=True)) runs the chunk as decode rows,
planned row by row (engine/state/decode_plan.py plan_decode with counts): every row is appended
past the live rows of buffers that had room for all of them before the step, and the plan leaves
in `trial.rows` the bookkeeping after each row. `cut(state, trial, m)` puts back the bookkeeping
after row m - 1: the later rows stay in the buffers past the live rows, where the next step
writes over them. Row j was planned and computed as the j-th of as many one-row decode steps, so
the kept rows are exactly what plain decoding writes and the state's bytes equal plain
decoding's at the same position (tests/unit/test_state_trial.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.state.sequence import restore_marks


@dataclass
class Trial:
    """A state's mark (see the module's docstring) and what its verify step left."""

    position: int
    recent: list
    layers: list  # per layer: (its __dict__'s items, its growth-buffer records)
    blocks: list  # (window block, start, end, attached) of every block a layer reads
    rows: list | None = None  # the bookkeeping after each row (state.plan_marks' form), from the plan
    chunk: list | None = None  # the chunk's token ids (the Engram look-back), and how many it keeps
    keep_recent: int = 0
    replicas: list = field(default_factory=list)  # the trials of the state's tensor-parallel replicas


def begin(state) -> Trial:
    """Mark `state` (state.trial) and each of its tensor-parallel replicas; its next forward, a
    verify step, is the trial."""
    if state.trial is not None:
        raise ValueError("the state already has a trial in progress")
    layers, blocks, seen = [], [], set()
    for ls in state.layers:
        d = ls.__dict__
        layers.append((dict(d), dict(d.get("spare", {}))))
        blk = d.get("_block")
        if blk is not None and id(blk) not in seen:
            seen.add(id(blk))
            blocks.append((blk, blk.start, blk.end, blk.attached))
    state.trial = Trial(state.position, state.recent_tokens, layers, blocks)
    state.trial.replicas = [begin(r) for r in state.replicas]
    return state.trial


def restore(state, trial: Trial) -> None:
    """Put the mark back: the state as it was at begin (the trial's rows dropped)."""
    for r, t in zip(state.replicas, trial.replicas, strict=False):
        restore(r, t)
    state.trial = None
    state.position, state.recent_tokens = trial.position, trial.recent
    for ls, (items, spare) in zip(state.layers, trial.layers, strict=True):
        d = ls.__dict__
        held = d.get("spare")
        d.clear()
        d.update(items)
        if held is not None:  # (the same dict object, its records as they were)
            held.clear()
            held.update(spare)
    for blk, start, end, attached in trial.blocks:
        blk.start, blk.end, blk.attached = start, end, attached


def cut(state, trial: Trial, m: int) -> None:
    """Keep the first m rows of the trial (all of them: nothing to do but end the trial)."""
    for r, t in zip(state.replicas, trial.replicas, strict=True):
        cut(r, t, m)
    n = state.position - trial.position
    state.trial = None
    if not 0 <= m <= n:
        raise ValueError(f"cannot keep {m} of a trial of {n} rows")
    if m == n:
        return
    if m == 0:
        restore(state, trial)
        return
    if trial.rows is None or len(trial.rows) != n:
        raise ValueError("the trial's rows were not planned as decode rows (ModelRunner.forward(verify=True))")
    restore_marks(trial.rows[m - 1])
    state.position = trial.position + m
    if trial.chunk is not None:
        k = trial.keep_recent
        state.recent_tokens = (list(trial.recent) + [int(t) for t in trial.chunk[:m]])[-k:] if k else []
