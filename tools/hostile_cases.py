"""The cases of tools/hostile.py: body, headers, framing, values, unicode, special tokens, sizes,
slow clients. Each names the statuses a correct server may answer (CLOSED: it closes without
answering; CUT: it cuts a stream short)."""

from __future__ import annotations

import gzip
import json
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from hostile import CLOSED, CUT, Hang, Reply, Target, connect, exchange, read_reply, request_bytes

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


@dataclass
class Case:
    name: str
    group: str
    expect: tuple[int, ...]
    data: Callable[[Target], bytes] | None = None  # the whole request, sent at once
    run: Callable[[Target], Reply] | None = None  # or a client of its own
    error_json: bool = True  # a 4xx must be the OpenAI error JSON
    timeout: float = 60.0
    alone: bool = False  # run after the others, by itself (it affects every connection)


def _chat(t: Target, **kw) -> dict:
    return {"model": t.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 0, **kw}


def chat_case(name: str, group: str, expect, **kw) -> Case:
    return Case(name, group, _tuple(expect),
                lambda t: request_bytes(t, "POST", CHAT, json.dumps(_chat(t, **kw)).encode()))


def raw_body(name: str, group: str, expect, body: bytes | Callable[[Target], bytes], path: str = CHAT,
             headers: dict | None = None) -> Case:
    return Case(name, group, _tuple(expect),
                lambda t: request_bytes(t, "POST", path, body(t) if callable(body) else body, headers))


def raw(name: str, group: str, expect, data: bytes | Callable[[Target], bytes], **kw) -> Case:
    return Case(name, group, _tuple(expect), (data if callable(data) else lambda t: data), **kw)


def _tuple(x) -> tuple[int, ...]:
    return x if isinstance(x, tuple) else (x,)


def _msgs(*contents: str, role: str = "user") -> list[dict]:
    return [{"role": role, "content": c} for c in contents]


# ---------------------------------------------------------------- groups


def body_cases() -> list[Case]:
    m = '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2%s}'

    def with_tail(tail: str) -> Callable[[Target], bytes]:
        return lambda t: (m % (t.model, tail)).encode()

    return [
        raw_body("truncated-json", "body", 400, b'{"messages": ['),
        raw_body("json-array", "body", 400, b"[1, 2]"),
        raw_body("json-string", "body", 400, b'"hello"'),
        raw_body("json-null", "body", 400, b"null"),
        raw_body("empty", "body", 400, b""),
        raw_body("whitespace", "body", 400, b" \n\t "),
        raw_body("invalid-utf8", "body", 400, b'{"messages": "\xff\xfe"}'),
        raw_body("nul-bytes", "body", 400, b"\x00" * 64),
        raw_body("utf8-bom", "body", (200, 400), lambda t: b"\xef\xbb\xbf" + (m % (t.model, "")).encode()),
        raw_body("trailing-garbage", "body", 400, lambda t: (m % (t.model, "")).encode() + b"}}}"),
        raw_body("two-objects", "body", 400, lambda t: (m % (t.model, "")).encode() * 2),
        raw_body("nested-100k", "body", 400, b"[" * 100000 + b"]" * 100000),
        raw_body("nested-objects", "body", 400, b'{"a":' * 5000 + b"1" + b"}" * 5000),
        raw_body("int-5000-digits", "body", 400, with_tail(', "seed": ' + "9" * 5000)),
        raw_body("int-4000-digits-seed", "body", 400, with_tail(', "seed": ' + "9" * 4000)),
        raw_body("int-4000-digits-n", "body", 400, with_tail(', "n": ' + "9" * 4000)),
        raw_body("int-4000-digits-max-tokens", "body", 200, lambda t: (
            '{"model": "' + t.model + '", "prompt": ' + str([5] * (t.context_len - 3))
            + ', "max_tokens": ' + "9" * 4000 + "}"
        ).encode(), COMPL),
        raw_body("float-huge-exponent", "body", 400, with_tail(', "temperature": 1e999999')),
        raw_body("nan-literal", "body", 400, with_tail(', "temperature": NaN')),
        raw_body("infinity-literal", "body", 400, with_tail(', "top_p": Infinity')),
        raw_body("neg-infinity-bias", "body", 400, with_tail(', "logit_bias": {"5": -Infinity}')),
        raw_body("duplicate-keys", "body", 200, with_tail(', "max_tokens": 1, "max_tokens": 2')),
        raw_body("single-quotes", "body", 400, b"{'messages': []}"),
        raw_body("comments", "body", 400, b'{"messages": [] /* hi */}'),
        raw_body("long-string-key", "body", 200, with_tail(', "' + "k" * 100000 + '": 1')),
        raw_body("many-keys", "body", 200, with_tail("".join(f', "x{i}": {i}' for i in range(20000)))),
        raw_body("control-char-in-string", "body", 400,
                 lambda t: (m % (t.model, "")).replace('"x"', '"\x01"').encode()),
    ]


