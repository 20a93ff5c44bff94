"""A forward by part: the time of each top-level op, summed by the part of the model it belongs to
(GEMMs, MoE, indexer, attention, the rest), for `bench`'s prefill breakdown.

Each op call is timed where it runs: on the GPU by a pair of CUDA events around it on the current
stream (so a fork's ops, on their own stream, overlap the main stream's and the parts may add up to
more than the wall time), on the numpy backend by the host clock. Ops called inside another op (a
MoE's own linears on the numpy backend) count as part of the outer one. Not for CUDA-graph captures:
an event recorded inside a capture belongs to the graph.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

PARTS = {
    "linear": "GEMMs", "grouped_linear": "GEMMs",
    "route": "MoE", "moe": "MoE", "swiglu_mlp": "MoE",  # (the shared expert's MLP too)
    "indexer_scores": "indexer", "indexer_scores_spans": "indexer", "topk_mask": "indexer",
    "attention_ranges": "attention", "attention_decode": "attention", "attend_decode": "attention",
}
OTHER = "the rest"
# every op of engine/ops/protocol.py that computes (the rest: norms, RoPE, mHC, Engram, pooling)
TIMED = (*PARTS, "embed", "rmsnorm", "rope", "norm_rope_quant", "engram_mix", "hc_mixes", "hc_head_pre",
         "hc_collapse_norm", "hc_expand", "gated_pool", "gated_pool_rows", "scatter_rows", "copy_rows")


class _HostClock:
    def start(self) -> float:
        return time.perf_counter()

    def stop(self, t0: float) -> float:
        return time.perf_counter() - t0

    def seconds(self, mark) -> float:
        return mark


class _EventClock:
    """CUDA events on the current stream; read once the work is done (seconds())."""

    def __init__(self) -> None:
        import cupy as cp

        self.cp = cp

    def start(self):
        ev = self.cp.cuda.Event()
        ev.record()
        return ev

    def stop(self, ev0):
        ev1 = self.cp.cuda.Event()
        ev1.record()
        return ev0, ev1

    def seconds(self, mark) -> float:
        mark[1].synchronize()
        return self.cp.cuda.get_elapsed_time(*mark) / 1e3


@contextlib.contextmanager
def watching(ops_list: list, around: Callable[[object, str, Callable[[], object]], object],
             names: tuple[str, ...] = TIMED) -> Iterator[None]:
    """Within the block, each top-level call of the ops `names` of the backends in ops_list goes
    through around(ops, name, call), call() running the op (call.args: the op's positional
    arguments; an op called inside another runs plainly); the backends' own methods show through
    again after."""
    patched: list[tuple[object, str]] = []
    for ops in ops_list:
        depth = [0]
        for name in names:
            fn = getattr(ops, name, None)
            if fn is None:
                continue

            def hooked(*a, _fn=fn, _name=name, _ops=ops, _depth=depth, **k):
                if _depth[0]:
                    return _fn(*a, **k)
                _depth[0] += 1

                def call():
                    return _fn(*a, **k)

                call.args = a
                try:
                    return around(_ops, _name, call)
                finally:
                    _depth[0] -= 1

            setattr(ops, name, hooked)
            patched.append((ops, name))
    try:
        yield
    finally:
        for ops, name in patched:
            delattr(ops, name)  # (the class's method shows through again)


def part_of(label: str) -> str:
    """The part an op's label (its name, a linear's with its weight's shape) belongs to."""
    return PARTS.get(label.split(" ")[0], OTHER)


def _label(name: str, args: tuple) -> str:
    """An op's name; a linear's with its weight's shape (which projection it is)."""
    shape = getattr(args[1], "shape", None) if name in ("linear", "grouped_linear") and len(args) > 1 else None
    return f"{name} {shape[0]}x{shape[1]}" if shape is not None and len(shape) == 2 else name


def array_bytes(*values) -> int:
    """Bytes of the arrays among values (tuples and lists looked into): what an op that reads its
    inputs once and writes its outputs once moves."""
    n = 0
    for v in values:
        if isinstance(v, (tuple, list)):
            n += array_bytes(*v)
        elif hasattr(v, "nbytes") and hasattr(v, "shape"):
            n += int(v.nbytes)
    return n


def by_op(ops_list: list, run: Callable[[], object], moved: dict[str, int] | None = None) -> dict[str, float]:
    """run() with every op of the backends in ops_list (one per tensor-parallel rank) timed;
    seconds by op (top-level calls; a linear by its weight's shape), summed over the ranks. moved:
    filled with each op's bytes of array arguments and results (array_bytes), summed the same way."""
    marks: list[tuple[str, object, object]] = []
    clocks = {id(ops): _EventClock() if getattr(ops, "name", "") == "cupy" else _HostClock() for ops in ops_list}

    def timed(ops, name: str, call: Callable[[], object]):
        clock, args = clocks[id(ops)], getattr(call, "args", ())
        label = _label(name, args)
        t0 = clock.start()
        out = None
        try:
            out = call()
            return out
        finally:
            marks.append((label, clock, clock.stop(t0)))
            if moved is not None:
                moved[label] = moved.get(label, 0) + array_bytes(args, out)

    with watching(ops_list, timed):
        run()
    out: dict[str, float] = defaultdict(float)
    for name, clock, mark in marks:
        out[name] += clock.seconds(mark)
    return dict(out)


def parts_of(op_seconds: dict[str, float]) -> dict[str, float]:
    """by_op's seconds summed by part (PARTS, OTHER)."""
    out: dict[str, float] = defaultdict(float)
    for name, s in op_seconds.items():
        out[part_of(name)] += s
    return dict(out)


def report(parts: dict[str, float], wall: float, floors: dict[str, float] | None = None,
           op_seconds: dict[str, float] | None = None, top: int = 6, op_floors: dict[str, float] | None = None) -> str:
    """One line: each part's seconds and share of the wall time, largest first; with floors (seconds
    by part at the tensor cores' rates, summed over the ranks as the parts are) each part's floor
    and its share of the part's time; with op_seconds the `top` largest ops of each part made of
    several, and with op_floors (seconds by op, e.g. its bytes at the copy rate) those of the rest's
    ops beside them."""
    items = sorted(parts.items(), key=lambda kv: -kv[1])

    def cell(p: str, s: float) -> str:
        text = f"{p} {s:.3f} s ({100 * s / wall:.0f}%"
        if floors and floors.get(p):
            text += f"; floor {floors[p]:.3f} s, {100 * floors[p] / s:.0f}% of it"
        ops = sorted(((n, t) for n, t in (op_seconds or {}).items() if part_of(n) == p), key=lambda kv: -kv[1])
        if len(ops) > 1:
            text += ": " + ", ".join(f"{n} {t:.3f}" + (f" (floor {op_floors[n]:.3f})" if p == OTHER and op_floors
                                                          and n in op_floors else "") for n, t in ops[:top])
        return text + ")"

    body = ", ".join(cell(p, s) for p, s in items)
    return f"{body}; ops {sum(parts.values()):.3f} s of {wall:.3f} s wall"
