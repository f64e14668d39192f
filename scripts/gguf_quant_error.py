"""The error `--quantize auto` adds to each GGUF tensor type (docs/quantization.md's type table).

The source: the default model's weights (SmolLM2-135M), whose linears are Q4_1 values, each moved by a uniform
draw within its half-step (the values its original rounded from; without it every type would start from
Q4_1's grid, which int4 recovers exactly). It is quantized by llama.cpp's `llama-quantize` to each type, every
tensor in that type where its rows allow (`--pure`; K-quants and IQ4_XS need rows of 256 values, so
for them only the 30 ffn_down linears, 1,536 wide, are in the type); MXFP4, which llama-quantize writes for
experts only, is written by gguf's own quantizer. For every decoder linear stored in the type: the file's exact
values (gguf's reference dequantization) against what our model runs after `--quantize auto`'s conversion, and,
for comparison, after the other integer format; and the file's own error against the source. The error of a
tensor is ||ours - exact|| / ||exact|| (Frobenius); the table gives its mean and max over the tensors.

    python scripts/gguf_quant_error.py --json docs/bench/gguf_quant_error.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from neuron_opt import envs
from neuron_opt.bench import llamacpp_server as peer
from neuron_opt.checkpoint import default_model_path
from neuron_opt.config import QuantConfig
from neuron_opt.quant.gguf import AUTO_FORMATS, STORED_INT4, q4_block_tensor
from neuron_opt.quant.weights import dequantize, quantize

TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "Q4_K", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K")
FORMATS = {"int8": QuantConfig("int8", "per_channel_symmetric", 0),
           "int4": QuantConfig("int4", "group_asymmetric", 32)}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def exact(t) -> torch.Tensor:
    """A GGUF tensor's values, [rows, cols], by gguf's reference dequantization."""
    rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims fastest-first
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
                            .reshape(rows, cols))


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def source_file(binary: Path, src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """`src` (Q4_1 linears) as F32 with every linear value moved uniformly within its half-step (seeded), written
    in place into llama-quantize's F32 copy; returns the moved linears by name."""
    subprocess.run([str(binary), "--allow-requantize", str(src), str(dst), "F32"], check=True, capture_output=True)
    blocks = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
    g = torch.Generator().manual_seed(0)
    moved = {}
    for t in gguf.GGUFReader(str(dst), "r+").tensors:
        b = blocks[t.name]
        if not (t.name.startswith("blk.") and t.name.split(".")[2] in LINEARS and b.tensor_type.name in STORED_INT4):
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])
        step = q4_block_tensor(b.data, b.tensor_type.name, rows, cols).scale.repeat_interleave(32, dim=1)
        x = exact(t) + (torch.rand(rows, cols, generator=g) - 0.5) * step
        t.data[...] = x.numpy().reshape(t.data.shape)
        moved[t.name] = x
    return moved


def errors(kind: str, tensors: list, source: dict[str, torch.Tensor]) -> dict[str, object]:
    """The errors of `tensors` (all stored in `kind`) under each format and against the source, and the format
    auto picks."""
    out: dict[str, object] = {"type": kind, "auto": AUTO_FORMATS[kind], "tensors": len(tensors)}
    own = [rel(exact(t), source[t.name]) for t in tensors]
    out["file"] = {"mean": float(np.mean(own)), "max": float(np.max(own))}
    for fmt, qc in FORMATS.items():
        errs = []
        for t in tensors:
            ref = exact(t)
            if fmt == "int4" and kind in STORED_INT4:  # read as stored: the blocks themselves
                ours = dequantize(q4_block_tensor(t.data, kind, *ref.shape))
            else:
                ours = dequantize(quantize(ref, qc))
            errs.append(rel(ours, ref))
        out[fmt] = {"mean": float(np.mean(errs)), "max": float(np.max(errs))}
    return out


def linears(path: Path, kind: str) -> list:
    reader = gguf.GGUFReader(str(path))
    return [t for t in reader.tensors if t.tensor_type.name == kind and t.name.startswith("blk.")
            and t.name.split(".")[2] in LINEARS]


def mxfp4_file(src: Path, dst: Path) -> Path:
    """`src`'s decoder linears in MXFP4 by gguf's own quantizer (the rest dropped: only the linears are measured)."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for t in reader.tensors:
        if t.name.startswith("blk.") and t.name.split(".")[2] in LINEARS:
            w.add_tensor(t.name, gguf.quants.quantize(exact(t).numpy(), gguf.GGMLQuantizationType.MXFP4),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-quantize", type=Path, help="a llama-quantize binary (default: built once into the "
                    "cache from the llama-cpp-python sdist of --llamacpp-version)")
    ap.add_argument("--llamacpp-version", default="0.3.36", help="llama-cpp-python whose llama.cpp quantizes")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    binary = args.llama_quantize or peer.ensure_built(envs.CACHE_DIR, args.llamacpp_version,
                                                      peer.default_cmake_args()).quantize
    src = default_model_path()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        source = source_file(binary, src, f32)
        for kind in TYPES:
            out = Path(tmp) / f"{kind}.gguf"
            if kind == "MXFP4":
                mxfp4_file(f32, out)
            else:
                subprocess.run([str(binary), "--allow-requantize", "--pure", str(f32), str(out), kind], check=True,
                               capture_output=True)
            row = errors(kind, linears(out, kind), source)
            rows.append(row)
            print(f"{kind:7s} auto={row['auto']:5s} tensors={row['tensors']:3d}  file mean/max "
                  f"{row['file']['mean']:.4f}/{row['file']['max']:.4f}  int8 mean/max "
                  f"{row['int8']['mean']:.4f}/{row['int8']['max']:.4f}  int4 mean/max "
                  f"{row['int4']['mean']:.4f}/{row['int4']['max']:.4f}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"source": str(src.name), "llama_quantize": str(binary), "rows": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
