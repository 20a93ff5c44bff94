"""Per-sequence output processing and the SSE writer.

Token ids come in one at a time (from the scheduler, on the event loop) and leave as deltas of
reasoning / content / tool calls. Three stages, each holding back only what it must:
  detokenizer  -> text, never splitting a UTF-8 character; control tokens dropped unless structural
  StopMatcher  -> stop strings found across token boundaries (text that could start one waits)
  OutputParser -> reasoning until `</think>`, content, DSML tool-call blocks -> OpenAI tool_calls
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.text import output_parser as chat_encoding
from engine.text.chat_encoding import DSML, THINK_END


def _partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of markers."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


class Detokenizer:
    """The tokenizer's incremental decoder. A generated control token (BOS, <｜User｜>, a stray
    `</think>`, ...) is dropped, so its text never reaches content, unless `keep(id)` says it is
    structural here: the parser acts on the spellings of `</think>` and `｜DSML｜`."""

    def __init__(self, tokenizer: Any, keep: Callable[[int], bool] | None = None):
        self._dec = tokenizer.stream_decoder(skip_special_tokens=False)
        self._control: frozenset[int] = getattr(tokenizer, "control_ids", frozenset())
        self._keep = keep

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._control and not (self._keep is not None and self._keep(token_id)):
            return ""
        return self._dec.push(token_id)

    def flush(self) -> str:
        return self._dec.flush()


class StopMatcher:
    """Finds stop strings in a stream of text pieces, holding back only possible stop prefixes."""

    def __init__(self, stops: list[str]):
        self.stops = tuple(s for s in stops if s)
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped). On a stop, the stop string and all after it go."""
        if not self.stops:
            return text, False
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        hold = _partial_suffix(self.buf, self.stops)
        cut = len(self.buf) - hold
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: Delta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


class OutputParser:
    """Generated text -> Deltas of reasoning, content and tool calls.

    Chat with tools offered: engine.text.chat_encoding's DSML parser (both V4 and V4.1 dialects).
    Otherwise only the `</think>` split (thinking mode), so a tool block nobody asked for stays
    text. Completions (thinking=False, tools=False) pass text through as content.
    """

    def __init__(self, thinking: bool, tools: bool):
        self._dsml = chat_encoding.OutputParser(thinking=thinking) if tools else None
        self._reasoning = thinking
        self.tools = tools
        self._buf = ""
        self.n_tool_calls = 0

    @property
    def in_reasoning(self) -> bool:
        return self._dsml.in_reasoning if self._dsml is not None else self._reasoning

    def push(self, text: str) -> Delta:
        if self._dsml is not None:
            return self._events(self._dsml.feed(text))
        if not self._reasoning:
            return Delta(content=text)
        self._buf += text
        i = self._buf.find(THINK_END)
        if i >= 0:
            d = Delta(reasoning=self._buf[:i], content=self._buf[i + len(THINK_END):])
            self._buf, self._reasoning = "", False
            return d
        cut = len(self._buf) - _partial_suffix(self._buf, (THINK_END,))
        d = Delta(reasoning=self._buf[:cut])
        self._buf = self._buf[cut:]
        return d

    def finish(self) -> Delta:
        if self._dsml is not None:
            return self._events(self._dsml.finish())
        d = Delta(reasoning=self._buf) if self._reasoning else Delta(content=self._buf)
        self._buf = ""
        return d

    def _events(self, events: list) -> Delta:
        d = Delta()
        for e in events:
            if isinstance(e, chat_encoding.ReasoningDelta):
                d.reasoning += e.text
            elif isinstance(e, chat_encoding.ContentDelta):  # a malformed block's DSML tokens too
                d.content += e.text.replace(DSML, "")
            elif isinstance(e, chat_encoding.ToolCallStart):  # streamed as it is written
                d.tool_calls.append({"index": self.n_tool_calls, "id": "call_" + uuid.uuid4().hex[:24],
                                     "type": "function", "function": {"name": e.name, "arguments": ""}})
                self.n_tool_calls += 1
            elif isinstance(e, (chat_encoding.ToolCallArgs, chat_encoding.ToolCallAbort)):
                text = e.text if isinstance(e, chat_encoding.ToolCallArgs) else e.closing
                last = d.tool_calls[-1] if d.tool_calls else None
                if last is not None and last["index"] == self.n_tool_calls - 1:
                    last["function"]["arguments"] += text  # one entry per call per chunk
                else:
                    d.tool_calls.append({"index": self.n_tool_calls - 1, "function": {"arguments": text}})
        return d


