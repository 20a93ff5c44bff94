"""Generate DeepSeek-V4.1 reference fixtures from transformers-main's deepseek_v41.

This is a *tool*: it imports torch + transformers and is never imported by the runtime
or the tests. It needs a scratch venv (torch 2.13 CPU, transformers 5.24) into which
transformers main's `src/transformers/models/deepseek_v41/{__init__,
configuration_deepseek_v41, modeling_deepseek_v41}.py` (commit 0a2080b4) were copied,
plus the one-line cache_utils.py edit described in ../shared/DESIGN.md. Then:

    /work/scratch/ref/bin/python tools/dev/gen_ref_fixtures_v41.py --out tests/fixtures/ref

Writes, per case, tests/fixtures/ref/<case>/{config.json, model.safetensors, expected.npz}
(random configs) or only expected.npz (demo-v41, shipped in models/demo-v41).
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformers.models.deepseek_v41.modeling_deepseek_v41 as M  # noqa: E402
from gen_ref_fixtures_v4 import (  # noqa: E402
    PY_TEXT,
    cached_forward,
    chunked_forward,
    greedy,
    pick_positions,
    randomize_,
    token_by_token,
)
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v41.configuration_deepseek_v41 import (  # noqa: E402
    DeepseekV41Config,
    DeepseekV41TextConfig,
)

torch.set_num_threads(2)

CHAT_TEXT = "<｜begin▁of▁sentence｜><｜User｜>Return the sum of a list of numbers.<｜Assistant｜></think>"


def base(**kw):
    cfg = dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        qk_rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        index_n_heads=16,
        index_head_dim=32,
        rms_norm_eps=1e-6,
        hc_mult=4,
        num_nextn_predict_layers=0,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        engram_layer_ids=[],
        dspark_noise_token_id=3,  # any id inside the small vocab (DSpark is not built)
    )
    cfg.update(kw)
    return cfg


CASES = {
    # CSA2 with ratio-2 and ratio-1 KV sources, a Reindex source (2) reusing layer 1's
    # keys, reuse-only layers (3, 6), candidate source 4 cutting blocks for index source 5.
    "v41_csa2": dict(
        cfg=dict(
            hidden_size=48,
            num_hidden_layers=7,
            compress_ratios=[0, 2, 2, 2, 1, 1, 1],
            kv_source_layer_ids=[1, 4],
            index_source_layer_ids=[1, 2, 4, 5],
            candidate_source_layer_id=4,
            candidate_topk_blocks=4,
            candidate_block_size=8,
            index_topk=16,
            sliding_window=16,
        ),
        seq=120,
        seed=11,
        splits=[15, 16, 33, 80],
        tokens="random",
    ),
    # Engram at layers 1 and 3 (real demo tokenizer, 8192 vocab), YaRN compress rope,
    # rms_norm_eps 1e-20 as released.
    "v41_engram": dict(
        cfg=dict(
            vocab_size=8192,
            hidden_size=32,
            num_attention_heads=2,
            o_groups=2,
            o_lora_rank=16,
            num_hidden_layers=5,
            compress_ratios=[0, 2, 2, 1, 1],
            kv_source_layer_ids=[1, 3],
            index_source_layer_ids=[1, 2, 3, 4],
            candidate_source_layer_id=3,
            candidate_topk_blocks=3,
            candidate_block_size=8,
            index_topk=8,
            sliding_window=16,
            rms_norm_eps=1e-20,
            engram_layer_ids=[1, 3],
            engram_vocab_size=40,
            engram_max_ngram_size=3,
            engram_n_heads=2,
            engram_head_dim=32,
            engram_pad_id=2,
            max_position_embeddings=1024,  # = 16 * 64, consistent with the YaRN factor
            rope_scaling={
                "rope_type": "yarn",
                "factor": 16.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        ),
        seq=160,
        seed=12,
        splits=[1, 2, 47, 100],
        tokens="text",
    ),
    # Shapes where the reference skips some fake-quantization: head_dim 48 (no FP8
    # window quant: 48 % 32 != 0, but FP4 compressed quant with block 16 applies),
    # index_head_dim 24 (no MXFP4 indexer quant). KV source at layer 0.
    "v41_quant_skip": dict(
        cfg=dict(
            head_dim=48,
            qk_rope_head_dim=16,
            index_head_dim=24,
            num_hidden_layers=4,
            compress_ratios=[2, 2, 1, 1],
            kv_source_layer_ids=[0, 2],
            index_source_layer_ids=[0, 2, 3],
            candidate_source_layer_id=2,
            candidate_topk_blocks=2,
            candidate_block_size=4,
            index_topk=6,
            sliding_window=20,
        ),
        seq=100,
        seed=13,
        splits=[19, 20, 21, 64],
        tokens="random",
    ),
}


def tokenizer(path):
    return PreTrainedTokenizerFast(tokenizer_file=path)


def make_cache_factory(tok):
    def make_cache(model):
        if model.model.engram_layout is not None:
            model.model.bind_tokenizer(tok)  # fresh n-gram history for each sequence
        return DynamicCache(config=model.config)

    return make_cache


class no_fake_quant:
    """Context manager: run the reference with its FP8 / FP4 fake-quantization off."""

    def __enter__(self):
        self.saved = (M._fake_quant_fp8_block, M._fake_quant_fp4_block)
        M._fake_quant_fp8_block = lambda x, block_size=32: x
        M._fake_quant_fp4_block = lambda x, block_size, e4m3_scales=False: x

    def __exit__(self, *a):
        M._fake_quant_fp8_block, M._fake_quant_fp4_block = self.saved


def build_random(case, tok):
    cfg_kw = base(**case["cfg"])
    if cfg_kw["engram_layer_ids"]:
        cfg_kw["engram_compressed_vocab_size"] = M.build_compressed_token_map(tok)[1]
        cfg_kw["engram_num_embeddings"] = [0] * len(cfg_kw["engram_layer_ids"])
        layout = M.EngramLayout.from_config(DeepseekV41TextConfig(**cfg_kw))
        cfg_kw["engram_num_embeddings"] = [sum(p for per in layer for p in per) for layer in layout.primes]
    cfg = DeepseekV41TextConfig(**cfg_kw)
    torch.manual_seed(case["seed"])
    model = M.DeepseekV41ForCausalLM(DeepseekV41Config(text_config=cfg.to_dict())).float().eval()
    randomize_(model, torch.Generator().manual_seed(case["seed"] + 1000))
    return cfg, model


def load(d):
    return M.DeepseekV41ForCausalLM.from_pretrained(
        d, config=DeepseekV41TextConfig.from_pretrained(d), dtype=torch.float32
    ).eval()


def run_case(model, ids, positions, splits, n_greedy, make_cache, tbt=True, greedy_keep=None, store_self=True):
    """store_self=False keeps only the max diffs (report) of the chunked / token-by-token
    runs, not their logits, to keep big-vocab fixtures small."""
    full = cached_forward(model, ids, make_cache)
    out = {"input_ids": ids.numpy().astype(np.int64)[0], "positions": np.asarray(positions, np.int64)}
    out["logits"] = full[0, positions].numpy().astype(np.float32)
    stats = {"max_abs_logit": float(full.abs().max())}
    if splits:
        ch = chunked_forward(model, ids, splits, make_cache)
        stats["chunked_max_abs_diff"] = float((ch - full).abs().max())
        stats["chunked_argmax_agree"] = float((ch.argmax(-1) == full.argmax(-1)).float().mean())
        if store_self:
            out["logits_chunked"] = ch[0, positions].numpy().astype(np.float32)
        out["chunk_splits"] = np.asarray(splits, np.int64)
    if tbt:
        tb = token_by_token(model, ids, make_cache)
        stats["tbt_max_abs_diff"] = float((tb - full).abs().max())
        stats["tbt_argmax_agree"] = float((tb.argmax(-1) == full.argmax(-1)).float().mean())
        if store_self:
            out["logits_tbt"] = tb[0, positions].numpy().astype(np.float32)
    with no_fake_quant():
        nq = cached_forward(model, ids, make_cache)
        out["logits_noquant"] = nq[0, positions].numpy().astype(np.float32)
        stats["noquant_vs_quant_max_abs_diff"] = float((nq - full).abs().max())
        if splits:
            chq = chunked_forward(model, ids, splits, make_cache)
            stats["noquant_chunked_max_abs_diff"] = float((chq - nq).abs().max())
    if n_greedy:
        g_ids, g_logits = greedy(model, ids, n_greedy, make_cache)
        g_logits = np.stack(g_logits).astype(np.float32)
        out["greedy_ids"] = np.asarray(g_ids, np.int64)
        top2 = torch.from_numpy(g_logits).topk(2, dim=-1).values
        out["greedy_margins"] = (top2[:, 0] - top2[:, 1]).numpy().astype(np.float32)
        keep = list(range(n_greedy)) if greedy_keep is None else greedy_keep
        out["greedy_logit_steps"] = np.asarray(keep, np.int64)
        out["greedy_logits"] = g_logits[keep]
        stats["greedy_min_margin"] = float(out["greedy_margins"].min())
    return out, stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/ref")
    ap.add_argument("--demo-v41", default="models/demo-v41")
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    import transformers

    tok = tokenizer(os.path.join(args.demo_v41, "tokenizer.json"))
    make_cache = make_cache_factory(tok)
    report = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "deepseek_v41_source": "huggingface/transformers@0a2080b43eb64e6d448186a4f3f0bc9c618f4797",
        "cases": {},
    }
    for name, case in CASES.items():
        if args.only and args.only != name:
            continue
        cfg, model = build_random(case, tok)
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d)
        model = load(d)  # fixtures come from the reloaded checkpoint
        if case["tokens"] == "text":
            ids = torch.tensor([tok.encode(PY_TEXT)[: case["seq"]]])
        else:
            gen = torch.Generator().manual_seed(case["seed"] + 7)
            ids = torch.randint(3, cfg.vocab_size, (1, case["seq"]), generator=gen)
        positions = pick_positions(ids.shape[1], 20)
        big = cfg.vocab_size > 1024
        out, stats = run_case(
            model, ids, positions, case["splits"], 8, make_cache,
            greedy_keep=[0, 1, 2, 3] if big else None, store_self=not big,
        )
        np.savez_compressed(os.path.join(d, "expected.npz"), **out)
        report["cases"][name] = stats
        print(name, stats, flush=True)

    if not args.only or args.only == "demo_v41":
        model = load(args.demo_v41)
        d = os.path.join(args.out, "demo_v41_chat")
        os.makedirs(d, exist_ok=True)
        ids = torch.tensor([tok.encode(CHAT_TEXT)])
        n = ids.shape[1]
        positions = sorted(set([0, 1, 2, n // 3, n // 2, n - 2, n - 1]))
        keep = list(range(8)) + list(range(8, 64, 8))
        out, stats = run_case(model, ids, positions, [n // 2], 64, make_cache, greedy_keep=keep, store_self=False)
        out["prompt_text"] = np.array(CHAT_TEXT)
        out["greedy_text"] = np.array(tok.decode(out["greedy_ids"].tolist()))
        np.savez_compressed(os.path.join(d, "expected.npz"), **out)
        stats["n_tokens"] = n
        report["cases"]["demo_v41_chat"] = stats
        print("demo_v41_chat", stats, repr(str(out["greedy_text"])), flush=True)

        d = os.path.join(args.out, "demo_v41_long")
        os.makedirs(d, exist_ok=True)
        ids = torch.tensor([tok.encode(PY_TEXT)])
        n = ids.shape[1]
        positions = pick_positions(n, 16)
        out, stats = run_case(model, ids, positions, [63, 64, 65, 130, 200], 0, make_cache, store_self=False)
        out["prompt_text"] = np.array(PY_TEXT)
        np.savez_compressed(os.path.join(d, "expected.npz"), **out)
        stats["n_tokens"] = n
        report["cases"]["demo_v41_long"] = stats
        print("demo_v41_long", stats, flush=True)

    with open(os.path.join(args.out, "report_v41.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
