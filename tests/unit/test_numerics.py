"""`--numerics deepseek|exact`: the flag on run / serve / bench, which linear computes how
(engine/model/numerics.py), and DeepseekOps' quantization points (engine/ops/deepseek_ops.py).
Agreement with DeepSeek's own reference: tests/reference/test_deepseek_numerics.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import formats
from engine.checkpoint.reader import Checkpoint
from engine.checkpoint.tiny_model import write_tiny_model
from engine.model.config import load_config
from engine.model.numerics import BF16, F32, QUANT
from engine.ops.deepseek_ops import DeepseekOps, LinearWeight
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.engine import Engine, make_ops
from engine.runtime.runner import ModelRunner as Model
from engine.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models" / "demo-v41"
IDS = [5, 17, 101, 33, 250, 7, 64, 12]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "dsuf.py"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("numerics", ["exact", "deepseek"])
def test_run_numerics_is_the_api_greedy_of_those_ops(numerics: str) -> None:
    r = _cli("run", "--numerics", numerics, "--prompt-ids", ",".join(map(str, IDS)), "--print-ids",
             "--max-tokens", "4", "--speculative", "off")
    assert r.returncode == 0, r.stderr
    got = [int(t) for t in r.stdout.strip().splitlines()[-1].split(",")]
    eng = Engine.load(DEMO, settings=Settings(numerics=numerics))
    assert type(eng.model.ops) is (DeepseekOps if numerics == "deepseek" else NumpyOps)
    assert got == eng.generate(IDS, 4, stop_at_eos=False, speculative=False)[: len(got)]


def test_numerics_setting_is_checked_and_defaults_to_deepseek() -> None:
    assert Settings().numerics == "deepseek"
    assert type(make_ops("numpy")) is DeepseekOps and type(make_ops("numpy", Settings(numerics="exact"))) is NumpyOps
    with pytest.raises(ValueError, match="numerics"):
        Settings(numerics="fp8")


def test_linears_use_what_the_reference_declares(tmp_path) -> None:
    """FP8 / FP4 weights quantize the activation; wo_a, indexer wk / weights_proj and the ratio-1
    compressor are bf16 though stored FP8 / bf16; the ratio-2 compressor, gate and head fp32."""
    ck = write_tiny_model(tmp_path / "t", arch="v41", seed=1, layers=4)
    cfg = load_config(ck)
    ops = DeepseekOps()
    m = Model(cfg, Checkpoint(ck, block_size=cfg.weight_block_size), ops, ck / "tokenizer.json")
    w = m.w

    def use(x) -> str:
        assert isinstance(x, LinearWeight)
        if x.quant:
            return QUANT
        return BF16 if x.bf16_out is True else F32 if x.bf16_out is False else "mixed"

    a1, a2 = w.layers[1].attn, w.layers[2].attn  # ratio 2 and ratio 1 KV sources, both index sources
    assert cfg.compress_ratios[1] == 2 and cfg.compress_ratios[2] == 1
    assert [use(x) for x in (a1.wq_b, a1.wo_b, a1.indexer.wq_b, w.layers[1].ffn.experts[0][0])] == [QUANT] * 4
    assert [use(x) for x in (a1.wo_a, a1.indexer.wk, w.layers[1].engram.wkv)] == [BF16, BF16, QUANT]
    assert [use(x) for x in (w.head, w.layers[0].ffn.gate)] == [F32, F32]
    # x_proj: comp_kv, comp_gate (fp32 at ratio 2), idx_w (bf16) stacked: bf16 output rows per part
    (stack1, parts1), = a1.x_proj
    assert use(stack1) == "mixed" and [p for p, *_ in parts1] == ["comp_kv", "comp_gate", "idx_w"]
    assert stack1.bf16_out.tolist() == [False] * (2 * cfg.head_dim) + [True] * cfg.index_n_heads
    (stack2, _), = a2.x_proj  # ratio 1: comp_kv and idx_w both bf16
    assert use(stack2) == BF16


def test_fp8_linear_quantizes_the_activation_per_32_with_pow2_scales() -> None:
    rng = np.random.default_rng(0)
    x = formats.round_bf16(rng.standard_normal((3, 64)).astype(np.float32) * np.float32(3.0))
    x[1, :32] *= np.float32(1e-3)  # a block of its own scale
    w = formats.round_bf16(rng.standard_normal((5, 64)).astype(np.float32))
    ops = DeepseekOps()
    y = ops.linear(x, LinearWeight(w, True, True))
    blocks = x.reshape(3, 2, 32)
    scale = formats.pow2_ceil_f32(np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)) / np.float32(448.0))
    q = formats.fp8_e4m3_to_f32(formats.f32_to_fp8_e4m3(blocks / scale[..., None])) * scale[..., None]
    want = formats.round_bf16(np.einsum("ti,oi->to", q.reshape(3, 64), w))
    np.testing.assert_array_equal(y, want)
    assert not np.array_equal(y, formats.round_bf16(x @ w.T))  # the quantization did something
    # a bf16 linear: no activation quantization, the output rounded to bf16
    np.testing.assert_array_equal(ops.linear(x, LinearWeight(w, False, True)),
                                  formats.round_bf16(np.einsum("ti,oi->to", x, w)))


def test_round_bf16_is_the_bf16_round_trip() -> None:
    x = np.random.default_rng(1).standard_normal(10_000).astype(np.float32) * np.float32(1e3)
    x[:3] = [np.inf, -np.inf, 0.0]
    np.testing.assert_array_equal(formats.round_bf16(x), formats.bf16_to_f32(formats.f32_to_bf16(x)))


def test_serve_computes_in_the_numerics_it_is_given(tmp_path) -> None:
    """A real `dsuf.py serve --numerics deepseek` (demo model, numpy) completes a prompt with the
    tokens DeepseekOps gives, which differ from exact numerics' on this prompt."""
    import socket
    import time
    import urllib.request

    from openai import OpenAI

    prompt, n = "class Stack:\n    def", 20
    want = {}
    for numerics in ("exact", "deepseek"):
        eng = Engine.load(DEMO, settings=Settings(numerics=numerics))
        ids = [eng.tokenizer.bos_id] + eng.tokenizer.encode(prompt)  # (the server starts a plain prompt so)
        want[numerics] = eng.tokenizer.decode(eng.generate(ids, n, stop_at_eos=False, speculative=False))
    assert want["exact"] != want["deepseek"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = open(tmp_path / "serve.err", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "dsuf.py", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--numerics", "deepseek", "--speculative", "off"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.err").read_text()[-2000:]
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        r = client.completions.create(model="deepseek-v4.1-flash", prompt=prompt, max_tokens=n, temperature=0)
        assert r.choices[0].text == want["deepseek"]
    finally:
        proc.terminate()
        proc.wait(30)
        err.close()


@pytest.mark.parametrize("ops", [NumpyOps(), DeepseekOps()], ids=["exact", "deepseek"])
def test_rope_in_place_then_wo_a_is_the_copying_rope(ops) -> None:
    """The attention output's RoPE undone in place (its other channels not rounded there) and then
    wo_a, which takes its input as linear() does: the same result as the copying rope before it."""
    rng = np.random.default_rng(3)
    t, g, heads, d = 5, 2, 2, 64
    x = rng.standard_normal((t, g * heads, d)).astype(np.float32)
    ang = rng.standard_normal((t, 8)).astype(np.float32)
    c, s = np.cos(ang), np.sin(ang)
    w = rng.standard_normal((g * 16, heads * d)).astype(np.float32) * np.float32(0.05)
    wo_a = LinearWeight(w, False, True) if isinstance(ops, DeepseekOps) else w
    copied = ops.rope(x, c, s, inverse=True)
    y = x.copy()
    assert ops.rope(y, c, s, inverse=True, in_place=True) is y
    np.testing.assert_array_equal(y[..., -16:], copied[..., -16:])
    np.testing.assert_array_equal(y[..., :-16], x[..., :-16])
    np.testing.assert_array_equal(ops.grouped_linear(y.reshape(t, g, -1), wo_a, g),
                                  ops.grouped_linear(copied.reshape(t, g, -1), wo_a, g))
