"""DeepSeek-V4.1's DSpark draft layers: the draft forward, named as DeepSeek's reference
inference/model.py names its parts (DSparkAttention, DSparkBlock, MarkovHead, ConfidenceHead).

What the main model hands the draft: the inputs of its target layers (`dspark_target_layer_ids`),
the mean of the hc streams entering each (collected by the V4.1 blocks when a step asks for them:
Batch.targets, ModelRunner.forward(targets=...)). Their concatenation goes through the first draft
layer's main_proj and main_norm: main_x, one row per main position.

Each draft layer keeps a window of K=V rows projected from main_x at the sequence's past
positions (engine/state/draft.py, DSpark.absorb). A draft block is [last token, noise x
(block_size - 1)] at the positions that follow; every draft layer is a sliding-window-only V4.1
layer (mHC, MoE with its own expert count and top-k) whose queries see the whole window and the
whole block, non-causally. After the last layer's collapse and norm, the shared head gives each
position's logits; the Markov head adds a low-rank bias from the previous token while the block's
tokens are drawn one after another, and the confidence head scores each position from the collapsed
stream and that Markov embedding.

Weights: the loader's `w.dspark` (engine/checkpoint/dspark_schema.py): main_proj, main_norm,
layers[j] (as a main layer's), norm, markov_head.embed / .head [vocab, rank],
confidence_head.proj [1, hidden + rank]. Embedding and head are the main model's. The config's
dspark_* fields (engine/model/config.py) give its shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from engine.model.batch import Batch
from engine.model.layers import Attention, Block, Embedding, project
from engine.model.rope import rope_tables
from engine.state.draft import DraftState, append_rows
from engine.state.sequence import F32 as NO_CODEC


class Draft(NamedTuple):
    """A drafted block: tokens [block_size] (the i-th drawn from position i), each position's
    logits [block_size, vocab] with the Markov bias added, their softmax (what rejection sampling
    weighs) and the confidence head's scores [block_size]."""

    tokens: Any
    logits: Any
    probs: Any
    confidence: Any


class DSparkAttention(Attention):
    """A sliding-window-only layer: the block's queries over the window of K=V rows projected
    from main_x and the block's own K=V rows, all of them, non-causally."""

    def __init__(self, cfg, w, ops, plan, codecs: dict) -> None:
        self.cfg, self.li, self.w, self.ops, self.codecs, self.rope = cfg, -1, w, ops, codecs, None
        self.heads = plan.heads[1] - plan.heads[0]  # this rank's query heads (0: none)
        self.ratio, self.kind, self.rope_name = 0, "sliding", "main"

    def window_rows(self, main_x, cos, sin):
        """K=V rows of main_x at its positions (on the window's grid)."""
        kv = project(self.ops, main_x, self.w.qkv)["kv_lat"]
        return self.ops.norm_rope_quant(kv, cos, sin, (self.w.kv_norm, self.cfg.rms_norm_eps), self.codec("window"))

    def __call__(self, x, windows: list, cos, sin, ranges: tuple):
        """x: every sequence's block rows, sequence after sequence (block_size each); windows:
        each sequence's window of this layer; ranges: (lo, hi, span) of each row's keys in the
        sequences' [window, block] side by side (DSpark.ranges). Each row attends its sequence's
        window and block. None on a rank without heads."""
        if not self.heads:
            return None
        ops, d = self.ops, self.cfg.head_dim
        _, q, kv = self.latents(x, cos, sin)
        n = x.shape[0] // len(windows)
        keys = ops.cat([part for b, w in enumerate(windows) for part in (w, kv[b * n : (b + 1) * n])], axis=0)
        lo, hi, span = ranges
        return ops.attention_ranges(q, keys, lo, hi, None, None, self.w.sinks, d**-0.5,
                                    exact=self.codec("window") != NO_CODEC, span=span)


class DSparkBlock(Block):
    """A draft layer: V4.1's single-pass mHC around DSparkAttention and the draft's MoE."""

    def __call__(self, h, pre_mix, windows: list, cos, sin, ids, ranges: tuple):
        w, attn = self.w, self.attn
        mixes = self.hc_mixes(h, w.hc_attn)
        out = attn(self.hc_pre(h, pre_mix, w.attn_norm), windows, cos, sin, ranges)
        h = self.hc_post(attn.output(out, cos, sin, h.shape[0]), h, *mixes[1:])
        pre_a = mixes[0]
        mixes = self.hc_mixes(h, w.hc_ffn)
        y = self.ffn(self.hc_pre(h, pre_a, w.ffn_norm), ids)
        return self.hc_post(y, h, *mixes[1:]), mixes[0]


