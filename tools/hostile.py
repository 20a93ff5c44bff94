"""Hostile-input suite against a running dsuf (or any OpenAI-compatible) server.

    python tools/hostile.py --url http://127.0.0.1:8000 [--api-key K] [--idle-timeout 15 ...]

Sends malformed, oversized, slow and adversarial requests over raw sockets (cases in
hostile_cases.py), each followed by a probe: a small greedy request whose answer must equal the
one it gave before the suite. A well-behaved stream runs alongside the whole time and must keep
giving its reference answer. Prints counts tried / right / wrong / crash / hang and exits 1 on
any wrong, crash, hang or harm to the probe or the stream.

Outcomes: right (an expected status; 4xx as OpenAI error JSON with a bounded message), wrong
(another status or an error body that is not the OpenAI JSON), crash (a 5xx, a reset before any
answer, or a server that stops answering probes), hang (no answer, or no close, in time).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

CLOSED = 0  # the server closed the connection without answering (expected for some cases)
CUT = -1  # the server cut a stream short (a client that never reads)
MAX_MESSAGE = 1100  # an error message must not echo unbounded input


class Hang(Exception):
    pass


@dataclass
class Target:
    host: str
    port: int
    model: str
    api_key: str | None = None
    idle_timeout: float = 15.0  # the server's settings, so slow cases know how long to wait
    body_timeout: float = 30.0
    write_timeout: float = 30.0
    max_connections: int = 0  # 0: skip the connection flood
    context_len: int = 0
    vocab: int = 0
    capacity: int = 0  # max_batch + max_queue (0: unknown)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def connect(t: Target, timeout: float = 30.0, rcvbuf: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect((t.host, t.port))
    return s


def request_bytes(t: Target, method: str, path: str, body: bytes = b"", headers: dict | None = None,
                  auth: bool = True) -> bytes:
    h = {"Host": f"{t.host}:{t.port}", "Content-Type": "application/json", "Connection": "close",
         **(t.auth() if auth else {}), **(headers or {})}
    if body and "Content-Length" not in h and "Transfer-Encoding" not in h:
        h["Content-Length"] = str(len(body))
    lines = [f"{method} {path} HTTP/1.1".encode()] + [
        (k.encode() if isinstance(k, str) else k) + b": " + (v.encode("latin-1") if isinstance(v, str) else v)
        for k, v in h.items() if v is not None]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def read_reply(s: socket.socket, deadline: float) -> Reply:
    """One HTTP response from s (Content-Length, chunked or until close); 1xx answers skipped."""
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            chunk = _recv(s, deadline)
            if not chunk:
                if not buf:
                    return Reply(CLOSED)
                raise ConnectionError("connection closed inside the response headers")
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        if not 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            break
        buf = rest
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = _recv(s, deadline)
            if not chunk:
                break
            rest += chunk
        return Reply(status, headers, rest[:n])
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = _recv(s, deadline)
            if not chunk:
                break
            rest += chunk
        return Reply(status, headers, _dechunk(rest))
    while True:
        chunk = _recv(s, deadline)
        if not chunk:
            return Reply(status, headers, rest)
        rest += chunk


def _recv(s: socket.socket, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Hang()
    s.settimeout(left)
    try:
        return s.recv(65536)
    except TimeoutError:
        raise Hang() from None


def _dechunk(data: bytes) -> bytes:
    out, i = b"", 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            return out
        size = int(data[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            return out
        out += data[j + 2:j + 2 + size]
        i = j + 4 + size


def exchange(t: Target, data: bytes, timeout: float = 30.0, pieces: int = 1, pause: float = 0.0) -> Reply:
    """Send data (in `pieces` writes `pause` s apart), read one reply."""
    deadline = time.monotonic() + timeout
    with connect(t, timeout) as s:
        try:
            step = max(1, -(-len(data) // pieces))
            for i in range(0, len(data), step):
                s.sendall(data[i:i + step])
                if pause:
                    time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before reading everything
        try:
            return read_reply(s, deadline)
        except ConnectionResetError:
            return Reply(CLOSED)


def post(t: Target, path: str, obj: dict, timeout: float = 60.0) -> Reply:
    return exchange(t, request_bytes(t, "POST", path, json.dumps(obj).encode()), timeout)


# ---------------------------------------------------------------- verdicts


def verdict(expect: tuple[int, ...], r: Reply, error_json: bool = True) -> str:
    if r.status >= 500:
        return "crash"
    if r.status not in expect:
        return "wrong"
    if 400 <= r.status < 500 and error_json:
        try:
            err = json.loads(r.body)["error"]
            assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str)
        except Exception:
            return "wrong"
        if len(err["message"]) > MAX_MESSAGE or len(str(err["param"] or "")) > 100:
            return "wrong"
    return "right"


# ---------------------------------------------------------------- the probe and the stream


def probe_body(t: Target) -> dict:
    return {"model": t.model, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}


def probe(t: Target) -> str | None:
    """The probe's text, or None when the server did not answer it properly."""
    try:
        r = post(t, "/v1/completions", probe_body(t), timeout=60)
        return json.loads(r.body)["choices"][0]["text"] if r.status == 200 else None
    except Exception:
        return None


