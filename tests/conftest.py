"""Shared fixtures: the demo engine loaded once, and real servers on loopback ports."""

from __future__ import annotations

import asyncio
import threading

import pytest


@pytest.fixture(scope="session")
def engine():
    from engine.runtime.engine import Engine

    return Engine.load(None)  # the embedded demo-v41 model, numpy backend


class ServerThread:
    """A dsuf server app on 127.0.0.1:<free port>, its own event loop in a daemon thread."""

    def __init__(self, engine, **opts):
        from server.app import build_app

        self.app = build_app(engine, **opts)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.site, self.port = self.call(self._start())
        self.base = f"http://127.0.0.1:{self.port}"
        self.closed = False

    async def _start(self):
        from server.app import start_site

        return await start_site(self.app, "127.0.0.1", 0)

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def shutdown(self) -> None:
        """Graceful shutdown, as on SIGTERM."""
        if self.closed:
            return
        from server.app import shutdown

        self.closed = True
        self.call(shutdown(self.app, self.runner, self.site))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def server(engine):
    s = ServerThread(engine, keepalive_s=0.25)
    yield s
    s.shutdown()


@pytest.fixture
def make_server(engine):
    """Extra servers with their own options; they share the engine (and its step thread).
    make_server(None) gives one that loads its own engine in the background, as `serve` does."""
    made = []

    def make(engine_=engine, **opts):
        s = ServerThread(engine_, **opts)
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()


def pytest_collection_modifyitems(config, items) -> None:
    """Every test under tests/gpu is marked `gpu`, every test with a real redis-server `redis`
    (`pytest -m "not gpu and not redis"` leaves them out)."""
    for item in items:
        if item.path.parent.name == "gpu":
            item.add_marker(pytest.mark.gpu)
        if "redis_srv" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
