"""The DSpark draft layers' part of the tensor schema (V4.1 `mtp.*`), declared once.

DeepSeek's inference/model.py builds `num_nextn_predict_layers` DSparkBlocks after the backbone
(upstream names `mtp.{j}.*`; the HF V4.1 export prefixes them with `model.` like every other
tensor, and the transformers port has no modules of its own for them). Each is a Block with a
sliding-window-only attention and a MoE of its own expert pool (dspark_n_routed_experts); the
first also holds main_proj / main_norm (the target layers' inputs projected to one stream), the
last norm, the Markov head and the confidence head. Embedding and head are the main model's.

Stored formats follow the main layers of the release: FP8 block-scaled linears (main_proj too),
FP4 routed experts, BF16 norms, gate and heads (markov embed / head, confidence proj), F32 mHC,
sinks and gate biases. Shard rules follow the main layers too: heads, output groups, the
shared expert's width, whole draft experts by owner (or their width), vocab rows for the
Markov embedding and head (ParallelEmbedding / ParallelHead in the reference); main_proj,
main_norm, norm and the confidence head are replicated.

Places (engine.checkpoint.loader's structure):

    w.dspark.main_proj, main_norm      (mtp.0)
    w.dspark.layers[j]                 as w.layers[i] (attn with qkv stacked, ffn, hc_attn,
                                       hc_ffn, attn_norm, ffn_norm; no compressor / indexer /
                                       engram / tid2eid)
    w.dspark.norm                      (mtp.{last})
    w.dspark.markov_head.embed, .head  (vocab rows, markov_rank columns)
    w.dspark.confidence_head.proj      ([1, hidden + markov_rank])
"""

from __future__ import annotations

import logging
from dataclasses import replace

from engine.checkpoint.reader import CheckpointError
from engine.checkpoint.schema import (
    VOCAB,
    SchemaError,
    Shard,
    _attention,
    _describe,
    _experts,
    _hc_sites,
    _Table,
    check_stored,
    resolve,
    tensor_schema,
)
from engine.model.config import ModelConfig

__all__ = ["PREFIX", "PLACE", "draft_schema", "draft_layer_of", "check_draft"]

log = logging.getLogger(__name__)

PREFIX = "mtp."  # canonical names of the draft tensors
PLACE = "dspark"  # their root in the loaded weights


def draft_layer_of(name: str) -> int | None:
    """The draft layer index of a canonical `mtp.{j}.*` name, else None."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def draft_schema(t: _Table, cfg: ModelConfig, norm_fmt: str) -> None:
    """Append every draft tensor of `cfg` to the table, in the reference's module order."""
    h, k = cfg.hidden_size, cfg.dspark_layers
    for j in range(k):
        name, place = f"{PREFIX}{j}.", f"{PLACE}.layers.{j}."
        sub = _Table()
        sub.vector(name + "attn_norm.weight", (h,), norm_fmt, "norm", name + "attn_norm")
        _attention(sub, cfg, name + "attn.", norm_fmt)
        sub.vector(name + "ffn_norm.weight", (h,), norm_fmt, "norm", name + "ffn_norm")
        _draft_ffn(sub, cfg, name + "ffn.")
        _hc_sites(sub, cfg, name)
        if j == 0:  # the target layers' inputs, concatenated, into one stream
            n_t = len(cfg.dspark_target_layer_ids)
            sub.linear(name + "main_proj.weight", (h, n_t * h), "fp8", f"{PLACE}.main_proj")
            sub.vector(name + "main_norm.weight", (h,), norm_fmt, "norm", f"{PLACE}.main_norm")
        if j == k - 1:
            _heads(sub, cfg, name, norm_fmt)
        for e in sub.out:  # layer tensors go under w.dspark.layers[j]; the shared parts have their own
            if e.place is not None and e.place.startswith(name):
                e = replace(e, place=place + e.place[len(name):])
            t.out.append(e)


def _draft_ffn(t: _Table, cfg: ModelConfig, f: str) -> None:
    """The draft MoE: its own routed experts (dspark_n_routed_experts), the main width."""
    h, e = cfg.hidden_size, cfg.dspark_n_routed_experts
    t.linear(f + "gate.weight", (e, h), "bf16", f + "gate")
    t.vector(f + "gate.bias", (e,), "f32", "bias", f + "gate_bias", optional=True)
    t.vector(f + "gate.bias_vl", (e,), "f32", "bias", None)  # (stored, unread: drafts are text)
    _experts(t, cfg, e, f, draft=True)


def _heads(t: _Table, cfg: ModelConfig, name: str, norm_fmt: str) -> None:
    """The last draft layer's final norm, Markov head (a rank-r bigram: embed the previous
    drafted token, project to the vocabulary) and confidence head."""
    h, v, r = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    t.vector(name + "norm.weight", (h,), norm_fmt, "norm", f"{PLACE}.norm")
    t.linear(name + "markov_head.embed.weight", (v, r), "bf16", f"{PLACE}.markov_head.embed",
             Shard(rows=VOCAB), role="embed")
    t.linear(name + "markov_head.head.weight", (v, r), "bf16", f"{PLACE}.markov_head.head", Shard(rows=VOCAB))
    t.linear(name + "confidence_head.proj.weight", (1, h + r), "bf16", f"{PLACE}.confidence_head.proj")


# ---------------------------------------------------------------------------------------------
# Checking a checkpoint's draft layers


def check_draft(cfg: ModelConfig, ckpt, warn: bool = False) -> None:
    """SchemaError, naming the tensor and what the schema expects, where the checkpoint's
    `mtp.*` tensors disagree with the config: declared but not stored, partly stored, of the
    wrong shape or format, or more draft layers stored than declared. Draft tensors stored
    while the config declares none are ignored (a warning where `warn`). Reads headers only."""
    stored = sorted(n for n in ckpt.names() if n.startswith(PREFIX))
    if not cfg.has_draft:
        if stored and warn:
            log.warning("checkpoint stores %d mtp.* (DSpark draft) tensors but its config declares no draft "
                        "layers (num_nextn_predict_layers 0): loading the model without them; the draft "
                        "layers are ignored", len(stored))
        return
    k = cfg.dspark_layers
    entries = [e for e in tensor_schema(cfg) if e.name.startswith(PREFIX) and e.place is not None]
    if not stored:
        raise SchemaError(
            f"config.json declares {k} DSpark draft layers (num_nextn_predict_layers) but the checkpoint "
            f"stores no mtp.* tensor: expected {len(entries)} tensors such as {entries[0].name!r} "
            f"{_describe(entries[0])} (set num_nextn_predict_layers to 0 to load the model without them)")
    extra = sorted({j for j in map(draft_layer_of, stored) if j is not None and j >= k})
    if extra:
        first = next(n for n in stored if draft_layer_of(n) == extra[0])
        raise SchemaError(f"checkpoint stores draft layer(s) {extra} (e.g. {first!r}) but config.json "
                          f"declares {k} (num_nextn_predict_layers)")
    errors = []
    for e in entries:
        if e.optional and not ckpt.has(resolve(ckpt, e.name)):
            continue
        try:
            check_stored(e, ckpt)
        except CheckpointError as err:
            errors.append(str(err))
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise SchemaError(f"the checkpoint's DSpark draft layers (mtp.*) disagree with the schema of its "
                          f"config ({k} layers): " + "; ".join(errors[:5]) + more)
