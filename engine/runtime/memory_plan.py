"""Device memory planning: will this checkpoint, with N sequences of C tokens, fit these GPUs?

Per tensor-parallel rank (engine.parallel.shard.ShardPlan decides what each rank holds) the plan adds up

- weights: what `engine.checkpoint.loader.load_weights` puts on the device for that rank, counted
  from the tensor schema (engine/checkpoint/schema.py): each tensor's shard rule gives the
  rank's slice (heads, vocab rows, experts, shared-expert width), its stored format the bytes in
  the form the GPU backend keeps (engine/ops/gpu/ops.py `prepare`): fp8 data 1 B per value plus
  its block scales widened to f32 (4 B per block); fp4 experts 1/2 B per value plus one UE8M0
  byte per 32; bf16 linears 2 B; f32 linears and every vector (norms, mHC, sinks, biases, ape,
  which the model reads as float32) 4 B. Formats and block sizes come from the tensor headers
  (checked against the schema; no data is read), from `engine.checkpoint.tiny_model.tensor_specs`,
  or from the schema itself. Engram tables are counted as HOST bytes (pinned host memory: a
  token reads only a few rows of them); hash-routing tables (`tid2eid`, int64) are device bytes,
  gathered on the GPU.
- state: max_seqs * (fixed + per_token * max_context), with (per_token, fixed) from
  `resident_state_bytes_per_token` (engine/model/base.py): what a running sequence occupies on the device (float32
  arrays, growth-buffer headroom), not its stored size (`state_bytes_per_token`: V4.1's
  FP8 window rings, FP4 compressed KV and MXFP4 indexer keys, 4-7x smaller), which is what the
  host keeps between turns. Every rank keeps the whole (replicated) state of its sequences.
- workspace (per rank; override with workspace_bytes), with T = prefill_chunk + decode_rows
  tokens in one step (a prefill budget plus the running sequences' decode rows: one a sequence,
  block_size + 1 with draft layers):
      activations  T * hidden * hc_mult * 4 * ACT_FACTOR        (mHC streams in / out, mixes, norms)
      attention    T * local_heads * head_dim * 4 * 3           (q, attention output, un-roped output)
      moe          T * top_k * moe_inter * 4 * 3                (gathered rows, gate / up, SwiGLU)
      scores       prefill_chunk * max_entries * 4 * 3          (indexer scores, visibility, attention
                                                                 bias over the compressed entries of
                                                                 one sequence, max_entries =
                                                                 max_context / smallest compress ratio)
      split        T * top_k * (hidden + hidden / 128) * 4   (the tensor-core GEMMs' f16 terms of their
                                                                 largest input, the experts' gathered
                                                                 rows, and its group inverses)
      attend_tc    min(prefill_chunk, ATTEND_TC_QUERIES) * local_heads * (window + min(max_entries,
                   2 * index_topk) + 64) * 4     (a prompt chunk's tensor-core attention scores: each
                                                  query's window, then its listed or unmasked entries;
                                                  exact numerics only: under deepseek numerics the
                                                  prompt attention is one pass with no score buffer)
      logits       decode_rows * vocab * 4
      graphs       what the captured decode-step graphs keep (engine/ops/gpu/graphs.py):
                   graph_bytes_per_row * the rows of the Settings.graph_buckets largest row
                   counts up to min(MAX_GRAPH_ROWS, decode_rows), an estimate: a step's graph keeps its logits,
                   and its intermediates come from one pool shared by every captured step
- reserve: RESERVE_FRACTION of the GPU's bytes (allocator fragmentation, kernels, graph launches).

A rank fits when weights + state + workspace + reserve <= gpu_bytes (the free bytes per GPU).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.checkpoint.reader import Checkpoint, scale_name
from engine.checkpoint.schema import IDS, LINEAR, TABLE, SchemaError, resolve, tensor_schema, validate
from engine.model.config import ModelConfig, parse_config
from engine.ops.kernels import ATTEND_TC_QUERIES
from engine.parallel.shard import ShardingError, ShardPlan, slice_bounds
from engine.settings import DEFAULT_NUMERICS

__all__ = [
    "ACT_FACTOR",
    "RESERVE_FRACTION",
    "MemoryPlanError",
    "RankPlan",
    "MemoryPlan",
    "state_bytes",
    "weight_bytes",
    "workspace_bytes",
    "graph_bytes_per_row",
    "plan_memory",
    "check",
    "max_sequences",
    "max_context",
    "parse_gpus",
    "gpu_free_bytes",
]

ACT_FACTOR = 6
RESERVE_FRACTION = 0.03
GIB = 1 << 30


class MemoryPlanError(RuntimeError):
    """The checkpoint (with the requested sequences and context) does not fit the GPUs given."""


# ---------------------------------------------------------------------------------------------
# Weights: the schema's tensors, this rank's slices, in the form the GPU backend keeps


def _category(name: str) -> str:
    if name.startswith("mtp."):
        return "DSpark draft layers"
    if ".engram.embed." in name:
        return "engram tables (host)"
    if ".ffn.experts." in name:
        return "routed experts"
    if ".ffn.shared_experts." in name:
        return "shared experts"
    if name.startswith(("embed.", "head.")):
        return "embedding + head"
    if ".attn." in name:
        return "attention"
    return "other"


@dataclass(frozen=True)
class _Stored:
    """What a tensor's bytes follow from: for a linear or a table its format as read
    (reader.Weight.fmt: 'bf16' | 'f32' | 'fp8' | 'fp4'), scale blocks and the bytes of one scale;
    vectors and ids are uploaded as float32 / int64 whatever their stored dtype."""

    fmt: str
    block: tuple[int, int] | None = None
    scale_itemsize: int = 0
    table_scale: int = 0  # bytes of an FP8 table's scales (kept beside it in host memory)


@dataclass
class RankWeights:
    device: dict[str, int]  # category -> bytes on this rank's GPU
    host: dict[str, int]  # category -> bytes in host memory
    tensors: dict[str, tuple[int, int]]  # weight name -> (stored bytes of the slice, device bytes)

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def _book(self, cat: str, nbytes: int) -> None:
        d = self.host if cat.endswith("(host)") else self.device
        d[cat] = d.get(cat, 0) + int(nbytes)


def _from_format(fmt: str, shape: tuple[int, ...], block: tuple[int, int]) -> _Stored:
    """The stored form of a schema / TensorSpec format (tiny_model writes UE8M0 scales)."""
    if fmt == "fp8":
        return _Stored("fp8", block, 1)
    if fmt == "fp4":
        return _Stored("fp4", (1, 32), 1)
    if fmt == "fp8_rows":
        return _Stored("fp8", (1, 32), 1, shape[0] * (shape[1] // 32))
    return _Stored(fmt)


def _stored_forms(cfg: ModelConfig, source) -> dict[str, tuple[str, _Stored]]:
    """{schema name: (name as held, stored form)} of every tensor the forward reads that `source`
    holds: a Checkpoint (its headers, checked against the schema: SchemaError where they
    disagree), a checkpoint directory, a list of TensorSpecs (tiny_model.tensor_specs: nothing
    written), or None (the schema's own formats)."""
    if isinstance(source, (str, Path)):
        source = Checkpoint(source, block_size=cfg.weight_block_size)
    if isinstance(source, Checkpoint):
        out = {}
        for e, got in validate(cfg, source):
            if e.kind not in (LINEAR, TABLE):
                out[e.name] = (got.name, _Stored(""))
                continue
            table_scale = 0
            sname = resolve(source, scale_name(e.name))
            if e.kind == TABLE and got.fmt == "fp8" and source.has(sname):
                table_scale = source.raw(sname).array.nbytes
            itemsize = got.scale.itemsize if got.scale is not None else 0
            out[e.name] = (got.name, _Stored(got.fmt, got.block, itemsize, table_scale))
        return out
    block = tuple(cfg.weight_block_size or (128, 128))
    entries = [e for e in tensor_schema(cfg) if e.place is not None]
    specs = {e.name: e for e in entries} if source is None else {s.name: s for s in source}
    out = {}
    for e in entries:
        s = specs.get(e.name)
        if s is None:
            if e.optional:
                continue
            raise SchemaError(f"the tensor specs lack {e.name!r}, which the {cfg.arch} schema lists")
        out[e.name] = (e.name, _from_format(s.fmt, tuple(s.shape), block))
    return out


def _linear_bytes(name: str, s: _Stored, shape: tuple[int, ...], window: tuple) -> tuple[int, int]:
    """(stored bytes, device bytes) of a linear's slice: the GPU backend keeps FP8 scales widened
    to float32 and FP4 experts as stored (engine/ops/gpu/ops.py prepare)."""
    (r0, r1), (c0, c1), srows, scols = slice_bounds(name, s.fmt, s.block, shape, *window)
    if srows is None:
        n = (r1 - r0) * (c1 - c0) * (2 if s.fmt == "bf16" else 4)
        return n, n
    scales = (srows[1] - srows[0]) * (scols[1] - scols[0])
    if s.fmt == "fp8":
        data = (r1 - r0) * (c1 - c0)
        return data + scales * s.scale_itemsize, data + scales * 4
    stored = (r1 - r0) * (c1 // 2 - c0 // 2) + scales * s.scale_itemsize  # fp4: two values a byte
    return stored, stored


def weight_bytes(cfg: ModelConfig | dict, source=None, n_gpus: int = 1, expert_split: str = "ep") -> list[RankWeights]:
    """Per rank, the bytes of the weights engine.checkpoint.loader.load_weights loads for
    ShardPlan.make(cfg, r, n_gpus, expert_split), from the schema: its slice of each tensor (the
    shard rules), in the form the GPU backend keeps it. `source`: a Checkpoint, a checkpoint
    directory, tiny_model.tensor_specs(config), or None (the schema's formats)."""
    cfg = _as_config(cfg)
    stored = _stored_forms(cfg, source)
    entries = [e for e in tensor_schema(cfg) if e.name in stored]
    out = []
    for r in range(n_gpus):
        plan = ShardPlan.make(cfg, r, n_gpus, expert_split)
        rw = RankWeights({}, {}, {})
        products = set()
        for e in entries:
            window = e.shard.window(cfg, plan)
            if window is None:
                continue
            name, s = stored[e.name]
            if e.kind == TABLE:  # pinned host memory, in the stored format
                n = math.prod(e.shape) * {"fp8": 1, "bf16": 2}.get(s.fmt, 4) + s.table_scale
                rw._book(_category(name), n)
                rw.tensors[name] = (n, n)
            elif e.kind == LINEAR:
                st, dev = _linear_bytes(name, s, e.shape, window)
                rw._book(_category(name), dev)
                rw.tensors[name] = (st, dev)
            elif e.part is None or e.place not in products:  # vectors as float32, ids as int64
                if e.part is not None:  # Engram's q * k: one vector of their shape
                    products.add(e.place)
                rows = window[0] or (0, e.shape[0])
                n = (rows[1] - rows[0]) * math.prod(e.shape[1:])
                rw._book("DSpark draft layers" if e.name.startswith("mtp.") else "other",
                         n * (8 if e.kind == IDS else 4))
        out.append(rw)
    return out


def _as_config(cfg) -> ModelConfig:
    return parse_config(cfg) if isinstance(cfg, dict) else cfg


# ---------------------------------------------------------------------------------------------
# State and workspace


def state_bytes(cfg: ModelConfig, context: int) -> int:
    """Device bytes of one running sequence's state at `context` tokens (the formula of
    engine/model/base.py resident_state_bytes_per_token)."""
    from engine.model.base import resident_state_bytes_per_token

    per_token, fixed = resident_state_bytes_per_token(cfg)
    return int(math.ceil(fixed + per_token * context))


def workspace_bytes(cfg: ModelConfig, plan: ShardPlan, max_seqs: int, max_context: int,
                    prefill_chunk: int = 512, numerics: str = DEFAULT_NUMERICS) -> dict[str, int]:
    """The documented workspace estimate of one rank (see the module docstring), by term, for the
    forward's numerics (engine/settings.py)."""
    t = prefill_chunk + decode_rows(cfg, max_seqs)
    ratios = [r for i, r in enumerate(cfg.compress_ratios) if r > 0 and
              (cfg.arch != "v41" or i in cfg.kv_source_layer_ids)]
    max_entries = max_context // min(ratios) if ratios else 0
    local_heads = plan.heads[1] - plan.heads[0]
    from engine.ops.gpu.limits import MAX_GRAPH_ROWS
    from engine.settings import Settings

    top = min(MAX_GRAPH_ROWS, decode_rows(cfg, max_seqs))  # no decode step has more rows
    graph_rows = sum(max(0, top - i) for i in range(Settings.from_env().graph_buckets))
    return {
        "graphs": graph_rows * graph_bytes_per_row(cfg, plan),
        "activations": t * cfg.hidden_size * cfg.hc_mult * 4 * ACT_FACTOR,
        "attention": t * local_heads * cfg.head_dim * 4 * 3,
        "moe": t * cfg.num_experts_per_tok * cfg.moe_intermediate_size * 4 * 3,
        "scores": min(prefill_chunk, max_context) * max_entries * 4 * 3,
        "split": t * cfg.num_experts_per_tok * (cfg.hidden_size + -(-cfg.hidden_size // 128)) * 4,
        "attend_tc": 0 if numerics == "deepseek" else min(prefill_chunk, ATTEND_TC_QUERIES) * local_heads
        * (cfg.sliding_window + min(max_entries, 2 * cfg.index_topk) + 64) * 4,
        "logits": decode_rows(cfg, max_seqs) * cfg.vocab_size * 4,
    }


def decode_rows(cfg: ModelConfig, max_seqs: int) -> int:
    """The most rows a decode step runs: one a sequence, or with DSpark draft layers (which serve
    speculates with by default) a verify step's block_size + 1 a sequence."""
    return max_seqs * (cfg.dspark_block_size + 1 if cfg.has_draft else 1)


def graph_bytes_per_row(cfg: ModelConfig, plan: ShardPlan) -> int:
    """Bytes per row a captured decode step keeps in its graph's memory, estimated as the float32
    arrays its layers produce per row (per layer: the streams, the normed input, the q residual, q,
    the K=V row, the mixes, V4.1's compressor / indexer projections, then the output projection,
    the FFN's part and the updated streams; the embedding's streams; this rank's logits)."""
    d, hc, hd = cfg.hidden_size, cfg.hc_mult, cfg.head_dim
    heads = plan.heads[1] - plan.heads[0]
    mixes = 2 * hc + hc * hc  # pre, post, comb
    total = plan.vocab[1] - plan.vocab[0]  # head: this rank's logits
    if plan.single:  # embed: the streams (and V4.1's first collapse weights)
        total += hc * d + (hc if cfg.arch == "v41" else 0)
    for i in range(cfg.num_layers):
        # in: streams, normed input, q residual, q, K=V row, mixes, then V4.1's projections
        n = hc * d + d + cfg.q_lora_rank + heads * hd + hd + mixes
        ratio = cfg.compress_ratios[i]
        if cfg.arch == "v41" and ratio:
            indexed = i in cfg.index_source_layer_ids
            if cfg.layer_kinds[i] == "source":  # compressor kv + gate, or the entry (+ indexer key)
                n += 2 * hd if ratio > 1 else hd + (cfg.index_head_dim if indexed else 0)
            if indexed:  # indexer query and head weights
                n += cfg.index_n_heads * (cfg.index_head_dim + 1)
        if plan.single:
            n += hc * d + hc  # post: the streams, the next collapse weights
        else:
            n += d if heads else 0  # attn_out (a rank without heads adds zeros instead)
            n += hc * d + d + mixes  # ffn: streams, this rank's FFN part, mixes
            n += hc * d  # out
        total += n
    return 4 * total


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass
class RankPlan:
    rank: int
    weights: dict[str, int]  # category -> device bytes
    state: int
    workspace: int
    reserve: int
    host: dict[str, int] = field(default_factory=dict)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def total(self) -> int:
        return self.weights_total + self.state + self.workspace + self.reserve


@dataclass
class MemoryPlan:
    n_gpus: int
    gpu_bytes: int
    max_seqs: int
    max_context: int
    prefill_chunk: int
    state_per_seq: int
    ranks: list[RankPlan]
    workspace_terms: dict[str, int]
    name: str = "checkpoint"
    _ctx: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return all(r.total <= self.gpu_bytes for r in self.ranks)

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def host_bytes(self) -> int:
        """Host memory for the Engram tables (one copy, shared by the ranks of a host)."""
        return max((sum(r.host.values()) for r in self.ranks), default=0)

    def consumers(self, rank: RankPlan | None = None) -> list[tuple[str, int]]:
        r = rank or self.worst
        items = [(f"weights: {k}", v) for k, v in r.weights.items()]
        items += [(f"state ({self.max_seqs} seqs x {self.max_context} tokens)", r.state),
                  ("workspace", r.workspace), ("reserve", r.reserve)]
        return sorted(items, key=lambda kv: -kv[1])

    def summary(self) -> str:
        g = _gib
        lines = [f"memory plan: {self.name} on {self.n_gpus} GPU(s) of {g(self.gpu_bytes)} free, "
                 f"{self.max_seqs} sequences x {self.max_context} tokens, prefill chunk {self.prefill_chunk}",
                 f"{'rank':>4} {'weights':>11} {'state':>11} {'workspace':>11} {'reserve':>11} {'total':>11}  fits"]
        for r in self.ranks:
            lines.append(f"{r.rank:>4} {g(r.weights_total):>11} {g(r.state):>11} {g(r.workspace):>11} "
                         f"{g(r.reserve):>11} {g(r.total):>11}  {'yes' if r.total <= self.gpu_bytes else 'NO'}")
        w = self.worst
        lines.append(f"largest (rank {w.rank}): " + ", ".join(f"{k} {g(v)}" for k, v in self.consumers(w)[:4]))
        lines.append(f"state per sequence: {g(self.state_per_seq)}; host memory (Engram tables): "
                     f"{g(self.host_bytes)}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 100 else f"{n / (1 << 20):.2f} MiB"


def plan_memory(cfg: ModelConfig | dict, ckpt, n_gpus: int, gpu_bytes: int, max_seqs: int, max_context: int,
                workspace_bytes: int | None = None, *, prefill_chunk: int = 512,
                weights: list[RankWeights] | None = None, name: str | None = None,
                numerics: str = DEFAULT_NUMERICS) -> MemoryPlan:
    """Plan n_gpus ranks of `gpu_bytes` free bytes each for max_seqs sequences of max_context
    tokens. `ckpt`: a Checkpoint, a checkpoint directory, tensor_specs(config) or None (the
    schema's formats). `weights`
    (from weight_bytes(cfg, ckpt, n_gpus)) skips recounting them."""
    cfg = _as_config(cfg)
    if n_gpus < 1 or max_seqs < 0 or max_context < 0:
        raise ValueError("n_gpus must be >= 1, max_seqs and max_context >= 0")
    weights = weights if weights is not None else weight_bytes(cfg, ckpt, n_gpus)
    per_seq = state_bytes(cfg, max_context)
    ranks, terms = [], {}
    ws_arg = workspace_bytes
    for r, rw in enumerate(weights):
        if ws_arg is None:
            terms = _workspace(cfg, ShardPlan.make(cfg, r, n_gpus), max_seqs, max_context, prefill_chunk, numerics)
            ws = sum(terms.values())
        else:
            ws, terms = int(ws_arg), {"given": int(ws_arg)}
        ranks.append(RankPlan(r, dict(rw.device), max_seqs * per_seq, ws, int(RESERVE_FRACTION * gpu_bytes),
                              dict(rw.host)))
    if name is None:
        if isinstance(ckpt, (Checkpoint, str, Path)):
            name = Path(ckpt.path if isinstance(ckpt, Checkpoint) else ckpt).name
    return MemoryPlan(n_gpus, int(gpu_bytes), max_seqs, max_context, prefill_chunk, per_seq, ranks, terms,
                      name or "checkpoint",
                      _ctx=dict(cfg=cfg, ckpt=ckpt, workspace_bytes=ws_arg, weights={n_gpus: weights},
                                numerics=numerics))


_workspace = workspace_bytes  # plan_memory's parameter shadows the function's name


def plan_largest_chunk(cfg: ModelConfig | dict, ckpt, n_gpus: int, gpu_bytes: int, max_seqs: int, max_context: int,
                       chunks: tuple[int, ...], *, weights: list[RankWeights] | None = None,
                       name: str | None = None, numerics: str = DEFAULT_NUMERICS) -> MemoryPlan:
    """plan_memory with the largest prefill chunk of `chunks` that fits; the smallest's plan when none
    does (check() then names what does not fit)."""
    cfg = _as_config(cfg)
    weights = weights if weights is not None else weight_bytes(cfg, ckpt, n_gpus)
    plan = None
    for chunk in sorted(chunks, reverse=True):
        plan = plan_memory(cfg, ckpt, n_gpus, gpu_bytes, max_seqs, max_context, prefill_chunk=chunk,
                           weights=weights, name=name, numerics=numerics)
        if plan.fits:
            break
    if plan is None:
        raise ValueError("no prefill chunk sizes given")
    return plan


def max_sequences(cfg: ModelConfig | dict, ckpt, n_gpus: int, gpu_bytes: int, max_context: int,
                  workspace_bytes: int | None = None, *, prefill_chunk: int = 512,
                  weights: list[RankWeights] | None = None, limit: int = 1 << 20,
                  numerics: str = DEFAULT_NUMERICS) -> int:
    """How many sequences of max_context tokens fit (0: not even one; capped at `limit`)."""
    cfg = _as_config(cfg)
    weights = weights if weights is not None else weight_bytes(cfg, ckpt, n_gpus)

    def fits(n: int) -> bool:
        return plan_memory(cfg, ckpt, n_gpus, gpu_bytes, n, max_context, workspace_bytes,
                           prefill_chunk=prefill_chunk, weights=weights, numerics=numerics).fits

    return _last_true(fits, 1, limit)


def max_context(cfg: ModelConfig | dict, ckpt, n_gpus: int, gpu_bytes: int, max_seqs: int,
                workspace_bytes: int | None = None, *, prefill_chunk: int = 512,
                weights: list[RankWeights] | None = None, limit: int = 1 << 30,
                numerics: str = DEFAULT_NUMERICS) -> int:
    """The longest context at which max_seqs sequences fit (0: none)."""
    cfg = _as_config(cfg)
    weights = weights if weights is not None else weight_bytes(cfg, ckpt, n_gpus)

    def fits(c: int) -> bool:
        return plan_memory(cfg, ckpt, n_gpus, gpu_bytes, max_seqs, c, workspace_bytes,
                           prefill_chunk=prefill_chunk, weights=weights, numerics=numerics).fits

    return _last_true(fits, 1, limit)


def _last_true(pred, lo: int, limit: int) -> int:
    """Largest n in [lo, limit] with pred(n) for a monotone (true, ..., true, false, ...) pred; lo-1 if none."""
    if not pred(lo):
        return lo - 1
    hi = lo
    while hi < limit and pred(min(hi * 2, limit)):
        hi = min(hi * 2, limit)
    if hi >= limit:
        return limit
    a, b = hi, min(hi * 2, limit)  # pred(a) true, pred(b) false
    while b - a > 1:
        m = (a + b) // 2
        a, b = (m, b) if pred(m) else (a, m)
    return a


def check(plan: MemoryPlan) -> MemoryPlan:
    """Raise MemoryPlanError, naming the largest consumers and what would fit, unless the plan fits."""
    if plan.fits:
        return plan
    w = plan.worst
    g = _gib
    parts = ", ".join(f"{k} {g(v)}" for k, v in plan.consumers(w)[:4])
    msg = [f"{plan.name} does not fit {plan.n_gpus} GPU(s) with {g(plan.gpu_bytes)} free each: rank {w.rank} "
           f"needs {g(w.total)} ({parts}); {plan.max_seqs} sequences x {plan.max_context} tokens of context, "
           f"{g(plan.state_per_seq)} of state per sequence."]
    hints = []
    ctx = plan._ctx
    cfg, ckpt, ws = ctx.get("cfg"), ctx.get("ckpt"), ctx.get("workspace_bytes")
    if cfg is not None and ckpt is not None:
        weights = ctx["weights"][plan.n_gpus]
        kw = dict(prefill_chunk=plan.prefill_chunk, weights=weights, numerics=ctx.get("numerics", DEFAULT_NUMERICS))
        if max(r.weights_total + r.reserve for r in plan.ranks) < plan.gpu_bytes:
            n = max_sequences(cfg, ckpt, plan.n_gpus, plan.gpu_bytes, plan.max_context, ws, **kw)
            if n > 0:
                hints.append(f"fewer sequences: --max-batch {n} fits at this context")
            c = max_context(cfg, ckpt, plan.n_gpus, plan.gpu_bytes, plan.max_seqs, ws, limit=plan.max_context, **kw)
            if c > 0:
                hints.append(f"a shorter context: --max-model-len {c} fits with {plan.max_seqs} sequences")
        else:
            msg.append(f"The weights alone need {g(w.weights_total)} on rank {w.rank}.")
        for n_gpus in (2, 4, 8, 16, 32, 64):
            if n_gpus <= plan.n_gpus:
                continue
            try:
                p = plan_memory(cfg, ckpt, n_gpus, plan.gpu_bytes, plan.max_seqs, plan.max_context, ws,
                                prefill_chunk=plan.prefill_chunk, numerics=kw["numerics"])
            except ShardingError:
                continue
            if p.fits:
                hints.append(f"more GPUs: --gpus with {n_gpus} GPUs fits ({g(p.worst.total)} per GPU)")
                break
        else:  # (the state is replicated on every rank: more GPUs only help with the weights)
            if not hints:
                hints.append("more GPUs (--gpus 0,1,...) than 64")
    else:
        hints.append("more GPUs (--gpus 0,1,...), fewer sequences (--max-batch) or a shorter context "
                     "(--max-model-len)")
    if hints:
        msg.append("Try " + "; or ".join(hints) + ".")
    raise MemoryPlanError(" ".join(msg))


# ---------------------------------------------------------------------------------------------
# GPUs


def parse_gpus(gpus: str | int | Iterable[int] | None) -> list[int] | None:
    """'0,1,2,3' / [0, 1] / 3 -> a list of device ids (None stays None)."""
    if gpus is None:
        return None
    if isinstance(gpus, int):
        ids = [gpus]
    elif isinstance(gpus, str):
        try:
            ids = [int(x) for x in gpus.replace(" ", "").split(",") if x != ""]
        except ValueError as e:
            raise ValueError(f"--gpus {gpus!r}: expected device ids like 0,1,2,3") from e
    else:
        ids = [int(x) for x in gpus]
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"--gpus {gpus!r}: expected distinct non-negative device ids like 0,1,2,3")
    return ids


def gpu_free_bytes(gpus: Sequence[int]) -> list[int]:
    """Free bytes on each device (cupy.cuda.Device(i).mem_info)."""
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    out = []
    for i in gpus:
        if i >= n:
            raise ValueError(f"--gpus: no GPU {i} (this machine has {n})")
        free, _total = cupy.cuda.Device(i).mem_info
        out.append(int(free))
    return out
