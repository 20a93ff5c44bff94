"""OpenAI `logprobs` objects: each token's text and raw bytes, with its alternatives."""

from __future__ import annotations

from typing import Any


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE spells byte b as one printable character; this is the inverse map."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()
_TOKEN_CACHE: dict[tuple[int, int], tuple[str, list[int]]] = {}


def _token_str(tok: Any, tid: int) -> tuple[str, list[int]]:
    """(text, raw bytes) of one token for logprobs; a token holding part of a UTF-8 character has
    its real bytes (the text shows U+FFFD)."""
    key = (id(tok), tid)
    hit = _TOKEN_CACHE.get(key)
    if hit is not None:
        return hit
    piece = tok.id_to_token(tid) if hasattr(tok, "id_to_token") else None
    if piece is not None and all(ch in _BYTE_DECODER for ch in piece):
        raw = bytes(_BYTE_DECODER[ch] for ch in piece)
    else:  # special / added token, or not a byte-level vocabulary
        raw = tok.decode([tid]).encode("utf-8")
    out = (raw.decode("utf-8", errors="replace"), list(raw))
    if len(_TOKEN_CACHE) < 1 << 20:
        _TOKEN_CACHE[key] = out
    return out


def chat_logprobs(tok: Any, entries: list) -> dict:
    """Chat completions' `logprobs` of (token, logprob, [(alternative, logprob)]) entries."""
    content = []
    for tid, lp, top in entries:
        s, b = _token_str(tok, tid)
        alts = []
        for t, v in top:
            ts, tb = _token_str(tok, t)
            alts.append({"token": ts, "logprob": v, "bytes": tb})
        content.append({"token": s, "logprob": lp, "bytes": b, "top_logprobs": alts})
    return {"content": content}


def completion_logprobs(tok: Any, entries: list, offset: int) -> dict:
    """Completions' `logprobs` of the same entries, with each token's text offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, lp, top in entries:
        s, _ = _token_str(tok, tid)
        tokens.append(s)
        lps.append(lp)
        tops.append({_token_str(tok, t)[0]: v for t, v in top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
