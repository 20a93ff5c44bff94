"""OpenAI protocol: request validation -> internal requests, errors, response and chunk builders.

Validation is strict about the types and ranges of the fields we read and ignores fields we do
not know (clients send vendor extras). Everything is pure: no I/O, no engine.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from engine.runtime import constraint
from engine.runtime.sampling import SamplingParams

MAX_N = 16
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # a stop string is held back while it might start: keep that bounded
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries; OpenAI documents 300
MAX_INT_FIELD = 1 << 31  # max_tokens, top_k: far above any context, far below what numpy chokes on
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # int64 or uint64, as clients send them; folded to uint64
MAX_ERROR_VALUE = 64  # characters of a client's value quoted back in an error message
MAX_ERROR_MESSAGE = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
REASONING_EFFORTS = ("minimal", "low", "medium", "high", "max")


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
                 close: bool = False):
        # whatever a message quotes, its size stays bounded
        message = short(message, MAX_ERROR_MESSAGE)
        param = None if param is None else short(param, MAX_ERROR_VALUE)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}
        self.close = close  # answer, then close the connection (e.g. a body left unread)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        resp = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.close:
            resp.force_close()
        return resp


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def short(value: Any, limit: int = MAX_ERROR_VALUE) -> str:
    """A client's value as an error message may quote it: at most limit characters."""
    text = value if isinstance(value, str) else _safe_repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _safe_repr(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<an integer of {value.bit_length()} bits>"  # str() of a huge int is slow, even refused
    try:
        return repr(value)
    except ValueError:
        return f"<{type(value).__name__}>"


# ---------------------------------------------------------------- typed field readers


# Deeper than any real request (tool schemas nest a few tens of levels). Checked before json.loads:
# its C scanner recurses once per level, and a finalizer that the garbage collector runs at that
# depth fails with RecursionError outside our control (an unraisable error, not a clean 400).
MAX_JSON_DEPTH = 256


_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """Deepest nesting of [ and { in a JSON text, brackets inside strings not counted."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be too deep; skip the scan for ordinary bodies
    b = np.frombuffer(raw, np.uint8)
    quote = b == ord('"')
    escaped = np.flatnonzero(quote[1:] & (b[:-1] == ord("\\"))) + 1
    if escaped.size:  # a quote is escaped when an odd run of backslashes precedes it
        plain = np.where(b != ord("\\"), np.arange(b.size), -1)
        run = escaped - 1 - np.maximum.accumulate(plain)[escaped - 1]
        quote[escaped[run % 2 == 1]] = False
    # a byte after an odd number of real quotes is inside a string (the quotes themselves do not step)
    inside = np.bitwise_xor.accumulate(quote.view(np.uint8))
    step = _BRACKET_STEP[b] * (inside ^ 1).view(np.int8)
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def parse_body(raw: bytes) -> Any:
    """A request body as JSON, or a 400 that says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"request body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise bad("request body is empty; expected a JSON object")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise bad(f"invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError:  # an integer past Python's digit limit for int parsing
        raise bad("invalid JSON: a number has too many digits") from None
    except RecursionError:
        raise bad("invalid JSON: nested too deeply") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(f"'{name}' must be a number", name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {short(v)}", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad(f"'{name}' must be in {rng}, got {short(v)}", name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return v


def _obj(body: dict, name: str) -> dict | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad(f"'{name}' must be an object", name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(v) > MAX_STOP:
        raise bad(f"'stop' may hold at most {MAX_STOP} strings", "stop")
    if any(s == "" for s in v):
        raise bad("'stop' strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise bad(f"'stop' strings may be at most {MAX_STOP_CHARS} characters", "stop")
    return v


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = []
    for k, b in v.items():
        # plain ASCII digits only: int() also takes signs, '_', spaces and other scripts' digits
        if not (k.isascii() and k.isdigit() and len(k) <= 10):
            raise bad(f"'logit_bias' key {short(k)!r} is not a token id", "logit_bias")
        tid = int(k)  # the vocabulary bound is checked once the model is known (check_vocab)
        if not _is_num(b) or not -100 <= b <= 100:
            raise bad("'logit_bias' values must be numbers in [-100, 100]", "logit_bias")
        out.append((tid, float(b)))
    return tuple(out)


# ---------------------------------------------------------------- internal request


@dataclass
class GenRequest:
    """What the scheduler needs, whatever endpoint it came from."""

    kind: str  # "chat" | "completion"
    model: str
    n: int
    max_tokens: int | None  # requested; clamped to the remaining context per prompt
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool = False
    ignore_eos: bool = False
    thinking: bool = False
    tools: bool = False  # parse DSML tool calls in the output
    echo: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    grammar: constraint.GrammarSpec | None = None  # constrained decoding (engine/runtime/constraint.py)
    cache_salt: str | None = None  # vLLM's field: prompt-cache reuse only among requests with the same salt
    prompts: list[list[int]] = field(default_factory=list)  # token ids, one list per prompt
    prompt_texts: list[str] = field(default_factory=list)
    request_id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        self.request_id = self.request_id or prefix + uuid.uuid4().hex
        self.created = self.created or int(time.time())


@dataclass
class ChatSpec:
    """A validated chat request: messages and options for the chat encoding, plus the GenRequest."""

    gen: GenRequest
    messages: list[dict]
    tools: list[dict] | None
    response_format: dict | None
    reasoning_effort: str | None


# Fields we accept and ignore; their types are still checked, as OpenAI does.
_IGNORED_FIELDS = {"user": str, "metadata": dict, "store": bool, "parallel_tool_calls": bool,
                   "service_tier": str, "prediction": dict, "modalities": list, "audio": dict}


def _common(body: dict, kind: str, default_model: str) -> GenRequest:
    for name, typ in _IGNORED_FIELDS.items():
        if body.get(name) is not None and not isinstance(body[name], typ):
            raise bad(f"'{name}' must be of type {typ.__name__}", name)
    model = body.get("model")
    if model is None:
        model = default_model
    elif not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    stream = _bool(body, "stream", False)
    so = _obj(body, "stream_options") or {}
    include_usage = _bool(so, "include_usage", False) if stream else False
    n = _int(body, "n", 1, 1, MAX_N)
    if kind == "chat":
        mt = _int(body, "max_completion_tokens", None, 1)
        if mt is None:
            mt = _int(body, "max_tokens", None, 1)
        default_max = None  # chat: up to the context length
    else:
        mt = _int(body, "max_tokens", None, 1)
        default_max = 16  # the completions API's documented default
    if mt is not None:  # any larger value means "up to the context", as it is clamped to it
        mt = min(mt, MAX_INT_FIELD)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, -1, MAX_INT_FIELD)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    seed = _int(body, "seed", None, *SEED_RANGE)
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= 256):
        raise bad("'cache_salt' must be a non-empty string of at most 256 characters", "cache_salt")
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise bad("'best_of' other than n is not supported", "best_of")
    gen = GenRequest(
        kind=kind, model=model, n=n, max_tokens=mt if mt is not None else default_max,
        sampling=SamplingParams(), stop=_stop(body), stream=stream, include_usage=include_usage,
        ignore_eos=_bool(body, "ignore_eos", False), return_token_ids=_bool(body, "return_token_ids", False),
        cache_salt=cache_salt,
    )
    gen.sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(0, top_k), min_p=min_p,
        seed=None if seed is None else seed & 0xFFFF_FFFF_FFFF_FFFF,  # SeedSequence wants >= 0
        presence_penalty=presence, frequency_penalty=frequency, logit_bias=_logit_bias(body),
    )
    return gen


def _content_text(content: Any, where: str, *, allow_none: bool) -> str | None:
    if content is None:
        if allow_none:
            return None
        raise bad(f"{where}.content must not be null", where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad(f"{where}.content[{j}] must be an object with a 'type'", where)
            if part["type"] not in ("text", "input_text"):
                raise bad(f"{where}.content[{j}]: content type {short(part['type'])!r} is not supported "
                          "(text only)", where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}].text must be a string", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of content parts", where)


