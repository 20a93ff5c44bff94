"""tools/hostile.py's suite against a real server (demo model, numpy) with short timeouts: every
case gets a right answer (no wrong status, 5xx, hang or reset), the probe after each answers as
before, and a well-behaved stream running alongside keeps giving the engine's greedy answer."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import hostile  # noqa: E402
import hostile_cases  # noqa: E402

from server.app import STATE  # noqa: E402
from server.limits import Limits, check_tokens, encode_bounded  # noqa: E402
from server.protocol import APIError  # noqa: E402

CONTEXT = 1024
KEY = "hostile-key"


@pytest.fixture(scope="module")
def hardened(module_servers):
    lim = Limits(idle_timeout_s=1.5, body_timeout_s=1.5, stream_write_timeout_s=1.5, stream_buffer_bytes=256 << 10,
                 stream_sndbuf=64 << 10, max_connections=48)
    return module_servers(max_model_len=CONTEXT, max_batch=12, max_queue=12, api_key=KEY, limits=lim)


@pytest.fixture(scope="module")
def module_servers(engine):
    from tests.conftest import ServerThread

    made = []

    def make(**opts):
        s = ServerThread(engine, **opts)
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()


def _target(srv, engine) -> hostile.Target:
    return hostile.Target("127.0.0.1", srv.port, "demo-v41", KEY, idle_timeout=1.5, body_timeout=1.5,
                          write_timeout=1.5, max_connections=48, context_len=CONTEXT,
                          vocab=int(engine.config.vocab_size), capacity=24)


def test_hostile_suite(hardened, engine):
    from engine.runtime.sampling import SamplingParams
    from engine.text.chat_encoding import encode_messages

    t = _target(hardened, engine)
    # the stream alongside must give the engine's own greedy answer, not merely a stable one
    body = hostile.stream_body(t)
    ids = engine.tokenizer.encode(encode_messages(body["messages"], arch=engine.config.arch, thinking=False,
                                                  add_generation_prompt=True))
    want = engine.tokenizer.decode(engine.generate(ids, body["max_tokens"], SamplingParams(temperature=0.0),
                                                   stop_at_eos=False))
    assert hostile.stream_text(t, body) == want
    cases = hostile_cases.build_cases(t)
    assert len(cases) >= 150
    t0 = time.monotonic()
    counts = hostile.run_suite(t, cases, workers=8)
    print(hostile.summary(counts), f"in {time.monotonic() - t0:.1f} s")
    assert counts["tried"] == len(cases)
    assert not counts["failures"], [(o.result, o.group, o.name, o.detail[:200]) for o in counts["failures"]]
    assert hostile.passed(counts), hostile.summary(counts)
    assert any(o.name == "stream-never-read" for o in cases)  # cut (CUT), or it would not be right
    # nothing left behind: the cut stream's sequences were cancelled, nothing runs or waits
    sched = hardened.app[STATE].scheduler
    deadline = time.monotonic() + 10
    while (sched.running or sched.waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sched.running and not sched.waiting


def test_oversized_prompt_is_refused_before_it_is_tokenized_in_full():
    calls = []

    def encode(text: str) -> list[int]:
        calls.append(len(text))
        return list(range(len(text)))  # one token per character

    with pytest.raises(APIError) as e:
        encode_bounded(encode, "word " * 1_000_000, 1000, 1 << 16, "prompt")
    assert e.value.code == "context_length_exceeded"
    assert calls == [calls[0]] and calls[0] <= 1 << 16  # one piece was enough to know
    short = "word " * 300
    assert encode_bounded(encode, short, 2000, 1 << 16, "prompt") == list(range(len(short)))


def test_a_long_text_that_fits_is_counted_once_in_pieces():
    """check_tokens counts a long text that fits in pieces, once, and encodes nothing more: the caller
    tokenizes the whole text itself (encode_bounded, the chat template's segments)."""
    calls = []

    def encode(text: str) -> list[int]:
        calls.append(len(text))
        return list(range(len(text) // 5))  # one token per word

    text = "word " * 100_000
    assert check_tokens(encode, text, 200_000, 1 << 16, "messages") is None
    assert sum(calls) == len(text) and len(calls) > 1 and max(calls) <= 1 << 16
    calls.clear()
    assert encode_bounded(encode, text, 200_000, 1 << 16, "prompt") == list(range(len(text) // 5))
    assert sum(calls) == 2 * len(text)  # the pieces' count, then the whole text once


def test_error_messages_never_echo_unbounded_input(hardened, engine):
    t = _target(hardened, engine)
    for obj in ({"model": "m" * 50000}, {"messages": [{"role": "r" * 50000, "content": "x"}]},
                {"logit_bias": {"9" * 50000: 1}}, {"seed": int("9" * 4000)}):
        r = hostile.post(t, "/v1/chat/completions", {**hostile_cases._chat(t), **obj})
        assert 400 <= r.status < 500
        msg = json.loads(r.body)["error"]["message"]
        assert len(msg) < 300, msg


def test_tokenization_is_bounded_in_concurrency():
    """At most tokenize_threads tokenizations run at once; past tokenize_waiting large prompts
    waiting, 429; small prompts wait without that cap."""
    from server.limits import tokenize

    lim = Limits(tokenize_threads=2, tokenize_waiting=3)
    running, most = [0], [0]

    def work() -> int:
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.1)
        running[0] -= 1
        return 1

    async def go(chars: int):
        async def one():
            try:
                return await tokenize(lim, work, chars=chars)
            except APIError as e:
                return e.status

        return await asyncio.gather(*(one() for _ in range(10)))

    got = asyncio.run(go(lim.piece_chars + 1))
    assert most[0] == 2
    assert sorted(got) == [1] * 5 + [429] * 5  # 2 running + 3 waiting served, the rest refused
    most[0] = 0
    assert asyncio.run(go(lim.piece_chars)) == [1] * 10 and most[0] == 2


def test_large_bodies_are_read_a_few_at_a_time(make_server, engine):
    """A large body holds a read slot while it arrives; past the waiting bound, 429 at once."""
    srv = make_server(limits=Limits(big_body_bytes=1000, big_body_reads=1, big_body_waiting=0, body_timeout_s=3))
    t = _target(srv, engine)
    t.api_key = None
    body = json.dumps(hostile_cases._chat(t, messages=[{"role": "user", "content": "x" * 5000}])).encode()
    with hostile.connect(t) as slow:  # holds the only slot: headers and a tenth of the body
        slow.sendall(hostile.request_bytes(t, "POST", "/v1/chat/completions", body[:500],
                                           {"Content-Length": str(len(body))}))
        time.sleep(0.3)
        r = hostile.exchange(t, hostile.request_bytes(t, "POST", "/v1/chat/completions", body), 30)
        assert r.status == 429 and json.loads(r.body)["error"]["code"] == "rate_limit_exceeded"
        small = json.dumps(hostile_cases._chat(t)).encode()  # under big_body_bytes: not gated
        assert hostile.exchange(t, hostile.request_bytes(t, "POST", "/v1/chat/completions", small), 30).status == 200
        slow.sendall(body[500:])
        assert hostile.read_reply(slow, time.monotonic() + 30).status == 200
    assert hostile.exchange(t, hostile.request_bytes(t, "POST", "/v1/chat/completions", body), 30).status == 200
