"""Continuous batching under load, disconnects, overload, keep-alives, readiness and shutdown."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from engine.text.chat_encoding import encode_messages
from server.metrics import parse_prometheus

ROOT = Path(__file__).resolve().parents[2]
MODEL = "demo-v41"


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
        return parse_prometheus(r.read().decode())


def _wait_for(pred, timeout: float = 10.0, every: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(every)
    return False


class RawStream:
    """A streaming chat request over a bare socket, so the test controls disconnects."""

    def __init__(self, port: int, body: dict, path: str = "/v1/chat/completions"):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.request("POST", path, body=json.dumps({"stream": True, **body}).encode(),
                          headers={"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        self.comments = 0

    def next_event(self) -> dict | str | None:
        """Next `data:` payload (parsed JSON, or '[DONE]'); None at end of stream."""
        while True:
            line = self.resp.fp.readline()
            if not line:
                return None
            line = line.decode().rstrip("\r\n")
            if line.startswith(":"):
                self.comments += 1
            elif line.startswith("data: "):
                data = line[6:]
                return data if data == "[DONE]" else json.loads(data)

    def first_token(self) -> dict:
        while True:
            ev = self.next_event()
            assert isinstance(ev, dict), ev
            if ev["choices"] and ev["choices"][0]["delta"].get("content") is not None \
                    and ev["choices"][0]["delta"].get("role") is None:
                return ev

    def rest(self) -> list:
        out = []
        while (ev := self.next_event()) is not None:
            out.append(ev)
            if ev == "[DONE]":
                break
        return out

    def close(self) -> None:
        self.conn.close()


def _long(i: int = 0) -> dict:
    return {"model": MODEL, "messages": _msgs(f"Write a long module {i}."), "max_tokens": 5000,
            "ignore_eos": True, "temperature": 0}


def test_32_simultaneous_streams(server, engine):
    prompts = [f"Task {k}: write a helper that formats dates." for k in range(4)]
    refs = {}
    for p in prompts:
        ids = engine.tokenizer.encode(encode_messages(_msgs(p), arch=engine.config.arch, thinking=False))
        refs[p] = engine.tokenizer.decode([t for t in engine.generate(ids, 8) if t not in engine.eos_ids])
    results: dict[int, tuple[str, str | None, int]] = {}
    errors: list[BaseException] = []
    go = threading.Barrier(32)

    def worker(i: int) -> None:
        try:
            client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
            go.wait()
            stream = client.chat.completions.create(model=MODEL, messages=_msgs(prompts[i % 4]), max_tokens=8,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
            text, finish, usage = "", None, None
            for ch in stream:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
                usage = ch.usage or usage
            results[i] = (text, finish, usage.completion_tokens)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[:3]
    assert len(results) == 32
    for i, (text, finish, n) in results.items():
        assert finish in ("stop", "length") and 1 <= n <= 8
        assert text == refs[prompts[i % 4]], i
    assert _wait_for(lambda: _metrics(server)["vllm:num_requests_running"] == 0)


def test_disconnect_mid_stream_frees_slot(server):
    before = _metrics(server).get('dsuf_requests_total{finish_reason="cancelled"}', 0)
    s = RawStream(server.port, _long(1))
    s.first_token()
    s.first_token()
    assert _metrics(server)["vllm:num_requests_running"] == 1
    s.close()
    assert _wait_for(lambda: _metrics(server)["vllm:num_requests_running"] == 0, timeout=5)
    m = _metrics(server)
    assert m['dsuf_requests_total{finish_reason="cancelled"}'] == before + 1
    assert m["vllm:num_requests_waiting"] == 0


def test_disconnect_of_non_streaming_request_frees_slot(server):
    before = _metrics(server).get('dsuf_requests_total{finish_reason="cancelled"}', 0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(_long(5)).encode(),
                 headers={"Content-Type": "application/json"})
    assert _wait_for(lambda: _metrics(server)["vllm:num_requests_running"] == 1)
    conn.close()
    assert _wait_for(lambda: _metrics(server)["vllm:num_requests_running"] == 0, timeout=5)
    assert _metrics(server)['dsuf_requests_total{finish_reason="cancelled"}'] == before + 1


def test_overload_gets_429_and_waiting_stream_gets_keepalives(make_server):
    s = make_server(max_batch=1, max_queue=1, keepalive_s=0.1)
    a = RawStream(s.port, _long(2))
    a.first_token()
    b = RawStream(s.port, _long(3))  # queued behind a
    assert _wait_for(lambda: _metrics(s)["vllm:num_requests_waiting"] == 1)
    t0 = time.monotonic()
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError) as exc:
        client.chat.completions.create(model=MODEL, messages=_msgs("one more"), max_tokens=2)
    assert time.monotonic() - t0 < 5  # refused, not parked
    assert exc.value.response.headers.get("Retry-After") == "1"
    assert exc.value.body["code"] == "rate_limit_exceeded"
    assert _metrics(s)["dsuf_requests_rejected_total"] >= 1
    # b waits for a's slot with `: keep-alive` comments, then streams once a disconnects
    b.resp.fp.readline()  # role chunk
    time.sleep(0.5)
    a.close()
    b.first_token()
    assert b.comments >= 2
    b.close()
    assert _wait_for(lambda: _metrics(s)["vllm:num_requests_running"] == 0, timeout=5)
    r = client.chat.completions.create(model=MODEL, messages=_msgs("after"), max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_long_prompt_prefill_is_chunked_and_does_not_stall_decodes(make_server, engine):
    s = make_server(prefill_chunk=32)
    short = RawStream(s.port, {"model": MODEL, "messages": _msgs("short"), "max_tokens": 5000, "ignore_eos": True,
                               "temperature": 0})
    short.first_token()
    m0 = _metrics(s)
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=120)
    long_text = "def f(x):\n    return x + 1\n" * 40
    r = client.chat.completions.create(model=MODEL, messages=_msgs(long_text), max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True})
    m1 = _metrics(s)
    short.close()
    prompt_len = r.usage.prompt_tokens
    assert prompt_len > 300
    steps = m1["dsuf_engine_steps_total"] - m0["dsuf_engine_steps_total"]
    short_tokens = m1["vllm:generation_tokens_total"] - m0["vllm:generation_tokens_total"] - 2
    # the prompt took one step per 32 tokens, and the short stream decoded a token in every one
    assert steps >= prompt_len / 32
    assert short_tokens >= prompt_len / 32 - 1


def test_graceful_shutdown_finishes_in_flight(make_server):
    s = make_server(drain_timeout_s=30)
    a = RawStream(s.port, {"model": MODEL, "messages": _msgs("Finish me."), "max_tokens": 30, "ignore_eos": True,
                           "temperature": 0})
    a.first_token()
    stopper = threading.Thread(target=s.shutdown)
    stopper.start()
    rest = a.rest()
    stopper.join(30)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", s.port), timeout=2).close()


def test_shutdown_past_drain_timeout_sends_error_frame(make_server):
    s = make_server(drain_timeout_s=0.3)
    a = RawStream(s.port, _long(4))
    a.first_token()
    stopper = threading.Thread(target=s.shutdown)
    stopper.start()
    rest = a.rest()
    stopper.join(30)
    errors = [ev for ev in rest if isinstance(ev, dict) and "error" in ev]
    assert len(errors) == 1 and "shutting down" in errors[0]["error"]["message"]
    assert rest[-1] == "[DONE]"


def test_readyz_503_while_loading(make_server):
    s = make_server(None)  # no engine given: the server loads demo-v41 in the background
    seen = []
    assert _wait_for(lambda: seen.append(_status(s.base + "/readyz")) or seen[-1] == 200, timeout=60)
    assert seen[0] == 503, seen[:3]  # answered while the model was still loading
    assert _status(s.base + "/healthz") == 200


def _status(url: str, body: dict | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_cli_stream_demo_and_sigterm():
    """`dsuf.py serve` (or `python -m server` until dsuf.py exists) on a free port, the README's
    streaming script against it, then SIGTERM with a request in flight: it finishes, the process exits 0."""
    port = _free_port()
    cmd = [sys.executable, "dsuf.py", "serve"] if (ROOT / "dsuf.py").exists() else [sys.executable, "-m", "server"]
    proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        assert _wait_for(lambda: _probe(base + "/readyz") == 200, timeout=90, every=0.2), "server never ready"
        out = subprocess.run([sys.executable, str(ROOT / "tools" / "stream_demo.py"), "--url", base,
                              "--max-tokens", "12"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "tokens/s (first token after" in out.stdout.strip().splitlines()[-1]
        a = RawStream(port, {"model": MODEL, "messages": _msgs("Finish me."), "max_tokens": 20,
                             "ignore_eos": True, "temperature": 0})
        a.first_token()
        proc.send_signal(signal.SIGTERM)
        rest = a.rest()
        assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log = proc.communicate(timeout=10)[0]
    assert "shutting down" in log


def _probe(url: str) -> int | None:
    try:
        return _status(url)
    except OSError:
        return None


def test_n_choices_prefill_the_prompt_once(server):
    """n > 1: choice 0 prefills, the others fork its state at the end of the prompt (the engine
    sees the prompt's tokens once) and still decode on their own random streams."""
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
    msgs = _msgs("Write a haiku about the sea, then explain it.")
    before = _metrics(server)["dsuf_prefill_tokens_total"]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, seed=7, n=3)
    fed = _metrics(server)["dsuf_prefill_tokens_total"] - before
    assert fed == r.usage.prompt_tokens - (r.usage.prompt_tokens_details.cached_tokens or 0)
    assert len({c.message.content for c in r.choices}) > 1
    one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, seed=7, n=1)
    assert r.choices[0].message.content == one.choices[0].message.content
    greedy = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, n=2)
    ref = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, n=1)
    assert [c.message.content for c in greedy.choices] == [ref.choices[0].message.content] * 2


