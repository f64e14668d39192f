"""The per-rank parallel context that TP-aware layers receive.

`ParallelContext` carries the rank, the degree and the collectives. With tp=1 every collective is the
identity, so the same model code runs single-rank with no communication in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Collectives(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...


class NoCollectives:
    """tp=1: nothing to communicate."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class ParallelContext:
    tp: int = 1
    rank: int = 0
    comm: Collectives = field(default_factory=NoCollectives)

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.tp, (self.rank, self.tp)


SINGLE = ParallelContext()
