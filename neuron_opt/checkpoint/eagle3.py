"""EAGLE-3 draft heads (models/eagle3.py) from a directory, in either published layout:

- EAGLE / SpecForge: a Llama-style config.json (`draft_vocab_size`, `num_hidden_layers` 1; the aux layer ids, when
  given, in `eagle_config.eagle_aux_hidden_state_layer_ids`) and tensors `midlayer.*`, `fc`, `norm`, `lm_head`,
  `d2t`, `t2d`, optionally `embed_tokens`;
- `speculators`: config.json with `speculators_model_type: eagle3`, the layer's config in
  `transformer_layer_config` (model_type llama or qwen3; qwen3 when unnamed, as speculators defaults),
  `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_residual` (and `norm_before_fc`, `fc_norm`,
  `norm_output`, `target_hidden_size`), tensors under `layers.0.*` for the layer.

Weights are safetensors only (`model.safetensors` or a sharded index; pickled `.bin` heads are refused). `t2d`
(which target tokens the draft vocabulary has) is not needed to propose and is not kept.
`check_head` refuses a head that does not fit the target (vocabulary, hidden size, layer ids), naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers, head_weight_names
from neuron_opt.checkpoint.hf import weight_files
from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError, ConfigError
from neuron_opt.headers import read_json_capped, safetensors_header

# config fields of the head that are no decoder-layer field
_HEAD_FIELDS = ("draft_vocab_size", "eagle_config", "target_hidden_size", "norm_before_residual", "norm_before_fc",
                "fc_norm", "norm_output", "eagle_aux_hidden_state_layer_ids")
_LAYER_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _layer_config(d: dict[str, Any], where: str) -> ModelConfig:
    d = {k: v for k, v in d.items() if k not in _HEAD_FIELDS}
    mt = d.get("model_type") or "qwen3"
    if mt not in _LAYER_TYPES:
        raise CheckpointError(f"eagle3 head {where}: its decoder layer is a {mt!r} layer; llama and qwen3 layers "
                              "are built")
    if d.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"eagle3 head {where}: {d['num_hidden_layers']} decoder layers; EAGLE-3 heads of one "
                              "layer are built")
    d.update(model_type=mt, architectures=[_LAYER_TYPES[mt]], num_hidden_layers=1)
    d.setdefault("max_position_embeddings", 4096)
    try:
        return ModelConfig.from_hf(d)
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"eagle3 head {where}: its layer config does not load ({e})") from None


def read_head_config(root: Path, load: bool = True) -> tuple[Eagle3Config, str, dict[str, torch.Tensor | None]]:
    """(the head's config, its layout "eagle" or "speculators", its tensors under our (EAGLE) names). `load`
    False: the tensors' names only (values None), read from the safetensors headers, as `plan` needs."""
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"eagle3 head {root}: no config.json")
    raw = read_json_capped(cfg_path, CheckpointError, "eagle3 head")
    tensors: dict[str, torch.Tensor | None] = {}
    if not (root / "model.safetensors").is_file() and not (root / "model.safetensors.index.json").is_file() \
            and any(root.glob(p) for p in ("*.bin", "*.pt", "*.pth")):
        raise CheckpointError(f"eagle3 head {root}: only pickled weights (*.bin), which are never unpickled; we read "
                              "safetensors only (most heads are published with model.safetensors too)")
    for f in weight_files(root):
        try:
            tensors.update(load_file(str(f)) if load else dict.fromkeys(safetensors_header(f)))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"eagle3 head: {f} is not a readable safetensors file ({e})") from None
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise CheckpointError(f"eagle3 head {root}: a speculators {raw['speculators_model_type']!r} model, not "
                                  "eagle3")
        layout, head = "speculators", raw
        layer = _layer_config(dict(raw.get("transformer_layer_config") or {}), str(root))
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        if extra := sorted({k.split(".")[1] for k in tensors if k.startswith("layers.")} - {"0"}):
            raise CheckpointError(f"eagle3 head {root}: decoder layers {extra} beyond layers.0; heads of one layer "
                                  "are built")
        tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in tensors.items()}
    else:
        if "draft_vocab_size" not in raw or not any(k.startswith("midlayer.") for k in tensors):
            raise CheckpointError(f"eagle3 head {root}: neither a speculators eagle3 config (speculators_model_type) "
                                  "nor an EAGLE-layout head (draft_vocab_size and midlayer.* tensors)")
        layout, head = "eagle", raw
        layer = _layer_config(raw, str(root))
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    has_map = "d2t" in tensors
    draft_vocab = int(head.get("draft_vocab_size", layer.vocab_size))
    if draft_vocab != layer.vocab_size and not has_map:
        raise CheckpointError(f"eagle3 head {root}: a draft vocabulary of {draft_vocab} tokens (the target's: "
                              f"{layer.vocab_size}) needs its d2t map, which the head lacks")
    cfg = Eagle3Config(
        layer=layer, draft_vocab_size=draft_vocab, aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
        norm_before_residual=bool(head.get("norm_before_residual", False)),
        norm_before_fc=bool(head.get("norm_before_fc", False)), fc_norm=bool(head.get("fc_norm", False)),
        norm_output=bool(head.get("norm_output", False)), target_hidden_size=head.get("target_hidden_size"),
        has_embed="embed_tokens.weight" in tensors, has_vocab_map=has_map)
    drop = ("t2d", "verifier_lm_head.weight", "verifier_norm.weight")
    return cfg, layout, {k: v for k, v in tensors.items() if k not in drop}