class OutputProcessor:
    """Token ids of one sequence -> Deltas, with stop-string detection."""

    def __init__(self, tokenizer: Any, *, stop: list[str], thinking: bool, tools: bool):
        ids = getattr(tokenizer, "special_ids", {})
        self._think_end, self._dsml = ids.get("think_end"), ids.get("dsml") if tools else None
        self.detok = Detokenizer(tokenizer, self._structural)
        self.stop = StopMatcher(stop)
        self.parser = OutputParser(thinking, tools)

    def _structural(self, token_id: int) -> bool:
        """`</think>` while reasoning is open; `｜DSML｜` in the answer when tools are offered."""
        if token_id == self._think_end:
            return self.parser.in_reasoning
        return token_id == self._dsml and not self.parser.in_reasoning

    def push(self, token_id: int) -> tuple[Delta, bool]:
        piece, stopped = self.stop.push(self.detok.push(token_id))
        return self.parser.push(piece), stopped

    def finish(self, stopped: bool) -> Delta:
        """Flush. After a stop string, held-back text is part of the stop and is dropped."""
        d = Delta()
        if not stopped:
            piece, hit = self.stop.push(self.detok.flush())
            if not hit:
                piece += self.stop.flush()
            d.extend(self.parser.push(piece))
        d.extend(self.parser.finish())
        return d

    @property
    def has_tool_calls(self) -> bool:
        return self.parser.n_tool_calls > 0


# ---------------------------------------------------------------- SSE


class SSEWriter:
    """`text/event-stream` response: `data: {json}` frames, `: keep-alive` comments, `[DONE]`.

    A client that stops reading must not make the server hold its output without bound: a write
    that cannot drain within the write deadline, or unsent bytes past the buffer cap, cut the
    connection and raise ConnectionResetError (the handler then cancels the sequences)."""

    def __init__(self, request: web.Request, limits: Any = None):
        self.request = request
        self.write_timeout_s = getattr(limits, "stream_write_timeout_s", 30.0)
        self.max_buffer = getattr(limits, "stream_buffer_bytes", 4 << 20)
        self.sndbuf = getattr(limits, "stream_sndbuf", 0)
        self.resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
            },
        )
        self.started = False

    async def start(self) -> None:
        await self.resp.prepare(self.request)
        self.started = True
        sock = self.request.transport.get_extra_info("socket") if self.request.transport else None
        if sock is not None and self.sndbuf:  # the kernel's autotuned buffer would hold megabytes unsent
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)

    def _cut(self, why: str) -> ConnectionResetError:
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        return ConnectionResetError(f"stream cut: {why}")

    async def _write(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client went away")
        if transport.get_write_buffer_size() + len(data) > self.max_buffer:
            raise self._cut("the client is not reading")
        try:  # asyncio.timeout: a timer per write, not a task as wait_for makes
            async with asyncio.timeout(self.write_timeout_s):
                await self.resp.write(data)
        except TimeoutError:
            raise self._cut(f"no progress writing for {self.write_timeout_s:g} s") from None

    async def send(self, obj: dict) -> None:
        await self._write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    async def keepalive(self) -> None:
        await self._write(b": keep-alive\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        async with asyncio.timeout(self.write_timeout_s):
            await self.resp.write_eof()
