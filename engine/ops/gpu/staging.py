"""A step's inputs (engine/state/decode_plan.py StepInputs) as the GPU kernels read them, in one upload.

Spans and destination rows become device addresses (int64), host arrays go up as they are; all
int64 values travel in one array and all float32 values in another. `Layout` remembers where
each field lies, so the same views can be cut from a CUDA graph's own copy of the two arrays:
a decode step's graph reads this step's tables wherever the state buffers are.

Tables (int64): "rows" [B] the address of each destination row (0: none); "spans" [B, 2]
(address of the first row, count); per layer, from the step's window blocks, `win_dst` [B] and
`attend` [B, 6] (window address, count, 0, entries address, count, 1 if the published top-k
mask row b masks them: kernels/attention.cu attention_decode).

Packing is host work (numpy): with numpy state buffers it yields their host addresses, which is how
the CPU tests check it (tests/test_staging.py).
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from engine.state.decode_plan import F32, HOST, I64, ROWS, SPANS, LayerPlan, StepInputs


def _address(buf) -> int:
    """A buffer's first byte: a CuPy array's device pointer, or a numpy array's host address."""
    data = buf.data
    return int(data.ptr) if hasattr(data, "ptr") else int(buf.ctypes.data)


class _Addresses:
    """Device addresses of Spans' first rows, each buffer checked once per step (a step's spans
    share a few buffers per sequence: its pending rows, entries and keys)."""

    def __init__(self) -> None:
        self._bufs: dict = {}  # id(buffer) -> (buffer, address, row bytes, rows)

    def _buffer(self, buf) -> tuple:
        """(buf, its address, row bytes, rows), checked once a step: C-contiguous float32 rows of a 2-D buffer."""
        got = self._bufs.get(id(buf))
        if got is None:
            if buf.dtype != np.float32 or not buf.flags.c_contiguous or buf.ndim != 2:
                raise ValueError("a staged Span must cover C-contiguous float32 rows of a 2-D buffer")
            got = self._bufs[id(buf)] = (buf, _address(buf), buf.shape[1] * 4, buf.shape[0])
        return got

    def addresses(self, spans: list) -> list[int]:
        """The address of each Span's first row (0 for None), in one loop (a step stages thousands:
        this is on the host's serial path while the device drafts)."""
        out, last, got = [], None, None
        for sp in spans:
            if sp is None or sp.buf is None:
                out.append(0)
                continue
            buf, start, n = sp
            if buf is not last:  # (a sequence's consecutive rows share a buffer)
                got = self._buffer(buf)
                last = buf
            if start + n > got[3]:
                raise ValueError("a staged Span runs past its buffer")
            out.append(got[1] + start * got[2])
        return out

    def table(self, kind: str, value: list) -> np.ndarray:
        if kind == ROWS:
            return np.array(self.addresses(value), np.int64)
        if kind == SPANS:
            tab = np.empty((len(value), 2), np.int64)
            tab[:, 0] = self.addresses(value)
            tab[:, 1] = [0 if sp is None else sp.n for sp in value]
            return tab
        raise ValueError(f"unknown staged field kind {kind!r}")


