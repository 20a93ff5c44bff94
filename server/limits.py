"""Bounds on what one client can make the server hold or do: request size before tokenizing,
concurrent tokenizations, body and idle deadlines, connections, and a stream's unsent output.

A prompt's token count is bounded cheaply before the tokenizer sees it: every token is at least
one UTF-8 byte and at most the vocabulary's longest token, so the text's length alone settles
most oversized prompts; the rest are tokenized in pieces that stop once the count is past the
context, so no request holds millions of token ids to learn that it does not fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import weakref
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

from .protocol import APIError, GenRequest, bad, short

T = TypeVar("T")


def _default_max_connections() -> int:
    """Leave descriptors for the model files, the engine and the state cache."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - 128))


@dataclass
class Limits:
    idle_timeout_s: float = 15.0  # a connection with no complete request (headers) in this long closes
    body_timeout_s: float = 30.0  # a request body must arrive within this
    max_connections: int = 0  # 0: from the descriptor limit; at the cap the oldest idle ones close
    tokenize_threads: int = 4  # tokenizations at once (each may hold a prompt's ids)
    tokenize_waiting: int = 64  # past this many large prompts (> piece_chars) waiting, 429
    big_body_bytes: int = 1 << 20  # bodies larger (or of unknown length) are read a few at a time
    big_body_reads: int = 16
    big_body_waiting: int = 256  # past this many waiting, 429
    stream_write_timeout_s: float = 30.0  # a stream whose client does not read for this long is cut
    stream_buffer_bytes: int = 4 << 20  # unsent bytes of one stream before it is cut
    stream_sndbuf: int = 256 << 10  # a stream socket's kernel send buffer (0: the system's autotuning)
    piece_chars: int = 1 << 16  # a large prompt is counted in pieces of about this size

    def __post_init__(self) -> None:
        if self.max_connections <= 0:
            self.max_connections = _default_max_connections()


LIMITS = web.AppKey("dsuf_limits", Limits)


def of(app: web.Application) -> Limits:
    lim = app.get(LIMITS)
    return lim if lim is not None else Limits()


def check_capacity(gen: GenRequest, vocab: int, capacity: int) -> None:
    """What parsing could not check without the model and the server: logit_bias ids inside the
    vocabulary, and a request that fits the server at all (more sequences than the batch and the
    queue together hold would get 429 forever)."""
    for tid, _ in gen.sampling.logit_bias:
        if not 0 <= tid < vocab:
            raise bad(f"'logit_bias' keys must be token ids in [0, {vocab}), got {short(tid)}", "logit_bias")
    seqs = gen.n * max(1, len(gen.prompts))
    if seqs > capacity:
        raise bad(f"this request asks for {seqs} sequences; this server runs at most {capacity} at once", "n")


async def read_body(request: web.Request, lim: Limits) -> bytes:
    """The request body within the body deadline; a body that cannot be read (corrupt gzip,
    broken chunked framing, cut short) is a 400, one that does not arrive in time a 408. Either
    way the connection closes after the answer: the rest of the body is not worth waiting for.
    Large bodies (and compressed ones, and ones of unknown length) are read a few at a time, so
    many connections cannot each hold a body of client_max_size at once."""
    if not request.can_read_body:
        return b""
    size = request.content_length
    if size is not None and size <= lim.big_body_bytes and "Content-Encoding" not in request.headers:
        return await _read(request, lim)  # small, and not compressed (which could inflate it)
    async with _gate("body", lim.big_body_reads, lim.big_body_waiting, "large request bodies").slot():
        return await _read(request, lim)


async def _read(request: web.Request, lim: Limits) -> bytes:
    try:  # raises 413 past client_max_size (after decompression too)
        async with asyncio.timeout(lim.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {lim.body_timeout_s:g} s",
                       code="request_timeout", close=True) from None
    except (HttpProcessingError, ClientPayloadError, web.RequestPayloadError, zlib.error, EOFError,
            ValueError) as e:
        raise APIError(400, f"cannot read the request body: {short(str(e) or type(e).__name__)}",
                       close=True) from None


# ---------------------------------------------------------------- gates


