"""Trial rows of a sequence state: feed a chunk, then keep only its first m rows (speculative
decoding's verify step, engine/runtime/spec_decode.py), with no copy of the state and no second
forward.

`begin(state)` marks the state: the position, the Engram look-back and each layer's bookkeeping
(its fields as references, its growth-buffer records, its window block's counters), O(layers),
no array copied. While `state.trial` is set, a prompt-chunk forward (the chunk path: every layer
replaces its arrays by new ones, never writing into the old) journals the rows it appends: each
layer's new K=V rows, its compressor's new kv / gate rows (V4: and the overlap slice of every
group it closes), the Engram look-back's chunk. `cut(state, trial, m)` then puts the mark back
and rebuilds what a chunk of the first m rows would have left, from the marked arrays and the
journaled rows: in a causal model the rows and the closed groups of the first m rows are exactly
what feeding those m rows computes. Compressed entries and indexer keys of the groups closed
within them are the first rows the trial appended. So after `cut` the state's bytes equal plain
decoding's at the same position (tests/unit/test_state_trial.py).

A one-row chunk of a V4.1 sequence takes the batched decode path, which journals nothing: it can
only be kept whole (m = 1) or dropped (m = 0, the mark put back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# what the layers journal, per layer index: "window": (new K=V rows, rows a window keeps);
# "comp": V4.1 KV source ((new kv rows, new gate rows) or None for ratio 1, ratio); V4 compressors:
# "pool" / "idx_pool": (new kv rows, new gate rows, ratio, overlap slices of each closed group or None)
_ENTRY_FIELD = {"pool": "entries", "idx_pool": "idx_keys"}


@dataclass
class Trial:
    """A state's mark (see the module's docstring) and what its trial chunk appended."""

    position: int
    recent: list
    layers: list  # per layer: (its __dict__'s items, its growth-buffer records)
    blocks: list  # (window block, start, end, attached) of every block a layer reads
    notes: list = field(default_factory=list)  # per layer: {kind: journaled rows}
    chunk: list | None = None  # the chunk's token ids (the Engram look-back), and how many it keeps
    keep_recent: int = 0

    def note(self, li: int, kind: str, value: tuple) -> None:
        self.notes[li][kind] = value


def begin(state) -> Trial:
    """Mark `state` and start journaling (state.trial); the next forward of it is the trial."""
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
    state.trial = Trial(state.position, state.recent_tokens, layers, blocks,
                        notes=[{} for _ in state.layers])
    return state.trial


def restore(state, trial: Trial) -> None:
    """Put the mark back: the state as it was at begin (the trial's rows dropped)."""
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
    """Keep the first m rows of the trial chunk (all of them: nothing to do but stop journaling)."""
    n = state.position - trial.position
    state.trial = None
    if not 0 <= m <= n:
        raise ValueError(f"cannot keep {m} of a trial of {n} rows")
    if m == n:
        return
    if m and n > 1 and not any(trial.notes):
        raise ValueError("the trial chunk was not journaled (it took the decode path)")
    grown = [{name: getattr(ls, name) for name in ("entries", "idx_keys")} for ls in state.layers]  # (the trial's)
    restore(state, trial)
    if m == 0:
        return
    state.position = trial.position + m
    if trial.chunk is not None:
        k = trial.keep_recent
        state.recent_tokens = (list(trial.recent) + [int(t) for t in trial.chunk[:m]])[-k:] if k else []
    for ls, notes, after in zip(state.layers, trial.notes, grown, strict=True):
        for kind, value in notes.items():
            _cut_layer(ls, kind, value, after, m, n)


def _rows(a, n: int, m: int):
    if a.shape[0] != n:
        raise ValueError(f"a trial journaled {a.shape[0]} rows of a chunk of {n}")
    return a[:m]


def _cut_layer(ls, kind: str, value: tuple, after: dict, m: int, n: int) -> None:
    """One journaled part of a layer, rebuilt for the first m rows as the chunk path builds it."""
    if kind == "window":
        rows, keep = value
        keys = np.concatenate([ls.window, _rows(rows, n, m)], axis=0)
        ls.window = keys[max(keys.shape[0] - keep, 0):] if keep > 0 else keys[:0]
        return
    if kind == "comp":  # V4.1 KV source (engine/model/v41.py Compressor.pool)
        new, ratio = value
        if new is None:  # ratio 1: every row closes its own group
            closed = m
        else:
            kv, gate = _pending(ls, "", new, n, m)
            usable = (kv.shape[0] // ratio) * ratio
            ls.buf_kv, ls.buf_gate = kv[usable:].copy(), gate[usable:].copy()
            closed = usable // ratio
        _keep_closed(ls, ("entries", "idx_keys"), after, closed)
        return
    prefix = "" if kind == "pool" else "idx_"  # V4's compressors (engine/model/v4.py V4Attention.pool)
    new_kv, new_gate, ratio, ovl = value
    kv, gate = _pending(ls, prefix, (new_kv, new_gate), n, m)
    usable = (kv.shape[0] // ratio) * ratio
    setattr(ls, prefix + "buf_kv", kv[usable:])
    setattr(ls, prefix + "buf_gate", gate[usable:])
    closed = usable // ratio
    if closed and ovl is not None:
        setattr(ls, prefix + "ovl_kv", ovl[0][closed - 1].copy())
        setattr(ls, prefix + "ovl_gate", ovl[1][closed - 1].copy())
    _keep_closed(ls, (_ENTRY_FIELD[kind],), after, closed)


def _pending(ls, prefix: str, new: tuple, n: int, m: int) -> tuple:
    """The compressor's unfinished group before the trial followed by the first m new rows."""
    kv, gate = _rows(new[0], n, m), _rows(new[1], n, m)
    bkv = getattr(ls, prefix + "buf_kv")
    if bkv is not None and bkv.shape[0]:
        kv = np.concatenate([bkv, kv])
        gate = np.concatenate([getattr(ls, prefix + "buf_gate"), gate])
    return kv, gate


def _keep_closed(ls, names: tuple, after: dict, closed: int) -> None:
    """The fields `names` keep their marked rows plus the first `closed` rows the trial appended."""
    if not closed:
        return
    for name in names:
        a = after[name]
        if a is None:
            continue
        before = getattr(ls, name)
        have = 0 if before is None else int(before.shape[0])
        setattr(ls, name, a[: have + closed])
