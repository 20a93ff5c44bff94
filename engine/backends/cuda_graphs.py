"""CUDA graphs for the fixed-shape regions of the forward (engine/model.py calls ops.graphed).

A region is a pure function of device arrays (a layer's projections, its output projection,
its FFN): the same kernels on the same shapes every decode step. The first call with a given
(region, input shapes) runs eagerly (it compiles kernels and fills caches); the second is
captured into a CUDA graph; later calls copy their inputs into the graph's input buffers and
launch it: one launch from Python instead of tens.

Contract: a region's outputs are its graph's buffers, rewritten by the next replay; anything
kept across steps (sequence state) must be a copy, never a view of them.

Memory: everything a capture allocates comes from one private pool, so eager work never lands
in memory a graph writes. Graph outputs stay owned by their graph (valid until that region runs
again, i.e. the next step) and are never freed, so no later capture reuses them; intermediates
freed inside a capture may be reused by the next capture, which is safe because regions replay
in the order they were captured in (one forward, one batch size, one stream). An input that is
another graph's output is read in place (no copy), so chained regions cost no copies.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import cupy as cp

log = logging.getLogger("dsuf.graphs")

MAX_GRAPH_ROWS = 64  # regions over more rows (prefill) run eagerly: their shapes rarely repeat
# Graphs (and their output buffers) are kept for at most this many distinct row counts (batch
# sizes), least recently used dropped first: every batch size 1..64 across 40 layers would
# otherwise hold gigabytes of region outputs.
MAX_ROW_BUCKETS = int(os.environ.get("DSUF_GRAPH_BUCKETS", "8"))


@dataclass
class _Captured:
    graph: object
    fn: object  # keeps the region's weights (and so the key's id()) alive as long as the graph
    slots: list  # per input: None (absent), ("copy", buffer) or ("direct", pointer)
    out: object


def _arrays(out) -> list:
    """The arrays a region returned (a tuple may hold None for parts a layer does not have)."""
    return [a for a in (out if isinstance(out, tuple) else (out,)) if a is not None]


class RegionGraphs:
    """Cache of captured regions, keyed by (region key, input shapes and dtypes)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = os.environ.get("DSUF_GRAPHS", "1") != "0" if enabled is None else enabled
        self._seen: set = set()
        self._graphs: dict = {}
        self._owned: set[int] = set()  # data pointers of graph outputs
        self._rows: dict = {}  # signature -> its row count
        self._buckets: OrderedDict[int, None] = OrderedDict()  # row counts with graphs, oldest first
        self.max_buckets = MAX_ROW_BUCKETS
        self.evictions = 0
        self._pool = cp.cuda.MemoryPool()
        self.replays = 0
        self.captures = 0
        self._inside = False

    def __call__(self, key, fn, *arrays, rows: int | None = None):
        """fn(*arrays), as a graph once the same key and input shapes come again. rows: the
        batch rows the region computes (default: the first input's leading dimension). A region
        called inside another (a decode step's layers) runs inline, part of the outer graph."""
        if self._inside:
            return fn(*arrays)
        self._inside = True
        try:
            return self._call(key, fn, arrays, rows)
        finally:
            self._inside = False

    def _call(self, key, fn, arrays: tuple, rows: int | None):
        if rows is None:
            rows = next((a.shape[0] for a in arrays if a is not None and a.ndim), MAX_GRAPH_ROWS + 1)
        if not self.enabled or rows > MAX_GRAPH_ROWS or any(a is not None and a.ndim == 0 for a in arrays):
            return fn(*arrays)
        sig = (key, tuple(None if a is None else (a.shape, a.dtype.str) for a in arrays))
        if sig in self._graphs:
            cap = self._graphs[sig]
            self._buckets.move_to_end(rows)
        elif sig not in self._seen:  # first time: warm up eagerly
            self._seen.add(sig)
            return fn(*arrays)
        else:
            self._make_room(rows)
            cap = self._capture(sig, fn, arrays)
            self._rows[sig] = rows
        if cap is None:  # capture failed once: this region stays eager
            return fn(*arrays)
        return self._replay(cap, fn, arrays)

    def captured(self, rows: int) -> list:
        """(key, CUDA graph) of every region captured at `rows` batch rows, oldest first (a
        benchmark times a decode step's graph on its own with them)."""
        return [(sig[0], c.graph) for sig, c in self._graphs.items() if c is not None and self._rows.get(sig) == rows]

    def _make_room(self, rows: int) -> None:
        """Before the first capture at a new row count: drop the least recently used bucket's
        graphs if there are too many. Safe: a forward runs one row count, and the dropped
        bucket's last replay finished with that forward (its logits were read back)."""
        if rows in self._buckets:
            self._buckets.move_to_end(rows)
            return
        while len(self._buckets) >= max(1, self.max_buckets):
            old, _ = self._buckets.popitem(last=False)
            for sig in [g for g, r in self._rows.items() if r == old]:
                cap = self._graphs.pop(sig, None)
                del self._rows[sig]
                if cap is not None:
                    for a in _arrays(cap.out):
                        self._owned.discard(a.data.ptr)
            self.evictions += 1
        self._buckets[rows] = None

    def _capture(self, sig, fn, arrays) -> _Captured | None:
        slots, inputs = [], []
        with cp.cuda.using_allocator(self._pool.malloc):
            for a in arrays:
                if a is None:
                    slots.append(None)
                    inputs.append(None)
                elif a.flags.c_contiguous and a.data.ptr in self._owned:
                    slots.append(("direct", a.data.ptr))
                    inputs.append(a)
                else:
                    buf = cp.ascontiguousarray(a).copy()
                    slots.append(("copy", buf))
                    inputs.append(buf)
            caller = cp.cuda.get_current_stream()
            stream = cp.cuda.Stream(non_blocking=True)
            stream.wait_event(caller.record())
            try:
                with stream:
                    stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
                    try:
                        out = fn(*inputs)
                    finally:
                        graph = stream.end_capture()
            except Exception as e:  # noqa: BLE001 - an op that cannot be captured: stay eager
                log.warning("region %s not captured (%s: %s); it runs eagerly", sig[0], type(e).__name__, e)
                self._graphs[sig] = None
                caller.wait_event(stream.record())
                return None
            caller.wait_event(stream.record())
        for a in _arrays(out):
            self._owned.add(a.data.ptr)
        cap = _Captured(graph, fn, slots, out)
        self._graphs[sig] = cap
        self.captures += 1
        return cap

    def _replay(self, cap: _Captured, fn, arrays):
        stream = cp.cuda.get_current_stream()
        for slot, a in zip(cap.slots, arrays, strict=True):
            if slot is None:
                continue
            kind, ref = slot
            if kind == "direct":
                if a.data.ptr != ref:  # the producer ran eagerly this time: so does this region
                    return fn(*arrays)
                continue
            if a.dtype != ref.dtype or not a.flags.c_contiguous:
                a = cp.ascontiguousarray(a, dtype=ref.dtype)
            cp.cuda.runtime.memcpyAsync(ref.data.ptr, a.data.ptr, ref.nbytes,
                                        cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        cap.graph.launch(stream)
        self.replays += 1
        return cap.out
