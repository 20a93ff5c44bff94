"""The server on the GPU backend (demo model): tool_choice 'required' and response_format json_schema
are enforced by the device sampler's token masks, streamed and not, and an unconstrained request in
the same batch still answers (skipped without a GPU)."""

from __future__ import annotations

import concurrent.futures
import json
import sys
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


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=300)


def _json_schema(client, stream: bool, seed: int | None) -> str:
    kw = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    if not stream:
        r = client.chat.completions.create(model="deepseek-v4.1-flash", messages=msgs, max_tokens=96,
                                           response_format=rf, **kw)
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].message.content
    parts = []
    for ch in client.chat.completions.create(model="deepseek-v4.1-flash", messages=msgs, max_tokens=96,
                                             response_format=rf, stream=True, **kw):
        for c in ch.choices:
            parts.append(c.delta.content or "")
    return "".join(parts)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [None, 7])
def test_json_schema_on_the_gpu(gpu_server, stream, seed):
    text = _json_schema(_client(gpu_server), stream, seed)
    assert errors(json.loads(text), PERSON) == [], text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_on_the_gpu_beside_a_free_request(gpu_server, stream):
    client = _client(gpu_server)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]

    def constrained():
        if not stream:
            r = client.chat.completions.create(model="deepseek-v4.1-flash", messages=msgs, tools=TOOLS,
                                               tool_choice="required", max_tokens=96, temperature=0.0)
            assert r.choices[0].finish_reason == "tool_calls", r
            return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        calls: dict[int, list[str]] = {}
        for ch in client.chat.completions.create(model="deepseek-v4.1-flash", messages=msgs, tools=TOOLS,
                                                 tool_choice="required", max_tokens=96, temperature=0.0,
                                                 stream=True):
            for c in ch.choices:
                for tc in c.delta.tool_calls or []:
                    cur = calls.setdefault(tc.index, ["", ""])
                    cur[0] += tc.function.name or ""
                    cur[1] += tc.function.arguments or ""
        return [tuple(v) for v in calls.values()]

    def free():
        r = client.chat.completions.create(model="deepseek-v4.1-flash", messages=msgs, max_tokens=24,
                                           temperature=0.0)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got, other = pool.submit(constrained), pool.submit(free)
        calls, text = got.result(), other.result()
    assert calls
    for name, args in calls:
        assert name == "get_weather" and errors(json.loads(args), WEATHER) == [], (name, args)
    assert text is not None