def _tool_calls(v: Any, where: str) -> list[dict]:
    if not isinstance(v, list):
        raise bad(f"{where}.tool_calls must be a list", where)
    out = []
    for j, tc in enumerate(v):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
            raise bad(f"{w} must be an object with a 'function'", w)
        fn = tc["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{w}.function.name must be a non-empty string", w)
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise bad(f"{w}.function.arguments must be a JSON string", w)
        out.append({"id": tc.get("id") if isinstance(tc.get("id"), str) else f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise bad("'messages' must be a list of message objects", "messages")
    if not msgs:
        raise bad("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{w} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{w}.role must be one of {', '.join(ROLES)}; got {short(role)!r}", "messages")
        has_calls = role == "assistant" and m.get("tool_calls") not in (None, [])
        text = _content_text(m.get("content"), w, allow_none=role == "assistant")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text or ""}
        if role == "assistant":
            if has_calls:
                msg["tool_calls"] = _tool_calls(m["tool_calls"], w)
            rc = m.get("reasoning_content")
            if rc is not None:
                if not isinstance(rc, str):
                    raise bad(f"{w}.reasoning_content must be a string", "messages")
                msg["reasoning_content"] = rc
        if role == "tool":
            tcid = m.get("tool_call_id")
            if tcid is not None and not isinstance(tcid, str):
                raise bad(f"{w}.tool_call_id must be a string", "messages")
            if tcid is not None:
                msg["tool_call_id"] = tcid
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"{w}.name must be a string", "messages")
            msg["name"] = name
        out.append(msg)
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad(f"{w} must be an object with type 'function'", "tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{w}.function must be an object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME_RE.match(name):
            raise bad(f"{w}.function.name must match [A-Za-z0-9_.-]{{1,64}}", "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{w}.function.description must be a string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{w}.function.parameters must be a JSON Schema object", "tools")
        if isinstance(params, dict) and "type" in params and not isinstance(params["type"], str | list):
            raise bad(f"{w}.function.parameters.type must be a string", "tools")
        clean = {"name": name}
        if desc is not None:
            clean["description"] = desc
        if params is not None:
            clean["parameters"] = params
        out.append({"type": "function", "function": clean})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise bad("tool names must be unique", "tools")
    return out


def _tool_choice(body: dict, tools: list[dict] | None) -> list[dict] | None:
    """Applies tool_choice to the offered tools ('required' and a named function are enforced by
    constrained decoding: _grammar)."""
    tc = body.get("tool_choice")
    if tc is None or tc == "auto" or tc == "required":
        if tc == "required" and not tools:
            raise bad("tool_choice 'required' needs 'tools'", "tool_choice")
        return tools
    if tc == "none":
        return None
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict):
        name = tc["function"].get("name")
        chosen = [t for t in tools or [] if t["function"]["name"] == name]
        if not chosen:
            shown = name[:64] if isinstance(name, str) else type(name).__name__
            raise bad(f"tool_choice names {shown!r}, which is not among 'tools'", "tool_choice")
        return chosen
    raise bad("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
              "'function': {'name': ...}}", "tool_choice")


