"""Lazy safetensors checkpoint reader (and a streaming writer) for DeepSeek-V4 / V4.1.

We parse safetensors ourselves -- 8-byte little-endian header length, JSON header, raw data
-- and np.memmap the data, because numpy has no bf16/fp8 dtypes and the `safetensors`
package's numpy loader refuses them. Tensors keep their stored format; `formats` decodes.

Names are normalised to DeepSeek's upstream ("canonical") naming: HF V4.1 checkpoints are
`model.` + upstream, HF V4 uses transformers module names (`self_attn.q_a_proj`, merged
`mlp.experts.gate_up_proj`, `weight_scale_inv`...). Vision-tower tensors are skipped with one
log line; `mtp.*` (DSpark draft) tensors keep their upstream names (`model.mtp.*` -> `mtp.*`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.checkpoint import formats

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "RawTensor",
    "Weight",
    "Checkpoint",
    "canonical_name",
    "skip_kind",
    "scale_name",
    "SAFETENSORS_DTYPES",
]


class CheckpointError(Exception):
    """A checkpoint is malformed or lacks what the model needs (names tensor and/or file)."""


# safetensors dtype string -> numpy storage dtype (bit patterns for bf16 / fp8).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "F8_E8M0": np.dtype(np.uint8),
}
_FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
_MAX_HEADER = 1 << 30


# ---------------------------------------------------------------------------------------------
# Names

# Whole-name prefixes of tensors that a text-only engine never reads.
_VISION_RE = re.compile(
    r"^(model\.)?(language_model\.)?"
    r"(vision|visual|vision_tower|vision_model|multi_modal_projector|mm_projector|aligner|"
    r"image_start|image_end|image_newline|view_seperator|view_separator)(\.|_|$)"
)

# Prefixes wrapping the text model (HF CausalLM / multimodal containers).
_PREFIX_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^model\.language_model\."), ""),
    (re.compile(r"^language_model\.model\."), ""),
    (re.compile(r"^language_model\.lm_head\."), "head."),
    (re.compile(r"^language_model\."), ""),
    (re.compile(r"^model\."), ""),
    (re.compile(r"^lm_head\."), "head."),
]

# Applied in order to the name without its wrapper prefix. Each rule is idempotent on
# upstream names (none of the source patterns occur in them).
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^embed_tokens\."), "embed."),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^(layers\.\d+)\.input_layernorm\."), r"\1.attn_norm."),
    (re.compile(r"^(layers\.\d+)\.post_attention_layernorm\."), r"\1.ffn_norm."),
    (re.compile(r"^(layers\.\d+)\.(attn|ffn)_hc\.(fn|base|scale)$"), r"\1.hc_\2_\3"),
    (re.compile(r"^(layers\.\d+)\.self_attn\."), r"\1.attn."),
    (re.compile(r"^(layers\.\d+)\.mlp\."), r"\1.ffn."),
    # V4: transformers nests the indexer inside the compressor; upstream has it beside.
    (
        re.compile(r"^(layers\.\d+\.attn)\.compressor\.indexer\.scorer\.weights_proj\."),
        r"\1.indexer.weights_proj.",
    ),
    (re.compile(r"^(layers\.\d+\.attn)\.compressor\.indexer\.q_b_proj\."), r"\1.indexer.wq_b."),
    (re.compile(r"^(layers\.\d+\.attn)\.compressor\.indexer\."), r"\1.indexer.compressor."),
    (re.compile(r"^(layers\.\d+\.attn)\.indexer\.scorer\.weights_proj\."), r"\1.indexer.weights_proj."),
    # attention leaves: transformers `*_proj` -> paper notation
    (re.compile(r"^(layers\.\d+\.attn(?:\.[a-z_.]+)?)\.q_a_proj\."), r"\1.wq_a."),
    (re.compile(r"^(layers\.\d+\.attn(?:\.[a-z_.]+)?)\.q_b_proj\."), r"\1.wq_b."),
    (re.compile(r"^(layers\.\d+\.attn(?:\.[a-z_.]+)?)\.kv_proj\."), r"\1.wkv."),
    (re.compile(r"^(layers\.\d+\.attn(?:\.[a-z_.]+)?)\.gate_proj\."), r"\1.wgate."),
    (re.compile(r"^(layers\.\d+\.attn(?:\.[a-z_.]+)?)\.o_a_proj\."), r"\1.wo_a."),
    (re.compile(r"^(layers\.\d+\.attn(?:\.[a-z_.]+)?)\.o_b_proj\."), r"\1.wo_b."),
    (re.compile(r"^(layers\.\d+\.attn)\.q_a_norm\."), r"\1.q_norm."),
    (re.compile(r"^(layers\.\d+\.attn)\.sinks$"), r"\1.attn_sink"),
    # transformers 5.17 saved the main KV norm as bare `attn.norm`
    (re.compile(r"^(layers\.\d+\.attn)\.norm\."), r"\1.kv_norm."),
    (re.compile(r"^(layers\.\d+\.attn(?:\.indexer)?\.compressor)\.kv_norm\."), r"\1.norm."),
    (re.compile(r"^(layers\.\d+\.attn(?:\.indexer)?\.compressor)\.position_bias$"), r"\1.ape"),
    # MoE
    (re.compile(r"^(layers\.\d+\.ffn\.gate)\.e_score_correction_bias$"), r"\1.bias"),
    (re.compile(r"^(layers\.\d+\.ffn\.(?:shared_experts|experts\.\d+))\.gate_proj\."), r"\1.w1."),
    (re.compile(r"^(layers\.\d+\.ffn\.(?:shared_experts|experts\.\d+))\.down_proj\."), r"\1.w2."),
    (re.compile(r"^(layers\.\d+\.ffn\.(?:shared_experts|experts\.\d+))\.up_proj\."), r"\1.w3."),
    # transformers' FP8 quantizer names the block scales `weight_scale_inv` (it IS the scale:
    # dequant = w * scale); upstream puts them beside the weight as `<module>.scale`.
    (re.compile(r"\.weight_scale_inv$"), ".scale"),
    (re.compile(r"\.weight_scale$"), ".scale"),
]

# transformers' merged expert tensors: [E, 2I, K] (w1 rows then w3 rows) and [E, H, I].
MERGED_EXPERTS_RE = re.compile(r"^(layers\.\d+)\.ffn\.experts\.(gate_up_proj|down_proj)(_scale_inv|_scale)?$")


def skip_kind(name: str) -> str | None:
    """'vision' for tensors the text engine skips, else None."""
    if _VISION_RE.match(name):
        return "vision"
    return None


def canonical_name(name: str) -> str:
    """Map any supported naming (upstream, HF V4.1, HF V4 short or long form) to upstream."""
    for pat, rep in _PREFIX_RULES:
        new = pat.sub(rep, name, count=1)
        if new != name:
            name = new
            break
    for pat, rep in _RULES:
        name = pat.sub(rep, name, count=1)
    return name


def scale_name(weight_name: str) -> str:
    """Canonical name of a weight's block-scale sibling."""
    base = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return base + ".scale"


