"""Constrained decoding through llguidance: the grammar of a constrained request, one matcher per
sequence, and the token bitmask each sampling step applies (engine.runtime.sampling for numpy,
kernels/sampling.cu on the GPU).

A request is constrained by `response_format` json_object / json_schema (the answer is one JSON
value of that schema) or `tool_choice` "required" / a named function (the answer is a DSML tool-call
block, as engine/text/chat_encoding.py renders and parses it, whose arguments follow each tool's
parameter schema). In thinking mode the reasoning is free and the grammar starts after `</think>`
(as vLLM applies structured outputs once its reasoning parser sees the reasoning end). Once the
grammar is complete only EOS is allowed.

Masks are int32 words, bit i of word w allowing token 32 * w + i (llguidance's layout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from engine.text.chat_encoding import DIALECTS, DSML

# How a parameter reaches the DSML block: plain strings as text (string="true"), the rest as JSON.
_PLAIN_STRING_KEYS = {"type", "description", "title", "default", "examples"}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains (pure data; protocol.py builds it, the engine compiles it).

    kind "json": one JSON value of `schema`. kind "tools": a DSML block of calls to `tools`
    ((name, parameters schema) pairs), exactly one call when `single`."""

    kind: str
    schema: str = ""  # JSON text (kind "json")
    tools: tuple[tuple[str, str], ...] = ()  # (name, parameters schema JSON text) (kind "tools")
    single: bool = False


JSON_OBJECT_SCHEMA = {"type": "object"}
# JSON as json.dumps writes it, whitespace only inside strings: a free whitespace rule lets a weak
# model pad its answer with newlines up to max_tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_error(schema: Any) -> str | None:
    """Why llguidance cannot compile this JSON schema, or None when it can."""
    if schema is True:
        schema = {}
    if schema is False:
        return "the schema false accepts no value"
    try:
        g = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        return str(e)
    err = llg.LLMatcher.validate_grammar(g)
    return err or None


def _parameters(schema: dict) -> tuple[list[tuple[str, dict]], set[str]]:
    """A tool's parameters in declared order with their schemas (the root's $defs carried along, so
    references resolve), and the required names."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return [], set()
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    out = [(name, {**sub, **defs} if isinstance(sub, dict) else {} if sub is True else sub)
           for name, sub in props.items()]
    req = schema.get("required")
    return out, {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()


def tool_schema_error(name: str, schema: Any) -> str | None:
    """Why a tool's parameters cannot be enforced in a DSML call, or None."""
    if schema is None:
        return None
    params, required = _parameters(schema)
    names = {n for n, _ in params}
    for r in sorted(required - names):
        return f"tool {name!r}: required parameter {r[:64]!r} is not among its properties"
    for pname, sub in params:
        if not pname or any(c in pname for c in '"\n') or DSML in pname:
            return f"tool {name!r}: parameter name {pname[:64]!r} cannot be written in a tool call"
        if not isinstance(sub, dict | bool):
            return f"tool {name!r}: parameter {pname[:64]!r} needs a schema object"
        err = schema_error(sub)
        if err:
            return f"tool {name!r}, parameter {pname[:64]!r}: {err}"
    return None


def _lit(text: str, dsml: str) -> str:
    """Lark for literal text, the DSML marker written as its special token when it is one."""
    items: list[str] = []
    for k, part in enumerate(text.split(DSML)):
        if k:
            items.append(dsml)
        if part:
            items.append(json.dumps(part, ensure_ascii=False))
    return " ".join(items)


def _plain_string(sub: Any) -> bool:
    return isinstance(sub, dict) and sub.get("type") == "string" and set(sub) <= _PLAIN_STRING_KEYS


