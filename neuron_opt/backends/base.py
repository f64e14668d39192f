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
from neuron_opt.config import CacheConfig


@dataclass(frozen=True)
class StepInputs:
    """Graph inputs of one step, exactly the bucket's shape (int64)."""

    input_ids: torch.Tensor  # [B, S] token ids; pads are 0
    positions: torch.Tensor  # [B, S] absolute position of each token (pads: any position < max_model_len)
    slot_mapping: torch.Tensor  # [B, S] where each token's K/V go: block * block_size + offset; pads: 0 (null)
    block_tables: torch.Tensor  # [B, nb] each row's blocks in logical order, padded with the null block 0
    last_index: torch.Tensor  # [B] index along S whose logits are returned; verify steps: [B, S], every index

    def arrays(self) -> tuple[torch.Tensor, ...]:
        """The five inputs in the order every graph takes them."""
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.last_index)


class Executor(Protocol):
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]

    def run(self, bucket: Bucket, inputs: StepInputs) -> torch.Tensor:
        """fp32 logits [B, V_local] of the rows' `last_index` tokens ([B, S, V_local] for a verify step)."""
        ...


ModelFactory = Callable[[], torch.nn.Module]


class Backend(Protocol):
    name: str

    def compile_bucket(self, model: torch.nn.Module, bucket: Bucket, cache: CacheConfig, out_dir: Path) -> list[Path]:
        ...

    def save_weights(self, model: torch.nn.Module, path: Path) -> None:
        ...

    def load(self, graph_files: dict[Bucket, list[Path]], weights_path: Path, model_factory: ModelFactory,
             cache: CacheConfig) -> Executor:
        ...


def kv_dtype(cache: CacheConfig, compute: torch.dtype) -> torch.dtype:
    """The KV pools' dtype: fp8 e4m3 under `--kv-cache-dtype fp8`, else the compute dtype."""
    return torch.float8_e4m3fn if cache.dtype == "float8_e4m3fn" else compute


def allocate_kv(model: torch.nn.Module, cache: CacheConfig,
                dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V block pools [num_blocks, n_kv_local, block_size (/ g), D], zero-filled, in `dtype` (the
    compute dtype) or in fp8 e4m3 when the cache config says so."""
    dtype = kv_dtype(cache, dtype)
    shape = model.kv_shape(cache.num_blocks, cache.block_size)
    L = len(model.model.layers)
    return [torch.zeros(shape, dtype=dtype) for _ in range(L)], [torch.zeros(shape, dtype=dtype) for _ in range(L)]
