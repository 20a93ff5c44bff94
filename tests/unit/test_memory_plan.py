"""Device memory planning (engine/runtime/memory_plan.py): CPU only, nothing is loaded onto a GPU."""

from __future__ import annotations

import math

import pytest

from engine.checkpoint import tiny_model as T
from engine.checkpoint.reader import SAFETENSORS_DTYPES, Checkpoint, scale_name
from engine.model.base import state_bytes_per_token
from engine.model.config import load_config, parse_config
from engine.parallel.shard import ShardingError, ShardPlan
from engine.runtime import memory_plan as mp
from engine.runtime.engine import DEFAULT_CKPT

GB = 10**9
GIB = 1 << 30
H200 = 141 * GB
SMALL = dict(layers=4, hidden=128, heads=8, head_dim=64, rope_dim=16, q_lora=64, o_groups=2, o_lora=64,
             experts=8, topk=2, moe_inter=64, vocab=1024, index_heads=16, index_head_dim=32,
             engram_head_dim=32, engram_vocab=300)


def _open(path):
    cfg = load_config(path)
    return cfg, Checkpoint(path, block_size=cfg.weight_block_size)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("memplan")
    v4 = dict(SMALL, o_lora=128)  # V4's 128x128 FP8 blocks: wo_a's group rows must cover whole blocks
    return {"v41": T.write_tiny_model(root / "v41", "v41", seed=1, **SMALL),
            "v4": T.write_tiny_model(root / "v4", "v4", seed=1, **v4)}


def _stored(ckpt, name: str) -> int:
    t = ckpt.raw(name)
    quantized = t.dtype in ("F8_E4M3", "I8", "U8")  # a bf16 / f32 weight ignores any .scale beside it
    return t.array.nbytes + (ckpt.raw(scale_name(name)).array.nbytes if quantized else 0)