# ---------------------------------------------------------------------------------------------
# Tensors


@dataclass
class RawTensor:
    """One stored tensor: `array` is a read-only view in its storage dtype (uint16 for BF16,
    uint8 for F8_*, int8 for I8, ...)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    array: np.ndarray
    file: str = ""
    stored_name: str = ""


@dataclass
class Weight:
    """A weight in its stored format. `shape` is the logical (out, in) shape: for fp4 the
    packed data has K/2 columns. `block` is (rows, cols) per scale entry: (32, 32) / (128, 128)
    for block-scaled fp8, (1, 32) for fp4 experts and engram rows."""

    name: str
    data: np.ndarray
    fmt: str  # 'bf16' | 'f32' | 'fp8' | 'fp4'
    scale: np.ndarray | None = None
    scale_fmt: str | None = None  # 'ue8m0' | 'fp32' | None
    block: tuple[int, int] | None = None
    shape: tuple[int, ...] = field(default_factory=tuple)
    # how `--numerics deepseek` computes with it (engine/model/numerics.py; set by the loader)
    use: str | None = None

    def dequant(self) -> np.ndarray:
        """Decode to float32 (the numpy reference path)."""
        if self.fmt == "bf16":
            return formats.bf16_to_f32(self.data)
        if self.fmt == "f32":
            return np.asarray(self.data, dtype=np.float32)
        if self.fmt == "fp8":
            return formats.dequant_fp8_blocks(self.data, self.scale, self.block)
        if self.fmt == "fp4":
            return formats.dequant_fp4_experts(self.data, self.scale, self.block[1])
        raise ValueError(f"unknown weight format {self.fmt!r}")


@dataclass
class _Entry:
    file: Path
    stored_name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int
    # merged-expert virtual tensors: (expert, row slice) into the stored [E, rows, K] tensor
    split: tuple[int, slice] | None = None
    stored_shape: tuple[int, ...] = ()


def _parse_header(path: Path) -> tuple[dict[str, _Entry], dict]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > _MAX_HEADER:
                raise CheckpointError(
                    f"{path}: corrupted or truncated header (declares {n} header bytes, file has {size})"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    data_size = size - data_start
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        try:
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupted header entry for tensor {name!r}") from e
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise CheckpointError(f"{path}: corrupted header entry for tensor {name!r}")
        want = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if end - begin != want:
            raise CheckpointError(
                f"{path}: tensor {name!r} has {end - begin} bytes, {dtype}{list(shape)} needs {want}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated file: tensor {name!r} ends at byte {data_start + end}, file has {size}"
            )
        entries[name] = _Entry(path, name, dtype, shape, data_start + begin, end - begin)
    return entries, meta


def _block_candidates(n: int, groups: int, allow_one: bool) -> list[int]:
    sizes = [1 << i for i in range(0 if allow_one else 1, 13)]
    return [b for b in sizes if math.ceil(n / b) == groups]


class Checkpoint:
    """A lazy view of a safetensors checkpoint: a directory (with or without
    `model.safetensors.index.json`), an index file, or a single `.safetensors` file.

    `block_size` is `quantization_config.weight_block_size`; when not given it is read from a
    `config.json` beside the weights, else inferred per tensor from the scale's shape."""

    def __init__(self, path: str | os.PathLike, block_size: Iterable[int] | None = None):
        self.path = Path(path)
        self._maps: dict[Path, np.memmap] = {}
        self._entries: dict[str, _Entry] = {}
        self.skipped: dict[str, int] = {"vision": 0}
        files, index_map = self._discover()
        self.block_size = tuple(block_size) if block_size is not None else self._config_block_size()
        stored: dict[str, _Entry] = {}
        for f in files:
            entries, _ = _parse_header(f)
            for name, e in entries.items():
                if name in stored:
                    raise CheckpointError(f"{f}: tensor {name!r} also stored in {stored[name].file}")
                stored[name] = e
        if index_map is not None:
            for name, shard in index_map.items():
                e = stored.get(name)
                if e is None:
                    raise CheckpointError(
                        f"{self.path}: index lists tensor {name!r} in {shard}, which lacks it"
                    )
                if e.file.name != Path(shard).name:
                    raise CheckpointError(
                        f"{self.path}: index puts tensor {name!r} in {shard}, found in {e.file}"
                    )
        for name, e in stored.items():
            kind = skip_kind(name)
            if kind is not None:
                self.skipped[kind] += 1
                continue
            canon = canonical_name(name)
            m = MERGED_EXPERTS_RE.match(canon)
            if m:
                self._add_merged(canon, m, e)
                continue
            self._add(canon, e)
        if any(self.skipped.values()):
            log.info("%s: skipped %d vision-tower tensors", self.path, self.skipped["vision"])

    # -- discovery ------------------------------------------------------------------------
    def _discover(self) -> tuple[list[Path], dict[str, str] | None]:
        p = self.path
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.exists():
                return self._read_index(index)
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{p}: no *.safetensors files and no model.safetensors.index.json")
            return files, None
        if not p.exists():
            raise CheckpointError(f"{p}: no such checkpoint")
        if p.name.endswith(".json"):
            return self._read_index(p)
        return [p], None

    def _read_index(self, index: Path) -> tuple[list[Path], dict[str, str]]:
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: bad index file ({e})") from e
        files = []
        for shard in sorted(set(weight_map.values())):
            f = index.parent / shard
            if not f.exists():
                users = [n for n, s in weight_map.items() if s == shard]
                raise CheckpointError(
                    f"{index}: missing shard {shard} (holds {len(users)} tensors, e.g. {users[0]!r})"
                )
            files.append(f)
        return files, weight_map

    def _config_block_size(self) -> tuple[int, int] | None:
        d = self.path if self.path.is_dir() else self.path.parent
        cfg = d / "config.json"
        if not cfg.exists():
            return None
        try:
            c = json.loads(cfg.read_text())
        except (OSError, ValueError):
            return None
        for holder in (c, c.get("text_config") or {}):
            q = holder.get("quantization_config") or {}
            if q.get("weight_block_size"):
                return tuple(int(x) for x in q["weight_block_size"])
        return None

    def _add(self, canon: str, e: _Entry) -> None:
        if canon in self._entries:
            other = self._entries[canon]
            raise CheckpointError(
                f"tensor {canon!r} stored twice: {other.stored_name!r} ({other.file}) "
                f"and {e.stored_name!r} ({e.file})"
            )
        self._entries[canon] = e

    def _add_merged(self, canon: str, m: re.Match[str], e: _Entry) -> None:
        layer, kind, scale = m.group(1), m.group(2), m.group(3)
        if len(e.shape) != 3:
            raise CheckpointError(f"{e.file}: merged experts tensor {e.stored_name!r} is not 3-D: {e.shape}")
        n_exp, rows = e.shape[0], e.shape[1]
        suffix = "scale" if scale else "weight"
        if kind == "gate_up_proj":
            if rows % 2:
                raise CheckpointError(f"{e.file}: {e.stored_name!r} has an odd gate_up row count {rows}")
            parts = [("w1", slice(0, rows // 2)), ("w3", slice(rows // 2, rows))]
        else:
            parts = [("w2", slice(0, rows))]
        for x in range(n_exp):
            for w, sl in parts:
                shape = (sl.stop - sl.start, e.shape[2])
                sub = _Entry(e.file, e.stored_name, e.dtype, shape, e.start, e.nbytes, (x, sl), e.shape)
                self._add(f"{layer}.ffn.experts.{x}.{w}.{suffix}", sub)

    # -- access ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Canonical names of every tensor (weights and their `.scale` siblings)."""
        return sorted(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        return e

    def _map(self, f: Path) -> np.memmap:
        mm = self._maps.get(f)
        if mm is None:
            try:
                mm = np.memmap(f, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{f}: cannot map ({e})") from e
            self._maps[f] = mm
        return mm

    def raw(self, name: str, expect_dtype: str | Iterable[str] | None = None) -> RawTensor:
        e = self._entry(name)
        if expect_dtype is not None:
            allowed = {expect_dtype} if isinstance(expect_dtype, str) else set(expect_dtype)
            if e.dtype not in allowed:
                raise CheckpointError(
                    f"{e.file}: tensor {name!r} has dtype {e.dtype}, expected {'/'.join(sorted(allowed))}"
                )
        dt = SAFETENSORS_DTYPES[e.dtype]
        if e.nbytes == 0:
            arr = np.zeros(e.shape, dtype=dt)
        elif e.split is None:
            arr = np.ndarray(e.shape, dtype=dt, buffer=self._map(e.file), offset=e.start)
        else:
            x, sl = e.split
            full = np.ndarray(e.stored_shape, dtype=dt, buffer=self._map(e.file), offset=e.start)
            arr = full[x, sl]
        return RawTensor(name, e.dtype, tuple(arr.shape), arr, str(e.file), e.stored_name)

    def f32(self, name: str) -> np.ndarray:
        """A float tensor (BF16 / F16 / F32 / F64) decoded to float32."""
        t = self.raw(name)
        if t.dtype == "BF16":
            return formats.bf16_to_f32(t.array)
        if t.dtype in ("F16", "F32", "F64"):
            return np.asarray(t.array, dtype=np.float32)
        raise CheckpointError(f"{t.file}: tensor {name!r} is {t.dtype}, not a float tensor (use weight())")

    def weight(
        self,
        name: str,
        expect_shape: Iterable[int] | None = None,
        expect_fmt: str | Iterable[str] | None = None,
    ) -> Weight:
        """A weight in its stored format, with its block-scale sibling for fp8 / fp4.
        `expect_shape` is the logical shape ((out, in) for linears; fp4 K is unpacked)."""
        t = self.raw(name)
        if t.dtype == "BF16":
            w = Weight(name, t.array, "bf16", shape=t.shape)
        elif t.dtype in ("F32", "F16", "F64"):
            data = t.array if t.dtype == "F32" else np.asarray(t.array, dtype=np.float32)
            w = Weight(name, data, "f32", shape=t.shape)
        elif t.dtype in ("F8_E4M3", "I8", "U8"):
            w = self._quantized(t)
        else:
            raise CheckpointError(f"{t.file}: tensor {name!r} has dtype {t.dtype}, not a weight format")
        if expect_fmt is not None:
            allowed = {expect_fmt} if isinstance(expect_fmt, str) else set(expect_fmt)
            if w.fmt not in allowed:
                raise CheckpointError(
                    f"{t.file}: tensor {name!r} is {w.fmt} ({t.dtype}), expected {'/'.join(sorted(allowed))}"
                )
        if expect_shape is not None and tuple(expect_shape) != tuple(w.shape):
            raise CheckpointError(
                f"{t.file}: tensor {name!r} has shape {list(w.shape)}, expected {list(expect_shape)}"
            )
        return w

    def _quantized(self, t: RawTensor) -> Weight:
        sname = scale_name(t.name)
        if sname not in self._entries:
            raise CheckpointError(f"{t.file}: {t.dtype} tensor {t.name!r} has no scale tensor {sname!r}")
        s = self.raw(sname)
        if s.dtype in ("F8_E8M0", "U8"):
            scale_fmt = "ue8m0"
        elif s.dtype == "F32":
            scale_fmt = "fp32"
        else:
            raise CheckpointError(f"{s.file}: scale {sname!r} has dtype {s.dtype}, expected F8_E8M0 or F32")
        if len(t.shape) != 2 or len(s.shape) != 2:
            raise CheckpointError(
                f"{t.file}: quantized tensor {t.name!r} {list(t.shape)} / scale {list(s.shape)} must be 2-D"
            )
        n, k = t.shape
        sn, sk = s.shape
        if t.dtype == "F8_E4M3":
            block = self._fp8_block(t, s)
            return Weight(t.name, t.array, "fp8", s.array, scale_fmt, block, (n, k))
        # I8 / U8: fp4 e2m1 packed two per byte, one scale per row per 32 (unpacked) columns
        k_full = 2 * k
        if sn != n or sk == 0 or k_full % sk or k_full // sk not in (16, 32):
            raise CheckpointError(
                f"{t.file}: fp4 tensor {t.name!r} {list(t.shape)} (K={k_full}) has scale {list(s.shape)}, "
                f"expected [{n}, {k_full // 32}]"
            )
        return Weight(t.name, t.array, "fp4", s.array, scale_fmt, (1, k_full // sk), (n, k_full))

    def _fp8_block(self, t: RawTensor, s: RawTensor) -> tuple[int, int]:
        n, k = t.shape
        sn, sk = s.shape
        if self.block_size is not None:
            bn, bk = self.block_size
            if (math.ceil(n / bn), math.ceil(k / bk)) == (sn, sk):
                return (bn, bk)
        cn = _block_candidates(n, sn, allow_one=True)
        ck = _block_candidates(k, sk, allow_one=False)
        if not cn or not ck:
            raise CheckpointError(
                f"{t.file}: fp8 tensor {t.name!r} {list(t.shape)} has scale {list(s.shape)} that fits no "
                f"block size (configured {self.block_size})"
            )
        common = [b for b in cn if b in ck]
        if common:  # square blocks when the shapes allow them; any candidate decodes the same
            return (common[0], common[0])
        return (cn[0], ck[0])

    def close(self) -> None:
        self._maps.clear()
