"""Generate DSpark draft fixtures from DeepSeek's own V4.1 reference (inference/model.py).

This is a *tool*: it imports torch and is never imported by the runtime or the tests. It needs a
scratch venv with torch 2.13 CPU and a package holding the reference's model.py and the CPU
kernel stand-ins (see ../shared/DESIGN.md, "DeepSeek's own V4.1 reference"); the package is
imported as `--ref-pkg`. For each case it
- builds the reference Transformer with DSpark layers (dspark_block_size > 0) from a small random
  config whose main layers are sliding-window only, draws every parameter from a seeded generator
  (rounded to bf16), and writes config.json + model.safetensors under the reference's own names
  (main layers and `mtp.*`);
- reloads that checkpoint into a fresh reference per mode and runs: the prompt's prefill
  (Transformer.forward, collecting the target layers' inputs), the draft's prefill (forward_spec
  at start_pos 0: it seeds the draft windows), a draft right after the prompt (forward_spec of
  the main argmax token and the last position's main_hidden at start_pos P - 1: that position's
  window row is rewritten with the same value, and the block starts at P), then one main decode
  step of that token and the draft that follows it (start_pos P).
Modes: `faithful` (bf16, FP8 window K=V and bf16 sparse attention as the reference computes) and
`statequant_f32` (float32 everywhere, the reference's FP8 window rounding kept: what the numpy
engine computes). Temperature 0: the reference's own greedy draw.

    REFPY tools/dev/gen_dspark_fixtures.py --ref-pkg /path/to/refpkg --out tests/fixtures/dspark \
        [--driver ../shared/tools/dsref_golden.py]  # also the TINY_CASES (make each with tiny-model first)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def hf_config(c: dict) -> dict:
    n = c["layers"]
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41_text", "dtype": "bfloat16",
        "vocab_size": c["vocab"], "hidden_size": c["dim"], "num_hidden_layers": n, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 32, "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "gate_temp": 1.0, "rms_norm_eps": 1e-6,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "sliding_window": c["window"],
        "compress_ratios": [0] * n, "layer_types": ["sliding_attention"] * n, "kv_source_layer_ids": [],
        "index_source_layer_ids": [], "index_n_heads": 16, "index_head_dim": 32, "index_topk": 16,
        "compress_rope_theta": 160000.0, "rope_theta": 10000.0, "rope_scaling": None,
        "rope_parameters": {"main": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"},
                            "compress": {"partial_rotary_factor": 0.5, "rope_theta": 160000.0,
                                         "rope_type": "default"}},
        "engram_layer_ids": [], "engram_num_embeddings": [], "max_position_embeddings": 4096,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False,
        "num_nextn_predict_layers": c["mtp"], "dspark_block_size": c["block"], "dspark_noise_token_id": 3,
        "dspark_target_layer_ids": c["targets"], "dspark_markov_rank": c["rank"],
        "dspark_n_routed_experts": c["experts"], "dspark_num_experts_per_tok": c["topk"],
    }


CASES = {
    # three draft layers over four main layers; the prompt is longer than the window (the draft
    # windows wrap); 8 draft experts, top-3
    "dspark_wrap": dict(vocab=256, dim=64, layers=4, window=16, mtp=3, block=5, targets=[1, 2, 3], rank=16,
                        experts=8, topk=3, prompt=23, seed=1),
    # one draft layer, the prompt shorter than the window (partly filled windows), block of 4
    "dspark_short": dict(vocab=192, dim=64, layers=2, window=16, mtp=1, block=4, targets=[0, 1], rank=32,
                         experts=6, topk=3, prompt=7, seed=2),
}


def model_args(ref, cfg: dict, max_seq: int):
    n = cfg["num_hidden_layers"]
    return ref.ModelArgs(
        max_batch_size=1, max_seq_len=max_seq, temperature=0.0, dtype="bf16", expert_dtype=None,
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], moe_inter_dim=cfg["moe_intermediate_size"],
        n_layers=n, n_mtp_layers=cfg["num_nextn_predict_layers"], n_heads=cfg["num_attention_heads"],
        n_routed_experts=cfg["n_routed_experts"], n_activated_experts=cfg["num_experts_per_tok"],
        score_func=cfg["scoring_func"], route_scale=cfg["routed_scaling_factor"], swiglu_limit=cfg["swiglu_limit"],
        q_lora_rank=cfg["q_lora_rank"], head_dim=cfg["head_dim"], rope_head_dim=cfg["qk_rope_head_dim"],
        norm_eps=cfg["rms_norm_eps"], o_groups=cfg["o_groups"], o_lora_rank=cfg["o_lora_rank"],
        window_size=cfg["sliding_window"], compress_ratios=tuple([0] * (n + cfg["num_nextn_predict_layers"])),
        kv_source_layers=tuple(cfg["kv_source_layer_ids"]), index_source_layers=tuple(cfg["index_source_layer_ids"]),
        rope_theta=cfg["rope_theta"], hc_mult=cfg["hc_mult"], hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"],
        hc_eps=cfg["hc_eps"], dspark_block_size=cfg["dspark_block_size"],
        dspark_noise_token_id=cfg["dspark_noise_token_id"],
        dspark_target_layer_ids=tuple(cfg["dspark_target_layer_ids"]), dspark_markov_rank=cfg["dspark_markov_rank"],
        dspark_n_routed_experts=cfg["dspark_n_routed_experts"],
        dspark_n_activated_experts=cfg["dspark_num_experts_per_tok"])


def random_params(model, seed: int) -> dict:
    """Every parameter drawn at a scale that keeps activations O(1); nothing left at 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        shape, leaf = tuple(p.shape), name.rsplit(".", 1)[-1]
        r = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.2 * r
        elif leaf == "attn_sink" or leaf.endswith("_base") or leaf.endswith("_scale"):
            t = 0.5 * r
        elif leaf == "bias":
            t = 0.1 * r
        elif leaf.endswith("_fn"):
            t = r / shape[1] ** 0.5
        elif name in ("embed.weight",) or name.endswith("markov_head.embed.weight"):
            t = r
        else:
            t = r / shape[-1] ** 0.5
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


