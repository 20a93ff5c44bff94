"""CUDA graphs for fixed-shape regions: a whole decode step (CupyOps.graphed_step), the tensor-parallel
driver's per-rank steps (engine/parallel/gpu.py drives begin_capture / end_capture itself), and the
benchmark's kernel timings.

A region is a pure function of device arrays: the same kernels on the same shapes every decode
step. The first call with a given (region, input shapes) runs eagerly (it compiles kernels and
fills caches); the second is captured into a CUDA graph; later calls copy their inputs into the
graph's input buffers and launch it: one launch from Python instead of hundreds.

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

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import cupy as cp

from engine.ops.gpu.common import copy_table
from engine.ops.gpu.limits import MAX_GRAPH_ROWS

log = logging.getLogger("dsuf.graphs")

# a replay copies its inputs with one copy_rows launch where it has more than this many (a draft
# step's windows: one per sequence and layer), else one cudaMemcpyAsync each
BATCHED_COPIES = 2


@dataclass
class _Captured:
    graph: object
    fn: object  # keeps the region's weights (and so the key's id()) alive as long as the graph
    slots: list  # per input: None (absent), ("copy", buffer) or ("direct", pointer)
    out: object


@dataclass
class _Capturing:
    """A capture under way (RegionGraphs.begin_capture)."""

    sig: tuple
    stream: object
    caller: object  # the stream it was forked from, joined back at the end
    slots: list
    inputs: tuple  # what the captured work reads: the inputs' graph-owned copies
    keep: object = None


def _arrays(out) -> list:
    """The arrays a region returned (a tuple may hold None for parts a layer does not have)."""
    return [a for a in (out if isinstance(out, tuple) else (out,)) if a is not None]


class RegionGraphs:
    """Cache of captured regions, keyed by (region key, input shapes and dtypes)."""

    def __init__(self, enabled: bool = True, buckets: int = 8, upload=None) -> None:
        """enabled: capture and replay (else every call runs eagerly); buckets: graphs (and their
        output buffers) are kept for at most this many distinct row counts (batch sizes), least
        recently used dropped first (Settings.graph_buckets); upload(numpy array) -> device array:
        how a replay's table of input copies goes up (default cupy.asarray)."""
        self.enabled = enabled
        self._upload = upload or cp.asarray
        self._seen: set = set()
        self._graphs: dict = {}
        self._owned: set[int] = set()  # data pointers of graph outputs
        self._rows: dict = {}  # signature -> its row count
        self._buckets: OrderedDict[int, None] = OrderedDict()  # row counts with graphs, oldest first
        self.max_buckets = buckets
        self.evictions = 0
        self._pool = cp.cuda.MemoryPool()
        self.replays = 0
        self.captures = 0
        self._inside = False

    def __call__(self, key, fn, *arrays, rows: int | None = None):
        """fn(*arrays), as a graph once the same key and input shapes come again. rows: the
        batch rows the region computes (default: the first input's leading dimension). A region
        called inside another runs inline, part of the outer graph."""
        if self._inside:
            return fn(*arrays)
        with self.inline():
            return self._call(key, fn, arrays, rows)

    @contextlib.contextmanager
    def inline(self):
        """Regions called inside this run inline (part of an enclosing graph or step)."""
        outer, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = outer

    def _call(self, key, fn, arrays: tuple, rows: int | None):
        if rows is None:
            rows = next((a.shape[0] for a in arrays if a is not None and a.ndim), MAX_GRAPH_ROWS + 1)
        sig = self.signature(key, arrays)
        mode = self.mode(sig, rows, arrays)
        if mode == "replay":
            return self.replay(sig, fn, arrays)
        if mode == "eager":
            return fn(*arrays)
        cap = self.begin_capture(sig, arrays, rows, keep=fn)
        out, err = None, None
        try:
            with self.capturing(cap):
                out = fn(*cap.inputs)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: stay eager
            err = e
        if not self.end_capture(cap, out, err):
            return fn(*arrays)
        return self.replay(sig, fn, arrays)

    # ---- the steps of a capture, also driven from outside (engine/parallel/gpu.py captures every
    # rank's decode step at once, the all-reduces inside) --------------------------------------
    @staticmethod
    def signature(key, arrays: tuple) -> tuple:
        return (key, tuple(None if a is None else (a.shape, a.dtype.str) for a in arrays))

    def mode(self, sig, rows: int, arrays: tuple = ()) -> str:
        """What a call of region `sig` does now: "eager" (graphs off, too many rows, first sight,
        or a region that failed to capture), "capture" (second sight), or "replay"."""
        if not self.enabled or rows > MAX_GRAPH_ROWS or any(a is not None and a.ndim == 0 for a in arrays):
            return "eager"
        if sig in self._graphs:
            if self._graphs[sig] is None:  # capture failed once: this region stays eager
                return "eager"
            self._buckets.move_to_end(self._rows[sig])
            return "replay"
        if sig not in self._seen:  # first time: warm up eagerly
            self._seen.add(sig)
            return "eager"
        return "capture"

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

    def begin_capture(self, sig, arrays: tuple, rows: int, keep=None) -> _Capturing:
        """Start capturing region `sig`: its inputs copied into buffers of the graphs' pool (or,
        for another graph's output, read in place), a capture begun on a fresh stream forked
        from the current one. Work for it runs inside `capturing(cap)`, then end_capture. keep:
        what the graph keeps alive (the region's function, holding the weights its key names)."""
        self._make_room(rows)
        self._rows[sig] = rows
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
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        return _Capturing(sig, stream, caller, slots, tuple(inputs), keep)

    @contextlib.contextmanager
    def capturing(self, cap: _Capturing):
        """Work enqueued inside this goes into cap's graph: its stream current, allocations from
        the graphs' pool (so eager work never lands in memory a graph writes)."""
        with cp.cuda.using_allocator(self._pool.malloc), cap.stream:
            yield

    def end_capture(self, cap: _Capturing, out, error: Exception | None = None) -> bool:
        """End cap's capture; keep its graph with `out` (the region's outputs, its graph's
        buffers from now on). On an error (raised while capturing, or by the capture itself) the
        region is marked to stay eager; returns whether a graph was kept."""
        try:
            graph = cap.stream.end_capture()
        except Exception as e:  # noqa: BLE001 - e.g. an op that invalidated the capture
            error = error or e
        cap.caller.wait_event(cap.stream.record())
        if error is not None:
            log.warning("region %s not captured (%s: %s); it runs eagerly", cap.sig[0], type(error).__name__, error)
            self._graphs[cap.sig] = None
            return False
        for a in _arrays(out):
            self._owned.add(a.data.ptr)
        self._graphs[cap.sig] = _Captured(graph, cap.keep, cap.slots, out)
        self.captures += 1
        return True

    def release(self) -> None:
        """Drop every captured graph and free the memory they kept (their outputs are invalid
        from now on). Each region runs eagerly once more before its next capture."""
        self._seen.clear()
        self._graphs.clear()
        self._owned.clear()
        self._rows.clear()
        self._buckets.clear()
        self._pool.free_all_blocks()

    def forget(self, sig) -> None:
        """Drop region `sig`'s graph, if any; the region stays eager (e.g. when another rank's
        part of a step failed to capture)."""
        cap = self._graphs.get(sig)
        if cap is not None:
            for a in _arrays(cap.out):
                self._owned.discard(a.data.ptr)
            self.captures -= 1
        self._graphs[sig] = None

    def replay(self, sig, fn, arrays: tuple):
        """Region `sig`'s graph on this call's inputs (fn(*arrays) eagerly where an input that
        was another graph's output now lies elsewhere)."""
        return self._replay(self._graphs[sig], fn, arrays)

    def _replay(self, cap: _Captured, fn, arrays):
        stream = cp.cuda.get_current_stream()
        copies = []  # (src, dst, bytes, the source array) of the inputs copied into the graph's buffers
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
            # (the array rides along: a converted copy must outlive the batched copy that reads it)
            copies.append((a.data.ptr, ref.data.ptr, ref.nbytes, a))
        self._copy(copies, stream)
        cap.graph.launch(stream)
        self.replays += 1
        return cap.out

    def _copy(self, copies: list, stream) -> None:
        """The input copies: where there are many (a draft step's windows, one per sequence and
        layer), the 16-byte-aligned ones in one copy_rows launch (kernels/elementwise.cu) over an
        uploaded table, since each cudaMemcpyAsync costs the host more than its copy takes."""
        table = [c[:3] for c in copies if len(copies) > BATCHED_COPIES and (c[0] | c[1] | c[2]) % 16 == 0]
        for src, dst, n, _ in copies:
            if not table or (src | dst | n) % 16:
                cp.cuda.runtime.memcpyAsync(dst, src, n, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        if table:
            copy_table(table, self._upload, 16)