def _check_split(cfg, ckpt, sizes=(1, 2, 4, 8)):
    full = mp.weight_bytes(cfg, ckpt, 1)[0]
    for name, (stored, _dev) in full.tensors.items():  # TP1 holds every tensor whole, as stored
        assert stored == _stored(ckpt, name), name
    for n in sizes:
        ranks = mp.weight_bytes(cfg, ckpt, n)
        for name, (stored, _dev) in full.tensors.items():
            got = [r.tensors.get(name, (0, 0))[0] for r in ranks]
            if name.endswith("attn.wo_b.weight"):  # ranks inside one output group share its columns
                want = [stored * len(ShardPlan.make(cfg, r, n).head_groups(cfg)) // cfg.o_groups for r in range(n)]
                assert got == want, name
            elif all(g == stored for g in got):
                pass  # replicated: whole on every rank
            else:
                assert sum(got) == stored, (name, n, got)  # split: the slices add up to the tensor
        # replicated + split: each rank holds exactly its share, the engram tables stay on the host
        assert all(r.host == full.host for r in ranks)
        assert sum(r.device_total for r in ranks) >= full.device_total
        routed = sum(r.device.get("routed experts", 0) for r in ranks)
        assert routed == full.device["routed experts"]
    return full


def test_demo_v41_split_sums_to_checkpoint():
    cfg, ckpt = _open(DEFAULT_CKPT)
    full = _check_split(cfg, ckpt)
    # Engram tables stay in host memory in their stored format (with their scales when FP8)
    assert full.host["engram tables (host)"] == sum(_stored(ckpt, f"layers.{i}.engram.embed.weight")
                                                   for i in cfg.engram_layer_ids)
    # every stored byte is counted somewhere (gate.bias_vl is not read, nor a bf16 table's scales)
    read = {n for n in ckpt.names() if not n.endswith((".gate.bias_vl", "engram.embed.scale"))}
    total = sum(ckpt.raw(n).array.nbytes for n in read)
    linear = sum(s for s, _ in full.tensors.values())
    assert linear <= total and total - linear < 0.05 * total


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_tiny_model_split_and_specs_agree(tiny, arch):
    cfg, ckpt = _open(tiny[arch])
    _check_split(cfg, ckpt, (1, 2, 4, 8) if arch == "v41" else (1, 2, 4))
    if arch == "v4":  # one 64-row head per rank is not a whole 128-row FP8 block: the load would fail too
        with pytest.raises(ShardingError):
            mp.plan_memory(cfg, ckpt, 8, 1 * GIB, 1, 1024)
    # the planner gives the same numbers from the tensor specs as from the written checkpoint
    raw = __import__("json").loads((tiny[arch] / "config.json").read_text())
    specs = T.tensor_specs(raw)
    for n in (1, 4):
        a = mp.plan_memory(cfg, ckpt, n, 1 * GIB, 4, 4096)
        b = mp.plan_memory(parse_config(raw), specs, n, 1 * GIB, 4, 4096)
        assert [(r.weights, r.host, r.state, r.workspace) for r in a.ranks] == \
               [(r.weights, r.host, r.state, r.workspace) for r in b.ranks]


def test_state_matches_the_model_formula():
    from engine.runtime.runner import ModelRunner

    cfg, ckpt = _open(DEFAULT_CKPT)
    m = ModelRunner(cfg, ckpt, __import__("engine.runtime.engine", fromlist=["make_ops"]).make_ops("numpy"),
              DEFAULT_CKPT / "tokenizer.json")
    per_token, fixed = m.resident_state_bytes_per_token()
    assert mp.state_bytes(cfg, 1000) == math.ceil(fixed + 1000 * per_token)
    p = mp.plan_memory(cfg, ckpt, 2, 1 * GIB, 3, 1000)
    assert all(r.state == 3 * mp.state_bytes(cfg, 1000) for r in p.ranks)


# ---------------------------------------------------------------------------------------------
# V4.1-Flash shapes, from specs (nothing written)

flash_config = T.flash_config


def flash_specs(c: dict) -> list:
    # V4.1 ships an fp32 head (DESIGN.md); tensor_specs writes bf16 for the tiny models
    return [T.TensorSpec(s.name, "f32", s.shape) if s.name == "head.weight" else s for s in T.tensor_specs(c)]


@pytest.fixture(scope="module")
def flash():
    c = flash_config()
    cfg, specs = parse_config(c), flash_specs(c)
    return cfg, specs, {n: mp.weight_bytes(cfg, specs, n) for n in (1, 4, 8)}


def test_v41_flash_does_not_fit_one_h200(flash, capsys):
    cfg, specs, w = flash
    stored = sum(math.prod(sh) * SAFETENSORS_DTYPES[dt].itemsize
                 for s in specs for _, dt, sh in T.stored_tensors(s, (32, 32)))
    assert 455 * GIB < stored < 480 * GIB  # ~475 GiB, the DSpark layers included
    host = w[1][0].host_total
    assert 185 * GIB < host < 195 * GIB  # Engram: two ~384M-row FP8 tables
    plans = {n: mp.plan_memory(cfg, specs, n, H200, 1, 1 << 20, weights=w[n]) for n in (1, 4, 8)}
    assert not plans[1].fits and plans[1].worst.weights_total > H200
    assert plans[4].fits and plans[8].fits
    assert 30 * GIB < plans[8].worst.weights_total < 40 * GIB
    # a running sequence holds float32 rows on the device (plus growth headroom): ~7.8 GiB at 1M
    # tokens, where its stored form (FP8 / FP4, what the host keeps between turns) is ~0.89 GiB
    assert 7.5 * GIB < plans[8].state_per_seq < 8.2 * GIB
    per_token, fixed = state_bytes_per_token(cfg)
    assert 0.8 * GIB < fixed + per_token * (1 << 20) < 0.9 * GIB  # ~890 B/token + ~2.6 MiB of rings
    with capsys.disabled():
        for n, p in plans.items():
            r = p.worst
            print(f"\nV4.1-Flash TP{n}: weights {r.weights_total / GIB:.2f} GiB/rank, state per 1M-token "
                  f"sequence {p.state_per_seq / GIB:.3f} GiB, workspace {r.workspace / GIB:.2f} GiB, "
                  f"host {p.host_bytes / GIB:.1f} GiB")
    with pytest.raises(mp.MemoryPlanError) as e:
        mp.check(plans[1])
    msg = str(e.value)
    assert "does not fit 1 GPU" in msg and "routed experts" in msg and "4 GPUs" in msg


def test_error_names_consumers_and_suggestions():
    cfg, ckpt = _open(DEFAULT_CKPT)
    p = mp.plan_memory(cfg, ckpt, 1, 2 * GIB, 1024, 65536)
    assert not p.fits
    with pytest.raises(mp.MemoryPlanError) as e:
        mp.check(p)
    msg = str(e.value)
    assert "state (1024 seqs x 65536 tokens)" in msg
    assert "--max-batch" in msg and "--max-model-len" in msg
    assert "--gpus" not in msg  # the state is replicated on every rank: more GPUs would not help
    n = int(msg.split("--max-batch ")[1].split()[0])
    assert mp.plan_memory(cfg, ckpt, 1, 2 * GIB, n, 65536).fits
    assert not mp.plan_memory(cfg, ckpt, 1, 2 * GIB, n + 1, 65536).fits
    assert mp.check(mp.plan_memory(cfg, ckpt, 1, 2 * GIB, n, 65536)).fits
    table = p.summary()
    assert "rank" in table and "NO" in table and "workspace" in table


def test_max_sequences_monotone_in_context():
    cfg, ckpt = _open(DEFAULT_CKPT)
    w = mp.weight_bytes(cfg, ckpt, 2)
    counts = [mp.max_sequences(cfg, ckpt, 2, 16 * GIB, c, weights=w) for c in (1024, 8192, 65536, 262144, 1 << 20)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] > 0
    assert mp.max_sequences(cfg, ckpt, 2, 10 << 20, 1024, weights=w) == 0  # not even the weights fit
    assert mp.max_sequences(cfg, ckpt, 1, 4 * GIB, 1024, workspace_bytes=0, limit=64) == 64


def test_parse_gpus():
    assert mp.parse_gpus("0,1,2,3") == [0, 1, 2, 3]
    assert mp.parse_gpus([2]) == [2] and mp.parse_gpus(1) == [1] and mp.parse_gpus(None) is None
    for bad in ("a", "0,0", "", "-1"):
        with pytest.raises(ValueError):
            mp.parse_gpus(bad)


def test_engine_load_with_gpus_checks_memory_first(monkeypatch):
    from engine.runtime.engine import Engine

    monkeypatch.setattr(mp, "gpu_free_bytes", lambda ids: [64 << 20] * len(ids))
    with pytest.raises(mp.MemoryPlanError, match="does not fit 1 GPU"):
        Engine.load(None, gpus="0", max_seqs=4, max_context=4096)
    monkeypatch.setattr(mp, "gpu_free_bytes", lambda ids: [80 * GB] * len(ids))
    import engine.parallel.gpu

    class Reached(Exception):
        pass

    def sharded(cfg, ckpt, devices, tok, expert_split, make_ops=None):  # stop before touching GPUs (none in CI)
        raise Reached(devices, expert_split)

    monkeypatch.setattr(engine.parallel.gpu, "GpuTP", sharded)
    with pytest.raises(Reached) as got:  # the plan fits two GPUs: one tensor-parallel rank on each
        Engine.load(None, gpus="0,1", max_seqs=4, max_context=4096)
    assert got.value.args == ([0, 1], "ep")
    with pytest.raises(Reached) as got:
        Engine.load(None, gpus="0,1", max_seqs=4, max_context=4096, expert_split="width")
    assert got.value.args == ([0, 1], "width")


@pytest.mark.parametrize("n", [2, 4])
def test_width_split_experts_counted(tiny, n):
    """Routed experts split by width: every rank holds a slice of every expert, the slices add up
    to the whole experts, and no rank holds more than its share (rounded up to 32 columns)."""
    cfg, ckpt = _open(tiny["v41"])
    whole = mp.weight_bytes(cfg, ckpt, 1)[0].device["routed experts"]
    ranks = [r.device.get("routed experts", 0) for r in mp.weight_bytes(cfg, ckpt, n, "width")]
    ep = [r.device.get("routed experts", 0) for r in mp.weight_bytes(cfg, ckpt, n)]
    assert sum(ranks) == whole == sum(ep)
    assert max(ranks) <= whole * (-(-cfg.moe_intermediate_size // (32 * n)) * 32) / cfg.moe_intermediate_size


def test_draft_layers_plan_a_verify_steps_rows(tiny, tmp_path):
    """With DSpark draft layers, serve speculates by default: a decode step is a verify step of
    block_size + 1 rows a sequence, and the workspace's per-row terms count them."""
    with_draft = T.write_tiny_model(tmp_path / "draft", "v41", seed=1, draft=True, **SMALL)
    plain_cfg, draft_cfg = load_config(tiny["v41"]), load_config(with_draft)
    rows = mp.decode_rows(draft_cfg, 8)
    assert mp.decode_rows(plain_cfg, 8) == 8 and rows == 8 * (draft_cfg.dspark_block_size + 1)
    plain = mp.workspace_bytes(plain_cfg, ShardPlan.make(plain_cfg), 8, 4096)
    draft = mp.workspace_bytes(draft_cfg, ShardPlan.make(draft_cfg), 8, 4096)
    assert draft["logits"] == rows * draft_cfg.vocab_size * 4 == plain["logits"] * (rows // 8)
    assert draft["activations"] > plain["activations"]


def test_graph_memory_counts_the_rows_decode_steps_can_have(tiny, tmp_path, monkeypatch):
    """The captured graphs are counted for the 8 (Settings.graph_buckets) largest row counts a
    decode step of max_seqs sequences can have (with draft layers a verify step's block_size + 1
    rows a sequence), never above MAX_GRAPH_ROWS (192: a full default verify step of 32 x 6)."""
    monkeypatch.delenv("DSUF_GRAPH_BUCKETS", raising=False)
    with_draft = T.write_tiny_model(tmp_path / "draft", "v41", seed=1, draft=True, **SMALL)
    assert load_config(with_draft).dspark_block_size == 5
    # (checkpoint, max_seqs) -> rows counted: 3+2+1; 192+...+185; 24+...+17; 192+...+185
    for ckpt, max_seqs, rows in ((tiny["v41"], 3, 6), (tiny["v41"], 500, 1508), (with_draft, 4, 164),
                                 (with_draft, 32, 1508)):
        cfg = load_config(ckpt)
        plan = ShardPlan.make(cfg)
        assert mp.workspace_bytes(cfg, plan, max_seqs, 4096)["graphs"] == rows * mp.graph_bytes_per_row(cfg, plan)


def test_gpu_prefill_chunk_is_the_largest_that_fits(monkeypatch):
    """Engine.load with --gpus and no prefill chunk takes the largest of GPU_PREFILL_CHUNKS whose plan
    fits (the indexer's scores grow with chunk x context); a given chunk is planned as given."""
    from engine.runtime import engine as E

    cfg, ckpt = _open(DEFAULT_CKPT)
    w = mp.weight_bytes(cfg, ckpt, 1)

    def least_bytes(chunk: int) -> int:  # the fewest free bytes (in MiB) at which a 4 x 65536 plan fits
        def short(mib: int) -> bool:
            return not mp.plan_memory(cfg, ckpt, 1, mib << 20, 4, 65536, prefill_chunk=chunk, weights=w).fits

        return (mp._last_true(short, 1, 1 << 20) + 1) << 20

    need = {c: least_bytes(c) for c in E.GPU_PREFILL_CHUNKS}
    assert [need[c] for c in E.GPU_PREFILL_CHUNKS] == sorted(need.values(), reverse=True)
    assert need[16384] > need[8192]
    for free, want in ((need[16384], 16384), (need[8192], 8192), (need[512], 512)):
        monkeypatch.setattr(mp, "gpu_free_bytes", lambda ids, free=free: [free] * len(ids))
        ids, plan = E._plan_gpus(cfg, ckpt, "0", 4, 65536, None)
        assert (ids, plan.prefill_chunk, plan.fits) == ([0], want, True)
    monkeypatch.setattr(mp, "gpu_free_bytes", lambda ids: [need[16384]] * len(ids))
    _, plan = E._plan_gpus(cfg, ckpt, "0", 4, 65536, 2048)
    assert plan.prefill_chunk == 2048
    monkeypatch.setattr(mp, "gpu_free_bytes", lambda ids: [need[512] - (64 << 20)] * len(ids))
    with pytest.raises(mp.MemoryPlanError, match="does not fit"):
        E._plan_gpus(cfg, ckpt, "0", 4, 65536, None)


def test_prompt_attention_scores_are_counted_under_exact_numerics_only(tiny):
    """Under deepseek numerics a prompt chunk's attention is one pass with no score buffer
    (kernels/attention.cu attn_sparse_bf); exact numerics' tensor-core attention keeps one. The plan
    (and the chunk it picks) follows the forward's numerics."""
    cfg = load_config(tiny["v41"])
    shard = ShardPlan.make(cfg)
    exact = mp.workspace_bytes(cfg, shard, 4, 4096, prefill_chunk=2048, numerics="exact")
    deep = mp.workspace_bytes(cfg, shard, 4, 4096, prefill_chunk=2048, numerics="deepseek")
    assert exact["attend_tc"] > 0 and deep["attend_tc"] == 0
    assert {k: v for k, v in exact.items() if k != "attend_tc"} == {k: v for k, v in deep.items() if k != "attend_tc"}
    ckpt = Checkpoint(tiny["v41"])
    pe = mp.plan_memory(cfg, ckpt, 1, 8 * GIB, 4, 4096, prefill_chunk=2048, numerics="exact")
    pd = mp.plan_memory(cfg, ckpt, 1, 8 * GIB, 4, 4096, prefill_chunk=2048, numerics="deepseek")
    assert pe.worst.workspace - pd.worst.workspace == exact["attend_tc"]
    # a GPU between the two needs (the reserve is a fraction of the GPU): exact numerics must take a
    # smaller chunk than deepseek's
    w = mp.weight_bytes(cfg, ckpt, 1)
    need = {}
    for n in ("exact", "deepseek"):
        r = mp.plan_memory(cfg, ckpt, 1, 8 * GIB, 4, 4096, prefill_chunk=2048, weights=w, numerics=n).worst
        need[n] = (r.total - r.reserve) / (1 - mp.RESERVE_FRACTION)
    budget = int((need["exact"] + need["deepseek"]) / 2)
    chunks = (512, 2048)
    picked = {n: mp.plan_largest_chunk(cfg, ckpt, 1, budget, 4, 4096, chunks, weights=w, numerics=n).prefill_chunk
              for n in ("exact", "deepseek")}
    assert picked == {"exact": 512, "deepseek": 2048}
