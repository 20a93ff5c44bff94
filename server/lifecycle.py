"""Running the server: listening sockets (bound before the model loads), the model loaded on a
daemon thread with progress on stderr, signals, graceful drain with the listener still open,
and the `serve` command line."""

from __future__ import annotations

import argparse
import asyncio
import errno
import inspect
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from aiohttp import web

from engine.settings import DEFAULT_NUMERICS
from kvcache import serving as kv_serving

from . import limits
from .app import STATE, _attach_engine, build_app
from .http_guard import GuardedRunner

log = logging.getLogger("dsuf.server")
load_log = logging.getLogger("dsuf.load")

DEFAULT_HOST = "localhost"  # every address localhost resolves to (127.0.0.1 and ::1 where both)


# ---------------------------------------------------------------- loading the model


def _load_engine(opts: Any) -> Any:
    from engine.checkpoint.progress import LoadProgress
    from engine.runtime.engine import Engine  # heavy import, off the loop
    from engine.settings import Settings

    kwargs: dict[str, Any] = {"progress": LoadProgress(load_log.info, delay_s=opts.load_delay_s),
                              "settings": Settings.from_env(numerics=opts.numerics)}
    if opts.gpus and "gpus" in inspect.signature(Engine.load).parameters:
        kwargs["gpus"] = opts.gpus  # multi-GPU selection, once the engine takes it
        # the memory plan (engine/runtime/memory_plan.py) checks --max-batch sequences of --max-model-len
        kwargs.update(max_seqs=opts.max_batch, max_context=opts.max_model_len, prefill_chunk=opts.prefill_chunk,
                      expert_split=opts.expert_split)
    engine = Engine.load(opts.ckpt, backend=opts.backend, **kwargs)
    seconds = engine.warm_up()  # before /readyz: the first requests would pay it
    if seconds:
        load_log.info("warmed up in %.1f s (kernels compiled, a %d-token prompt chunk and a decode step run)",
                      seconds, engine.prefill_chunk)
    return engine


def begin_loading(app: web.Application) -> None:
    """Load the model on a daemon thread (an exit during the load does not wait for it)."""
    st = app[STATE]
    if st.engine is not None or st.load_task is not None:
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: tuple[Any, BaseException | None]) -> None:
        if not done.done():
            done.set_result(result)

    def work() -> None:
        try:
            result: tuple[Any, BaseException | None] = (_load_engine(st.opts), None)
        except BaseException as e:  # reported by the task below
            result = (None, e)
        try:
            loop.call_soon_threadsafe(settle, result)
        except RuntimeError:  # the loop is closed: the server stopped during the load
            pass

    async def load() -> None:
        engine, err = await done
        try:
            if err is not None:
                raise err
            st.kv = await kv_serving.start_cache(st.opts.kv, engine)
        except Exception as e:
            log.error("loading the model failed", exc_info=e)
            st.phase, st.load_error = "failed", f"{type(e).__name__}: {e}"
            st.loaded.set()
            return
        _attach_engine(st, engine)

    st.load_thread = threading.Thread(target=work, name="dsuf-load", daemon=True)
    st.load_thread.start()
    st.load_task = loop.create_task(load(), name="load-engine")


# ---------------------------------------------------------------- listening


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for every address `host` resolves to. An address this machine lacks (::1
    without IPv6) is skipped; a port in use raises at once."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    families = {fam for fam, *_ in infos}
    socks: list[socket.socket] = []
    errors: list[OSError] = []
    seen = set()
    for fam, typ, proto, _, addr in infos:
        if (fam, addr[0]) in seen:
            continue
        seen.add((fam, addr[0]))
        if port == 0 and socks:  # one free port for every address
            addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
        try:
            sock = socket.socket(fam, typ, proto)
        except OSError as e:
            errors.append(e)
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6 and len(families) > 1:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                for s in socks:
                    s.close()
                raise
            errors.append(e)
            continue
        socks.append(sock)
    if not socks:
        raise errors[0] if errors else OSError(errno.EADDRNOTAVAIL, f"{host} resolves to no address")
    return socks


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, web.BaseSite, int]:
    """Listen (port 0 = any free one), then start loading the model if the app has none.
    Returns the runner, the first site and the bound port; OSError if the port cannot be had."""
    # handler_cancellation: a client disconnect cancels its handler, which frees the slot;
    # GuardedRunner: error JSON from the HTTP parser, idle / slow-header timeout, connection cap
    lim = limits.of(app)
    runner = GuardedRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=lim.idle_timeout_s, max_connections=lim.max_connections)
    await runner.setup()
    try:
        socks = bind_sockets(host, port)
    except OSError:
        await runner.cleanup()
        raise
    sites = [web.SockSite(runner, s) for s in socks]
    for site in sites:
        await site.start()
    app[STATE].sites = sites
    begin_loading(app)
    return runner, sites[0], socks[0].getsockname()[1]


async def shutdown(app: web.Application, runner: web.AppRunner, site: web.BaseSite | None = None) -> None:
    """Graceful: refuse new work (503, /readyz says draining) while still accepting connections,
    let accepted work finish (drain_timeout_s) or cancel the rest, then close the listener."""
    st = app[STATE]
    st.phase = "draining" if st.phase != "failed" else st.phase
    if st.scheduler is not None:
        if not await st.scheduler.drain(st.opts.drain_timeout_s):
            log.warning("drain timed out; cancelling the remaining requests")
            await st.scheduler.stop()
        await asyncio.sleep(0.05)  # let handlers write their last frames
    for s in st.sites or ([site] if site is not None else []):
        await s.stop()
    await runner.cleanup()


