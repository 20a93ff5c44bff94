#!/usr/bin/env python3
"""dsuf command line: serve | run | bench | tiny-model."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _run(args: argparse.Namespace) -> int:
    from engine.checkpoint.progress import LoadProgress
    from engine.runtime.engine import Engine
    from engine.runtime.sampling import SamplingParams
    from engine.settings import Settings
    from engine.text.chat_encoding import render_messages

    eng = Engine.load(args.ckpt, backend=args.backend, settings=Settings.from_env(numerics=args.numerics),
                      progress=LoadProgress(lambda line: print(line, file=sys.stderr, flush=True)))
    if args.prompt_ids:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            print("error: --prompt-ids takes comma-separated integers", file=sys.stderr)
            return 2
    else:
        if args.prompt is None:
            print("error: give a prompt or --prompt-ids", file=sys.stderr)
            return 2
        ids = eng.tokenizer.encode(args.prompt) if args.raw else eng.tokenizer.encode_segments(render_messages(
            [{"role": "user", "content": args.prompt}], arch=eng.config.arch, thinking=args.thinking))
    if not ids:
        print("error: empty prompt", file=sys.stderr)
        return 2
    bad = [t for t in ids if not 0 <= t < eng.config.vocab_size]
    if bad:
        print(f"error: token ids {bad[:5]} outside the vocabulary [0, {eng.config.vocab_size})", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=max(args.temperature, 0.0), seed=args.seed)
    t0 = time.perf_counter()
    spec = None if args.speculative is None else args.speculative == "dspark"
    try:
        out = eng.generate(ids, args.max_tokens, params, speculative=spec)
    except ValueError as e:  # --speculative dspark on a checkpoint without draft layers
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    if args.print_ids:
        print(",".join(str(t) for t in out))
    else:
        print(eng.tokenizer.decode([t for t in out if t not in eng.eos_ids]))
    per_token, fixed = eng.model.state_bytes_per_token()
    print(f"{len(ids)} prompt + {len(out)} generated tokens in {dt:.2f} s: "
          f"{len(out) / dt if dt > 0 else 0.0:.1f} tokens/s; sequence state {per_token:.0f} B/token "
          f"+ {fixed / 1024:.0f} KiB of window rings", file=sys.stderr)
    if eng.last_acceptance is not None:
        acc = eng.last_acceptance
        print(f"acceptance {acc.tokens_per_step:.2f} tokens/step ({acc.accepted} of {acc.drafted} drafts kept "
              f"over {acc.steps} verify steps)", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from server.lifecycle import serve_main

    return serve_main(args) or 0


def _bench(argv: list[str]) -> int:
    from engine.bench import bench_main

    return bench_main(argv) or 0


def _tiny(argv: list[str]) -> int:
    from engine.checkpoint.tiny_model import tiny_model_main

    return tiny_model_main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if argv and argv[0] == "tiny-model":  # its options live with the writer
        return _tiny(argv[1:])
    if argv and argv[0] == "bench":  # its options live with the benchmark
        return _bench(argv[1:])
    from engine.settings import DEFAULT_NUMERICS, NUMERICS

    p = argparse.ArgumentParser(prog="dsuf", description="DeepSeek-V4 / V4.1 inference engine and server")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="complete one prompt and print it")
    r.add_argument("prompt", nargs="?")
    r.add_argument("--ckpt", default=None, help="checkpoint directory (default: embedded demo-v41)")
    r.add_argument("--backend", default="numpy")
    r.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="deepseek (the default): as DeepSeek's reference (bf16, FP8 activations); exact: float32")
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--raw", action="store_true", help="no chat template")
    r.add_argument("--thinking", action="store_true", help="chat template in thinking mode")
    r.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids")
    r.add_argument("--print-ids", action="store_true", help="print generated ids, comma-separated")
    r.add_argument("--speculative", choices=("dspark", "off"), default=None,
                   help="decode with the checkpoint's DSpark draft layers (default: dspark when it has them)")

    from server.lifecycle import add_serve_args

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(s)
    sub.add_parser("tiny-model", help="write a small random checkpoint (see `dsuf.py tiny-model -h`)")
    sub.add_parser("bench", help="decode / prefill timings against the HBM and tensor-core floors")

    args = p.parse_args(argv)
    if args.cmd == "run":
        return _run(args)
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
