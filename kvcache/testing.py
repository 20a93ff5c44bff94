"""Test and benchmark helpers: a real redis-server on a free loopback port, and a TCP proxy
that injects network faults (corruption, stalls, throttling) between two real servers."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server without persistence; restart() keeps the port (data is lost, as in a crash)."""

    def __init__(self, port: int | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(prefix="dsuf-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop for good and remove the working directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class FaultProxy:
    """Forward loopback TCP to `target`; faults apply to the target -> client direction.

    mode: pass | corrupt (flip one byte at offset `at`) | stall (forward nothing back) |
    throttle (`rate` bytes/s) | block (a partition: open connections are cut, new ones refused).
    Modes can change while it runs (set_mode).
    """

    def __init__(self, target: str, mode: str = "pass", at: int = 4096, rate: float = 20_000.0):
        self.target_host, _, port = target.rpartition(":")
        self.target_port = int(port)
        self.mode, self.at, self.rate = mode, at, rate
        self.port = 0
        self.connections = 0
        self.bytes_back = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def set_mode(self, mode: str) -> None:
        def apply() -> None:
            self.mode = mode
            if mode == "block":
                for w in list(self._writers):
                    w.transport.abort()
        self._loop.call_soon_threadsafe(apply)
        time.sleep(0.05)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode == "block":
            cw.transport.abort()
            return
        try:
            ur, uw = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            cw.close()
            return
        self._writers.update((cw, uw))

        async def up() -> None:
            while data := await cr.read(65536):
                uw.write(data)
                await uw.drain()

        async def down() -> None:
            off = 0
            while data := await ur.read(4096 if self.mode == "throttle" else 65536):
                if self.mode == "stall":
                    continue
                if self.mode == "corrupt" and off <= self.at < off + len(data):
                    b = bytearray(data)
                    b[self.at - off] ^= 0x5A
                    data = bytes(b)
                off += len(data)
                self.bytes_back = off
                cw.write(data)
                await cw.drain()
                if self.mode == "throttle":
                    await asyncio.sleep(len(data) / self.rate)
            if self.mode == "stall":  # keep the client's connection open and silent
                await asyncio.Event().wait()

        try:
            await asyncio.wait([asyncio.ensure_future(up()), asyncio.ensure_future(down())],
                               return_when=asyncio.FIRST_COMPLETED)
        except Exception:
            pass
        finally:
            for w in (cw, uw):
                self._writers.discard(w)
                try:
                    w.close()
                except Exception:
                    pass

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
