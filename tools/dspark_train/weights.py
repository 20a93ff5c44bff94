"""The draft's config fields, its first weights (warm-started from the main model's last layers)
and writing it into a checkpoint directory beside the main model's shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from engine.checkpoint.reader import Checkpoint, CheckpointError
from engine.checkpoint.schema import resolve, tensor_schema
from engine.model.config import parse_config
from engine.ops.numpy_ops import dequantize

DRAFT_FILE = "model-dspark.safetensors"
RELEASE_BLOCK = (32, 32)  # V4.1's weight_block_size


def draft_config(raw: dict, layers: int, experts: int, topk: int, rank: int, block: int, noise: int) -> dict:
    """config.json with the DSpark fields set (the released checkpoint's names); the target layers
    are the last three, as in the release."""
    cfg = json.loads(json.dumps(raw))
    text = cfg.get("text_config", cfg)
    n = text["num_hidden_layers"]
    text.update({
        "num_nextn_predict_layers": layers, "dspark_block_size": block, "dspark_noise_token_id": noise,
        "dspark_target_layer_ids": list(range(n - 3, n)), "dspark_markov_rank": rank,
        "dspark_n_routed_experts": experts, "dspark_num_experts_per_tok": topk,
        "compress_ratios": list(text["compress_ratios"][:n]) + [0] * layers,
    })
    return cfg


def draft_entries(cfg) -> list:
    """The schema entries of the draft tensors (canonical `mtp.*` names), those stored but unread
    (the gate's vision bias) included."""
    return [e for e in tensor_schema(cfg) if e.name.startswith("mtp.")]


def read_f32(ck: Checkpoint, name: str) -> torch.Tensor:
    """A tensor of `ck` as float32, whatever its stored format (BF16 / F32, or FP8 / FP4 decoded)."""
    real = resolve(ck, name)
    try:
        arr = ck.f32(real)
    except CheckpointError:  # FP8 / FP4 stored
        arr = dequantize(ck.weight(real))
    return torch.from_numpy(np.array(arr, np.float32))


def initial(ckpt_dir: Path, raw_cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Draft layer j starts as main layer n - layers + j (its attention, norms, mHC, shared expert,
    gate rows and first experts); main_proj picks the last target layer's input; the final norm
    is the main model's; the Markov head starts at zero bias, the confidence head at zero."""
    cfg = parse_config(raw_cfg)
    ck = Checkpoint(ckpt_dir, block_size=cfg.weight_block_size)
    gen = torch.Generator().manual_seed(seed)
    n, k, h = cfg.num_layers, cfg.dspark_layers, cfg.hidden_size
    out: dict[str, torch.Tensor] = {}

    def main(name: str) -> torch.Tensor | None:
        return read_f32(ck, name) if ck.has(resolve(ck, name)) else None

    for e in draft_entries(cfg):
        j, rest = e.name[len("mtp."):].split(".", 1)
        src = f"layers.{n - k + int(j)}.{rest}"
        t = None
        if rest == "main_proj.weight":
            t = torch.zeros(e.shape)
            t[:, -h:] = torch.eye(h)
        elif rest in ("main_norm.weight",):
            t = torch.ones(e.shape)
        elif rest == "norm.weight":
            t = main("norm.weight")
        elif rest.startswith("markov_head.embed"):
            t = torch.randn(e.shape, generator=gen) * 0.02
        elif rest.startswith(("markov_head.head", "confidence_head")):
            t = torch.zeros(e.shape)
        elif rest.startswith("ffn.gate.") or rest.startswith("ffn.experts."):
            t = main(src)
            if t is not None and rest.startswith("ffn.gate."):
                t = t[: e.shape[0]]
            if rest in ("ffn.gate.bias", "ffn.gate.bias_vl"):
                t = torch.zeros(e.shape)
        else:
            t = main(src)
        if t is None or tuple(t.shape) != tuple(e.shape):
            raise ValueError(f"no starting value for {e.name} {e.shape} (main {src}: "
                             f"{None if t is None else tuple(t.shape)})")
        out[e.name] = t.float()
    return out


def write(src_dir: Path, out_dir: Path, raw_cfg: dict, params: dict[str, torch.Tensor],
          release: bool = True) -> None:
    """out_dir = src_dir's files (copied unless the same directory) with config.json's draft
    fields and the draft tensors in their own shard, under the main tensors' prefix: stored as
    the release stores its draft layers (FP8 linears with UE8M0 scales per 32 x 32 block, FP4
    routed experts with a UE8M0 scale per row per 32, the rest BF16 / F32: the schema's format of
    each tensor) or, release=False, all in bf16."""
    from engine.checkpoint.schema import stored_tensors
    from engine.checkpoint.writer import write_safetensors
    from tools.dev.quantize_demo import encode

    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() != src_dir.resolve():
        for f in src_dir.iterdir():
            if f.is_file() and f.name != DRAFT_FILE:
                shutil.copy2(f, out_dir / f.name)
    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = {k: v for k, v in index["weight_map"].items() if v != DRAFT_FILE}
    prefix = "model." if any(k.startswith("model.layers.") for k in wm) else ""
    fmts = {e.name: e.fmt for e in draft_entries(parse_config(raw_cfg))}
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for n, t in params.items():
        fmt = fmts[n] if release else ("f32" if fmts[n] == "f32" else "bf16")
        x = t.detach().float().cpu().numpy()
        for (sname, dtype, _), arr in zip(stored_tensors(n, fmt, tuple(x.shape), RELEASE_BLOCK),
                                          encode(fmt, x, RELEASE_BLOCK), strict=True):
            tensors[prefix + sname] = (dtype, arr)
    write_safetensors(out_dir / DRAFT_FILE, tensors, {"format": "pt"})
    wm.update(dict.fromkeys(tensors, DRAFT_FILE))
    index["weight_map"] = dict(sorted(wm.items()))
    index.setdefault("metadata", {})["total_size"] = sum(_data_bytes(out_dir / f) for f in set(wm.values()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")


def _data_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors file (what an index's total_size counts)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
