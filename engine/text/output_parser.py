"""Incremental parser of DeepSeek-V4 / V4.1 model output: reasoning, content, DSML tool calls.

The counterpart of engine/text/chat_encoding.py's prompt rendering (which re-exports these
names). It works on decoded text: the control tokens it acts on (`</think>`, `｜DSML｜`) reach
it as their spellings, and the server's detokenizer passes only those, where they are structural.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.text.chat_encoding import DIALECTS, EOS, THINK_END, Dialect, to_json


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text


# Streaming view of the same calls, for clients that show a call as it is written: a start as
# soon as an invoke's name is known, then argument text as each parameter completes. The
# fragments of one call concatenate to its ToolCall.arguments. An announced invoke that turns
# out malformed (it then reaches the output as content, like any malformed block) ends with
# ToolCallAbort, after which the streamed arguments must be closed by the consumer.
@dataclass(frozen=True)
class ToolCallStart:
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    text: str


@dataclass(frozen=True)
class ToolCallAbort:
    closing: str  # text that makes the arguments streamed so far a JSON object


Event = ReasoningDelta | ContentDelta | ToolCall | ToolCallStart | ToolCallArgs | ToolCallAbort

# Both dialects are accepted: a server may host either, and the tags cannot collide.
_BLOCK_TAGS = {d.open(d.block) + ">": d for d in DIALECTS.values()}
_CONTENT_STOPS = [EOS] + [p + t for t in _BLOCK_TAGS for p in ("\n\n", "")]
_WS = " \t\r\n"


def _argument_item(key: str, is_str: str, value: str) -> str:
    """One `"key": value` of the arguments JSON; string="false" values kept verbatim."""
    if is_str != "true":
        try:
            json.loads(value)
        except ValueError:
            is_str = "true"  # not JSON after all: keep it as a string
    return f"{to_json(key)}: {to_json(value) if is_str == 'true' else value}"


def _arguments_json(params: list[tuple[str, str, str]]) -> str:
    """Arguments JSON in the reference's layout."""
    return "{" + ", ".join(_argument_item(*p) for p in params) + "}"


def _invoke_head(d: Dialect) -> re.Pattern:
    return re.compile(re.escape(d.open(d.invoke)) + r' name="([^"\n]*)">')


def _param_re(d: Dialect) -> re.Pattern:
    return re.compile(
        r'\s*' + re.escape(d.open(d.param)) + r' name="([^"\n]*)" string="(true|false)">(.*?)'
        + re.escape(d.close(d.param)),
        re.DOTALL,
    )


def _parse_invoke(text: str, d: Dialect) -> ToolCall | None:
    """One complete `<｜DSML｜invoke ...>...</｜DSML｜invoke>`; None when malformed."""
    head = _invoke_head(d).match(text)
    if head is None or not text.endswith(d.close(d.invoke)):
        return None
    body = text[head.end() : len(text) - len(d.close(d.invoke))]
    param = _param_re(d)
    params, pos = [], 0
    while (m := param.match(body, pos)) is not None:
        params.append(m.groups())
        pos = m.end()
    if body[pos:].strip(_WS) or len({k for k, _, _ in params}) != len(params):
        return None
    return ToolCall(name=head.group(1), arguments=_arguments_json(params))


