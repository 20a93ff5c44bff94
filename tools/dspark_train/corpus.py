"""The demo's corpus, built as ../shared/training/ built the one demo-v41 was trained on: the
Python standard library and site-packages of the machine running this, files of 300+ characters
shuffled with seed 0, the first 8,000 characters of each, up to 24 MB; a module with a docstring
becomes a chat turn (its first paragraph as the user's request, the code as the answer), others
plain text; BOS / EOS around each. The first `held_out` tokens of the stream are the held-out
part (the demo's own validation tokens); the rest trains the draft.

Site-packages differ between machines, so the corpus is the same in kind, not byte for byte."""

from __future__ import annotations

import ast
import glob
import os
import random
import sysconfig

BOS, EOS, USER, ASSISTANT, END_THINK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                        "<｜Assistant｜>", "</think>")


def documents(limit_chars: float = 24e6) -> list[dict]:
    """[{"text": whole document, "prompt": the chat prefix or None}] in the recipe's order."""
    rng = random.Random(0)
    files: list[str] = []
    for root in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]):
        files += sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    rng.shuffle(files)
    docs, total = [], 0
    for f in files:
        if total > limit_chars:
            break
        try:
            with open(f, encoding="utf-8") as fh:
                src = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        if len(src) < 300 or "\x00" in src:
            continue
        try:
            doc = ast.get_docstring(ast.parse(src)) or ""
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            doc = ""
        req = doc.strip().split("\n\n")[0].replace("\n", " ")[:300]
        body = src[:8000]
        prompt = f"{BOS}{USER}{req}{ASSISTANT}{END_THINK}" if req else None
        docs.append({"text": (prompt or BOS) + body + EOS, "prompt": prompt})
        total += len(docs[-1]["text"])
    return docs


def token_stream(docs: list[dict], tokenizer) -> list[int]:
    """Every document's ids, concatenated (tokenizer: a `tokenizers.Tokenizer`)."""
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer.encode(d["text"], add_special_tokens=False).ids)
    return ids


def held_out_prompts(docs: list[dict], tokenizer, held_out: int, count: int) -> list[str]:
    """Up to `count` chat prompts (the user's request, as a client would send it) of documents
    lying wholly inside the held-out head of the stream."""
    out, used = [], 0
    for d in docs:
        used += len(tokenizer.encode(d["text"], add_special_tokens=False).ids)
        if used > held_out or len(out) >= count:
            break
        if d["prompt"] is not None:
            out.append(d["prompt"][len(BOS) + len(USER):-len(ASSISTANT) - len(END_THINK)])
    return out
