"""engine/runtime/constraint.py on the demo tokenizer: random walks through the masks always end
in text the output parser reads as valid calls / JSON of the schema; thinking runs free until
</think>; a complete grammar allows only EOS."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from engine.runtime.constraint import Constrainer, GrammarSpec, tool_schema_error
from engine.runtime.sampling import token_mask
from engine.text.chat_encoding import parse_output
from engine.text.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v41"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer", "maximum": 9},
                                           "mode": {"type": "string", "enum": ["a", "b"]}}, "required": ["city", "n"]}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO)


def _constrainer(tok, arch="v41"):
    ids = tok.special_ids
    return Constrainer(DEMO / "tokenizer.json", 8192, [tok.eos_id], arch, ids["dsml"], ids["think_end"])


def _walk(c, tc, rng, limit=600, prefer_short=True):
    """Draw uniformly among allowed ids (short tokens favoured, so that walks end); the text."""
    out = []
    for _ in range(limit):
        allowed = np.flatnonzero(token_mask(c.masks([tc])[0], c.vocab))
        if prefer_short and rng.random() < 0.5 and 1 in allowed:
            break
        t = int(rng.choice(allowed))
        if t == 1:
            break
        assert tc.advance(t), tc.error
        out.append(t)
    return out


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_tool_walks_parse_into_valid_calls(tok, arch):
    c = _constrainer(tok, arch)
    spec = GrammarSpec("tools", tools=(("f", json.dumps(PARAMS)), ("g", "")))
    rng = np.random.default_rng(1)
    ended = 0
    for _ in range(12):
        tc = c.start(spec, thinking=False)
        ids = _walk(c, tc, rng, prefer_short=False)
        if not tc.matcher.is_accepting():
            continue
        ended += 1
        calls = parse_output(tok.decode(ids), thinking=False).tool_calls
        assert calls
        for call in calls:
            args = json.loads(call["arguments"])
            if call["name"] == "f":
                assert isinstance(args["city"], str) and isinstance(args["n"], int) and args["n"] <= 9
                assert set(args) <= {"city", "n", "mode"} and args.get("mode", "a") in ("a", "b")
            else:
                assert call["name"] == "g" and args == {}
    assert ended >= 3


def test_complete_grammar_allows_only_eos(tok):
    c = _constrainer(tok)
    tc = c.start(GrammarSpec("json", schema=json.dumps({"type": "boolean"})), thinking=False)
    for t in tok.encode("true"):
        assert tc.advance(t)
    assert list(np.flatnonzero(token_mask(c.masks([tc])[0], 8192))) == [tok.eos_id]
    assert not tc.advance(tok.encode("x")[0]) or tc.matcher.is_stopped()


def test_thinking_is_free_until_think_end(tok):
    c = _constrainer(tok)
    tc = c.start(GrammarSpec("json", schema=json.dumps({"type": "integer"})), thinking=True)
    for t in tok.encode("let me think"):
        assert c.masks([None, tc]) == [None, None]
        assert tc.advance(t)
    assert tc.advance(tok.special_ids["think_end"])
    mask = token_mask(c.masks([tc])[0], 8192)
    assert not mask[tok.special_ids["think_end"]] and not mask[tok.eos_id]
    assert mask.any() and all(re.fullmatch(r"-?[0-9]*", tok.decode([t])) for t in np.flatnonzero(mask))


def test_fork_is_independent(tok):
    c = _constrainer(tok)
    a = c.start(GrammarSpec("json", schema=json.dumps({"type": "string"})), thinking=False)
    assert a.advance(tok.encode('"')[0])
    b = a.fork()
    assert b.advance(tok.encode('"')[0])
    assert b.matcher.is_accepting() and not a.matcher.is_accepting()


def test_tool_schema_errors():
    assert tool_schema_error("f", None) is None
    assert tool_schema_error("f", PARAMS) is None
    assert "required" in tool_schema_error("f", {"type": "object", "properties": {}, "required": ["x"]})
    assert "cannot be written" in tool_schema_error("f", {"type": "object", "properties": {"a\nb": {}}})
