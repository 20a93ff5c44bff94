"""An FP8 / FP4 copy of a float checkpoint (the trained demo models), stored as DeepSeek's release
stores its weights: each tensor in the format engine.checkpoint.schema's table gives it (`fmt`):
FP8 e4m3 linears with UE8M0 scales per weight_block_size block, FP4 e2m1 routed experts with a
UE8M0 scale per row per 32, FP8 Engram rows with a UE8M0 scale per 32, the rest BF16 / F32.

The demo models are BF16 throughout, so DeepSeek's reference would never quantize an activation
on them; this copy exercises its FP8 / FP4 paths on trained weights (tests/reference/
test_deepseek_trained.py rebuilds it in a temp dir; tools/dev/gen_deepseek_trained.py makes its
fixtures). Deterministic: the same source gives the same bytes. DSpark draft layers (`mtp.*`)
are left out (num_nextn_predict_layers 0 in the copy).

    python tools/dev/quantize_demo.py OUT_DIR [--src models/demo-v41]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine.checkpoint import formats  # noqa: E402
from engine.checkpoint.reader import Checkpoint, scale_name  # noqa: E402
from engine.checkpoint.schema import resolve, stored_tensors, tensor_schema  # noqa: E402
from engine.checkpoint.tiny_model import make_config  # noqa: E402
from engine.checkpoint.writer import write_safetensors  # noqa: E402
from engine.model.config import parse_config  # noqa: E402

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def quantized_config(raw: dict) -> dict:
    """The source's config without draft layers, with the release's quantization_config."""
    cfg = {k: v for k, v in raw.items() if not k.startswith("dspark_")}
    n = int(cfg["num_hidden_layers"])
    cfg["num_nextn_predict_layers"] = 0
    cfg["compress_ratios"] = list(cfg["compress_ratios"])[:n]
    arch = "v41" if "v41" in str(cfg.get("model_type", "")) else "v4"
    cfg["quantization_config"] = make_config(arch, False)["quantization_config"]
    cfg.pop("dtype", None)
    return cfg


def encode(fmt: str, x: np.ndarray, block: tuple[int, int]) -> list[np.ndarray]:
    """float32 values -> the arrays `fmt` stores (weight first, then its scale)."""
    if fmt == "fp8":
        return list(formats.quant_fp8_blocks(x, block, "ue8m0"))
    if fmt == "fp8_rows":
        return list(formats.quant_fp8_blocks(x, (1, 32), "ue8m0"))
    if fmt == "fp4":
        return list(formats.quant_fp4_rows(x, 32))
    if fmt == "bf16":
        return [formats.f32_to_bf16(x)]
    if fmt == "f32":
        return [np.ascontiguousarray(x, dtype=np.float32)]
    raise ValueError(f"cannot encode {fmt!r}")


def quantize_checkpoint(src: str | Path, out: str | Path) -> Path:
    """Write the FP8 / FP4 copy of checkpoint `src` into `out` (one shard); returns `out`."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = quantized_config(json.loads((src / "config.json").read_text()))
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    ckpt = Checkpoint(src)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for e in tensor_schema(parse_config(cfg)):
        name = resolve(ckpt, e.name)
        if not ckpt.has(name):
            if e.optional:
                continue
            raise SystemExit(f"{src}: lacks {e.name}")
        stored = stored_tensors(e.name, e.fmt, e.shape, block)
        if e.fmt == "i64":
            arrays = [np.ascontiguousarray(ckpt.raw(name).array, dtype=np.int64)]
        else:
            arrays = encode(e.fmt, ckpt.weight(name).dequant() if e.kind in ("linear", "table")
                            else ckpt.f32(name), block)
        for (sname, dtype, shape), arr in zip(stored, arrays, strict=True):
            if tuple(arr.shape) != tuple(shape):
                raise SystemExit(f"{sname}: encoded {arr.shape}, schema says {shape}")
            tensors[sname] = (dtype, arr)
    assert all(n == scale_name(n[: -len(".scale")] + ".weight") for n in tensors if n.endswith(".scale"))
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in COPIED:
        if (src / f).exists():
            shutil.copyfile(src / f, out / f)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--src", default=str(REPO / "models" / "demo-v41"))
    a = ap.parse_args(argv)
    out = quantize_checkpoint(a.src, a.out_dir)
    print(f"wrote {out / 'model.safetensors'} ({(out / 'model.safetensors').stat().st_size} B)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
