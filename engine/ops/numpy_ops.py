"""float32 numpy reference ops: the backend every other backend is tested against.

The model code (engine/model/) calls only these methods (engine/ops/protocol.py) plus `xp` array glue, so a GPU backend
supplies the same names with kernels behind them. Weights arrive as `engine.checkpoint.reader.Weight`
in their stored format; `prepare_*` turns them into whatever the backend computes with (here:
dequantized float32), once, at load time.
"""

from __future__ import annotations

import numpy as np

from engine.checkpoint import formats
from engine.parallel.shard import stack_rows
from engine.runtime import spec_sampling
from engine.runtime.sampling import sample_batch
from engine.state import sequence as codecs
from engine.state.decode_plan import with_spans
from engine.state.rows import Span

F32 = np.float32
NEG_INF = F32(-np.inf)


def fake_quant(ops, x, codec: int):
    """x onto a state codec's grid (engine/state/sequence.py: FP8_UE8M0_32, FP4_E4M3_16, FP4_UE8M0_32;
    F32: unchanged) through ops' fake_quant_* ops."""
    if codec == codecs.FP8_UE8M0_32:
        return ops.fake_quant_fp8(x, 32)
    if codec == codecs.FP4_E4M3_16:
        return ops.fake_quant_fp4(x, 16, e4m3_scales=True)
    if codec == codecs.FP4_UE8M0_32:
        return ops.fake_quant_fp4(x, 32)
    if codec != codecs.F32:
        raise ValueError(f"unknown state codec {codec}")
    return x


def norm_rope_quant_chain(ops, x, cos, sin, norm: tuple | None = None, quant: int = codecs.F32,
                          keep_normed: bool = False):
    """ops.norm_rope_quant as the chain of ops it stands for: rmsnorm (norm = (weight or None,
    eps); None: no norm), RoPE, fake-quant onto a state codec. Returns the result, or (normed
    before RoPE, result) with keep_normed."""
    n = x if norm is None else ops.rmsnorm(x, norm[0], norm[1])
    y = fake_quant(ops, ops.rope(n, cos, sin), quant)
    return (n, y) if keep_normed else y


