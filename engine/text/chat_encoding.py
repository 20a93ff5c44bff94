"""DeepSeek-V4 / V4.1 chat prompt encoding and model-output parsing.

Our own implementation of the format DeepSeek ships as `encoding_dsv4.py` (V4) and
`encoding.py` (V4.1); tests compare it byte for byte with outputs of the public
reference encoders (tests/fixtures/chat). V4.1 differs from V4 in: a `<｜System｜>` turn
token (a mid-conversation system message is a turn that gets an answer), a numeric
"Reasoning Effort" line in thinking mode (always, default "high"), and DSML tag names
with a leading space (`<｜DSML｜ calls>` instead of `<｜DSML｜tool_calls>`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

Arch = Literal["v4", "v41"]


@dataclass(frozen=True)
class Dialect:
    """DSML tag names of one architecture."""

    block: str
    invoke: str
    param: str

    def open(self, tag: str) -> str:
        return f"<{DSML}{tag}"

    def close(self, tag: str) -> str:
        return f"</{DSML}{tag}>"


DIALECTS: dict[str, Dialect] = {
    "v4": Dialect(block="tool_calls", invoke="invoke", param="parameter"),
    "v41": Dialect(block=" calls", invoke=" invoke", param=" parameter"),
}

# V4.1 budgets as in the released checkpoint encoder (DESIGN.md). sglang's copy carries a
# runtime pin with low=25/high=50/xhigh=75 instead; we follow the checkpoint.
V41_EFFORT_BUDGETS = {"low": 50, "high": 75, "max": 100}
V41_DEFAULT_EFFORT = "high"
V4_EFFORTS = (None, "high", "max")

V4_MAX_EFFORT_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

RESPONSE_FORMAT_HEADER = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)

# Roles that survive reasoning-dropping even before the last user turn.
_KEEP_ROLES = {"user", "system", "tool", "latest_reminder", "direct_search_results"}


def to_json(value: Any) -> str:
    """JSON as the reference writes it: non-ASCII kept, ASCII escapes only as a fallback."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (UnicodeEncodeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def _tools_section(functions: list[dict], d: Dialect) -> str:
    b, i, p = d.block, d.invoke, d.param
    schemas = "\n".join(to_json(f) for f in functions)
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools "
        f'by writing a "<{DSML}{b}>" block like the following:\n\n'
        f"<{DSML}{b}>\n"
        f'<{DSML}{i} name="$TOOL_NAME">\n'
        f'<{DSML}{p} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}{p}>\n'
        "...\n"
        f"</{DSML}{i}>\n"
        f'<{DSML}{i} name="$TOOL_NAME2">\n'
        "...\n"
        f"</{DSML}{i}>\n"
        f"</{DSML}{b}>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types '
        '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.'
        "\n\n"
        f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
        f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        f"{schemas}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
        "calls.\n"
    )


def _extras(msg: dict, d: Dialect) -> str:
    """Tools and response-format sections appended to a system/developer message."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + _tools_section([t.get("function", t) for t in msg["tools"]], d)
    if msg.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT_HEADER + to_json(msg["response_format"])
    return out


def _call_arguments(raw: Any, arch: str) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw)
    except (TypeError, ValueError) as err:
        if arch == "v41":
            raise ValueError(f"tool call arguments are not valid JSON: {raw!r}") from err
        args = {"arguments": raw}  # V4 wraps unparsable arguments as one string parameter
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return args


def render_tool_calls(calls: list[dict], arch: Arch) -> str:
    """DSML block for OpenAI-style tool calls ({"function": {"name", "arguments"}} or flat)."""
    d = DIALECTS[arch]
    invokes = []
    for call in calls:
        fn = call.get("function", call)
        params = []
        for key, value in _call_arguments(fn.get("arguments", "{}"), arch).items():
            is_str = isinstance(value, str)
            text = value if is_str else to_json(value)
            params.append(
                f'<{DSML}{d.param} name="{key}" string="{"true" if is_str else "false"}">'
                f"{text}</{DSML}{d.param}>"
            )
        body = "\n".join(params)
        invokes.append(f'<{DSML}{d.invoke} name="{fn.get("name")}">\n{body}\n</{DSML}{d.invoke}>')
    return f"<{DSML}{d.block}>\n" + "\n".join(invokes) + f"\n</{DSML}{d.block}>"


def _text_of(content: Any) -> str:
    """Message content as text: OpenAI content-part lists join their text parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n\n".join(
            p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
            for p in content
        )
    return content


def _merge_tool_results(messages: list[dict], arch: str) -> list[dict]:
    """Fold `tool` messages and runs of user messages into single user turns.

    There is no tool role: results become `<tool_result>` parts of the next user turn, put
    in the order of the calls of the latest assistant message that made calls.
    """
    turns: list[dict] = []
    for msg in messages:
        role = msg.get("role")
        if role == "tool":
            part = ("tool", msg.get("tool_call_id", ""), _text_of(msg.get("content")))
        elif role == "user":
            part = ("text", "", _text_of(msg.get("content")))
        else:
            turns.append(dict(msg))
            continue
        prev = turns[-1] if turns else None
        if prev is not None and prev.get("role") == "user" and "parts" in prev:
            prev["parts"].append(part)
        elif role == "tool":
            turns.append({"role": "user", "parts": [part]})
        else:
            # V4 keeps only a few fields of a user message; V4.1 keeps them all.
            base = dict(msg) if arch == "v41" else {k: msg[k] for k in ("wo_eos",) if k in msg}
            base.update(role="user", parts=[part])
            turns.append(base)
    return _apply_call_order(turns)


