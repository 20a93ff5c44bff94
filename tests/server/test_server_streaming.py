"""Output processing of the server, token by token through the real demo tokenizer."""

from __future__ import annotations

import json

import pytest

from engine.text.chat_encoding import render_tool_calls
from server.streaming import OutputProcessor, StopMatcher


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


def _run(tok, text: str, *, stop=(), thinking=False, tools=False):
    """Feed text's token ids one at a time; returns (reasoning, content, tool_calls, stopped)."""
    proc = OutputProcessor(tok, stop=list(stop), thinking=thinking, tools=tools)
    reasoning = content = ""
    calls: list[dict] = []
    stopped = False
    for tid in tok.encode(text):
        d, stopped = proc.push(tid)
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
        if stopped:
            break
    d = proc.finish(stopped)
    return reasoning + d.reasoning, content + d.content, calls + d.tool_calls, stopped


def test_stop_matcher_across_pieces():
    m = StopMatcher(["END", "xyz"])
    out = []
    for piece in ["abc E", "N", "D tail"]:
        text, stopped = m.push(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "abc " and stopped


def test_stop_matcher_holds_only_possible_prefixes():
    m = StopMatcher(["</answer>"])
    assert m.push("a < b") == ("a < b", False)
    assert m.push(" and </ans") == (" and ", False)
    assert m.push("wer") == ("", False)
    assert m.push("!") == ("</answer!", False)
    assert m.flush() == ""


def test_stop_matcher_earliest_wins():
    m = StopMatcher(["bbb", "ab"])
    assert m.push("xxabbb") == ("xx", True)


def test_multibyte_text_survives_token_splits(tok):
    text = "héllo wörld — 日本語 🙂 done"
    assert _run(tok, text)[1] == text


def test_stop_string_inside_token_stream(tok):
    _, content, _, stopped = _run(tok, "def parse(line):\n    return line.split(',')\n", stop=["split("])
    assert stopped and content == "def parse(line):\n    return line."


def test_reasoning_split(tok):
    r, c, calls, _ = _run(tok, "Let me think.\nOK</think>The answer is 4.", thinking=True)
    assert (r, c, calls) == ("Let me think.\nOK", "The answer is 4.", [])
    # not thinking (the prompt closed reasoning) a generated `</think>` is a stray control token
    assert _run(tok, "a</think>b")[1] == "ab"
    # and so is a second one after reasoning ended
    assert _run(tok, "r</think>a</think>b", thinking=True)[:2] == ("r", "ab")


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_tool_calls_parsed_from_dsml(tok, arch):
    calls = [{"function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}},
             {"function": {"name": "search", "arguments": json.dumps({"q": "a \"quoted\" term", "n": [1, 2]})}}]
    text = "Need the weather.</think>Checking.\n\n" + render_tool_calls(calls, arch)
    r, content, deltas, _ = _run(tok, text, thinking=True, tools=True)
    assert (r, content) == ("Need the weather.", "Checking.")
    got: list[dict] = []  # merged as an OpenAI client does: first delta of a call, then fragments
    for dl in deltas:
        if "id" in dl:
            got.append({**dl, "function": dict(dl["function"])})
        else:
            assert dl["index"] == got[-1]["index"]
            got[-1]["function"]["arguments"] += dl["function"]["arguments"]
    assert len(deltas) > len(got)  # arguments arrived in pieces, parameter by parameter
    assert [c["index"] for c in got] == [0, 1]
    assert [c["function"]["name"] for c in got] == ["get_weather", "search"]
    assert [json.loads(c["function"]["arguments"]) for c in got] == [
        {"city": "Paris", "days": 3}, {"q": "a \"quoted\" term", "n": [1, 2]}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)


def test_tool_block_is_text_when_no_tools_were_offered(tok):
    block = render_tool_calls([{"function": {"name": "f", "arguments": "{}"}}], "v41")
    _, content, calls, _ = _run(tok, block)
    assert calls == [] and content == block.replace("｜DSML｜", "")  # control tokens never reach content


def _run_ids(tok, ids, *, thinking=False, tools=False):
    proc = OutputProcessor(tok, stop=[], thinking=thinking, tools=tools)
    out = [proc.push(t)[0] for t in ids] + [proc.finish(False)]
    return ("".join(d.reasoning for d in out), "".join(d.content for d in out),
            [c for d in out for c in d.tool_calls])


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_generated_control_tokens_never_reach_text(tok, thinking, tools):
    think_end = tok.special_ids["think_end"]
    noise = [i for i in sorted(tok.control_ids) if i != think_end]
    spellings = [tok.id_to_token(i) for i in sorted(tok.control_ids)]
    plain = tok.encode_plain
    ids = noise + plain("why") + noise + ([think_end] if thinking else []) + noise + plain("So 4.") + noise
    ids += [think_end] + noise  # a stray `</think>` after reasoning ended
    reasoning, content, calls = _run_ids(tok, ids, thinking=thinking, tools=tools)
    assert (reasoning, content, calls) == (("why", "So 4.") if thinking else ("", "whySo 4.")) + ([],)
    assert not any(s in reasoning + content for s in spellings)


def test_tool_calls_parsed_among_control_tokens(tok):
    noise = [i for i in sorted(tok.control_ids) if i != tok.special_ids["think_end"]]
    block = render_tool_calls([{"function": {"name": "f", "arguments": json.dumps({"a": 1})}}], "v41")
    ids = tok.encode_plain("r") + noise + [tok.special_ids["think_end"]] + noise + tok.encode_plain("Calling.")
    ids += noise + tok.encode("\n\n" + block)  # the block as the model writes it, with DSML ids
    reasoning, content, calls = _run_ids(tok, ids, thinking=True, tools=True)
    assert (reasoning, content) == ("r", "Calling.")
    assert [c["function"]["name"] for c in calls if "id" in c] == ["f"]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"a": 1}