def load_head(root: str | Path, max_model_len: int, dtype: torch.dtype) -> Eagle3Head:
    """The head in `root`, its weights in `dtype` (the vocabulary map as stored)."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"eagle3 head: {root} is not a directory")
    cfg, _, tensors = read_head_config(root)
    want = set(head_weight_names(cfg))
    if missing := sorted(want - set(tensors)):
        raise CheckpointError(f"eagle3 head {root}: missing tensors {missing[:6]}")
    if extra := sorted(set(tensors) - want):
        raise CheckpointError(f"eagle3 head {root}: tensors no EAGLE-3 head has: {extra[:6]}")
    head = Eagle3Head(cfg, max_model_len).to(dtype)
    try:
        head.load_state_dict({k: v if k == "d2t" else v.to(dtype) for k, v in tensors.items()}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"eagle3 head {root}: tensors do not fit its config ({e})") from None
    return head.eval()


def check_head(cfg: Eagle3Config, target: ModelConfig, where: str) -> tuple[int, ...]:
    """The target layer ids the head reads, after checking that it fits the target (ConfigError naming the field
    otherwise)."""
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"speculative_model: the eagle3 head {where} {msg}", param="speculative_model")

    if cfg.target_vocab_size != target.vocab_size:
        raise bad(f"is for a vocabulary of {cfg.target_vocab_size} tokens; the model has {target.vocab_size}")
    if cfg.aux_hidden_size != target.hidden_size:
        raise bad(f"reads hidden states of size {cfg.aux_hidden_size}; the model's hidden size is "
                  f"{target.hidden_size}")
    if not cfg.has_embed and cfg.hidden_size != target.hidden_size:
        raise bad(f"has hidden size {cfg.hidden_size} and no embed_tokens of its own; the model's embeddings are "
                  f"{target.hidden_size} wide")
    L = target.num_hidden_layers
    ids = cfg.aux_layer_ids or default_aux_layers(L)
    if len(ids) != cfg.num_aux or len(set(ids)) != len(ids) or not all(0 <= i <= L for i in ids):
        raise bad(f"reads layers {list(ids)}" + ("" if cfg.aux_layer_ids else " (the default: it names none)")
                  + f"; the model has {L} layers (ids 0..{L}, distinct, {cfg.num_aux} of them)")
    return tuple(ids)
