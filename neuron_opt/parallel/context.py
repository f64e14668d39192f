"""The per-rank parallel context that TP-aware layers receive.

`ParallelContext` carries the rank, the degree, the layout switches chosen at build time and the collectives.
With tp=1 every collective is the identity, so the same model code runs single-rank with no communication.
The real collectives (torch.distributed, counted) are in `neuron_opt.parallel.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Collectives(Protocol):
    """What the model may call. Every op is over the tp group except `group_all_gather` (the KV group of
    flash decoding). `all_gather`/`reduce_scatter` concatenate / split along `dim` in rank order."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...
    def group_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...


class NoCollectives:
    """tp=1: nothing to communicate."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def group_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class ParallelContext:
    """One rank's view of the tensor-parallel group.

    Attributes:
        tp: tensor-parallel degree.
        rank: this rank, 0 <= rank < tp.
        comm: the collectives (identity when tp=1).
        sequence_parallel: prefill activations are sharded along the sequence between layers
            (all-gather before column layers, reduce-scatter after row layers). Decode (S=1) is unaffected.
    """

    tp: int = 1
    rank: int = 0
    comm: Collectives = field(default_factory=NoCollectives)
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.tp, (self.rank, self.tp)

    def rank_value(self) -> int | torch.Tensor:
        """This rank's id for rank-dependent arithmetic (vocab offsets, sequence chunks).

        An int, except in a single SPMD program that runs on every rank (the neuron backend's tp > 1 graphs):
        there the collectives carry the rank as a device tensor, each rank's shard of arange(tp) (NxD's
        SPMDRank), so that one HLO serves every rank."""
        r = getattr(self.comm, "rank_tensor", None)
        return self.rank if r is None else r

    def seq_sharded(self, seq: int) -> bool:
        """Whether a step of `seq` tokens per row runs sequence-parallel (chosen per bucket = per graph)."""
        return self.sequence_parallel and self.tp > 1 and seq > 1


SINGLE = ParallelContext()
