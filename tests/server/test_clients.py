"""Stock clients meet the server: model names (canonical id, DeepSeek's family names,
--served-model-name), every OpenAI route without /v1, auth on both forms, /health, the access log."""

from __future__ import annotations

import json
import logging
import time
import urllib.request

import openai
import pytest

MODEL = "deepseek-v4.1-flash"
MSGS = [{"role": "user", "content": "hi"}]


def _req(base: str, method: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _chat(base: str, model: str | None, path: str = "/v1/chat/completions", **kw) -> tuple[int, dict]:
    body = {"messages": MSGS, "max_tokens": 2, "temperature": 0, **kw}
    if model is not None:
        body["model"] = model
    return _req(base, "POST", path, body)


def test_canonical_id_and_family_names(server):
    status, body = _req(server.base, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]
    for name in (MODEL, "deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner", "demo-v41", None):
        status, body = _chat(server.base, name)
        assert status == 200, (name, body)
        assert body["model"] == MODEL  # responses report the served id
    status, body = _req(server.base, "GET", "/v1/models/deepseek-chat")
    assert status == 200 and body["id"] == "deepseek-chat"


def test_unknown_model_404_does_not_echo_unbounded(server):
    name = "no-such-model-" + "x" * 5000
    for path in ("/v1/chat/completions", "/chat/completions"):
        status, body = _chat(server.base, name, path)
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert len(body["error"]["message"]) < 200 and MODEL in body["error"]["message"]
    status, body = _req(server.base, "GET", "/models/" + "y" * 3000)
    assert status == 404 and body["error"]["code"] == "model_not_found" and len(body["error"]["message"]) < 200


def test_reasoner_thinks_by_default_chat_does_not(server):
    _, r = _chat(server.base, "deepseek-reasoner")
    assert "reasoning_content" in r["choices"][0]["message"]
    _, r = _chat(server.base, "deepseek-reasoner", thinking={"type": "disabled"})
    assert "reasoning_content" not in r["choices"][0]["message"]
    _, r = _chat(server.base, "deepseek-chat")
    assert "reasoning_content" not in r["choices"][0]["message"]
    _, r = _chat(server.base, "deepseek-chat", thinking={"type": "enabled"})
    assert "reasoning_content" in r["choices"][0]["message"]


def test_routes_without_v1(server):
    for path in ("/models", "/v1/models"):
        status, body = _req(server.base, "GET", path)
        assert status == 200 and body["data"][0]["id"] == MODEL
    status, body = _req(server.base, "GET", f"/models/{MODEL}")
    assert status == 200 and body["id"] == MODEL
    status, body = _chat(server.base, "deepseek-v4-flash", "/chat/completions")
    assert status == 200 and body["object"] == "chat.completion"
    status, body = _req(server.base, "POST", "/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert status == 200 and body["object"] == "text_completion"
    # the official client pointed at the bare host, as DeepSeek's docs show it
    c = openai.OpenAI(base_url=server.base, api_key="none", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="deepseek-chat", messages=MSGS, max_tokens=2)
    assert r.model == MODEL and r.choices[0].finish_reason == "length"


def test_served_model_name(make_server):
    s = make_server(served_model_names=("my-model", "other"))
    status, body = _req(s.base, "GET", "/v1/models")
    assert [m["id"] for m in body["data"]] == ["my-model", "other"]
    for name in ("other", "my-model", "deepseek-chat"):
        status, body = _chat(s.base, name)
        assert status == 200 and body["model"] == "my-model"
    status, body = _chat(s.base, "nope")
    assert status == 404 and "my-model" in body["error"]["message"]


def test_auth_applies_to_api_routes_with_and_without_v1(make_server):
    s = make_server(api_key="sekrit")
    for method, path, body in (("POST", "/chat/completions", {"model": MODEL, "messages": MSGS}),
                               ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MSGS}),
                               ("POST", "/completions", {"model": MODEL, "prompt": "a"}),
                               ("GET", "/models", None), ("GET", f"/models/{MODEL}", None),
                               ("GET", "/v1/models", None)):
        status, got = _req(s.base, method, path, body)
        assert status == 401 and got["error"]["code"] == "invalid_api_key", path
    status, _ = _req(s.base, "GET", "/models", key="sekrit")
    assert status == 200
    for path in ("/health", "/healthz", "/readyz"):
        assert _req(s.base, "GET", path)[0] == 200, path
    with urllib.request.urlopen(s.base + "/metrics", timeout=30) as r:
        assert r.status == 200


def test_health(server):
    status, body = _req(server.base, "GET", "/health")
    assert status == 200 and body == {"status": "ok"}


def test_access_log_line(server, caplog):
    caplog.set_level(logging.INFO, logger="dsuf.access")
    status, body = _chat(server.base, "deepseek-chat", "/chat/completions", max_tokens=3)
    assert status == 200
    u = body["usage"]
    lines = [r.getMessage() for r in caplog.records if r.name == "dsuf.access"]
    line = next(x for x in lines if "/chat/completions" in x)
    assert '"POST /chat/completions" 200 ' in line, line
    assert (f"model={MODEL} prompt_tokens={u['prompt_tokens']} completion_tokens={u['completion_tokens']} "
            f"cached_tokens={u['prompt_tokens_details']['cached_tokens']}") in line, line
    _chat(server.base, "nope")
    assert any('"POST /v1/chat/completions" 404 ' in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("stream", [True, False])
def test_access_log_counts_streamed_tokens(server, caplog, stream):
    caplog.set_level(logging.INFO, logger="dsuf.access")
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, **kw)
    usage = [ch.usage for ch in r if ch.usage][-1] if stream else r.usage
    deadline = time.monotonic() + 10  # a stream's line comes once its handler returns, after [DONE]
    while not (lines := [x.getMessage() for x in caplog.records if x.name == "dsuf.access"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    line = lines[-1]
    assert f"completion_tokens={usage.completion_tokens} " in line, line
