"""The transformer both architectures share: embedding, the layers, the head, and what a
sequence's state holds (its layout and size).

`build(cfg, weights, ops, plan)` gives the V4.1 or V4 model (engine/model/v41.py, v4.py) over a
backend's ops, holding this rank's weights (engine/checkpoint/loader.py). A step is:
`h, pre_mix = model.embed(batch)`, then `h, pre_mix = layer(h, pre_mix, batch)` for every layer,
then `model.head(h, pre_mix)` (this rank's vocabulary slice of the logits). The runner
(engine/runtime/runner.py) builds the Batch and runs these, deciding how.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.model.batch import Batch, Seq
from engine.model.config import ModelConfig
from engine.model.dspark import DSpark
from engine.model.engram import NgramHasher
from engine.model.layers import Embedding, Head
from engine.model.rope import Rope
from engine.model.v4 import V4Attention, V4Block
from engine.model.v41 import V41Attention, V41Block
from engine.parallel.shard import ShardPlan
from engine.state import rows
from engine.state.sequence import V41_CODECS, LayerState, SequenceState


class Transformer:
    def __init__(self, cfg: ModelConfig, weights, ops, plan: ShardPlan, tokenizer_json: str | Path | None = None,
                 store_quantized: bool = True) -> None:
        self.cfg, self.w, self.ops, self.plan = cfg, weights, ops, plan
        self.codecs: dict = {}  # the state codecs every part rounds onto (one dict, shared)
        self.set_store_quantized(store_quantized)
        self.rope = Rope(cfg)
        attn_cls, block_cls = (V41Attention, V41Block) if cfg.arch == "v41" else (V4Attention, V4Block)
        self.embedding = Embedding(weights.embed, plan, ops)
        self.layers = [block_cls(cfg, li, L, ops, attn_cls(cfg, li, L.attn, ops, plan, self.codecs, self.rope))
                       for li, L in enumerate(weights.layers)]
        self.head = Head(cfg, weights, ops)
        # the DSpark draft (engine/model/dspark.py), where the checkpoint has draft layers
        self.dspark = DSpark(self, weights.dspark) if getattr(weights, "dspark", None) is not None else None
        self.hasher = None
        if cfg.engram_layer_ids:
            if tokenizer_json is None:
                raise ValueError("this checkpoint has Engram layers: the tokenizer is needed to hash n-grams")
            self.hasher = NgramHasher(cfg, tokenizer_json)
        self.model_key = f"{cfg.model_type}:{cfg.num_layers}x{cfg.hidden_size}:{cfg.vocab_size}"

    def set_store_quantized(self, on: bool) -> None:
        """V4.1 keeps its state on DeepSeek's FP8/FP4 grids; False computes on unrounded state
        (only to compare against a reference run without fake quantization)."""
        self.store_quantized = on and self.cfg.arch == "v41"
        self.codecs.clear()
        self.codecs.update(V41_CODECS if self.store_quantized else {})

    def embed(self, batch: Batch):
        """The hc_mult residual streams of the rows' tokens, and V4.1's first collapse weights
        (single-pass mHC: the first site collapses stream 0; V4: None)."""
        cfg, ops = self.cfg, self.ops
        x = self.embedding(batch.ids)
        h = ops.xp.repeat(x[:, None, :], cfg.hc_mult, axis=1)
        pre_mix = None
        if cfg.arch == "v41":
            pre_mix = ops.xp.zeros((x.shape[0], cfg.hc_mult), dtype=np.float32)
            pre_mix[:, 0] = 1.0
        return h, pre_mix

    @property
    def last_kv_source(self) -> int:
        """V4.1's last layer that publishes anything later layers read (beyond its own window);
        -1 where none does (V4: every compressing layer keeps its own)."""
        ids = self.cfg.kv_source_layer_ids if self.cfg.arch == "v41" else ()
        return max(ids) if ids else -1

    # ---- host-side inputs ----------------------------------------------------------------
    def engram_hashes(self, seqs: list[Seq], ids: list[np.ndarray]) -> np.ndarray:
        """Every row's Engram hash ids; each sequence's look-back of recent tokens moves on."""
        keep = self.cfg.engram_max_ngram_size - 1
        out = self.hasher([s.state.recent_tokens for s in seqs], ids, [int(s.pos[0]) for s in seqs])
        if all(ch.size == 1 for ch in ids):  # (a decode step: host time of every step, kept lean)
            for s, ch in zip(seqs, ids, strict=True):
                s.state.recent_tokens = [*s.state.recent_tokens, int(ch[0])][-keep:] if keep else []
            return out
        for s, ch in zip(seqs, ids, strict=True):
            s.state.recent_tokens = (list(s.state.recent_tokens) + [int(t) for t in ch])[-keep:] if keep else []
            if s.state.trial is not None:  # the look-back a speculative verify may cut (engine/state/trial.py)
                s.state.trial.chunk, s.state.trial.keep_recent = [int(t) for t in ch], keep
        return out

    # ---- state ------------------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        d = self.cfg.head_dim
        layers = [LayerState(window=self.ops.xp.zeros((0, d), np.float32)) for _ in range(self.cfg.num_layers)]
        return SequenceState(position=0, layers=layers, model_key=self.model_key, codecs=dict(self.codecs),
                             placed=self.ops.placement)

    def state_bytes_per_token(self) -> tuple[float, int]:
        return state_bytes_per_token(self.cfg)


def state_bytes_per_token(cfg: ModelConfig) -> tuple[float, int]:
    """(bytes per token of context, fixed bytes per sequence) in the stored formats: V4.1 keeps
    FP8 window rows (d + d/32 bytes), FP4 entries (d/2 + d/16) and MXFP4 indexer keys
    (di/2 + di/32) per group of `ratio` tokens; V4 keeps float32 (the reference's precision)."""
    d, di, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window - 1
    per_token = 0.0
    if cfg.arch == "v41":
        fixed = cfg.num_layers * w * (d + d // 32)
        for src in cfg.kv_source_layer_ids:
            per_token += (d // 2 + d // 16 + di // 2 + di // 32) / cfg.compress_ratios[src]
    else:
        fixed = cfg.num_layers * w * d * 4
        for i, kind in enumerate(cfg.layer_kinds):
            if kind != "sliding":
                per_token += (d + (di if kind == "csa" else 0)) * 4 / cfg.compress_ratios[i]
    return per_token, fixed


def resident_state_bytes_per_token(cfg: ModelConfig) -> tuple[float, int]:
    """(bytes per token of context, fixed bytes per sequence) that a running sequence's state
    occupies in the backend's memory (what a GPU must hold), at most: every array is float32
    (on the storage grids), and each one a decode step grows lives in a growth buffer with up
    to 1 / rows.GROWTH of its rows plus rows.MIN_ROWS of headroom (engine/state/rows.py). V4.1:
    the windows, every KV source's pending group (kv and gate rows, buffers of 2 x ratio rows)
    and its entries and indexer keys. V4 decodes through plain arrays: its float32 formula."""
    d, di, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window - 1
    if cfg.arch != "v41":
        return state_bytes_per_token(cfg)
    # the window buffer: its w live rows and the new one, then max(MIN_ROWS, rows / GROWTH) spare
    fixed = cfg.num_layers * (w + 1 + max(rows.MIN_ROWS, (w + 1) // rows.GROWTH)) * d * 4
    per_token = 0.0
    for src in cfg.kv_source_layer_ids:
        ratio, width = cfg.compress_ratios[src], (d + di) * 4
        per_token += width * (1 + 1 / rows.GROWTH) / ratio
        fixed += rows.MIN_ROWS * width + (2 * ratio * 2 * d * 4 if ratio > 1 else 0)
    return per_token, int(fixed)
