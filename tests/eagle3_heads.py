"""A random EAGLE-3 head written as the EAGLE/SpecForge layout publishes one, for the engine tests (eager, cpu
and the XLA tier's device graphs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.eagle3 import Eagle3Config, Eagle3Head, head_weight_names
from neuron_opt.config import ModelConfig


def write_random_head(out: Path, target: Path, aux_ids: list[int] | None, seed: int = 0,
                      hidden: int | None = None, draft_vocab: int = 4096) -> Path:
    """A random EAGLE-layout head for the HF checkpoint `target` (its layer shaped like the target's, a draft
    vocabulary of `draft_vocab` tokens, every third of the target's, by d2t), saved as EAGLE/SpecForge do
    (no embed_tokens: the target's are shared)."""
    tc = json.loads((target / "config.json").read_text())
    layer = {k: tc[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "rms_norm_eps", "max_position_embeddings")}
    layer |= dict(model_type="llama", architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1)
    if hidden:
        layer["hidden_size"] = hidden
    cfg = Eagle3Config(layer=ModelConfig.from_hf(dict(layer, architectures=["LlamaForCausalLM"])),
                       draft_vocab_size=draft_vocab, aux_layer_ids=tuple(aux_ids) if aux_ids else None,
                       has_vocab_map=True)
    g = torch.Generator().manual_seed(seed)
    sd = Eagle3Head(cfg, 64).state_dict()
    tensors = {}
    for name in head_weight_names(cfg):
        t = sd[name]
        if name == "d2t":  # draft token d is target token d + d2t[d]: every third target token
            tensors[name] = torch.arange(draft_vocab) * 2
        elif name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            tensors[name] = 0.3 * torch.randn(t.shape, generator=g)
    tensors["t2d"] = torch.zeros(layer["vocab_size"], dtype=torch.bool)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    conf = dict(layer, draft_vocab_size=draft_vocab)
    if aux_ids:
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    (out / "config.json").write_text(json.dumps(conf))
    return out