def _window_tables(inputs: StepInputs, addr: _Addresses) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's window destinations [L, B] and attention tables [L, B, 6], computed at once:
    addresses in each sequence's WindowBlock, then the group entries where the layer attends them
    (layers reading the same group under the same mask share one table of addresses)."""
    w, layers = inputs.window, inputs.layers
    base = np.array([_address(b) for b in w.blocks], np.int64)
    cap = np.array([b.shape[1] for b in w.blocks], np.int64)
    row = w.blocks[0].shape[2] * 4
    off = np.arange(len(layers), dtype=np.int64)[:, None] * cap[None, :]
    att = np.zeros((len(layers), len(w.blocks), 6), np.int64)
    att[:, :, 0] = base + (off + w.start) * row
    att[:, :, 1] = w.dst + 1 - w.start
    by_source: dict = {}
    for li, lp in enumerate(layers):
        by_source.setdefault((lp.ents_from, lp.mask_from), []).append(li)
    for (src, _), lis in by_source.items():
        ok = layers[lis[0]].attended
        if ok is None or not ok.any():
            continue
        ents = layers[src].entries
        att[lis, :, 3] = np.where(ok, addr.addresses(ents), 0)
        att[lis, :, 4] = np.where(ok, [sp.n for sp in ents], 0)
        att[lis, :, 5] = ok
    return base + (off + w.dst) * row, att


_STEP_FIELDS = [(f.name, f.metadata["kind"]) for f in fields(StepInputs) if "kind" in f.metadata]
_LAYER_FIELDS = [(f.name, f.metadata["kind"]) for f in fields(LayerPlan) if "kind" in f.metadata]


class Layout:
    """Where each staged field of a StepInputs lies in the packed int64 / float32 arrays."""

    def __init__(self) -> None:
        self.step: list = []  # (field name, dtype, offset, shape)
        self.layers: list | None = None  # per layer: (its static fields, slots)

    @staticmethod
    def _cut(slots: list, i64, f32) -> dict:
        return {name: (i64 if dt is np.int64 else f32)[off:off + int(np.prod(shape))].reshape(shape)
                for name, dt, off, shape in slots}

    def views(self, i64, f32) -> StepInputs:
        """The StepInputs whose tables are views of i64 / f32 (no copy, no kernel)."""
        step = self._cut(self.step, i64, f32)
        layers = None if self.layers is None else [LayerPlan(**static, **self._cut(slots, i64, f32))
                                                    for static, slots in self.layers]
        if layers is not None and "win_dst" in step:
            layers = [replace(lp, win_dst=step["win_dst"][li], attend=step["attend"][li])
                      for li, lp in enumerate(layers)]
        return StepInputs(**{name: step.get(name) for name, _ in _STEP_FIELDS}, layers=layers)


def fill(i64: np.ndarray, layout: Layout, name: str, value: np.ndarray) -> None:
    """Write a step's int64 host field `name` (e.g. its token ids) into an i64 array packed
    before the field's values were known (ModelRunner.prepare_next)."""
    for field_name, dt, off, shape in layout.step:
        if field_name == name and dt is np.int64:
            i64[off:off + int(np.prod(shape))] = np.asarray(value, np.int64).reshape(-1)
            return
    raise KeyError(f"{name}: not an int64 field of this layout")


def pack(inputs: StepInputs) -> tuple[np.ndarray, np.ndarray, Layout]:
    """(int64 array, float32 array, Layout) of a step's inputs."""
    lay, addr = Layout(), _Addresses()
    parts: dict = {np.int64: [], np.float32: []}
    size = {np.int64: 0, np.float32: 0}

    def put(slots: list, name: str, kind: str, value) -> None:
        dt = np.float32 if kind == F32 else np.int64
        arr = np.ascontiguousarray(value, dtype=dt) if kind in (F32, I64) else addr.table(kind, value)
        slots.append((name, dt, size[dt], arr.shape))
        parts[dt].append(arr.reshape(-1))
        size[dt] += arr.size

    for name, kind in _STEP_FIELDS:
        if (v := getattr(inputs, name)) is not None:
            put(lay.step, name, kind, v)
    if inputs.window is not None:
        for name, table in zip(("win_dst", "attend"), _window_tables(inputs, addr), strict=True):
            put(lay.step, name, I64, table)
    if inputs.layers is not None:
        lay.layers = []
        staged: dict = {}  # id(plan) -> its (static fields, slots): layers sharing a plan share its tables
        for lp in inputs.layers:
            got = staged.get(id(lp))
            if got is None:
                slots: list = []
                for name, kind in _LAYER_FIELDS:
                    if (v := getattr(lp, name)) is not None and kind != HOST:
                        put(slots, name, kind, v)
                got = staged[id(lp)] = (lp.static(), slots)
            lay.layers.append(got)
    out = [np.concatenate(parts[dt]) if parts[dt] else np.zeros(1, dt) for dt in (np.int64, np.float32)]
    return out[0], out[1], lay