# ---------------------------------------------------------------- the serve command


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _serve(app: web.Application, host: str, port: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner, site, bound = await start_site(app, host, port)
    except OSError as e:
        why = "address already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        print(f"dsuf: cannot listen on {_url_host(host)}:{port}: {why}"
              + (" (another server on this port? choose another with --port)" if e.errno == errno.EADDRINUSE
                 else ""), file=sys.stderr, flush=True)
        return 2
    st = app[STATE]
    print(f"dsuf: serving on http://{_url_host(host)}:{bound}/v1 (loading the model; GET /readyz says when ready)",
          flush=True)

    async def watch_load() -> None:
        await st.loaded.wait()
        if st.phase == "failed":
            print(f"dsuf: the model failed to load: {st.load_error}", file=sys.stderr, flush=True)
            stop.set()
        else:
            print(f"dsuf: model {st.model_ids[0]} ready", flush=True)

    watcher = loop.create_task(watch_load())
    await stop.wait()
    watcher.cancel()
    print("dsuf: shutting down" + (" (the model was still loading)" if st.phase == "starting" else ""),
          flush=True)
    await shutdown(app, runner, site)
    return 1 if st.phase == "failed" else 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: embedded demo-v41)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id(s) to serve (the first is reported in responses; default: the "
                        "checkpoint's canonical name, e.g. deepseek-v4.1-flash)")
    p.add_argument("--gpus", default=None, help="GPUs to use, e.g. 0,1,2,3 (default: numpy on the CPU)")
    from engine.parallel.shard import EXPERT_SPLITS
    from engine.settings import NUMERICS

    p.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="deepseek (the default): as DeepSeek's reference (bf16, FP8 activations); exact: float32")

    p.add_argument("--expert-split", choices=EXPERT_SPLITS, default="ep",
                   help="with several GPUs: routed experts split by expert id or by width")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="address to listen on (default localhost: 127.0.0.1 and ::1; 0.0.0.0 or :: for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DSUF_API_KEY"),
                   help="require Bearer auth on the API routes (/v1/* and their unprefixed forms)")
    p.add_argument("--max-batch", type=int, default=32, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=256, help="waiting sequences before 429")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens prefilled per step (default: 512 on the CPU; with --gpus the largest of "
                        "16384, 8192, ... 512 that the memory plan fits)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context length")
    p.add_argument("--speculative", choices=("dspark", "off"), default=None,
                   help="speculative decoding with the checkpoint's draft layers (default: when it has them, each "
                        "sequence while its acceptance pays for the draft and verify steps on this backend; dspark: "
                        "always)")
    p.add_argument("--keepalive", type=float, default=5.0, help="seconds between SSE keep-alives")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish work on SIGTERM")
    lim = limits.Limits.__dataclass_fields__
    p.add_argument("--idle-timeout", type=float, default=lim["idle_timeout_s"].default,
                   help="seconds a connection may stay open without a complete request (idle, slow headers)")
    p.add_argument("--body-timeout", type=float, default=lim["body_timeout_s"].default,
                   help="seconds a request body may take to arrive")
    p.add_argument("--stream-write-timeout", type=float, default=lim["stream_write_timeout_s"].default,
                   help="seconds a streaming client may stop reading before it is cut off")
    p.add_argument("--max-connections", type=int, default=0,
                   help="open connections at most (0: from the descriptor limit); the oldest idle close first")
    # stands for slow storage in tests of signals and probes during a load
    p.add_argument("--load-delay-per-tensor", type=float, default=0.0, help=argparse.SUPPRESS)
    from kvcache.cache import add_cache_args

    add_cache_args(p)  # --host-cache-gb, --kv-* (sharing needs DSUF_REDIS_URL)


def _kv_config(args: argparse.Namespace) -> Any:
    from kvcache.cache import CacheConfig

    return CacheConfig.from_args(args)


def serve_main(args: argparse.Namespace) -> int:
    """`dsuf.py serve`: blocks until SIGTERM/SIGINT, returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gpus = getattr(args, "gpus", None)
    numerics = getattr(args, "numerics", DEFAULT_NUMERICS)
    app = build_app(numerics=numerics,
        ckpt=getattr(args, "ckpt", None), backend="cupy" if gpus else "numpy", gpus=gpus,
        expert_split=getattr(args, "expert_split", "ep"),
        api_key=getattr(args, "api_key", None), max_batch=getattr(args, "max_batch", 32),
        max_queue=getattr(args, "max_queue", 256), prefill_chunk=getattr(args, "prefill_chunk", None),
        max_model_len=getattr(args, "max_model_len", None), keepalive_s=getattr(args, "keepalive", 5.0),
        drain_timeout_s=getattr(args, "drain_timeout", 30.0), kv=_kv_config(args),
        served_model_names=tuple(getattr(args, "served_model_name", None) or ()),
        load_delay_s=getattr(args, "load_delay_per_tensor", 0.0),
        speculative=getattr(args, "speculative", None),
        limits=limits.Limits(**{k: getattr(args, a) for k, a in (
            ("idle_timeout_s", "idle_timeout"), ("body_timeout_s", "body_timeout"),
            ("stream_write_timeout_s", "stream_write_timeout"), ("max_connections", "max_connections"))
            if getattr(args, a, None) is not None}),
    )
    t0 = time.monotonic()
    rc = asyncio.run(_serve(app, getattr(args, "host", DEFAULT_HOST), getattr(args, "port", 8000)))
    log.info("server stopped after %.1f s", time.monotonic() - t0)
    loader = app[STATE].load_thread
    if loader is not None and loader.is_alive():  # stopped mid-load: do not wait for the weights
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
