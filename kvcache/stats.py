"""Counters of the state cache, exposed as a prometheus_client collector (dsuf_kvcache_*) that the
server registers in its own registry with the served model's label (server/metrics.py)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

_FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "dsuf_kvcache_"


def _le(b: float) -> str:
    return "+Inf" if math.isinf(b) else repr(float(b))


class KVStats:
    """Counters, scrape-time gauges and the fetch-time histogram. Updated from the event loop and
    from the snapshot / engine threads, hence the lock."""

    def __init__(self) -> None:
        self.counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self.help: dict[str, str] = {}
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        # counters owned elsewhere, read at scrape: a value, or {label value: value} under one label
        self.counter_fns: dict[str, tuple[Callable[[], float | dict[str, float]], str | None]] = {}
        self.hist_counts = [0] * (len(_FETCH_BUCKETS) + 1)
        self.hist_sum = 0.0
        self._lock = threading.Lock()
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
        with self._lock:
            c = self.counters[name]
            c[key] = c.get(key, 0.0) + amount

    def get(self, name: str, **labels: str) -> float:
        return self.counters[name].get(tuple(sorted(labels.items())), 0.0)

    def observe_fetch(self, seconds: float) -> None:
        with self._lock:
            self.hist_sum += seconds
            for i, b in enumerate((*_FETCH_BUCKETS, math.inf)):
                if seconds <= b:
                    self.hist_counts[i] += 1  # cumulative: every bucket >= seconds

    def gauge(self, name: str, text: str, fn: Callable[[], float]) -> None:
        self.gauges[name] = (text, fn)

    def counter_fn(self, name: str, fn: Callable[[], float | dict[str, float]], label: str | None = None) -> None:
        """A counter whose value something else keeps (read at scrape time); with `label`, fn returns
        one value per label value."""
        self.counter_fns[name] = (fn, label)

    def collector(self, model_name: str) -> Collector:
        return _KVCollector(self, model_name)

    def render(self, model_name: str = "") -> str:
        """The families alone, in text format (tools; the server renders its whole registry)."""
        reg = CollectorRegistry()
        reg.register(self.collector(model_name))
        return generate_latest(reg).decode()


class _KVCollector(Collector):
    def __init__(self, stats: KVStats, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        s, m = self.stats, self.model_name
        for name, (text, fn) in s.gauges.items():
            g = GaugeMetricFamily(PREFIX + name, text, labels=("model_name",))
            g.add_metric((m,), float(fn()))
            yield g
        with s._lock:
            values = {name: dict(v) for name, v in s.counters.items()}
            counts, total = list(s.hist_counts), s.hist_sum
        for name, (fn, label) in s.counter_fns.items():
            v = fn()
            values[name] = ({((label, str(k)),): float(n) for k, n in v.items()} if label is not None
                            else {(): float(v)})
        for name, series in values.items():
            fam = CounterMetricFamily(PREFIX + name, s.help[name])
            for labels, v in sorted(series.items() or [((), 0.0)]):
                fam.samples.append(Sample(fam.name + "_total", {"model_name": m, **dict(labels)}, v))
            yield fam
        h = HistogramMetricFamily(PREFIX + "fetch_seconds", "Time to fetch a state from a peer (successful "
                                  "fetches).", labels=("model_name",))
        h.add_metric((m,), [(_le(b), c) for b, c in zip((*_FETCH_BUCKETS, math.inf), counts, strict=True)], total)
        yield h
