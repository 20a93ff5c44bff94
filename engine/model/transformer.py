"""DeepSeek-V4 and V4.1 forward pass, written once over a backend's ops.

A forward call takes several sequences, each with its own state and a chunk of >= 1 new tokens
(prefill, chunked prefill and decode are the same call). Token-wise work (projections, MoE,
mHC) runs on all tokens of the batch at once; attention and the compressors run per sequence
against that sequence's state.

Architecture facts (see DESIGN.md): shared K=V MQA with sinks over a sliding window plus
compressed entries; partial interleaved RoPE on the trailing channels, undone on the output;
grouped output projection; mHC streams with Sinkhorn; sqrtsoftplus MoE with a shared expert.
V4.1: CSA2 (KV sources publish compressed KV + indexer keys to their group, index sources
publish top-k, a candidate-block level), Engram, single-pass mHC, state stored on FP8/FP4 grids.
V4: per-layer CSA (overlapping windows, own indexer) / HCA compressors, hash-routed layers,
per-head q RMSNorm, hc_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from engine.model.config import ModelConfig, RopeSpec
from engine.model.engram import NgramHasher
from engine.parallel.tp import Collective, ShardPlan, StepRegion, rows_stackable, run_single, slice_weight
from engine.state import rows
from engine.state.decode_plan import StepInputs, plan_decode
from engine.state.sequence import F32 as NO_CODEC
from engine.state.sequence import (
    V41_CODECS,
    LayerState,
    SequenceState,
    marks_hold,
    place,
    plan_marks,
    restore_marks,
)

NEG_INF = np.float32(-np.inf)


# ---------------------------------------------------------------------------------------------
# RoPE frequencies


def inv_freq(spec: RopeSpec) -> np.ndarray:
    """Per-pair inverse frequencies (float64 math, rounded once to float32), YaRN-corrected."""
    dim = spec.dim
    pos_freqs = spec.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    if spec.rope_type != "yarn":
        return extrapolation.astype(np.float32)
    interpolation = 1.0 / (spec.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * np.log(spec.original_max_position / (rotations * 2 * np.pi))) / (2 * np.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    return (interpolation * (1 - extra_factor) + extrapolation * extra_factor).astype(np.float32)


def rope_tables(freqs: np.ndarray, positions: np.ndarray, attention_factor: float = 1.0):
    angles = positions.astype(np.float32)[:, None] * freqs[None, :]
    return np.cos(angles) * np.float32(attention_factor), np.sin(angles) * np.float32(attention_factor)


# ---------------------------------------------------------------------------------------------
# Weights


class _Names:
    """Looks a tensor up under its canonical name or a known alternative spelling."""

    ALIASES = {"attn.kv_norm.weight": ("attn.norm.weight",)}

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def resolve(self, name: str) -> str:
        if self.ckpt.has(name):
            return name
        for suffix, alts in self.ALIASES.items():
            if name.endswith(suffix):
                for alt in alts:
                    cand = name[: -len(suffix)] + alt
                    if self.ckpt.has(cand):
                        return cand
        return name  # let the checkpoint raise its "missing tensor" error

    def has(self, name: str) -> bool:
        return self.ckpt.has(self.resolve(name))


def load_weights(cfg: ModelConfig, ckpt, ops, plan: ShardPlan) -> SimpleNamespace:
    """Read every tensor the forward needs (this rank's slices of the split ones, see engine/parallel/tp.py),
    in the backend's compute form."""
    names = _Names(ckpt)

    def lin(name: str, rows=None, cols=None):
        w = ckpt.weight(names.resolve(name))
        return ops.prepare(w if rows is None and cols is None else slice_weight(w, rows, cols))

    def vec(name: str):
        return ops.asarray(ckpt.f32(names.resolve(name)))

    def opt_vec(name: str):
        return vec(name) if names.has(name) else None

    w = SimpleNamespace(embed=lin("embed.weight", rows=plan.vocab), head=lin("head.weight", rows=plan.vocab),
                        norm=vec("norm.weight"), layers=[])
    d, ol = cfg.head_dim, cfg.o_lora_rank
    h0, h1 = plan.heads
    if cfg.arch == "v4":
        w.hc_head = (vec("hc_head_fn"), vec("hc_head_scale"), vec("hc_head_base"))
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = p + "attn."
        L = SimpleNamespace(
            attn_norm=vec(p + "attn_norm.weight"), ffn_norm=vec(p + "ffn_norm.weight"),
            hc_attn=(vec(p + "hc_attn_fn"), vec(p + "hc_attn_scale"), vec(p + "hc_attn_base")),
            hc_ffn=(vec(p + "hc_ffn_fn"), vec(p + "hc_ffn_scale"), vec(p + "hc_ffn_base")),
            q_norm=vec(a + "q_norm.weight"), wq_b=lin(a + "wq_b.weight", rows=(h0 * d, h1 * d)),
            kv_norm=vec(a + "kv_norm.weight"),
            sinks=vec(a + "attn_sink")[h0:h1], comp=None, idx=None, engram=None, wo_a=None, wo_b=None,
        )
        # the q and K=V latents both project x: one stacked weight (one GEMV) where the formats allow
        L.qkv = _stacked_projections(ckpt, names, ops, {"q_lat": a + "wq_a.weight", "kv_lat": a + "wkv.weight"})
        groups = plan.head_groups(cfg)
        if groups:  # the wo_a blocks of this rank's heads, and the wo_b columns of their groups
            (g0, lo, hi), gl = groups[0], groups[-1][0]
            if any((x[1], x[2]) != (lo, hi) for x in groups):
                raise ValueError("a rank's heads must cover whole output groups or lie inside one")
            L.wo_a = lin(a + "wo_a.weight", rows=(g0 * ol, (gl + 1) * ol), cols=(lo * d, hi * d))
            L.wo_b = lin(a + "wo_b.weight", cols=(g0 * ol, (gl + 1) * ol))
            L.wo_groups = len(groups)
        kind = cfg.layer_kinds[i]
        # V4.1: the compressor's kv and gate and the indexer's head weights also all project x (BF16,
        # no scales): L.x_proj, stacked likewise
        xw = {}
        if kind in ("source", "csa", "hca"):
            c = a + "compressor."
            ratio = cfg.compress_ratios[i]
            if cfg.arch == "v41":
                xw.update({"comp_kv": c + "wkv.weight", **({"comp_gate": c + "wgate.weight"} if ratio > 1 else {})})
            L.comp = SimpleNamespace(
                wkv=lin(c + "wkv.weight") if cfg.arch == "v4" else None, norm=vec(c + "norm.weight"),
                wgate=lin(c + "wgate.weight") if cfg.arch == "v4" else None,
                ape=vec(c + "ape") if cfg.arch == "v4" else None,
            )
        if (cfg.arch == "v41" and i in cfg.index_source_layer_ids) or kind == "csa":
            x = a + "indexer."
            if cfg.arch == "v41":
                xw["idx_w"] = x + "weights_proj.weight"
            L.idx = SimpleNamespace(wq_b=lin(x + "wq_b.weight"),
                                    weights_proj=lin(x + "weights_proj.weight") if cfg.arch == "v4" else None)
            if cfg.arch == "v41" and kind == "source":
                L.idx.wk, L.idx.k_norm = lin(x + "wk.weight"), vec(x + "k_norm.weight")
            if kind == "csa":
                ic = x + "compressor."
                L.idx.comp = SimpleNamespace(wkv=lin(ic + "wkv.weight"), wgate=lin(ic + "wgate.weight"),
                                             ape=vec(ic + "ape"), norm=vec(ic + "norm.weight"))
        L.x_proj = _stacked_projections(ckpt, names, ops, xw)
        f = p + "ffn."
        L.gate_w = lin(f + "gate.weight")
        L.gate_bias = opt_vec(f + "gate.bias")
        L.tid2eid = ops.asarray(ckpt.raw(f + "gate.tid2eid").array, dtype=np.int64) if cfg.hash_layers[i] else None
        ec = plan.expert_cols if plan.expert_split == "width" else None  # this rank's slice of each expert
        L.experts = [(lin(f"{f}experts.{e}.w1.weight", rows=ec), lin(f"{f}experts.{e}.w2.weight", cols=ec),
                      lin(f"{f}experts.{e}.w3.weight", rows=ec)) if plan.owns_expert(e) else None
                     for e in range(cfg.n_routed_experts)]
        sc = plan.shared_cols
        L.shared = (lin(f + "shared_experts.w1.weight", rows=sc), lin(f + "shared_experts.w2.weight", cols=sc),
                    lin(f + "shared_experts.w3.weight", rows=sc)) if cfg.n_shared_experts and sc[1] > sc[0] else None
        if i in cfg.engram_layer_ids:
            e = p + "engram."
            scale = ckpt.raw(e + "embed.scale") if names.has(e + "embed.scale") else None
            table_arr = ops.prepare_table(ckpt.weight(e + "embed.weight"), scale)
            L.engram = SimpleNamespace(table=table_arr, wkv=lin(e + "wkv.weight"),
                                       qk=ops.asarray(ckpt.f32(e + "q_weight") * ckpt.f32(e + "k_weight")))
        w.layers.append(L)
    return w


def _stacked_projections(ckpt, names, ops, parts: dict) -> list:
    """[(weight, ((part, first row, end row), ...)), ...]: the named projections of one input, as one
    stacked weight where rows_stackable allows, else one weight each."""
    ws = {part: ckpt.weight(names.resolve(n)) for part, n in parts.items()}
    if len(ws) > 1 and rows_stackable(list(ws.values())):
        ends = np.cumsum([w.shape[0] for w in ws.values()])
        return [(ops.prepare_rows(list(ws.values())), tuple((part, int(e - w.shape[0]), int(e))
                                                            for (part, w), e in zip(ws.items(), ends, strict=True)))]
    return [(ops.prepare(w), ((part, 0, w.shape[0]),)) for part, w in ws.items()]


# ---------------------------------------------------------------------------------------------
# The model


class _Ahead(NamedTuple):
    """A decode step planned ahead (Model.prepare_next): its sequences and positions, their
    bookkeeping before and after the plan, its inputs (token fields placeholders) and the
    backend's staging of them."""

    states: list
    pos: np.ndarray
    before: tuple
    after: tuple
    inputs: StepInputs
    pre: object


def _token_ids(chunks: list) -> tuple[np.ndarray, np.ndarray]:
    """Every chunk's token ids in one int64 array, and each chunk's length (a decode step's
    one-token chunks without a numpy call apiece)."""
    if all(isinstance(ch, (list, tuple)) and len(ch) == 1 for ch in chunks):
        ids = np.array([ch[0] for ch in chunks], np.int64)
        if ids.ndim == 1:
            return ids, np.ones(len(chunks), np.int64)
    arrs = [np.asarray(ch, dtype=np.int64).reshape(-1) for ch in chunks]
    return np.concatenate(arrs), np.array([a.size for a in arrs], np.int64)


@dataclass
class _Seq:
    """One sequence's slice of the flattened batch."""

    state: SequenceState
    rows: slice
    pos: np.ndarray  # absolute positions of its new tokens
    shared: dict  # per-forward V4.1 group state: top-k mask, candidate blocks


def _joined(x):
    """x, or the value of a side branch (ops.side) joined into the current stream here."""
    return x.result() if hasattr(x, "result") else x


class _Projected(NamedTuple):
    """Token-wise outputs of a V4.1 layer's compressor / indexer projections (None where the
    layer has no such part): compressor kv / gate of every row (ratio > 1 sources), the RoPE'd
    quantized entry and indexer key of every row (ratio-1 sources: each token is a group), the
    indexer's query and head weights (index sources)."""

    comp_kv: object = None
    comp_gate: object = None
    entry: object = None
    idx_key: object = None
    idx_q: object = None
    idx_w: object = None

    def rows(self, r: slice) -> _Projected:
        return _Projected(*(None if a is None else a[r] for a in self))

    def take(self, idx) -> _Projected:
        """The rows at indices idx (a backend int64 array), gathered."""
        return _Projected(*(None if a is None else a[idx] for a in self))


class Model:
    def __init__(self, cfg: ModelConfig, ckpt, ops, tokenizer_json: str | Path | None = None,
                 store_quantized: bool = True, plan: ShardPlan | None = None):
        self.cfg, self.ops = cfg, ops
        self.plan = plan or ShardPlan.make(cfg)
        # V4.1 keeps its state on DeepSeek's FP8/FP4 grids; False computes on unrounded state
        # (only to compare against a reference run without fake quantization).
        self.store_quantized = store_quantized and cfg.arch == "v41"
        self.bounded_replay = True
        self.w = load_weights(cfg, ckpt, ops, self.plan)
        self.freq_main = inv_freq(cfg.rope_main)
        self.freq_comp = inv_freq(cfg.rope_compress)
        self.hasher = None
        if cfg.engram_layer_ids:
            if tokenizer_json is None:
                raise ValueError("this checkpoint has Engram layers: the tokenizer is needed to hash n-grams")
            self.hasher = NgramHasher(cfg, tokenizer_json)
        self.model_key = f"{cfg.model_type}:{cfg.num_layers}x{cfg.hidden_size}:{cfg.vocab_size}"
        self._next: _Ahead | None = None  # the next decode step's plan, made ahead (prepare_next)
        self.ahead_used = 0  # decode steps that took a plan made ahead (for tests and profiles)

    # ---- state -------------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        d = self.cfg.head_dim
        layers = [LayerState(window=self.ops.xp.zeros((0, d), np.float32)) for _ in range(self.cfg.num_layers)]
        codecs = dict(V41_CODECS) if self.store_quantized else {}
        return SequenceState(position=0, layers=layers, model_key=self.model_key, codecs=codecs,
                             placed=getattr(self.ops, "placement", self.ops.name))

    def state_bytes_per_token(self) -> tuple[float, int]:
        """(bytes per token of context, fixed bytes per sequence) in the stored formats: V4.1 keeps
        FP8 window rows (d + d/32 bytes), FP4 entries (d/2 + d/16) and MXFP4 indexer keys
        (di/2 + di/32) per group of `ratio` tokens; V4 keeps float32 (the reference's precision)."""
        cfg = self.cfg
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

    def resident_state_bytes_per_token(self) -> tuple[float, int]:
        """(bytes per token of context, fixed bytes per sequence) that a running sequence's state
        occupies in the backend's memory (what a GPU must hold), at most: every array is float32
        (on the storage grids), and each one a decode step grows lives in a growth buffer with up
        to 1 / rows.GROWTH of its rows plus rows.MIN_ROWS of headroom (engine/state/rows.py). V4.1:
        the windows, every KV source's pending group (kv and gate rows, buffers of 2 x ratio rows)
        and its entries and indexer keys. V4 decodes through plain arrays: its float32 formula."""
        cfg = self.cfg
        d, di, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window - 1
        if cfg.arch != "v41":
            return Model.state_bytes_per_token(self)
        # the window buffer: its w live rows and the new one, then max(MIN_ROWS, rows / GROWTH) spare
        fixed = cfg.num_layers * (w + 1 + max(rows.MIN_ROWS, (w + 1) // rows.GROWTH)) * d * 4
        per_token = 0.0
        for src in cfg.kv_source_layer_ids:
            ratio, width = cfg.compress_ratios[src], (d + di) * 4
            per_token += width * (1 + 1 / rows.GROWTH) / ratio
            fixed += rows.MIN_ROWS * width + (2 * ratio * 2 * d * 4 if ratio > 1 else 0)
        return per_token, int(fixed)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, states: list[SequenceState], chunks: list, all_logits: bool = False,
                on_device: bool = False) -> list[np.ndarray]:
        """Feed chunks[i] (>= 1 token ids) to states[i]; advance the states. Returns, per sequence,
        logits [vocab] of its last token (or [len(chunk), vocab] with all_logits); on_device: the
        last tokens' logits as one backend array [len(states), vocab], left on the device."""
        if not self.plan.single:
            raise RuntimeError("a sharded rank runs under engine.parallel.tp.run_ranks (forward_steps)")
        return run_single(self.forward_steps(states, chunks, all_logits, on_device))

    def step_sample(self, states: list[SequenceState], chunks: list, jobs: list) -> list:
        """forward(), then one token per engine.runtime.sampling.SampleJob (its row: the index of a state)
        drawn by the backend: on the GPU only the tokens and logprobs come back. A V4.1 decode
        step on one rank plans the next one for the same sequences while the device runs this one,
        where the backend asks (CupyOps DSUF_PREPARE_NEXT; prepare_next)."""
        logits = self.forward(states, chunks, on_device=True)
        ahead = None
        if (getattr(self.ops, "prepare_next", False) and self.cfg.arch == "v41" and self.plan.single
                and all(len(ch) == 1 for ch in chunks)):
            def ahead():
                self.prepare_next(states)
        return self.ops.sample_rows(logits, jobs, ahead=ahead)

    def prepare_next(self, states: list[SequenceState]) -> None:
        """The token-independent host work of a decode step of `states` (one new token each), done
        ahead: its plan (decode_plan.plan_decode, whose bookkeeping of the grown state is set aside
        again until that step: state.plan_marks / restore_marks; the copies into grown buffers go
        out now, after the step before, and are simply unused if the plan is), its RoPE tables and
        the backend's staging of them (CupyOps.prestage: the tables packed, token ids to come).
        forward() takes it if its next call is that step, with nothing changed in between."""
        cfg, ops = self.cfg, self.ops
        self._next = None
        sources = [li for li, kind in enumerate(cfg.layer_kinds) if kind == "source"]  # (their rows grow)
        before = plan_marks(states, sources)
        growth: list = []
        try:
            window, layers = plan_decode(cfg, states, ops.xp, growth, self._comp_rope_tables,
                                         self.plan.heads[1] > self.plan.heads[0])
            after = plan_marks(states, sources, like=before)
        finally:
            restore_marks(before)
        ops.copy_rows(growth)
        pos = np.array([st.position for st in states], np.int64)
        inputs = StepInputs(ids=np.zeros(len(states), np.int64),
                            hash_ids=np.zeros((len(states), *self.hasher.row_shape), np.int64) if self.hasher else None,
                            layers=layers, rope=self._rope_rows(pos), window=window, dec_rows=None)
        self._next = _Ahead(list(states), pos, before, after, inputs, ops.prestage(inputs))

    def _take_next(self, states: list[SequenceState], pos: np.ndarray) -> _Ahead | None:
        """The plan made ahead (prepare_next) if it is this decode step's, its bookkeeping applied;
        else None (it is dropped either way)."""
        nxt, self._next = self._next, None
        if (nxt is None or len(nxt.states) != len(states) or any(a is not b for a, b in zip(nxt.states, states,
                                                                                         strict=True))
                or not np.array_equal(nxt.pos, pos) or not marks_hold(nxt.before)):
            return None
        restore_marks(nxt.after)
        self.ahead_used += 1
        return nxt

    def _rope_rows(self, pos: np.ndarray) -> np.ndarray:
        """Both RoPE tables (cos, sin of the main and the compressed one) at each row's position."""
        cfg = self.cfg
        return np.stack([*rope_tables(self.freq_main, pos, cfg.rope_main.attention_factor),
                         *rope_tables(self.freq_comp, pos, cfg.rope_compress.attention_factor)])

    def forward_steps(self, states: list[SequenceState], chunks: list, all_logits: bool = False,
                      on_device: bool = False):
        """The forward as a generator: yields a Collective wherever ranks must combine partial
        results and resumes with the combined value (engine/parallel/tp.py drives it)."""
        cfg, ops = self.cfg, self.ops
        if len(states) != len(chunks) or not states:
            raise ValueError("forward needs one chunk per state")
        for st in states:
            place(st, getattr(ops, "placement", ops.name), ops.asarray)  # e.g. one restored from bytes
        # (checked and laid out for the whole batch at once: per-sequence numpy calls cost ~7 us
        # each sequence, 0.2 ms a decode step at batch 32)
        ids_all, sizes = _token_ids(chunks)
        if not sizes.all():
            raise ValueError("every chunk needs at least one token")
        if ids_all.min() < 0 or ids_all.max() >= cfg.vocab_size:
            raise ValueError(f"token id out of range [0, {cfg.vocab_size})")
        pos_all = np.array([st.position for st in states], np.int64)
        if ids_all.size == len(states):  # one token each (a decode step)
            bounds = [(i, i + 1) for i in range(len(states))]
        else:
            ends = np.cumsum(sizes)
            starts = ends - sizes
            pos_all = np.repeat(pos_all - starts, sizes) + np.arange(ends[-1])
            bounds = list(zip(starts.tolist(), ends.tolist(), strict=True))
        seqs = [_Seq(st, slice(a, b), pos_all[a:b], {}) for st, (a, b) in zip(states, bounds, strict=True)]
        ids = [ids_all[a:b] for a, b in bounds]
        # V4.1 sequences fed one token take the batched decode path: every layer's state rows are
        # planned on the host first (engine/state/decode_plan.py), so its device half has the same launches
        # whatever the positions; a step of only such sequences is one graph on one GPU. Prompt
        # chunks sharing the step take the chunk path beside them.
        dec = [i for i, ch in enumerate(ids) if ch.size == 1] if cfg.arch == "v41" else []
        window = layers = dec_rows = None
        # (a decode step of the sequences a plan was made ahead for: prepare_next)
        ahead = self._take_next(states, pos_all) if self._next is not None and len(dec) == len(seqs) else None
        self._next = None
        if ahead is not None:
            window, layers = ahead.inputs.window, ahead.inputs.layers
        elif dec:
            growth: list = []
            window, layers = plan_decode(cfg, [states[i] for i in dec], ops.xp, growth, self._comp_rope_tables,
                                         self.plan.heads[1] > self.plan.heads[0])
            ops.copy_rows(growth)
            if len(dec) < len(seqs):
                dec_rows = np.array([seqs[i].rows.start for i in dec], np.int64)
        inputs = StepInputs(
            ids=ids_all, hash_ids=self._engram_hashes(seqs, ids) if self.hasher else None, layers=layers,
            rope=ahead.inputs.rope if ahead is not None else self._rope_rows(pos_all), window=window,
            dec_rows=dec_rows)
        if layers is not None and dec_rows is None:  # a decode step alone: one graph per rank
            key = ("decode", id(self.w))

            def run(st):
                return self._run(st, seqs, all_logits)

            if self.plan.single:
                staged = {"pre": ahead.pre} if ahead is not None else {}  # (its tables packed ahead)
                local_logits = ops.graphed_step(key, inputs, lambda st: run_single(run(st)), rows=len(seqs), **staged)
            else:  # every rank's step at once, as the driver runs them (engine/parallel/tp.py StepRegion)
                local_logits = yield Collective("step", StepRegion(key, inputs, run, ops, len(seqs)))
        else:
            local_logits = yield from self._run(ops.stage(inputs), seqs, all_logits)
        for s, ch in zip(seqs, ids, strict=True):
            s.state.position += ch.size
        if on_device and not all_logits:
            return (yield Collective("gather", local_logits))
        logits = yield Collective("gather", ops.to_host(local_logits))
        if not all_logits:
            return [logits[i] for i in range(len(seqs))]
        return [logits[s.rows] for s in seqs]

    def _run(self, st: StepInputs, seqs: list[_Seq], all_logits: bool):
        """The forward's device work over staged inputs (ops.stage), as a generator like
        forward_steps: the embedding, every layer, the head; returns this rank's logits (of each
        sequence's last row, or of every row with all_logits)."""
        cfg, ops = self.cfg, self.ops
        ids, hash_ids = st.ids, st.hash_ids
        xin = None  # the next mHC site's input where the stream update computed it (_update)
        if self.plan.single:  # the embedding and the initial streams as one region
            h, pre_mix = ops.graphed(("embed", id(self.w)), lambda i: self._streams(ops.embed(self.w.embed, i)), ids)
        else:  # vocab-parallel: other ranks hold the other rows
            v0, v1 = self.plan.vocab
            local = (ids >= v0) & (ids < v1)
            x = ops.embed(self.w.embed, ops.xp.where(local, ids - v0, 0)) * local[:, None]
            h, pre_mix = self._streams((yield Collective("sum", x)))
        ropes = {"main": (st.rope[0], st.rope[1]), "compress": (st.rope[2], st.rope[3])}
        # a step mixing decode rows (st.layers plans their sequences) with prompt chunks (the chunk path)
        dseqs = [s for s in seqs if s.pos.size == 1] if st.layers is not None else []
        cseqs = [s for s in seqs if s.pos.size > 1] if st.layers is not None else seqs
        drows = st.dec_rows
        # a decode step whose regions run inline (one graph, or eagerly) keeps its query branches
        # open past the layer's projections: joined where the indexer and the attention read them
        late = not cseqs and ops.regions_inline()
        replay_from = self._replay_start() if not all_logits else cfg.num_layers
        # (a decode step drops no rows in bounded replay: its sequences have one row each)
        early = self._engram_early(hash_ids) if late else {}
        batch: dict = {}  # what a V4.1 decode step's index sources publish to later layers
        # Each layer runs as "regions" (pure functions of device arrays: ops.graphed may replay them
        # as CUDA graphs) around the per-sequence attention, which reads and grows the state: its
        # projections before; after, on one rank, the rest of the layer as one region, under tensor
        # parallelism three (output projection, FFN, stream update) with an all-reduce after the
        # first two. (A V4.1 decode step on one rank is a graph as a whole: its regions run inline.)
        for li, L in enumerate(self.w.layers):
            if li >= replay_from:  # bounded replay: drop rows no later output or state depends on
                idx = self._keep_trailing(seqs, 1 + (cfg.num_layers - li) * (cfg.sliding_window - 1))
                if idx is not None:
                    idx = ops.asarray(idx, dtype=np.int64)
                    h, pre_mix, ids = h[idx], pre_mix[idx], ids[idx]
                    xin = xin[idx] if xin is not None else None
                    ropes = {k: (c[idx], sn[idx]) for k, (c, sn) in ropes.items()}
                    hash_ids = hash_ids[idx] if hash_ids is not None else None
                    if dseqs and cseqs:
                        drows = ops.asarray([s.rows.start for s in dseqs], dtype=np.int64)
            cos, sin = ropes["compress" if cfg.compress_ratios[li] else "main"]
            eng = hash_ids if L.engram is not None else None
            h, xa, q_res, q, kv, pre_a, post_a, comb_a, *extra = ops.graphed(
                ("in", id(L)), lambda *a, li=li, L=L: self._layer_in(li, L, *a, late=late, early=early.get(li)), h,
                pre_mix, xin, eng, cos, sin)
            proj = _Projected(*extra)
            derope = (cos, sin)  # (the attention output's RoPE, undone before the output projection)
            if not cseqs:  # (by the decode attention itself: nothing left for _attn_out)
                out, derope = self._decode_attend(li, L, q, kv, proj, st.layers[li], batch, derope), (None, None)
            else:
                out = self._attention(li, L, xa, q_res, q, kv, cseqs, proj)
                if dseqs:  # the one-token sequences' rows, batched, beside the chunks
                    o = self._decode_attend(li, L, q[drows], kv[drows], proj.take(drows), st.layers[li], batch)
                    if out is not None:
                        out[drows] = o
            route_hash = L.tid2eid[ids] if L.tid2eid is not None else None
            if self.plan.single:  # no collectives: the rest of the layer is one region (one graph)
                h, pre_mix, xin = ops.graphed(("post", id(L)), lambda *a, li=li, L=L: self._post(li, L, *a),
                                              out, *derope, h, pre_a, post_a, comb_a, route_hash)
                continue
            part = (ops.graphed(("attn_out", id(L)), lambda *a, L=L: self._attn_out(L, *a), out, *derope)
                    if out is not None else ops.xp.zeros((xa.shape[0], cfg.hidden_size), dtype=np.float32))
            attn = yield Collective("sum", part)
            h, ffn_part, pre_f, post_f, comb_f = ops.graphed(
                ("ffn", id(L)), lambda *a, li=li, L=L: self._ffn(li, L, *a), attn, h, pre_a, post_a, comb_a, route_hash)
            ffn = yield Collective("sum", ffn_part)
            h, xin = ops.graphed(("out", id(L)), lambda *a, li=li: self._update(li + 1, *a), ffn, h, post_f, comb_f,
                                 pre_f)
            pre_mix = pre_f
        last = np.array([s.rows.stop - 1 for s in seqs])
        if not all_logits and not np.array_equal(last, np.arange(h.shape[0])):  # (decode: every row)
            rows = ops.asarray(last, dtype=np.int64)
            h, pre_mix = h[rows], pre_mix[last] if pre_mix is not None else None
            xin = xin[rows] if xin is not None else None
        return ops.graphed(("head", id(self.w)), self._head, h, pre_mix, xin)

    # ---- bounded replay ----------------------------------------------------------------
    def _replay_start(self) -> int:
        """First layer of V4.1's "bounded replay": after the last KV source no layer publishes
        anything later layers read except its own window, so layer l only needs the trailing
        in(l) = 1 + (n_layers - l) * (window - 1) rows of a chunk (its window for the state plus
        the window of every row the next layer needs). Exact, and O(1) in the prompt length."""
        cfg = self.cfg
        if not self.bounded_replay or cfg.arch != "v41" or not cfg.kv_source_layer_ids:
            return cfg.num_layers
        return max(cfg.kv_source_layer_ids) + 1

    @staticmethod
    def _keep_trailing(seqs: list[_Seq], keep: int) -> np.ndarray | None:
        """Restrict every sequence to its last `keep` rows; returns the row index (None: no change)."""
        if all(s.pos.size <= keep for s in seqs):
            return None
        idx, start = [], 0
        for s in seqs:
            n = min(s.pos.size, keep)
            idx.append(np.arange(s.rows.stop - n, s.rows.stop))
            s.rows, s.pos = slice(start, start + n), s.pos[-n:]
            s.shared = {k: v[-n:] for k, v in s.shared.items()}  # per-query masks follow their rows
            start += n
        return np.concatenate(idx)

    # ---- Engram ------------------------------------------------------------------------
    def _engram_hashes(self, seqs: list[_Seq], ids: list[np.ndarray]) -> np.ndarray:
        keep = self.cfg.engram_max_ngram_size - 1
        if all(ch.size == 1 for ch in ids):  # decode: one vectorized hash for the whole batch
            toks = [int(ch[0]) for ch in ids]
            out = self.hasher.decode([s.state.recent_tokens for s in seqs], toks, [int(s.pos[0]) for s in seqs])
            for s, t in zip(seqs, toks, strict=True):  # (host time of every decode step: kept lean)
                s.state.recent_tokens = [*s.state.recent_tokens, t][-keep:] if keep else []
            return out
        out = np.concatenate([self.hasher(s.state.recent_tokens, ch, int(s.pos[0]))
                              for s, ch in zip(seqs, ids, strict=True)], axis=0)
        for s, ch in zip(seqs, ids, strict=True):
            s.state.recent_tokens = (list(s.state.recent_tokens) + [int(t) for t in ch])[-keep:] if keep else []
        return out

    def _engram_kv(self, L, hash_ids: np.ndarray):
        """An Engram layer's rows for these hash ids, projected: a function of the ids alone."""
        ops = self.ops
        rows = ops.embed(L.engram.table, ops.asarray(hash_ids, dtype=np.int64))  # [T, cols, dim]
        return ops.linear(rows.reshape(rows.shape[0], -1), L.engram.wkv)

    def _engram_early(self, hash_ids) -> dict:
        """Each Engram layer's projected rows (_engram_kv) as a branch forked at the start of a
        decode step, where the backend asks (CupyOps DSUF_ENGRAM_EARLY: on a stream of its own,
        beside the layers before it, instead of on the critical path at its layer). Only for a step
        whose regions run inline (one graph): its branches may stay open across layers."""
        ops, cfg = self.ops, self.cfg
        if not getattr(ops, "engram_early", False) or hash_ids is None:
            return {}
        cols = {li: ops.xp.ascontiguousarray(hash_ids[:, cfg.engram_layer_ids.index(li)])
                for li, L in enumerate(self.w.layers) if L.engram is not None}
        return {li: ops.side(self._engram_kv, self.w.layers[li], c, lane=1) for li, c in cols.items()}

    def _engram(self, L, h, hash_ids: np.ndarray, early=None):
        """The Engram gate on the streams h; early: _engram_kv's branch, forked before."""
        ops, cfg = self.ops, self.cfg
        kv = early.result() if early is not None else self._engram_kv(L, hash_ids)
        d, hc = cfg.hidden_size, cfg.hc_mult
        key, value = kv[:, : hc * d].reshape(-1, hc, d), kv[:, hc * d :]
        return ops.engram_mix(h, key, value, L.engram.qk, cfg.rms_norm_eps)

    # ---- layer regions (token-wise, fixed shapes: CUDA-graph material) ---------------------
    def _layer_in(self, li: int, L, h, pre_mix, xin, engram_ids, cos, sin, late: bool = False, early=None):
        """Engram, the attention-site mHC mix and the q / K=V projections of every token. xin: the
        site's input if the previous stream update computed it. late: the query heads and the
        indexer's queries are returned as open side branches (see _joined). early: this Engram
        layer's projected rows, forked at the step's start (_engram_early)."""
        cfg, ops = self.cfg, self.ops
        if L.engram is not None:  # (engram_ids: every Engram layer's hash ids, one column each)
            h = self._engram(L, h, ops.xp.ascontiguousarray(engram_ids[:, cfg.engram_layer_ids.index(li)]), early)
        xa, mix = self._site_in(h, pre_mix, L.hc_attn, L.attn_norm, xin)
        # the compressor's and indexer's projections of xa on a stream of their own, beside the q and
        # K=V ones, where the backend asks (CupyOps DSUF_XPROJ_EARLY)
        xs = (ops.side(self._project, xa, L.x_proj, lane=2) if cfg.arch == "v41" and cfg.compress_ratios[li]
              and getattr(ops, "xproj_early", False) else None)
        lat = self._project(xa, L.qkv)
        q_res = ops.rmsnorm(lat["q_lat"], L.q_norm, cfg.rms_norm_eps)
        # the query heads (wq_b, the largest projection here) as a side branch, beside the K=V,
        # compressor and indexer chain of small kernels
        q = ops.side(self._query_heads, L, q_res, cos, sin)
        kv = ops.norm_rope_quant(lat["kv_lat"], cos, sin, (L.kv_norm, cfg.rms_norm_eps), self._codec("window"))
        extra = self._v41_projections(li, L, xa, q_res, cos, sin, late, xs)
        return (h, xa, q_res, q if late else q.result(), kv, *mix.result(), *extra)

    def _project(self, x, stacked: list) -> dict:
        """Projections of x by name, from _stacked_projections' weights (a stacked weight's parts
        are column slices of its one GEMV's output)."""
        out = {}
        for w, parts in stacked:
            y = self.ops.linear(x, w)
            out.update({part: y[:, r0:r1] if len(parts) > 1 else y for part, r0, r1 in parts})
        return out

    def _site_in(self, h, pre, hc_weights, norm, x=None):
        """An mHC site's input: the collapse + norm of the streams h (V4.1: with the previous
        site's weights `pre`; V4: with this site's own), or x where the stream update computed it,
        and this site's mixes as a side branch. V4.1 forks the mixes after the collapse where the
        backend asks (CupyOps DSUF_MIXES_LATE), so that the collapse, on the critical path, does not
        share the SMs with the mix kernel."""
        cfg, ops = self.cfg, self.ops
        if x is None and cfg.arch == "v41" and getattr(ops, "mixes_after_collapse", False):
            x = ops.hc_collapse_norm(h, pre, norm, cfg.rms_norm_eps)
        if x is not None:
            return x, self._site_mixes(h, hc_weights)
        mix = self._site_mixes(h, hc_weights)
        x = ops.hc_collapse_norm(h, pre if cfg.arch == "v41" else mix.result()[0], norm, cfg.rms_norm_eps)
        return x, mix

    def _site_mixes(self, h, hc_weights):
        """An mHC site's mixes (pre, post, comb) of the streams h, as a side branch: V4.1's
        single-pass mHC collapses with the previous site's weights, so these are needed only at the
        site's expand (after the attention, or the FFN) and run beside everything until then. (V4
        collapses with its own: its result() is taken at once.) No two mixes overlap: each site's
        is joined before the next site forks its own (they share the block counters)."""
        cfg = self.cfg
        return self.ops.side(self.ops.hc_mixes, h, *hc_weights, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def _query_heads(self, L, q_res, cos, sin):
        """q_res -> this rank's query heads [T, H, D], RoPE applied."""
        cfg, ops = self.cfg, self.ops
        t, hn = q_res.shape[0], self.plan.heads[1] - self.plan.heads[0]
        q = ops.linear(q_res, L.wq_b).reshape(t, hn, cfg.head_dim)
        return ops.norm_rope_quant(q, cos, sin, (None, cfg.rms_norm_eps) if cfg.arch == "v4" else None)

    def _v41_projections(self, li: int, L, x, q_res, cos, sin, late: bool = False, xs=None) -> tuple:
        """The token-wise part of a V4.1 layer's compressor and indexer (see _Projected), done for
        every row here so it can be graphed; the attention then only appends and selects. xs: x's
        projections by L.x_proj as a branch forked before (_layer_in)."""
        cfg, ops = self.cfg, self.ops
        p = [None] * len(_Projected._fields)
        ratio = cfg.compress_ratios[li]
        if cfg.arch != "v41" or not ratio:
            return tuple(p)
        # the indexer's queries: a side branch, beside the compressor's chain
        idx = ops.side(self._index_queries, L, q_res, cos, sin) if L.idx is not None else None
        # (the compressor's kv / gate and the indexer's head weights)
        xs = xs.result() if xs is not None else self._project(x, L.x_proj)
        if cfg.layer_kinds[li] == "source":
            if ratio > 1:
                p[0], p[1] = xs["comp_kv"], xs["comp_gate"]
            else:  # every token closes its own group at its own position: the entry and key now
                p[2], p[3] = self._entry_and_key(L, xs["comp_kv"], cos, sin)
        if idx is not None:
            p[4], p[5] = idx if late else idx.result(), xs["idx_w"]
        return tuple(p)

    def _index_queries(self, L, q_res, cos, sin):
        """The V4.1 indexer's queries: RoPE, then MXFP4 (the grid of the keys they are scored against)."""
        cfg, ops = self.cfg, self.ops
        q = ops.linear(q_res, L.idx.wq_b).reshape(-1, cfg.index_n_heads, cfg.index_head_dim)
        return ops.norm_rope_quant(q, cos, sin, None, self._codec("idx_keys"))

    def _codec(self, field: str) -> int:
        """The state codec (engine/state/sequence.py) a V4.1 state field's rows are rounded onto."""
        return V41_CODECS[field] if self.store_quantized else NO_CODEC

    def _entry_and_key(self, L, pooled, cos, sin) -> tuple:
        """A closed group's compressed entry and indexer key (None without an indexer) from its
        pooled row (pre-norm), RoPE at the group's first position: the entry is the normed latent
        rotated (stored as FP4 e2m1 + e4m3 scale per 16), the key the latent through wk, normed and
        rotated (MXFP4)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        latent, entry = ops.norm_rope_quant(pooled, cos, sin, (L.comp.norm, eps), self._codec("entries"),
                                            keep_normed=True)
        if L.idx is None:
            return entry, None
        key = ops.norm_rope_quant(ops.linear(latent, L.idx.wk), cos, sin, (L.idx.k_norm, eps), self._codec("idx_keys"))
        return entry, key

    def _streams(self, x):
        """The hc_mult residual streams of the embedded tokens x and V4.1's first collapse weights
        (single-pass mHC: the first site collapses stream 0; V4: None)."""
        cfg, ops = self.cfg, self.ops
        h = ops.xp.repeat(x[:, None, :], cfg.hc_mult, axis=1)
        pre_mix = None
        if cfg.arch == "v41":
            pre_mix = ops.xp.zeros((x.shape[0], cfg.hc_mult), dtype=np.float32)
            pre_mix[:, 0] = 1.0
        return h, pre_mix

    def _post(self, li: int, L, out, cos, sin, h, pre_a, post_a, comb_a, route_hash):
        """A single rank's layer after the attention: output projection, FFN, the streams updated.
        Returns the new streams, the next site's collapse weights and, where the update computed
        it, the next site's input (_update)."""
        attn = self._attn_out(L, out, cos, sin)
        h, ffn, pre_f, post_f, comb_f = self._ffn(li, L, attn, h, pre_a, post_a, comb_a, route_hash)
        h, x_next = self._update(li + 1, ffn, h, post_f, comb_f, pre_f)
        return h, pre_f, x_next

    def _update(self, nxt: int, out, h, post, comb, pre):
        """The streams updated by a sub-layer's output, and the next attention site's input (layer
        nxt's; the head's after the last layer) where the backend fuses the two (V4.1's collapse
        weights are known before the update); else None, and that site collapses the streams itself
        (V4; and an Engram layer, which changes the streams first)."""
        cfg, ops = self.cfg, self.ops
        last = nxt == len(self.w.layers)
        if not self._fuse_expand() or (not last and self.w.layers[nxt].engram is not None):
            return ops.hc_expand(out, h, post, comb), None
        norm = self.w.norm if last else self.w.layers[nxt].attn_norm
        return ops.hc_expand_norm(out, h, post, comb, pre, norm, cfg.rms_norm_eps)

    def _fuse_expand(self) -> bool:
        """Whether stream updates also give the next V4.1 site's collapse + norm (CupyOps
        DSUF_FUSED_EXPAND: one kernel for the two; the mixes then fork after it)."""
        return self.cfg.arch == "v41" and getattr(self.ops, "expand_norm_fused", False)

    def _head(self, h, pre_mix, x=None):
        """The streams' final collapse, norm (x: done by the last stream update) and this rank's
        vocabulary slice of the logits."""
        cfg, ops = self.cfg, self.ops
        if x is not None:
            return ops.linear(x, self.w.head)
        if cfg.arch != "v41":
            pre_mix = ops.hc_head_pre(h, *self.w.hc_head, cfg.rms_norm_eps, cfg.hc_eps)
        return ops.linear(ops.hc_collapse_norm(h, pre_mix, self.w.norm, cfg.rms_norm_eps), self.w.head)

    def _attn_out(self, L, out, cos, sin):
        """RoPE undone on the attention output (cos None: done already), then the grouped output
        projection."""
        ops = self.ops
        t = out.shape[0]
        if cos is not None:
            out = ops.rope(out, cos, sin, inverse=True)
        g = L.wo_groups
        grouped = ops.grouped_linear(out.reshape(t, g, -1), L.wo_a, g)
        return ops.linear(grouped.reshape(t, -1), L.wo_b)

    def _ffn(self, li: int, L, attn, h, pre_a, post_a, comb_a, route_hash):
        """Attention residual into the streams, the FFN-site mHC mix and this rank's MoE part."""
        if self._fuse_expand():
            h, xf = self.ops.hc_expand_norm(attn, h, post_a, comb_a, pre_a, L.ffn_norm, self.cfg.rms_norm_eps)
        else:
            h, xf = self.ops.hc_expand(attn, h, post_a, comb_a), None
        xf, mix = self._site_in(h, pre_a, L.hc_ffn, L.ffn_norm, xf)
        y = self._moe(li, L, xf, route_hash)
        return (h, y, *mix.result())

    # ---- MoE ---------------------------------------------------------------------------
    def _moe(self, li: int, L, x, hash_ids):
        cfg, ops = self.cfg, self.ops
        # the shared expert does not wait for the routing: a side branch, beside the routed experts
        # (forked before the routing, or after it where the backend says its GEMV would hold the SMs
        # that the routing's small kernels need)
        late = getattr(ops, "shared_after_routing", False)
        shared = None
        if L.shared is not None and not late:
            shared = ops.side(ops.swiglu_mlp, x, *L.shared, cfg.swiglu_limit)
        weights, experts = ops.route(x, L.gate_w, L.gate_bias, cfg.num_experts_per_tok, cfg.scoring_func,
                                     cfg.gate_temp, cfg.routed_scaling_factor, cfg.norm_topk_prob, hash_ids,
                                     L.experts)
        if L.shared is not None and late:
            shared = ops.side(ops.swiglu_mlp, x, *L.shared, cfg.swiglu_limit)
        # this rank's experts, plus the shared expert's branch, joined at the combine
        return ops.moe(x, L.experts, weights, experts, cfg.swiglu_limit, shared)

    # ---- attention ---------------------------------------------------------------------
    def _attention(self, li: int, L, x, q_res, q, kv, seqs: list[_Seq], proj: _Projected):
        """Each sequence's queries over its window, the new K=V rows and its compressed entries;
        grows the state. Returns the per-head output [T, H, D] (None on a rank without heads)."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        hn, d = self.plan.heads[1] - self.plan.heads[0], cfg.head_dim
        ratio = cfg.compress_ratios[li]
        win = cfg.sliding_window
        # decode (one query per sequence): every sequence in one launch over its sources in place
        decode = bool(hn) and all(s.pos.size == 1 for s in seqs)
        # (a lone sequence's output is the whole output unless other rows share the step)
        whole = len(seqs) == 1 and seqs[0].rows == slice(0, q.shape[0])
        out = xp.empty_like(q) if not whole and not decode else None
        sources = []
        for s in seqs:
            st = s.state.layers[li]
            r = s.rows
            keys = ops.cat([st.window, kv[r]], axis=0)
            st.window = keys[max(keys.shape[0] - (win - 1), 0):] if win > 1 else keys[:0]
            srcs = [(keys, None)]  # a decode query sees its whole window
            comp = cvis = None
            if ratio:
                comp, cvis = (self._v41_compressed(li, L, proj.rows(r), s) if cfg.arch == "v41"
                              else self._v4_compressed(li, L, x[r], q_res[r], s))
                if comp is None or not comp.shape[0]:
                    comp = cvis = None
                elif decode:
                    srcs.append((comp, cvis[0]))
            if decode:
                sources.append(srcs)
            elif hn:  # query i sees window keys lo[i] .. hi[i] (the state's rows, then the chunk's)
                i = np.arange(s.pos.size) + (keys.shape[0] - s.pos.size)
                lo, hi = np.maximum(i - (win - 1), 0), i + 1
                # (V4.1's masks and V4 CSA's are top-k selections; V4 HCA's only the causal limit)
                most = cfg.index_topk if cfg.arch == "v41" or cfg.layer_kinds[li] == "csa" else 0
                o = ops.attention_ranges(q[r], keys, lo, hi, comp, cvis, L.sinks, d**-0.5, most,
                                         exact=self._codec("window") != NO_CODEC)
                if out is None:
                    out = o
                else:
                    out[r] = o
        if decode:
            out = ops.attention_decode(q, sources, L.sinks, d**-0.5)
        return out if hn else None

    def _causal_cols(self, lens: np.ndarray, n: int):
        """Bool [S, n] on the backend: column j < lens[s] (the compressed entries or keys query s
        may see), built there rather than on the host and uploaded ([4096, 16384] at a 64k
        context)."""
        xp = self.ops.xp
        return xp.arange(n)[None, :] < self.ops.asarray(lens, dtype=np.int64)[:, None]

    # V4.1 decode -------------------------------------------------------------------------
    def _decode_attend(self, li: int, L, q, kv, p: _Projected, lp, batch: dict, derope: tuple | None = None):
        """The device half of a V4.1 layer's decode step (lp: its staged LayerPlan, see
        engine/state/decode_plan.py): the new rows into the state, the closing groups pooled into
        entries and indexer keys, the index source's top-k published in `batch`, then one
        attention launch over each window and its group's selected entries, read in place. Every
        sequence in one launch per op, whatever its phase; same values as the chunk path
        (_attention over _v41_compressed), which the consistency tests check bit for bit. derope:
        (cos, sin), the attention output returned with that RoPE undone (_attn_out's first step)."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        entry, key = p.entry, p.idx_key
        # the new rows into the state: the window's, and where ratio > 1 each one into its group
        pending = [(p.comp_kv, lp.pend_kv), (p.comp_gate, lp.pend_gate)] if lp.pool_kv is not None else []
        ops.scatter_rows_many([(kv, lp.win_dst), *pending])
        if pending:  # closing groups pool
            pooled = ops.gated_pool_rows(lp.pool_kv, lp.pool_gate, cfg.compress_ratios[li], cfg.head_dim)
            entry, key = self._entry_and_key(L, pooled, lp.pool_rope[0], lp.pool_rope[1])  # (at groups' first rows)
        ops.scatter_rows_many([(a, dst) for a, dst in ((entry, lp.entry_dst), (key, lp.key_dst)) if dst is not None])
        idx_q = _joined(p.idx_q)  # (always joined: a graph's capture must join every branch it forked)
        if lp.keys is not None:  # index source: every sequence's top-k over its group's keys
            scores = ops.indexer_scores_spans(idx_q, lp.keys, p.idx_w, cfg.index_n_heads, cfg.index_head_dim,
                                              lp.keys_cap)
            if lp.cand == "source":
                batch["cand"] = self._candidate_blocks(scores, lp.cand_last)
            elif lp.cand == "filter":
                scores = xp.where(batch["cand"], scores, NEG_INF)
            batch["topk"] = ops.topk_mask(scores, min(cfg.index_topk, lp.keys_cap))
        q = _joined(q)
        if self.plan.heads[1] == self.plan.heads[0]:
            return None
        mask = batch.get("topk")  # (its width is the publishing layer's keys_cap: at most index_topk true a row)
        return ops.attend_decode(q, lp.attend, mask, L.sinks, cfg.head_dim**-0.5, lp.attend_cap, cfg.sliding_window,
                                 0 if mask is None else min(cfg.index_topk, mask.shape[1]), derope=derope)

    def _comp_rope_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return rope_tables(self.freq_comp, positions, self.cfg.rope_compress.attention_factor)

    def _comp_tables(self, positions: np.ndarray) -> tuple:
        """Compressed-RoPE cos / sin at these positions, on the device in one upload."""
        t = self.ops.asarray(np.stack(self._comp_rope_tables(positions)))
        return t[0], t[1]

    def _comp_rope(self, x, first: int, ratio: int):
        return self.ops.rope(x, *self._comp_tables(first + ratio * np.arange(x.shape[0])))

    def _query_rope(self, q, pos: np.ndarray):
        return self.ops.rope(q, *self._comp_tables(pos))

    # V4.1 ---------------------------------------------------------------------------------
    def _v41_compressed(self, li: int, L, p: _Projected, s: _Seq):
        """CSA2 branch of one sequence (p: its rows of the layer's projections): returns (group's
        compressed entries, which of them each query sees: bool [S, n])."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        ratio = cfg.compress_ratios[li]
        st = s.state.layers[li]
        rotated, keys_new = None, None
        if cfg.layer_kinds[li] == "source":
            if ratio == 1:
                rotated, keys_new = p.entry, p.idx_key
            else:
                pooled, first = self._v41_pool(L, p, st, ratio)
                if pooled is not None:  # RoPE at each closing group's first position
                    cos, sin = self._comp_tables(first + ratio * np.arange(pooled.shape[0]))
                    rotated, keys_new = self._entry_and_key(L, pooled, cos, sin)
            if keys_new is not None:  # (a copy: region outputs are rewritten by the next step's replay)
                st.idx_keys = keys_new.copy() if st.idx_keys is None else ops.cat([st.idx_keys, keys_new])
        if L.idx is not None:
            self._v41_index(li, p, s)
        if rotated is not None:
            st.entries = rotated.copy() if st.entries is None else ops.cat([st.entries, rotated], axis=0)
        entries = s.state.layers[cfg.kv_group_source(li)].entries
        if entries is None or entries.shape[0] == 0:
            return None, None
        mask = s.shared.get("topk")
        if mask is None or mask.shape[1] != entries.shape[0]:
            # no index source has scored this group in this forward: nothing is selected
            return entries, xp.zeros((s.pos.size, entries.shape[0]), dtype=bool)
        return entries, mask

    def _v41_pool(self, L, p: _Projected, st: LayerState, ratio: int):
        """Pooled rows (before the norm) of the ratio > 1 groups that close in this chunk (None if
        none), and the position of the first."""
        ops = self.ops
        first = st.n_entries * ratio
        kv, gate = p.comp_kv, p.comp_gate
        if st.buf_kv is not None and st.buf_kv.shape[0]:
            kv, gate = ops.cat([st.buf_kv, kv]), ops.cat([st.buf_gate, gate])
        usable = (kv.shape[0] // ratio) * ratio
        # copies: kv / gate may be a graphed region's outputs, which the next step overwrites
        st.buf_kv, st.buf_gate = kv[usable:].copy(), gate[usable:].copy()
        if usable == 0:
            return None, first
        g, dd = usable // ratio, kv.shape[1]
        return ops.gated_pool(kv[:usable].reshape(g, ratio, dd), gate[:usable].reshape(g, ratio, dd)), first

    def _v41_index(self, li: int, p: _Projected, s: _Seq) -> None:
        """Index source: publish this sequence's top-k mask (and candidate blocks) for the group."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        ratio = cfg.compress_ratios[li]
        keys = s.state.layers[cfg.kv_group_source(li)].idx_keys
        if keys is None or keys.shape[0] == 0:
            return
        n = keys.shape[0]
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        # (queries and keys rounded onto the same codec's grid are exact in bf16)
        scores = ops.indexer_scores(p.idx_q, keys, p.idx_w, hi, di, exact=self._codec("idx_keys") != NO_CODEC)
        lens = (s.pos + 1) // ratio
        if not (lens >= n).all():  # queries that see only part of the keys (prefill)
            scores = xp.where(self._causal_cols(lens, n), scores, NEG_INF)
        cand = cfg.candidate_source_layer_id
        if li == cand:
            s.shared["cand"] = self._candidate_blocks(scores, ops.asarray((lens - 1) // cfg.candidate_block_size,
                                                                          dtype=np.int64))
        elif 0 <= cand < li and s.shared.get("cand") is not None and s.shared["cand"].shape[1] == n:
            scores = xp.where(s.shared["cand"], scores, NEG_INF)
        s.shared["topk"] = ops.topk_mask(scores, min(cfg.index_topk, n))

    def _candidate_blocks(self, scores, last):
        """Level one of the two-level top-k: the best blocks of `candidate_block_size` entries per
        query (block score = its best entry); the block holding the newest entry (last: each row's,
        a backend int64 array, -1 when nothing is visible yet) is always kept."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        bs = cfg.candidate_block_size
        s, n = scores.shape
        nb = -(-n // bs)
        padded = xp.full((s, nb * bs), NEG_INF, dtype=np.float32)
        padded[:, :n] = scores
        block = padded.reshape(s, nb, bs).max(axis=-1)
        block = xp.where(xp.arange(nb)[None, :] == last[:, None], np.float32(np.inf), block)
        keep = ops.topk_mask(block, min(cfg.candidate_topk_blocks, nb))
        return xp.repeat(keep, bs, axis=1)[:, :n]

    # V4 -----------------------------------------------------------------------------------
    def _v4_pool(self, kv, gate, ape, norm, st: LayerState, prefix: str, ratio: int, overlap: bool):
        """V4 compressor (CSA with two overlapping series, or HCA): entries closing in this chunk,
        already RoPE'd, or None. State fields are `<prefix>buf_kv` etc."""
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        keys = "entries" if prefix == "" else "idx_keys"
        n_before = 0 if getattr(st, keys) is None else getattr(st, keys).shape[0]
        bkv, bgate = getattr(st, prefix + "buf_kv"), getattr(st, prefix + "buf_gate")
        if bkv is not None and bkv.shape[0]:
            kv, gate = ops.cat([bkv, kv]), ops.cat([bgate, gate])
        usable = (kv.shape[0] // ratio) * ratio
        setattr(st, prefix + "buf_kv", kv[usable:])
        setattr(st, prefix + "buf_gate", gate[usable:])
        if usable == 0:
            return None
        g = usable // ratio
        ck = kv[:usable].reshape(g, ratio, -1)
        cg = gate[:usable].reshape(g, ratio, -1) + ape
        if overlap:
            d = ck.shape[-1] // 2
            nkv = xp.zeros((g, 2 * ratio, d), dtype=np.float32)
            ngate = xp.full((g, 2 * ratio, d), NEG_INF, dtype=np.float32)
            nkv[:, ratio:], ngate[:, ratio:] = ck[..., d:], cg[..., d:]
            if g > 1:
                nkv[1:, :ratio], ngate[1:, :ratio] = ck[:-1, :, :d], cg[:-1, :, :d]
            okv = getattr(st, prefix + "ovl_kv")
            if okv is not None:
                nkv[0, :ratio], ngate[0, :ratio] = okv, getattr(st, prefix + "ovl_gate")
            setattr(st, prefix + "ovl_kv", ck[-1, :, :d].copy())
            setattr(st, prefix + "ovl_gate", cg[-1, :, :d].copy())
            ck, cg = nkv, ngate
        pooled = ops.rmsnorm(ops.gated_pool(ck, cg), norm, cfg.rms_norm_eps)
        return self._comp_rope(pooled, n_before * ratio, ratio)

    def _v4_compressed(self, li: int, L, x, q_res, s: _Seq):
        cfg, ops, xp = self.cfg, self.ops, self.ops.xp
        ratio = cfg.compress_ratios[li]
        st = s.state.layers[li]
        c = L.comp
        csa = cfg.layer_kinds[li] == "csa"
        new = self._v4_pool(ops.linear(x, c.wkv), ops.linear(x, c.wgate), c.ape, c.norm, st, "", ratio, csa)
        if new is not None:
            st.entries = new if st.entries is None else ops.cat([st.entries, new], axis=0)
        lens = (s.pos + 1) // ratio
        n = st.n_entries
        visible = self._causal_cols(lens, n)
        if csa:
            ic = L.idx.comp
            newk = self._v4_pool(ops.linear(x, ic.wkv), ops.linear(x, ic.wgate), ic.ape, ic.norm, st, "idx_",
                                 ratio, True)
            if newk is not None:
                st.idx_keys = newk if st.idx_keys is None else ops.cat([st.idx_keys, newk], axis=0)
            if n:
                hi, di = cfg.index_n_heads, cfg.index_head_dim
                q = self._query_rope(ops.linear(q_res, L.idx.wq_b).reshape(-1, hi, di), s.pos)
                scores = ops.indexer_scores(q, st.idx_keys, ops.linear(x, L.idx.weights_proj), hi, di)
                scores = xp.where(visible, scores, NEG_INF)
                visible = ops.topk_mask(scores, min(cfg.index_topk, n))
        if n == 0:
            return None, None
        return st.entries, visible
