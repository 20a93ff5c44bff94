"""Operators meet the server: `dsuf.py serve` as a real subprocess (port bound before the load,
SIGTERM during the load, load progress, the seed's streaming script against localhost) and the
drain that keeps the listener open."""

from __future__ import annotations

import ast
import errno
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEED = Path(__file__).parent / "clients" / "seed_stream.py"


def _free_port() -> int:
    """A port free on 127.0.0.1 and, where the machine has it, on ::1 (the default host `localhost`
    binds both)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                with socket.socket(socket.AF_INET6) as s6:
                    s6.bind(("::1", port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    continue
            return port


class Serve:
    """`python dsuf.py serve ...` with its stderr in a file."""

    def __init__(self, tmp: Path, *args: str):
        self.err_path = tmp / f"serve-{time.monotonic_ns()}.err"
        self.err = open(self.err_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "dsuf.py", "serve", *args], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=self.err)

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, pred, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}: {self.stderr()[-2000:]}"
            assert time.monotonic() < deadline, self.stderr()[-2000:]
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.err.close()
        return rc


def _get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, dict]:
    c = http.client.HTTPConnection(host, port, timeout=10)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        c.close()


def _v6_up(port: int) -> bool:
    try:
        return _get(port, "/health", host="::1")[0] == 200
    except OSError:
        return False


def _up(port: int, path: str = "/readyz", want: int = 200):
    def check() -> bool:
        try:
            return _get(port, path)[0] == want
        except OSError:
            return False
    return check


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `dsuf.py serve` of the demo model on the default host (localhost)."""
    port = _free_port()
    s = Serve(tmp_path_factory.mktemp("serve"), "--port", str(port))
    s.wait_for(_up(port))
    s.port = port
    yield s
    assert s.stop() == 0


def test_seed_streaming_script_as_published(served, tmp_path):
    script = tmp_path / "seed.py"
    script.write_text(SEED.read_text().replace("localhost:8000", f"localhost:{served.port}"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text, usage = out.stdout.rsplit("\nusage: ", 1)
    usage = ast.literal_eval(usage)  # the script prints the usage dict as Python shows it
    assert usage["completion_tokens"] == 16 and usage["prompt_tokens"] > 5, out.stdout
    assert text.strip(), out.stdout
    served.wait_for(lambda: '"POST /v1/chat/completions" 200' in served.stderr(), timeout=10)
    line = [x for x in served.stderr().splitlines() if '"POST /v1/chat/completions" 200' in x][-1]
    assert f"prompt_tokens={usage['prompt_tokens']} completion_tokens=16" in line, line


def test_default_host_answers_on_every_localhost_address(served):
    """`localhost` binds every address it resolves to, so clients that resolve it to ::1 first
    (Node.js) and to 127.0.0.1 both connect."""
    addrs = {a[4][0] for a in socket.getaddrinfo("localhost", served.port, type=socket.SOCK_STREAM)}
    for addr in addrs:
        assert _get(served.port, "/health", host=addr) == (200, {"status": "ok"}), addr


def test_busy_port_reported_at_once(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        s = Serve(tmp_path, "--host", "127.0.0.1", "--port", str(port))
        rc = s.proc.wait(30)
        took = time.monotonic() - t0
        s.err.close()
    err = s.stderr()
    assert rc != 0 and "address already in use" in err and f":{port}" in err, err
    assert "loading weights" not in err and "loaded weights" not in err, err  # never started the load
    assert took < 15, took


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_signal_during_load_exits_promptly_and_progress_shows(tmp_path, sig):
    port = _free_port()
    # each tensor waits 0.2 s after its read: a load of about a minute, as slow storage would make it
    s = Serve(tmp_path, "--host", "127.0.0.1", "--port", str(port), "--load-delay-per-tensor", "0.2")
    try:
        s.wait_for(lambda: s.stderr().count("loading weights:") >= 2)
        assert _get(port, "/health") == (200, {"status": "ok"})
        status, body = _get(port, "/readyz")
        assert status == 503 and body["status"] == "starting"
        line = [x for x in s.stderr().splitlines() if "loading weights:" in x][-1]
        assert re.search(r"loading weights: [\d.]+ \w+ / [\d.]+ MiB \(\d+%\), \d+/\d+ tensors, "
                         r"[\d.]+ \w+/s, ETA \d+ s", line), line
        t0 = time.monotonic()
        s.proc.send_signal(sig)
        rc = s.proc.wait(30)
        took = time.monotonic() - t0
    finally:
        s.stop()
    assert rc == 0, s.stderr()[-2000:]
    assert took < 5, took
    assert "loaded weights" not in s.stderr()


def test_readyz_503_while_draining_with_listener_open(make_server):
    """While draining, probes connect and read 503 draining; new work gets 503; the listener
    closes after the drain."""
    from tests.server.test_server_concurrency import RawStream

    s = make_server(drain_timeout_s=3.0)
    long = RawStream(s.port, {"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "go"}],
                              "max_tokens": 5000, "ignore_eos": True})
    long.first_token()
    t = threading.Thread(target=s.shutdown, daemon=True)
    t.start()
    deadline = time.monotonic() + 2
    while _get(s.port, "/readyz")[0] == 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status, body = _get(s.port, "/readyz")
    assert (status, body["status"]) == (503, "draining")
    assert _get(s.port, "/health")[0] == 200
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    c.request("POST", "/v1/chat/completions", body=json.dumps({"model": "deepseek-chat", "messages": [
        {"role": "user", "content": "x"}]}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 503 and json.loads(r.read())["error"]["code"] == "not_ready"
    c.close()
    t.join(30)
    long.close()
    with pytest.raises(OSError):
        _get(s.port, "/readyz")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
def test_ipv6_host(tmp_path):
    port = _free_port()
    s = Serve(tmp_path, "--host", "::1", "--port", str(port))
    try:
        s.wait_for(lambda: _v6_up(port))
        assert _get(port, "/health", host="::1") == (200, {"status": "ok"})
    finally:
        assert s.stop() == 0