def _held_suffix(buf: str, tags: list[str]) -> int:
    """Length of the longest tail of `buf` that could still grow into one of `tags`."""
    for n in range(min(len(buf), max(map(len, tags)) - 1), 0, -1):
        tail = buf[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


class OutputParser:
    """Incremental parser of one assistant answer: feed text pieces, get events.

    Reasoning ends at `</think>` (thinking mode only); a DSML block becomes ToolCall events
    as each invoke completes; text that may be the start of a tag is held back, so a
    partial tag never reaches content. A malformed block is passed through as content.
    """

    def __init__(self, thinking: bool = False) -> None:
        self._mode = "reasoning" if thinking else "content"
        self._buf = ""
        self._dialect: Dialect | None = None
        self._streamed: list[str] | None = None  # keys of the open invoke's streamed parameters
        self._stream_pos = 0  # where in the open invoke's text the next parameter starts

    @property
    def in_reasoning(self) -> bool:
        """Whether `</think>` is still to come (what the detokenizer keeps it for)."""
        return self._mode == "reasoning"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        if self._buf and self._mode != "done":
            cls = ReasoningDelta if self._mode == "reasoning" else ContentDelta
            events.append(cls(self._buf))
        self._buf = ""
        self._mode = "done"
        return events

    def _emit(self, events: list[Event], text: str) -> None:
        if text:
            events.append(ReasoningDelta(text) if self._mode == "reasoning" else ContentDelta(text))

    def _step(self, events: list[Event], final: bool) -> bool:
        """Consume what can be decided from the buffer; True when progress was made."""
        buf = self._buf
        if self._mode == "done":
            self._buf = ""
            return False
        if self._mode == "raw":
            self._emit(events, buf)
            self._buf = ""
            return False
        if self._mode in ("reasoning", "content"):
            stops = [THINK_END] if self._mode == "reasoning" else _CONTENT_STOPS
            found = [(buf.find(s), -len(s), s) for s in stops if s in buf]
            if found:
                pos, _, stop = min(found)
                self._emit(events, buf[:pos])
                self._buf = buf[pos + len(stop) :]
                if self._mode == "reasoning":
                    self._mode = "content"
                elif stop == EOS:
                    self._mode = "done"
                else:
                    self._mode, self._dialect = "tools", _BLOCK_TAGS[stop.lstrip("\n")]
                return True
            held = 0 if final else _held_suffix(buf, stops)
            self._emit(events, buf[: len(buf) - held])
            self._buf = buf[len(buf) - held :]
            return False
        # Inside a tool-call block.
        d = self._dialect
        assert d is not None
        body = buf.lstrip(_WS)
        if not body:
            self._buf = "" if final else buf
            return False
        end_tag, invoke_tag = d.close(d.block), d.open(d.invoke) + ' name="'
        if body.startswith(end_tag):
            self._buf, self._mode = body[len(end_tag) :], "content"
            return True
        if body.startswith(invoke_tag):
            close = body.find(d.close(d.invoke))
            self._stream_invoke(events, body if close < 0 else body[:close], d)
            if close >= 0:
                call = _parse_invoke(body[: close + len(d.close(d.invoke))], d)
                if call is not None:
                    self._end_invoke(events, call)
                    events.append(call)
                    self._buf = body[close + len(d.close(d.invoke)) :]
                    return True
            elif not final:
                return False
            self._end_invoke(events, None)
        elif not final and (end_tag.startswith(body) or invoke_tag.startswith(body)):
            return False
        self._mode = "raw"  # malformed (or cut off): hand the rest over as plain content
        self._buf = buf
        return True

    # ---- streaming view of an invoke (ToolCallStart / ToolCallArgs / ToolCallAbort) ----------
    def _stream_invoke(self, events: list[Event], text: str, d: Dialect) -> None:
        """Announce the invoke once its name is known and stream each newly completed
        parameter; `text` is the invoke so far (without its close tag). Completed parts never
        change as text arrives, so this is the same however the answer is split."""
        if self._streamed is None:
            head = _invoke_head(d).match(text)
            if head is None:
                return
            events.append(ToolCallStart(head.group(1)))
            self._streamed, self._stream_pos = [], head.end()
        param = _param_re(d)  # resume after the last streamed parameter: completed ones never change
        while (m := param.match(text, self._stream_pos)) is not None:
            key, is_str, value = m.groups()
            if key in self._streamed:  # a repeated key: the invoke is malformed, stream no more
                return
            events.append(ToolCallArgs(("{" if not self._streamed else ", ") + _argument_item(key, is_str, value)))
            self._streamed.append(key)
            self._stream_pos = m.end()

    def _end_invoke(self, events: list[Event], call: ToolCall | None) -> None:
        if self._streamed is None:
            return
        closing = "}" if self._streamed else "{}"
        events.append(ToolCallArgs(closing) if call is not None else ToolCallAbort(closing))
        self._streamed = None


@dataclass
class ParsedOutput:
    reasoning: str
    content: str
    tool_calls: list[dict]


def parse_output(text: str, *, thinking: bool) -> ParsedOutput:
    """One-shot parse of a complete answer (the same machine as the streaming parser)."""
    parser = OutputParser(thinking=thinking)
    events = parser.feed(text) + parser.finish()
    return ParsedOutput(
        reasoning="".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        content="".join(e.text for e in events if isinstance(e, ContentDelta)),
        tool_calls=[
            {"name": e.name, "arguments": e.arguments} for e in events if isinstance(e, ToolCall)
        ],
    )


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content, [{"name", "arguments"}]) of answer text that follows the reasoning."""
    parsed = parse_output(text, thinking=False)
    return parsed.content, parsed.tool_calls


def split_reasoning(text: str, thinking: bool = True) -> tuple[str, str]:
    """(reasoning, rest) split at the first `</think>`; without one a thinking answer is
    all reasoning (cut off) and a chat answer all content."""
    if not thinking:
        return "", text
    reasoning, sep, rest = text.partition(THINK_END)
    return (reasoning, rest) if sep else (text, "")
