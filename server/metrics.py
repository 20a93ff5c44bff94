"""Prometheus metrics through prometheus_client, under vLLM's names and labels where vLLM exports
the same figure (so its Grafana dashboards, the production-stack router and KEDA rules read this
server unchanged), plus ours (dsuf_*). Every family carries `model_name` (the served model id);
vLLM's also carry `engine` ("0": one engine per server). docs/metrics.md lists them all.

One CollectorRegistry per server (never the process-wide default), so several apps in one
process keep their own figures. Families that depend on the model (label value, context-sized
buckets, the scheduler's gauges) are created by bind() once the engine is attached; an HTTP error
answered before that is counted then. Updates and scrapes both run on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "parse_prometheus", "build_1_2_5_buckets", "state_usage_fn"]

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
SPEC_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16)

# our finish reasons -> vLLM's FinishReason values (tool calls end on a stop token for the engine)
VLLM_REASON = {"stop": "stop", "tool_calls": "stop", "length": "length", "cancelled": "abort", "error": "error"}

_VLLM_LABELS = ("model_name", "engine")
_ENGINE = "0"


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def state_usage_fn(engine: Any, scheduler: Any, context_len: int) -> Callable[[], float] | None:
    """vllm:kv_cache_usage_perc's definition here (no paged KV pool): the device-resident state
    bytes of the running sequences at their current positions (engine/model/base.py
    resident_state_bytes_per_token) over the sequence-state budget, which is the GPU memory plan's
    state term (max sequences x state of a full context) when there is one, else max_batch
    sequences of the served context. None when the engine gives no model config."""
    cfg = getattr(engine, "config", None)
    if cfg is None:
        return None
    from engine.model.base import resident_state_bytes_per_token

    per_token, fixed = resident_state_bytes_per_token(cfg)
    plan = getattr(engine, "memory_plan", None)
    if plan is not None:
        budget = float(plan.max_seqs * plan.state_per_seq)
    else:
        budget = scheduler.max_batch * (fixed + per_token * context_len)
    if budget <= 0:
        return None

    def usage() -> float:
        used = 0.0
        for s in list(scheduler.running):
            st = s.state
            if st is not None:
                used += fixed + per_token * int(st.position)
        return used / budget

    return usage


class _Inc:
    """A labelled counter's `.inc(amount, **labels)` for callers that predate bind()."""

    def __init__(self, fn: Callable[..., None]):
        self.inc = fn


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.model_name: str | None = None
        self._http = Counter("dsuf_http_errors", "Error responses sent, by HTTP status.", ("model_name", "status"),
                             registry=self.registry)
        self._early_errors: dict[str, int] = {}
        self.http_errors = _Inc(self._http_error)
        self.cache_queries = _Inc(self._cache_queries)  # kvcache/serving.py: prompt tokens looked up
        self.cache_hits = _Inc(self._cache_hits)  # prompt tokens reused from the state cache
        self._queried = self._hit = 0

    # ------------------------------------------------------------ families

    def bind(self, model_name: str, scheduler: Any, engine: Any = None, *, context_len: int = 0,
             kv: Any = None) -> None:
        """Create the families for the served model (label value), the scheduler's gauges and the
        state cache's collector (kv: kvcache.cache.StateCache or None)."""
        if self.model_name is not None:
            raise RuntimeError("metrics already bound")
        self.model_name = model_name
        r, v, ours = self.registry, (model_name, _ENGINE), (model_name,)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, _VLLM_LABELS, registry=r).labels(*v)

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, _VLLM_LABELS, registry=r).labels(*v).set_function(fn)

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return Histogram(name, doc, _VLLM_LABELS, buckets=tuple(buckets), registry=r).labels(*v)

        gauge("vllm:num_requests_running", "Sequences in the running batch (n choices of a prompt count n).",
              lambda: len(scheduler.running))
        gauge("vllm:num_requests_waiting", "Sequences queued for a batch slot.", lambda: len(scheduler.waiting))
        usage = state_usage_fn(engine, scheduler, context_len or 1)
        if usage is not None:
            doc = ("Sequence-state memory in use, 1 = 100 percent: device-resident state bytes of the running "
                   "sequences at their current lengths over the state budget (the GPU memory plan's state "
                   "term, else max_batch sequences of the served context).")
            gauge("vllm:kv_cache_usage_perc", doc, usage)
            gauge("vllm:gpu_cache_usage_perc", doc + " Same value as vllm:kv_cache_usage_perc (older name).",
                  usage)
        gauge("vllm:gpu_prefix_cache_hit_rate", "Prompt tokens reused from the state cache over prompt tokens "
              "looked up, since the server started (0 before any lookup).",
              lambda: self._hit / self._queried if self._queried else 0.0)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens "
                                      "looked up in the state cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens reused "
                                   "from the state cache.")
        self.gpu_prefix_queries = counter("vllm:gpu_prefix_cache_queries", "Same as vllm:prefix_cache_queries "
                                          "(older name).")
        self.gpu_prefix_hits = counter("vllm:gpu_prefix_cache_hits", "Same as vllm:prefix_cache_hits (older name).")
        counter("vllm:num_preemptions", "Preemptions: this scheduler runs an admitted sequence to its end "
                "and never preempts.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the prompts whose prefill "
                                     "completed, once per prompt (usage.prompt_tokens), cached ones included.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        success = Counter("vllm:request_success", "Finished sequences by finish reason (abort: the client "
                          "left; error: the engine failed it).", (*_VLLM_LABELS, "finished_reason"), registry=r)
        self.success = {k: success.labels(*v, k) for k in ("stop", "length", "abort", "error")}
        max_len = max(1, context_len)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per finished sequence.",
                               build_1_2_5_buckets(max_len))
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens per finished sequence.",
                            build_1_2_5_buckets(max_len))
        self.iteration = hist("vllm:iteration_tokens_total", "Tokens fed to the model per engine step "
                              "(prompt chunks, one per decoding sequence, and a speculating sequence's drafted rows).",
                              ITERATION_TOKEN_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "The n request parameter, per admitted prompt.", N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens request parameter "
                                      "(when given), per finished sequence.", build_1_2_5_buckets(max_len))
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival (after tokenization) to the first "
                         "generated token, seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Gap between consecutive generated tokens of a "
                        "sequence, seconds.", ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Same observations as "
                         "vllm:inter_token_latency_seconds (older name).", ITL_BUCKETS)
        self.req_tpot = hist("vllm:request_time_per_output_token_seconds", "Mean gap between generated tokens "
                             "of a finished sequence, seconds.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish of a sequence, seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Arrival to admission into the running "
                               "batch, seconds.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds", "Admission into the running batch to "
                                   "the last token, seconds.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "Admission into the running batch to the "
                                 "first token, seconds.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds", "First to last generated token, seconds.",
                                REQUEST_LATENCY_BUCKETS)
        info = {"model_name": model_name, "engine": _ENGINE,
                "enable_prefix_caching": str(kv is not None and bool(getattr(kv, "enabled", True)))}
        if kv is not None:
            info["host_cache_bytes"] = str(int(getattr(getattr(kv, "store", None), "capacity", 0)))
        Gauge("vllm:cache_config_info", "Information of the state cache configuration (always 1).",
              tuple(info), registry=r).labels(**info).set(1)

        def ours_counter(name: str, doc: str, *labels: str) -> Any:
            c = Counter(name, doc, ("model_name", *labels), registry=r)
            return c if labels else c.labels(*ours)

        Gauge("dsuf_batch_capacity", "Maximum sequences in the running batch.", ("model_name",),
              registry=r).labels(*ours).set_function(lambda: scheduler.max_batch)
        Gauge("dsuf_queue_capacity", "Sequences that may wait for a slot before requests get 429.",
              ("model_name",), registry=r).labels(*ours).set_function(lambda: getattr(scheduler, "max_queue", 0))
        self.prefill_tokens = ours_counter("dsuf_prefill_tokens", "Prompt tokens computed by prefill (tokens "
                                           "reused from the state cache not counted).")
        self.requests = ours_counter("dsuf_requests", "Finished sequences by our finish reason.", "finish_reason")
        self.rejected = ours_counter("dsuf_requests_rejected", "Requests refused with 429: the queue was full.")
        self.steps = ours_counter("dsuf_engine_steps", "Batched engine steps.")
        self._bind_spec(counter, ours_counter, ours)
        for status, n in self._early_errors.items():
            self._http.labels(model_name, status).inc(n)
        self._early_errors.clear()
        if kv is not None:
            r.register(kv.stats.collector(model_name))

    def _bind_spec(self, counter: Callable[..., Any], ours_counter: Callable[..., Any], ours: tuple[str]) -> None:
        """Speculative decoding (server/speculate.py): vLLM's counters and ours, and the
        distribution of tokens emitted per verify step (1 .. block size + 1)."""
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Verify steps of speculative decoding.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_drafted = ours_counter("dsuf_spec_drafted_tokens", "Draft tokens proposed to the verify step.")
        self.spec_accepted = ours_counter("dsuf_spec_accepted_tokens", "Draft tokens the verify step kept.")
        self.spec_stopped = ours_counter("dsuf_spec_stopped_sequences", "Sequences that went back to plain "
                                         "decoding: their acceptance did not pay for the draft and verify steps.")
        self.spec_length = Histogram("dsuf_spec_acceptance_length", "Tokens emitted per verify step of a "
                                     "speculating sequence (accepted drafts plus the main model's own token).",
                                     ("model_name",), buckets=SPEC_LENGTH_BUCKETS,
                                     registry=self.registry).labels(*ours)

    # ------------------------------------------------------------ call sites

    def spec(self, stats: Any) -> None:
        """One sequence's verify steps (engine.runtime.spec_decode.SpecStats)."""
        self.spec_drafts.inc(len(stats.lengths))
        self.spec_draft_tokens.inc(stats.drafted)
        self.spec_accepted_tokens.inc(stats.accepted)
        self.spec_drafted.inc(stats.drafted)
        self.spec_accepted.inc(stats.accepted)
        for n in stats.lengths:
            self.spec_length.observe(n)

    def _http_error(self, amount: float = 1.0, *, status: str) -> None:
        if self.model_name is None:
            self._early_errors[status] = self._early_errors.get(status, 0) + int(amount)
        else:
            self._http.labels(self.model_name, status).inc(amount)

    def _cache_queries(self, amount: float) -> None:
        if self.model_name is not None:
            self._queried += int(amount)
            self.prefix_queries.inc(amount)
            self.gpu_prefix_queries.inc(amount)

    def _cache_hits(self, amount: float) -> None:
        if self.model_name is not None:
            self._hit += int(amount)
            self.prefix_hits.inc(amount)
            self.gpu_prefix_hits.inc(amount)

    def admitted(self, n: int, prompts: int) -> None:
        for _ in range(prompts):
            self.params_n.observe(n)

    def step(self, tokens: int) -> None:
        self.steps.inc()
        self.iteration.observe(tokens)

    def token(self, s: Any, now: float) -> None:
        """One token generated for sequence s (before s.t_first / s.t_last move to now)."""
        self.generation_tokens.inc()
        if s.t_first is None:
            self.ttft.observe(now - s.t_arrival)
        elif s.t_last is not None:
            self.itl.observe(now - s.t_last)
            self.tpot.observe(now - s.t_last)

    def finished(self, s: Any, reason: str, now: float | None = None) -> None:
        """A sequence ended: stop | length | tool_calls carry their timings; cancelled | error only count."""
        now = time.monotonic() if now is None else now
        self.requests.labels(self.model_name, reason).inc()
        self.success[VLLM_REASON.get(reason, "abort")].inc()
        if reason in ("cancelled", "error"):
            return
        n_gen = len(s.generated)
        self.e2e.observe(now - s.t_arrival)
        self.req_prompt.observe(len(s.prompt))
        self.req_gen.observe(n_gen)
        if s.gen.max_tokens is not None:
            self.params_max_tokens.observe(s.gen.max_tokens)
        t_sched = getattr(s, "t_scheduled", None) or s.t_arrival
        self.queue_time.observe(t_sched - s.t_arrival)
        if s.t_first is not None and s.t_last is not None:
            self.prefill_time.observe(s.t_first - t_sched)
            self.decode_time.observe(s.t_last - s.t_first)
            self.inference_time.observe(s.t_last - t_sched)
            if n_gen > 1:
                self.req_tpot.observe((s.t_last - s.t_first) / (n_gen - 1))

    # ------------------------------------------------------------ exposition

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_prometheus(text: str, drop: tuple[str, ...] = ("model_name", "engine")) -> dict[str, float]:
    """Samples as 'name{k="v",...}' (labels sorted; `drop` labels left out, since one server serves
    one model) -> value, read with prometheus_client's own parser. For tests and tools."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            labels = sorted((k, v) for k, v in smp.labels.items() if k not in drop)
            key = smp.name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")
            out[key] = out.get(key, 0.0) + smp.value
    return out
