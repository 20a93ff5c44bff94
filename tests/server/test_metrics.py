"""/metrics over real HTTP: vLLM's families and labels (dashboards, the production-stack router and
KEDA read them), values checked against what the requests actually got (usage), and ours."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import openai
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import CONTENT_TYPE_LATEST, TTFT_BUCKETS, Metrics, parse_prometheus

VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:gpu_prefix_cache_hit_rate": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:gpu_prefix_cache_queries": "counter", "vllm:gpu_prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:iteration_tokens_total": "histogram",
}


def _scrape(server) -> tuple[str, str]:
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
        return r.headers["Content-Type"], r.read().decode()


def _families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(_scrape(server)[1])}


def _value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """Sum of a family's samples named `sample` (default: the family's own) whose labels include `labels`."""
    name = sample or family
    return sum(s.value for s in fams[family].samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _model_id(server) -> str:
    with urllib.request.urlopen(server.base + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def _wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("speculative", ["off", "dspark"])
def test_vllm_families_count_what_the_requests_got(make_server, speculative):
    s = make_server(speculative=speculative)
    model = _model_id(s)
    c = _client(s)
    usage_p = usage_c = 0
    finishes: list[str] = []
    for text in ("Name a prime.", "Sort a list in Python."):
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=6,
                                      temperature=0)
        usage_p, usage_c = usage_p + r.usage.prompt_tokens, usage_c + r.usage.completion_tokens
        finishes += [ch.finish_reason for ch in r.choices]
    stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to three."}],
                                       max_tokens=5, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        finishes += [ch.finish_reason for ch in chunk.choices if ch.finish_reason]
        if chunk.usage:
            usage_p, usage_c = usage_p + chunk.usage.prompt_tokens, usage_c + chunk.usage.completion_tokens
    r = c.completions.create(model=model, prompt="def add(a, b):", max_tokens=4, n=2, temperature=1.0, seed=3)
    usage_p, usage_c = usage_p + r.usage.prompt_tokens, usage_c + r.usage.completion_tokens
    finishes += [ch.finish_reason for ch in r.choices]
    n_seqs, n_prompts = len(finishes), 4
    assert n_seqs == 5

    ctype, text = _scrape(s)
    assert ctype == CONTENT_TYPE_LATEST
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_FAMILIES.items():
        assert name in fams, name
        assert fams[name].type == kind, name
        assert fams[name].samples, name
        for smp in fams[name].samples:  # vLLM's label names, the served model id as the value
            assert smp.labels["model_name"] == model and smp.labels["engine"] == "0", smp
    v = lambda *a, **kw: _value(fams, *a, **kw)  # noqa: E731
    assert v("vllm:prompt_tokens", "vllm:prompt_tokens_total") == usage_p
    assert v("vllm:generation_tokens", "vllm:generation_tokens_total") == usage_c
    ok = "vllm:request_success_total"
    assert v("vllm:request_success", ok) == n_seqs
    for reason in ("stop", "length"):
        assert v("vllm:request_success", ok, finished_reason=reason) == finishes.count(reason)
    assert v("vllm:request_success", ok, finished_reason="abort") == 0
    for h in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens"):
        assert v(h, h + "_count") == n_seqs, h
        assert v(h, h + "_bucket", le="+Inf") == n_seqs, h
    assert v("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == usage_c
    assert v("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 6 + 6 + 5 + 4 + 4
    # one gap per generated token after a sequence's first
    itl = "vllm:inter_token_latency_seconds"
    assert v(itl, itl + "_count") == usage_c - n_seqs
    assert v("vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_count") == usage_c - n_seqs
    assert v("vllm:request_params_n", "vllm:request_params_n_count") == n_prompts
    assert v("vllm:request_params_n", "vllm:request_params_n_sum") == 1 + 1 + 1 + 2
    # tokens fed to the model: the prompts' computed tokens plus every generated token but each
    # sequence's last; speculating, each verify step's rows instead: the fed token and its drafts
    it = "vllm:iteration_tokens_total"
    prefill = v("dsuf_prefill_tokens", "dsuf_prefill_tokens_total", model_name=model)
    assert prefill == usage_p  # no state cache here: every prompt token computed, once per prompt
    spec = {f: v(f, s, model_name=model) if f in fams else 0.0  # (families a plain server may not show)
            for f, s in (("dsuf_spec_acceptance_length", "dsuf_spec_acceptance_length_count"),
                         ("dsuf_spec_drafted_tokens", "dsuf_spec_drafted_tokens_total"))}
    verify_steps, drafted = spec["dsuf_spec_acceptance_length"], spec["dsuf_spec_drafted_tokens"]
    if speculative == "off":
        assert verify_steps == drafted == 0
        assert v(it, it + "_sum") == prefill + usage_c - n_seqs
    else:
        assert verify_steps > 0 and drafted > 0
        assert v(it, it + "_sum") == prefill + verify_steps + drafted
    assert v(it, it + "_count") == v("dsuf_engine_steps", "dsuf_engine_steps_total", model_name=model)
    assert v("vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    ttft_bounds = sorted(float(s.labels["le"]) for s in fams["vllm:time_to_first_token_seconds"].samples
                         if s.name.endswith("_bucket"))
    assert ttft_bounds == [*TTFT_BUCKETS, float("inf")]
    # idle: the gauges are back at 0
    for g in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert v(g) == 0, g
    assert v("dsuf_requests", "dsuf_requests_total", model_name=model) == n_seqs
    assert v("dsuf_batch_capacity") == 32
    # the families live in this server's registry, not the process-wide default one
    assert REGISTRY.get_sample_value("vllm:prompt_tokens_total", {"model_name": model, "engine": "0"}) is None


class _Stream:
    """A streaming chat request over a bare socket, so the test decides when the client leaves."""

    def __init__(self, port: int, model: str, i: int):
        body = {"model": model, "messages": [{"role": "user", "content": f"Write a long module {i}."}],
                "max_tokens": 5000, "ignore_eos": True, "temperature": 0, "stream": True}
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()

    def tokens(self, k: int) -> None:
        while k > 0:
            line = self.resp.fp.readline()
            assert line, "stream ended"
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                k -= "role" not in delta and bool(delta.get("content"))

    def close(self) -> None:
        self.conn.close()


def test_gauges_while_busy_keda_waiting_and_back_to_zero(make_server):
    s = make_server(max_batch=1, max_queue=2, keepalive_s=0.1)
    model = _model_id(s)
    g = lambda name: _value(_families(s), name)  # noqa: E731
    a = _Stream(s.port, model, 1)
    a.tokens(3)
    b = _Stream(s.port, model, 2)  # waits for a's slot
    # the query KEDA examples scale on: vllm:num_requests_waiting{model_name=...}
    assert _wait_for(lambda: _value(_families(s), "vllm:num_requests_waiting", model_name=model) == 1)
    fams = _families(s)
    assert _value(fams, "vllm:num_requests_running") == 1
    usage = _value(fams, "vllm:kv_cache_usage_perc")
    assert 0 < usage <= 1
    assert _value(fams, "vllm:gpu_cache_usage_perc") == usage
    a.tokens(20)  # the state grows with the sequence
    assert g("vllm:kv_cache_usage_perc") > usage
    a.close()
    b.close()
    assert _wait_for(lambda: g("vllm:num_requests_running") == 0 and g("vllm:num_requests_waiting") == 0)
    fams = _families(s)
    assert _value(fams, "vllm:kv_cache_usage_perc") == 0
    assert _value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 2
    assert _value(fams, "dsuf_requests", "dsuf_requests_total", finish_reason="cancelled") == 2


def test_http_errors_and_separate_registries(make_server):
    s1, s2 = make_server(), make_server()
    model = _model_id(s1)
    req = urllib.request.Request(s1.base + "/v1/chat/completions", method="POST",
                                 data=json.dumps({"model": "nope", "messages": []}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("expected an error status")
    except urllib.error.HTTPError as e:
        status = e.code
    assert status in (400, 404)
    _client(s1).completions.create(model=model, prompt="x", max_tokens=2)
    f1, f2 = _families(s1), _families(s2)
    assert _value(f1, "dsuf_http_errors", "dsuf_http_errors_total", model_name=model, status=str(status)) == 1
    assert _value(f2, "dsuf_http_errors", "dsuf_http_errors_total") == 0
    assert _value(f1, "vllm:generation_tokens", "vllm:generation_tokens_total") == 2
    assert _value(f2, "vllm:generation_tokens", "vllm:generation_tokens_total") == 0


def test_errors_before_the_model_is_bound_are_kept(engine):
    from server.scheduler import Scheduler

    m = Metrics()
    m.http_errors.inc(status="503")  # answered while the model was loading
    m.bind("served-id", Scheduler(engine, m), engine, context_len=256)
    m.http_errors.inc(status="503")
    vals = parse_prometheus(m.render().decode(), drop=())
    assert vals['dsuf_http_errors_total{model_name="served-id",status="503"}'] == 2
    assert vals['vllm:num_requests_running{engine="0",model_name="served-id"}'] == 0


def test_state_cache_counts_under_vllm_prefix_cache_names(make_server):
    from kvcache.cache import CacheConfig

    s = make_server(kv=CacheConfig(host_cache_gb=0.25, pin=False))
    model = _model_id(s)
    c = _client(s)
    msgs = [{"role": "user", "content": "Explain what a hash map is, briefly."}]
    prompt = cached = 0
    for _ in range(20):  # the prompt's snapshot is stored off the request path: ask until it is reused
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
        prompt += r.usage.prompt_tokens
        cached += r.usage.prompt_tokens_details.cached_tokens or 0
        if cached:
            break
        time.sleep(0.1)
    assert cached > 0
    fams = _families(s)
    assert _value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == prompt
    assert _value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == cached
    assert _value(fams, "vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_hits_total") == cached
    assert abs(_value(fams, "vllm:gpu_prefix_cache_hit_rate") - cached / prompt) < 1e-9
    assert _value(fams, "dsuf_prefill_tokens", "dsuf_prefill_tokens_total") == prompt - cached
    assert _value(fams, "vllm:cache_config_info", enable_prefix_caching="True") == 1
    # the state cache's own families, with the same model label
    assert _value(fams, "dsuf_kvcache_hits", "dsuf_kvcache_hits_total", model_name=model, source="local") == 1
    assert _value(fams, "dsuf_kvcache_snapshots", "dsuf_kvcache_snapshots_total", model_name=model) >= 1
    assert _value(fams, "dsuf_kvcache_entries", model_name=model) >= 1
    assert _value(fams, "dsuf_kvcache_fetch_seconds", "dsuf_kvcache_fetch_seconds_count", model_name=model) == 0
