"""Tensor parallelism: per-rank context and collectives, TP-aware layers, sharding rules and head layouts."""

from neuron_opt.parallel.context import SINGLE, NoCollectives, ParallelContext
from neuron_opt.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from neuron_opt.parallel.sharding import HeadLayout, head_layout

__all__ = [
    "SINGLE", "NoCollectives", "ParallelContext", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "HeadLayout", "head_layout",
]
