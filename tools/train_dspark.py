"""Train a V4.1 checkpoint's DSpark draft layers with its main model frozen (a development tool:
torch here, never in the runtime). Made for the embedded demo model, models/demo-v41:

    python tools/train_dspark.py data  --ckpt models/demo-v41 --work W [--chunks 2000 --length 256 --workers 2]
    python tools/train_dspark.py train --ckpt models/demo-v41 --work W --out DIR [--minutes 10 --device cuda]
    python tools/train_dspark.py check --ckpt DIR --work W      # torch forward == the engine's draft
    python tools/train_dspark.py accept --ckpt DIR [--prompts 16 --max-tokens 128]

`data` builds the demo's corpus (tools/dspark_train/corpus.py, ../shared/training/'s recipe) and
runs the main model over it with the numpy engine; `train` warm-starts the draft from the main
model's last layers and writes it into --out (config.json's DSpark fields and one more shard,
in the release's formats: FP8 linears, FP4 experts); `check` compares this tool's forward with
engine/model/dspark.py on the written checkpoint; `accept` decodes held-out chat prompts greedily
with speculation and prints the acceptance (tokens per verify step) and whether the ids equal
plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.config import parse_config  # noqa: E402

HELD_OUT = 200_000  # the stream's first tokens: the demo's validation part, never trained on


def _raw(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def cmd_data(a) -> None:
    from tokenizers import Tokenizer

    from tools.dspark_train.corpus import documents, token_stream
    from tools.dspark_train.extract import extract

    t0 = time.time()
    docs = documents()
    stream = np.asarray(token_stream(docs, Tokenizer.from_file(str(a.ckpt / "tokenizer.json"))), np.int32)
    print(f"{len(docs)} documents, {len(stream) / 1e6:.1f}M tokens ({time.time() - t0:.0f} s)", flush=True)
    train_part = stream[HELD_OUT:]
    chunks = min(a.chunks, len(train_part) // a.length)
    cfg = parse_config(_raw(a.ckpt))
    n = cfg.num_layers
    extract(a.ckpt, train_part, a.work, a.length, chunks, a.workers, list(range(n - 3, n)), cfg.hidden_size)
    print(f"extracted {chunks} chunks of {a.length} ({time.time() - t0:.0f} s)", flush=True)


def _model(ckpt: Path, raw: dict, params: dict, device: str):
    from engine.checkpoint.reader import Checkpoint
    from tools.dspark_train.draft_torch import DraftTorch
    from tools.dspark_train.weights import read_f32

    cfg = parse_config(raw)
    ck = Checkpoint(ckpt, block_size=cfg.weight_block_size)
    return DraftTorch(cfg, params, read_f32(ck, "embed.weight"), read_f32(ck, "head.weight")).to(device)


def cmd_train(a) -> None:
    import torch

    from tools.dspark_train.train import train
    from tools.dspark_train.weights import draft_config, initial, write

    torch.manual_seed(0)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.init:  # continue from a draft written before (its config's DSpark fields too)
        raw = dict(_raw(a.ckpt), **{k: v for k, v in _raw(a.init).items() if k.startswith(("dspark_", "num_nextn",
                                                                                           "compress_ratios"))})
        params = _stored_draft(a.init, raw)
    else:
        raw = draft_config(_raw(a.ckpt), a.layers, a.experts, a.topk, a.rank, a.block, a.noise)
        params = initial(a.ckpt, raw)
    model = _model(a.ckpt, raw, params, a.device)
    print(f"draft: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    result = train(model, a.work, a.minutes, a.device, a.seqs, a.anchors)
    write(a.ckpt, a.out, raw, {k: v.cpu() for k, v in model.state().items()})
    (a.work / "train.json").write_text(json.dumps(result, indent=2))
    print(f"wrote the draft into {a.out}", flush=True)


def _stored_draft(ckpt: Path, raw: dict) -> dict:
    """The draft tensors `ckpt` stores, float32 torch tensors by canonical name."""
    import torch

    from engine.checkpoint.reader import Checkpoint
    from engine.checkpoint.schema import resolve
    from tools.dspark_train.weights import draft_entries, read_f32

    cfg = parse_config(raw)
    ck = Checkpoint(ckpt, block_size=cfg.weight_block_size)
    out = {}
    for e in draft_entries(cfg):
        if ck.has(resolve(ck, e.name)):
            out[e.name] = read_f32(ck, e.name)
        elif e.place is None:  # stored but unread (written as zeros)
            out[e.name] = torch.zeros(e.shape)
        else:
            raise KeyError(f"{ckpt}: no draft tensor {e.name}")
    return out


def cmd_check(a) -> None:
    """The written draft through this tool's forward and through the engine's, on a training chunk."""
    import torch

    from engine.runtime.engine import Engine
    from engine.runtime.spec_decode import draft_of, feed

    raw = _raw(a.ckpt)
    cfg = parse_config(raw)
    model = _model(a.ckpt, raw, _stored_draft(a.ckpt, raw), "cpu").eval()
    tokens = np.load(a.work / "tokens.npy")[0].astype(np.int64)
    eng = Engine.load(a.ckpt)
    dsp = draft_of(eng.model)
    worst = 0.0
    for p in (3, 40, 150):
        st, ds = eng.model.new_state(), dsp.new_state()
        feed(eng.model, dsp, st, ds, [int(t) for t in tokens[:p]], all_logits=False)
        d = dsp.draft(ds, int(tokens[p]))
        targets = dict.fromkeys(cfg.dspark_target_layer_ids)
        eng.model.forward([eng.model.new_state()], [[int(t) for t in tokens[:p + 1]]], all_logits=True,
                          targets=targets)
        tin = torch.from_numpy(np.concatenate([np.asarray(targets[i]) for i in cfg.dspark_target_layer_ids], 1))
        with torch.no_grad():
            _, logits = model(tin, torch.from_numpy(tokens[:p + 1]), torch.tensor([p]))
            prev = torch.tensor([[int(tokens[p]), *d.tokens[:-1].tolist()]])
            logits = (logits + model.markov(prev)[0])[0].numpy()
        rel = float(np.abs(logits - d.logits).max() / np.abs(d.logits).max())
        same = logits.argmax(1).tolist() == d.tokens.tolist()
        worst = max(worst, rel)
        print(f"anchor {p}: max |diff| / max |logit| {rel:.2e}, drafted tokens equal: {same}")
    print(f"check: worst {worst:.2e}")
    if worst > 1e-3:
        raise SystemExit("the tool's forward and the engine's disagree")


def cmd_accept(a) -> None:
    """Held-out chat prompts decoded greedily with and without speculation: acceptance (tokens per
    verify step), equality of the ids, and the time each took."""
    from tokenizers import Tokenizer

    from engine.runtime.engine import Engine
    from engine.runtime.sampling import SamplingParams
    from engine.text.chat_encoding import render_messages
    from tools.dspark_train.corpus import documents, held_out_prompts

    eng = Engine.load(a.ckpt)
    prompts = held_out_prompts(documents(), Tokenizer.from_file(str(a.ckpt / "tokenizer.json")), HELD_OUT, a.prompts)
    emitted = steps = same = tokens = 0
    t_spec = t_plain = 0.0
    greedy = SamplingParams(temperature=0.0)
    for text in prompts:
        ids = eng.tokenizer.encode_segments(render_messages([{"role": "user", "content": text}],
                                                            arch=eng.config.arch, thinking=False))
        t0 = time.perf_counter()
        spec = eng.generate(ids, a.max_tokens, greedy, speculative=True)
        st = eng.last_acceptance
        t1 = time.perf_counter()
        plain = eng.generate(ids, a.max_tokens, greedy, speculative=False)
        t_spec, t_plain = t_spec + t1 - t0, t_plain + time.perf_counter() - t1
        emitted, steps = emitted + sum(st.lengths), steps + st.steps
        same, tokens = same + (spec == plain), tokens + len(spec)
        print(f"{len(ids):4d} prompt tokens, {len(spec):4d} generated: {st.tokens_per_step:.2f} tokens/step, "
              f"equal to plain decoding: {spec == plain}", flush=True)
    print(f"{len(prompts)} held-out prompts, {tokens} tokens: acceptance {emitted / max(steps, 1):.2f} tokens/step; "
          f"{same}/{len(prompts)} equal to plain decoding; speculative {tokens / t_spec:.1f} tokens/s, "
          f"plain {tokens / t_plain:.1f} tokens/s (numpy backend)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    t = sub.add_parser("train")
    c = sub.add_parser("check")
    s = sub.add_parser("accept")
    for p in (d, t, c, s):
        p.add_argument("--ckpt", type=Path, required=True)
    for p in (d, t, c):
        p.add_argument("--work", type=Path, required=True)
    d.add_argument("--chunks", type=int, default=2000)
    d.add_argument("--length", type=int, default=256)
    d.add_argument("--workers", type=int, default=2)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--init", type=Path, help="continue from the draft this checkpoint directory holds")
    t.add_argument("--minutes", type=float, default=10.0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--seqs", type=int, default=8, help="sequences per step")
    t.add_argument("--anchors", type=int, default=48, help="draft blocks per sequence and step")
    t.add_argument("--layers", type=int, default=3)
    t.add_argument("--experts", type=int, default=4)
    t.add_argument("--topk", type=int, default=2)
    t.add_argument("--rank", type=int, default=64)
    t.add_argument("--block", type=int, default=5)
    t.add_argument("--noise", type=int, default=2, help="the noise token id (demo: its pad token, never in text)")
    s.add_argument("--prompts", type=int, default=16)
    s.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    {"data": cmd_data, "train": cmd_train, "check": cmd_check, "accept": cmd_accept}[a.cmd](a)


if __name__ == "__main__":
    main()
