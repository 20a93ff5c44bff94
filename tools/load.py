"""Concurrent streaming load against a dsuf (or any OpenAI-compatible) server.

    python tools/load.py --url http://127.0.0.1:8000 --streams 64 --max-tokens 32

Sends the same greedy chat request on every stream at once (each with its own prompt variant), then
the same requests one at a time, and prints: errors, whether every concurrent answer equals its
single-request answer token for token, aggregate tokens/s, time to first token and per-token
latency percentiles. Exits non-zero on any error or mismatch. --save FILE writes every stream's
text as JSON and --expect FILE compares them with such a file (another server's, say one started
with `--speculative off`): a difference counts as a mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    text, usage, error = [], None, None
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                error = obj["error"].get("message")
                continue
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
    dt = time.perf_counter() - t0
    n = usage["completion_tokens"] if usage else 0
    return {"error": error, "text": "".join(text), "tokens": n, "ttft": first or dt, "time": dt,
            "tpot": (dt - (first or dt)) / max(n - 1, 1)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def main_async(args: argparse.Namespace) -> int:
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        async with s.get(f"{args.url}/v1/models") as r:
            model = args.model or (await r.json())["data"][0]["id"]
        prompts = [f"{args.prompt} (variant {i % args.variants})" for i in range(args.streams)]
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(s, args.url, model, p, args.max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        singles = {}
        for p in sorted(set(prompts)):
            singles[p] = await one(s, args.url, model, p, args.max_tokens)
    errors = [r["error"] for r in res if r.get("error")] + [r["error"] for r in singles.values() if r.get("error")]
    mismatch = sum(1 for p, r in zip(prompts, res, strict=True)
                   if not r.get("error") and r["text"] != singles[p].get("text"))
    ok = [r for r in res if not r.get("error")]
    texts = [r.get("text") for r in res]
    if args.save:
        with open(args.save, "w") as f:
            json.dump(texts, f)
    differ = 0
    if args.expect:
        with open(args.expect) as f:
            want = json.load(f)
        differ = len(want) != len(texts) or sum(a != b for a, b in zip(want, texts, strict=True))
        print(f"streams whose text differs from {args.expect}: {differ}")
    tokens = sum(r["tokens"] for r in ok)
    print(f"{args.streams} concurrent streams, {args.max_tokens} max tokens, model {model}")
    print(f"errors {len(errors)}  mismatches vs single requests {mismatch}")
    print(f"{tokens} tokens in {wall:.2f} s: {tokens / wall:.1f} tokens/s aggregate")
    if ok:
        print(f"ttft p50 {pct([r['ttft'] for r in ok], .5):.3f} s  p99 {pct([r['ttft'] for r in ok], .99):.3f} s; "
              f"per-token p50 {statistics.median(r['tpot'] for r in ok) * 1e3:.1f} ms  "
              f"p99 {pct([r['tpot'] for r in ok], .99) * 1e3:.1f} ms")
    for e in errors[:5]:
        print("error:", e, file=sys.stderr)
    return 1 if errors or mismatch or differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--variants", type=int, default=8, help="distinct prompts among the streams")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt", default="Write a Python function that adds two numbers.")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--save", help="write every stream's text to this JSON file")
    ap.add_argument("--expect", help="compare every stream's text with this JSON file (from --save)")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
