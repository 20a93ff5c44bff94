"""Forks: a captured decode step's independent chains on a second stream (CupyOps.fork, join_all).

fork(fn, *args) runs fn(*args) on the backend's side stream while the current stream is being
captured into a CUDA graph, so that a step's independent chains (the shared expert beside the
routed ones, the query heads beside the K=V path, an mHC site's mixes beside its collapse) overlap
their launch latencies and fill each other's idle memory time; the fork and its join become edges
of the graph. Otherwise fn runs inline and fork returns what it returned.

The rules:
- fork returns fn's outputs as plain arrays (in the tuple / None structure fn returned). They are
  pending: every public op method of the backend first joins the forks its array arguments come
  from (also inside list / tuple arguments): the current stream waits for the fork's end, and the
  whole fork is joined. A forked output must therefore reach other work only through op methods
  (a CuPy expression on it would not wait), or after join_all(). One exception, for overlap:
  moe() joins its `shared` argument only after the routed experts' launches, before it adds it.
- join_all() joins every fork still open. A capture must join every stream it forked, so the
  runner calls it at the end of a captured step (graphed_step does it too).
- A fork keeps its arguments and outputs alive until it is joined, so that memory the caller
  drops meanwhile is not handed to a kernel of the current stream while the fork may still read
  it. Pass fn every array it reads (weights live anyway).
- Only while capturing: an eager fork could fill a cache (segment or pointer tables) or the pinned
  upload ring on its own stream, and the current stream could read that entry before the join. A
  capture runs after the step's eager warm-up, its caches full and its uploads not staged through
  the ring.
- No fork inside a fork: it runs inline on the side stream (one side stream: forks are ordered
  among themselves, so ops inside a fork need not join earlier forks).
- hc_mixes / hc_head_pre's one-launch kernel keeps per-row block counters in one buffer of the
  backend: two of its launches must never overlap. The model joins one site's mixes before it
  forks the next site's; and a mix launched on the current stream while a fork that launched one is
  pending joins that fork first.
"""

from __future__ import annotations

import functools
import inspect

import cupy as cp


class _Fork:
    """One fork: its end on the side stream, what it keeps alive, its outputs' allocations."""

    __slots__ = ("done", "keep", "keys")

    def __init__(self, done: cp.cuda.Event, keep: tuple, keys: list[int]) -> None:
        self.done, self.keep, self.keys = done, keep, keys


def _arrays(out) -> list:
    """The device arrays in what fn returned (an array, a tuple / list of them, or None)."""
    if isinstance(out, cp.ndarray):
        return [out]
    if isinstance(out, (tuple, list)):
        return [a for x in out for a in _arrays(x)]
    return []


def _key(a: cp.ndarray) -> int:
    """An array's allocation (shared by its views)."""
    return id(a.data.mem)


class Forks:
    """fork / join_all and the bookkeeping of the forks still pending (a base of CupyOps)."""

    def _init_forks(self) -> None:
        self._pending: dict[int, _Fork] = {}  # allocation of a forked output -> its fork
        self._open: dict[int, _Fork] = {}  # id(fork) -> fork, every fork not yet joined
        self._forking = False  # inside fork(): fn is being enqueued on the side stream
        self._side_stream: cp.cuda.Stream | None = None  # made on first use, on this backend's device
        self._mix_fork: _Fork | None = None  # an open fork that launched the mix kernel's counters
        self._fork_mixes = False  # the fork being enqueued launched it

    def fork(self, fn, *args):
        """fn(*args), on the side stream while the current stream is capturing (see the module)."""
        main = cp.cuda.get_current_stream()
        if self._forking or not main.is_capturing():
            return fn(*args)
        if self._side_stream is None:
            self._side_stream = cp.cuda.Stream(non_blocking=True)
        side = self._side_stream
        start = cp.cuda.Event(disable_timing=True)
        start.record(main)
        side.wait_event(start)
        self._forking, self._fork_mixes = True, False
        try:
            with side:
                out = fn(*args)
        finally:
            self._forking = False
        done = cp.cuda.Event(disable_timing=True)
        done.record(side)
        f = _Fork(done, (args, out), [_key(a) for a in _arrays(out)])
        self._open[id(f)] = f
        for k in f.keys:
            self._pending[k] = f
        if self._fork_mixes:
            self._mix_fork = f
        return out

    def join_all(self) -> None:
        """Join every open fork into the current stream."""
        for f in list(self._open.values()):
            self._join(f)

    # ---- joins ------------------------------------------------------------------------
    def _join(self, f: _Fork) -> None:
        """The current stream waits for fork f; f and its outputs are no longer pending. (A fork
        found open outside a capture belongs to a capture that ended: nothing to wait for.)"""
        main = cp.cuda.get_current_stream()
        if main.is_capturing():
            main.wait_event(f.done)
        self._open.pop(id(f), None)
        for k in f.keys:
            if self._pending.get(k) is f:
                del self._pending[k]
        if self._mix_fork is f:
            self._mix_fork = None

    def _join_value(self, v, depth: int = 0) -> None:
        if isinstance(v, cp.ndarray):
            f = self._pending.get(_key(v))
            if f is not None:
                self._join(f)
        elif isinstance(v, (list, tuple)) and depth < 4:  # (attention_decode: sources[b][j] = (kv, mask))
            for x in v:
                self._join_value(x, depth + 1)

    def _join_late(self, x):
        """x (an argument whose join its op deferred: moe's shared), its fork joined now."""
        if self._pending and not self._forking:
            self._join_value(x)
        return x

    def _claim_mix_counters(self) -> None:
        """Before a launch of the mix kernel (the backend's one counter buffer): inside a fork,
        remember it; else join an open fork that launched one."""
        if self._forking:
            self._fork_mixes = True
        elif self._mix_fork is not None:
            self._join(self._mix_fork)

    def _drop_forks(self) -> None:
        """Forget every open fork (its capture failed: nothing of it will run)."""
        self._pending.clear()
        self._open.clear()
        self._mix_fork = None


def joins_late(name: str):
    """Mark an op method whose argument `name` it joins itself (Forks._join_late), later than at
    its start."""
    def mark(fn):
        fn._joins_late = name
        return fn
    return mark


def _joining(fn):
    """fn, first joining the forks its array arguments come from (one check while none is pending)."""
    late = getattr(fn, "_joins_late", None)
    if late is None:
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            if self._pending and not self._forking:
                self._join_value(args)
                self._join_value(tuple(kwargs.values()))
            return fn(self, *args, **kwargs)
        method._joins = True
        return method
    pos = list(inspect.signature(fn).parameters).index(late) - 1  # (its position after self)

    @functools.wraps(fn)
    def method_late(self, *args, **kwargs):
        if self._pending and not self._forking:
            self._join_value(args[:pos] + args[pos + 1:])
            self._join_value(tuple(v for k, v in kwargs.items() if k != late))
        return fn(self, *args, **kwargs)
    method_late._joins = True
    return method_late


def joins_inputs(cls):
    """Class decorator: every public method of cls (its own or inherited) joins its inputs first. A
    subclass of a decorated class needs it too, for the methods it overrides."""
    for name in dir(cls):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        if inspect.isfunction(raw) and not getattr(raw, "_joins", False):
            setattr(cls, name, _joining(raw))
    return cls