@contextlib.contextmanager
def kernel_mode(ref, kc, mode: str):
    saved = {n: getattr(ref, n) for n in ("act_quant", "sparse_attn")}
    prev = kc.get_mode()
    try:
        if mode == "faithful":
            kc.set_mode("faithful")
        else:  # statequant_f32: in-place state rounding as the reference, the rest exact
            kc.set_mode("exact")

            def in_mode(fn, m):
                def wrapped(*a, **k):
                    old = kc.get_mode()
                    kc.set_mode(m)
                    try:
                        return fn(*a, **k)
                    finally:
                        kc.set_mode(old)
                return wrapped

            def act_quant(*a, **k):
                inplace = k.get("inplace", a[4] if len(a) > 4 else False)
                return in_mode(kc.act_quant, "faithful" if inplace else "exact")(*a, **k)

            ref.act_quant = act_quant
            ref.sparse_attn = in_mode(kc.sparse_attn, "exact")
        yield
    finally:
        for n, f in saved.items():
            setattr(ref, n, f)
        kc.set_mode(prev)


def run_mode(ref, kc, cfg: dict, sd: dict, prompt: list[int], mode: str) -> dict:
    f32 = mode.endswith("_f32")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if f32 else torch.bfloat16)
    try:
        model = ref.Transformer(model_args(ref, cfg, len(prompt) + 16))
        for name, p in model.named_parameters():
            p.data = sd[name].to(torch.float32 if f32 else p.dtype).contiguous()
        model.eval()
        with kernel_mode(ref, kc, mode):
            return _draft_twice(model, prompt)
    finally:
        torch.set_default_dtype(prev)


def _draft_twice(model, prompt: list[int]) -> dict:
    """The reference's prefill, the draft block after it, one main decode step and the block after
    that, as the fixture's arrays."""
    n = len(prompt)
    tok, logits, mh = model(torch.tensor([prompt]), 0)
    model.forward_spec(tok, mh, 0)
    ids1, dl1, c1 = model.forward_spec(tok, mh[:, -1:], n - 1)
    tok2, logits2, mh2 = model(tok[:, None], n)
    ids2, dl2, c2 = model.forward_spec(tok2, mh2, n)

    def f(t):
        return t.float().numpy()[0]

    return dict(main_token=np.array([int(tok), int(tok2)]), main_logits=np.stack([f(logits), f(logits2)]),
                main_hidden=f(mh), main_hidden_next=f(mh2)[0], draft_ids=np.stack([f(ids1), f(ids2)]).astype(np.int64),
                draft_logits=np.stack([f(dl1), f(dl2)]), confidence=np.stack([f(c1), f(c2)]))


# Cases in the released formats: a `dsuf.py tiny-model` checkpoint (FP8 linears with UE8M0 32x32
# scales, FP4 routed experts, compressor / indexer / candidate main layers, an Engram layer, and
# sliding-window-only draft layers), loaded into the reference with the dtype bridges of
# ../shared/tools/dsref_golden.py (`--driver`). Modes from that driver, with its index-key fix.
TINY_CASES = {
    "dspark_v41": dict(args=["--layers", "4", "--hidden", "64", "--vocab", "256", "--window", "8", "--q-lora", "64",
                             "--o-lora", "64", "--moe-inter", "64", "--index-topk", "4", "--draft-layers", "2",
                             "--draft-experts", "8", "--draft-topk", "3", "--block-size", "5", "--seed", "3"],
                       prompt=21, seed=3),
}
TINY_MODES = ("faithful_fix", "statequant_f32_fix")
RECIPE = "tiny_model.json"  # how to rebuild a tiny case's checkpoint, and its files' sha256


