"""`--numerics deepseek` on the numpy backend: DeepSeek's reference inference numerics.

DeepSeek's inference/model.py computes with bf16 activations between ops. Its `linear()` picks a
GEMM from the weight's dtype (engine/model/numerics.py says which each weight is): an FP8 / FP4
weight takes the activation quantized to FP8 e4m3 per 32 along K with UE8M0 scales (`act_quant`)
and returns bf16; a bf16 weight returns bf16; an fp32 one (the gate, the head, the ratio > 1
compressor) computes in fp32. Sparse attention takes bf16 q and K=V, normalizes by the fp32
probabilities' sum and multiplies V by the bf16-rounded probabilities; the indexer's products and
head-weighted sum are bf16 tensors. Everything else is NumpyOps with `act` rounding to bf16; the
GEMMs stay float32 einsum on bf16-valued operands (exact products, float32 sums), so the backend
keeps its batch- and chunking-invariance.
"""

from __future__ import annotations

import numpy as np

from engine.checkpoint.formats import round_bf16
from engine.model.numerics import BF16, QUANT
from engine.ops.numpy_ops import F32, NumpyOps, _silu
from engine.parallel.shard import stack_rows

ACT_BLOCK = 32  # act_quant's block along K (the reference's fp8_block_size)


class LinearWeight(np.ndarray):
    """A float32 weight that knows how the reference's linear() uses it: `quant` (FP8 activation
    quantization first) and `bf16_out` (True, False, or bool per output row for stacked weights
    of different uses)."""

    quant: bool
    bf16_out: bool | np.ndarray

    def __new__(cls, arr: np.ndarray, quant: bool, bf16_out):
        obj = np.asarray(arr).view(cls)
        obj.quant, obj.bf16_out = quant, bf16_out
        return obj

    def __array_finalize__(self, obj) -> None:
        self.quant = getattr(obj, "quant", False)
        self.bf16_out = getattr(obj, "bf16_out", False)


