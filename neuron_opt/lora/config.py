"""The compile-time LoRA capacity of an artifact: how many adapters run at once, their largest rank, and which
linears carry an adapter path. Adapters themselves are run-time data (docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron_opt.errors import ConfigError

# vLLM's names for `--lora-target-modules`; every attention and MLP projection by default
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_TARGETS + MLP_TARGETS
ROW_PARALLEL = ("o_proj", "down_proj")  # A split on its input features under tp; the others split B on outputs
MAX_LORA_RANK = 512  # PEFT allows any rank; beyond this the adapter costs more than a small model's layer


@dataclass(frozen=True)
class LoraConfig:
    """`max_loras` adapter slots of rank up to `max_lora_rank` on the linears `target_modules` (in TARGET_MODULES'
    order). Slot 0 of every stack is zero: the base model's rows."""

    max_loras: int
    max_lora_rank: int
    target_modules: tuple[str, ...] = TARGET_MODULES

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ConfigError(f"max_loras: must be an integer >= 1, got {self.max_loras!r}", param="max_loras")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ConfigError(f"max_lora_rank: must be an integer in 1..{MAX_LORA_RANK}, got {self.max_lora_rank!r}",
                              param="max_lora_rank")
        targets = tuple(self.target_modules)
        unknown = [t for t in targets if t not in TARGET_MODULES]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise ConfigError(f"lora_target_modules: expected distinct names among {list(TARGET_MODULES)}, got "
                              f"{list(targets)}", param="lora_target_modules")
        object.__setattr__(self, "target_modules", tuple(t for t in TARGET_MODULES if t in targets))

    def to_dict(self) -> dict[str, Any]:
        return {"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoraConfig:
        return cls(int(d["max_loras"]), int(d["max_lora_rank"]), tuple(d["target_modules"]))


def module_shapes(cfg: Any, layout: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target linear on one rank of `layout` (models.llama's shapes)."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv, inter = layout.n_heads_local * D, layout.n_kv_local * D, layout.intermediate_local
    return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, inter), "up_proj": (H, inter), "down_proj": (inter, H)}


def full_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target linear of the unsharded model (a PEFT adapter's shapes)."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.intermediate_size
    return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, inter), "up_proj": (H, inter), "down_proj": (inter, H)}
