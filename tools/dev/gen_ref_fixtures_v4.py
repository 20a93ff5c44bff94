"""Generate DeepSeek-V4 reference fixtures from Hugging Face transformers' deepseek_v4.

This is a *tool*: it imports torch + transformers (>= 5.17) and is never imported by the
runtime or the tests. Run it from a scratch venv that has them, e.g.

    /work/scratch/ref/bin/python tools/dev/gen_ref_fixtures_v4.py \
        --out tests/fixtures/ref --demo-v4 ../shared/models/demo-v4

Writes, per case, tests/fixtures/ref/<case>/{config.json, model.safetensors, expected.npz}
(random configs) or only expected.npz (demo-v4, whose weights stay in ../shared).
"""

import argparse
import json
import os

import numpy as np
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

torch.set_num_threads(2)


# --------------------------------------------------------------------------------------
# helpers shared with gen_ref_fixtures_v41.py (it imports them from here)

# ~300 tokens of Python source (written for these fixtures) used as a raw prompt.
PY_TEXT = '''import heapq
from collections import defaultdict


class Graph:
    """A small weighted directed graph with shortest-path queries."""

    def __init__(self):
        self.edges = defaultdict(list)

    def add_edge(self, src, dst, weight=1.0):
        if weight < 0:
            raise ValueError("negative weights are not supported")
        self.edges[src].append((dst, weight))

    def neighbours(self, node):
        return [dst for dst, _ in self.edges.get(node, [])]

    def shortest_path(self, start, goal):
        queue = [(0.0, start, [start])]
        seen = set()
        while queue:
            cost, node, path = heapq.heappop(queue)
            if node == goal:
                return cost, path
            if node in seen:
                continue
            seen.add(node)
            for dst, weight in self.edges.get(node, []):
                if dst not in seen:
                    heapq.heappush(queue, (cost + weight, dst, path + [dst]))
        return float("inf"), []


def parse_line(line):
    parts = line.strip().split(",")
    if len(parts) != 3:
        return None
    src, dst, weight = parts
    return src, dst, float(weight)


def load_graph(lines):
    graph = Graph()
    for line in lines:
        item = parse_line(line)
        if item is not None:
            graph.add_edge(*item)
    return graph


if __name__ == "__main__":
    g = load_graph(["a,b,1", "b,c,2", "a,c,5", "c,d,1"])
    print(g.shortest_path("a", "d"))
'''


def pick_positions(n, k):
    """k positions spread over [0, n), always including the first and the last."""
    return sorted(set(int(round(x)) for x in np.linspace(0, n - 1, k)))


def randomize_(model, gen):
    """Give every parameter a non-trivial random value: weights ~ N(0, 1/fan_in), and
    the ones HF initialises to 0/1 (norm weights, sinks, mHC base/scale, gate bias,
    ape / position_bias, engram q/k weights) get values away from 0/1 too."""
    def rn(shape):
        return torch.randn(shape, generator=gen)

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.split(".")[-1]
            if "embed.scale" in name:  # engram fp8 row scales: unused for float tables
                p.fill_(1.0)
            elif p.ndim == 1 and ("norm" in name and leaf == "weight"):
                p.copy_(1.0 + 0.2 * rn(p.shape))
            elif leaf in ("sinks", "attn_sink"):
                p.copy_(1.0 * rn(p.shape))
            elif leaf.endswith("base"):  # hc_*_base, hc_base
                p.copy_(0.5 * rn(p.shape))
            elif leaf.endswith("scale") and p.ndim == 1:  # hc_*_scale, hc_scale
                p.copy_(1.0 + 0.3 * rn(p.shape))
            elif leaf in ("bias", "bias_vl", "e_score_correction_bias"):
                p.copy_(0.3 * rn(p.shape))
            elif leaf == "position_bias":
                p.copy_(0.5 * rn(p.shape))
            elif leaf in ("q_weight", "k_weight"):
                p.copy_(1.0 + 0.3 * rn(p.shape))
            elif ("embed" in name and leaf == "weight" and p.ndim == 2 and "engram" not in name) or (
                    "embed_tokens" in name):
                p.copy_(rn(p.shape))
            elif "engram" in name and "embed" in name:
                p.copy_(rn(p.shape))
            elif p.ndim == 3:  # stacked experts [E, out, in]
                p.copy_(rn(p.shape) / p.shape[-1] ** 0.5)
            elif p.ndim == 2:
                p.copy_(rn(p.shape) / p.shape[-1] ** 0.5)
            else:
                p.copy_(rn(p.shape) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * rn(b.shape))


def _fwd(model, ids, cache):
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=ids, use_cache=True, **{key: cache}).logits.float()


@torch.no_grad()
def cached_forward(model, ids, make_cache):
    return _fwd(model, ids, make_cache(model))


@torch.no_grad()
def chunked_forward(model, ids, splits, make_cache):
    cache = make_cache(model)
    bounds = [0] + list(splits) + [ids.shape[1]]
    return torch.cat([_fwd(model, ids[:, a:b], cache) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], 1)


@torch.no_grad()
def token_by_token(model, ids, make_cache):
    cache = make_cache(model)
    return torch.cat([_fwd(model, ids[:, i : i + 1], cache) for i in range(ids.shape[1])], 1)


