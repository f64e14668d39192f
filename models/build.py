"""Model construction: architecture -> class, and one rank's model skeleton (weights are loaded by the caller).

The supported-architecture table itself is `neuron_opt.architectures`, below both this package and
`neuron_opt.config` (which validates a checkpoint's architecture against it), so the packages depend one way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from models import gpt_oss
from models.llama import LlamaForCausalLM, checkpoint_weight_names, expected_weight_names, split_fused
from models.moe import MoeForCausalLM, moe_weight_names
from models.pooling import LlamaEmbeddingModel
from neuron_opt.architectures import family_for
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig, QuantConfig
from neuron_opt.errors import ConfigError
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel import ParallelContext, head_layout
from neuron_opt.parallel.layers import ColumnParallelLinear, RowParallelLinear

_CLASSES: dict[str, type] = {"llama": LlamaForCausalLM, "moe": MoeForCausalLM}
# embedding models (ModelConfig.pooling): the family's decoder with a pooling step for a head (models.pooling)
_EMBEDDING_CLASSES: dict[str, type] = {"llama": LlamaEmbeddingModel}


def model_class(cfg: ModelConfig) -> type:
    """The class that builds a model of `cfg`: its family's, the embedding variant when `cfg` pools."""
    family = family_for(cfg.architecture)
    return _EMBEDDING_CLASSES[family] if cfg.is_embedding else _CLASSES[family]


def weight_names(cfg: ModelConfig) -> list[str]:
    """The checkpoint names a model of `cfg` loads (HF names)."""
    return moe_weight_names(cfg) if cfg.is_moe else expected_weight_names(cfg)


def stored_weight_names(cfg: ModelConfig) -> list[str]:
    """The names the checkpoint of `cfg` stores: `weight_names`, with fused projections (Phi-3) under their fused
    names and GPT-OSS's experts as its stacked tensors (`split_stored` turns both into the canonical ones)."""
    if cfg.model_type == "gpt_oss":
        return gpt_oss.stored_names(cfg, weight_names(cfg))
    return checkpoint_weight_names(cfg, weight_names(cfg))


def split_stored(cfg: ModelConfig, name: str, tensor: torch.Tensor,
                 read: Callable[[str], torch.Tensor] | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """A stored tensor as canonical (name, tensor) pairs (neuron_opt.checkpoint calls this on every tensor it
    reads): Phi-3's fused projections split (models.llama.split_fused), GPT-OSS's stacked experts one per expert,
    MXFP4 dequantized with the scales `read(name)` returns (models.gpt_oss.split_stored)."""
    if cfg.model_type == "gpt_oss":
        return gpt_oss.split_stored(cfg, name, tensor, read)
    return split_fused(cfg, name, tensor)


def apply_quant_layout(model: torch.nn.Module, qc: QuantConfig | None) -> None:
    """Give every decoder linear that `qc` converts a quantized weight in place of its float one (shapes only:
    the caller loads the values). Embeddings stay in the compute dtype, the LM head too unless `qc.lm_head`."""
    if qc is None or not qc.enabled:
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and name.startswith("model.layers.") \
                and qc.converts(name):
            module.quantize_as(qc, name)
    if qc.lm_head:
        model.lm_head.quantize_as(qc.head_config(), "lm_head")


def apply_lora_capacity(model: torch.nn.Module, lora: LoraConfig | None) -> None:
    """Give a model the LoRA capacity its graphs take adapters for (`model.lora_config`; neuron_opt.lora).
    Dense models only: a mixture-of-experts model is refused (ConfigError naming the flag)."""
    if lora is None:
        return
    if model.cfg.is_moe:
        raise ConfigError("enable_lora: LoRA adapters are served on dense models only, not on mixture-of-experts "
                          f"models ({model.cfg.architecture})", param="enable_lora")
    model.lora_config = lora


def rank_model_factory(cfg: ModelConfig, par: ParallelConfig, cache: CacheConfig, rank: int,
                       dtype: torch.dtype, pctx: Any = None,
                       quant: QuantConfig | None = None,
                       lora: LoraConfig | None = None) -> Callable[[], torch.nn.Module]:
    """A zero-argument factory for rank `rank`'s model skeleton in `dtype`, its parameters allocated once in
    `dtype` and left uninitialised: the caller loads the weights (building in fp32 and casting would hold the
    rank's weights 3x over for a moment, which is what compile's host RAM is planned on).

    `pctx`: the rank's ParallelContext (its collectives); default: no collectives, the layouts of `par`.
    `quant`: the decoder linears hold quantized weights (models.build.apply_quant_layout).
    `lora`: the model takes LoRA adapters of this capacity (apply_lora_capacity)."""

    def make() -> torch.nn.Module:
        ctx = pctx if pctx is not None else ParallelContext(par.tp, rank, sequence_parallel=par.sequence_parallel)
        with torch.device("meta"):  # parameters take no memory yet; the rope tables are built on the CPU
            model = model_class(cfg)(cfg, head_layout(cfg, par), cache.max_model_len, ctx)
            apply_quant_layout(model, quant)
            apply_lora_capacity(model, lora)
        model = model.to(dtype)  # meta parameters change dtype for free; buffers are cast as before
        materialize_parameters(model)
        return model.eval()

    return make


def materialize_parameters(model: torch.nn.Module) -> None:
    """Meta parameters -> uninitialised CPU parameters of the same shape and dtype; ties stay ties."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
