"""Prometheus text exposition (format 0.0.4) without a client library.

Everything here is touched only from the event loop, so no locks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Counter:
    def __init__(self, name: str, help_: str, label_names: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help_, label_names
        self.values: dict[tuple[str, ...], float] = {} if label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(str(labels[n]) for n in self.label_names)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(str(labels[n]) for n in self.label_names), 0.0)

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(dict(zip(self.label_names, key, strict=True)))} {_fmt(v)}")
        return out


class Gauge:
    """A gauge read from a callback at scrape time (the scheduler owns the truth)."""

    def __init__(self, name: str, help_: str, fn: Callable[[], float]):
        self.name, self.help, self.fn = name, help_, fn

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {_fmt(self.fn())}"]


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help = name, help_
        self.buckets = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for b, c in zip(self.buckets, self.counts, strict=True):
            out.append(f'{self.name}_bucket{{le="{_fmt(b)}"}} {c}')
        out.append(f"{self.name}_sum {_fmt(self.sum)}")
        out.append(f"{self.name}_count {self.count}")
        return out


class Metrics:
    def __init__(self) -> None:
        p = "dsuf_"
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens prefilled.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
        self.requests = Counter(p + "requests_total", "Finished sequences by finish reason.", ("finish_reason",))
        self.http_errors = Counter(p + "http_errors_total", "Error responses by status.", ("status",))
        self.rejected = Counter(p + "requests_rejected_total", "Requests refused because the queue was full.")
        self.cache_queries = Counter(p + "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = Counter(p + "prefix_cache_hits_total", "Prompt tokens served from the prefix cache.")
        self.steps = Counter(p + "engine_steps_total", "Batched engine steps.")
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean gap between generated tokens.",
                              _TPOT_BUCKETS)
        self.e2e = Histogram(p + "request_latency_seconds", "Arrival to finish, per sequence.", _E2E_BUCKETS)
        self.gauges: list[Gauge] = []

    def add_gauge(self, name: str, help_: str, fn: Callable[[], float]) -> None:
        self.gauges.append(Gauge("dsuf_" + name, help_, fn))

    def render(self) -> str:
        lines: list[str] = []
        for g in self.gauges:
            lines += g.render()
        for m in (self.prompt_tokens, self.generation_tokens, self.requests, self.http_errors, self.rejected,
                  self.cache_queries, self.cache_hits, self.steps, self.ttft, self.tpot, self.e2e):
            lines += m.render()
        return "\n".join(lines) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """Tiny parser for tests and tools: 'name{labels}' -> value (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out
