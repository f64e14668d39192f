"""Start `tp` rank processes on this machine, without torchrun.

Design decisions
- The driver (the process that owns the runner) is not a rank. It starts tp workers with the `spawn` start
  method (fork is unsafe with torch's thread pools), talks to each over its own `multiprocessing` pipe, and
  never joins the process group. That keeps torch.distributed's process-global state out of the driver, so
  one Python process can hold several TP executors (tests, benchmarks) and a dying rank can never hang it.
- Ranks rendezvous over TCP on a free loopback port (bind to port 0, read it back). The tiny window between
  closing the probe socket and rank 0 binding it is the usual trade-off of this trick; a clash shows up as a
  clear start-up error, not a hang.
- Each rank reads only `weights/rank{r}.safetensors`, written once by `write_rank_weights`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig, QuantConfig
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel.sharding import HeadLayout, head_layout, shard_state_dict


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its model (picklable; sent once at start-up)."""

    model: ModelConfig
    parallel: ParallelConfig
    cache: CacheConfig
    weights_dir: str  # holds rank{r}.safetensors
    dtype: str = "float32"
    collective_timeout_s: float = 60.0
    threads_per_rank: int = 1
    quant: QuantConfig | None = None  # quantized decoder linears (models.build.apply_quant_layout)
    lora: LoraConfig | None = None  # the LoRA capacity (models.build.apply_lora_capacity): adapter stacks per rank

    @property
    def layout(self) -> HeadLayout:
        return head_layout(self.model, self.parallel)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_threads(tp: int) -> int:
    """Intra-op threads per rank: the cores split evenly, at least one (oversubscription only slows gloo)."""
    return max(1, (os.cpu_count() or 1) // tp)


def write_rank_weights(
    sd: dict[str, torch.Tensor],
    cfg: ModelConfig,
    par: ParallelConfig,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
) -> list[Path]:
    """Shard a canonical (HF-named) state dict and write weights/rank{r}.safetensors for every rank."""
    lay = head_layout(cfg, par)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(par.tp):
        shard = shard_state_dict(sd, cfg, lay, rank)
        if cfg.tie_word_embeddings:
            shard.pop("lm_head.weight", None)  # tied to the embedding shard; stored once
        path = out_dir / f"rank{rank}.safetensors"
        save_file({k: v.to(dtype).contiguous() for k, v in shard.items()}, str(path))
        paths.append(path)
    return paths
