"""LoRA adapter stacks on the neuron backend's device: held like the KV caches, written in place (docs/lora.md).

Design decisions
- The stacks are device state, allocated once when the device program is built: for each layer and target
  linear, A `[N + 1, R, in]` and B `[N + 1, out, R]` at tp=1; at tp > 1 every rank's shard stacked on a leading
  rank dimension, `[tp, N + 1, R, in_local]` / `[tp, N + 1, out_local, R]`, sharded on it (device r holds rank r's
  shard, as the SPMD weights and KV pools are). Slot 0 stays zero: the base model's rows and padding rows.
- Every bucket's graph takes them as parameters (never constants) beside one step input, the rows' slots [B];
  the per-row product is neuron_opt.lora.ops's batched-matmul form (a gather of each row's A and B, then two
  batched GEMMs), added to the base projection, and for row-parallel linears before the base layer's
  all-reduce. A step moves only the slots in besides the usual step inputs: the stacks never leave the device.
- Writing a slot is one small graph of its own: an `index_copy` of every stack at the slot, with the slot itself
  a device tensor and the new rows always given for every (layer, module) (zeros where the adapter has none), so
  the graph is the same for every adapter and every slot. It is compiled when the stacks are built (by clearing
  slot 1), so loading, evicting or replacing adapters compiles nothing. The stacks are updated in place (torch-xla
  aliases an updated device tensor's buffer to its output), so a write costs the adapter's size, not N of them.
- Adapters are sharded per rank by neuron_opt.lora.adapter.rank_tensors, the rule the eager ranks use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from neuron_opt.lora.adapter import LoraAdapter, rank_tensors
from neuron_opt.lora.config import LoraConfig, module_shapes
from neuron_opt.lora.ops import LayerLora


@dataclass
class StackView:
    """Layer-wise views of stacks as one rank's model reads them (neuron_opt.lora.ops.LoraInputs's `stacks`):
    a[i][module], b[i][module]."""

    targets: tuple[str, ...]
    a: list[dict[str, torch.Tensor]]
    b: list[dict[str, torch.Tensor]]

    def layer(self, i: int, slots: torch.Tensor, loop: bool = False) -> LayerLora:
        return LayerLora(slots, {m: (self.a[i][m], self.b[i][m]) for m in self.targets}, loop)


@dataclass(frozen=True)
class _RankShape:
    """What sharding an adapter needs of one rank model (its weights are not kept)."""

    cfg: Any
    layout: Any
    rank: int


class DeviceLora:
    """One device program's adapter stacks (tp=1 or every rank of an SPMD program) and their slot writes.

    Args:
        models: the rank models, in rank order (built with a LoRA capacity: `model.lora_config`).
        dtype: the stacks' dtype (the model's compute dtype).
        xla: the torch_xla module; device: the XLA device.
        shard: tp > 1: marks a `[tp, ...]` device tensor sharded on dim 0 over the program's mesh.
    """

    def __init__(self, models: list[torch.nn.Module], dtype: torch.dtype, xla: ModuleType, device: Any,
                 shard: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.config: LoraConfig = models[0].lora_config
        self.xla, self.device, self.dtype, self.shard = xla, device, dtype, shard
        self.tp = len(models)
        if self.tp > 1 and shard is None:
            raise ValueError("DeviceLora: tp > 1 needs the program's sharding (shard=)")
        self.ranks = [_RankShape(m.cfg, m.layout, m.pctx.rank) for m in models]
        self.shapes = module_shapes(models[0].cfg, models[0].layout)  # (in, out) per module, the same on every rank
        self.num_layers = len(models[0].model.layers)
        n, r = self.config.max_loras + 1, self.config.max_lora_rank
        lead = (self.tp,) if self.tp > 1 else ()
        self.a = [{m: self._place(torch.zeros(*lead, n, r, self.shapes[m][0], dtype=dtype, device=device))
                   for m in self.config.target_modules} for _ in range(self.num_layers)]
        self.b = [{m: self._place(torch.zeros(*lead, n, self.shapes[m][1], r, dtype=dtype, device=device))
                   for m in self.config.target_modules} for _ in range(self.num_layers)]
        xla.sync()  # the stacks become device data before any graph takes them
        self.write(1, None)  # compiles the slot-write graph now, so no later load compiles anything

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        return self.shard(t) if self.shard is not None else t

    def tensors(self) -> list[torch.Tensor]:
        """Every stack in graph-parameter order: per layer, A then B of each target module."""
        return [t for i in range(self.num_layers) for m in self.config.target_modules
                for t in (self.a[i][m], self.b[i][m])]

    def view(self, enter: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StackView:
        """The stacks as the rank model reads them; `enter` maps each (at tp > 1: into the manual-sharding
        region, this device's [N + 1, ...] shard)."""
        f = enter or (lambda t: t)
        return StackView(self.config.target_modules, [{m: f(t) for m, t in layer.items()} for layer in self.a],
                         [{m: f(t) for m, t in layer.items()} for layer in self.b])

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 1 <= slot <= self.config.max_loras:
            raise ValueError(f"lora slot {slot}: the stacks hold slots 1..{self.config.max_loras} (0 is the base "
                             "model)")

    @torch.no_grad()
    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write `adapter` (None: zeros) into `slot` of every stack, each rank its own shard, in place on the
        device; every linear the adapter does not target is zeroed. The same graph for any adapter and slot."""
        self.check_slot(slot)
        R = self.config.max_lora_rank
        per_rank = [{} if adapter is None else rank_tensors(adapter, s.cfg, s.layout, self.config, s.rank)
                    for s in self.ranks]
        idx = torch.tensor([slot], dtype=torch.int64).to(self.device)  # device data: not baked into the graph
        for i in range(self.num_layers):
            for m in self.config.target_modules:
                in_f, out_f = self.shapes[m]
                zero_a, zero_b = torch.zeros(R, in_f), torch.zeros(out_f, R)
                for j, (stack, zero) in enumerate(((self.a[i][m], zero_a), (self.b[i][m], zero_b))):
                    rows = [pr[(i, m)][j] if (i, m) in pr else zero for pr in per_rank]
                    if self.tp > 1:  # [tp, 1, R, in_local] / [tp, 1, out_local, R], sharded like the stack
                        new = self._place(torch.stack(rows)[:, None].to(self.dtype).to(self.device))
                        stack.index_copy_(1, idx, new)
                    else:
                        stack.index_copy_(0, idx, rows[0][None].to(self.dtype).to(self.device))
        self.xla.sync()