class MarkovHead:
    """A rank-r bigram bias: the previous token's embedding [r] through its own head -> [vocab].
    Both are vocab-parallel (the reference's ParallelEmbedding / ParallelHead): a rank holds its
    vocabulary slice of each, the embedding summed over ranks, the bias gathered."""

    def __init__(self, embed, head, plan, ops) -> None:
        self.embed, self.head, self.ops = Embedding(embed, plan, ops), head, ops

    def __call__(self, ids):
        e = self.embed(ids)
        return self.ops.all_gather(self.ops.linear(e, self.head)), e


class ConfidenceHead:
    """One score per position from the collapsed stream and the Markov embedding."""

    def __init__(self, proj, ops) -> None:
        self.proj, self.ops = proj, ops

    def __call__(self, x, markov_embed):
        return self.ops.linear(self.ops.cat([x, markov_embed], axis=1), self.proj)[:, 0]


class DSpark:
    """The draft over the main Transformer (engine/model/base.py), sharing its embedding and head."""

    def __init__(self, model, w) -> None:
        cfg, ops = model.cfg, model.ops
        if len(w.layers) != cfg.dspark_layers or not cfg.dspark_layers:
            raise ValueError(f"DSpark: {len(w.layers)} draft layers loaded, the config has {cfg.dspark_layers}")
        self.model, self.ops, self.w = model, ops, w
        self.block_size, self.noise_token_id = cfg.dspark_block_size, cfg.dspark_noise_token_id
        self.target_layer_ids = tuple(cfg.dspark_target_layer_ids)
        # the draft's MoE: its own expert count and top-k
        self.cfg = dataclasses.replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts,
                                       num_experts_per_tok=cfg.dspark_num_experts_per_tok)
        self.layers = [DSparkBlock(self.cfg, -1, L, ops, DSparkAttention(self.cfg, L.attn, ops, model.plan,
                                                                         model.codecs))
                       for L in w.layers]
        self.main_proj, self.main_norm, self.norm = w.main_proj, w.main_norm, w.norm
        self.markov_head = MarkovHead(w.markov_head.embed, w.markov_head.head, model.plan, ops)
        self.confidence_head = ConfidenceHead(w.confidence_head.proj, ops)
        # how forward() runs its draft layers where the shapes repeat: region(key, fn, *arrays,
        # rows=...) -> fn(*arrays); the runner sets its backend's (CUDA graphs), None: eagerly
        self.region = None

    @property
    def targets(self) -> dict:
        """What to ask the main forward for (ModelRunner.forward(targets=...))."""
        return dict.fromkeys(self.target_layer_ids)

    def rope_host(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos / sin of the draft layers (no compressed branch: the main table), on the host."""
        return rope_tables(self.model.rope.freq_main, positions, self.cfg.rope_main.attention_factor)

    def rope(self, positions: np.ndarray) -> tuple:
        """rope_host's tables on the backend, in one upload."""
        cs = self.ops.asarray(np.stack(self.rope_host(positions)))
        return cs[0], cs[1]

    def main_x(self, inputs: list):
        """main_norm(main_proj(the target layers' inputs at the same positions, concatenated in
        layer order)); inputs: their columns in that order, in one or more arrays."""
        ops = self.ops
        x = inputs[0] if len(inputs) == 1 else ops.cat(inputs, axis=1)
        return ops.rmsnorm(ops.linear(x, self.main_proj), self.main_norm, self.cfg.rms_norm_eps)

    def new_state(self, position: int = 0) -> DraftState:
        """Empty windows whose next block starts at `position` (a sequence with history: the
        windows fill from there)."""
        d = self.cfg.head_dim
        return DraftState(position=position, windows=[self.ops.xp.zeros((0, d), np.float32) for _ in self.layers])

    def absorb(self, state: DraftState, targets: dict, n: int) -> None:
        """Append the K=V rows of the n main positions one sequence's forward just ran (a chunk
        continuing state.position), from their target inputs. Bounded replay may have run the
        target layers on only the chunk's trailing rows (at least a window of them): the rows
        every target layer has are used, the last of the chunk."""
        self._absorb_rows([state], targets, {i: ([0], [int(targets[i].shape[0])]) for i in self.target_layer_ids},
                          [n])

    def absorb_many(self, states: list[DraftState], targets: dict, ns: list[int]) -> None:
        """absorb for every sequence of one forward over chunks of ns rows: each target layer's
        rows are the sequences' in order, all of a chunk's or, under bounded replay, its trailing
        min(n, k) for the layer's k, which the row count determines."""
        rows = {}
        for i in self.target_layer_ids:
            counts = _rows_per_chunk(ns, int(targets[i].shape[0]))
            rows[i] = (np.cumsum([0, *counts]), counts)
        self._absorb_rows(states, targets, rows, ns)

    def absorb_kept(self, states: list[DraftState], targets: dict, lengths: list[int], keeps: list[int]) -> None:
        """absorb for every sequence of a verify step, whose chunks of `lengths` rows ran whole,
        side by side: each keeps the first keeps[b] rows of its chunk."""
        starts = np.cumsum([0, *lengths])
        self._absorb_rows(states, targets, dict.fromkeys(targets, (starts, keeps)), keeps)

    def _absorb_rows(self, states: list[DraftState], targets: dict, rows: dict, ns: list[int]) -> None:
        """absorb n = ns[b] positions into states[b] from rows[i] = (starts, counts): target layer
        i's rows starts[b] .. starts[b] + counts[b] of sequence b. Of those, the last m[b], the
        rows every target layer has for it, are its positions' (state.position + n - m ..); the
        last min(m[b], window) of them, all a window keeps, are projected, all sequences'
        together: taken from the target layers at once (_target_rows), one main_x, one rope
        table, one window_rows per draft layer; then each sequence's windows take its rows."""
        ops, win, ids = self.ops, self.cfg.sliding_window, self.target_layer_ids
        ends, m = {}, None
        for i in ids:  # (counts clipped to the rows the layer has, as slicing would)
            t = int(targets[i].shape[0])
            lo = np.minimum(np.asarray(rows[i][0][:len(states)], np.int64), t)
            ends[i] = np.minimum(lo + np.asarray(rows[i][1], np.int64), t)
            m = ends[i] - lo if m is None else np.minimum(m, ends[i] - lo)
        for mb, n in zip(m, ns, strict=True):
            if mb > n or mb < min(n, win):
                raise ValueError(f"DSpark: {mb} target rows for a chunk of {n} (window {win})")
        m = np.minimum(m, win)  # (a window keeps the last `win` rows: earlier ones are not projected)
        if m.any():
            main_x = self.main_x(self._target_rows(targets, ends, m))
            cos, sin = self.rope(np.concatenate([np.arange(st.position + n - mb, st.position + n)
                                                 for st, n, mb in zip(states, ns, m, strict=True)]))
            append_rows(ops, states, [layer.attn.window_rows(main_x, cos, sin) for layer in self.layers],
                        [int(mb) for mb in m], win)
        for st, n in zip(states, ns, strict=True):
            st.position += n

    def _target_rows(self, targets: dict, ends: dict, counts: np.ndarray) -> list:
        """Target layer i's rows ends[i][b] - counts[b] .. ends[i][b] of every sequence b, in order,
        for every target layer: as arrays whose columns side by side are main_x's input, the
        layers of the same rows joined first and taken together (a slice where the rows are one
        run, else one gather)."""
        ops, groups = self.ops, []  # (rows, the layers' inputs)
        for i in self.target_layer_ids:
            pick = np.concatenate([np.arange(e - c, e) for e, c in zip(ends[i], counts, strict=True)])
            if groups and np.array_equal(groups[-1][0], pick) and groups[-1][1][0].shape[0] == targets[i].shape[0]:
                groups[-1][1].append(targets[i])
            else:
                groups.append((pick, [targets[i]]))
        out = []
        for pick, xs in groups:
            x = xs[0] if len(xs) == 1 else ops.cat(xs, axis=1)
            lo = int(pick[0])
            run = np.array_equal(pick, np.arange(lo, lo + pick.size))
            out.append(x[lo : lo + pick.size] if run else x[ops.asarray(pick, dtype=np.int64)])
        return out

    @staticmethod
    def ranges(lengths: list[int], n: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Each block row's keys [lo, hi) when every sequence's window (of lengths[b] rows) and
        block (n rows) lie side by side, and the longest span."""
        spans = np.asarray(lengths, np.int64) + n
        starts = np.cumsum(spans) - spans
        return np.repeat(starts, n), np.repeat(starts + spans, n), int(spans.max())

    def forward(self, states: list[DraftState], last_tokens: list[int]):
        """Every sequence's block [last token, noise ...] at positions state.position.. through
        every draft layer, the sequences side by side: the collapsed stream of each position
        (before the final norm) [len(states) * block, hidden], sequence after sequence, and the
        head's logits of each (without the Markov bias)."""
        return self._run(states, last_tokens, greedy=False)

    def _run(self, states: list[DraftState], last_tokens: list[int], greedy: bool, tokens_only: bool = False):
        """forward(), or with greedy the whole greedy block (_greedy_block; tokens_only: its tokens
        alone, none of the outputs a served greedy step does not read). Where every window is
        full (the shapes then repeat step after step) it runs as one region of the runner's
        (`region`: a CUDA graph on the GPU; its outputs are rewritten by its next run)."""
        ops, model, n, bsz = self.ops, self.model, self.block_size, len(states)
        ids = np.full((bsz, n), self.noise_token_id, np.int64)
        ids[:, 0] = last_tokens
        cos, sin = self.rope_host(np.concatenate([np.arange(st.position, st.position + n) for st in states]))
        lengths = [int(st.windows[0].shape[0]) for st in states]
        lo, hi, span = self.ranges(lengths, n)
        # the host's part in two uploads (ids, lo, hi as int64; cos, sin as float32), cut apart on the
        # backend: each upload and each copy into a graph's inputs costs the host a call
        inputs = (ops.asarray(np.concatenate([ids.reshape(-1), lo, hi]), dtype=np.int64),
                  ops.asarray(np.stack([cos, sin])), *(st.windows[i] for i in range(len(self.layers)) for st in states))

        def stream(i64, cs, *windows, collapse: bool = True):
            ids, lo, hi = i64[:bsz * n], i64[bsz * n:2 * bsz * n], i64[2 * bsz * n:]
            cos, sin = cs[0], cs[1]
            h, pre_mix = model.embed(Batch(ids=ids, hash_ids=None, rope={}, chunks=[]))
            for i, layer in enumerate(self.layers):
                h, pre_mix = layer(h, pre_mix, windows[i * bsz : (i + 1) * bsz], cos, sin, ids, (lo, hi, span))
            # the head's input: the streams' collapse (stored as an activation: bf16 under deepseek
            # numerics, as the reference's hc_pre) RMS-normalised, in one op as the main model's head
            # takes it; the main head's vocabulary slice on this rank, gathered
            logits = ops.all_gather(ops.linear(ops.hc_collapse_norm(h, pre_mix, self.norm, self.cfg.rms_norm_eps),
                                               model.head.w.head))
            if not collapse:  # (a greedy block of tokens alone: no confidence head reads it)
                return None, logits
            # the collapse itself, for the confidence head; a product and a sum, not einsum, which CuPy
            # hands to cuBLAS (not capturable)
            return ops.act((pre_mix[:, :, None] * h).sum(axis=1, dtype=np.float32)), logits

        def block(i64, cs, *windows):
            return self._greedy_block(*stream(i64, cs, *windows, collapse=not tokens_only), i64[:bsz * n:n], bsz,
                                      tokens_only)

        fn = block if greedy else stream
        if self.region is not None and min(lengths) == self.cfg.sliding_window:
            return self.region(("draft", id(self), bsz, span, greedy, tokens_only), fn, *inputs, rows=bsz * n)
        return fn(*inputs)

    def _markov(self, logits, i: int, prev):
        """Position i's Markov bias after tokens prev [bsz] added to logits [bsz, n, vocab] in
        place; the Markov embedding of prev (what the confidence head reads)."""
        bias, e = self.markov_head(prev)
        logits[:, i] += bias  # (in place: one kernel on the GPU, not an add and a copy)
        return e

    def _greedy_block(self, x, logits, last, bsz: int, tokens_only: bool = False) -> tuple:
        """Argmax drafting of every sequence on the backend, with no host work: tokens [n, bsz]
        (backend int64, position-major: position i's row is the next one's previous tokens as it
        lies), logits [bsz, n, vocab] with the Markov bias, their softmax, confidence; tokens_only:
        (tokens,)."""
        ops, xp, n = self.ops, self.ops.xp, self.block_size
        logits = logits.reshape(bsz, n, logits.shape[-1])
        tokens = xp.empty((n, bsz), np.int64)
        prev, embeds = last, []
        for i in range(n):
            bias, e = self.markov_head(prev)
            embeds.append(e)
            # (the bias added and the argmax taken in one pass: one kernel on the GPU)
            prev = ops.add_argmax(logits[:, i], bias, tokens[i])
        if tokens_only:
            return (tokens,)
        confidence = self.confidence_head(x, xp.stack(embeds, axis=1).reshape(bsz * n, -1)).reshape(bsz, n)
        return tokens, logits, _softmax_last(xp, logits), confidence

    def draft(self, state: DraftState, last_token: int, rng: np.random.Generator | None = None,
              temperature: float = 1.0) -> Draft:
        """One sequence's block (draft_many)."""
        return self.draft_many([state], [last_token], [rng], [temperature])[0]

    def draft_many(self, states: list[DraftState], last_tokens: list[int], rngs: list | None = None,
                   temperatures: list[float] | None = None, ahead: Callable[[], None] | None = None,
                   tokens_only: bool = False) -> list[Draft]:
        """Draft a block for each sequence, all in one forward: position i's logits plus the
        Markov bias of the token before it (the last token, then the drafted ones); each token
        their argmax (rng None), or drawn with the sequence's rng from softmax(logits / its
        temperature), the distributions `probs` then holds (what rejection sampling weighs; a
        backend array, ops.draw_drafts). A batch that only takes argmaxes drafts as one region
        (one graph on the GPU); one with drawing sequences draws each position with
        ops.draw_drafts, on the device on the GPU: only the tokens come to the host, at the end.
        ahead(): host work to do once the draft's device work is launched, before its tokens are
        read back (the verify step's plan: ModelRunner.prepare_verify). tokens_only: where every
        sequence is greedy, Drafts of tokens alone (logits, probs and confidence None: a greedy
        verify reads none of them, and the graph then neither computes nor copies them). Reads
        the states, never changes them."""
        ops, xp, n, bsz = self.ops, self.ops.xp, self.block_size, len(states)
        rngs = rngs or [None] * bsz
        temperatures = temperatures or [1.0] * bsz
        drawing = [b for b in range(bsz) if rngs[b] is not None]
        if not drawing:
            out = self._run(states, last_tokens, greedy=True, tokens_only=tokens_only)
            if ahead is not None:
                ahead()
            tokens = np.asarray(ops.to_host(out[0]), np.int64).T  # ([n, bsz] on the backend)
            if tokens_only:
                return [Draft(tokens[b], None, None, None) for b in range(bsz)]
            logits, probs, confidence = out[1:]
            # (copies, one of each array: a region's outputs are rewritten by its next run)
            logits, probs, confidence = logits.copy(), probs.copy(), confidence.copy()
            return [Draft(tokens[b], logits[b], probs[b], confidence[b]) for b in range(bsz)]
        x, logits = self.forward(states, last_tokens)
        vocab = logits.shape[-1]
        logits = logits.reshape(bsz, n, vocab).copy()  # (a region's output: its next run rewrites it)
        flat = logits.reshape(bsz * n, vocab)  # (a view: the Markov bias added to logits shows in it)
        # each drawing sequence's uniforms, one per position, taken as the draws go (position by
        # position, sequence by sequence), so that a generator shared by two sequences still
        # gives each the uniforms it always did
        uniforms = np.zeros((n, bsz))
        for i in range(n):
            for b in drawing:
                uniforms[i, b] = rngs[b].random()
        temps = [float(temperatures[b]) if rngs[b] is not None else 0.0 for b in range(bsz)]
        prev = ops.asarray(np.asarray(last_tokens, np.int64), dtype=np.int64)
        tokens, embeds, drawn_from = [], [], []
        for i in range(n):
            embeds.append(self._markov(logits, i, prev))
            prev, q = ops.draw_drafts(flat, [b * n + i for b in range(bsz)], temps, uniforms[i])
            tokens.append(prev)
            drawn_from.append(q)
        confidence = self.confidence_head(x, xp.stack(embeds, axis=1).reshape(bsz * n, -1)).reshape(bsz, n)
        probs = xp.stack(drawn_from, axis=1)  # [bsz, n, vocab]
        if ahead is not None:
            ahead()
        tokens = np.asarray(ops.to_host(xp.stack(tokens, axis=1)), np.int64)  # [bsz, n]
        return [Draft(tokens[b], logits[b], probs[b] if rngs[b] is not None else _softmax_last(xp, logits[b]),
                      confidence[b]) for b in range(bsz)]


def _softmax_last(xp, logits):
    """Softmax over the last axis, on the backend (what a greedy draft's probs hold)."""
    p = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def _rows_per_chunk(ns: list[int], total: int) -> list[int]:
    """min(n, k) for each chunk length n, for the k (a trailing-row bound) that makes them add up to
    `total`; ns themselves where they do."""
    if total == sum(ns):
        return list(ns)
    lo, hi = 0, max(ns, default=0)
    while lo < hi:  # the least k with sum(min(n, k)) >= total
        k = (lo + hi) // 2
        lo, hi = (k + 1, hi) if sum(min(n, k) for n in ns) < total else (lo, k)
    counts = [min(n, lo) for n in ns]
    if sum(counts) != total:
        raise ValueError(f"DSpark: {total} target rows fit no trailing bound of chunks {ns}")
    return counts