class _Tokenizer:
    """What the reference's Engram token map reads of a tokenizer (transformers not needed)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def run_tiny_mode(ref, kc, drv, d: Path, prompt: list[int], mode: str) -> dict:
    import dataclasses

    cfg = json.loads((d / "config.json").read_text())
    base, fix = (mode[:-4], True) if mode.endswith("_fix") else (mode, False)
    f32 = base.endswith("_f32")
    args, _ = drv.model_args_from_config(ref, cfg, len(prompt) + 16)
    args = dataclasses.replace(
        args, dspark_block_size=cfg["dspark_block_size"], dspark_noise_token_id=cfg["dspark_noise_token_id"],
        dspark_target_layer_ids=tuple(cfg["dspark_target_layer_ids"]), dspark_markov_rank=cfg["dspark_markov_rank"],
        dspark_n_routed_experts=cfg["dspark_n_routed_experts"],
        dspark_n_activated_experts=cfg["dspark_num_experts_per_tok"],
        compress_ratios=tuple(cfg["compress_ratios"]) + (0,) * (args.n_mtp_layers + args.n_layers
                                                               - len(cfg["compress_ratios"])))
    block = int(cfg["quantization_config"]["weight_block_size"][0])
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if f32 else torch.bfloat16)
    try:
        model = ref.Transformer(args, _Tokenizer(d))
        drv.load_into(model, drv.load_checkpoint_tensors(d), block, widen_bf16=f32)
        model.eval()
        with drv.kernel_mode(ref, kc, base), drv.index_key_fix(ref, fix):
            return _draft_twice(model, prompt)
    finally:
        torch.set_default_dtype(prev)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref-pkg", required=True)
    ap.add_argument("--out", default="tests/fixtures/dspark")
    ap.add_argument("--driver", help="../shared/tools/dsref_golden.py: also make the TINY_CASES")
    a = ap.parse_args()
    torch.set_num_threads(2)
    pkg = Path(a.ref_pkg).resolve()
    sys.path.insert(0, str(pkg.parent))
    ref = importlib.import_module(f"{pkg.name}.model")
    kc = importlib.import_module(f"{pkg.name}.kernel_cpu")
    for name, c in CASES.items():
        d = Path(a.out) / name
        d.mkdir(parents=True, exist_ok=True)
        cfg = hf_config(c)
        (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        torch.set_default_dtype(torch.float32)
        save_file(random_params(ref.Transformer(model_args(ref, cfg, 64)), c["seed"]), str(d / "model.safetensors"))
        sd = load_file(str(d / "model.safetensors"))  # every run reads the checkpoint as written
        prompt = np.random.default_rng([c["seed"], c["prompt"]]).integers(4, c["vocab"], size=c["prompt"]).tolist()
        out = {"input_ids": np.array(prompt, np.int64)}
        for mode in ("faithful", "statequant_f32"):
            for k, v in run_mode(ref, kc, cfg, sd, prompt, mode).items():
                out[f"{mode}.{k}"] = v
        np.savez_compressed(d / "expected.npz", **out)
        fa, f32 = out["faithful.draft_ids"], out["statequant_f32.draft_ids"]
        print(name, "draft ids f32", f32.tolist(), "faithful", fa.tolist())
    if a.driver:
        spec = importlib.util.spec_from_file_location("dsref_driver", a.driver)
        drv = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(drv)
        for name, c in TINY_CASES.items():
            d = Path(a.out) / name
            if not (d / "config.json").is_file():
                raise SystemExit(f"make it first: python dsuf.py tiny-model {d} {' '.join(c['args'])}")
            vocab = json.loads((d / "config.json").read_text())["vocab_size"]
            prompt = np.random.default_rng([c["seed"], c["prompt"]]).integers(4, vocab - 1, size=c["prompt"]).tolist()
            out = {"input_ids": np.array(prompt, np.int64)}
            for mode in TINY_MODES:
                for k, v in run_tiny_mode(ref, kc, drv, d, prompt, mode).items():
                    out[f"{mode}.{k}"] = v
            np.savez_compressed(d / "expected.npz", **out)
            # the checkpoint is not committed: the test rebuilds it with tiny-model and checks these
            files = sorted(f.name for f in d.iterdir() if f.is_file() and f.name not in ("expected.npz", RECIPE))
            recipe = {"tiny_model_args": c["args"], "sha256": {f: hashlib.sha256((d / f).read_bytes()).hexdigest()
                                                                for f in files}}
            (d / RECIPE).write_text(json.dumps(recipe, indent=2) + "\n")
            print(name, {m: out[f"{m}.draft_ids"].tolist() for m in TINY_MODES})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