def stream_body(t: Target, max_tokens: int = 12) -> dict:
    return {"model": t.model, "messages": [{"role": "user", "content": "Count to five."}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def stream_text(t: Target, body: dict, timeout: float = 60.0, why: list[str] | None = None) -> str | None:
    """A streamed chat answer's content, or None if the stream failed or was not complete (the
    reason appended to `why`)."""
    why = [] if why is None else why
    try:
        r = exchange(t, request_bytes(t, "POST", "/v1/chat/completions", json.dumps(body).encode()), timeout)
    except Exception as e:
        why.append(f"{type(e).__name__}: {e}")
        return None
    if r.status != 200 or b"data: [DONE]" not in r.body:
        why.append(f"status {r.status}: {r.body[-200:]!r}")
        return None
    text = ""
    for line in r.body.split(b"\n"):
        if line.startswith(b"data: {"):
            obj = json.loads(line[6:])
            if "error" in obj:
                why.append(f"error event: {obj['error']}")
                return None
            for c in obj.get("choices", []):
                text += c.get("delta", {}).get("content") or ""
    return text


class Alongside:
    """Well-behaved streams in a loop beside the suite; each must equal the reference."""

    def __init__(self, t: Target, reference: str):
        self.t, self.reference = t, reference
        self.ok = self.bad = 0
        self.why: list[str] = []  # what went wrong with the streams that were not identical
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            why: list[str] = []
            text = stream_text(self.t, stream_body(self.t), why=why)
            if text == self.reference:
                self.ok += 1
            else:
                self.bad += 1
                self.why.append(why[0] if why else f"different text: {text!r}")

    def __enter__(self) -> Alongside:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(120)


# ---------------------------------------------------------------- running


@dataclass
class Outcome:
    name: str
    group: str
    result: str
    detail: str = ""


def run_case(t: Target, case, probe_ref: str) -> Outcome:
    try:
        r = case.run(t) if case.run is not None else exchange(t, case.data(t), case.timeout)
        result = verdict(case.expect, r, case.error_json)
        detail = f"status {r.status}: {r.body[:160]!r}"
    except Hang:
        result, detail = "hang", f"no answer within {case.timeout} s"
    except ConnectionResetError as e:
        result, detail = "crash", f"reset: {e}"
    except Exception as e:
        result, detail = "crash", f"{type(e).__name__}: {e}"
    got = probe(t)
    if got != probe_ref:  # the server must serve everyone else exactly as before
        result, detail = "crash", f"{detail}; the probe after it got {got!r}, not {probe_ref!r}"
    return Outcome(case.name, case.group, result, detail)


def run_suite(t: Target, cases: list, workers: int = 8, verbose: bool = False) -> dict:
    """Every case (slow ones in parallel), with the stream alongside. Returns the counts."""
    probe_ref = probe(t)
    ref = stream_text(t, stream_body(t))
    if probe_ref is None or ref is None:
        raise RuntimeError("the server does not answer the probe before the suite starts")
    with Alongside(t, ref) as along:
        with ThreadPoolExecutor(workers) as pool:
            outcomes = list(pool.map(lambda c: run_case(t, c, probe_ref), [c for c in cases if not c.alone]))
        outcomes += [run_case(t, c, probe_ref) for c in cases if c.alone]
        time.sleep(0.5)
    counts = {k: sum(o.result == k for o in outcomes) for k in ("right", "wrong", "crash", "hang")}
    counts.update(tried=len(outcomes), streams_ok=along.ok, streams_bad=along.bad, streams_why=along.why,
                  failures=[o for o in outcomes if o.result != "right"])
    if verbose:
        for o in outcomes:
            print(f"{o.result:6} {o.group:8} {o.name}: {o.detail[:200]}", flush=True)
    for why in along.why:
        print(f"stream alongside not identical: {why[:300]}", flush=True)
    return counts


def summary(c: dict) -> str:
    return (f"tried {c['tried']}  right {c['right']}  wrong {c['wrong']}  crash {c['crash']}  hang {c['hang']}"
            f"  | streams alongside: {c['streams_ok']} identical, {c['streams_bad']} not")


def passed(c: dict) -> bool:
    return c["right"] == c["tried"] and c["streams_bad"] == 0 and c["streams_ok"] > 0


def main() -> int:
    from hostile_cases import build_cases  # beside this file

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--idle-timeout", type=float, default=15.0, help="the server's idle/header timeout")
    ap.add_argument("--body-timeout", type=float, default=30.0)
    ap.add_argument("--write-timeout", type=float, default=30.0)
    ap.add_argument("--max-connections", type=int, default=0, help="the server's cap (0: skip the flood)")
    ap.add_argument("--capacity", type=int, default=0, help="the server's max batch + max queue")
    ap.add_argument("--vocab", type=int, default=0, help="the model's vocabulary size (logit_bias edges)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    u = urllib.parse.urlsplit(a.url)
    t = Target(u.hostname or "127.0.0.1", u.port or 80, a.model or "", a.api_key, a.idle_timeout, a.body_timeout,
               a.write_timeout, a.max_connections, capacity=a.capacity, vocab=a.vocab)
    cards = json.loads(exchange(t, request_bytes(t, "GET", "/v1/models")).body)["data"]
    t.model = t.model or cards[0]["id"]
    t.context_len = int(cards[0].get("max_model_len") or 4096)
    cases = build_cases(t)
    c = run_suite(t, cases, a.workers, a.verbose)
    for o in c["failures"]:
        print(f"{o.result}: {o.group}/{o.name}: {o.detail[:300]}")
    print(summary(c))
    return 0 if passed(c) else 1


if __name__ == "__main__":
    sys.exit(main())