class _Gate:
    """At most `slots` holders at once on this event loop; past `waiting` waiting, 429 (for
    holders that count: small requests wait without a cap, their memory is bounded by the
    connection cap)."""

    def __init__(self, slots: int, waiting: int, what: str):
        self.sem = asyncio.Semaphore(max(1, slots))
        self.max_waiting = max(0, waiting)
        self.waiting = 0
        self.what = what

    @contextlib.asynccontextmanager
    async def slot(self, capped: bool = True) -> AsyncIterator[None]:
        if capped and self.sem.locked() and self.waiting >= self.max_waiting:
            raise APIError(429, f"too many {self.what} in progress; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.waiting += 1
        try:
            await self.sem.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self.sem.release()


_GATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _gate(name: str, slots: int, waiting: int, what: str) -> _Gate:
    """The event loop's gate of that name (made with these sizes on first use)."""
    gates = _GATES.setdefault(asyncio.get_running_loop(), {})
    if name not in gates:
        gates[name] = _Gate(slots, waiting, what)
    return gates[name]


async def tokenize(lim: Limits, fn: Callable[..., T], *args: Any, chars: int = 0) -> T:
    """fn(*args) in a worker thread, bounded in concurrency per event loop. Only large prompts
    (over piece_chars characters) count against the waiting cap: a burst of ordinary requests
    queues here as it would in the scheduler."""
    gate = _gate("tokenize", lim.tokenize_threads, lim.tokenize_waiting, "tokenizations")
    async with gate.slot(capped=chars > lim.piece_chars):
        return await asyncio.to_thread(fn, *args)


# ---------------------------------------------------------------- prompt size


_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (its byte-level form: one char per byte, so
    at least its text's length), special tokens included. Computed once per tokenizer."""
    n = _LONGEST.get(tokenizer)
    if n is None:
        lengths = (len(tokenizer.id_to_token(i) or "") for i in range(int(tokenizer.vocab_size)))
        n = _LONGEST[tokenizer] = max(1, max(lengths, default=1))
    return n


def too_long(tokens: str, context_len: int, param: str) -> APIError:
    return bad(f"This model's maximum context length is {context_len} tokens; the prompt has {tokens} "
               "tokens, leaving no room for output", param, code="context_length_exceeded")


def check_chars(n_chars: int, context_len: int, longest: int, param: str) -> None:
    """A text longer than context_len tokens of the longest kind cannot fit: refused untokenized."""
    if n_chars > context_len * longest:
        raise too_long(f"more than {context_len}", context_len, param)


def _pieces(text: str, size: int) -> list[tuple[int, int]]:
    """Spans of about `size` characters, cut before whitespace where one is near, so a piece's
    tokens are (nearly) those of the whole text there."""
    spans, a = [], 0
    while a < len(text):
        b = min(len(text), a + size)
        if b < len(text):
            cut = max(text.rfind(" ", b - 1024, b), text.rfind("\n", b - 1024, b))
            b = cut if cut > a else b
        spans.append((a, b))
        a = b
    return spans


def encode_bounded(encode: Callable[[str], list[int]], text: str, context_len: int, piece_chars: int,
                   param: str) -> list[int]:
    """encode(text), refused (context_length_exceeded) without holding all its ids when it is far
    past the context (check_tokens). Runs in a worker thread."""
    check_tokens(encode, text, context_len, piece_chars, param)
    return encode(text)


def check_tokens(encode: Callable[[str], list[int]], text: str, context_len: int, piece_chars: int,
                 param: str) -> None:
    """Refuses a text far past the context without holding all its ids: texts that surely fit (no
    more UTF-8 bytes than context_len) pass at once; others are counted in pieces, stopping once
    the count passes the context."""
    if len(text) * 4 <= context_len or len(text) <= piece_chars or len(text.encode()) <= context_len:
        return
    count = 0
    spans = _pieces(text, piece_chars)
    for k, (a, b) in enumerate(spans):
        count += len(encode(text[a:b]))
        # a cut may split what the whole text would merge: allow a few tokens per cut
        if count > context_len + 4 * (k + 1):
            raise too_long(f"more than {context_len}", context_len, param)