def _response_format(body: dict) -> dict | None:
    rf = _obj(body, "response_format")
    if rf is None:
        return None
    t = rf.get("type")
    if t == "text":
        return None
    if t == "json_object":
        return rf
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict | bool):
            raise bad("response_format.json_schema must be an object with a 'schema' object", "response_format")
        return rf
    raise bad("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")


def _short(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[:limit] + "..."


def _grammar(body: dict, tools: list[dict] | None, rf: dict | None) -> constraint.GrammarSpec | None:
    """What constrained decoding enforces: tool_choice 'required' / a named function (a DSML block
    of calls to the offered tools, one call when named or parallel_tool_calls is false), else
    response_format json_object / json_schema. Every schema must compile (else 400)."""
    tc = body.get("tool_choice")
    if tools and (tc == "required" or isinstance(tc, dict)):
        out = []
        for t in tools:
            fn = t["function"]
            err = constraint.tool_schema_error(fn["name"], fn.get("parameters"))
            if err:
                raise bad(f"tools: cannot enforce the parameters schema: {_short(err)}", "tools")
            out.append((fn["name"], json.dumps(fn["parameters"]) if "parameters" in fn else ""))
        single = isinstance(tc, dict) or body.get("parallel_tool_calls") is False
        return constraint.GrammarSpec("tools", tools=tuple(out), single=single)
    if rf is None:
        return None
    schema = rf["json_schema"].get("schema", {}) if rf["type"] == "json_schema" else constraint.JSON_OBJECT_SCHEMA
    err = constraint.schema_error(schema)
    if err:
        raise bad(f"response_format.json_schema.schema cannot be enforced: {_short(err)}", "response_format")
    return constraint.GrammarSpec("json", schema=json.dumps({} if schema is True else schema))


def _thinking(body: dict) -> tuple[bool, str | None]:
    """DeepSeek's `thinking: {type}` and `reasoning_effort`; vLLM's chat_template_kwargs.thinking too.

    Thinking is off unless asked for; a reasoning_effort alone turns it on.
    """
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    th = body.get("thinking")
    if th is not None:
        if isinstance(th, bool):
            return th, effort
        if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled"):
            raise bad("'thinking' must be {\"type\": \"enabled\" | \"disabled\"}", "thinking")
        return th["type"] == "enabled", effort
    ctk = _obj(body, "chat_template_kwargs") or {}
    for key in ("thinking", "enable_thinking"):
        if key in ctk:
            return _bool(ctk, key, False), effort
    return effort is not None, effort


def parse_chat(body: Any, default_model: str) -> ChatSpec:
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    gen = _common(body, "chat", default_model)
    messages = _messages(body)
    tools = _tool_choice(body, _tools(body))
    thinking, effort = _thinking(body)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    gen.logprobs, gen.top_logprobs = logprobs, top
    gen.thinking, gen.tools = thinking, bool(tools)
    rf = _response_format(body)
    gen.grammar = _grammar(body, tools, rf)
    return ChatSpec(gen=gen, messages=messages, tools=tools, response_format=rf, reasoning_effort=effort)


def parse_completion(body: Any, default_model: str) -> tuple[GenRequest, list[str | list[int]]]:
    """Returns the request and its prompts (strings to tokenize, or token id lists)."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    gen = _common(body, "completion", default_model)
    p = body.get("prompt")
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompts = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(s, str) for s in p):
        prompts = list(p)
    elif (isinstance(p, list) and p and all(isinstance(s, list) and s and all(_is_int(t) for t in s)
                                            for s in p)):
        prompts = [list(s) for s in p]
    else:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                  "token-id lists (non-empty)", "prompt")
    if len(prompts) * gen.n > 64:
        raise bad("too many prompts x n (at most 64 sequences per request)", "prompt")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' is not supported", "suffix")
    lp = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    gen.logprobs, gen.top_logprobs = lp is not None, lp or 0
    gen.echo = _bool(body, "echo", False)
    return gen, prompts


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chunk(gen: GenRequest, choices: list[dict], usage_: dict | None = None) -> dict:
    obj = {
        "id": gen.request_id,
        "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
        "created": gen.created,
        "model": gen.model,
        "choices": choices,
    }
    if usage_ is not None or gen.include_usage:
        obj["usage"] = usage_
    return obj


def completion(gen: GenRequest, choices: list[dict], usage_: dict) -> dict:
    return {
        "id": gen.request_id,
        "object": "chat.completion" if gen.kind == "chat" else "text_completion",
        "created": gen.created,
        "model": gen.model,
        "choices": choices,
        "usage": usage_,
    }


def model_card(model_id: str, context_len: int) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "dsuf", "max_model_len": context_len}
