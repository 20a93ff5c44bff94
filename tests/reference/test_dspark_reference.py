"""The numpy DSpark draft equals DeepSeek's own V4.1 reference draft forward (fixtures in
tests/fixtures/dspark, made by tools/dev/gen_dspark_fixtures.py from the reference's float32 run
with its FP8 window rounding kept: `statequant_f32`).

Per case: the prompt's prefill collects the target layers' inputs, the draft windows absorb them,
a block is drafted right after the prompt; then one decode step of the main model's token and the
block after it. Compared: the target inputs, the main token, every draft position's logits (with
the Markov bias), the confidence scores and the greedy draft tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.checkpoint.reader import Checkpoint
from engine.model.config import load_config
from engine.model.dspark import DSpark, DSparkSpec
from engine.ops.numpy_ops import NumpyOps
from engine.runtime.runner import ModelRunner

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "dspark"
CASES = sorted(p.name for p in FIX.iterdir() if (p / "expected.npz").is_file()) if FIX.is_dir() else []
MODE = "statequant_f32"
RTOL = 1e-4  # relative to the largest magnitude, as tests/reference/test_reference_logits.py


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


def read_tensors(path: Path, prefix: str = "mtp.") -> dict:
    """The checkpoint's tensors under prefix as float32 (bf16 / f32 as stored; until the loader
    reads `mtp.*`, the checkpoint reader skips them)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    out = {}
    for name, e in json.loads(raw[8:8 + n]).items():
        if not name.startswith(prefix):
            continue
        a, b = e["data_offsets"]
        buf = raw[8 + n + a:8 + n + b]
        if e["dtype"] == "BF16":
            x = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif e["dtype"] == "F32":
            x = np.frombuffer(buf, np.float32)
        else:
            raise ValueError(f"{name}: {e['dtype']}")
        out[name] = x.reshape(e["shape"])
    return out


def draft_layers(tensors: dict, spec: DSparkSpec, cfg, ops) -> list:
    """The draft layers' weights from the checkpoint's `mtp.*` tensors (the reference's names), in
    the structure engine/model/dspark.py reads."""

    def t(name):
        return tensors[name].astype(np.float32)

    def lin(name):
        return ops.prepare(t(name))

    layers = []
    for i in range(spec.n_layers):
        p = f"mtp.{i}."
        a = p + "attn."
        attn = SimpleNamespace(
            qkv=[(lin(a + "wq_a.weight"), (("q_lat", 0, cfg.q_lora_rank),)),
                 (lin(a + "wkv.weight"), (("kv_lat", 0, cfg.head_dim),))],
            q_norm=t(a + "q_norm.weight"), kv_norm=t(a + "kv_norm.weight"), wq_b=lin(a + "wq_b.weight"),
            sinks=t(a + "attn_sink"), wo_a=lin(a + "wo_a.weight"), wo_b=lin(a + "wo_b.weight"),
            wo_groups=cfg.o_groups)
        ffn = SimpleNamespace(
            gate=lin(p + "ffn.gate.weight"), gate_bias=t(p + "ffn.gate.bias"), tid2eid=None,
            experts=[tuple(lin(f"{p}ffn.experts.{e}.w{k}.weight") for k in (1, 2, 3))
                     for e in range(spec.n_routed_experts)],
            shared_experts=tuple(lin(f"{p}ffn.shared_experts.w{k}.weight") for k in (1, 2, 3)))
        hc = {s: tuple(t(f"{p}hc_{s}_{k}") for k in ("fn", "scale", "base")) for s in ("attn", "ffn")}
        opt = {k: (t(p + n) if p + n in tensors else None) for k, n in (
            ("main_proj", "main_proj.weight"), ("main_norm", "main_norm.weight"), ("norm", "norm.weight"),
            ("markov_embed", "markov_head.embed.weight"), ("markov_head", "markov_head.head.weight"),
            ("confidence", "confidence_head.proj.weight"))}
        layers.append(SimpleNamespace(attn_norm=t(p + "attn_norm.weight"), ffn_norm=t(p + "ffn_norm.weight"),
                                      hc_attn=hc["attn"], hc_ffn=hc["ffn"], attn=attn, ffn=ffn, engram=None, **opt))
    return layers


@pytest.fixture(scope="module", params=CASES)
def case(request):
    d = FIX / request.param
    cfg = load_config(d)
    ops = NumpyOps()
    runner = ModelRunner(cfg, Checkpoint(d, block_size=cfg.weight_block_size), ops)
    spec = DSparkSpec.from_config(cfg, json.loads((d / "config.json").read_text()))
    dsp = DSpark(runner.model, spec, draft_layers(read_tensors(d / "model.safetensors"), spec, cfg, ops))
    z = np.load(d / "expected.npz")
    return request.param, runner, dsp, {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith(MODE + ".")}, z


def test_target_inputs_and_main_x_match_reference(case) -> None:
    name, runner, dsp, ref, z = case
    targets = dsp.targets
    runner.forward([runner.new_state()], [z["input_ids"].tolist()], targets=targets)
    got = np.concatenate([targets[i] for i in dsp.spec.target_layer_ids], axis=1)
    assert got.shape == ref["main_hidden"].shape
    assert _rel(got, ref["main_hidden"]) < RTOL, name


def test_draft_after_prefill_and_after_a_decode_step_match_reference(case) -> None:
    name, runner, dsp, ref, z = case
    st, ds = runner.new_state(), dsp.new_state()
    targets = dsp.targets
    logits = runner.forward([st], [z["input_ids"].tolist()], targets=targets)[0]
    tok = int(np.argmax(logits))
    assert tok == ref["main_token"][0]
    dsp.absorb(ds, targets)
    drafts = [dsp.draft(ds, tok)]
    assert ds.position == z["input_ids"].size  # drafting reads the state, never grows it
    targets = dsp.targets
    logits = runner.forward([st], [[tok]], targets=targets)[0]
    tok2 = int(np.argmax(logits))
    assert tok2 == ref["main_token"][1]
    dsp.absorb(ds, targets)
    drafts.append(dsp.draft(ds, tok2))
    for k, (d, first) in enumerate(zip(drafts, (tok, tok2), strict=True)):
        assert _rel(d.logits, ref["draft_logits"][k]) < RTOL, f"{name} block {k}: logits"
        assert _rel(d.confidence, ref["confidence"][k]) < RTOL, f"{name} block {k}: confidence"
        assert [first, *d.tokens.tolist()] == ref["draft_ids"][k].tolist(), f"{name} block {k}: tokens"
        np.testing.assert_allclose(d.probs.sum(axis=1), 1.0, rtol=1e-5)
