"""The few calls the server makes into the state cache, kept here so server/ changes stay small.

    app startup:   st.kv = await start_cache(cfg, engine)
    _generate:     await reuse_prefixes(st.kv, seqs, gen.n, session_id(request.headers), st.metrics,
                                    tenant=tenant(request.headers, gen.cache_salt, api_key))
    scheduler:     chunk_limit(s) caps a prefill chunk at the next snapshot point;
                   snapshot_prompt(kv, s) after a step; snapshot_answer(kv, s) when it finishes
    /metrics:      kv.render_metrics()
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

from engine.state.validate import StateShape

from .cache import CacheConfig, StateCache

log = logging.getLogger("dsuf.kvcache")

SESSION_HEADERS = ("x-deepseek-harness-session-id", "x-session-id")


def session_id(headers: Mapping[str, str]) -> str | None:
    for h in SESSION_HEADERS:
        v = headers.get(h)
        if v:
            return v[:256]
    return None


def tenant(headers: Mapping[str, str], cache_salt: str | None, api_key: str | None) -> str:
    """Whose states a request may reuse. States are shared only within one tenant: the API key's
    identity where the server has keys (a hash of the key the client presented, which the auth
    middleware has checked), narrowed by the request's `cache_salt` when it gives one. A server
    without keys and a request without a salt: the one shared tenant (a single-tenant server)."""
    parts = []
    if api_key:
        auth = headers.get("Authorization", "")
        token = auth[7:] if auth[:7].lower() == "bearer " else ""
        parts.append("key:" + hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()[:32])
    if cache_salt:
        parts.append("salt:" + hashlib.sha256(cache_salt.encode("utf-8", "replace")).hexdigest()[:32])
    return "|".join(parts)


async def start_cache(cfg: CacheConfig | None, engine: Any) -> StateCache | None:
    if cfg is None or cfg.host_cache_gb <= 0:
        return None
    model = engine.model
    shape = StateShape.of(model.cfg, str(model.model_key), int(engine.context_length))
    cache = StateCache(cfg, str(engine.model_id), str(model.model_key), shape)
    await cache.start()
    return cache


async def reuse_prefixes(kv: StateCache | None, seqs: list[Any], n: int, session: str | None,
                         metrics: Any = None, tenant: str = "") -> int:
    """Give each new sequence the longest stored state of its prompt among its tenant's; returns
    the prompt tokens reused (per prompt, as usage.cached_tokens counts them). Sequences of one
    prompt come in groups of n that share the prompt list."""
    total = 0
    for i in range(0, len(seqs), max(1, n)):
        group = seqs[i:i + n]
        for s in group:
            s.session, s.kv_tenant = session, tenant
        if kv is None:
            continue
        try:
            hit = await kv.lookup(group[0].prompt, session, copies=len(group), tenant=tenant)
        except Exception:  # the cache must never fail a request
            log.exception("state cache lookup failed; prefilling the whole prompt")
            hit = None
        if metrics is not None:  # the server's own prefix-cache counters, in prompt tokens
            metrics.cache_queries.inc(len(group[0].prompt))
            metrics.cache_hits.inc(hit.n_tokens if hit else 0)
        if hit is not None:
            for s, state in zip(group, hit.states, strict=True):
                s.state, s.n_prefilled, s.n_cached = state, hit.n_tokens, hit.n_tokens
            total += hit.n_tokens
        for s in group:
            s.snap_at = kv.snapshot_points(len(s.prompt), s.n_prefilled)
    return total


def chunk_limit(s: Any) -> int | None:
    """Tokens this sequence may prefill in its next chunk before reaching a snapshot point."""
    for p in getattr(s, "snap_at", ()):
        if p > s.n_prefilled:
            return p - s.n_prefilled
    return None


def snapshot_prompt(kv: StateCache | None, s: Any, n_fed: int) -> None:
    """In the engine thread, right after a step that brought s to n_fed prompt tokens."""
    if kv is not None and n_fed in getattr(s, "snap_at", ()):
        _safe(kv, s.prompt, s)


def snapshot_answer(kv: StateCache | None, s: Any) -> None:
    """After s finished: its state has consumed the prompt and all but the last generated token."""
    if kv is not None and s.state is not None:
        _safe(kv, list(s.prompt) + list(s.generated), s)


def _safe(kv: StateCache, tokens: list[int], s: Any) -> None:
    try:
        kv.snapshot(tokens, s.state, getattr(s, "session", None), getattr(s, "kv_tenant", ""))
    except Exception:
        log.exception("state snapshot failed (ignored)")