class DeepseekOps(NumpyOps):
    """NumpyOps computing as DeepSeek's reference inference does (bf16 / FP8, see the module doc)."""

    numerics = "deepseek"

    def act(self, x: np.ndarray) -> np.ndarray:
        return round_bf16(x)

    # ---- weights: tagged with their use -------------------------------------------------
    def prepare(self, weight) -> np.ndarray:
        arr = super().prepare(weight)
        use = getattr(weight, "use", None)
        if use is None:  # a plain array: an fp32 linear
            return arr
        return LinearWeight(arr, use == QUANT, use in (QUANT, BF16))

    def prepare_rows(self, ws: list) -> np.ndarray:
        uses = [w.use for w in ws]
        if len(set(uses)) == 1:
            return self.prepare(stack_rows(ws))
        if QUANT in uses:
            raise ValueError(f"cannot stack FP8 and unquantized linears: {[w.name for w in ws]}")
        rows = np.concatenate([np.full(w.shape[0], u == BF16) for w, u in zip(ws, uses, strict=True)])
        return LinearWeight(NumpyOps.prepare(self, stack_rows(ws)), False, rows)

    # ---- dense math -----------------------------------------------------------------------
    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The reference's linear(): by the weight's use (an untagged array: fp32)."""
        if not isinstance(w, LinearWeight):
            return super().linear(x, w)
        return self._output(self.sums(self._input(x, w), w), w)

    def grouped_linear(self, x: np.ndarray, w: np.ndarray, groups: int) -> np.ndarray:
        """wo_a's block-diagonal projection, x taken as linear() takes it (bf16 for a BF16 weight)."""
        return super().grouped_linear(self._input(x, w) if isinstance(w, LinearWeight) else x, w, groups)

    def _input(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        """x as the reference's linear() hands it to w's GEMM: bf16, then FP8 per 32 for a QUANT weight."""
        x = self.act(x)
        return self.fake_quant_fp8(x, ACT_BLOCK) if w.quant else x

    def _output(self, y: np.ndarray, w: LinearWeight) -> np.ndarray:
        """w's sums as the reference's linear() returns them: bf16, or float32 (per row when stacked)."""
        if isinstance(w.bf16_out, np.ndarray):
            return np.where(w.bf16_out, self.act(y), y)
        return self.act(y) if w.bf16_out else y

    def sums(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        """A tagged linear's float32 sums, on operands already rounded as the reference rounds them
        (the GPU test's reordered-sums model perturbs exactly this)."""
        return super().linear(x, w.view(np.ndarray))

    # ---- mHC, in Block.hc_mixes' / hc_post's order of float32 operations -------------------
    def hc_mix_logits(self, flat: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
        """F.linear(x, hc_fn) * rsqrt(mean(x^2) + eps): the norm applied after the projection."""
        rsqrt = F32(1.0) / np.sqrt(np.mean(np.square(flat, dtype=F32), axis=-1, keepdims=True, dtype=F32)
                                   + F32(norm_eps))
        return self.linear(flat, fn) * rsqrt

    def hc_expand(self, out: np.ndarray, residual: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
        """post_k * out + sum_j comb[j, k] * residual_j, the sum in order of j, then bf16."""
        mixed = comb[:, 0, :, None] * residual[:, 0, None, :]
        for j in range(1, residual.shape[1]):
            mixed = mixed + comb[:, j, :, None] * residual[:, j, None, :]
        return self.act(post[:, :, None] * out[:, None, :] + mixed)

    # ---- MoE: the routing weight scales the hidden state before w2, as Expert.forward does ----
    def swiglu_mlp(self, x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, limit: float,
                   weights: np.ndarray | None = None) -> np.ndarray:
        if isinstance(w1, LinearWeight) and isinstance(w3, LinearWeight) and w1.quant == w3.quant:
            xin = self._input(x, w1)  # (gate and up take the same input: prepared once)
            gate, up = self._output(self.sums(xin, w1), w1), self._output(self.sums(xin, w3), w3)
        else:
            gate, up = self.linear(x, w1), self.linear(x, w3)
        if limit > 0:
            up = np.clip(up, -limit, limit)
            gate = np.minimum(gate, F32(limit))
        hidden = _silu(gate) * up
        if weights is not None:
            hidden = hidden * weights[:, None]
        return self.linear(self.act(hidden), w2)

    def moe(self, x: np.ndarray, experts: list, weights: np.ndarray, ids: np.ndarray, limit: float,
            shared: np.ndarray | None = None) -> np.ndarray:
        y = np.zeros(x.shape, F32)  # the experts' bf16 outputs summed in fp32, then bf16
        for e in np.unique(ids):
            if experts[int(e)] is None:
                continue
            rows, slot = np.nonzero(ids == e)
            w1, w2, w3 = experts[int(e)]
            np.add.at(y, rows, self.swiglu_mlp(x[rows], w1, w2, w3, limit, weights[rows, slot]))
        return self.act(y + shared if shared is not None else y)

    # ---- attention -----------------------------------------------------------------------
    def attention(self, q: np.ndarray, kv: np.ndarray, bias: np.ndarray, sinks: np.ndarray,
                  scale: float) -> np.ndarray:
        """sparse_attn: bf16 q and K=V, fp32 scores; the max is the keys' own (the sink joins the
        denominator only); the denominator sums the fp32 probabilities, the PV product takes them
        rounded to bf16; the output is bf16."""
        q, kv = self.act(q), self.act(kv)
        out = np.empty_like(q)
        for s in range(q.shape[0]):
            keys = kv[np.flatnonzero(bias[s] == 0)]
            logits = np.einsum("hd,nd->hn", q[s], keys) * F32(scale)
            m = np.maximum(logits.max(axis=-1, initial=-np.inf), F32(-1e30))
            p = np.exp(logits - m[:, None])
            denom = p.sum(axis=-1, dtype=F32) + np.exp(sinks - m)
            out[s] = np.einsum("hn,nd->hd", self.act(p), keys) / denom[:, None]
        return self.act(out)

    def indexer_scores(self, q: np.ndarray, k: np.ndarray, w: np.ndarray, n_heads: int, head_dim: int,
                       exact: bool = False) -> np.ndarray:
        """Indexer.forward's scores, each of its bf16 tensors rounded: the head weights times
        softmax_scale * n_heads^-0.5, the q.k products, relu(q.k) * weight, the sum over heads."""
        s, h, d = q.shape
        dots = self.act(np.einsum("xd,nd->xn", q.reshape(s * h, d), k)).reshape(s, h, -1)
        wts = self.act(self.act(w) * F32(head_dim**-0.5 * n_heads**-0.5))
        return self.act(np.sum(self.act(np.maximum(dots, F32(0.0)) * wts[:, :, None]), axis=1, dtype=F32))
