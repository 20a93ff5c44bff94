"""aiohttp application: routes (each OpenAI route with and without /v1), auth, model names,
readiness. Listening, loading and shutdown are in server/lifecycle.py. The request path:
handler -> protocol.parse_* -> chat encoding + tokenize (worker thread) -> scheduler.submit ->
events -> SSE chunks or one JSON response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.settings import DEFAULT_NUMERICS
from kvcache import serving as kv_serving  # state cache hooks (kvcache/serving.py)

from . import limits, protocol
from .access import access_middleware, note_usage
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .names import ModelNames, thinking_default
from .protocol import APIError, GenRequest, bad
from .scheduler import Event, Scheduler, Sequence
from .streaming import SSEWriter

log = logging.getLogger("dsuf.server")

DEFAULT_MAX_BODY = 8 << 20  # a 1M-token prompt is ~4 MB of text


@dataclass
class Options:
    ckpt: str | None = None
    backend: str = "numpy"
    gpus: str | None = None
    expert_split: str = "ep"  # tensor parallel: routed experts by expert id or by width
    api_key: str | None = None
    max_batch: int = 32
    max_queue: int = 256
    prefill_chunk: int | None = None  # None: the engine's default for its backend (Engine.prefill_chunk)
    max_model_len: int | None = None  # cap below the model's context (tests, memory)
    keepalive_s: float = 5.0  # `: keep-alive` SSE comment after this much silence
    drain_timeout_s: float = 30.0
    max_body: int = DEFAULT_MAX_BODY
    kv: Any = None  # kvcache.cache.CacheConfig: host state cache / sharing (None: off)
    served_model_names: tuple[str, ...] = ()  # --served-model-name (default: the checkpoint's canonical id)
    load_delay_s: float = 0.0  # test hook: wait after each tensor read, as slow storage would
    limits: limits.Limits = field(default_factory=limits.Limits)  # timeouts, connection and size caps
    speculative: str | None = None  # dspark | off (None: dspark where the checkpoint has draft layers)
    numerics: str = DEFAULT_NUMERICS  # deepseek | exact (engine/settings.py)


@dataclass
class ServerState:
    opts: Options
    metrics: Metrics = field(default_factory=Metrics)
    engine: Any = None
    scheduler: Scheduler | None = None
    model_ids: tuple[str, ...] = ()  # served ids (names.served)
    names: ModelNames | None = None
    context_len: int = 0
    phase: str = "starting"  # starting | ready | draining | failed
    load_error: str | None = None
    load_task: asyncio.Task | None = None
    load_thread: threading.Thread | None = None
    sites: list = field(default_factory=list)  # listening sites (lifecycle.start_site)
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    kv: Any = None  # kvcache.cache.StateCache


STATE = web.AppKey("dsuf_state", ServerState)
BODY_BYTES = web.RequestKey("dsuf_body_bytes", int)  # the size of the body read, in bytes


# ---------------------------------------------------------------- engine lifecycle


def _attach_engine(st: ServerState, engine: Any) -> None:
    st.engine = engine
    ctx = int(getattr(engine, "context_length", engine.config.max_position_embeddings))
    st.context_len = min(ctx, st.opts.max_model_len) if st.opts.max_model_len else ctx
    ckpt_dir = getattr(engine, "ckpt_dir", None)
    st.names = ModelNames.make(str(engine.model_id), getattr(ckpt_dir, "name", None), st.opts.served_model_names)
    st.model_ids = st.names.served
    mid = st.model_ids[0]
    st.scheduler = Scheduler(engine, st.metrics, max_batch=st.opts.max_batch, max_queue=st.opts.max_queue,
                             prefill_chunk=st.opts.prefill_chunk, kv=st.kv, speculative=st.opts.speculative)
    st.metrics.bind(st.model_ids[0], st.scheduler, engine, context_len=st.context_len, kv=st.kv)
    st.scheduler.start()
    st.phase = "ready"
    st.loaded.set()
    log.info("model %s ready (context %d, max batch %d)", mid, st.context_len, st.opts.max_batch)


async def _on_startup(app: web.Application) -> None:
    st = app[STATE]
    if st.engine is not None:  # else lifecycle.start_site loads it once the port is bound
        st.kv = await kv_serving.start_cache(st.opts.kv, st.engine)
        _attach_engine(st, st.engine)


async def _on_cleanup(app: web.Application) -> None:
    st = app[STATE]
    if st.load_task and not st.load_task.done():
        st.load_task.cancel()
    if st.scheduler:
        await st.scheduler.stop()
    if st.kv is not None:  # drain: give up directory ownership before the process goes
        await st.kv.close(release=True)


# ---------------------------------------------------------------- middleware


def _error_response(e: APIError, st: ServerState) -> web.Response:
    st.metrics.http_errors.inc(status=str(e.status))
    return e.response()


@web.middleware
async def _middleware(request: web.Request, handler):
    st = request.app[STATE]
    try:
        if st.opts.api_key and _is_api_path(request.path):
            auth = request.headers.get("Authorization", "")
            token = auth[7:] if auth[:7].lower() == "bearer " else ""
            # aiohttp keeps a non-UTF-8 header byte as a surrogate: compare bytes, never raise
            if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), st.opts.api_key.encode()):
                raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)",
                               code="invalid_api_key")
        return await handler(request)
    except APIError as e:
        return _error_response(e, st)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        msg = {404: f"no route for {protocol.short(request.method)} {protocol.short(request.path)}",
               413: f"request body larger than {st.opts.max_body} bytes"}.get(e.status, e.reason)
        return _error_response(APIError(e.status, msg, code=code, headers={"Allow": e.headers["Allow"]}
                                        if "Allow" in e.headers else None), st)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:
        log.exception("unhandled error on %s", request.path)
        return _error_response(APIError(500, f"internal error: {type(e).__name__}", type="server_error",
                                        code="internal_error"), st)


# ---------------------------------------------------------------- helpers


_API_PATHS = ("/chat/completions", "/completions", "/models")


def _is_api_path(path: str) -> bool:
    """The OpenAI routes, with or without the /v1 prefix (probes and /metrics need no key)."""
    bare = path[3:] if path.startswith("/v1/") else path
    return path.startswith("/v1/") or any(bare == p or bare.startswith(p + "/") for p in _API_PATHS)


def _require_ready(st: ServerState) -> Scheduler:
    if st.phase != "ready" or st.scheduler is None:
        msg = {"starting": "the model is still loading", "draining": "server is shutting down",
               "failed": f"the model failed to load: {st.load_error}"}.get(st.phase, st.phase)
        raise APIError(503, msg, type="service_unavailable", code="not_ready", headers={"Retry-After": "5"})
    return st.scheduler


async def _read_json(request: web.Request) -> Any:
    raw = await limits.read_body(request, limits.of(request.app))
    request[BODY_BYTES] = len(raw)  # bounds the text it carries: sizes the tokenization gate
    if len(raw) < (256 << 10):
        return protocol.parse_body(raw)
    # a big body takes tens of ms to check and parse: off the loop, so streams keep flowing
    return await asyncio.to_thread(protocol.parse_body, raw)


def _check_model(st: ServerState, gen: GenRequest) -> None:
    gen.model = st.names.resolve(gen.model)  # 404 model_not_found for a name this server lacks


def _check_lengths(st: ServerState, gen: GenRequest) -> list[int]:
    """Per-prompt max_tokens, clamped to what the context leaves."""
    limits.check_capacity(gen, int(st.engine.config.vocab_size), st.opts.max_batch + st.opts.max_queue)
    out = []
    for ids in gen.prompts:
        if len(ids) >= st.context_len:
            raise bad(f"This model's maximum context length is {st.context_len} tokens; the prompt has "
                      f"{len(ids)} tokens, leaving no room for output", "messages" if gen.kind == "chat"
                      else "prompt", code="context_length_exceeded")
        room = st.context_len - len(ids)
        out.append(room if gen.max_tokens is None else min(gen.max_tokens, room))
    return out


# ---------------------------------------------------------------- generation


async def _generate(request: web.Request, st: ServerState, gen: GenRequest) -> web.StreamResponse:
    sched = _require_ready(st)
    max_tokens = _check_lengths(st, gen)
    sink: asyncio.Queue[Event] = asyncio.Queue()
    seqs: list[Sequence] = []
    for i, (ids, mt) in enumerate(zip(gen.prompts, max_tokens, strict=True)):
        seqs += sched.new_sequences(gen, ids, mt, sink, first_index=i * gen.n)
    await kv_serving.reuse_prefixes(st.kv, seqs, gen.n, kv_serving.session_id(request.headers), st.metrics,
                                    tenant=kv_serving.tenant(request.headers, gen.cache_salt, st.opts.api_key))
    sched.submit(seqs)  # 429 / 503 raised here, before any byte of a stream is sent
    try:
        if not gen.stream:
            return await _collect(st, gen, seqs, sink)
        w = SSEWriter(request, limits.of(request.app))
        try:
            return await _stream(w, st, gen, seqs, sink)
        except ConnectionResetError:  # the client went away mid-stream; nothing left to answer
            log.info("client disconnected from %s", gen.request_id)
            return w.resp
    finally:
        # disconnect (handler cancelled), write error or normal end: free the slots now
        sched.cancel([s for s in seqs if not s.finished])
        note_usage(request, gen.model, sum(map(len, gen.prompts)), sum(len(s.generated) for s in seqs),
                   _cached(gen, seqs))


def _delta_json(ev: Event) -> dict:
    d: dict[str, Any] = {}
    if ev.delta.reasoning:
        d["reasoning_content"] = ev.delta.reasoning
    if ev.delta.content:
        d["content"] = ev.delta.content
    if ev.delta.tool_calls:
        d["tool_calls"] = ev.delta.tool_calls
    return d


async def _stream(w: SSEWriter, st: ServerState, gen: GenRequest, seqs: list[Sequence],
                  sink: asyncio.Queue) -> web.StreamResponse:
    tok = st.engine.tokenizer
    await w.start()
    chat = gen.kind == "chat"
    if chat:
        for s in seqs:
            obj = protocol.chunk(gen, [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            if gen.return_token_ids:
                obj["prompt_token_ids"] = gen.prompts[0]
            await w.send(obj)
    left = {s.index for s in seqs}
    pending_ids: dict[int, list[int]] = {s.index: [] for s in seqs}
    pending_lp: dict[int, list] = {s.index: [] for s in seqs}
    offsets = {s.index: len(gen.prompt_texts[s.index // gen.n]) if gen.echo else 0 for s in seqs}
    completion_tokens = 0
    if gen.echo and not chat:
        for i, text in enumerate(gen.prompt_texts):
            for j in range(gen.n):
                await w.send(protocol.chunk(gen, [{"index": i * gen.n + j, "text": text, "logprobs": None,
                                                   "finish_reason": None}]))
    while left:
        try:
            ev: Event = await asyncio.wait_for(sink.get(), st.opts.keepalive_s)
        except TimeoutError:
            await w.keepalive()
            continue
        if ev.error is not None:
            await w.send(APIError(500, ev.error, type="server_error", code="generation_failed").body())
            await w.done()
            return w.resp
        pending_ids[ev.index] += ev.token_ids
        pending_lp[ev.index] += ev.logprobs
        if chat:
            delta = _delta_json(ev)
            if not delta and ev.finish_reason is None:
                continue  # held back (partial UTF-8, stop-string prefix, tag prefix)
            choice: dict[str, Any] = {"index": ev.index, "delta": delta, "logprobs": None,
                                      "finish_reason": ev.finish_reason}
            if gen.logprobs:
                choice["logprobs"] = chat_logprobs(tok, pending_lp[ev.index])
        else:
            text = ev.delta.content
            if not text and ev.finish_reason is None:
                continue
            choice = {"index": ev.index, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
            if gen.logprobs:
                choice["logprobs"] = completion_logprobs(tok, pending_lp[ev.index], offsets[ev.index])
            offsets[ev.index] += len(text)
        if gen.return_token_ids:
            choice["token_ids"] = pending_ids[ev.index]
        pending_ids[ev.index], pending_lp[ev.index] = [], []
        await w.send(protocol.chunk(gen, [choice]))
        if ev.finish_reason is not None:
            left.discard(ev.index)
            completion_tokens += ev.completion_tokens
    if gen.include_usage:
        await w.send(protocol.chunk(gen, [], protocol.usage(sum(map(len, gen.prompts)), completion_tokens,
                                                            _cached(gen, seqs))))
    await w.done()
    return w.resp


def _cached(gen: GenRequest, seqs: list[Sequence]) -> int:
    """Prompt tokens served from the state cache, once per prompt (not per choice)."""
    return sum(s.n_cached for s in seqs if s.index % gen.n == 0)


async def _collect(st: ServerState, gen: GenRequest, seqs: list[Sequence], sink: asyncio.Queue) -> web.Response:
    tok = st.engine.tokenizer
    acc = {s.index: {"reasoning": "", "content": "", "tool_calls": [], "ids": [], "lp": [], "finish": None,
                     "completion_tokens": 0} for s in seqs}
    left = set(acc)
    while left:
        ev: Event = await sink.get()
        if ev.error is not None:
            raise APIError(500, ev.error, type="server_error", code="generation_failed")
        a = acc[ev.index]
        a["reasoning"] += ev.delta.reasoning
        a["content"] += ev.delta.content
        for tc in ev.delta.tool_calls:  # a call's first delta, then its argument fragments
            if "id" in tc:
                a["tool_calls"].append({**tc, "function": dict(tc["function"])})
            else:
                a["tool_calls"][-1]["function"]["arguments"] += tc["function"]["arguments"]
        a["ids"] += ev.token_ids
        a["lp"] += ev.logprobs
        if ev.finish_reason is not None:
            a["finish"], a["completion_tokens"] = ev.finish_reason, ev.completion_tokens
            left.discard(ev.index)
    choices = []
    for idx in sorted(acc):
        a = acc[idx]
        if gen.kind == "chat":
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": a["content"] if a["content"] or not a["tool_calls"] else None}
            if gen.thinking:
                msg["reasoning_content"] = a["reasoning"]
            if a["tool_calls"]:
                msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in a["tool_calls"]]
            choice: dict[str, Any] = {"index": idx, "message": msg, "logprobs": None,
                                      "finish_reason": a["finish"]}
            if gen.logprobs:
                choice["logprobs"] = chat_logprobs(tok, a["lp"])
        else:
            prefix = gen.prompt_texts[idx // gen.n] if gen.echo else ""
            choice = {"index": idx, "text": prefix + a["content"], "logprobs": None, "finish_reason": a["finish"]}
            if gen.logprobs:
                choice["logprobs"] = completion_logprobs(tok, a["lp"], len(prefix))
        if gen.return_token_ids:
            choice["token_ids"] = a["ids"]
            if gen.kind == "completion":
                choice["prompt_token_ids"] = gen.prompts[idx // gen.n]
        choices.append(choice)
    body = protocol.completion(gen, choices, protocol.usage(sum(map(len, gen.prompts)),
                                                            sum(a["completion_tokens"] for a in acc.values()),
                                                            _cached(gen, seqs)))
    if gen.return_token_ids and gen.kind == "chat":
        body["prompt_token_ids"] = gen.prompts[0]
    return web.json_response(body, dumps=lambda o: json.dumps(o, ensure_ascii=False))


# ---------------------------------------------------------------- routes


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = await _read_json(request)
    _require_ready(st)
    spec = protocol.parse_chat(body, st.model_ids[0])
    thinking = thinking_default(spec.gen.model, body)  # deepseek-reasoner: on unless the body says
    _check_model(st, spec.gen)
    if thinking is not None:
        spec.gen.thinking = thinking
    from engine.text.chat_encoding import render_messages

    arch = st.engine.config.arch
    lim = limits.of(request.app)
    longest = limits.longest_token_chars(st.engine.tokenizer)
    n_chars = sum(len(m["content"]) for m in spec.messages)
    limits.check_chars(n_chars, st.context_len, longest, "messages")

    def encode() -> list[int]:
        # Message text is tokenized as plain text: it can never spell a control token.
        segments = render_messages(spec.messages, arch=arch, thinking=spec.gen.thinking,
                                   reasoning_effort=spec.reasoning_effort, tools=spec.tools,
                                   response_format=spec.response_format, add_generation_prompt=True)
        text = "".join(piece for piece, _ in segments)
        limits.check_chars(len(text), st.context_len, longest, "messages")
        limits.check_tokens(st.engine.tokenizer.encode, text, st.context_len, lim.piece_chars, "messages")
        return st.engine.tokenizer.encode_segments(segments)

    try:
        ids = await limits.tokenize(lim, encode, chars=request[BODY_BYTES])
    except (ValueError, TypeError, KeyError) as e:
        raise bad(f"cannot encode the conversation: {e}", "messages") from None
    spec.gen.prompts = [ids]
    return await _generate(request, st, spec.gen)


async def completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = await _read_json(request)
    _require_ready(st)
    gen, prompts = protocol.parse_completion(body, st.model_ids[0])
    _check_model(st, gen)
    tok = st.engine.tokenizer
    vocab = int(st.engine.config.vocab_size)
    lim = limits.of(request.app)
    longest = limits.longest_token_chars(tok)
    for p in prompts:  # cheap bounds first: nothing that cannot fit is tokenized or decoded
        if isinstance(p, str):
            limits.check_chars(len(p), st.context_len, longest, "prompt")
        elif len(p) >= st.context_len:
            raise limits.too_long(str(len(p)), st.context_len, "prompt")

    def encode() -> tuple[list[list[int]], list[str]]:
        ids_out, texts = [], []
        for p in prompts:
            if isinstance(p, str):
                # A raw prompt is the client's own context (no other party's turn in it):
                # control tokens spelled in it are matched, as vLLM does.
                ids = limits.encode_bounded(tok.encode, p, st.context_len, lim.piece_chars, "prompt")
                texts.append(p)
            else:
                if any(t < 0 or t >= vocab for t in p):
                    raise ValueError(f"token ids must be in [0, {vocab})")
                ids = list(p)
                texts.append(tok.decode(ids))
            # a plain prompt starts a document: BOS first, as the model was trained
            if tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
                ids = [tok.bos_id] + ids
            ids_out.append(ids)
        return ids_out, texts

    try:
        gen.prompts, gen.prompt_texts = await limits.tokenize(lim, encode, chars=sum(map(len, prompts)))
    except (ValueError, TypeError) as e:  # TypeError: text the tokenizer cannot take (lone surrogates)
        raise bad(str(e), "prompt") from None
    return await _generate(request, st, gen)


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    _require_ready(st)
    data = [protocol.model_card(m, st.context_len) for m in st.model_ids]
    return web.json_response({"object": "list", "data": data})


async def model_detail(request: web.Request) -> web.Response:
    st = request.app[STATE]
    _require_ready(st)
    mid = request.match_info["model"]
    st.names.resolve(mid)  # 404 for a name this server lacks
    return web.json_response(protocol.model_card(mid, st.context_len))


async def readyz(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.phase == "ready" and st.scheduler is not None and not st.scheduler.alive:
        st.phase, st.load_error = "failed", "the scheduler loop stopped"
    ok = st.phase == "ready"
    body: dict[str, Any] = {"status": st.phase}
    if st.load_error:
        body["error"] = st.load_error
    return web.json_response(body, status=200 if ok else 503)


async def healthz(request: web.Request) -> web.Response:
    """/health and /healthz: 200 while the process is alive (loading and draining included)."""
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.Response(body=st.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(engine: Any = None, **opts: Any) -> web.Application:
    """The aiohttp application. With engine=None the model (opts ckpt/backend/gpus; ckpt None =
    embedded demo-v41) loads in the background after startup; /readyz says 503 until then."""
    o = Options(**opts)
    app = web.Application(middlewares=[access_middleware, _middleware], client_max_size=o.max_body)
    st = ServerState(opts=o, engine=engine)
    app[STATE] = st
    app[limits.LIMITS] = o.limits
    for prefix in ("/v1", ""):  # clients such as DeepSeek's dsh post to /chat/completions
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_post(f"{prefix}/completions", completions)
        app.router.add_get(f"{prefix}/models", models)
        app.router.add_get(f"{prefix}/models/{{model}}", model_detail)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/health", healthz)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    return app


# ---------------------------------------------------------------- running it


def __getattr__(name: str) -> Any:
    """start_site, shutdown, serve_main, add_serve_args live in server/lifecycle.py."""
    if name in ("start_site", "shutdown", "serve_main", "add_serve_args"):
        from . import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
