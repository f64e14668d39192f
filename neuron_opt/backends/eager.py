"""Reference backend: runs the torch model eagerly, no compilation. The oracle for the other backends."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from neuron_opt.backends.base import Backend, ModelFactory, StepInputs, allocate_kv
from neuron_opt.buckets import Bucket
from neuron_opt.config import CacheConfig
from neuron_opt.lora.adapter import LoraAdapter, load_into_slot
from neuron_opt.lora.ops import LoraInputs, stacks_for
from neuron_opt.quant import QuantTensor, quantized_modules


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


class EagerExecutor:
    """The model run eagerly; with a LoRA capacity (`model.lora_config`) it holds the adapter stacks too."""

    gathers_candidates = False

    def __init__(self, model: torch.nn.Module, cache: CacheConfig) -> None:
        self.model = model.eval()
        dtype = next(model.parameters()).dtype
        self.k_caches, self.v_caches = allocate_kv(model, cache, dtype)
        self.lora_config = getattr(model, "lora_config", None)
        self.lora_stacks = stacks_for(model, dtype)

    @torch.inference_mode()
    def run(self, bucket: Bucket, inputs: StepInputs) -> torch.Tensor:
        if self.lora_stacks is not None and inputs.lora_slots is not None:
            return self.model(*inputs.arrays(), self.k_caches, self.v_caches, bucket.kv_len, bucket.generates,
                              lora=LoraInputs(self.lora_stacks, inputs.lora_slots))
        return self.model(*inputs.arrays(), self.k_caches, self.v_caches, bucket.kv_len, bucket.generates)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        load_into_slot(self.lora_stacks, slot, adapter, self.model)

    def clear_lora(self, slot: int) -> None:
        assert self.lora_stacks is not None
        self.lora_stacks.clear_slot(slot)


class EagerBackend(Backend):
    """Nothing to compile: each rank's graph is its eager model (tp > 1: gloo rank processes)."""

    name = "eager"
    compiles_graphs = False
    est_seconds_per_graph = 0.0
    supports_lora = True

    def __init__(self, dtype: torch.dtype = torch.float32, options: dict | None = None) -> None:
        self.dtype = dtype
        self.options = dict(options or {})

    def compile_bucket(self, model: torch.nn.Module, bucket: Bucket, cache: CacheConfig, out_dir: Path) -> list[Path]:
        return []  # nothing to compile: the eager graph is the model itself

    def save_weights(self, model: torch.nn.Module, path: Path) -> None:
        save_file(model_state_for_save(model), str(path))

    def load(self, graph_files: dict[Bucket, list[Path]], weights_path: Path, model_factory: ModelFactory,
             cache: CacheConfig) -> EagerExecutor:
        model = model_factory()
        load_model_weights(model, weights_path)
        return EagerExecutor(model.to(self.dtype), cache)
