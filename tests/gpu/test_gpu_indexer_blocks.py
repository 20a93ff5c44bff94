"""A prompt chunk's indexer selection (engine/model/v41.py Indexer.select) on the GPU in blocks of
query rows equals the whole chunk's in one block, bit for bit: the top-k and candidate masks of a
candidate source, a layer it filters and one before it. Random queries and keys, the block size
forced tiny through limits.INDEXER_BLOCK_BYTES (CupyOps.indexer_rows) or directly. Skipped where
CuPy or a GPU is absent (CI)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gpu_cases import GPU, REF, cp, rnd

from engine.model import v41
from engine.model.batch import Projected, Seq
from engine.model.layers import Attention
from engine.ops.gpu import attention as gpu_attention
from engine.ops.gpu import limits
from engine.ops.gpu.attention import ITC_MIN_QUERIES, _indexer_tc_shape
from engine.state.sequence import F32 as NO_CODEC
from engine.state.sequence import FP4_UE8M0_32

CAND = 2  # the candidate source layer; layer 3 filters by its blocks, layer 1 comes before it


class _Attn:
    """What Indexer.select reads of its attention layer."""

    causal_cols = Attention.causal_cols

    def __init__(self, cfg, li: int, ratio: int, codec: int) -> None:
        self.ops, self.cfg, self.li, self.ratio, self._codec = GPU, cfg, li, ratio, codec

    def codec(self, field: str) -> int:
        return self._codec


def _cfg(h: int, dh: int):
    return SimpleNamespace(index_n_heads=h, index_head_dim=dh, index_topk=40, candidate_block_size=8,
                           candidate_topk_blocks=20, candidate_source_layer_id=CAND,
                           kv_group_source=lambda li: 0)


def _select(cfg, keys, q, w, pos, ratio: int, codec: int) -> list:
    """Each layer's published (top-k, candidates), on the host."""
    s = Seq(SimpleNamespace(layers=[SimpleNamespace(idx_keys=keys)]), slice(0, q.shape[0]), pos)
    out = []
    for li in (CAND, CAND + 1, CAND - 1):
        v41.Indexer(_Attn(cfg, li, ratio, codec), None).select(Projected(idx_q=q, idx_w=w), s)
        out.append([cp.asnumpy(s.shared["topk"]), cp.asnumpy(s.shared["cand"])])
    return out


@pytest.mark.parametrize("h,dh,exact", [(32, 64, False), (32, 64, True), (16, 32, False)])
@pytest.mark.parametrize("ratio", [1, 2])
def test_select_in_row_blocks_equals_one_block(h, dh, exact, ratio, monkeypatch):
    s_rows, n = 100, 700
    cfg = _cfg(h, dh)
    qh, kh, wh = rnd(s_rows, h, dh), rnd(n, dh), rnd(s_rows, h)
    if exact:  # on the indexer keys' MXFP4 grid, which the one-term tensor-core kernel relies on
        qh, kh = REF.fake_quant_fp4(qh, 32), REF.fake_quant_fp4(kh, 32)
    q, k, w = cp.asarray(qh), cp.asarray(kh), cp.asarray(wh)
    # the chunk's last rows see every key, its first ones fewer (a prompt chunk over its own keys)
    pos = np.arange(s_rows) + (n * ratio - s_rows)
    codec = FP4_UE8M0_32 if exact else NO_CODEC
    calls, real = [], GPU.indexer_scores

    def scores(q, *args, **kw):  # the rows of each block scored
        calls.append(q.shape[0])
        return real(q, *args, **kw)

    monkeypatch.setattr(GPU, "indexer_scores", scores)
    whole = _select(cfg, k, q, w, pos, ratio, codec)
    assert calls == [s_rows] * 3  # one block a layer: the chunk's scores fit the budget
    top, cands = whole[0]
    assert (top.sum(axis=1) <= cfg.index_topk).all() and top.sum(axis=1).max() == cfg.index_topk
    assert not cands.all()  # the candidate blocks leave entries out: the filter matters
    assert not np.array_equal(whole[1][0], whole[2][0])  # and changes layer 3's top-k
    # the tensor-core kernel takes blocks of >= ITC_MIN_QUERIES rows, so blocks of at most 32 rows
    # (balanced: 25 rows each) keep every row on the chunk's own kernel; the CUDA-core kernel's
    # results do not depend on the rows beside them at all
    tc = _indexer_tc_shape(s_rows, h, dh)
    sizes = [32] if tc else [1, 5]
    for most in sizes:
        calls.clear()
        monkeypatch.setattr(limits, "INDEXER_BLOCK_BYTES", most * n * limits.INDEXER_BYTES_PER_SCORE)
        monkeypatch.setattr(gpu_attention, "indexer_wave", lambda: 1)  # (blocks of any size)
        assert GPU.indexer_rows(s_rows, n) == most
        got = _select(cfg, k, q, w, pos, ratio, codec)
        assert len(calls) == 3 * -(-s_rows // most) and max(calls) <= most
        assert not tc or min(calls) >= ITC_MIN_QUERIES
        for g, r in zip(got, whole, strict=True):
            np.testing.assert_array_equal(g[0], r[0])
            np.testing.assert_array_equal(g[1], r[1])
