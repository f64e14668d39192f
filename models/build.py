"""Model construction: architecture -> class, and one rank's model skeleton (weights are loaded by the caller).

Separate from `models.registry` (the supported-architecture table, which `neuron_opt.config` validates against
and which therefore imports no model code) so that the import graph stays a DAG.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from models.llama import LlamaForCausalLM
from models.registry import family_for
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.parallel import ParallelContext, head_layout

_CLASSES: dict[str, type] = {"llama": LlamaForCausalLM}


def model_class(architecture: str) -> type:
    return _CLASSES[family_for(architecture)]


def rank_model_factory(cfg: ModelConfig, par: ParallelConfig, cache: CacheConfig, rank: int,
                       dtype: torch.dtype, pctx: Any = None) -> Callable[[], torch.nn.Module]:
    """A zero-argument factory for rank `rank`'s model skeleton in `dtype`.

    `pctx`: the rank's ParallelContext (its collectives); default: no collectives, the layouts of `par`."""

    def make() -> torch.nn.Module:
        ctx = pctx if pctx is not None else ParallelContext(par.tp, rank, sequence_parallel=par.sequence_parallel)
        model = model_class(cfg.architecture)(cfg, head_layout(cfg, par), cache.max_length, ctx)
        return model.to(dtype).eval()

    return make
