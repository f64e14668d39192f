"""Tensor parallelism: per-rank context and collectives, TP-aware layers, sharding rules and head layouts.

The rank processes (executor, launcher, worker) are imported from their modules, not from here, so that
importing the model does not import multiprocessing machinery. docs/tensor_parallel.md is the overview.
"""

from neuron_opt.parallel.context import SINGLE, NoCollectives, ParallelContext
from neuron_opt.parallel.layers import ColumnParallelLinear, FusedLinears, RowParallelLinear, VocabParallelEmbedding
from neuron_opt.parallel.sharding import HeadLayout, LayoutCost, head_layout, layout_cost, shard_state_dict

__all__ = [
    "SINGLE",
    "NoCollectives",
    "ParallelContext",
    "ColumnParallelLinear",
    "FusedLinears",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "HeadLayout",
    "LayoutCost",
    "head_layout",
    "layout_cost",
    "shard_state_dict",
]