class NumpyOps:
    """Reference implementation of every op of the forward pass, float32 throughout."""

    name = placement = "numpy"
    xp = np
    comm = None  # tensor parallelism: set by the lockstep driver (engine/parallel/lockstep.py)

    # ---- weights ---------------------------------------------------------------------
    def prepare(self, weight) -> np.ndarray:
        """Stored-format Weight (or plain array) -> float32 array used by `linear`."""
        if isinstance(weight, np.ndarray):
            return np.ascontiguousarray(weight, dtype=F32)
        return np.ascontiguousarray(dequantize(weight), dtype=F32)

    def prepare_rows(self, ws: list) -> np.ndarray:
        """Weights of one input as one, stacked along their output rows (engine/parallel/shard.py stack_rows)."""
        return self.prepare(stack_rows(ws))

    def prepare_table(self, table, scale=None) -> np.ndarray:
        """An Engram table (a row gather source): FP8 rows with a per-32 scale (`scale`, a RawTensor)
        are dequantized row-wise, as the reference does; a float table is used as stored (its
        values are exact and the reference ignores its scales)."""
        return np.ascontiguousarray(dequantize_table(table, scale), dtype=F32)

    def asarray(self, x, dtype=F32) -> np.ndarray:
        return np.asarray(x, dtype=dtype)

    def cat(self, arrays: list, axis: int = 0) -> np.ndarray:
        return np.concatenate(arrays, axis=axis)

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    def sample_rows(self, logits: np.ndarray, jobs: list, ahead=None) -> list:
        """One token per engine.runtime.sampling.SampleJob from logits [rows, vocab]; ahead(): host work
        the GPU backend does while the device finishes (here after the draw)."""
        out = sample_batch(np.asarray(logits), jobs)
        if ahead is not None:
            ahead()
        return out

    def add_argmax(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> np.ndarray:
        """x += bias in place (bias None: x as it is); out[:] = each row's argmax (the first on ties);
        returns out."""
        if bias is not None:
            x += bias
        out[...] = np.argmax(x, axis=1)
        return out

    def draw_drafts(self, logits: np.ndarray, rows, temperatures, uniforms) -> tuple[np.ndarray, np.ndarray]:
        """One position of a draft block, by the host rule (engine/runtime/spec_sampling.py)."""
        return spec_sampling.draw_drafts(logits, rows, temperatures, uniforms)

    def verify_rows(self, logits: np.ndarray, jobs: list) -> list:
        """Speculative verify of free sequences, by the host rule (engine/runtime/spec_sampling.py)."""
        return spec_sampling.verify_batch(np.asarray(logits), jobs)

    def copy_rows(self, jobs: list) -> None:
        """Row copies (src, src_row, dst, dst_row, rows) between 2-D arrays of one width, in order."""
        for src, sr, dst, dr, n in jobs:
            dst[dr : dr + n] = src[sr : sr + n]

    def fork(self, fn, *args):
        """fn(*args): the GPU backend runs it on a second stream while it captures a step; here now."""
        return fn(*args)

    def join_all(self) -> None:
        """Nothing forked is pending here (fork computes at once)."""

    def all_reduce(self, x):
        """x summed over the tensor-parallel ranks (one rank: x)."""
        return x if self.comm is None else self.comm.all_reduce(x)

    def all_gather(self, x):
        """The ranks' x joined along the last axis (one rank: x)."""
        return x if self.comm is None else self.comm.all_gather(x)

    def stage(self, inputs):
        """A step's inputs (engine/state/decode_plan.py StepInputs) as this backend's ops read them: here
        Spans of state rows and host arrays; the GPU backend uploads address tables."""
        return with_spans(inputs)

    def prestage(self, inputs):
        """A step's staging done ahead (the GPU backend packs its tables): nothing here."""
        return None

    def graphed_step(self, key, inputs, run, rows: int, pre=None):
        """run(staged inputs): a whole decode step (the GPU backend replays it as one graph)."""
        return run(self.stage(inputs))

    def scatter_rows(self, src: np.ndarray, dst: list) -> None:
        """Row b of src into the state row dst[b] (a Span of one row of a buffer; None: none)."""
        for b, sp in enumerate(dst):
            if sp is not None:
                sp.buf[sp.start] = src[b]

    # ---- dense math ------------------------------------------------------------------
    def act(self, x: np.ndarray) -> np.ndarray:
        """An activation as stored between ops: float32 here (exact numerics); DeepseekOps rounds
        it to bf16 (engine/ops/deepseek_ops.py)."""
        return x

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """y = x @ w.T with w [out, in]. einsum's own loops, not BLAS: each row's result is then
        independent of how many rows share the call, so the reference backend is batch- and
        chunking-invariant bit for bit (V4.1's FP8/FP4 state rounding would otherwise amplify
        BLAS's shape-dependent summation order into 1e-3 differences)."""
        return np.einsum("ti,oi->to", x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + (w.shape[0],))

    def grouped_linear(self, x: np.ndarray, w: np.ndarray, groups: int) -> np.ndarray:
        """Block-diagonal projection: x [T, G, in_g], w [G*out_g, in_g] -> [T, G, out_g]."""
        wg = np.asarray(w).reshape(groups, -1, w.shape[-1])
        return self.act(np.einsum("tgi,goi->tgo", x, wg, dtype=F32))

    def engram_mix(self, h: np.ndarray, key: np.ndarray, value: np.ndarray, qk: np.ndarray, eps: float) -> np.ndarray:
        """Gate the Engram value into each stream by the normalised stream-key match.
        h, key [T, hc, D]; value [T, D]; qk [hc, D] (q_weight * k_weight)."""
        d = h.shape[-1]
        rstd = (F32(1.0) / np.sqrt(np.mean(h * h, axis=-1) + F32(eps))) * (
            F32(1.0) / np.sqrt(np.mean(key * key, axis=-1) + F32(eps)))
        dot = np.sum(h * qk * key, axis=-1, dtype=F32) * rstd * F32(d**-0.5)
        gate = _sigmoid(np.copysign(np.sqrt(np.maximum(np.abs(dot), F32(1e-6))), dot))
        return self.act((h + gate[..., None] * value[:, None, :]).astype(F32))

    def embed(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return table[ids]

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
        return self.act(_rms(x, weight, eps))

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False,
             in_place: bool = False) -> np.ndarray:
        """Interleaved-pair RoPE on the trailing 2*cos.shape[-1] channels of x.
        x [T, ..., D]; cos/sin [T, rd/2] (broadcast over the middle axes). in_place: those channels
        rotated (and act()) in x, the others left as they are (not rounded: for an input the
        consumer rounds anyway, such as the attention output before wo_a), and x returned."""
        rd = cos.shape[-1] * 2
        extra = x.ndim - cos.ndim
        c = cos.reshape(cos.shape[:1] + (1,) * extra + cos.shape[1:])
        s = sin.reshape(c.shape)
        if inverse:
            s = -s
        even = x[..., -rd::2]
        odd = x[..., -rd + 1 :: 2]
        rot_even, rot_odd = even * c - odd * s, even * s + odd * c
        if in_place:
            x[..., -rd::2], x[..., -rd + 1 :: 2] = self.act(rot_even), self.act(rot_odd)
            return x
        out = x.copy()
        out[..., -rd::2] = rot_even
        out[..., -rd + 1 :: 2] = rot_odd
        return self.act(out)

    def norm_rope_quant(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, norm: tuple | None = None,
                        quant: int = codecs.F32, keep_normed: bool = False):
        """A state row's chain: RMSNorm (norm = (weight or None, eps)), RoPE (as rope()), then
        fake-quant onto a state codec (engine/state/sequence.py). With keep_normed: (normed, result)."""
        return norm_rope_quant_chain(self, x, cos, sin, norm, quant, keep_normed)

    # ---- mHC -------------------------------------------------------------------------
    def hc_mixes(self, streams: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray,
                 norm_eps: float, hc_eps: float, iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """streams [T, hc, D] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (Sinkhorn-projected)."""
        t, hc, _ = streams.shape
        mixes = self.hc_mix_logits(streams.reshape(t, -1), fn, norm_eps)
        eps = F32(hc_eps)
        pre = _sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
        post = F32(2.0) * _sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        logits = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(t, hc, hc)
        comb = _softmax(logits, axis=-1) + eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        return pre, post, comb

    def hc_mix_logits(self, flat: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
        """The mHC projection of the flattened streams [T, hc*D], RMS-normalised first."""
        return self.linear(_rms(flat, None, norm_eps), fn)

    def hc_head_pre(self, streams: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray,
                    norm_eps: float, hc_eps: float) -> np.ndarray:
        """V4's final hc_head mix: pre weights only."""
        t = streams.shape[0]
        flat = _rms(streams.reshape(t, -1), None, norm_eps)
        return _sigmoid(self.linear(flat, fn) * scale[0] + base) + F32(hc_eps)

    def hc_collapse_norm(self, streams: np.ndarray, pre: np.ndarray, weight: np.ndarray | None,
                         eps: float) -> np.ndarray:
        """A sub-layer's input: the streams collapsed by `pre`, RMS-normalised."""
        return self.rmsnorm(self.act(self.hc_collapse(streams, pre)), weight, eps)

    def hc_collapse(self, streams: np.ndarray, pre: np.ndarray) -> np.ndarray:
        return np.sum(pre[:, :, None] * streams, axis=1, dtype=F32)

    def hc_expand(self, out: np.ndarray, residual: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
        """new_k = post_k * out + sum_j comb[j, k] * residual_j."""
        mixed = np.einsum("tjk,tjd->tkd", comb, residual, dtype=F32)
        return self.act(post[:, :, None] * out[:, None, :] + mixed)

    # ---- MoE -------------------------------------------------------------------------
    def route(self, x: np.ndarray, gate_w: np.ndarray, bias: np.ndarray | None, top_k: int, scoring: str,
              temp: float, scale: float, normalise: bool, hash_ids: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Returns (weights [T, k] f32, expert ids [T, k] int64)."""
        logits = self.linear(x, gate_w)
        if temp != 1.0:
            logits = logits / F32(temp)
        if scoring == "sqrtsoftplus":
            scores = np.sqrt(np.logaddexp(F32(0.0), logits, dtype=F32))
        elif scoring == "sigmoid":
            scores = _sigmoid(logits)
        else:
            scores = _softmax(logits, axis=-1)
        if hash_ids is not None:
            idx = hash_ids.astype(np.int64)
        else:
            sel = scores + bias if bias is not None else scores
            idx = np.argsort(-sel, axis=-1, kind="stable")[:, :top_k]
        w = np.take_along_axis(scores, idx, axis=-1)
        if normalise and (top_k > 1 or hash_ids is not None):
            w = w / (w.sum(axis=-1, keepdims=True) + F32(1e-20))
        return (w * F32(scale)).astype(F32), idx

    def swiglu_mlp(self, x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, limit: float) -> np.ndarray:
        gate = self.linear(x, w1)
        up = self.linear(x, w3)
        if limit > 0:
            up = np.clip(up, -limit, limit)
            gate = np.minimum(gate, F32(limit))
        return self.linear(_silu(gate) * up, w2)

    def moe(self, x: np.ndarray, experts: list, weights: np.ndarray, ids: np.ndarray, limit: float,
            shared: np.ndarray | None = None) -> np.ndarray:
        """Routed experts: sum_k weights[t,k] * expert_{ids[t,k]}(x_t), plus `shared` (the shared
        expert's output) where given. experts[e] = (w1, w2, w3), or None for an
        expert another rank holds (its contribution arrives through the all-reduce)."""
        y = np.zeros_like(x)
        for e in np.unique(ids):
            if experts[int(e)] is None:
                continue
            rows, slot = np.nonzero(ids == e)
            w1, w2, w3 = experts[int(e)]
            out = self.swiglu_mlp(x[rows], w1, w2, w3, limit)
            np.add.at(y, rows, out * weights[rows, slot][:, None])
        return y + shared if shared is not None else y

    # ---- attention -------------------------------------------------------------------
    def attention(self, q: np.ndarray, kv: np.ndarray, bias: np.ndarray, sinks: np.ndarray,
                  scale: float) -> np.ndarray:
        """MQA with K == V and a per-head sink in the softmax denominator.
        q [S, H, D], kv [N, D], bias [S, N] (0 or -inf), sinks [H] -> [S, H, D].
        Each query reduces over exactly its visible keys, so its result does not depend on which
        other queries or masked keys share the call (chunking-invariant reference)."""
        out = np.empty_like(q)
        for s in range(q.shape[0]):
            keys = kv[np.flatnonzero(bias[s] == 0)]
            logits = np.einsum("hd,nd->hn", q[s], keys) * F32(scale)
            m = np.maximum(logits.max(axis=-1, initial=-np.inf), sinks)
            p = np.exp(logits - m[:, None])
            denom = p.sum(axis=-1) + np.exp(sinks - m)
            out[s] = np.einsum("hn,nd->hd", p / denom[:, None], keys)
        return out

    def attention_ranges(self, q: np.ndarray, keys: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                         entries: np.ndarray | None, emask: np.ndarray | None, sinks: np.ndarray, scale: float,
                         selected: int = 0, exact: bool = False, span: int = 0) -> np.ndarray:
        """A prompt chunk's attention: query s over keys rows lo[s] .. hi[s] - 1 (its window) and,
        given entries, the rows j of entries where emask[s, j]. (selected, an upper bound on each
        mask row's true values or 0, sizes the GPU kernel's work, exact says keys and entries sit
        on state codecs' grids, which bf16 holds exactly, and span, max(hi - lo), lets the GPU take
        lo / hi as device arrays; the result depends on none of them.)"""
        return self.attention_decode(q, [[(keys[lo[s]:hi[s]], None)] + ([] if entries is None else
                                                                          [(entries, emask[s])])
                                         for s in range(q.shape[0])], sinks, scale)

    def attention_decode(self, q: np.ndarray, sources: list, sinks: np.ndarray, scale: float) -> np.ndarray:
        """Decode attention of B sequences, one query each: q [B, H, D]; sources[b] lists (kv [n, D],
        mask bool [n] or None = all visible) K=V sources of sequence b, either of them possibly a
        Span (rows of a buffer; a row of a [B, N] mask). Same as attention() of each query over
        the visible rows of its sources."""
        out = np.empty_like(q)
        for b, srcs in enumerate(sources):
            srcs = [(kv.view() if isinstance(kv, Span) else kv, mask.row() if isinstance(mask, Span) else mask)
                    for kv, mask in srcs]
            rows = [kv if mask is None else kv[np.asarray(mask, dtype=bool).reshape(-1)]
                    for kv, mask in srcs if kv is not None]
            keys = np.concatenate(rows, axis=0) if rows else np.zeros((0, q.shape[2]), F32)
            out[b] = self.attention(q[b:b + 1], keys, np.zeros((1, keys.shape[0]), F32), sinks, scale)[0]
        return out

    def attend_decode(self, q: np.ndarray, attend: list, mask: np.ndarray | None, sinks: np.ndarray,
                      scale: float, longest: int, window: int = 0, selected: int = 0) -> np.ndarray:
        """A V4.1 decode step's attention (engine/state/decode_plan.py): attend[b] = (window Span, group
        entries Span or None), the entries masked by row b of the published top-k `mask`. (longest,
        window and selected size the GPU kernel's work; the result does not depend on them.)"""
        return self.attention_decode(q, [[(w, None)] + ([(e, Span(mask, b, e.n))] if e is not None else [])
                                        for b, (w, e) in enumerate(attend)], sinks, scale)

    def indexer_scores(self, q: np.ndarray, k: np.ndarray, w: np.ndarray, n_heads: int, head_dim: int,
                       exact: bool = False) -> np.ndarray:
        """sum_h w[s,h] * relu(q[s,h] . k[n]) * head_dim^-0.5 * n_heads^-0.5 -> [S, N]. exact: q and
        k hold values bf16 represents exactly (a state codec's grid), which a backend may use."""
        s, h, d = q.shape
        dots = np.einsum("xd,nd->xn", q.reshape(s * h, d), k).reshape(s, h, -1)
        scores = np.maximum(dots, F32(0.0)) * F32(head_dim**-0.5)
        return np.sum(scores * (w * F32(n_heads**-0.5))[:, :, None], axis=1, dtype=F32)

    def indexer_scores_spans(self, q: np.ndarray, keys: list, w: np.ndarray, n_heads: int,
                             head_dim: int, width: int | None = None) -> np.ndarray:
        """Decode: query row b against its own keys (keys[b], a Span of rows) -> [B, width]
        (default: the largest n), -inf past each row's n."""
        width = max((k.n for k in keys), default=0) if width is None else width
        out = np.full((q.shape[0], width), NEG_INF, dtype=F32)
        for b, k in enumerate(keys):
            if k.n:
                out[b, : k.n] = self.indexer_scores(q[b : b + 1], k.view(), w[b : b + 1], n_heads, head_dim)[0]
        return out

    def topk_mask(self, scores: np.ndarray, k: int) -> np.ndarray:
        """Bool mask of each row's k best finite scores (ties: lower index first)."""
        mask = np.zeros(scores.shape, dtype=bool)
        if k <= 0 or scores.shape[-1] == 0:
            return mask
        idx = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
        np.put_along_axis(mask, idx, True, axis=-1)
        return mask & (scores > -np.inf)

    def gated_pool(self, kv: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """kv, gate [G, R, D] -> sum_r softmax_r(gate) * kv  [G, D] (softmax over the window)."""
        return self.act(np.sum(kv * _softmax(gate, axis=1), axis=1, dtype=F32))

    def gated_pool_rows(self, kv: list, gate: list, ratio: int, width: int) -> np.ndarray:
        """Decode: row b pools the `ratio` pending rows of sequence b's closing group (kv[b],
        gate[b]: Spans of them; None: no group closes, a zero row) -> [B, width]."""
        out = np.zeros((len(kv), width), F32)
        for b, (k, g) in enumerate(zip(kv, gate, strict=True)):
            if k is not None:
                out[b] = self.gated_pool(k.view()[None], g.view()[None])[0]
        return out

    # ---- state quantization (DeepSeek's stored formats, applied as fake-quant) ----------
    def fake_quant_fp8(self, x: np.ndarray, block: int = 32) -> np.ndarray:
        """FP8 e4m3 with a UE8M0 scale per `block` channels (window KV)."""
        n = x.shape[-1]
        if n % block:
            return x
        b = x.reshape(x.shape[:-1] + (n // block, block))
        amax = np.maximum(np.abs(b).max(axis=-1), F32(1e-4))
        scale = formats.pow2_ceil_f32(amax * F32(1.0 / formats.FP8_E4M3_MAX))[..., None]
        q = np.clip(b / scale, -formats.FP8_E4M3_MAX, formats.FP8_E4M3_MAX)
        return (formats.fp8_e4m3_to_f32(formats.f32_to_fp8_e4m3(q)) * scale).reshape(x.shape).astype(F32)

    def fake_quant_fp4(self, x: np.ndarray, block: int, e4m3_scales: bool = False) -> np.ndarray:
        """FP4 e2m1 with a scale per `block` channels: UE8M0 (indexer, MXFP4) or e4m3 (compressed KV)."""
        n = x.shape[-1]
        if n % block:
            return x
        b = x.reshape(x.shape[:-1] + (n // block, block))
        amax = np.abs(b).max(axis=-1)
        if e4m3_scales:
            s = np.maximum(amax, F32(6.0 * 2.0**-9)) / F32(6.0)
            scale = formats.fp8_e4m3_to_f32(formats.f32_to_fp8_e4m3(s.astype(F32)))
        else:
            scale = formats.pow2_ceil_f32(np.maximum(amax, F32(6.0 * 2.0**-126)) * F32(1.0 / 6.0))
        scale = scale[..., None].astype(F32)
        q = np.clip(b / scale, F32(-6.0), F32(6.0))
        return (formats.fp4_to_f32(formats.f32_to_fp4(q)) * scale).reshape(x.shape).astype(F32)


def dequantize(w) -> np.ndarray:
    """A stored-format checkpoint Weight -> float32 (the reference decode of each format)."""
    if w.fmt == "bf16":
        return formats.bf16_to_f32(w.data)
    if w.fmt == "f32":
        return np.asarray(w.data, dtype=F32)
    if w.fmt == "fp8":
        if w.scale is None:  # unscaled fp8 (e.g. an Engram table saved without scales)
            return formats.fp8_e4m3_to_f32(w.data)
        return formats.dequant_fp8_blocks(w.data, w.scale, w.block)
    if w.fmt == "fp4":
        return formats.dequant_fp4_experts(w.data, w.scale, w.block[1])
    raise ValueError(f"{w.name}: unknown weight format {w.fmt!r}")


def dequantize_table(table, scale=None) -> np.ndarray:
    """Engram rows -> float32: FP8 values times their UE8M0 (or float) scale per 32 channels."""
    if table.fmt != "fp8" or scale is None:
        return dequantize(table)
    if scale.dtype == "F8_E8M0":
        s = formats.e8m0_to_f32(scale.array)
    elif scale.dtype == "BF16":
        s = formats.bf16_to_f32(scale.array)
    else:
        s = np.asarray(scale.array, dtype=F32)
    vals = formats.fp8_e4m3_to_f32(table.data)
    return (vals.reshape(vals.shape[0], -1, 32) * s[:, :, None]).reshape(vals.shape)


def _rms(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    var = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    y = x * (F32(1.0) / np.sqrt(var + F32(eps)))
    return y if weight is None else y * weight


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (F32(1.0) / (F32(1.0) + np.exp(-x))).astype(F32)


def _silu(x: np.ndarray) -> np.ndarray:
    return (x * _sigmoid(x)).astype(F32)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, F32(0.0))
    e = np.exp(x - m)
    return (e / e.sum(axis=axis, keepdims=True)).astype(F32)
