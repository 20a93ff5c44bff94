"""Stream a chat completion from a dsuf (or any OpenAI-compatible) server; standard library only.

    python tools/stream_demo.py "Write a function that reverses a list"
    python tools/stream_demo.py --url http://127.0.0.1:8000 --max-tokens 64 --think "..."

Prints the answer as it arrives, then: N tokens at X tokens/s (first token after Y s)
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt", nargs="?", default="Write a Python function that parses a CSV line.")
    ap.add_argument("--url", default=os.environ.get("DSUF_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--think", action="store_true", help="thinking mode (reasoning goes to stderr)")
    ap.add_argument("--api-key", default=os.environ.get("DSUF_API_KEY"))
    args = ap.parse_args()

    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"

    def open_url(req: urllib.request.Request, timeout: float):
        for attempt in range(60):  # a server still loading its model answers 503: wait for it
            try:
                return urllib.request.urlopen(req, timeout=timeout)
            except urllib.error.HTTPError as e:
                if e.code != 503 or attempt == 59:
                    raise
                time.sleep(1)

    model = args.model
    if model is None:
        with open_url(urllib.request.Request(f"{args.url}/v1/models", headers=headers), 30) as r:
            model = json.load(r)["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "thinking": {"type": "enabled" if args.think else "disabled"},
    }
    req = urllib.request.Request(f"{args.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers=headers, method="POST")
    t0 = time.perf_counter()
    t_first = None
    n_chunks = 0
    usage = None
    with open_url(req, 600) as resp:
        for raw in resp:  # one SSE line at a time; ": keep-alive" comments and blank lines skipped
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                print(f"\nerror: {chunk['error']['message']}", file=sys.stderr)
                return 1
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta", {})
                text = delta.get("content") or ""
                reasoning = delta.get("reasoning_content") or ""
                if (text or reasoning) and t_first is None:
                    t_first = time.perf_counter()
                if text or reasoning:
                    n_chunks += 1
                if reasoning:
                    print(reasoning, end="", file=sys.stderr, flush=True)
                print(text, end="", flush=True)
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else n_chunks
    t_first = t_first if t_first is not None else t_end
    rate = (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0
    print(f"\n{n} tokens at {rate:.1f} tokens/s (first token after {t_first - t0:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
