"""Speculative decoding through the server (server/speculate.py): a random tiny V4.1 checkpoint
with draft layers, served with `speculative` dspark and off. Greedy outputs are identical to each
other and to Engine.generate's plain decoding under concurrent streams, max_tokens and stop
strings that end inside a block give the plain path's tokens, the metrics counters move, and a
streamed request carries the same text.

A random draft rarely agrees with a random main model, so the tests that need multi-token steps
use a second engine whose draft always proposes one token X (its Markov head edited in memory, as
in tests/unit/test_speculative_decode.py) and steer the main model to X with logit_bias.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import numpy as np
import pytest

from engine.checkpoint.tiny_model import write_tiny_model
from engine.runtime.engine import Engine
from engine.runtime.sampling import SamplingParams
from server.metrics import parse_prometheus
from tests.conftest import ServerThread
from tests.unit.spec_drafts import proposing

SIZES = dict(layers=4, hidden=128, heads=2, head_dim=64, q_lora=64, o_lora=64, moe_inter=64, experts=4,
             vocab=1024, window=8, index_topk=4, index_heads=4, index_head_dim=32, candidate_blocks=2,
             engram_vocab=200, markov_rank=16, draft_layers=2, draft_experts=4)
X = 777  # the token the agreeing draft proposes
BIAS = {str(X): 100}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed + n).integers(10, 1000, size=n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("spec_srv"), "v41", seed=21, draft=True, **SIZES)


@pytest.fixture(scope="module")
def tiny(ckpt) -> Engine:
    return Engine.load(ckpt)


@pytest.fixture(scope="module")
def agreeing(ckpt) -> Engine:
    return proposing(ckpt, X)


def _servers(eng: Engine):
    """A speculating server and a plain one on the same engine, shut down after the module."""
    on, off = ServerThread(eng, speculative="dspark"), ServerThread(eng, speculative="off")
    yield on, off
    on.shutdown()
    off.shutdown()


@pytest.fixture(scope="module")
def tiny_servers(tiny):
    yield from _servers(tiny)


@pytest.fixture(scope="module")
def agreeing_servers(agreeing):
    yield from _servers(agreeing)


def _post(srv, body: dict) -> dict:
    req = urllib.request.Request(srv.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def _model(srv) -> str:
    with urllib.request.urlopen(srv.base + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def _complete(srv, prompt: list[int], max_tokens: int, **kw) -> dict:
    body = {"model": _model(srv), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **kw}
    return _post(srv, body)["choices"][0]


def _metrics(srv) -> dict[str, float]:
    with urllib.request.urlopen(srv.base + "/metrics", timeout=30) as r:
        return parse_prometheus(r.read().decode())


def _stream_text(srv, prompt: list[int], max_tokens: int, **kw) -> tuple[str, str | None]:
    body = {"model": _model(srv), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **kw}
    req = urllib.request.Request(srv.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    text, finish = "", None
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                text += c.get("text") or ""
                finish = c.get("finish_reason") or finish
    return text, finish


def test_speculative_mode_checks(tiny, tmp_path) -> None:
    from server.metrics import Metrics
    from server.scheduler import Scheduler

    assert Scheduler(tiny, Metrics()).spec.enabled  # default: dspark where the checkpoint has draft layers
    assert not Scheduler(tiny, Metrics(), speculative="off").spec.enabled
    assert Scheduler(Engine.load(None), Metrics()).spec.enabled  # the demo ships a trained draft
    plain = Engine.load(write_tiny_model(tmp_path / "plain", "v41", seed=3))
    assert not Scheduler(plain, Metrics()).spec.enabled
    with pytest.raises(ValueError, match="draft layers"):
        Scheduler(plain, Metrics(), speculative="dspark")


def test_greedy_equal_under_concurrent_streams(tiny, tiny_servers) -> None:
    on, off = tiny_servers
    prompts = [_prompt(n, seed) for seed in (0, 1) for n in (3, 9, 17, 30, 45, 60)]  # 12 streams
    max_tokens = 20
    before = _metrics(on)
    outs = []
    for srv in (on, off):
        got: list = [None] * len(prompts)

        def one(i: int, srv=srv, got=got) -> None:
            # odd ones ask for logprobs (reported from their verify rows)
            c = _complete(srv, prompts[i], max_tokens, **({"logprobs": 1} if i % 2 else {}))
            got[i] = (c["prompt_token_ids"], c["token_ids"])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        outs.append(got)
    # the server's prompt (its BOS first) decoded alone by the engine, plainly
    plain = [(p, tiny.generate(p, max_tokens, SamplingParams(temperature=0.0), speculative=False))
             for p, _ in outs[1]]
    assert outs[0] == outs[1] == plain
    assert any(len(t) == max_tokens for _, t in plain)
    after = _metrics(on)
    assert after["dsuf_spec_drafted_tokens_total"] > before.get("dsuf_spec_drafted_tokens_total", 0)
    assert after["vllm:spec_decode_num_drafts_total"] > before.get("vllm:spec_decode_num_drafts_total", 0)
    assert after["dsuf_spec_acceptance_length_count"] > before.get("dsuf_spec_acceptance_length_count", 0)
    assert _metrics(off).get("dsuf_spec_drafted_tokens_total", 0) == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 8, 13])
def test_multi_token_steps_and_max_tokens_inside_a_block(agreeing, agreeing_servers, max_tokens) -> None:
    on, off = agreeing_servers
    prompt = _prompt(11)
    before = _metrics(on)
    a = _complete(on, prompt, max_tokens, logit_bias=BIAS)
    b = _complete(off, prompt, max_tokens, logit_bias=BIAS)
    plain = agreeing.generate(b["prompt_token_ids"], max_tokens,
                              SamplingParams(temperature=0.0, logit_bias=((X, 100.0),)), speculative=False)
    assert a["token_ids"] == b["token_ids"] == plain
    assert a["finish_reason"] == b["finish_reason"] == ("length" if len(plain) == max_tokens else "stop")
    after = _metrics(on)
    if max_tokens > 2:  # a verify step kept drafts
        assert after["dsuf_spec_accepted_tokens_total"] - before.get("dsuf_spec_accepted_tokens_total", 0) \
            == max_tokens - 2 - (max_tokens - 2) // 6
        assert after["vllm:spec_decode_num_accepted_tokens_total"] == after["dsuf_spec_accepted_tokens_total"]


def test_stop_string_inside_a_block_and_streaming(agreeing, agreeing_servers) -> None:
    on, off = agreeing_servers
    prompt = _prompt(7)
    piece = agreeing.tokenizer.decode([X])
    assert piece
    stop = piece * 3
    a = _complete(on, prompt, 20, logit_bias=BIAS, stop=[stop])
    b = _complete(off, prompt, 20, logit_bias=BIAS, stop=[stop])
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert a["finish_reason"] == b["finish_reason"] == "stop"
    assert 3 <= len(a["token_ids"]) < 7  # ended inside the first verify step's block
    text_on, fin_on = _stream_text(on, prompt, 16, logit_bias=BIAS)
    text_off, fin_off = _stream_text(off, prompt, 16, logit_bias=BIAS)
    assert text_on == text_off == _complete(off, prompt, 16, logit_bias=BIAS)["text"]
    assert fin_on == fin_off == "length"


def test_agreeing_draft_under_concurrent_streams(agreeing_servers) -> None:
    """Sequences keeping whole blocks, ending at different places inside them, side by side."""
    on, off = agreeing_servers
    cases = [(_prompt(n, 5), m) for n, m in zip((2, 6, 10, 14, 19, 23, 31, 40), (3, 7, 8, 9, 12, 14, 15, 20),
                                               strict=True)]
    outs = []
    for srv in (on, off):
        got: list = [None] * len(cases)

        def one(i: int, srv=srv, got=got) -> None:
            got[i] = _complete(srv, cases[i][0], cases[i][1], logit_bias=BIAS)["token_ids"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        outs.append(got)
    assert outs[0] == outs[1]
    assert [len(t) for t in outs[0]] == [m for _, m in cases]


def _post_to(srv, path: str, body: dict) -> dict:
    req = urllib.request.Request(srv.base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def _stream_chunks(srv, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(srv.base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _streamed_logprobs(chunks: list[dict]) -> dict[int, dict[str, list]]:
    """Per choice index: completions' logprobs lists, concatenated over the stream's chunks."""
    got: dict[int, dict[str, list]] = {}
    for ch in chunks:
        for c in ch.get("choices", []):
            lp = c.get("logprobs")
            if lp:
                acc = got.setdefault(c["index"], {"tokens": [], "token_logprobs": [], "top_logprobs": []})
                for k in acc:
                    acc[k] += lp[k]
    return got


@pytest.mark.parametrize("which", ["tiny", "agreeing"])
def test_logprobs_equal_to_plain(which, request) -> None:
    """Each emitted token's logprob and top_logprobs, streamed or not, equal plain decoding's bit for
    bit (the numpy backend's rows do not depend on the chunk they run in); usage counts too."""
    on, off = request.getfixturevalue(f"{which}_servers")
    bias = BIAS if which == "agreeing" else {}
    before = _metrics(on)
    for n, max_tokens in ((5, 14), (23, 9)):
        body = {"model": _model(on), "prompt": _prompt(n, 3), "max_tokens": max_tokens, "temperature": 0,
                "logprobs": 5, "logit_bias": bias, "return_token_ids": True}
        a, b = (_post_to(srv, "/v1/completions", body) for srv in (on, off))
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
        assert len(a["choices"][0]["logprobs"]["token_logprobs"]) == len(a["choices"][0]["token_ids"])
        assert a["usage"] == b["usage"]
        sa, sb = (_streamed_logprobs(_stream_chunks(srv, "/v1/completions", body)) for srv in (on, off))
        assert sa == sb == {0: {k: a["choices"][0]["logprobs"][k] for k in sa[0]}}
    chat = {"model": _model(on), "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 10,
            "temperature": 0, "logprobs": True, "top_logprobs": 3, "logit_bias": bias}
    a, b = (_post_to(srv, "/v1/chat/completions", chat) for srv in (on, off))
    assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"] and a["usage"] == b["usage"]
    assert all(len(e["top_logprobs"]) == 3 for e in a["choices"][0]["logprobs"]["content"])
    after = _metrics(on)
    assert after["dsuf_spec_drafted_tokens_total"] > before.get("dsuf_spec_drafted_tokens_total", 0)
    if which == "agreeing":  # multi-token steps reported their logprobs
        assert after["dsuf_spec_accepted_tokens_total"] > before.get("dsuf_spec_accepted_tokens_total", 0)


def _choices(resp: dict) -> list[dict]:
    return sorted(resp["choices"], key=lambda c: c["index"])


@pytest.mark.parametrize("which", ["tiny", "agreeing"])
def test_n_choices_greedy_equal_to_plain(which, request) -> None:
    """n = 3 greedy: every choice speculates (forking choice 0's state and draft state at the
    prompt's end) and equals plain decoding's, logprobs included; usage counts equal."""
    on, off = request.getfixturevalue(f"{which}_servers")
    bias = BIAS if which == "agreeing" else {}
    before = _metrics(on)
    body = {"model": _model(on), "prompt": _prompt(13, 4), "max_tokens": 11, "temperature": 0, "n": 3,
            "logprobs": 2, "logit_bias": bias, "return_token_ids": True}
    a, b = (_post_to(srv, "/v1/completions", body) for srv in (on, off))
    ca, cb = _choices(a), _choices(b)
    assert [c["token_ids"] for c in ca] == [c["token_ids"] for c in cb] == [cb[0]["token_ids"]] * 3
    assert [c["logprobs"] for c in ca] == [c["logprobs"] for c in cb]
    assert a["usage"] == b["usage"]
    assert a["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in ca)
    after = _metrics(on)
    # every choice ran verify steps (each emits at least one token per step past its first)
    steps = after["dsuf_spec_acceptance_length_count"] - before.get("dsuf_spec_acceptance_length_count", 0)
    assert steps >= 3
    if which == "agreeing":
        assert after["dsuf_spec_accepted_tokens_total"] - before.get("dsuf_spec_accepted_tokens_total", 0) \
            >= 3 * (11 - 2 - 9 // 6)


def test_n_choices_seeded_sampling_reproducible(tiny_servers) -> None:
    """n = 3 seeded sampling with speculation: two identical requests give the same choices, choice 0
    is the same seeded n = 1 request's tokens (each choice's generator depends on (seed, index)
    only), and the usage counts the tokens."""
    on, _ = tiny_servers
    body = {"model": _model(on), "prompt": _prompt(9, 6), "max_tokens": 12, "temperature": 0.9, "top_p": 0.95,
            "seed": 1234, "return_token_ids": True}
    first, again = (_post_to(on, "/v1/completions", {**body, "n": 3}) for _ in range(2))
    one = _post_to(on, "/v1/completions", body)
    toks = [c["token_ids"] for c in _choices(first)]
    assert toks == [c["token_ids"] for c in _choices(again)]
    assert toks[0] == one["choices"][0]["token_ids"]
    assert len({tuple(t) for t in toks}) > 1  # the choices draw their own tokens
    assert first["usage"]["completion_tokens"] == sum(map(len, toks))
    assert first["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    streamed = _stream_chunks(on, "/v1/completions", {**body, "n": 3})
    text = {}
    for ch in streamed:
        for c in ch.get("choices", []):
            text[c["index"]] = text.get(c["index"], "") + (c.get("text") or "")
    assert [text[i] for i in range(3)] == [c["text"] for c in _choices(first)]


# Constrained decoding: literal stretches of a grammar (keys, an enum's value, DSML markup) leave one
# allowed token a position, so the masked draft proposes it and verify keeps it.
STATION = {"type": "object", "properties": {
    "weather_station_identifier": {"enum": ["north-ridge-observatory", "south"]},
    "temperature_celsius": {"type": "integer", "minimum": -50, "maximum": 60}, "ok": {"type": "boolean"}},
    "required": ["weather_station_identifier", "temperature_celsius", "ok"], "additionalProperties": False}
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
GUIDED = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": STATION}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "required": {"tools": WEATHER_TOOLS, "tool_choice": "required"},
    "named": {"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
}


def _chat(srv, **kw) -> dict:
    body = {"model": _model(srv), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "temperature": 0, "logprobs": True, **kw}
    return _post_to(srv, "/v1/chat/completions", body)


def _answer(resp: dict) -> list:
    """What a choice says, tool call ids (random per response) left out."""
    out = []
    for c in _choices(resp):
        msg = dict(c["message"])
        msg["tool_calls"] = [t["function"] for t in msg.get("tool_calls") or []]
        out.append((msg, c["finish_reason"], c["logprobs"]))
    return out


@pytest.mark.parametrize("kind", sorted(GUIDED))
def test_guided_greedy_equal_to_plain(tiny_servers, kind) -> None:
    """Greedy constrained requests speculate (the draft masked by the grammar, verify's masks per
    position) and give plain decoding's tokens, logprobs and usage, streamed and not, n = 2 too."""
    on, off = tiny_servers
    before = _metrics(on)
    a, b = (_chat(srv, **GUIDED[kind]) for srv in (on, off))
    assert _answer(a) == _answer(b) and a["usage"] == b["usage"]
    content = [e["token"] for e in a["choices"][0]["logprobs"]["content"]]
    assert len(content) == a["usage"]["completion_tokens"]
    after = _metrics(on)
    assert after["dsuf_spec_drafted_tokens_total"] > before.get("dsuf_spec_drafted_tokens_total", 0)
    if kind != "json_object":  # the grammar's literal stretches were drafted and kept
        assert after["dsuf_spec_accepted_tokens_total"] - before.get("dsuf_spec_accepted_tokens_total", 0) >= 5
    if kind == "json_schema":
        assert a["choices"][0]["message"]["content"].startswith('{"weather_station_identifier": "')
    if kind in ("required", "named"):
        assert a["choices"][0]["message"]["tool_calls"] or a["choices"][0]["finish_reason"] == "length"
    two = {**GUIDED[kind], "n": 2}
    a2, b2 = (_chat(srv, **two) for srv in (on, off))
    assert _answer(a2) == _answer(b2) == _answer(b) * 2 and a2["usage"] == b2["usage"]
    sa, sb = (_stream_chunks(srv, "/v1/chat/completions", {
        "model": _model(srv), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
        "temperature": 0, "logprobs": True, **GUIDED[kind]}) for srv in (on, off))
    def strip(chunks: list[dict]) -> list:  # noqa: E306 - ids and timestamps differ per response
        return [[{k: v for k, v in c.items() if k != "delta"} | {"delta": _no_ids(c.get("delta"))}
                 for c in ch.get("choices", [])] for ch in chunks]
    assert strip(sa) == strip(sb)


def _no_ids(delta: dict | None) -> dict | None:
    if not delta or not delta.get("tool_calls"):
        return delta
    return {**delta, "tool_calls": [{k: v for k, v in t.items() if k != "id"} for t in delta["tool_calls"]]}


def test_guided_thinking_and_sampling(agreeing_servers, tiny_servers) -> None:
    """Reasoning runs free before the grammar starts (the agreeing draft's blocks are kept there);
    seeded sampled constrained requests reproduce, and their answers follow the grammar."""
    on, off = agreeing_servers
    before = _metrics(on)
    kw = {**GUIDED["json_schema"], "thinking": {"type": "enabled"}, "logit_bias": BIAS, "max_tokens": 14}
    a, b = _chat(on, **kw), _chat(off, **kw)
    assert _answer(a) == _answer(b) and a["usage"] == b["usage"]
    assert _metrics(on)["dsuf_spec_accepted_tokens_total"] - before.get("dsuf_spec_accepted_tokens_total", 0) >= 8
    on, _ = tiny_servers
    kw = {**GUIDED["json_schema"], "temperature": 1.0, "seed": 5, "max_tokens": 60, "n": 2}
    a, again = _chat(on, **kw), _chat(on, **kw)
    assert _answer(a) == _answer(again)
    for c in _choices(a):
        text = c["message"]["content"]
        assert text.startswith('{"weather_station_identifier": "')
        if c["finish_reason"] == "stop":
            assert json.loads(text).keys() == STATION["properties"].keys()


def test_default_mode_stops_speculating_where_it_does_not_pay(tiny, tiny_servers) -> None:
    """With no --speculative, a sequence whose acceptance after its first WARMUP_STEPS verify steps
    is at or below the backend's breakeven (measured: spec_cost.measure) decodes plainly from its
    next step, and its tokens stay plain decoding's. The random draft rarely agrees with the random
    main model, so its acceptance stays near 1, below the breakeven of any backend whose verify
    step costs more than a 1-token step. Forced with --speculative dspark, it never stops."""
    from engine.runtime.spec_cost import WARMUP_STEPS
    from server.app import STATE

    srv = ServerThread(tiny)
    try:
        prompt, n = _prompt(9, 3), 3 * WARMUP_STEPS
        before = _metrics(srv)
        c = _complete(srv, prompt, n, ignore_eos=True)
        after = _metrics(srv)
        breakeven = srv.app[STATE].scheduler.spec.breakeven()
    finally:
        srv.shutdown()
    # (the server's prompt, its BOS first, decoded alone by the engine, plainly)
    assert c["token_ids"] == tiny.generate(c["prompt_token_ids"], n, SamplingParams(temperature=0.0),
                                           stop_at_eos=False, speculative=False)
    steps = after["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0)
    emitted = after["dsuf_spec_acceptance_length_sum"] - before.get("dsuf_spec_acceptance_length_sum", 0)
    assert breakeven > 1.0 and emitted <= breakeven * steps
    assert steps == WARMUP_STEPS, "it went on speculating after its acceptance was judged"
    assert after["dsuf_spec_stopped_sequences_total"] - before.get("dsuf_spec_stopped_sequences_total", 0) == 1
    on, _ = tiny_servers
    b0 = _metrics(on)
    _complete(on, prompt, n, ignore_eos=True)
    b1 = _metrics(on)
    assert b1["vllm:spec_decode_num_drafts_total"] - b0["vllm:spec_decode_num_drafts_total"] > WARMUP_STEPS
    assert b1.get("dsuf_spec_stopped_sequences_total", 0) == b0.get("dsuf_spec_stopped_sequences_total", 0)


def test_default_mode_speculates_on_if_the_breakeven_cannot_be_measured(tiny, monkeypatch, caplog) -> None:
    """A failed measurement is logged and leaves every sequence speculating (as --speculative
    dspark), never a failed request."""
    import server.speculate as spec_mod

    def broken(*_a, **_k):
        raise RuntimeError("no timer")

    monkeypatch.setattr(spec_mod.spec_cost, "measure", broken)
    srv = ServerThread(tiny)
    try:
        with caplog.at_level("ERROR", logger="dsuf.speculate"):
            before = _metrics(srv)
            c = _complete(srv, _prompt(9, 3), 24, ignore_eos=True)
            after = _metrics(srv)
    finally:
        srv.shutdown()
    assert c["token_ids"] == tiny.generate(c["prompt_token_ids"], 24, SamplingParams(temperature=0.0),
                                           stop_at_eos=False, speculative=False)
    assert after.get("dsuf_spec_stopped_sequences_total", 0) == before.get("dsuf_spec_stopped_sequences_total", 0)
    assert any("breakeven failed" in r.getMessage() for r in caplog.records)
