"""The per-row LoRA product the model computes, and the per-rank adapter stacks the graphs take.

Design decisions
- BGMV form (punica's): every target linear of every layer has A stacked `[N + 1, R, in]` and B stacked
  `[N + 1, out, R]` (this rank's shard), and each batch row a slot index `slots` [B]; row b adds
  `x_b @ A[slots[b]].T @ B[slots[b]].T` to the base linear's output. Slot 0 is all zeros: the base model's rows
  (and padding rows) add exactly 0, so one graph per bucket serves any mix of adapters and the base.
- The adapter's scale (lora_alpha / r, or / sqrt(r) with use_rslora) is folded into its B rows when it is loaded
  (in fp32, before the cast to the compute dtype), so the graphs take no scale input.
- Adapters of a smaller rank or fewer target modules are zero-padded to the compiled rank and target set: the
  padded rank columns multiply zeros, and an untargeted linear's slot is zero.
- The stacks are graph inputs, never constants: loading an adapter writes its slot in place and no graph is
  recompiled. Eager models read the stacks directly; the cpu backend passes each layer's stacks to its layer
  graph container (neuron_opt.backends.cpu.backend).
- Two forms of the same product: batched matmuls (eager), and a broadcast-and-sum that Inductor fuses into loops
  (`loop`, the cpu backend's compiled graphs: its C++ GEMM template has no batched GEMM). Same values up to
  summation order; tests compare both with PEFT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_opt.lora.config import module_shapes


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               loop: bool = False) -> torch.Tensor:
    """x [B, S, in], a [N + 1, R, in], b [N + 1, out, R], slots [B] (int64) -> [B, S, out] in x's dtype."""
    a_rows = a[slots].to(x.dtype)  # [B, R, in]
    b_rows = b[slots].to(x.dtype)  # [B, out, R]
    if loop:
        t = (x[:, :, None, :] * a_rows[:, None]).sum(-1)  # [B, S, R]
        return (t[:, :, None, :] * b_rows[:, None]).sum(-1)  # [B, S, out]
    return (x @ a_rows.transpose(1, 2)) @ b_rows.transpose(1, 2)


@dataclass
class LayerLora:
    """One layer's adapter stacks (target module -> (A, B)) and the rows' slots, as the layer's forward takes them.
    `loop`: the broadcast-and-sum form (compiled cpu graphs)."""

    slots: torch.Tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    loop: bool = False

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA term of linear `name` on its input x [B, S, in]; None when the artifact does not target it."""
        ab = self.weights.get(name)
        if ab is None:
            return None
        return lora_delta(x, ab[0], ab[1], self.slots, self.loop)

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output on x) plus linear `name`'s LoRA term."""
        d = self.delta(name, x)
        return y if d is None else y + d.to(y.dtype)


class LoraStacks:
    """One rank's adapter stacks, zero-filled: for each layer and target module A [N + 1, R, in_local] and
    B [N + 1, out_local, R] in `dtype`. Slot s (1..N) holds an adapter once `set_slot` wrote it."""

    def __init__(self, shapes: dict[str, tuple[int, int]], targets: tuple[str, ...], num_layers: int,
                 max_loras: int, rank: int, dtype: torch.dtype) -> None:
        self.targets, self.max_loras, self.rank, self.dtype = targets, max_loras, rank, dtype
        self.a = [{m: torch.zeros(max_loras + 1, rank, shapes[m][0], dtype=dtype) for m in targets}
                  for _ in range(num_layers)]
        self.b = [{m: torch.zeros(max_loras + 1, shapes[m][1], rank, dtype=dtype) for m in targets}
                  for _ in range(num_layers)]

    def layer(self, i: int, slots: torch.Tensor, loop: bool = False) -> LayerLora:
        return LayerLora(slots, {m: (self.a[i][m], self.b[i][m]) for m in self.targets}, loop)

    def layer_tensors(self, i: int) -> list[torch.Tensor]:
        """Layer i's stacks in graph-input order: A then B of each target module."""
        return [t for m in self.targets for t in (self.a[i][m], self.b[i][m])]

    def check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"lora slot {slot}: the stacks hold slots 1..{self.max_loras} (0 is the base model)")

    @torch.no_grad()
    def set_slot(self, slot: int, tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter (this rank's padded shards: (layer, module) -> (A [R, in_local], B [out_local, R]),
        adapter.rank_tensors) into `slot`; every linear it does not target is zeroed."""
        self.check_slot(slot)
        for i, (a_layer, b_layer) in enumerate(zip(self.a, self.b, strict=True)):
            for m in self.targets:
                ab = tensors.get((i, m))
                if ab is None:
                    a_layer[m][slot].zero_()
                    b_layer[m][slot].zero_()
                else:
                    a_layer[m][slot].copy_(ab[0])
                    b_layer[m][slot].copy_(ab[1])

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.check_slot(slot)
        for a_layer, b_layer in zip(self.a, self.b, strict=True):
            for m in self.targets:
                a_layer[m][slot].zero_()
                b_layer[m][slot].zero_()


@dataclass
class LoraInputs:
    """What a model's forward takes for LoRA: one rank's stacks and the rows' slots [B] (0: the base model)."""

    stacks: LoraStacks
    slots: torch.Tensor
    loop: bool = False

    def layer(self, i: int) -> LayerLora:
        return self.stacks.layer(i, self.slots, self.loop)


def stacks_for(model: torch.nn.Module, dtype: torch.dtype) -> LoraStacks | None:
    """Zero stacks for a rank model built with a LoRA capacity (`model.lora_config`, models.build), else None."""
    lc = getattr(model, "lora_config", None)
    if lc is None:
        return None
    return LoraStacks(module_shapes(model.cfg, model.layout), lc.target_modules, len(model.model.layers),
                      lc.max_loras, lc.max_lora_rank, dtype)
