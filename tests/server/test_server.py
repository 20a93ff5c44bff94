"""The OpenAI-compatible server over real HTTP on loopback, with the real demo-v41 engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import openai
import pytest

from engine.text.chat_encoding import encode_messages

ROOT = Path(__file__).resolve().parents[2]
MODEL = "deepseek-v4.1-flash"  # the demo checkpoint's canonical id


def _client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                         timeout=120, **kw)


def _post(server, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _get(server, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(server.base + path, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _chat_ids(engine, messages, thinking=False, **kw) -> list[int]:
    text = encode_messages(messages, arch=engine.config.arch, thinking=thinking, **kw)
    return engine.tokenizer.encode(text)


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- basics


def test_models_health_ready_metrics(server):
    status, body = _get(server, "/v1/models")
    assert status == 200
    data = json.loads(body)["data"]
    assert [m["id"] for m in data] == [MODEL]
    assert _client(server).models.list().data[0].id == MODEL
    assert _get(server, "/healthz")[0] == 200
    status, body = _get(server, "/readyz")
    assert status == 200 and json.loads(body)["status"] == "ready"
    status, text = _get(server, "/metrics")
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_count", "vllm:prefix_cache_hits_total"):
        assert name in text


def test_chat_nonstreaming_openai_client(server, engine):
    msgs = _msgs("Parse a CSV line.")
    r = _client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    ids = _chat_ids(engine, msgs)
    ref = engine.generate(ids, 12)
    assert c.message.content == engine.tokenizer.decode([t for t in ref if t not in engine.eos_ids])
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref)
    assert r.usage.total_tokens == len(ids) + len(ref)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_openai_client(server, engine):
    msgs = _msgs("Write a function that reverses a list.")
    stream = _client(server).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    ref = engine.generate(_chat_ids(engine, msgs), 12)
    assert text == engine.tokenizer.decode([t for t in ref if t not in engine.eos_ids])
    assert usage.completion_tokens == len(ref)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0


# ---------------------------------------------------------------- greedy == engine, alone and batched


def _greedy_ids_over_http(server, msgs, max_tokens):
    status, body = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    return body["prompt_token_ids"], body["choices"][0]["token_ids"]


def test_greedy_equals_engine_alone(server, engine):
    msgs = _msgs("Read a JSON config file and merge it with defaults.")
    prompt, out = _greedy_ids_over_http(server, msgs, 24)
    assert prompt == _chat_ids(engine, msgs)
    assert out == engine.generate(prompt, 24)


def test_greedy_equals_engine_with_8_concurrent_streams(server, engine):
    msgs = _msgs("Read a JSON config file and merge it with defaults.")
    ref = engine.generate(_chat_ids(engine, msgs), 24)
    errors: list[BaseException] = []
    started = threading.Barrier(9)

    def background(i: int) -> None:
        try:
            client = _client(server)
            started.wait()
            stream = client.chat.completions.create(
                model=MODEL, messages=_msgs(f"Background job {i}: sort numbers {i * 7}"), max_tokens=30,
                temperature=1.0, seed=i, stream=True)
            assert any(ch.choices[0].finish_reason for ch in stream if ch.choices)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=background, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    started.wait()
    _, out = _greedy_ids_over_http(server, msgs, 24)
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert out == ref


def test_completions_endpoint_matches_engine(server, engine):
    prompt = "def add(a, b):"
    ids = [engine.tokenizer.bos_id] + engine.tokenizer.encode(prompt)
    ref = engine.generate(ids, 10)
    ref_text = engine.tokenizer.decode([t for t in ref if t not in engine.eos_ids])
    r = _client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref_text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    stream = _client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == ref_text
    r = _client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, echo=True)
    assert r.choices[0].text == prompt + ref_text


# ---------------------------------------------------------------- sampling parameters


def test_seed_n_and_sampling_params(server):
    client = _client(server)
    kw = dict(model=MODEL, messages=_msgs("Open a socket."), max_tokens=16, temperature=1.0, top_p=0.9,
              seed=1234, extra_body={"top_k": 50, "min_p": 0.01})
    a = client.chat.completions.create(n=3, **kw)
    b = client.chat.completions.create(n=1, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert a.choices[0].message.content == b.choices[0].message.content  # choice 0 doesn't depend on n
    assert len({c.message.content for c in a.choices}) > 1
    assert 3 <= a.usage.completion_tokens <= 3 * 16
    g = client.chat.completions.create(model=MODEL, messages=_msgs("Open a socket."), max_tokens=8,
                                       temperature=0, n=2)
    assert g.choices[0].message.content == g.choices[1].message.content


def test_penalties_change_greedy_output(server):
    client = _client(server)
    base = dict(model=MODEL, messages=_msgs("List prime numbers."), max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**base).choices[0].message.content
    pen = client.chat.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **base)
    assert pen.choices[0].message.content != plain


def test_logprobs(server):
    r = _client(server).chat.completions.create(model=MODEL, messages=_msgs("Hash a password."), max_tokens=8,
                                                temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy picks the top token
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    stream = _client(server).chat.completions.create(
        model=MODEL, messages=_msgs("Hash a password."), max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2, stream=True)
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


# ---------------------------------------------------------------- stop strings, thinking, roles, tools


def test_stop_string_across_token_boundary(server, engine):
    msgs = _msgs("Parse a CSV line.")
    ids = _chat_ids(engine, msgs)
    ref = engine.generate(ids, 20, stop_at_eos=False)
    pieces = [engine.tokenizer.decode([t]) for t in ref]
    full = engine.tokenizer.decode(ref)
    # a stop string made of the end of one token and the start of the next
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
             and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    expected = full[: full.find(stop)]
    client = _client(server)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, stop=stop,
                                            stream=True)
    chunks = [ch for ch in stream if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_thinking_splits_reasoning_at_think_end(server, engine):
    msgs = _msgs("Explain what a closure is.")
    status, body = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": 24, "temperature": 0, "return_token_ids": True,
        "thinking": {"type": "enabled"}, "reasoning_effort": "high"})
    assert status == 200, body
    tok = engine.tokenizer
    assert body["prompt_token_ids"] == _chat_ids(engine, msgs, thinking=True, reasoning_effort="high")
    assert body["prompt_token_ids"][-1] == tok.token_to_id("<think>")
    msg = body["choices"][0]["message"]
    # generated control tokens are dropped, except the first `</think>`, which ends the reasoning
    gen, end = body["choices"][0]["token_ids"], tok.special_ids["think_end"]
    cut = gen.index(end) if end in gen else len(gen)
    reasoning, content = (tok.decode([t for t in p if t not in tok.control_ids]) for p in (gen[:cut], gen[cut + 1:]))
    assert msg["reasoning_content"] == reasoning
    assert (msg["content"] or "") == content
    # streaming: the same split, as reasoning_content deltas
    stream = _client(server).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
        extra_body={"thinking": {"type": "enabled"}, "reasoning_effort": "high"})
    chunks = [ch for ch in stream if ch.choices]
    r = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks)
    c = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert (r, c) == (reasoning, content)
    # disabled: the prompt ends in </think> and there is no reasoning field
    status, body = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": 4, "return_token_ids": True,
        "thinking": {"type": "disabled"}})
    assert body["prompt_token_ids"][-1] == tok.token_to_id("</think>")
    assert "reasoning_content" not in body["choices"][0]["message"]


def test_developer_role_is_system(server, engine):
    def prompt(role):
        status, body = _post(server, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 1, "return_token_ids": True,
            "messages": [{"role": role, "content": "You write Python."}, {"role": "user", "content": "Hi"}]})
        assert status == 200, body
        return body["prompt_token_ids"]

    assert prompt("developer") == prompt("system")


def test_tools_round_trip_is_encoded(server, engine):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"},
    ]
    status, body = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "tools": tools, "tool_choice": "auto", "max_tokens": 6,
        "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    assert body["prompt_token_ids"] == _chat_ids(engine, msgs, tools=tools)
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    # tool_choice "none" leaves the tools out of the prompt
    status, none = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": msgs[:1], "tools": tools, "tool_choice": "none", "max_tokens": 1,
        "return_token_ids": True})
    assert none["prompt_token_ids"] == _chat_ids(engine, msgs[:1])


# ---------------------------------------------------------------- limits


def test_max_tokens_clamped_and_context_exceeded(make_server, engine):
    s = make_server(max_model_len=48)
    msgs = _msgs("Parse a CSV line.")
    n_prompt = len(_chat_ids(engine, msgs))
    status, body = _post(s, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 10**12,
                                                     "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 48 - n_prompt
    status, body = _post(s, "/v1/chat/completions", {"model": MODEL, "messages": _msgs("word " * 60)})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert _get(s, "/v1/models")[1].count('"max_model_len": 48') == 1


def test_api_key(make_server):
    s = make_server(api_key="sekrit")
    with pytest.raises(openai.AuthenticationError):
        _client(s).models.list()
    with pytest.raises(openai.AuthenticationError):
        _client(s, api_key="wrong").chat.completions.create(model=MODEL, messages=_msgs("hi"), max_tokens=1)
    r = _client(s, api_key="sekrit").chat.completions.create(model=MODEL, messages=_msgs("hi"), max_tokens=2)
    assert r.choices[0].message.content is not None
    status, body = _post(s, "/v1/chat/completions", {"model": MODEL, "messages": _msgs("hi")})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert _get(s, "/healthz")[0] == 200 and _get(s, "/readyz")[0] == 200


# ---------------------------------------------------------------- the README's streaming script


def test_stream_demo_script(server):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "stream_demo.py"), "--url", server.base,
                          "--max-tokens", "16", "Write a function that adds two numbers."],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ tokens at [\d.]+ tokens/s \(first token after [\d.]+ s\)", last), last
