"""Sequence-state arrays that grow by rows in place (the decode step's appends).

A state array (a layer's window, pending compressor rows, compressed entries, indexer keys) is
a view of the live rows of a larger buffer that the LayerState holds in `spare` (LayerState.hold).
A decode step then appends each sequence's new row with one batched copy (`ops.copy_rows`) instead of a
concatenation per sequence and array, and the attention and indexer read the rows in place
(`Span`). Any other code may keep treating the field as a plain array: assigning it anything
else simply drops the buffer (the next append starts a new one).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MIN_ROWS = 64  # smallest buffer a growing array gets
GROWTH = 4  # a full buffer is replaced by one with len / GROWTH (>= MIN_ROWS) rows of headroom


class Span(NamedTuple):
    """Rows start .. start + n of a 2-D array (a buffer, or a batch's [B, N] mask: then the
    first n entries of row `start`)."""

    buf: object
    start: int
    n: int

    def view(self):
        return self.buf[self.start : self.start + self.n]

    def row(self):
        return self.buf[self.start, : self.n]


def reserve(xp, ls, name: str, width: int, n_new: int, jobs: list, room: int | None = None) -> tuple:
    """Room for n_new rows after the live rows of ls.<name> (one of state.GROWN_FIELDS). Returns
    (buffer, first live row, first free row); a new buffer (with `room` spare rows if given, else
    GROWTH's headroom) gets the live rows through a copy job added to `jobs` (ops.copy_rows tuples:
    src, src_row, dst, dst_row, rows)."""
    held = ls.spare.get(name)  # ([buffer, start, end, view]: engine/state/sequence.py LayerState.hold)
    if held is not None:
        src, s0, n = held[0], held[1], held[2] - held[1]
        if held[2] + n_new <= src.shape[0]:
            return src, s0, held[2]
    else:
        src, s0 = getattr(ls, name), 0
        n = 0 if src is None else int(src.shape[0])
    spare = max(MIN_ROWS, (n + n_new) // GROWTH) if room is None else room
    buf = xp.empty((n + n_new + spare, width), dtype=np.float32)
    if n:
        jobs.append((src if held is not None else xp.ascontiguousarray(src), s0, buf, 0, n))
    return buf, 0, n


def commit(ls, name: str, buf, start: int, end: int) -> None:
    """ls.<name> becomes rows start .. end of buf (its buffer kept for the next append; the
    field's view is made when it is read, engine/state/sequence.py LayerState.hold)."""
    ls.hold(name, buf, start, end)


def span(ls, name: str) -> Span:
    """ls.<name> as a Span (of its buffer, where it has one), for reading rows in place."""
    held = ls.spare.get(name)
    if held is not None:
        return Span(held[0], held[1], held[2] - held[1])
    arr = getattr(ls, name)
    return Span(None, 0, 0) if arr is None else Span(arr, 0, int(arr.shape[0]))


class WindowBlock:
    """Every layer's sliding window of one sequence in one buffer [layers, rows, width]: each
    layer's live rows are start .. end, the same for all, so a decode step appends every layer's
    new row at `end` with no per-layer work on the host (engine/state/decode_plan.py). LayerState.window
    reads its rows through the block; setting a layer's window to anything else detaches that
    layer, and a block serves a step only while every layer is attached."""

    __slots__ = ("buf", "start", "end", "attached")

    def __init__(self, buf, start: int, end: int, attached: int) -> None:
        self.buf, self.start, self.end, self.attached = buf, start, end, attached

    def rows(self, layer: int):
        return self.buf[layer, self.start : self.end]


def block_has_room(layers: list, n_new: int = 1) -> bool:
    """Whether a sequence's layers share one WindowBlock with room for n_new more rows
    (window_block then appends to it, touching no layer)."""
    blk = layers[0]._block
    return blk is not None and blk.attached == len(layers) and blk.end + n_new <= blk.buf.shape[1]


def window_block(xp, layers: list, width: int, keep: int, jobs: list, n_new: int = 1) -> WindowBlock:
    """The WindowBlock of a sequence's layer states with room for n_new more rows in every layer:
    theirs, or a new one (keep + n_new + MIN_ROWS rows, so one every MIN_ROWS + 1 steps) that gets
    every layer's live rows through copy jobs added to `jobs`. keep: the rows a window holds
    between steps (sliding_window - 1). All n_new rows go into one block: a step's later rows
    attend its earlier ones, which the copy jobs (run before the step) could not move."""
    blk = layers[0]._block
    if block_has_room(layers, n_new):
        return blk
    wins = [ls.window for ls in layers]
    n = int(wins[0].shape[0])
    if any(int(w.shape[0]) != n for w in wins):
        raise ValueError("a sequence's layers must hold windows of one length")
    new = WindowBlock(xp.empty((len(layers), keep + n_new + MIN_ROWS, width), dtype=np.float32), 0, n, len(layers))
    for li, (ls, w) in enumerate(zip(layers, wins, strict=True)):
        if n:
            jobs.append((xp.ascontiguousarray(w), 0, new.buf[li], 0, n))
        ls.attach(new, li)
    return new
