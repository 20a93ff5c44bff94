"""Tokenizer of a checkpoint directory (tokenizer.json + tokenizer_config.json).

Uses the HF `tokenizers` library only. `encode` matches added tokens (<｜User｜>, ...) anywhere
in its text and never adds BOS itself: it is for text the caller fully controls (a raw
completions prompt). Chat prompts go through `encode_segments`: the chat template's own
markers become control ids while client text is tokenized as plain text, so a message that
spells a control token gets the ordinary tokens of that spelling and cannot forge a turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

# Special tokens the chat format uses; absent ones (V4 has no <｜System｜>) map to None.
CHAT_TOKENS = {
    "user": "<｜User｜>",
    "assistant": "<｜Assistant｜>",
    "system": "<｜System｜>",
    "think_start": "<think>",
    "think_end": "</think>",
    "dsml": "｜DSML｜",
    "tool_result_start": "<tool_result>",
    "tool_result_end": "</tool_result>",
    "latest_reminder": "<｜latest_reminder｜>",
}


def _token_text(value: object) -> str | None:
    """tokenizer_config.json spells tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, hf: _HFTokenizer, config: dict | None = None) -> None:
        self._tok = hf
        self.config = config or {}
        self.bos_id = self._config_id("bos_token")
        self.eos_id = self._config_id("eos_token")
        pad = self._config_id("pad_token")
        self.pad_id = pad if pad is not None else self.eos_id
        self.special_ids: dict[str, int | None] = {
            k: self._tok.token_to_id(v) for k, v in CHAT_TOKENS.items()
        }
        added = hf.get_added_tokens_decoder()
        # Every added token is a control token, flagged special or not (the real V4 vocabulary
        # does not flag <｜User｜> or </think>): none may come from client text or reach content.
        self.control_ids: frozenset[int] = frozenset(added)
        self._added = {a.content: i for i, a in added.items()}
        # Leftmost-longest match, as the added-vocabulary split of `tokenizers` does.
        names = sorted(self._added, key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, names))) if names else None
        self._plain = self._without_added_tokens(hf)

    @staticmethod
    def _without_added_tokens(hf: _HFTokenizer) -> _HFTokenizer:
        """A copy that matches no added token: their spellings become ordinary byte tokens."""
        spec = json.loads(hf.to_str())
        spec["added_tokens"] = []
        return _HFTokenizer.from_str(json.dumps(spec))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        return cls(_HFTokenizer.from_file(str(path / "tokenizer.json")), config)

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, config: dict | None = None) -> Tokenizer:
        return cls(_HFTokenizer.from_file(str(tokenizer_json)), config)

    def _config_id(self, key: str) -> int | None:
        text = _token_text(self.config.get(key))
        return None if text is None else self._tok.token_to_id(text)

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (the embedding table may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Added tokens in the text (<｜User｜>, ...) are matched by `tokenizers` itself;
        # add_special_tokens=False keeps post-processors from inserting a BOS.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Text as ordinary tokens only: spelled control tokens are not matched."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_segments(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        """Ids of (text, trusted) pieces: added tokens are matched in trusted pieces only.

        The text between two matched control tokens is tokenized as one piece, across segment
        boundaries, exactly as `encode` of the joined text splits it; so when no untrusted
        piece spells a control token the ids equal `encode("".join(texts))`.
        """
        chunks: list[str] = [""]  # text runs; a control id sits between consecutive runs
        cuts: list[int] = []
        for text, trusted in segments:
            pos = 0
            if trusted and self._added_re is not None:
                for m in self._added_re.finditer(text):
                    chunks[-1] += text[pos : m.start()]
                    cuts.append(self._added[m.group()])
                    chunks.append("")
                    pos = m.end()
            chunks[-1] += text[pos:]
        ids = self.encode_plain(chunks[0]) if chunks[0] else []
        for cut, chunk in zip(cuts, chunks[1:], strict=True):
            ids.append(cut)
            if chunk:
                ids.extend(self.encode_plain(chunk))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        token = self._tok.id_to_token(token_id)
        added = self._tok.get_added_tokens_decoder().get(token_id)
        return token is not None and added is not None and added.special

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only newly completed text.

    Decodes a short window of ids and emits text once it no longer ends in U+FFFD, so a
    character split over several byte tokens comes out whole. The window starts at the
    last point where everything decoded cleanly, keeping per-token cost small and exact
    for byte-level BPE. A real U+FFFD at the end is held until the next token or flush().
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully emitted
        self._read = 0  # ids before it have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Remaining text at the end of the stream (incomplete bytes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]
