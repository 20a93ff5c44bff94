"""Constrained decoding over real HTTP on the demo model (numpy backend): tool_choice 'required' and
a named function give tool calls whose arguments follow the tools' schemas, response_format
json_object / json_schema give JSON of the schema, streamed and not; schemas that cannot be
enforced are a 400; unconstrained requests draw what they drew before."""

from __future__ import annotations

import json

import openai
import pytest
from schema_check import errors
from test_server import MODEL, _chat_ids, _client, _msgs, _post

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days"]}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 40},
    "filters": {"type": "array", "items": {"type": "string", "enum": ["news", "images"]}, "maxItems": 2},
    "exact": {"type": "boolean"}}, "required": ["query", "exact"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "web.search", "parameters": SEARCH}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def _check_calls(calls: list[tuple[str, str]], only: str | None = None) -> None:
    assert calls
    for name, args in calls:
        assert name in SCHEMAS and (only is None or name == only), name
        assert errors(json.loads(args), SCHEMAS[name]) == [], (name, args)


def _stream_calls(stream) -> tuple[list[tuple[str, str]], str | None, str]:
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    for ch in stream:
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish, content


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
def test_tool_choice_required_gives_valid_calls(server, sampling):
    c = _client(server)
    r = c.chat.completions.create(model=MODEL, messages=_msgs("hi"), tools=TOOLS,
                                  tool_choice="required", max_tokens=200, **sampling)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    _check_calls([(t.function.name, t.function.arguments) for t in ch.message.tool_calls])
    assert all(t.type == "function" and t.id for t in ch.message.tool_calls)
    # streamed: the same calls (same seed), in deltas
    calls, finish, content = _stream_calls(c.chat.completions.create(
        model=MODEL, messages=_msgs("hi"), tools=TOOLS, tool_choice="required",
        max_tokens=200, stream=True, **sampling))
    assert finish == "tool_calls" and content == ""
    assert calls == [(t.function.name, t.function.arguments) for t in ch.message.tool_calls]


def test_named_function_is_the_one_called_once(server):
    c = _client(server)
    named = {"type": "function", "function": {"name": "web.search"}}
    for seed in (1, 2):
        r = c.chat.completions.create(model=MODEL, messages=_msgs("Look this up"), tools=TOOLS, tool_choice=named,
                                      max_tokens=200, temperature=1.0, seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        _check_calls([(t.function.name, t.function.arguments) for t in ch.message.tool_calls], "web.search")
    calls, finish, _ = _stream_calls(c.chat.completions.create(
        model=MODEL, messages=_msgs("Look this up"), tools=TOOLS, tool_choice=named, max_tokens=200,
        temperature=0, stream=True))
    assert finish == "tool_calls" and len(calls) == 1
    _check_calls(calls, "web.search")


def test_json_schema_gives_json_of_the_schema(server):
    c = _client(server)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        r = c.chat.completions.create(model=MODEL, messages=_msgs("Describe a person"), response_format=rf,
                                      max_tokens=120, **kw)
        assert r.choices[0].finish_reason == "stop"
        assert errors(json.loads(r.choices[0].message.content), PERSON) == []
    chunks = c.chat.completions.create(model=MODEL, messages=_msgs("Describe a person"), response_format=rf,
                                       max_tokens=120, temperature=0.7, seed=9, stream=True)
    text, finish = "", None
    for ch in chunks:
        text += ch.choices[0].delta.content or "" if ch.choices else ""
        finish = (ch.choices[0].finish_reason if ch.choices else None) or finish
    assert finish == "stop" and errors(json.loads(text), PERSON) == []


def test_json_object_gives_an_object(server):
    status, body = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": _msgs("Give JSON"), "response_format": {"type": "json_object"},
        "max_tokens": 300, "temperature": 0})
    assert status == 200
    ch = body["choices"][0]
    if ch["finish_reason"] == "stop":  # (a free object may outgrow max_tokens: then a prefix of one)
        assert isinstance(json.loads(ch["message"]["content"]), dict)
    else:
        assert ch["message"]["content"].startswith("{")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["a"]}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {'a"b': {"type": "string"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
])
def test_schema_that_cannot_be_enforced_is_400(server, body, param):
    status, err = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": _msgs("hi"), **body})
    assert status == 400, err
    assert err["error"]["param"] == param and "enforce" in err["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        _client(server).chat.completions.create(model=MODEL, messages=_msgs("hi"), max_tokens=2, **body)


def test_unconstrained_requests_draw_what_they_drew(server, engine):
    """No grammar, no mask: greedy chat output is the engine's own greedy continuation."""
    msgs = _msgs("Tell me about tools")
    want = engine.generate(_chat_ids(engine, msgs, tools=TOOLS), 12)
    status, body = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 12,
        "temperature": 0, "return_token_ids": True})
    assert status == 200
    assert body["choices"][0]["token_ids"] == want[:len(body["choices"][0]["token_ids"])]