def test_planning_ahead_serves_the_same_completions(make_server, engine):
    """A server whose model plans each next decode step ahead (Model.prepare_next; here through the
    hint on numpy) streams the same greedy completions as the plain
    engine, under concurrent requests that join and finish at different steps (the batch changes:
    plans made ahead are dropped), and does take plans made ahead. (Plain decode steps plan ahead,
    so speculation is off here.)"""
    from engine.runtime.engine import Engine

    ahead = Engine.load(None)
    ahead.model.ops.prepare_next = True
    prompts = [f"Request {k}: list {k + 2} colours." for k in range(6)]
    outs = {}
    for name, eng in (("plain", engine), ("ahead", ahead)):
        s = make_server(eng, speculative="off")
        results: dict[int, str] = {}
        errors: list[BaseException] = []

        def worker(i: int, base: str = s.base, results: dict = results, errors: list = errors) -> None:
            try:
                time.sleep(0.05 * i)  # (joining at different steps)
                client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
                r = client.chat.completions.create(model=MODEL, messages=_msgs(prompts[i]), max_tokens=6 + 4 * i,
                                                   temperature=0)
                results[i] = r.choices[0].message.content
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors[:3]
        outs[name] = results
    assert outs["plain"] == outs["ahead"] and len(outs["ahead"]) == len(prompts)
    assert ahead.model.ahead_used > 0
