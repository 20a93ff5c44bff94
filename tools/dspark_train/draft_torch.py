"""The DSpark draft forward in torch, for training: what engine/model/dspark.py computes (DSpark,
DSparkBlock, DSparkAttention, MarkovHead, ConfidenceHead over the main model's embedding and
head), batched over many anchors of a sequence at once. Parameters carry the checkpoint's
canonical `mtp.*` names (engine/checkpoint/dspark_schema.py), so what trains is what loads;
tools/train_dspark.py checks this forward against the numpy engine's on the written checkpoint.

A training anchor p of a sequence: the block [token p, noise x (block - 1)] at positions p .. p +
block - 1, whose queries see each draft layer's K=V rows of main_x at positions p - window .. p - 1
and the whole block; block row i predicts the token after position p + i, its Markov bias taken
from the token at p + i (teacher forcing: at serving time, the draft's own previous token).

The window K=V is rounded onto the FP8 grid as served, with a straight-through gradient."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.rope import Rope, rope_tables


def fq_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 with a power-of-two scale per `block` channels (the window codec), straight-through."""
    b = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = b.detach().abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = ((b / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale).reshape(x.shape)
    return x + (q - x).detach()


def rmsnorm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved pairs on the trailing 2 * cos.shape[-1] channels; cos / sin broadcast over the
    axes between the first and the last."""
    rd = cos.shape[-1] * 2
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    even, odd = x[..., -rd::2], x[..., -rd + 1::2]
    rot = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot], dim=-1)


class DraftTorch(torch.nn.Module):
    """Trainable draft layers (params: {canonical name: Parameter}, registered under names with
    '.' as '__'); embed / head: the main model's, frozen."""

    def __init__(self, cfg, params: dict[str, torch.Tensor], embed: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.names = list(params)
        for n, t in params.items():
            self.register_parameter(n.replace(".", "__"), torch.nn.Parameter(t.float().clone()))
        self.register_buffer("embed", embed.float())
        self.register_buffer("head", head.float())
        freq = Rope(cfg).freq_main
        self.freq, self.factor = freq, cfg.rope_main.attention_factor

    def p(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "__"))

    def state(self) -> dict[str, torch.Tensor]:
        return {n: self.p(n).detach() for n in self.names}

    def tables(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_tables(self.freq, np.arange(n), self.factor)
        return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)

    # ---- the pieces of a V4.1 layer --------------------------------------------------
    def hc_mixes(self, h: torch.Tensor, site: str):
        cfg, hc = self.cfg, self.cfg.hc_mult
        fn, scale, base = self.p(site + "_fn"), self.p(site + "_scale"), self.p(site + "_base")
        flat = rmsnorm(h.flatten(-2), None, cfg.rms_norm_eps)
        mixes = flat @ fn.t()
        pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + cfg.hc_eps
        post = 2.0 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
        logits = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*h.shape[:-2], hc, hc)
        comb = torch.softmax(logits, -1) + cfg.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
        return pre, post, comb

    def collapse_norm(self, h, pre, norm):
        return rmsnorm((pre.unsqueeze(-1) * h).sum(-2), norm, self.cfg.rms_norm_eps)

    @staticmethod
    def expand(out, h, post, comb):
        return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.einsum("...jk,...jd->...kd", comb, h)

    def kv_rows(self, a: str, x, cos, sin):
        """A layer's K=V rows of x on the window's grid."""
        kv = x @ self.p(a + "wkv.weight").t()
        return fq_fp8(rope(rmsnorm(kv, self.p(a + "kv_norm.weight"), self.cfg.rms_norm_eps), cos, sin))

    def attention(self, a: str, x, window, wmask, cos, sin):
        """x [A, B, hidden] (each anchor's block), window [A, W, D] with wmask [A, W] (rows that
        exist) -> [A, B, hidden]."""
        cfg = self.cfg
        q_res = rmsnorm(x @ self.p(a + "wq_a.weight").t(), self.p(a + "q_norm.weight"), cfg.rms_norm_eps)
        q = (q_res @ self.p(a + "wq_b.weight").t()).unflatten(-1, (cfg.num_heads, cfg.head_dim))
        q = rope(q, cos, sin)
        keys = torch.cat([window, self.kv_rows(a, x, cos, sin)], dim=1)  # [A, W + B, D]
        mask = torch.cat([wmask, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)], dim=1)
        logits = torch.einsum("abhd,and->abhn", q, keys) * cfg.head_dim ** -0.5
        logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
        sinks = self.p(a + "attn_sink").reshape(1, 1, -1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sinks], dim=-1), -1)[..., :-1]
        out = rope(torch.einsum("abhn,and->abhd", probs, keys), cos, sin, inverse=True)
        wo_a = self.p(a + "wo_a.weight")
        g = cfg.o_groups
        grouped = torch.einsum("abgi,goi->abgo", out.reshape(*out.shape[:2], g, -1),
                               wo_a.reshape(g, -1, wo_a.shape[-1]))
        return grouped.flatten(-2) @ self.p(a + "wo_b.weight").t()

    def swiglu(self, x, w1, w2, w3):
        lim = self.cfg.swiglu_limit
        gate, up = x @ w1.t(), x @ w3.t()
        if lim > 0:
            up, gate = up.clamp(-lim, lim), gate.clamp(max=lim)
        return (F.silu(gate) * up) @ w2.t()

    def moe(self, f: str, x):
        """Top-k routed experts (dense over the draft's few experts, weights zero where not
        chosen) plus the shared expert."""
        cfg = self.cfg
        logits = x @ self.p(f + "gate.weight").t()
        if cfg.gate_temp != 1.0:
            logits = logits / cfg.gate_temp
        scores = torch.sqrt(F.softplus(logits)) if cfg.scoring_func == "sqrtsoftplus" else torch.sigmoid(logits)
        sel = scores + self.p(f + "gate.bias") if (f + "gate.bias") in self.names else scores
        idx = sel.detach().topk(cfg.dspark_num_experts_per_tok, -1).indices
        w = scores.gather(-1, idx)
        if cfg.norm_topk_prob and cfg.dspark_num_experts_per_tok > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        dense = torch.zeros_like(scores).scatter(-1, idx, w * cfg.routed_scaling_factor)
        y = self.swiglu(x, *(self.p(f"{f}shared_experts.w{i}.weight") for i in (1, 2, 3)))
        for e in range(cfg.dspark_n_routed_experts):
            ex = self.swiglu(x, *(self.p(f"{f}experts.{e}.w{i}.weight") for i in (1, 2, 3)))
            y = y + dense[..., e:e + 1] * ex
        return y

    # ---- the draft -------------------------------------------------------------------
    def main_x(self, tin):
        return rmsnorm(tin @ self.p("mtp.0.main_proj.weight").t(), self.p("mtp.0.main_norm.weight"),
                       self.cfg.rms_norm_eps)

    def forward(self, tin, tokens, anchors):
        """tin [T, targets * hidden], tokens [T] (one sequence), anchors [A] (positions p) ->
        (x: collapsed streams before the final norm [A, B, hidden], logits without the Markov
        bias [A, B, vocab])."""
        cfg, dev = self.cfg, tin.device
        B, W, T = cfg.dspark_block_size, cfg.sliding_window, tin.shape[0]
        cos_all, sin_all = self.tables(T + B, dev)
        mx = self.main_x(tin)
        pos = anchors[:, None] + torch.arange(B, device=dev)  # [A, B]
        cos, sin = cos_all[pos], sin_all[pos]
        wpos = anchors[:, None] - W + torch.arange(W, device=dev)  # [A, W]
        wmask = wpos >= 0
        wpos = wpos.clamp_min(0)
        ids = torch.full((anchors.shape[0], B), cfg.dspark_noise_token_id, device=dev)
        ids[:, 0] = tokens[anchors]
        x = self.embed[ids]
        h = x.unsqueeze(-2).expand(*x.shape[:-1], cfg.hc_mult, x.shape[-1])
        pre = torch.zeros(*x.shape[:-1], cfg.hc_mult, device=dev)
        pre[..., 0] = 1.0
        for j in range(cfg.dspark_layers):
            n = f"mtp.{j}."
            window = self.kv_rows(n + "attn.", mx, cos_all[:T], sin_all[:T])[wpos]  # [A, W, D]
            _, post, comb = mixes = self.hc_mixes(h, n + "hc_attn")
            out = self.attention(n + "attn.", self.collapse_norm(h, pre, self.p(n + "attn_norm.weight")),
                                 window, wmask, cos, sin)
            h = self.expand(out, h, post, comb)
            pre_a = mixes[0]
            pre, post, comb = self.hc_mixes(h, n + "hc_ffn")
            y = self.moe(n + "ffn.", self.collapse_norm(h, pre_a, self.p(n + "ffn_norm.weight")))
            h = self.expand(y, h, post, comb)
        xc = (pre.unsqueeze(-1) * h).sum(-2)
        last = f"mtp.{cfg.dspark_layers - 1}."
        logits = rmsnorm(xc, self.p(last + "norm.weight"), cfg.rms_norm_eps) @ self.head.t()
        return xc, logits

    def markov(self, prev):
        """(bias [.., vocab], embedding [.., rank]) of the previous tokens."""
        last = f"mtp.{self.cfg.dspark_layers - 1}."
        e = self.p(last + "markov_head.embed.weight")[prev]
        return e @ self.p(last + "markov_head.head.weight").t(), e

    def confidence(self, xc, e):
        last = f"mtp.{self.cfg.dspark_layers - 1}."
        return (torch.cat([xc, e], -1) @ self.p(last + "confidence_head.proj.weight").t())[..., 0]
