"""Reference backend: runs the torch model eagerly, no compilation. The oracle for the other backends."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from neuron_opt.backends.base import Backend, ModelFactory, StepInputs, allocate_kv
from neuron_opt.buckets import Bucket
from neuron_opt.config import CacheConfig
from neuron_opt.lora.adapter import LoraAdapter, load_into_slot
from neuron_opt.lora.ops import LoraInputs, stacks_for
from neuron_opt.weights import load_model_weights, model_state_for_save


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
        window = {"window_kv": inputs.window_kv()} if inputs.window_kv() is not None else {}
        if self.lora_stacks is not None and inputs.lora_slots is not None:
            return self.model(*inputs.arrays(), self.k_caches, self.v_caches, bucket.kv_len, bucket.generates,
                              lora=LoraInputs(self.lora_stacks, inputs.lora_slots), **window)
        return self.model(*inputs.arrays(), self.k_caches, self.v_caches, bucket.kv_len, bucket.generates, **window)

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
    window_kv = True

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