@torch.no_grad()
def greedy(model, ids, n, make_cache):
    """Cached prefill + n greedy decode steps. Returns (new ids, logits that chose each)."""
    cache = make_cache(model)
    logits = _fwd(model, ids, cache)[0, -1]
    out_ids, out_logits = [], []
    for _ in range(n):
        nxt = int(logits.argmax())
        out_ids.append(nxt)
        out_logits.append(logits.numpy())
        logits = _fwd(model, torch.tensor([[nxt]]), cache)[0, -1]
    return out_ids, out_logits


def base(**kw):
    cfg = dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.5,  # qk_rope_head_dim 16
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        index_n_heads=16,
        index_head_dim=16,
        rms_norm_eps=1e-6,
        hc_mult=4,
        num_nextn_predict_layers=0,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    cfg.update(kw)
    return DeepseekV4Config(**cfg)


CASES = {
    # every layer type, small compress rates so many entries of both kinds exist
    "v4_small_rates": dict(
        cfg=dict(
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            sliding_window=16,
            index_topk=8,
        ),
        seq=160,
        seed=1,
        splits=[37, 64, 65, 101],
    ),
    # the real rates (4 / 128), long enough for several HCA entries
    "v4_real_rates": dict(
        cfg=dict(
            num_hidden_layers=3,
            layer_types=[
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "sliding_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            sliding_window=32,
            index_topk=24,
        ),
        seq=700,
        seed=2,
        splits=[127, 128, 300, 513],
    ),
    # YaRN on the compress rope, two hash layers, top-3 routing, rates 4 / 8
    "v4_yarn_hash2": dict(
        cfg=dict(
            num_hidden_layers=5,
            layer_types=[
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "sliding_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            sliding_window=24,
            index_topk=12,
            n_routed_experts=6,
            num_experts_per_tok=3,
            max_position_embeddings=1024,  # = 16 * 64, consistent with the YaRN factor
            rope_scaling={
                "rope_type": "yarn",
                "factor": 16.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        ),
        seq=200,
        seed=3,
        splits=[3, 50, 51, 160],
    ),
}


def build_random(case):
    torch.manual_seed(case["seed"])
    cfg = base(**case["cfg"])
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(case["seed"] + 1000)
    randomize_(model, gen)
    # hash routing table: distinct random experts per token
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            n_exp = cfg.n_routed_experts
            rows = [torch.randperm(n_exp, generator=gen)[: buf.shape[1]] for _ in range(buf.shape[0])]
            buf.copy_(torch.stack(rows))
    return cfg, model


def make_cache(model):
    return DynamicCache(config=model.config)


def run_case(model, ids, positions, splits, n_greedy, tbt=True, store_self=True, greedy_keep=None):
    full = cached_forward(model, ids, make_cache)
    out = {"input_ids": ids.numpy().astype(np.int64)[0], "positions": np.asarray(positions, np.int64)}
    out["logits"] = full[0, positions].numpy().astype(np.float32)
    stats = {}
    ch = chunked_forward(model, ids, splits, make_cache)
    stats["chunked_max_abs_diff"] = float((ch - full).abs().max())
    if store_self:
        out["logits_chunked"] = ch[0, positions].numpy().astype(np.float32)
    out["chunk_splits"] = np.asarray(splits, np.int64)
    if tbt:
        tb = token_by_token(model, ids, make_cache)
        stats["tbt_max_abs_diff"] = float((tb - full).abs().max())
        out["logits_tbt"] = tb[0, positions].numpy().astype(np.float32)
    stats["max_abs_logit"] = float(full.abs().max())
    if n_greedy:
        g_ids, g_logits = greedy(model, ids, n_greedy, make_cache)
        out["greedy_ids"] = np.asarray(g_ids, np.int64)
        g_logits = np.stack(g_logits).astype(np.float32)
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
    ap.add_argument("--demo-v4", default="../shared/models/demo-v4")
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    import transformers

    report = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": {}}
    for name, case in CASES.items():
        if args.only and args.only != name:
            continue
        cfg, model = build_random(case)
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d)
        # everything below runs on the reloaded checkpoint, so the fixture is exactly
        # what a loader of model.safetensors sees
        model = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(case["seed"] + 7)
        ids = torch.randint(2, cfg.vocab_size, (1, case["seq"]), generator=gen)
        positions = pick_positions(case["seq"], 20)
        out, stats = run_case(model, ids, positions, case["splits"], n_greedy=8)
        np.savez_compressed(os.path.join(d, "expected.npz"), **out)
        report["cases"][name] = stats
        print(name, stats, flush=True)

    if (not args.only or args.only == "demo_v4") and os.path.isdir(args.demo_v4):
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(args.demo_v4, "tokenizer.json"))
        model = DeepseekV4ForCausalLM.from_pretrained(args.demo_v4, dtype=torch.float32).eval()
        ids = torch.tensor([tok.encode(PY_TEXT)])
        n = ids.shape[1]
        positions = pick_positions(n, 16)
        out, stats = run_case(
            model, ids, positions, [100, 128, 129, 257], n_greedy=32, tbt=False, store_self=False,
            greedy_keep=list(range(8)) + list(range(8, 32, 8)),
        )
        out["prompt_text"] = np.array(PY_TEXT)
        d = os.path.join(args.out, "demo_v4")
        os.makedirs(d, exist_ok=True)
        np.savez_compressed(os.path.join(d, "expected.npz"), **out)
        stats["n_tokens"] = n
        report["cases"]["demo_v4"] = stats
        print("demo_v4", stats, flush=True)

    with open(os.path.join(args.out, "report_v4.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