def tool_grammar(spec: GrammarSpec, arch: str, dsml: str) -> str:
    """Lark for a DSML block of calls (engine/text/chat_encoding.py's render_tool_calls layout, which
    its parser reads). `dsml`: the Lark item for the DSML marker (a special token's `<[id]>`, or the
    quoted text). Parameters come in declared order: required ones always, the others optionally;
    a plain string as text without '<' (string="true") or as a JSON string (string="false")."""
    d = DIALECTS[arch]
    lines = [f"start: {_lit('<' + DSML + d.block + '>', dsml)} \"\\n\" "
             + ("call" if spec.single else 'call ("\\n" call)*')
             + f" \"\\n\" {_lit(d.close(d.block), dsml)}",
             "call: " + " | ".join(f"tool{i}" for i in range(len(spec.tools))),
             "PLAIN: /[^<]*/"]
    for i, (name, schema_text) in enumerate(spec.tools):
        params, required = _parameters(json.loads(schema_text) if schema_text else {})
        items = []
        for j, (pname, sub) in enumerate(params):
            opened = '\n<' + DSML + d.param + f' name="{pname}" string='
            close = _lit(d.close(d.param), dsml)
            as_json, as_text = _lit(opened + '"false">', dsml), _lit(opened + '"true">', dsml)
            embedded = {**sub, "x-guidance": JSON_OPTIONS} if isinstance(sub, dict) else sub
            alts = [f"{as_json} %json{json.dumps(embedded, ensure_ascii=False)} {close}"]
            if _plain_string(sub):
                alts.insert(0, f"{as_text} PLAIN {close}")
            lines.append(f"t{i}p{j}: " + " | ".join(alts))
            items.append(f"t{i}p{j}" + ("" if pname in required else "?"))
        head = _lit(f'<{DSML}{d.invoke} name="{name}">', dsml)
        lines.append(f"tool{i}: {head} {' '.join(items)} \"\\n\" {_lit(d.close(d.invoke), dsml)}")
    return llg.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


class TokenConstraint:
    """One sequence's matcher. With `think_end` set the reasoning runs free until that token."""

    def __init__(self, matcher: llg.LLMatcher, think_end: int | None):
        self.matcher = matcher
        self.waiting = think_end  # token that starts the constrained part, or None (started)

    @property
    def active(self) -> bool:
        return self.waiting is None

    def advance(self, token: int) -> bool:
        """Feed a drawn token; False if the grammar refused it (the matcher is then in error)."""
        if self.waiting is not None:
            if token == self.waiting:
                self.waiting = None
            return True
        if self.matcher.is_stopped():
            return True  # complete: only EOS was allowed; (ignore_eos may draw it again)
        return self.matcher.consume_token(int(token))

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def fork(self) -> TokenConstraint:
        return TokenConstraint(self.matcher.deep_copy(), self.waiting)


class Constrainer:
    """Per engine: the tokenizer as llguidance sees it, grammar compilation and batched masks.
    Everything here runs on the engine thread (llguidance drops the GIL in its heavy parts)."""

    def __init__(self, tokenizer_json: str | Path, vocab: int, eos_ids: list[int], arch: str,
                 dsml_id: int | None, think_end: int | None):
        self.vocab, self.arch, self.think_end = vocab, arch, think_end
        self.tok = llg.LLTokenizer(str(tokenizer_json), eos_token=list(eos_ids))
        self.words = (max(vocab, self.tok.vocab_size) + 31) // 32
        self.dsml = f"<[{dsml_id}]>" if dsml_id is not None else json.dumps(DSML, ensure_ascii=False)
        self.eos_ids = list(eos_ids)
        self._executor = llg.LLExecutor()

    def grammar(self, spec: GrammarSpec) -> str:
        if spec.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(spec.schema, overrides=JSON_OPTIONS)
        return tool_grammar(spec, self.arch, self.dsml)

    def start(self, spec: GrammarSpec, thinking: bool) -> TokenConstraint:
        m = llg.LLMatcher(self.tok, self.grammar(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"grammar does not compile: {m.get_error()}")
        return TokenConstraint(m, self.think_end if thinking else None)

    def start_eos_only(self) -> TokenConstraint:
        """A matcher whose grammar is complete at once: only EOS is allowed."""
        return TokenConstraint(llg.LLMatcher(self.tok, llg.LLMatcher.grammar_from_lark('start: ""\n'),
                                             log_level=0), None)

    def masks(self, constraints: list[TokenConstraint | None]) -> list[np.ndarray | None]:
        """The next token's mask per sequence (None: unconstrained now), computed in parallel."""
        live = [(c.matcher, k) for k, c in enumerate(constraints) if c is not None and c.active]
        if not live:
            return [None] * len(constraints)
        bits = np.zeros((len(constraints), self.words), dtype=np.int32)
        llg_np.fill_next_token_bitmask_par(self._executor, live, bits)
        out: list[np.ndarray | None] = [None] * len(constraints)
        for m, k in live:
            row = bits[k]
            if m.is_error() or not row.any():  # never a row that allows nothing: end the answer
                words = row.view(np.uint32)
                words[:] = 0
                for e in self.eos_ids:
                    words[e >> 5] |= np.uint32(1 << (e & 31))
            out[k] = row
        return out

