"""The one narrow interface every backend implements.

A backend turns a model (one rank's shard) into per-bucket graphs on disk at compile time, and at load time into
an `Executor` that runs a bucket's graph on named inputs. The executor owns the KV caches; every bucket's graph
reads and writes the same cache buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from neuron_opt.buckets import Bucket


@dataclass(frozen=True)
class StepInputs:
    """Graph inputs of one step, exactly the bucket's shape (int64)."""

    input_ids: torch.Tensor  # [B, S] token ids; pads are 0
    positions: torch.Tensor  # [B, S] absolute position of each token; prompt pads continue past the prompt
    slot_ids: torch.Tensor  # [B] KV cache line of each row; padded rows use the scratch slot
    last_index: torch.Tensor  # [B] index along S whose logits are returned; verify steps: [B, S], every index


class Executor(Protocol):
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]

    def run(self, bucket: Bucket, inputs: StepInputs) -> torch.Tensor:
        """fp32 logits [B, V_local] of the rows' `last_index` tokens ([B, S, V_local] for a verify step)."""
        ...


ModelFactory = Callable[[], torch.nn.Module]


class Backend(Protocol):
    name: str

    def compile_bucket(self, model: torch.nn.Module, bucket: Bucket, num_slots: int, out_dir: Path) -> list[Path]:
        ...

    def save_weights(self, model: torch.nn.Module, path: Path) -> None:
        ...

    def load(self, graph_files: dict[Bucket, list[Path]], weights_path: Path, model_factory: ModelFactory,
             num_slots: int) -> Executor:
        ...


def allocate_kv(model: torch.nn.Module, num_slots: int,
                dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V buffers [num_slots, n_kv_local, max_model_len, D], zero-filled."""
    shape = model.kv_shape(num_slots)
    L = len(model.model.layers)
    return [torch.zeros(shape, dtype=dtype) for _ in range(L)], [torch.zeros(shape, dtype=dtype) for _ in range(L)]
