"""Weights into and out of a model: a canonical (HF-named) state dict or a stream of its tensors loaded with
every check (each parameter filled, no unknown name, shapes equal), a rank's saved weights file loaded, and the
state dict a backend saves."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from neuron_opt.quant.weights import QuantTensor, quantized_modules


def model_state_for_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict without tied duplicates (safetensors refuses shared storage) and without derived buffers.
    Quantized weights are saved in their stored format (`X.quant.qweight`, `.scale`, `.offset`)."""
    sd = model.state_dict()
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return {k: v.contiguous() for k, v in sd.items()}


def load_weights(model: torch.nn.Module, sd: dict[str, torch.Tensor], source: object) -> None:
    """Load a canonical (HF-named) state dict; the only name allowed to be absent is a tied LM head."""
    load_weights_streamed(model, sd.items(), source)


def load_weights_streamed(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                          source: object) -> None:
    """`load_weights` for a stream of (canonical name, tensor): each is copied into its parameter and dropped, so
    only one tensor is in flight. The same checks: every parameter loaded (a tied LM head may be absent), no
    unknown name, shapes equal."""
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied LM head appears under both names
    quantized = quantized_modules(model)  # a float or quantized `X.weight` fills X's quantized weight
    slot_of = getattr(model, "stacked_slot", None)  # MoE: per-expert checkpoint tensors into stacked parameters
    seen: set[str] = set()
    filled: dict[str, dict[str, int]] = {}  # stacked parameter -> elements written, by slot
    unexpected: list[str] = []
    with torch.no_grad():
        for name, w in tensors:
            if w is None:  # another rank's (expert-parallel group's) tensor
                continue
            slot = slot_of(name) if slot_of is not None else None
            if slot is not None:
                pname, index = slot
                p = params.get(pname)
                if p is None or p[index].shape != w.shape:
                    raise ValueError(f"{source}: {name} of shape {tuple(w.shape)} does not fit {pname}{list(index)}"
                                     f" ({'absent' if p is None else tuple(p[index].shape)})")
                p[index].copy_(w)
                filled.setdefault(pname, {})[repr(index)] = w.numel()
                continue
            q = quantized.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if q is not None:
                try:
                    q.load(w)
                except ValueError as e:
                    raise ValueError(f"{source}: {name}: {e}") from None
                seen.update(f"{name.removesuffix('.weight')}.quant.{part}" for part in q.stored().parts())
                continue
            if isinstance(w, QuantTensor):
                raise ValueError(f"{source}: {name} is stored quantized ({w.method}) but the model's layer is not; "
                                 "compile with --quantize auto to keep it quantized")
            p = params.get(name)
            if p is None:
                unexpected.append(name)
                continue
            if p.shape != w.shape:
                raise ValueError(f"{source}: {name} has shape {tuple(w.shape)}, the model expects {tuple(p.shape)}")
            p.copy_(w)
            seen.add(name)
    tied = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    head = quantized.get("lm_head")
    if head is not None and model.cfg.tie_word_embeddings and "lm_head.weight" not in seen and \
            "lm_head.quant.qweight" not in seen:  # a quantized tied head: its own copy of the table
        head.load(model.model.embed_tokens.weight.detach())
        seen.update(f"lm_head.quant.{part}" for part in head.stored().parts())
    for pname, slots in filled.items():  # a stacked parameter is loaded once its (disjoint) slots cover it
        if sum(slots.values()) == params[pname].numel():
            seen.add(pname)
    missing = sorted(set(params) - seen - tied)
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match the model (missing {missing[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]})")


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    load_weights(model, load_file(str(path)), path)
