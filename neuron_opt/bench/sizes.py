"""The decode benchmark's model sizes (`scripts/bench_decode.py --sizes 135m,1b,3b`): the default model, and Llama
shapes of the 1B and 3B class with random weights, made once under the cache directory and converted to GGUF by
llama.cpp's own converter, so our systems and llama.cpp's read the same file.

Design decisions:
- "135m" is the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF as shipped). "1b" and "3b" are the
  Llama-3.2-1B and Llama-3.2-3B shapes (layers, hidden and MLP widths, heads, grouped KV heads, head width, tied
  embedding), "synthetic" a two-layer one for the tests and `--quick`. The random ones use the default model's
  tokenizer and its 49,152-token vocabulary (so every command accepts them, and the embedding matches the
  tokenizer), rope theta 500,000 without Llama 3's long-context scaling, and 8,192 positions: 1.07 B and 2.97 B
  parameters.
- Random weights from transformers' own initialisation (seed 0) in bf16, saved with `save_pretrained`, converted
  by `convert_hf_to_gguf.py --outtype bf16` of the llama-cpp-python sdist (neuron_opt.bench.llamacpp_server),
  without loss: the BF16 file is the source checkpoint of every system of that size; llama.cpp's quantizer makes
  the F32, Q8_0, Q4_1 and Q4_K_M files from it (neuron_opt.bench.llamacpp.storage_gguf). The HF directory is
  removed once the file is written; the file is named by the size and VERSION (bump it when a config or the seed
  changes).
- Disk under the cache directory, all storage formats: about 9 GB for "1b", 25 GB for "3b". Memory: a process
  holds one system's weights (3b in fp32: 12 GB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from neuron_opt.bench import llamacpp_server as peer
from neuron_opt.checkpoint import default_model_path, open_checkpoint

LLAMACPP_VERSION = "0.3.36"  # the converter and llama-quantize without llama-cpp-python installed (tests' version)
VERSION = 1
_LLAMA = dict(max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
              hidden_act="silu", attention_bias=False, mlp_bias=False)


@dataclass(frozen=True)
class Size:
    name: str
    title: str  # what the tables and the plot call it
    config: dict | None  # LlamaConfig fields of a random model; None: the default model
    minutes_per_round: float  # one round of the record's 15 system-batch pairs on 2 cores (an estimate)
    setup_minutes: float  # the first run: the model's files (random weights, conversion, quantizing), compiles


SIZES = {
    "135m": Size("135m", "SmolLM2-135M (the default model)", None, 2.5, 3.0),
    "1b": Size("1b", "Llama-3.2-1B shape, random weights", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, **_LLAMA), 8.0, 28.0),
    "3b": Size("3b", "Llama-3.2-3B shape, random weights", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, **_LLAMA), 15.0, 60.0),
    "synthetic": Size("synthetic", "two-layer Llama, random weights (tests, --quick)", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, **_LLAMA), 0.5, 1.0),
}


def parse_sizes(value: str) -> list[Size]:
    """`--sizes`: a comma list of SIZES' names.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        raise ValueError(f"--sizes: unknown {unknown or value!r}; choose from {', '.join(SIZES)}")
    return [SIZES[n] for n in names]


def llamacpp_version() -> str:
    """The llama-cpp-python whose vendored llama.cpp converts and quantizes: the installed one, else the tests'."""
    return peer.installed_llama_cpp_python() or LLAMACPP_VERSION


def size_gguf(size: Size, cache_dir: Path) -> Path:
    """The GGUF of `size`: the default model's file, or the random model's BF16 file, made on first use."""
    if size.config is None:
        return default_model_path()
    out = Path(cache_dir) / "bench-sizes" / f"{size.name}-v{VERSION}-bf16.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    hf_dir = out.with_name(f"{size.name}-v{VERSION}-hf.tmp")
    shutil.rmtree(hf_dir, ignore_errors=True)
    try:
        _random_checkpoint(size, hf_dir)
        _convert(hf_dir, out, Path(cache_dir))
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
    return out


def _random_checkpoint(size: Size, out: Path) -> None:
    """The random-weight Llama of `size` (seed 0, bf16) with the default model's tokenizer, saved to `out`."""
    import transformers

    tok = open_checkpoint("default").tokenizer()
    cfg = transformers.LlamaConfig(**size.config, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _convert(hf_dir: Path, out: Path, cache_dir: Path) -> None:
    """`hf_dir` written to `out` by llama.cpp's converter in BF16 (atomic: a temp file renamed into place).

    Raises:
        RuntimeError: the converter failed (with its output's tail).
    """
    script = peer.ensure_sources(cache_dir, llamacpp_version()) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    tmp = out.with_name(out.name + ".tmp")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converter's own gguf-py
    try:
        r = subprocess.run([sys.executable, str(script), "--outtype", "bf16", "--outfile", str(tmp), str(hf_dir)],
                           capture_output=True, text=True, env=env, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"llama.cpp's converter failed on {hf_dir} ({r.returncode}): "
                               f"{(r.stdout + r.stderr)[-2000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def quantizer(cache_dir: Path) -> Callable[[Path, Path, str], None]:
    """neuron_opt.bench.llamacpp.storage_gguf's quantizer from llama.cpp's `llama-quantize` (built once under
    `cache_dir` with this CPU's instruction sets: neuron_opt.bench.llamacpp_server.ensure_built)."""
    build = peer.ensure_built(Path(cache_dir), llamacpp_version(), peer.default_cmake_args())
    return peer.quantizer(build.quantize)
