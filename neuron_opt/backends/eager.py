"""Reference backend: runs the torch model eagerly, no compilation. The oracle for the other backends."""

from __future__ import annotations

from collections.abc import Callable
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
    takes_embeddings = True  # image embeddings merged at their positions (StepInputs.multimodal)
    takes_last_keys = True  # queries that see keys past their position (StepInputs.last_keys)
    # its graph calls use every core the thread policy gives them, with the GIL held between ops (layers): the
    # host work of async scheduling has nowhere to overlap (docs/serving.md, "Async scheduling")
    async_scheduling = False

    def __init__(self, model: torch.nn.Module, cache: CacheConfig) -> None:
        self.model = model.eval()
        dtype = next(model.parameters()).dtype
        self.k_caches, self.v_caches = allocate_kv(model, cache, dtype)
        self.lora_config = getattr(model, "lora_config", None)
        self.lora_stacks = stacks_for(model, dtype)
        self.aux_layers: tuple[int, ...] = ()  # capture_aux_hidden
        self.aux_hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self, bucket: Bucket, inputs: StepInputs) -> torch.Tensor:
        kw: dict = {"window_kv": inputs.window_kv()} if inputs.window_kv() is not None else {}
        if self.lora_stacks is not None and inputs.lora_slots is not None:
            kw["lora"] = LoraInputs(self.lora_stacks, inputs.lora_slots)
        if inputs.multimodal() is not None:
            kw["mm_embeds"] = inputs.multimodal()
        if inputs.rope_positions is not None:
            kw["rope_positions"] = inputs.rope_positions
        if inputs.last_keys is not None:
            kw["last_keys"] = inputs.last_keys
        if self.aux_layers:
            logits, self.aux_hidden = self.model.forward_with_aux(
                *inputs.arrays(), self.k_caches, self.v_caches, bucket.kv_len, self.aux_layers, bucket.generates,
                **kw)
            return logits
        return self.model(*inputs.arrays(), self.k_caches, self.v_caches, bucket.kv_len, bucket.generates, **kw)

    def capture_aux_hidden(self, layer_ids: tuple[int, ...]) -> None:
        """From now on each step also keeps the residual stream entering these layers at every position
        (`aux_hidden`: [B, S, len(layer_ids) * H], models.llama `forward_with_aux`), for an EAGLE-3 head."""
        if not hasattr(self.model, "forward_with_aux"):
            raise ValueError(f"{type(self.model).__name__} returns no hidden states")
        self.aux_layers = tuple(layer_ids)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embedding rows of `ids` (tp 1: the whole table), unscaled."""
        return torch.nn.functional.embedding(ids, self.model.model.embed_tokens.weight)

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
    gguf_blocks = True  # gguf's reference dequantization in every product (quant.weights)
    compiles_encoders = True  # vision encoder buckets (neuron_opt.multimodal.compiled)
    bidirectional_blocks = True  # EagerExecutor.takes_last_keys

    def __init__(self, dtype: torch.dtype = torch.float32, options: dict | None = None) -> None:
        self.dtype = dtype
        self.options = dict(options or {})

    def compile_bucket(self, model: torch.nn.Module, bucket: Bucket, cache: CacheConfig, out_dir: Path) -> list[Path]:
        return []  # nothing to compile: the eager graph is the model itself

    def save_weights(self, model: torch.nn.Module, path: Path) -> None:
        save_file(model_state_for_save(model), str(path))

    def compile_encoder(self, graph: torch.nn.Module, args: tuple[torch.Tensor, ...], key: str,
                        out_dir: Path) -> list[Path]:
        return []  # the eager encoder bucket is the module itself

    def load_encoder(self, graph: torch.nn.Module, files: list[Path]) -> Callable[[tuple[torch.Tensor, ...]],
                                                                                  torch.Tensor]:
        return lambda args: graph(*args)

    def load(self, graph_files: dict[Bucket, list[Path]], weights_path: Path, model_factory: ModelFactory,
             cache: CacheConfig) -> EagerExecutor:
        model = model_factory()
        load_model_weights(model, weights_path)
        return EagerExecutor(model.to(self.dtype), cache)