def _apply_call_order(turns: list[dict]) -> list[dict]:
    """Reorder tool results inside each user turn by the preceding calls' order."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.get("role") == "assistant" and turn.get("tool_calls"):
            order = {}
            for n, call in enumerate(turn["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = n
        elif "parts" in turn:
            results = [p for p in turn["parts"] if p[0] == "tool"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda p: order.get(p[1], 0)))
                turn["parts"] = [next(ranked) if p[0] == "tool" else p for p in turn["parts"]]
    return turns


def _is_turn_end(turn: dict, index: int, arch: str) -> bool:
    """Whether an assistant answer follows this turn (V4.1: also a non-leading system)."""
    role = turn.get("role")
    return role in ("user", "developer") or (arch == "v41" and role == "system" and index > 0)


def _last_user_index(turns: list[dict], arch: str) -> int:
    for index in range(len(turns) - 1, -1, -1):
        if _is_turn_end(turns[index], index, arch):
            return index
    return -1


def _effort_prefix(arch: str, thinking: bool, effort: str | int | None) -> str:
    """Text opening the prompt for the reasoning effort; validates it in every mode."""
    if arch == "v4":
        if effort not in V4_EFFORTS:
            raise ValueError(f"invalid reasoning_effort for V4: {effort!r} (None, 'high' or 'max')")
        return V4_MAX_EFFORT_PREFIX if thinking and effort == "max" else ""
    if effort is None:
        effort = V41_DEFAULT_EFFORT
    if isinstance(effort, str) and effort in V41_EFFORT_BUDGETS:
        budget = V41_EFFORT_BUDGETS[effort]
    elif type(effort) is int and 1 <= effort <= 100:  # bool is not a budget
        budget = effort
    else:
        raise ValueError(f"invalid reasoning_effort for V4.1: {effort!r} (1-100 or low/high/max)")
    if not thinking:
        return ""
    return (
        f"Reasoning Effort: {budget} "
        "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    )


def encode_messages(
    messages: list[dict],
    *,
    arch: Arch,
    thinking: bool,
    reasoning_effort: str | int | None = None,
    tools: list | None = None,
    response_format: Any = None,
    add_generation_prompt: bool = True,
) -> str:
    """Prompt text (starting with BOS) for an OpenAI-style conversation.

    `tools` / `response_format` go into the leading system message (one is inserted if the
    conversation has none). Earlier assistant turns lose their reasoning unless tools are
    present; `developer` is a user turn (and, as in the reference, dropped when it comes
    before the last user turn of a thinking-mode conversation without tools).
    """
    if arch not in DIALECTS:
        raise ValueError(f"unknown arch {arch!r}")
    d = DIALECTS[arch]
    prefix = _effort_prefix(arch, thinking, reasoning_effort)
    msgs = [dict(m) for m in messages]
    if tools or response_format:
        if not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": ""})
        if tools:
            msgs[0]["tools"] = tools
        if response_format:
            msgs[0]["response_format"] = response_format

    turns = _merge_tool_results(msgs, arch)
    # Tools in play keep every turn's reasoning (the model may be mid tool loop).
    drop = thinking and not any(t.get("tools") for t in turns)
    if drop:
        last = _last_user_index(turns, arch)
        kept = []
        for index, turn in enumerate(turns):
            if turn.get("role") in _KEEP_ROLES or index >= last:
                kept.append(turn)
            elif turn.get("role") == "assistant":
                kept.append({k: v for k, v in turn.items() if k != "reasoning_content"})
        turns = kept
    last_user = _last_user_index(turns, arch)

    out = [BOS]
    for index, turn in enumerate(turns):
        role = turn.get("role")
        if index == 0:
            if arch == "v41" and (prefix or role == "system"):
                out.append(SYSTEM)
            out.append(prefix)
        if role == "system":
            if arch == "v41" and index > 0:
                out.append(SYSTEM)
            out.append(_text_of(turn.get("content")) + _extras(turn, d))
        elif role == "developer":
            if not turn.get("content"):
                raise ValueError("developer message needs content")
            out.append(USER + _text_of(turn["content"]) + _extras(turn, d))
        elif role == "user":
            out.append(USER)
            out.append(
                "\n\n".join(
                    f"<tool_result>{text}</tool_result>" if kind == "tool" else text
                    for kind, _, text in turn["parts"]
                )
            )
        elif role == "latest_reminder":
            out.append(LATEST_REMINDER + _text_of(turn.get("content")))
        elif role == "assistant":
            if thinking and (not drop or index > last_user):
                out.append((turn.get("reasoning_content") or "") + THINK_END)
            out.append(_text_of(turn.get("content")))
            if turn.get("tool_calls"):
                out.append("\n\n" + render_tool_calls(turn["tool_calls"], arch))
            if not turn.get("wo_eos"):
                out.append(EOS)
        else:
            raise ValueError(f"unknown role {role!r}")

        nxt = turns[index + 1].get("role") if index + 1 < len(turns) else None
        if nxt not in (None, "assistant", "latest_reminder") or not _is_turn_end(turn, index, arch):
            continue
        if nxt is None and not add_generation_prompt:
            continue
        out.append(ASSISTANT)
        out.append(THINK_START if thinking and (not drop or index >= last_user) else THINK_END)
    return "".join(out)


# ---------------------------------------------------------------------------------------
# Parsing model output
# ---------------------------------------------------------------------------------------


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
