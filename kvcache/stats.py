"""Counters of the state cache, rendered in Prometheus text format for the server's /metrics."""

from __future__ import annotations

import math
from collections.abc import Callable

_FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf"
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class KVStats:
    def __init__(self) -> None:
        self.counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self.help: dict[str, str] = {}
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self.hist_counts = [0] * (len(_FETCH_BUCKETS) + 1)
        self.hist_sum = 0.0
        for name, text in (
            ("lookups_total", "Prompt lookups in the state cache."),
            ("hits_total", "Lookups that reused a stored state, by source (local, remote)."),
            ("hit_tokens_total", "Prompt tokens reused instead of prefilled, by source."),
            ("fetched_bytes_total", "State bytes fetched from peers."),
            ("fallbacks_total", "Remote fetches abandoned for recomputation, by reason."),
            ("snapshots_total", "Sequence states stored."),
            ("served_total", "States sent to peers."),
            ("served_bytes_total", "State bytes sent to peers."),
            ("refused_total", "Fetches this server refused, by reason (unauthorized, missing, stale, busy)."),
            ("accept_errors_total", "Errors accepting state-transfer connections (descriptor shortage)."),
        ):
            self.counters[name] = {}
            self.help[name] = text

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        c = self.counters[name]
        c[key] = c.get(key, 0.0) + amount

    def get(self, name: str, **labels: str) -> float:
        return self.counters[name].get(tuple(sorted(labels.items())), 0.0)

    def observe_fetch(self, seconds: float) -> None:
        self.hist_sum += seconds
        for i, b in enumerate((*_FETCH_BUCKETS, math.inf)):
            if seconds <= b:
                self.hist_counts[i] += 1

    def gauge(self, name: str, text: str, fn: Callable[[], float]) -> None:
        self.gauges[name] = (text, fn)

    def render(self, prefix: str = "dsuf_kvcache_") -> str:
        out: list[str] = []
        for name, (text, fn) in self.gauges.items():
            out += [f"# HELP {prefix}{name} {text}", f"# TYPE {prefix}{name} gauge", f"{prefix}{name} {_num(fn())}"]
        for name, values in self.counters.items():
            out += [f"# HELP {prefix}{name} {self.help[name]}", f"# TYPE {prefix}{name} counter"]
            if not values:
                out.append(f"{prefix}{name} 0")
            for labels, v in sorted(values.items()):
                lab = ",".join(f'{k}="{val}"' for k, val in labels)
                out.append(f"{prefix}{name}{{{lab}}} {_num(v)}" if lab else f"{prefix}{name} {_num(v)}")
        h = prefix + "fetch_seconds"
        out += [f"# HELP {h} Time to fetch a state from a peer (successful fetches).", f"# TYPE {h} histogram"]
        for b, c in zip((*_FETCH_BUCKETS, math.inf), self.hist_counts, strict=True):
            out.append(f'{h}_bucket{{le="{_num(b)}"}} {c}')  # cumulative: observe() fills every bucket >= v
        out += [f"{h}_sum {_num(self.hist_sum)}", f"{h}_count {self.hist_counts[-1]}"]
        return "\n".join(out) + "\n"
