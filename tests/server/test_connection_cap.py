"""The connection cap (server/http_guard.py) on a real aiohttp server: a connection waiting for
its first request counts as idle, and may be closed at the cap, only while nothing it sent sits
unread: a client that sent its request before the event loop read it is not idle."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from server.http_guard import GuardedRunner, _idle, pending_bytes


def test_pending_bytes_counts_what_was_received_and_not_read():
    a, b = socket.socketpair()
    try:
        assert pending_bytes(b) == 0
        a.sendall(b"GET / HTTP/1.1\r\n")
        for _ in range(100):
            if pending_bytes(b) == 16:
                break
        assert pending_bytes(b) == 16
        b.recv(16)
        assert pending_bytes(b) == 0
    finally:
        a.close()
        b.close()
    assert pending_bytes(None) == 0


def test_a_connection_with_unread_request_bytes_is_not_idle():
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main():
        app = web.Application()
        app.router.add_get("/", ok)
        runner = GuardedRunner(app, max_connections=8)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        server = runner.server
        client = socket.create_connection(("127.0.0.1", port))
        try:
            for _ in range(200):  # until the handler waits for its first request
                handlers = list(server._connections)
                if handlers and _idle(handlers[0]):
                    break
                await asyncio.sleep(0.01)
            (h,) = server._connections
            assert _idle(h)
            h.transport.pause_reading()  # what a busy loop does: the bytes stay in the socket
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            for _ in range(200):
                if pending_bytes(h.transport.get_extra_info("socket")):
                    break
                await asyncio.sleep(0.01)
            assert not _idle(h)
            h.transport.resume_reading()  # and the request is answered
            client.settimeout(5)
            reply = await asyncio.get_running_loop().run_in_executor(None, client.recv, 4096)
            assert reply.startswith(b"HTTP/1.1 200")
        finally:
            client.close()
            await runner.cleanup()

    asyncio.run(main())
