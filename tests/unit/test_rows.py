"""Growth buffers behind sequence-state arrays (engine/state/rows.py), on the numpy backend."""

from __future__ import annotations

import numpy as np

from engine.ops.numpy_ops import NumpyOps
from engine.state import rows
from engine.state.sequence import LayerState


def _append(ls: LayerState, name: str, row: np.ndarray, room=None) -> None:
    jobs: list = []
    buf, start, end = rows.reserve(np, ls, name, row.shape[1], 1, jobs, room=room)
    jobs.append((row, 0, buf, end, 1))
    NumpyOps().copy_rows(jobs)
    rows.commit(ls, name, buf, start, end + 1)


def test_appends_grow_in_place_and_keep_every_row() -> None:
    rng = np.random.default_rng(0)
    ls = LayerState(window=np.zeros((0, 4), np.float32))
    ls.entries = rng.standard_normal((3, 4)).astype(np.float32)  # a plain array from the chunk path
    want = [r for r in ls.entries]
    bufs = set()
    for _ in range(300):
        r = rng.standard_normal((1, 4)).astype(np.float32)
        _append(ls, "entries", r)
        want.append(r[0])
        bufs.add(id(ls.spare["entries"][0]))
    np.testing.assert_array_equal(ls.entries, np.stack(want))
    assert len(bufs) < 10  # grown a few times, not once per row
    sp = rows.span(ls, "entries")
    assert sp.buf is ls.spare["entries"][0] and sp.n == 303
    np.testing.assert_array_equal(sp.view(), ls.entries)


def test_reassigned_field_drops_its_buffer() -> None:
    ls = LayerState(window=np.zeros((0, 2), np.float32))
    _append(ls, "entries", np.ones((1, 2), np.float32))
    old = ls.spare["entries"][0]
    ls.entries = np.full((2, 2), 5.0, np.float32)  # e.g. the chunk path's concatenation
    assert "entries" not in ls.spare and rows.span(ls, "entries").buf is ls.entries
    _append(ls, "entries", np.zeros((1, 2), np.float32))
    assert ls.spare["entries"][0] is not old
    np.testing.assert_array_equal(ls.entries, [[5, 5], [5, 5], [0, 0]])
    assert ls.n_entries == 3


def test_grown_field_reads_as_one_view_until_it_changes() -> None:
    """A grown field's view is made when read and kept until the next append (engine/state/sequence.py)."""
    ls = LayerState(window=np.zeros((0, 2), np.float32))
    _append(ls, "idx_keys", np.ones((1, 2), np.float32))
    a = ls.idx_keys
    assert ls.idx_keys is a and a.base is ls.spare["idx_keys"][0]
    _append(ls, "idx_keys", np.full((1, 2), 2.0, np.float32))
    assert ls.idx_keys is not a
    np.testing.assert_array_equal(ls.idx_keys, [[1, 1], [2, 2]])


def test_room_bounds_a_pending_buffer() -> None:
    ls = LayerState(window=np.zeros((0, 2), np.float32))
    _append(ls, "buf_kv", np.ones((1, 2), np.float32), room=2)
    assert ls.spare["buf_kv"][0].shape[0] == 3


def test_replaced_state_keeps_its_own_rows() -> None:
    """dataclasses.replace copies a grown field as its current rows, not its growth buffer."""
    import dataclasses

    ls = LayerState(window=np.zeros((0, 2), np.float32))
    _append(ls, "entries", np.ones((1, 2), np.float32))
    copy = dataclasses.replace(ls)
    _append(ls, "entries", np.full((1, 2), 3.0, np.float32))
    np.testing.assert_array_equal(copy.entries, [[1, 1]])
    assert copy.n_entries == 1 and ls.n_entries == 2 and not copy.spare
