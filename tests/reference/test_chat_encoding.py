"""Chat encoding against reference fixtures, and the DSML output parser."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.text.chat_encoding import (
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ToolCall,
    ToolCallAbort,
    ToolCallArgs,
    ToolCallStart,
    encode_messages,
    parse_output,
    parse_tool_calls,
    render_tool_calls,
    split_reasoning,
)

FIXTURES = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures/chat/cases.json").read_text(encoding="utf-8")
)
OPTIONAL = ("tools", "response_format", "reasoning_effort", "add_generation_prompt")


@pytest.mark.parametrize("case", FIXTURES, ids=[c["name"] for c in FIXTURES])
def test_matches_reference(case):
    kwargs = {k: case[k] for k in OPTIONAL if k in case}
    got = encode_messages(case["messages"], arch=case["arch"], thinking=case["thinking"], **kwargs)
    assert got == case["expected"]


def test_fixtures_cover_the_format():
    names = {c["name"] for c in FIXTURES}
    assert len(FIXTURES) >= 25
    for arch in ("v4", "v41"):
        for part in ("tool-loop-think", "developer-think", "response-format-sys", "effort-max-think"):
            assert f"{arch}-{part}" in names


def test_input_messages_not_modified():
    case = next(c for c in FIXTURES if c["name"] == "v41-tool-done-think")
    before = json.dumps(case["messages"])
    encode_messages(case["messages"], arch="v41", thinking=True, tools=case["tools"])
    assert json.dumps(case["messages"]) == before


@pytest.mark.parametrize(
    "arch,effort", [("v4", "low"), ("v4", 50), ("v41", 0), ("v41", 101), ("v41", True), ("v41", "xhigh")]
)
def test_invalid_effort_rejected(arch, effort):
    with pytest.raises(ValueError):
        encode_messages([{"role": "user", "content": "q"}], arch=arch, thinking=True, reasoning_effort=effort)


def test_v41_bad_tool_arguments_rejected():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
    ]
    with pytest.raises(ValueError):
        encode_messages(msgs, arch="v41", thinking=False)
    # V4 wraps unparsable arguments into one string parameter, like its reference.
    assert 'name="arguments" string="true">not json<' in encode_messages(msgs, arch="v4", thinking=False)


# --- parsing ----------------------------------------------------------------------------

CALLS = [
    {"name": "get_weather", "arguments": {"city": "東京", "days": 3}},
    {"name": "search", "arguments": {"q": 'a "b" <c>\nline', "opts": {"n": [1, 2.5, None, True]}}},
    {"name": "noargs", "arguments": {}},
]


def _answer(arch: str, reasoning: str | None, content: str, calls: list[dict]) -> str:
    text = "" if reasoning is None else reasoning + "</think>"
    text += content
    if calls:
        rendered = [{"function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]
        text += "\n\n" + render_tool_calls(rendered, arch)
    return text


ANSWERS = [
    (arch, reasoning, content, calls)
    for arch in ("v4", "v41")
    for reasoning in (None, "think 🤔 hard\n\n", "")
    for content in ("", "Let me check.", "para\n\n")
    for calls in ([], CALLS[:1], CALLS)
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_parser_round_trips_rendering(answer):
    arch, reasoning, content, calls = answer
    text = _answer(arch, reasoning, content, calls)
    parsed = parse_output(text, thinking=reasoning is not None)
    assert parsed.reasoning == (reasoning or "")
    assert parsed.content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    if reasoning is None:
        assert parse_tool_calls(text) == (parsed.content, parsed.tool_calls)


def test_arguments_json_layout_matches_reference():
    text = (
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">value</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="limit" string="false">2</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
    )
    assert parse_tool_calls("summary" + text) == (
        "summary",
        [{"name": "lookup", "arguments": '{"query": "value", "limit": 2}'}],
    )


def test_eos_ends_the_answer_and_split_reasoning():
    assert parse_tool_calls("hi<｜end▁of▁sentence｜>junk") == ("hi", [])
    assert split_reasoning("abc</think>def</think>") == ("abc", "def</think>")
    assert split_reasoning("cut off") == ("cut off", "")
    assert split_reasoning("x</think>y", thinking=False) == ("", "x</think>y")


GARBAGE = [
    "<｜DSML｜tool_calls>",
    "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n",
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"maybe\">1"
    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "<｜DSML｜tool_calls>\nhello</｜DSML｜tool_calls>",
    "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"a\" string=\"false\">{bad"
    "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">1"
    "</｜DSML｜parameter>\n<｜DSML｜parameter name=\"a\" string=\"true\">2</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "</think></think><think>",
    "｜DSML｜｜DSML｜<<<<\n\n\n",
]


def _fuzz_texts(n: int = 300) -> list[str]:
    rng = random.Random(0)
    valid = [_answer(*a) for a in ANSWERS[::5]]
    alphabet = ["<", ">", "/", "\n", '"', "=", "｜DSML｜", "invoke", " invoke", "parameter", "tool_calls",
                " calls", "name", "string", "true", "</think>", "x", " "]
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            base = rng.choice(valid)
            cut = rng.randrange(len(base) + 1)
            out.append(base[:cut] + "".join(rng.choices(alphabet, k=rng.randrange(3))))
        else:
            out.append("".join(rng.choices(alphabet, k=rng.randrange(40))))
    return out


@pytest.mark.parametrize("text", GARBAGE + _fuzz_texts())
def test_garbage_does_not_crash(text):
    for thinking in (False, True):
        parsed = parse_output(text, thinking=thinking)
        for call in parsed.tool_calls:
            assert isinstance(json.loads(call["arguments"]), dict)


def test_malformed_block_is_passed_through_as_content():
    content, calls = parse_tool_calls(GARBAGE[2])
    assert calls == [] and "string=\"maybe\"" in content
    content, calls = parse_tool_calls(GARBAGE[4])
    # A string="false" value that is not JSON is kept as a string.
    assert calls == [{"name": "f", "arguments": '{"a": "{bad"}'}] and content == ""


def _collect(events) -> tuple[str, str, list]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return reasoning, content, [e for e in events if isinstance(e, ToolCall)]


def _stream(pieces: list[str], thinking: bool) -> list:
    parser = OutputParser(thinking=thinking)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


STREAM_TEXTS = [_answer(*a) for a in ANSWERS[::3]] + GARBAGE


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_equals_one_shot_at_every_split(text):
    for thinking in (False, True):
        whole = _collect(_stream([text], thinking))
        for cut in range(len(text) + 1):
            assert _collect(_stream([text[:cut], text[cut:]], thinking)) == whole, cut
        assert _collect(_stream(list(text), thinking)) == whole


@pytest.mark.parametrize("text", [_answer(*a) for a in ANSWERS if a[3]])
def test_stream_never_leaks_dsml_into_content(text):
    for thinking in (False, True):
        events = _stream(list(text), thinking)
        assert not any(isinstance(e, ContentDelta) and ("｜DSML｜" in e.text or e.text.endswith("<"))
                       for e in events)


def test_tool_calls_stream_as_each_invoke_completes():
    text = _answer("v41", "r", "c", CALLS)
    parser = OutputParser(thinking=True)
    first_invoke_end = text.index("</｜DSML｜ invoke>") + len("</｜DSML｜ invoke>")
    events = parser.feed(text[:first_invoke_end])
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["get_weather"]


def _streamed_calls(events) -> list[list]:
    """[name, arguments text, (aborted)] per announced call, from the streaming events."""
    calls: list[list] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            calls.append([e.name, ""])
        elif isinstance(e, ToolCallArgs):
            calls[-1][1] += e.text
        elif isinstance(e, ToolCallAbort):
            calls[-1][1] += e.closing
            calls[-1].append("aborted")
    return calls


@pytest.mark.parametrize("text", STREAM_TEXTS + _fuzz_texts(120))
def test_streamed_tool_call_arguments_match_the_calls(text):
    """Start / argument fragments: the same at every split, valid JSON once closed, and equal to
    the completed ToolCalls (an aborted announcement is a block that went to content)."""
    for thinking in (False, True):
        events = _stream([text], thinking)
        ref = _streamed_calls(events)
        done = [[c.name, c.arguments] for c in events if isinstance(c, ToolCall)]
        assert [c for c in ref if len(c) == 2] == done
        for c in ref:
            assert isinstance(json.loads(c[1]), dict)
        for cut in range(0, len(text) + 1, max(1, len(text) // 40)):
            assert _streamed_calls(_stream([text[:cut], text[cut:]], thinking)) == ref, cut
        assert _streamed_calls(_stream(list(text), thinking)) == ref


def test_tool_call_arguments_stream_per_parameter():
    text = _answer("v41", "r", "c", CALLS)
    parser = OutputParser(thinking=True)
    first_param_end = text.index("</｜DSML｜ parameter>") + len("</｜DSML｜ parameter>")
    events = parser.feed(text[:first_param_end])
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    args = [e.text for e in events if isinstance(e, ToolCallArgs)]
    assert [e.name for e in starts] == ["get_weather"] and len(args) == 1 and args[0].startswith("{")
    assert not any(isinstance(e, ToolCall) for e in events)  # the call itself completes later
