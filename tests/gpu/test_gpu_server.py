"""The server on the GPU backend (demo model): tool_choice 'required' and response_format json_schema
are enforced by the device sampler's token masks, streamed and not, and an unconstrained request in
the same batch still answers (skipped without a GPU)."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import urllib.request
from pathlib import Path

import pytest
from gpu_required import require_gpu

cp = require_gpu()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from schema_check import errors  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def gpu_server():
    from conftest import ServerThread

    from engine.runtime.engine import Engine

    s = ServerThread(Engine.load(None, backend="cupy"), keepalive_s=0.25)
    yield s
    s.shutdown()


def _chat(server, body: dict) -> list[dict]:
    """POST a chat request (plain urllib: the GPU machine has no openai package); returns the
    response object, or the stream's chunks."""
    req = urllib.request.Request(server.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not body.get("stream"):
            return [json.load(r)]
        return [json.loads(line[6:]) for line in (raw.decode().strip() for raw in r)
                if line.startswith("data: {")]


def _json_schema(server, stream: bool, seed: int | None) -> str:
    kw = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 96, "response_format": rf, "stream": stream, **kw}
    out = _chat(server, body)
    if not stream:
        assert out[0]["choices"][0]["finish_reason"] == "stop", out
        return out[0]["choices"][0]["message"]["content"]
    assert [c["finish_reason"] for ch in out for c in ch["choices"] if c["finish_reason"]] == ["stop"], out
    return "".join(c["delta"].get("content") or "" for ch in out for c in ch["choices"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [None, 7])
def test_json_schema_on_the_gpu(gpu_server, stream, seed):
    text = _json_schema(gpu_server, stream, seed)
    assert errors(json.loads(text), PERSON) == [], text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_on_the_gpu_beside_a_free_request(gpu_server, stream):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": "deepseek-v4.1-flash", "messages": msgs, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 96, "temperature": 0.0, "stream": stream}

    def constrained():
        out = _chat(gpu_server, body)
        if not stream:
            choice = out[0]["choices"][0]
            assert choice["finish_reason"] == "tool_calls", out
            return [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        calls: dict[int, list[str]] = {}
        for ch in out:
            for c in ch["choices"]:
                for tc in c["delta"].get("tool_calls") or []:
                    cur = calls.setdefault(tc["index"], ["", ""])
                    cur[0] += tc["function"].get("name") or ""
                    cur[1] += tc["function"].get("arguments") or ""
        return [tuple(v) for v in calls.values()]

    def free():
        out = _chat(gpu_server, {"model": "deepseek-v4.1-flash", "messages": msgs, "max_tokens": 24,
                                 "temperature": 0.0})
        return out[0]["choices"][0]["message"]["content"]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got, other = pool.submit(constrained), pool.submit(free)
        calls, text = got.result(), other.result()
    assert calls
    for name, args in calls:
        assert name == "get_weather" and errors(json.loads(args), WEATHER) == [], (name, args)
    assert text is not None
