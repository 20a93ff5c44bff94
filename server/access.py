"""One access-log line per request on the `dsuf.access` logger: client, method, path, status,
latency and, for generation requests, the model and token counts the handler stashed with
`note_usage`. Probe and scrape routes log at DEBUG so that a probe every few seconds does not
bury the requests."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

__all__ = ["access_middleware", "note_usage", "ACCESS_LOG"]

ACCESS_LOG = logging.getLogger("dsuf.access")
_USAGE = web.RequestKey("dsuf_usage", tuple)
_QUIET = frozenset({"/health", "/healthz", "/readyz", "/metrics"})
_PATH_MAX = 200


def note_usage(request: web.Request, model: str, prompt: int, completion: int, cached: int) -> None:
    """What a generation handler served, for its access-log line."""
    request[_USAGE] = (model, prompt, completion, cached)


def _clean(text: str) -> str:
    """A client's path as one bounded, printable token."""
    text = text if len(text) <= _PATH_MAX else text[:_PATH_MAX] + "..."
    return text.encode("ascii", "backslashreplace").decode().replace('"', "%22")


@web.middleware
async def access_middleware(request: web.Request, handler):
    t0 = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away before the answer ended
        raise
    finally:
        level = logging.DEBUG if request.path in _QUIET else logging.INFO
        if ACCESS_LOG.isEnabledFor(level):
            line = f'{request.remote or "-"} "{request.method} {_clean(request.path)}" {status} ' \
                   f"{time.perf_counter() - t0:.3f}s"
            usage = request.get(_USAGE)
            if usage is not None:
                model, prompt, completion, cached = usage
                line += (f" model={_clean(model)} prompt_tokens={prompt} completion_tokens={completion}"
                         f" cached_tokens={cached}")
            ACCESS_LOG.log(level, "%s", line)