def value_cases(t: Target) -> list[Case]:
    c = []
    bad = {
        "temperature": [-1, 2.5, "1", True, [1], {"a": 1}, 1e308],
        "top_p": [0, -0.1, 1.01, "x", False],
        "top_k": [-2, 1 << 40, 1.5, "5"],
        "min_p": [-0.1, 1.5, "x"],
        "presence_penalty": [-3, 2.01, "x"],
        "frequency_penalty": [9, -9, None and 0 or "x"],
        "max_tokens": [0, -1, 1.5, "10", True, -(10 ** 30)],
        "max_completion_tokens": [0, -5, "x"],
        "n": [0, -1, 17, 1.0, "2", 10 ** 20],
        "seed": [1 << 64, -(1 << 63) - 1, 1.5, "7", 10 ** 30],
        "stop": [5, [1, 2], [""], ["s"] * 17, ["x" * 1025], {"a": 1}],
        "logprobs": ["yes", 1],
        "stream": ["yes", 1],
        "best_of": [2, 0, 100],
        "logit_bias": ["x", [1], {"abc": 1}, {"-1": 1}, {"99999999999999999999999": 1},
                      {str(1 << 70): 5}, {"1e3": 1}, {" 5": 1}, {"+5": 1}, {"5_0": 1},
                      {"\u0663": 1}, {"5": 101}, {"5": -100.5}, {"5": "1"}, {"5": None},
                      {str(i): 1 for i in range(2000)}],
        "user": [["x"], 5],
        "model": [["m"], 5, None and 0 or {"a": 1}],
        "tools": ["x", [{"type": "function"}], [{"type": "function", "function": {"name": "a b"}}],
                  [{"type": "function", "function": {"name": "f", "parameters": "s"}}]],
        "tool_choice": [7, "sometimes", {"type": "function", "function": {"name": "nope"}}],
        "response_format": [{"type": "xml"}, "json", {"type": "json_schema", "json_schema": 5}],
        "reasoning_effort": ["ultra", 5],
        "thinking": [{"type": "maybe"}, "on"],
        "stream_options": ["x"],
    }
    for name, values in bad.items():
        for i, v in enumerate(values):
            extra = {"stream": True} if name == "stream_options" else {}
            c.append(chat_case(f"{name}-{i}", "values", 400, **{name: v}, **extra))
    c.append(chat_case("top-logprobs-21", "values", 400, logprobs=True, top_logprobs=21))
    c.append(chat_case("top-logprobs-without-logprobs", "values", 400, top_logprobs=3))
    c.append(chat_case("unknown-model-long", "values", 404, model="m" * 100000))
    ok = {"seed": [(1 << 64) - 1, -(1 << 63), -1, 0], "n": [2], "top_k": [-1, 1 << 30],
          "logit_bias": [{"5": 100, "6": -100}, {"0": 1}],
          "stop": [["\u0000"], ["x" * 1024]]}
    for name, values in ok.items():
        for i, v in enumerate(values):
            c.append(chat_case(f"ok-{name}-{i}", "values", 200, **{name: v}))
    c.append(raw_body("ok-max-tokens-googol", "values", 200, lambda t: json.dumps(
        {"model": t.model, "prompt": [5] * (t.context_len - 3), "max_tokens": 10 ** 100}).encode(), COMPL))
    if t.vocab:
        c.append(chat_case("logit-bias-vocab-edge", "values", 400, logit_bias={str(t.vocab): 1}))
        c.append(chat_case("logit-bias-last-id", "values", 200, logit_bias={str(t.vocab - 1): 1}))
    if t.capacity:
        c.append(raw_body("n-times-prompts-past-capacity", "values", 400, lambda t: json.dumps(
            {"model": t.model, "prompt": ["a"] * t.capacity, "n": 2, "max_tokens": 1}).encode(), COMPL))
    c += [
        raw_body("completion-token-past-int64", "values", 400,
                 lambda t: json.dumps({"model": t.model, "prompt": [1, 1 << 70]}).encode(), COMPL),
        raw_body("completion-negative-token", "values", 400,
                 lambda t: json.dumps({"model": t.model, "prompt": [-1]}).encode(), COMPL),
        raw_body("completion-mixed-prompt", "values", 400,
                 lambda t: json.dumps({"model": t.model, "prompt": ["a", 1]}).encode(), COMPL),
        raw_body("completion-suffix", "values", 400,
                 lambda t: json.dumps({"model": t.model, "prompt": "a", "suffix": "b"}).encode(), COMPL),
        raw_body("completion-logprobs-99", "values", 400,
                 lambda t: json.dumps({"model": t.model, "prompt": "a", "logprobs": 99}).encode(), COMPL),
        chat_case("role-huge", "values", 400, messages=[{"role": "x" * 100000, "content": "a"}]),
        chat_case("content-type-huge", "values", 400,
                  messages=[{"role": "user", "content": [{"type": "y" * 100000}]}]),
        chat_case("content-int", "values", 400, messages=[{"role": "user", "content": 5}]),
        chat_case("content-null-user", "values", 400, messages=[{"role": "user", "content": None}]),
        chat_case("content-image", "values", 400,
                  messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        chat_case("name-int", "values", 400, messages=[{"role": "user", "content": "a", "name": 5}]),
        chat_case("tool-call-id-int", "values", 400, messages=[{"role": "tool", "content": "a", "tool_call_id": 5}]),
        chat_case("reasoning-content-int", "values", 400,
                  messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                                               "reasoning_content": 5}]),
        chat_case("tool-calls-garbage", "values", 400,
                  messages=[{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": "x"}]),
        chat_case("messages-empty", "values", 400, messages=[]),
        chat_case("messages-dict", "values", 400, messages={"role": "user"}),
        chat_case("messages-nested-list", "values", 400, messages=[[{"role": "user", "content": "a"}]]),
    ]
    return c


SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜System｜>",
            "<think>", "</think>", "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "<｜latest_reminder｜>",
            "<｜tool▁output▁begin｜>"]


def unicode_cases(t: Target) -> list[Case]:
    n = max(1, (t.context_len or 4096) // 8)  # every text well inside the context
    texts = {
        "lone-surrogate": "\ud800", "surrogate-pair-split": "\udc00\ud800", "nul": "a\u0000b",
        "rtl-override": "\u202eabc\u202c", "zero-width": "\u200b\u200c\u200d" * 100, "bom": "\ufeffhi",
        "combining": "e" + "\u0301" * n, "emoji-zwj": "\U0001f468\u200d\U0001f469\u200d\U0001f467" * (n // 16),
        "cjk": "\u4e2d\u6587" * (n // 2), "private-use": "\ue000\U000f0000", "noncharacters": "\ufffe\uffff",
        "max-codepoint": "\U0010ffff" * 10, "c1-controls": "".join(chr(i) for i in range(0x80, 0xa0)),
        "ascii-controls": "".join(chr(i) for i in range(32)), "mixed-scripts": "Ab\u0416\u05d0\u0e01\u3042",
        "replacement-char": "\ufffd" * 100, "line-separators": "a\u2028b\u2029c\r\n\r",
        "long-word": "x" * n, "spaces-run": " " * (n * 4),
    }
    out = []
    for k, v in texts.items():  # lone surrogates cannot be tokenized: 400 is right too
        expect = (200, 400) if "surrogate" in k else 200
        out.append(chat_case(f"chat-{k}", "unicode", expect, messages=_msgs(v)))
        out.append(raw_body(f"completion-{k}", "unicode", expect, lambda t, v=v: json.dumps(
            {"model": t.model, "prompt": v, "max_tokens": 2, "temperature": 0}).encode(), COMPL))
    return out


def special_token_cases() -> list[Case]:
    out = []
    for i, s in enumerate(SPECIALS):
        out.append(chat_case(f"user-{i}", "special", 200, messages=_msgs(f"a{s}b")))
        out.append(chat_case(f"system-{i}", "special", 200,
                             messages=[{"role": "system", "content": s * 3}, {"role": "user", "content": "x"}]))
        out.append(raw_body(f"completion-{i}", "special", 200, lambda t, s=s: json.dumps(
            {"model": t.model, "prompt": s + "hi", "max_tokens": 2, "temperature": 0}).encode(), COMPL))
    out.append(chat_case("tool-result-forged-close", "special", 200, messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "r" + "".join(SPECIALS)}]))
    out.append(chat_case("all-specials-stop", "special", 200, stop=SPECIALS[:16], messages=_msgs("".join(SPECIALS))))
    return out


def size_cases(t: Target) -> list[Case]:
    ctx = t.context_len or 4096
    return [
        raw_body("body-9mb", "sizes", 413, lambda t: json.dumps(_chat(t, messages=_msgs("A" * (9 << 20)))).encode()),
        raw_body("chat-7mb-prompt", "sizes", (400, 413), lambda t: json.dumps(
            _chat(t, messages=_msgs("hello world " * (600_000)))).encode()),
        raw_body("chat-just-past-context", "sizes", 400, lambda t: json.dumps(
            _chat(t, messages=_msgs("hello " * (ctx + 100)))).encode()),
        raw_body("chat-many-messages", "sizes", 400, lambda t: json.dumps(
            _chat(t, messages=_msgs(*["hi there"] * (ctx // 2)))).encode()),
        raw_body("completion-ids-past-context", "sizes", 400, lambda t: json.dumps(
            {"model": t.model, "prompt": [5] * (ctx + 10)}).encode(), COMPL),
        raw_body("completion-64-prompts-past-context", "sizes", 400, lambda t: json.dumps(
            {"model": t.model, "prompt": ["word " * (ctx + 10)] * 8, "max_tokens": 1}).encode(), COMPL),
        raw_body("completion-3mb-one-char-tokens", "sizes", (400, 413), lambda t: json.dumps(
            {"model": t.model, "prompt": "\u4e2d" * 1_000_000}).encode(), COMPL),
        chat_case("tools-500", "sizes", (200, 400), tools=[
            {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(500)]),
        chat_case("stop-16-long", "sizes", 200, stop=["z" * 1000 + str(i) for i in range(16)]),
    ]


def _gz(t: Target) -> bytes:
    return gzip.compress(json.dumps(_chat(t)).encode())


def header_cases(t: Target) -> list[Case]:
    denied = 401 if t.api_key else 200  # without a key configured, Authorization is not read
    def body(t: Target) -> bytes:
        return json.dumps(_chat(t)).encode()

    def hdr(name: str, expect, headers: dict, data=body, auth=True, path=CHAT) -> Case:
        return raw(name, "headers", expect, lambda t: request_bytes(t, "POST", path, data(t), headers, auth))

    return [
        hdr("content-type-text", 200, {"Content-Type": "text/plain"}),
        hdr("content-type-missing", 200, {"Content-Type": None}),
        hdr("content-type-garbage", (200, 400), {"Content-Type": "\x7f;;;===="}),
        hdr("content-length-short", 400, {"Content-Length": "10"}),
        hdr("content-length-negative", 400, {"Content-Length": "-5"}),
        hdr("content-length-huge", (408, 413), {"Content-Length": "99999999999"}),
        hdr("content-length-not-number", 400, {"Content-Length": "ten"}),
        hdr("content-length-twice", 400, {"Content-Length": "50", "content-length": "60"}),
        hdr("cl-and-te", 400, {"Transfer-Encoding": "chunked", "Content-Length": "5"}),
        hdr("te-unknown", (400, 501), {"Transfer-Encoding": "gzip, foo"}),
        hdr("gzip-valid", 200, {"Content-Encoding": "gzip"}, data=_gz),
        hdr("gzip-corrupt", 400, {"Content-Encoding": "gzip"}, data=lambda t: _gz(t)[:20] + b"\x00" * 40),
        hdr("gzip-not-gzip", 400, {"Content-Encoding": "gzip"}),
        hdr("gzip-bomb", (400, 413), {"Content-Encoding": "gzip"}, data=lambda t: gzip.compress(b" " * (200 << 20), 9)),
        hdr("deflate-valid", 200, {"Content-Encoding": "deflate"}, data=lambda t: zlib.compress(body(t))),
        hdr("deflate-corrupt", 400, {"Content-Encoding": "deflate"}, data=lambda t: b"x\x9c" + b"\xff" * 50),
        hdr("br-corrupt", (400, 415), {"Content-Encoding": "br"}, data=lambda t: b"\xff" * 50),
        hdr("encoding-unknown", (200, 400, 415), {"Content-Encoding": "zzz"}),
        hdr("auth-missing", denied, {}, auth=False),
        hdr("auth-wrong", denied, {"Authorization": "Bearer nope"}),
        hdr("auth-non-utf8", denied, {"Authorization": b"Bearer \xff\xfe"}),
        hdr("auth-latin1", denied, {"Authorization": b"Bearer caf\xe9"}),
        hdr("auth-huge", denied, {"Authorization": "Bearer " + "k" * 8000}),
        hdr("auth-basic", denied, {"Authorization": "Basic dXNlcjpwYXNz"}),
        hdr("auth-empty-bearer", denied, {"Authorization": "Bearer "}),
        hdr("auth-lowercase-scheme", 200, {"Authorization": f"bearer {t.api_key}"} if t.api_key else {}),
        hdr("header-too-long", (400, 431), {"X-Big": "a" * 20000}),
        hdr("headers-too-many", (400, 431), {f"X-H{i}": "1" for i in range(300)}),
        hdr("header-nul", 400, {"X-Nul": "a\x00b"}),
        hdr("header-no-colon", 400, {"X-Bad\r\nnocolon": "x"}),
        hdr("header-space-before-colon", 400, {"X-Bad ": "x"}),
        hdr("header-obs-fold", 400, {"X-Fold": "a\r\n b"}),
        hdr("header-non-ascii-name", 400, {"X-\xe9": "x"}),
        hdr("session-id-huge", 200, {"X-Session-Id": "s" * 4000}),
        hdr("expect-100", 200, {"Expect": "100-continue"}),
        hdr("expect-garbage", (200, 417), {"Expect": "magic"}),
        hdr("host-missing", (200, 400), {"Host": None}),
        hdr("upgrade-h2c", 200, {"Upgrade": "h2c", "Connection": "Upgrade"}),
        hdr("accept-html", 200, {"Accept": "text/html"}),
    ]


def framing_cases() -> list[Case]:
    def chunked(payload: bytes) -> Callable[[Target], bytes]:
        return lambda t: request_bytes(t, "POST", CHAT, payload, {"Transfer-Encoding": "chunked"})

    def good_chunks(t: Target) -> bytes:
        b = json.dumps(_chat(t)).encode()
        return request_bytes(t, "POST", CHAT, b"%x\r\n%s\r\n0\r\n\r\n" % (len(b), b), {"Transfer-Encoding": "chunked"})

    return [
        raw("chunked-valid", "framing", 200, good_chunks),
        raw("chunked-bad-size", "framing", 400, chunked(b"zz\r\nabc\r\n0\r\n\r\n")),
        raw("chunked-size-huge", "framing", (400, 413), chunked(b"ffffffffffffffffff\r\nabc\r\n0\r\n\r\n")),
        raw("chunked-missing-crlf", "framing", 400, chunked(b"3\r\nabcdef0\r\n\r\n")),
        raw("chunked-negative", "framing", 400, chunked(b"-3\r\nabc\r\n0\r\n\r\n")),
        raw("garbage-request-line", "framing", (400, CLOSED), b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"),
        raw("invalid-method-chars", "framing", 400, lambda t: b"GE(T /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"),
        raw("unknown-method", "framing", (400, 405, 501), lambda t: request_bytes(t, "BREW", "/v1/models")),
        raw("method-lowercase", "framing", (400, 405), lambda t: request_bytes(t, "get", "/v1/models")),
        raw("http-version-9", "framing", (400, 505), lambda t: b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n"),
        raw("http-09-style", "framing", (400, 404, CLOSED), lambda t: b"GET /\r\n\r\n"),
        raw("no-version", "framing", (200, 400, 401, 404, CLOSED),  # read as HTTP/0.9, or refused
            lambda t: b"GET /v1/models\r\nHost: x\r\n\r\n"),
        raw("uri-too-long", "framing", (400, 414), lambda t: request_bytes(t, "GET", "/v1/models?" + "a" * 20000)),
        raw("path-traversal", "framing", (400, 404), lambda t: request_bytes(t, "GET", "/../../etc/passwd")),
        raw("path-percent-garbage", "framing", (400, 404), lambda t: request_bytes(t, "GET", "/v1/%zz%00")),
        raw("path-absolute-form", "framing", (200, 400, 404),
            lambda t: request_bytes(t, "GET", f"http://{t.host}:{t.port}/v1/models")),
        raw("path-asterisk", "framing", (400, 404, 405), lambda t: request_bytes(t, "OPTIONS", "*")),
        raw("get-chat", "framing", 405, lambda t: request_bytes(t, "GET", CHAT)),
        raw("delete-models", "framing", 405, lambda t: request_bytes(t, "DELETE", "/v1/models")),
        raw("unknown-route", "framing", 404, lambda t: request_bytes(t, "POST", "/v1/" + "x" * 5000, b"{}")),
        raw("lf-only-lines", "framing", (200, 400),
            lambda t: request_bytes(t, "GET", "/v1/models").replace(b"\r\n", b"\n")),
        raw("bare-cr", "framing", 400, lambda t: b"GET /v1/models HTTP/1.1\rHost: x\r\n\r\n"),
        Case("pipelined-two", "framing", (200,), run=_pipelined),
        Case("head-models", "framing", (200, 405), run=lambda t: _head(t)),
    ]


def _pipelined(t: Target) -> Reply:
    """Two requests in one write: two answers, in order."""
    one = request_bytes(t, "GET", "/v1/models", headers={"Connection": "keep-alive"})
    data = b""
    with connect(t) as s:
        s.sendall(one + request_bytes(t, "GET", "/v1/models"))
        end = time.monotonic() + 30
        while chunk := _recv_until(s, end):
            data += chunk
    return Reply(200 if data.count(b"HTTP/1.1 200 OK") == 2 else 400 if data else CLOSED)


def _head(t: Target) -> Reply:
    with connect(t) as s:
        s.sendall(request_bytes(t, "HEAD", "/v1/models"))
        buf = s.recv(65536)
    return Reply(int(buf.split()[1]))


# ---------------------------------------------------------------- slow clients


def _closed_within(s: socket.socket, deadline: float) -> Reply:
    """Reads until the server closes; any answer must come before the deadline."""
    return read_reply(s, deadline)


def _idle(t: Target) -> Reply:
    with connect(t) as s:
        return _closed_within(s, time.monotonic() + t.idle_timeout + 10)


def _slow_headers(t: Target) -> Reply:
    data = request_bytes(t, "GET", "/v1/models")
    end = time.monotonic() + t.idle_timeout + 10
    with connect(t) as s:
        try:
            for i in range(len(data) - 4):  # never completes the headers
                s.sendall(data[i:i + 1])
                s.settimeout(0.5)
                try:
                    if s.recv(1) == b"":
                        return Reply(CLOSED)
                except TimeoutError:
                    pass
                if time.monotonic() > end:
                    raise Hang()
        except (BrokenPipeError, ConnectionResetError):
            return Reply(CLOSED)
        return _closed_within(s, end)


def _slow_body(t: Target) -> Reply:
    body = json.dumps(_chat(t)).encode()
    with connect(t) as s:
        s.sendall(request_bytes(t, "POST", CHAT, body[:10], {"Content-Length": str(len(body))}))
        return read_reply(s, time.monotonic() + t.body_timeout + 10)


def _dribble_body(t: Target) -> Reply:
    """A body one byte at a time, forever: the body deadline still holds."""
    body = json.dumps(_chat(t)).encode() * 1000
    end = time.monotonic() + t.body_timeout + 10
    with connect(t) as s:
        s.sendall(request_bytes(t, "POST", CHAT, b"", {"Content-Length": str(len(body))}))
        for b in body:
            try:
                s.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                return Reply(CLOSED)
            s.settimeout(0.2)
            try:
                head = s.recv(65536)
                if head == b"":
                    return Reply(CLOSED)
                return Reply(int(head.split()[1]), body=head.split(b"\r\n\r\n", 1)[-1])
            except TimeoutError:
                pass
            if time.monotonic() > end:
                raise Hang()
        raise Hang()


def _never_reads(t: Target) -> Reply:
    """A stream whose client never reads: the server must cut it, not buffer it all."""
    body = json.dumps({"model": t.model, "messages": [{"role": "user", "content": "go"}], "stream": True,
                       "n": 4, "max_tokens": max(16, (t.context_len or 4096) - 64), "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 20, "temperature": 1.0}).encode()
    with connect(t, rcvbuf=4096) as s:
        s.sendall(request_bytes(t, "POST", CHAT, body))
        time.sleep(t.write_timeout + 15)  # the buffers fill, then the write deadline passes
        data = b""
        end = time.monotonic() + 30
        try:
            while True:
                chunk = _recv_until(s, end)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
    if not data.startswith(b"HTTP/1.1 200"):
        return Reply(int(data.split()[1]) if data else CLOSED)
    return Reply(200 if b"data: [DONE]" in data else CUT)


def _recv_until(s: socket.socket, end: float) -> bytes:
    s.settimeout(max(0.01, end - time.monotonic()))
    try:
        return s.recv(1 << 20)
    except TimeoutError:
        raise Hang() from None


def _flood(t: Target) -> Reply:
    """More idle connections than the server allows: it closes the oldest idle ones (not waiting
    for the idle timeout) and still answers a new request."""
    socks = []
    extra = 50
    try:
        for _ in range(t.max_connections + extra):
            try:
                socks.append(connect(t, 5))
            except OSError:
                break
        time.sleep(min(0.3, t.idle_timeout / 4))
        closed = sum(_is_closed(s) for s in socks)
        r = exchange(t, request_bytes(t, "GET", "/v1/models"), 30)
        if r.status == 200 and closed < extra - 5:  # a few may be counted before their close lands
            return Reply(400, body=f"only {closed} of {len(socks)} idle connections were closed".encode())
        return r
    finally:
        for s in socks:
            s.close()


def _is_closed(s: socket.socket) -> bool:
    s.setblocking(False)  # a peek, not a wait
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def slow_cases(t: Target) -> list[Case]:
    idle = t.idle_timeout + 15
    out = [
        Case("idle-connection", "slow", (CLOSED, 408), run=_idle, timeout=idle),
        Case("slow-headers", "slow", (CLOSED, 400, 408), run=_slow_headers, timeout=idle),
        Case("slow-body", "slow", (408, CLOSED), run=_slow_body, timeout=t.body_timeout + 15),
        Case("dribble-body", "slow", (408, CLOSED), run=_dribble_body, timeout=t.body_timeout + 15),
        Case("stream-never-read", "slow", (CUT,), run=_never_reads, timeout=t.write_timeout + 40),
    ]
    if t.max_connections:
        out.append(Case("connection-flood", "slow", (200,), run=_flood, timeout=60, alone=True))
    return out


def build_cases(t: Target) -> list[Case]:
    # slow ones first: they run in parallel with the rest
    return (slow_cases(t) + body_cases() + value_cases(t) + unicode_cases(t) + special_token_cases()
            + size_cases(t) + header_cases(t) + framing_cases())
