"""Model configuration: one normalised view of a DeepSeek-V4 / V4.1 checkpoint's config.json.

Accepted spellings: HF transformers (`deepseek_v4`, `deepseek_v41_text`, composite `deepseek_v41`
with `text_config`), V4's legacy fields (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`) and DeepSeek's upstream `inference/config.json` names (`dim`, `n_layers`, ...).
Everything the model code reads is resolved here, so the model never looks at raw JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that is missing a field or contradicts itself."""


# DeepSeek upstream (inference/config.json) name -> HF name.
_UPSTREAM_ALIASES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "rope_head_dim": "qk_rope_head_dim",
    "window_size": "sliding_window",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "norm_eps": "rms_norm_eps",
    "n_hash_layers": "num_hash_layers",
    "max_seq_len": "max_position_embeddings",
    "n_mtp_layers": "num_nextn_predict_layers",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}

_V4_LAYER_RATIO_KEY = {"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


@dataclass(frozen=True)
class RopeSpec:
    """Frequencies for one rope type ('main' or 'compress')."""

    theta: float
    dim: int  # rotated channels (the trailing `dim` of a head)
    rope_type: str = "default"  # 'default' | 'yarn'
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # 'v4' | 'v41'
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    max_position_embeddings: int
    # mHC
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # MoE
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    norm_topk_prob: bool
    gate_temp: float
    swiglu_limit: float
    # rope
    rope_main: RopeSpec
    rope_compress: RopeSpec
    # per layer: compress ratio (0 = sliding only) and, for V4, the layer kind
    compress_ratios: tuple[int, ...]
    layer_kinds: tuple[str, ...]  # v4: 'sliding' | 'csa' | 'hca'; v41: 'sliding' | 'source' | 'shared'
    hash_layers: tuple[bool, ...]  # v4 hash-routed MoE layers
    # indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # V4.1 CSA2 schedule
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 8
    # V4.1 Engram
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 0
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    # tokens and quantization
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    weight_block_size: tuple[int, int] | None = None
    scale_fmt: str | None = None
    expert_dtype: str | None = None
    num_nextn_predict_layers: int = 0
    # V4.1 DSpark draft layers (mtp.* tensors); dspark_layers 0 = none, the other fields unset
    dspark_layers: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived views -------------------------------------------------------------
    def kv_group_source(self, layer: int) -> int:
        """V4.1: the KV-source layer whose compressed cache `layer` reads (-1: none)."""
        sources = [s for s in self.kv_source_layer_ids if s <= layer]
        return sources[-1] if sources and self.compress_ratios[layer] > 0 else -1

    @property
    def has_draft(self) -> bool:
        """Whether the checkpoint carries DSpark draft layers the engine loads."""
        return self.dspark_layers > 0

    @property
    def model_type(self) -> str:
        return "deepseek_v41" if self.arch == "v41" else "deepseek_v4"


def _need(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json: missing required field '{key}' ({where})")
    return d[key]


def _rope_spec(params: dict | None, theta: float, dim: int, max_pos: int) -> RopeSpec:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"config.json: unsupported rope_type '{rope_type}' (default or yarn)")
    if rope_type == "default":
        return RopeSpec(theta=float(params.get("rope_theta", theta)), dim=dim)
    return RopeSpec(
        theta=float(params.get("rope_theta", theta)),
        dim=dim,
        rope_type="yarn",
        factor=float(_need(params, "factor", "rope_scaling")),
        original_max_position=int(params.get("original_max_position_embeddings") or max_pos),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        # DeepSeek does not scale cos/sin by YaRN's mscale (HF forces attention_factor=1.0).
        attention_factor=float(params.get("attention_factor", 1.0)),
        truncate=bool(params.get("truncate", True)),
    )


def _normalise(raw: dict) -> tuple[dict, dict]:
    """Returns (text config with HF names, top-level dict holding quantization_config)."""
    top = raw
    cfg = dict(raw.get("text_config") or raw)
    for up, hf in _UPSTREAM_ALIASES.items():
        if up in cfg and hf not in cfg:
            cfg[hf] = cfg[up]
    if "quantization_config" not in cfg and "quantization_config" in top:
        cfg["quantization_config"] = top["quantization_config"]
    return cfg, top


def _arch_of(cfg: dict, top: dict) -> str:
    mt = str(cfg.get("model_type") or top.get("model_type") or "")
    if mt.startswith("deepseek_v41"):
        return "v41"
    if mt == "deepseek_v4":
        return "v4"
    # upstream inference configs carry no model_type: V4.1 is the one with KV sources
    if not mt and ("kv_source_layer_ids" in cfg or "engram_layer_ids" in cfg):
        return "v41"
    if not mt and ("compress_ratios" in cfg or "layer_types" in cfg):
        return "v4"
    raise ConfigError(f"config.json: unknown model_type '{mt}' (expected deepseek_v4 or deepseek_v41)")


def parse_config(raw: dict) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json dict."""
    cfg, top = _normalise(raw)
    arch = _arch_of(cfg, top)
    where = f"{arch} config"
    n = int(_need(cfg, "num_hidden_layers", where))
    hidden = int(_need(cfg, "hidden_size", where))
    heads = int(_need(cfg, "num_attention_heads", where))
    head_dim = int(cfg.get("head_dim") or 512)
    if cfg.get("num_key_value_heads", 1) not in (1, None):
        raise ConfigError("config.json: DeepSeek-V4 uses one shared KV head (num_key_value_heads must be 1)")

    rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    if "qk_rope_head_dim" in cfg and cfg["qk_rope_head_dim"] is not None:
        rope_dim = int(cfg["qk_rope_head_dim"])
    elif cfg.get("partial_rotary_factor"):
        rope_dim = int(head_dim * float(cfg["partial_rotary_factor"]))
    elif rope_params and isinstance(rope_params.get("main"), dict):
        rope_dim = int(head_dim * float(rope_params["main"].get("partial_rotary_factor", 1.0)))
    else:
        rope_dim = 64
    if rope_dim <= 0 or rope_dim > head_dim or rope_dim % 2:
        raise ConfigError(f"config.json: rope dim {rope_dim} must be even and fit head_dim {head_dim}")

    max_pos = int(cfg.get("max_position_embeddings") or 1 << 20)
    rope_theta = float(cfg.get("rope_theta") or 10000.0)
    compress_theta = float(cfg.get("compress_rope_theta") or 160000.0)
    if rope_params and isinstance(rope_params.get("main"), dict) and isinstance(rope_params.get("compress"), dict):
        main_p, comp_p = rope_params["main"], rope_params["compress"]
    else:
        scaling = cfg.get("rope_scaling") or (rope_params if rope_params else None) or {}
        main_p = {"rope_theta": rope_theta}
        comp_p = {**{k: v for k, v in scaling.items() if k not in ("main", "compress")}, "rope_theta": compress_theta}
    rope_main = _rope_spec(main_p, rope_theta, rope_dim, max_pos)
    rope_compress = _rope_spec(comp_p, compress_theta, rope_dim, max_pos)

    extra: dict = {}
    v41: dict = {}
    if arch == "v4":
        default_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        rates = dict(cfg.get("compress_rates") or default_rates)
        rates.setdefault("compressed_sparse_attention", int(cfg.get("compress_rate_csa") or 4))
        rates.setdefault("heavily_compressed_attention", int(cfg.get("compress_rate_hca") or 128))
        layer_types = cfg.get("layer_types")
        if layer_types is None and cfg.get("compress_ratios") is not None:
            inv = {0: "sliding_attention", rates["compressed_sparse_attention"]: "compressed_sparse_attention",
                   rates["heavily_compressed_attention"]: "heavily_compressed_attention"}
            try:
                layer_types = [inv[int(r)] for r in cfg["compress_ratios"][:n]]
            except KeyError as e:
                raise ConfigError(f"config.json: compress_ratios entry {e} is not 0, the CSA or the HCA rate") from None
        if layer_types is None:
            layer_types = ["heavily_compressed_attention"] * min(n, 2) + [
                "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
            ]
        layer_types = list(layer_types[:n])
        if len(layer_types) != n:
            raise ConfigError(f"config.json: layer_types has {len(layer_types)} entries for {n} layers")
        kinds, ratios = [], []
        for t in layer_types:
            if t == "sliding_attention":
                kinds.append("sliding")
                ratios.append(0)
            elif t in _V4_LAYER_RATIO_KEY:
                kinds.append(_V4_LAYER_RATIO_KEY[t])
                ratios.append(int(rates[t]))
            else:
                raise ConfigError(f"config.json: unknown V4 layer type '{t}'")
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(cfg.get("num_hash_layers", 3) if cfg.get("num_hash_layers") is not None else 3)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        if len(mlp_types) < n or any(t not in ("hash_moe", "moe") for t in mlp_types[:n]):
            raise ConfigError("config.json: mlp_layer_types must list 'hash_moe' or 'moe' for every layer")
        hash_layers = tuple(t == "hash_moe" for t in mlp_types[:n])
        index_defaults = (64, 128, 512)
    else:
        ratios = cfg.get("compress_ratios")
        if ratios is None:
            n_slide = min(2, n)
            n_enc = max(0, (n - n_slide + 1) // 2)
            ratios = [0] * n_slide + [2] * n_enc + [1] * max(0, n - n_slide - n_enc)
        if len(ratios) < n:
            raise ConfigError(f"config.json: compress_ratios has {len(ratios)} entries for {n} layers")
        raw_ratios = list(ratios)
        ratios = [int(r) for r in ratios[:n]]
        kv_src = cfg.get("kv_source_layer_ids")
        if kv_src is None:
            kv_src = [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
        idx_src = cfg.get("index_source_layer_ids")
        if idx_src is None:
            idx_src = list(kv_src)
        kv_src, idx_src = [int(i) for i in kv_src], [int(i) for i in idx_src]
        for name, ids in (("kv_source_layer_ids", kv_src), ("index_source_layer_ids", idx_src)):
            bad = [i for i in ids if not 0 <= i < n or ratios[i] == 0]
            if bad:
                raise ConfigError(f"config.json: {name} {bad} must be layers with compress_ratios > 0")
        missing = [s for s in kv_src if s not in idx_src]
        if missing:
            # The indexer keys of a KV source are published by its own indexer.
            raise ConfigError(f"config.json: kv sources {missing} must also be index sources")
        for i in range(n):
            if ratios[i] > 0:
                src = [s for s in kv_src if s <= i]
                if not src:
                    raise ConfigError(f"config.json: layer {i} has compress ratio {ratios[i]} but no KV source")
                if ratios[src[-1]] != ratios[i]:
                    raise ConfigError(f"config.json: layer {i} ratio {ratios[i]} differs from its source {src[-1]}")
        cand = cfg.get("candidate_source_layer_id")
        cand = (kv_src[-1] if kv_src else -1) if cand is None else int(cand)
        if cand >= 0 and cand not in idx_src:
            raise ConfigError(f"config.json: candidate_source_layer_id {cand} is not an index source")
        kinds = ["source" if i in kv_src else ("shared" if ratios[i] > 0 else "sliding") for i in range(n)]
        hash_layers = tuple(False for _ in range(n))
        index_defaults = (32, 128, 512)
        engram_ids = [int(i) for i in (cfg.get("engram_layer_ids") or [])]
        engram_rows = [int(x) for x in (cfg.get("engram_num_embeddings") or [0] * len(engram_ids))]
        if len(engram_rows) != len(engram_ids):
            raise ConfigError("config.json: engram_num_embeddings must have one entry per engram layer")
        v41 = dict(
            kv_source_layer_ids=tuple(kv_src),
            index_source_layer_ids=tuple(idx_src),
            candidate_source_layer_id=cand,
            candidate_topk_blocks=int(cfg.get("candidate_topk_blocks", 2048)),
            candidate_block_size=int(cfg.get("candidate_block_size", 8)),
            engram_layer_ids=tuple(engram_ids),
            engram_vocab_size=int(cfg.get("engram_vocab_size", 16000000)),
            engram_num_embeddings=tuple(engram_rows),
            engram_max_ngram_size=int(cfg.get("engram_max_ngram_size", 4)),
            engram_n_heads=int(cfg.get("engram_n_heads", 8)),
            engram_head_dim=int(cfg.get("engram_head_dim", 256)),
            engram_pad_id=int(cfg.get("engram_pad_id", 2)),
            engram_compressed_vocab_size=int(cfg.get("engram_compressed_vocab_size", 99092)),
        )

    o_groups = int(cfg.get("o_groups") or 8)
    if heads % o_groups:
        raise ConfigError(f"config.json: num_attention_heads {heads} is not a multiple of o_groups {o_groups}")
    scoring = str(cfg.get("scoring_func") or "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ConfigError(f"config.json: unsupported scoring_func '{scoring}'")
    eos = cfg.get("eos_token_id", 1)
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    q = cfg.get("quantization_config") or {}
    block = q.get("weight_block_size")
    return ModelConfig(
        arch=arch,
        vocab_size=int(_need(cfg, "vocab_size", where)),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(_need(cfg, "q_lora_rank", where)),
        o_groups=o_groups,
        o_lora_rank=int(cfg.get("o_lora_rank") or 1024),
        sliding_window=int(cfg.get("sliding_window") or 128),
        rms_norm_eps=float(cfg.get("rms_norm_eps") if cfg.get("rms_norm_eps") is not None else 1e-6),
        max_position_embeddings=max_pos,
        hc_mult=int(cfg.get("hc_mult") or 4),
        hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters") or 20),
        hc_eps=float(cfg.get("hc_eps") if cfg.get("hc_eps") is not None else 1e-6),
        n_routed_experts=int(_need(cfg, "n_routed_experts", where)),
        n_shared_experts=int(cfg.get("n_shared_experts", 1)),
        num_experts_per_tok=int(_need(cfg, "num_experts_per_tok", where)),
        moe_intermediate_size=int(_need(cfg, "moe_intermediate_size", where)),
        scoring_func=scoring,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        gate_temp=float(cfg.get("gate_temp", 1.0) or 1.0),
        swiglu_limit=float(cfg.get("swiglu_limit", 10.0) or 0.0),
        rope_main=rope_main,
        rope_compress=rope_compress,
        compress_ratios=tuple(ratios),
        layer_kinds=tuple(kinds),
        hash_layers=hash_layers,
        index_n_heads=int(cfg.get("index_n_heads") or index_defaults[0]),
        index_head_dim=int(cfg.get("index_head_dim") or index_defaults[1]),
        index_topk=int(cfg.get("index_topk") or index_defaults[2]),
        bos_token_id=cfg.get("bos_token_id", 0),
        eos_token_ids=eos_ids or (1,),
        pad_token_id=cfg.get("pad_token_id"),
        weight_block_size=tuple(block) if block else None,
        scale_fmt=q.get("scale_fmt"),
        expert_dtype=q.get("expert_dtype") or cfg.get("expert_dtype"),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        extra=extra,
        **v41,
        **(_dspark(cfg, n, int(cfg["vocab_size"]), raw_ratios) if arch == "v41" else {}),
    )


def _dspark(cfg: dict, n: int, vocab: int, ratios: list) -> dict:
    """The DSpark draft fields, validated; {} when the config declares no draft layers
    (num_nextn_predict_layers / n_mtp_layers absent or 0: the other dspark_* fields are then
    ignored, as the reference builds no draft without them)."""
    k = int(cfg.get("num_nextn_predict_layers") or 0)
    if k <= 0:
        return {}
    where = "DSpark draft layers (num_nextn_predict_layers > 0)"
    block = int(_need(cfg, "dspark_block_size", where))
    noise = int(_need(cfg, "dspark_noise_token_id", where))
    targets = [int(i) for i in _need(cfg, "dspark_target_layer_ids", where)]
    rank = int(cfg.get("dspark_markov_rank") or 256)
    experts = int(cfg.get("dspark_n_routed_experts") or cfg["n_routed_experts"])
    topk = int(cfg.get("dspark_num_experts_per_tok") or cfg["num_experts_per_tok"])
    if block < 2:
        raise ConfigError(f"config.json: dspark_block_size {block} must be >= 2 (the last token plus drafts)")
    if not 0 <= noise < vocab:
        raise ConfigError(f"config.json: dspark_noise_token_id {noise} is outside the vocabulary [0, {vocab})")
    if not targets or len(set(targets)) != len(targets) or any(not 0 <= i < n for i in targets):
        raise ConfigError(f"config.json: dspark_target_layer_ids {targets} must be distinct layers in [0, {n})")
    if rank <= 0:
        raise ConfigError(f"config.json: dspark_markov_rank {rank} must be positive")
    if experts <= 0 or not 0 < topk <= experts:
        raise ConfigError(f"config.json: dspark_num_experts_per_tok {topk} must lie in [1, "
                          f"dspark_n_routed_experts {experts}]")
    draft_ratios = [int(r) for r in ratios[n:n + k]]
    if any(draft_ratios):
        raise ConfigError(f"config.json: compress_ratios {draft_ratios} of the draft layers must be 0 "
                          "(DSpark layers attend over a sliding window only)")
    if len(ratios) > n + k:
        raise ConfigError(f"config.json: compress_ratios has {len(ratios)} entries for {n} layers + {k} draft layers")
    return dict(dspark_layers=k, dspark_block_size=block, dspark_noise_token_id=noise,
                dspark_target_layer_ids=tuple(targets), dspark_markov_rank=rank,
                dspark_n_routed_experts=experts, dspark_num_experts_per_tok=topk)


def load_config(ckpt_dir: str | Path) -> ModelConfig:
    """Read `<ckpt_dir>/config.json`."""
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (is this a checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    try:
        return parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: malformed field ({e})") from None
