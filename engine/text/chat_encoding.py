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


# A prompt is a list of segments (text, trusted). Trusted text is the template's own, whose
# spelled control tokens become control ids; everything a client sent (contents, names,
# arguments, schemas, reasoning sent back) is untrusted and is tokenized as plain text.
Segment = tuple[str, bool]


def _t(text: str) -> Segment:
    return (text, True)


def _u(text: str) -> Segment:
    return (text, False)


def _tools_section(functions: list[dict], d: Dialect) -> list[Segment]:
    b, i, p = d.block, d.invoke, d.param
    schemas = "\n".join(to_json(f) for f in functions)
    return [_t(
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
    ), _u(schemas), _t(
        "\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
        "calls.\n"
    )]


def _extras(msg: dict, d: Dialect) -> list[Segment]:
    """Tools and response-format sections appended to a system/developer message."""
    out: list[Segment] = []
    if msg.get("tools"):
        out += [_t("\n\n"), *_tools_section([t.get("function", t) for t in msg["tools"]], d)]
    if msg.get("response_format"):
        out += [_t("\n\n" + RESPONSE_FORMAT_HEADER), _u(to_json(msg["response_format"]))]
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


def _tool_call_segments(calls: list[dict], arch: Arch) -> list[Segment]:
    """DSML block for OpenAI-style tool calls ({"function": {"name", "arguments"}} or flat)."""
    d = DIALECTS[arch]
    out = [_t(f"<{DSML}{d.block}>")]
    for call in calls:
        fn = call.get("function", call)
        out += [_t(f'\n<{DSML}{d.invoke} name="'), _u(str(fn.get("name"))), _t('">\n')]
        for n, (key, value) in enumerate(_call_arguments(fn.get("arguments", "{}"), arch).items()):
            is_str = isinstance(value, str)
            out += [
                _t(("\n" if n else "") + f'<{DSML}{d.param} name="'), _u(str(key)),
                _t(f'" string="{"true" if is_str else "false"}">'), _u(value if is_str else to_json(value)),
                _t(f"</{DSML}{d.param}>"),
            ]
        out.append(_t(f"\n</{DSML}{d.invoke}>"))
    out.append(_t(f"\n</{DSML}{d.block}>"))
    return out


def render_tool_calls(calls: list[dict], arch: Arch) -> str:
    """DSML block for OpenAI-style tool calls, as text."""
    return "".join(text for text, _ in _tool_call_segments(calls, arch))


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


def encode_messages(messages: list[dict], **kwargs: Any) -> str:
    """Prompt text of `render_messages` (the reference encoders' output, byte for byte)."""
    return "".join(text for text, _ in render_messages(messages, **kwargs))


def render_messages(
    messages: list[dict],
    *,
    arch: Arch,
    thinking: bool,
    reasoning_effort: str | int | None = None,
    tools: list | None = None,
    response_format: Any = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """Prompt segments (starting with BOS) for an OpenAI-style conversation; tokenize them
    with engine.text.tokenizer.Tokenizer.encode_segments.

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

    out = [_t(BOS)]
    for index, turn in enumerate(turns):
        role = turn.get("role")
        if index == 0:
            if arch == "v41" and (prefix or role == "system"):
                out.append(_t(SYSTEM))
            out.append(_t(prefix))
        if role == "system":
            if arch == "v41" and index > 0:
                out.append(_t(SYSTEM))
            out += [_u(_text_of(turn.get("content"))), *_extras(turn, d)]
        elif role == "developer":
            if not turn.get("content"):
                raise ValueError("developer message needs content")
            out += [_t(USER), _u(_text_of(turn["content"])), *_extras(turn, d)]
        elif role == "user":
            out.append(_t(USER))
            for n, (kind, _, text) in enumerate(turn["parts"]):
                if n:
                    out.append(_t("\n\n"))
                out += [_t("<tool_result>"), _u(text), _t("</tool_result>")] if kind == "tool" else [_u(text)]
        elif role == "latest_reminder":
            out += [_t(LATEST_REMINDER), _u(_text_of(turn.get("content")))]
        elif role == "assistant":
            if thinking and (not drop or index > last_user):
                out += [_u(turn.get("reasoning_content") or ""), _t(THINK_END)]
            out.append(_u(_text_of(turn.get("content"))))
            if turn.get("tool_calls"):
                out += [_t("\n\n"), *_tool_call_segments(turn["tool_calls"], arch)]
            if not turn.get("wo_eos"):
                out.append(_t(EOS))
        else:
            raise ValueError(f"unknown role {role!r}")

        nxt = turns[index + 1].get("role") if index + 1 < len(turns) else None
        if nxt not in (None, "assistant", "latest_reminder") or not _is_turn_end(turn, index, arch):
            continue
        if nxt is None and not add_generation_prompt:
            continue
        out.append(_t(ASSISTANT))
        out.append(_t(THINK_START if thinking and (not drop or index >= last_user) else THINK_END))
    return [seg for seg in out if seg[0]]


def __getattr__(name: str) -> object:
    """The output parser's names, which lived here first, from engine/text/output_parser.py."""
    from engine.text import output_parser

    try:
        return getattr(output_parser, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None

