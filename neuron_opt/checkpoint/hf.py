"""Hugging Face checkpoint directories: config.json + `model.safetensors` or a sharded
`model.safetensors.index.json`, read only with `safetensors` (never unpickled: `.bin` checkpoints are refused with
a message saying how to convert them). Fused or stacked stored tensors (Phi-3's qkv_proj, GPT-OSS's experts) are
split into their canonical parts as they are read (models.build.split_stored).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from models.build import split_stored
from neuron_opt.checkpoint.names import stored_names
from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError
from neuron_opt.headers import read_json_capped, safetensors_header

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def weight_files(root: Path) -> list[Path]:
    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = read_json_capped(index, CheckpointError, "checkpoint")["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"checkpoint: {index} is not a valid safetensors index ({e!r})") from None
        if bad := [n for n in names if not isinstance(n, str) or Path(n).name != n]:  # a shard beside the index
            raise CheckpointError(f"checkpoint: {index} names shard files outside its directory: {bad[:3]}")
        files = [root / name for name in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"checkpoint: {f} is missing (listed in {index.name})")
        return files
    if any(root.glob("*.bin")) or any(root.glob("*.pt")) or any(root.glob("*.pth")):
        raise CheckpointError(
            f"checkpoint: {root} holds only pickled weights (*.bin); we read safetensors only. Convert with "
            "`AutoModelForCausalLM.from_pretrained(d).save_pretrained(d, safe_serialization=True)`")
    raise CheckpointError(f"checkpoint: {single} is missing (and no {index.name} either)")


def safetensors_keys(f: Path) -> set[str]:
    names = set(safetensors_header(f))  # our bounded check first: sizes and offsets against the file
    try:
        with safe_open(str(f), framework="pt") as sf:
            sf.keys()
    except Exception as e:  # SafetensorError has no stable import path; any failure means unreadable
        raise CheckpointError(f"checkpoint: {f} is not a readable safetensors file ({e})") from None
    return names



def hf_state_dict(root: Path, cfg: ModelConfig, prefix: str = "") -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(root):
        try:
            sd.update(load_file(str(f)))
        except Exception as e:
            raise CheckpointError(f"checkpoint: {f} is not a readable safetensors file ({e})") from None
    stored = set(stored_names(cfg))

    def read(name: str) -> torch.Tensor:
        if name[len(prefix):] not in sd:
            raise CheckpointError(f"checkpoint: {name} is missing")
        return sd[name[len(prefix):]]

    return {part: t for k, v in sd.items() if prefix + k in stored
            for part, t in split_stored(cfg, prefix + k, v, read)}


def hf_tokenizer(root: Path) -> PreTrainedTokenizerBase:
    # transformers when a tokenizer is built, not with this module: importing it may import a device runtime,
    # which the neuron backend must set up first (executors.loader)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint: no usable tokenizer in {root} ({e})") from None

