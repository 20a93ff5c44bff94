"""Malformed and hostile requests: each gets the right 4xx as OpenAI error JSON, and the server
keeps serving everyone else."""

from __future__ import annotations

import http.client
import json

import pytest

MODEL = "demo-v41"
MSGS = [{"role": "user", "content": "hi"}]


def _chat(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 2, **kw}).encode()


def _raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (id, path, body bytes, expected status, expected param or code substring or None)
CASES = [
    ("bad-json", "/v1/chat/completions", b'{"model": "demo-v41", "messages": [', 400, None),
    ("json-array", "/v1/chat/completions", b"[1, 2, 3]", 400, None),
    ("empty-body", "/v1/chat/completions", b"", 400, None),
    ("invalid-utf8", "/v1/chat/completions",
     b'{"model": "demo-v41", "messages": [{"role": "user", "content": "\xff\xfe\xc0"}]}', 400, None),
    ("no-messages", "/v1/chat/completions", json.dumps({"model": MODEL}).encode(), 400, "messages"),
    ("empty-messages", "/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("messages-string", "/v1/chat/completions", _chat(messages="hello"), 400, "messages"),
    ("message-not-object", "/v1/chat/completions", _chat(messages=[42]), 400, "messages"),
    ("unknown-role", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages"),
    ("content-number", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), 400, None),
    ("content-image", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, None),
    ("negative-temperature", "/v1/chat/completions", _chat(temperature=-0.5), 400, "temperature"),
    ("temperature-string", "/v1/chat/completions", _chat(temperature="hot"), 400, "temperature"),
    ("temperature-nan", "/v1/chat/completions",
     b'{"model": "demo-v41", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
    ("top-p-zero", "/v1/chat/completions", _chat(top_p=0), 400, "top_p"),
    ("top-p-big", "/v1/chat/completions", _chat(top_p=1.5), 400, "top_p"),
    ("max-tokens-negative", "/v1/chat/completions", _chat(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-string", "/v1/chat/completions", _chat(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-float", "/v1/chat/completions", _chat(max_tokens=10.5), 400, "max_tokens"),
    ("max-tokens-infinite", "/v1/chat/completions",
     b'{"model": "demo-v41", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}', 400,
     "max_tokens"),
    ("max-tokens-bool", "/v1/chat/completions", _chat(max_tokens=True), 400, "max_tokens"),
    ("n-zero", "/v1/chat/completions", _chat(n=0), 400, "n"),
    ("n-huge", "/v1/chat/completions", _chat(n=100000), 400, "n"),
    ("stop-number", "/v1/chat/completions", _chat(stop=123), 400, "stop"),
    ("stop-too-many", "/v1/chat/completions", _chat(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    ("presence-out-of-range", "/v1/chat/completions", _chat(presence_penalty=5), 400, "presence_penalty"),
    ("seed-string", "/v1/chat/completions", _chat(seed="abc"), 400, "seed"),
    ("logprobs-string", "/v1/chat/completions", _chat(logprobs="yes"), 400, "logprobs"),
    ("top-logprobs-huge", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("logit-bias-garbage", "/v1/chat/completions", _chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("tools-string", "/v1/chat/completions", _chat(tools="garbage"), 400, "tools"),
    ("tools-bad-name", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "rm -rf /"}}]), 400, "tools"),
    ("tools-schema-garbage", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]), 400, "tools"),
    ("tools-no-function", "/v1/chat/completions", _chat(tools=[{"type": "function"}]), 400, "tools"),
    ("tool-choice-unknown", "/v1/chat/completions",
     _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("tool-choice-garbage", "/v1/chat/completions", _chat(tools=[TOOL], tool_choice=7), 400, "tool_choice"),
    ("assistant-tool-calls-garbage", "/v1/chat/completions", _chat(messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": "nope"}]), 400,
     None),
    ("stream-options-garbage", "/v1/chat/completions", _chat(stream=True, stream_options="yes"), 400,
     "stream_options"),
    ("stream-not-bool", "/v1/chat/completions", _chat(stream="yes"), 400, "stream"),
    ("response-format-unknown", "/v1/chat/completions", _chat(response_format={"type": "xml"}), 400,
     "response_format"),
    ("thinking-garbage", "/v1/chat/completions", _chat(thinking={"type": "maybe"}), 400, "thinking"),
    ("reasoning-effort-unknown", "/v1/chat/completions", _chat(reasoning_effort="ultra"), 400,
     "reasoning_effort"),
    ("deeply-nested-json", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, 400, None),
    ("user-not-string", "/v1/chat/completions", _chat(user=["x"]), 400, "user"),
    ("model-not-string", "/v1/chat/completions", _chat(model=["demo-v41"]), 400, "model"),
    ("unknown-model", "/v1/chat/completions", _chat(model="gpt-17"), 404, "model_not_found"),
    ("completion-prompt-number", "/v1/completions", json.dumps({"model": MODEL, "prompt": 123}).encode(), 400,
     "prompt"),
    ("completion-token-out-of-range", "/v1/completions",
     json.dumps({"model": MODEL, "prompt": [1, 2, 99999999]}).encode(), 400, "prompt"),
    ("completion-empty-prompt-list", "/v1/completions", json.dumps({"model": MODEL, "prompt": []}).encode(), 400,
     "prompt"),
    # ranges the engine cannot take, refused before admission (one request must not fail a batch)
    ("logit-bias-past-int64", "/v1/chat/completions", _chat(logit_bias={str(1 << 70): 5}), 400, "logit_bias"),
    ("logit-bias-past-vocab", "/v1/chat/completions", _chat(logit_bias={"8192": 5}), 400, "logit_bias"),
    ("logit-bias-signed-key", "/v1/chat/completions", _chat(logit_bias={"-1": 5}), 400, "logit_bias"),
    ("logit-bias-arabic-digit", "/v1/chat/completions", _chat(logit_bias={"\u0663": 5}), 400, "logit_bias"),
    ("logit-bias-too-many", "/v1/chat/completions", _chat(logit_bias={str(i): 1 for i in range(2000)}), 400,
     "logit_bias"),
    ("seed-past-uint64", "/v1/chat/completions", _chat(seed=1 << 64), 400, "seed"),
    ("seed-below-int64", "/v1/chat/completions", _chat(seed=-(1 << 63) - 1), 400, "seed"),
    ("top-k-huge", "/v1/chat/completions", _chat(top_k=1 << 40), 400, "top_k"),
    ("stop-string-too-long", "/v1/chat/completions", _chat(stop=["x" * 5000]), 400, "stop"),
    ("best-of-huge", "/v1/chat/completions", _chat(best_of=10**9), 400, "best_of"),
    ("int-5000-digits", "/v1/chat/completions", _chat()[:-1] + b', "seed": ' + b"9" * 5000 + b"}", 400, None),
]


@pytest.mark.parametrize("path,body,status,hint", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(server, path, body, status, hint):
    got, headers, raw = _raw(server, "POST", path, body)
    assert got == status, raw[:300]
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert err["type"] == "invalid_request_error"
    if hint is not None:
        assert hint in (err["param"] or "", err["code"] or ""), err


@pytest.mark.parametrize("text,depth", [
    ('{"a": [1, {"b": []}]}', 3),
    ('"[[[[" ' * 100, 0),  # brackets inside strings do not nest
    ('["\\\\", ' + "[" * 300 + "]" * 300 + "]", 301),  # an escaped backslash ends before the quote
    ('["\\"' + "[" * 300 + '"]', 1),  # an escaped quote does not end the string
])
def test_json_depth(text, depth):
    from server.protocol import MAX_JSON_DEPTH, json_depth

    big = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    assert json_depth(text.encode()) == (depth if big else 0)


def test_nesting_at_the_limit_parses():
    from server.protocol import MAX_JSON_DEPTH, parse_body

    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_body(deep.encode())
    with pytest.raises(Exception, match="nested deeper"):
        parse_body(("[" + deep + "]").encode())


def test_ten_megabyte_body(server):
    body = _chat(messages=[{"role": "user", "content": "A" * (10 << 20)}])
    got, _, raw = _raw(server, "POST", "/v1/chat/completions", body)
    assert got == 413
    assert json.loads(raw)["error"]["code"] == "request_too_large"


def test_unknown_route_and_method(server):
    got, _, raw = _raw(server, "POST", "/v1/nope", b"{}")
    assert got == 404 and "error" in json.loads(raw)
    got, headers, raw = _raw(server, "GET", "/v1/chat/completions")
    assert got == 405 and "error" in json.loads(raw)


def test_corrupt_gzip_and_non_utf8_authorization(server, make_server):
    got, _, raw = _raw(server, "POST", "/v1/chat/completions", b"\x1f\x8b\x08\x00garbage" * 4,
                       {"Content-Encoding": "gzip"})
    assert got == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    s = make_server(api_key="k")
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Authorization", b"Bearer \xff\xfe")
    conn.putheader("Content-Length", str(len(_chat())))
    conn.endheaders(_chat())
    r = conn.getresponse()
    assert r.status == 401 and json.loads(r.read())["error"]["code"] == "invalid_api_key"
    conn.close()


def test_parser_errors_are_openai_json(server):
    import socket

    for raw in (b"GE(T / HTTP/1.1\r\nHost: x\r\n\r\n", b"GET / HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(raw)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        assert head.split()[1].startswith(b"4") and b"application/json" in head, head
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_server_still_serves_after_abuse(server):
    for _, path, body, _, _ in CASES[:10]:
        _raw(server, "POST", path, body)
    got, _, raw = _raw(server, "POST", "/v1/chat/completions", _chat(max_tokens=3, temperature=0))
    assert got == 200
    assert json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")
    assert _raw(server, "GET", "/readyz")[0] == 200
