"""The checkpoint's tensor schema: every tensor of a DeepSeek-V4 / V4.1 checkpoint, declared once.

For a ModelConfig, `tensor_schema` lists each tensor (in the file order the random checkpoints
write) with
- its canonical name (DeepSeek's upstream naming, what engine.checkpoint.reader normalises to),
- its logical shape (from the config; FP4 columns unpacked),
- its stored format in the released checkpoints (`fmt`, see FORMATS) and how the forward reads it
  (`kind`, which decides the formats a checkpoint may use instead, see ACCEPTS),
- how it splits under tensor parallelism (`shard`: a Shard of ShardPlan ranges, or whole routed
  experts held by their owner),
- where it goes in the loaded weights (`place`, a dotted path into engine.checkpoint.loader's
  structure; `part` for values built from several tensors).

Consumers: engine.checkpoint.tiny_model writes what it lists, engine.checkpoint.loader reads
it, engine.runtime.memory_plan counts its bytes per rank, and Shard.window gives the slice that
engine.parallel.shard.slice_weight cuts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.checkpoint.reader import CheckpointError, RawTensor, Weight, scale_name
from engine.model.config import ModelConfig
from engine.parallel.shard import ShardingError, ShardPlan, even_range

__all__ = [
    "FORMATS",
    "KINDS",
    "LINEAR",
    "VECTOR",
    "TABLE",
    "IDS",
    "RANGES",
    "ACCEPTS",
    "ALIASES",
    "STACK_PARTS",
    "PRODUCTS",
    "SchemaError",
    "Shard",
    "REPLICATED",
    "Entry",
    "tensor_schema",
    "stored_tensors",
    "resolve",
    "check_stored",
    "validate",
]

# Stored formats of the released checkpoints (and of tiny_model's random ones).
FORMATS = {
    "fp8": "FP8 e4m3 linear, block-scaled: + `.scale`, UE8M0 per weight_block_size block",
    "fp4": "FP4 e2m1 routed expert, two per I8 byte: + `.scale`, UE8M0 per row per 32 columns",
    "fp8_rows": "FP8 e4m3 Engram rows: + `.scale`, UE8M0 per row per 32 columns",
    "bf16": "BF16",
    "f32": "F32",
    "i64": "I64 ids",
}
LINEAR, VECTOR, TABLE, IDS = "linear", "vector", "table", "ids"
KINDS = {
    LINEAR: "a weight the backend prepares (ops.prepare)",
    VECTOR: "float parameters read as float32 (norms, mHC, sinks, biases, ape)",
    TABLE: "Engram rows gathered by hashed n-gram (ops.prepare_table)",
    IDS: "an integer table (hash routing's token -> experts)",
}
_FLOATS = ("BF16", "F16", "F32", "F64")
# Stored dtypes each kind may have: any float export (the demo models are BF16 / F32 throughout),
# else the block-scaled forms the reader decodes (F8_E4M3 + scale; I8 / U8: packed FP4 + scale).
ACCEPTS = {
    LINEAR: ("F8_E4M3", "I8", "U8", *_FLOATS),
    TABLE: ("F8_E4M3", *_FLOATS),
    VECTOR: _FLOATS,
    IDS: ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"),
}
# Alternative spellings of canonical names that some exports use (canonical suffix -> others).
ALIASES = {"attn.kv_norm.weight": ("attn.norm.weight",)}
# Values the loader builds from several tensors: the projections of one input stacked (in this
# part order) into as few weights as the formats allow, and Engram's q * k norm weights.
STACK_PARTS = {"qkv": ("q_lat", "kv_lat"), "x_proj": ("comp_kv", "comp_gate", "idx_w")}
PRODUCTS = ("qk",)


class SchemaError(CheckpointError):
    """A checkpoint that disagrees with the schema of its config (names the tensor)."""


# ---------------------------------------------------------------------------------------------
# Sharding

# ShardPlan ranges a tensor's rows or columns may be restricted to (in units of `row_unit` /
# `col_unit` rows or columns per range step).
VOCAB = "vocab"  # plan.vocab: embedding / head rows
HEADS = "heads"  # plan.heads: this rank's query heads
OUT_GROUPS = "out_groups"  # the output groups this rank's heads touch (wo_a rows, wo_b columns)
GROUP_HEADS = "group_heads"  # this rank's heads within each touched group (wo_a columns)
SHARED = "shared"  # plan.shared_cols: the shared expert's width
EXPERT_WIDTH = "expert_width"  # plan.expert_cols under the "width" expert split (else whole)
RANGES = (VOCAB, HEADS, OUT_GROUPS, GROUP_HEADS, SHARED, EXPERT_WIDTH)
# A rank with none of these holds nothing of the tensor: the forward skips its wo / shared expert.
_ABSENT_WHEN_EMPTY = (OUT_GROUPS, SHARED)


@dataclass(frozen=True)
class Shard:
    """How a tensor splits over tensor-parallel ranks: its rows and / or columns restricted to a
    ShardPlan range, and a routed expert (`expert`) held only by the ranks that own it. A rank
    whose OUT_GROUPS or SHARED range is empty holds nothing of the tensor (None in the loaded
    weights); an empty HEADS range leaves an empty slice, as the forward expects."""

    rows: str | None = None
    cols: str | None = None
    row_unit: int = 1
    col_unit: int = 1
    expert: int | None = None
    draft: bool = False  # `expert` indexes the DSpark draft layers' own expert pool

    @property
    def replicated(self) -> bool:
        return self.rows is None and self.cols is None and self.expert is None

    def window(self, cfg: ModelConfig, plan: ShardPlan) -> tuple | None:
        """(rows, cols) this rank holds, each (lo, hi) or None for all of them; None when the
        rank holds nothing of the tensor."""
        if self.expert is not None and not _owns(self, cfg, plan):
            return None
        out = []
        for name, unit in ((self.rows, self.row_unit), (self.cols, self.col_unit)):
            r = None if name is None else _range(name, cfg, plan)
            if r is not None and r[1] <= r[0] and name in _ABSENT_WHEN_EMPTY:
                return None
            out.append(None if r is None else (r[0] * unit, r[1] * unit))
        return tuple(out)


REPLICATED = Shard()


def _owns(shard: Shard, cfg: ModelConfig, plan: ShardPlan) -> bool:
    """Whether `plan`'s rank holds routed expert `shard.expert`: the draft layers' pool splits
    by expert id like the main one (contiguous even ranges), or by width over every expert."""
    if not shard.draft:
        return plan.owns_expert(shard.expert)
    if plan.expert_split == "width":
        return plan.expert_cols[1] > plan.expert_cols[0]
    lo, hi = even_range(cfg.dspark_n_routed_experts, plan.rank, plan.size)
    return lo <= shard.expert < hi


def _range(name: str, cfg: ModelConfig, plan: ShardPlan) -> tuple[int, int] | None:
    if name == VOCAB:
        return plan.vocab
    if name == HEADS:
        return plan.heads
    if name == SHARED:
        return plan.shared_cols if cfg.n_shared_experts else (0, 0)
    if name == EXPERT_WIDTH:
        return plan.expert_cols if plan.expert_split == "width" else None
    groups = plan.head_groups(cfg)
    if not groups:
        return (0, 0)
    if name == OUT_GROUPS:
        return groups[0][0], groups[-1][0] + 1
    if name == GROUP_HEADS:
        lo, hi = groups[0][1], groups[0][2]
        if any((g[1], g[2]) != (lo, hi) for g in groups):
            raise ShardingError("a rank's heads must cover whole output groups or lie inside one")
        return lo, hi
    raise ValueError(f"unknown shard range {name!r} (one of {', '.join(RANGES)})")


# ---------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Entry:
    """One tensor of the schema. role: what parameter it is ('linear', 'embed', 'norm', 'sink',
    'ape', 'bias', 'hc_fn', 'hc_base', 'hc_scale', 'table', 'tid2eid'; a random checkpoint draws
    it by role). place: None for a tensor checkpoints carry but the forward does not read.
    optional: the forward does without it when a checkpoint lacks it."""

    name: str
    shape: tuple[int, ...]
    fmt: str
    kind: str
    role: str
    shard: Shard = REPLICATED
    place: str | None = None
    part: str | None = None
    optional: bool = False


class _Table:
    def __init__(self) -> None:
        self.out: list[Entry] = []

    def linear(self, name: str, shape: tuple[int, ...], fmt: str, place: str, shard: Shard = REPLICATED,
               part: str | None = None, role: str = "linear") -> None:
        self.out.append(Entry(name, shape, fmt, LINEAR, role, shard, place, part))

    def vector(self, name: str, shape: tuple[int, ...], fmt: str, role: str, place: str | None,
               shard: Shard = REPLICATED, part: str | None = None, optional: bool = False) -> None:
        self.out.append(Entry(name, shape, fmt, VECTOR, role, shard, place, part, optional))


def tensor_schema(cfg: ModelConfig) -> list[Entry]:
    """Every tensor of a checkpoint for `cfg`, in file order: the shape table of the reference
    modeling (transformers deepseek_v4 / deepseek_v41, DeepSeek's inference/model.py)."""
    v41 = cfg.arch == "v41"
    h, v, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    norm_fmt = "bf16" if v41 else "f32"  # V4.1 ships its RMSNorm weights in BF16
    t = _Table()
    t.linear("embed.weight", (v, h), "bf16", "embed", Shard(rows=VOCAB), role="embed")
    for i in range(cfg.num_layers):
        _layer(t, cfg, i, norm_fmt)
    t.vector("norm.weight", (h,), norm_fmt, "norm", "norm")
    t.linear("head.weight", (v, h), "bf16", "head", Shard(rows=VOCAB))
    if not v41:  # V4.1 collapses with the last site's pre-mix instead
        _hc(t, "hc_head_", "hc_head", (hc, hc * h), hc, 1)
    if cfg.has_draft:
        from engine.checkpoint.dspark_schema import draft_schema  # (it builds on this module)

        draft_schema(t, cfg, norm_fmt)
    return t.out


def _hc(t: _Table, prefix: str, place: str, fn: tuple[int, int], base: int, scale: int) -> None:
    """One mHC site's weights, file order fn, base, scale; loaded as the tuple (fn, scale, base)."""
    t.vector(prefix + "fn", fn, "f32", "hc_fn", place + ".0")
    t.vector(prefix + "base", (base,), "f32", "hc_base", place + ".2")
    t.vector(prefix + "scale", (scale,), "f32", "hc_scale", place + ".1")


def _layer(t: _Table, cfg: ModelConfig, i: int, norm_fmt: str) -> None:
    v41 = cfg.arch == "v41"
    h, hc = cfg.hidden_size, cfg.hc_mult
    hd, ql = cfg.head_dim, cfg.q_lora_rank
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    p = f"layers.{i}."  # (names and places share the layer prefix)
    if v41 and i in cfg.engram_layer_ids:
        k = cfg.engram_layer_ids.index(i)
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        t.out.append(Entry(p + "engram.embed.weight", (cfg.engram_num_embeddings[k], cfg.engram_head_dim),
                           "fp8_rows", TABLE, "table", place=p + "engram.table"))
        t.linear(p + "engram.wkv.weight", (h * (hc + 1), cols), "fp8", p + "engram.wkv")
        t.vector(p + "engram.q_weight", (hc, h), "bf16", "norm", p + "engram.qk", part="q")
        t.vector(p + "engram.k_weight", (hc, h), "bf16", "norm", p + "engram.qk", part="k")
    t.vector(p + "attn_norm.weight", (h,), norm_fmt, "norm", p + "attn_norm")
    a = p + "attn."
    _attention(t, cfg, a, norm_fmt)
    if v41:
        _v41_attention(t, cfg, i, a, norm_fmt)
    elif cfg.layer_kinds[i] == "csa":  # overlapping windows: two series (2x width), own indexer
        ratio = cfg.compress_ratios[i]
        _v4_compressor(t, a + "compressor.", a + "compressor", h, hd, ratio, True, norm_fmt)
        t.linear(a + "indexer.wq_b.weight", (ih * ihd, ql), "fp8", a + "indexer.wq_b")
        t.linear(a + "indexer.weights_proj.weight", (ih, h), "bf16", a + "indexer.weights_proj")
        _v4_compressor(t, a + "indexer.compressor.", a + "indexer.compressor", h, ihd, ratio, True, norm_fmt)
    elif cfg.layer_kinds[i] == "hca":
        _v4_compressor(t, a + "compressor.", a + "compressor", h, hd, cfg.compress_ratios[i], False, norm_fmt)
    t.vector(p + "ffn_norm.weight", (h,), norm_fmt, "norm", p + "ffn_norm")
    _ffn(t, cfg, i, p + "ffn.")
    _hc_sites(t, cfg, p)


def _hc_sites(t: _Table, cfg: ModelConfig, p: str) -> None:
    """A block's two mHC sites (attention, FFN)."""
    h, hc = cfg.hidden_size, cfg.hc_mult
    mix = (2 + hc) * hc
    for site in ("attn", "ffn"):
        _hc(t, f"{p}hc_{site}_", f"{p}hc_{site}", (mix, hc * h), mix, 3)


def _attention(t: _Table, cfg: ModelConfig, a: str, norm_fmt: str) -> None:
    """The sliding-window attention every block has (main and draft layers): the q / K=V latents
    stacked into qkv, the grouped low-rank output, the sinks."""
    h, nh, hd, ql = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    og, ol = cfg.o_groups, cfg.o_lora_rank
    t.linear(a + "wq_a.weight", (ql, h), "fp8", a + "qkv", part="q_lat")
    t.vector(a + "q_norm.weight", (ql,), norm_fmt, "norm", a + "q_norm")
    t.linear(a + "wq_b.weight", (nh * hd, ql), "fp8", a + "wq_b", Shard(rows=HEADS, row_unit=hd))
    t.linear(a + "wkv.weight", (hd, h), "fp8", a + "qkv", part="kv_lat")
    t.vector(a + "kv_norm.weight", (hd,), norm_fmt, "norm", a + "kv_norm")
    # the wo_a blocks of this rank's heads, and the wo_b columns of their groups
    t.linear(a + "wo_a.weight", (og * ol, nh * hd // og), "fp8", a + "wo_a",
             Shard(rows=OUT_GROUPS, row_unit=ol, cols=GROUP_HEADS, col_unit=hd))
    t.linear(a + "wo_b.weight", (h, og * ol), "fp8", a + "wo_b", Shard(cols=OUT_GROUPS, col_unit=ol))
    t.vector(a + "attn_sink", (nh,), "f32", "sink", a + "sinks", Shard(rows=HEADS))


def _v41_attention(t: _Table, cfg: ModelConfig, i: int, a: str, norm_fmt: str) -> None:
    """CSA2: a KV source's compressor (one latent per group: wkv / wgate at head_dim, no ape, no
    wgate at ratio 1) and an index source's indexer; the BF16 projections of x join x_proj."""
    h, hd = cfg.hidden_size, cfg.head_dim
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    is_kv = i in cfg.kv_source_layer_ids
    if is_kv:
        t.linear(a + "compressor.wkv.weight", (hd, h), "bf16", a + "x_proj", part="comp_kv")
        if cfg.compress_ratios[i] > 1:
            t.linear(a + "compressor.wgate.weight", (hd, h), "bf16", a + "x_proj", part="comp_gate")
        t.vector(a + "compressor.norm.weight", (hd,), norm_fmt, "norm", a + "compressor.norm")
    if i in cfg.index_source_layer_ids:
        t.linear(a + "indexer.wq_b.weight", (ih * ihd, cfg.q_lora_rank), "fp8", a + "indexer.wq_b")
        t.linear(a + "indexer.weights_proj.weight", (ih, h), "bf16", a + "x_proj", part="idx_w")
        if is_kv:  # keys come from the source's pooled latent
            t.linear(a + "indexer.wk.weight", (ihd, hd), "fp8", a + "indexer.wk")
            t.vector(a + "indexer.k_norm.weight", (ihd,), norm_fmt, "norm", a + "indexer.k_norm")


def _v4_compressor(t: _Table, p: str, place: str, h: int, dim: int, rate: int, overlap: bool,
                   norm_fmt: str) -> None:
    w = 2 * dim if overlap else dim
    t.linear(p + "wkv.weight", (w, h), "bf16", place + ".wkv")
    t.linear(p + "wgate.weight", (w, h), "bf16", place + ".wgate")
    t.vector(p + "ape", (rate, w), "f32", "ape", place + ".ape")
    t.vector(p + "norm.weight", (dim,), norm_fmt, "norm", place + ".norm")


def _ffn(t: _Table, cfg: ModelConfig, i: int, f: str) -> None:
    h, e = cfg.hidden_size, cfg.n_routed_experts
    t.linear(f + "gate.weight", (e, h), "bf16", f + "gate")
    if cfg.hash_layers[i]:
        t.out.append(Entry(f + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "i64", IDS, "tid2eid",
                           place=f + "tid2eid"))
    else:
        t.vector(f + "gate.bias", (e,), "f32", "bias", f + "gate_bias", optional=True)
        if cfg.arch == "v41":  # (stored, unread)
            t.vector(f + "gate.bias_vl", (e,), "f32", "bias", None)
    _experts(t, cfg, e, f)


def _experts(t: _Table, cfg: ModelConfig, e: int, f: str, draft: bool = False) -> None:
    """A MoE's e routed experts (FP4) and its shared expert (FP8), w1 / w3 rows and w2 columns
    sharded by the width a rank holds of each expert it owns (draft: the DSpark layers' pool)."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    shared_inter = inter * cfg.n_shared_experts
    for x in range(e):
        rows = Shard(rows=EXPERT_WIDTH, expert=x, draft=draft)
        cols = Shard(cols=EXPERT_WIDTH, expert=x, draft=draft)
        t.linear(f"{f}experts.{x}.w1.weight", (inter, h), "fp4", f"{f}experts.{x}.0", rows)
        t.linear(f"{f}experts.{x}.w2.weight", (h, inter), "fp4", f"{f}experts.{x}.1", cols)
        t.linear(f"{f}experts.{x}.w3.weight", (inter, h), "fp4", f"{f}experts.{x}.2", rows)
    rows, cols = Shard(rows=SHARED), Shard(cols=SHARED)
    t.linear(f + "shared_experts.w1.weight", (shared_inter, h), "fp8", f + "shared_experts.0", rows)
    t.linear(f + "shared_experts.w2.weight", (h, shared_inter), "fp8", f + "shared_experts.1", cols)
    t.linear(f + "shared_experts.w3.weight", (shared_inter, h), "fp8", f + "shared_experts.2", rows)


# ---------------------------------------------------------------------------------------------
# Stored tensors


def stored_tensors(name: str, fmt: str, shape: tuple[int, ...],
                   block: tuple[int, int]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, stored shape) of each tensor a `fmt` tensor is stored as."""
    if fmt == "fp8":
        n, k = shape
        return [(name, "F8_E4M3", shape),
                (scale_name(name), "F8_E8M0", (math.ceil(n / block[0]), math.ceil(k / block[1])))]
    if fmt == "fp8_rows":
        n, k = shape
        return [(name, "F8_E4M3", shape), (scale_name(name), "F8_E8M0", (n, k // 32))]
    if fmt == "fp4":
        n, k = shape
        return [(name, "I8", (n, k // 2)), (scale_name(name), "F8_E8M0", (n, k // 32))]
    dtype = {"bf16": "BF16", "f32": "F32", "i64": "I64"}[fmt]
    return [(name, dtype, shape)]


# ---------------------------------------------------------------------------------------------
# Checking a checkpoint against the schema


def resolve(ckpt, name: str) -> str:
    """`name` as `ckpt` holds it: the canonical name, else a known alternative spelling (ALIASES);
    the canonical name when neither is there."""
    if ckpt.has(name):
        return name
    for suffix, alts in ALIASES.items():
        if name.endswith(suffix):
            for alt in alts:
                cand = name[: -len(suffix)] + alt
                if ckpt.has(cand):
                    return cand
    return name


def _describe(e: Entry) -> str:
    return f"{e.fmt} {list(e.shape)} ({KINDS[e.kind]})"


def check_stored(e: Entry, ckpt, name: str | None = None) -> Weight | RawTensor:
    """What `ckpt` holds for `e` (under `name`, default resolve(ckpt, e.name)): its Weight for a
    linear or a table, else its RawTensor; SchemaError unless it is there, in a format its kind
    accepts and with its logical shape. Reads headers only."""
    name = resolve(ckpt, e.name) if name is None else name
    if not ckpt.has(name):
        raise SchemaError(f"checkpoint lacks tensor {e.name!r}: the schema expects {_describe(e)}")
    got = raw = ckpt.raw(name)
    if raw.dtype not in ACCEPTS[e.kind]:
        raise SchemaError(f"tensor {name!r} is stored as {raw.dtype}; the schema expects {_describe(e)}, "
                          f"stored as one of {'/'.join(ACCEPTS[e.kind])}")
    if e.kind in (LINEAR, TABLE):
        got = ckpt.weight(name)
    if tuple(got.shape) != tuple(e.shape):
        raise SchemaError(f"tensor {name!r} has shape {list(got.shape)}; the schema expects {_describe(e)}")
    return got


def validate(cfg: ModelConfig, ckpt) -> list[tuple[Entry, Weight | RawTensor]]:
    """Check every tensor the forward reads against `ckpt` (headers only); SchemaError listing
    the disagreements. Returns each entry the checkpoint holds with what check_stored found."""
    from engine.checkpoint.dspark_schema import check_draft  # (it builds on this module)

    check_draft(cfg, ckpt)  # the draft layers' own, clearer errors first
    held, errors = [], []
    for e in tensor_schema(cfg):
        if e.place is None:
            continue
        if e.optional and not ckpt.has(resolve(ckpt, e.name)):
            continue
        try:
            held.append((e, check_stored(e, ckpt)))
        except CheckpointError as err:
            errors.append(str(err))
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise SchemaError(f"checkpoint disagrees with the {cfg.arch} schema: " + "; ".join(errors[:5]) + more)
    return held
