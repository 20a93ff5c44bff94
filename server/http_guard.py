"""The HTTP layer below the routes, hardened: OpenAI error JSON for what aiohttp's parser refuses
(bad framing, oversized headers, invalid methods answer text/plain otherwise), and a cap on open
connections that closes the oldest idle ones first (idle: waiting for a request, with no bytes of
one received and unread).

aiohttp has no hook for either: its RequestHandler.handle_error writes the parser's error page
(and finish_response writes what is raised before the middleware, e.g. an unknown Expect),
and web.Server makes one RequestHandler per connection. GuardedRunner is web.AppRunner with the
server's class swapped for GuardedServer, which makes GuardedHandlers; nothing else changes.
Idle and slow-header connections are closed by aiohttp's own keepalive timer, which runs from the
moment a connection opens until its first complete request (Limits.idle_timeout_s).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import termios
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .protocol import APIError, short

log = logging.getLogger("dsuf.http")

_CODES = {400: "bad_request", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large",
          414: "uri_too_long", 431: "request_header_fields_too_large", 501: "not_implemented"}


def error_response(status: int, message: str | None) -> web.Response:
    """The OpenAI error JSON for a status aiohttp's parser chose."""
    status = status if 400 <= status <= 599 else 400
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    if status >= 500:
        err = APIError(status, phrase, type="server_error", code="internal_error")
    else:
        err = APIError(status, f"{phrase}: {short(message or '', 200)}".rstrip(": "),
                       code=_CODES.get(status, "bad_request"))
    resp = err.response()
    resp.force_close()
    return resp


class GuardedHandler(RequestHandler):
    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request", exc_info=exc)
        else:
            log.debug("refused a malformed request (%s): %s", status, message)
        if request.writer.output_size > 0:  # part of a response went out: the connection is broken
            raise ConnectionError("response already started; cannot send the error")
        return error_response(status, message)

    async def finish_response(self, request: Any, resp: web.StreamResponse, start_time: float | None) -> Any:
        # an HTTPException raised before the middleware runs (aiohttp's Expect handling) is
        # written as it is, text/plain: answer the OpenAI JSON instead
        if isinstance(resp, web.HTTPException) and resp.status >= 400 and not resp.prepared:
            resp = error_response(resp.status, resp.text)
        return await super().finish_response(request, resp, start_time)


def pending_bytes(sock: Any) -> int:
    """Bytes a socket has received that nobody has read yet (0 if it cannot say)."""
    if sock is None:
        return 0
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf, True)
    except (OSError, ValueError):  # (closed, or no FIONREAD here)
        return 0
    return int(buf[0])


def _idle(h: RequestHandler) -> bool:
    """No request being handled: waiting for the first or the next one, with nothing received
    that the event loop has not read yet. (A flood of new connections keeps the loop busy in
    connection_made, and a client that sent its request the moment it connected must not look
    idle meanwhile: it would be closed before a byte of its answer.)"""
    waiter = getattr(h, "_waiter", None)
    if waiter is None or waiter.done():
        return False
    transport = getattr(h, "transport", None)
    return pending_bytes(transport.get_extra_info("socket") if transport is not None else None) == 0


class GuardedServer(web.Server):
    max_connections: int = 4096

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        over = len(self._connections) - self.max_connections
        if over <= 0:
            return
        # the oldest idle connections go first (dicts keep insertion order); then the new one
        for h in [h for h in self._connections if h is not handler and _idle(h)][:over]:
            h.force_close()
            over -= 1
        if over > 0:
            log.warning("connection limit (%d) reached; refusing a connection", self.max_connections)
            transport.abort()  # its handler is still starting: the transport's loss ends it


class GuardedRunner(web.AppRunner):
    """web.AppRunner whose server makes GuardedHandlers and caps connections."""

    def __init__(self, app: web.Application, *, max_connections: int, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._max_connections = max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GuardedServer
        server.max_connections = self._max_connections
        return server
