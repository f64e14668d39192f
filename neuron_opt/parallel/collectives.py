"""Collectives over torch.distributed (gloo on CPU), counted.

Every call records (op, payload bytes, group size) so a layout's communication is measured, not assumed.
Payload bytes are the size of the logical tensor being communicated on one rank:
  all_reduce      the input (= output) tensor
  all_gather      the gathered (full) output tensor
  reduce_scatter  the full input tensor
Wire bytes per rank follow the ring algorithm's volume: all_reduce 2(n-1)/n x payload, all_gather and
reduce_scatter (n-1)/n x payload, so an all-gather plus a reduce-scatter moves exactly what one all-reduce
moves (the sequence-parallel identity).

Neuron mapping (documented, not runnable here): these four ops map one-to-one onto the Neuron SDK's
collectives over the NeuronLink ring (`xm.all_reduce`, `xm.all_gather`, `xm.reduce_scatter` inside the
traced XLA graph, as neuronx-distributed's `parallel_layers.mappings` does), so there the collectives live
inside the compiled graph instead of between eager ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CollectiveCall:
    op: str  # all_reduce | all_gather | reduce_scatter | group_all_gather
    nbytes: int  # payload bytes (see the module docstring)
    group: int  # ranks taking part

    @property
    def wire_bytes(self) -> float:
        n = self.group
        factor = 2 * (n - 1) / n if self.op == "all_reduce" else (n - 1) / n
        return factor * self.nbytes


@dataclass
class CollectiveCounter:
    calls: list[CollectiveCall] = field(default_factory=list)

    def record(self, op: str, x: torch.Tensor, group: int) -> None:
        self.calls.append(CollectiveCall(op, x.numel() * x.element_size(), group))


class TorchCollectives:
    """The eager `Collectives` of one rank of an initialised gloo process group.

    Args:
        tp: world size of the tensor-parallel group (the default process group).
        kv_group: the flash-decoding KV subgroup of this rank and its size, or (None, 1).
    """

    def __init__(self, tp: int, kv_group: Any = None, kv_group_size: int = 1) -> None:
        self.tp, self.kv_group, self.kv_group_size = tp, kv_group, kv_group_size
        self.counter = CollectiveCounter()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x)
        self.counter.record("all_reduce", x, self.tp)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = _gather(x, self.tp, None)
        y = torch.cat(out, dim=dim)
        self.counter.record("all_gather", y, self.tp)
        return y

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        chunks = [c.contiguous() for c in x.chunk(self.tp, dim=dim)]
        assert len(chunks) == self.tp and all(c.shape == chunks[0].shape for c in chunks), (x.shape, dim)
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks)
        self.counter.record("reduce_scatter", x, self.tp)
        return out

    def group_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.kv_group_size == 1:
            return x
        y = torch.cat(_gather(x, self.kv_group_size, self.kv_group), dim=dim)
        self.counter.record("group_all_gather", y, self.kv_group_size)
        return y


def _gather(x: torch.Tensor, n: int, group: Any) -> list[torch.Tensor]:
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(out, x, group=group)
    return out
