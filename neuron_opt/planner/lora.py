"""LoRA adapters in a plan (`plan --max-loras N --max-lora-rank R`; docs/lora.md): the adapter stacks' bytes per
rank, and the per-row adapter product's (BGMV's) share of a step.

Design decisions
- Memory: every target linear of every layer holds A [N + 1, R, in_local] and B [N + 1, out_local, R] (slot 0 is
  the base model's zeros) in the compute dtype, sharded as its base layer (neuron_opt.lora.config.module_shapes:
  column-parallel linears split B's rows, row-parallel ones A's columns). This is exactly what the executor
  allocates (neuron_opt.lora.ops.LoraStacks), which a test checks against a compiled artifact.
- FLOPs: each token adds 2 R (in_local + out_local) per target linear per layer (x A^T, then that times B^T),
  whatever its adapter: padded rank columns and the base model's zero slot are computed too.
- Bytes: each row reads its own adapter's A and B slices, R (in_local + out_local) elements per target linear per
  layer. An upper bound: rows under one adapter read the same slices, which a kernel may read once.
"""

from __future__ import annotations

from neuron_opt.config import ModelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.lora.config import LoraConfig, module_shapes
from neuron_opt.parallel.sharding import HeadLayout


def _per_layer_elements(cfg: ModelConfig, lay: HeadLayout, lora: LoraConfig) -> int:
    """R (in_local + out_local) summed over the target linears of one layer: one adapter's A and B on this rank."""
    if cfg.is_moe:
        raise ConfigError(f"max_loras: LoRA adapters are served on dense models only, not on {cfg.architecture}",
                          param="max_loras")
    shapes = module_shapes(cfg, lay)
    return lora.max_lora_rank * sum(shapes[m][0] + shapes[m][1] for m in lora.target_modules)


def adapter_bytes(cfg: ModelConfig, lay: HeadLayout, lora: LoraConfig, act_bytes: int) -> int:
    """Bytes of one rank's adapter stacks: max_loras + 1 slots of every target linear of every layer."""
    return (lora.max_loras + 1) * cfg.num_hidden_layers * _per_layer_elements(cfg, lay, lora) * act_bytes


def bgmv_step(cfg: ModelConfig, lay: HeadLayout, lora: LoraConfig, *, rows: int, tokens: int,
              act_bytes: int) -> tuple[float, int]:
    """(FLOPs, bytes read) of the adapter products of one step of `rows` batch rows holding `tokens` tokens."""
    per_layer = _per_layer_elements(cfg, lay, lora)
    return 2.0 * tokens * cfg.num_hidden_layers * per_layer, rows * cfg.num_hidden_layers * per_layer * act_bytes
