"""The one factory that decides how a model runs: in this process, as gloo rank processes, or as one SPMD program.

Design decisions
- The choice is made once, here, from what the artifact's manifest says (its backend and tp) or, for an
  uncompiled run, from the checkpoint spec (the eager backend and the tp asked for). Nothing else branches on a
  backend's name: the backend's class states whether its graphs hold the collectives (`Backend.spmd`) and how
  its ranks map to compile units (`Backend.compile_units`), the same units `compile` wrote.
- Three kinds:
  single  tp = 1: the backend's own executor, in this process (`Backend.load_unit` of the one rank).
  spmd    tp > 1 on a backend whose graphs hold the collectives: every rank in one program, in this process
          (`Backend.load_unit` of the one unit holding every rank; the rank models built with its collectives).
  ranks   tp > 1 on the others: `tp` rank processes running the eager model with gloo collectives between ops
          (neuron_opt.executors.tp); the only place rank processes are started.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.build import apply_lora_capacity, model_class, rank_model_factory
from neuron_opt.backends import backend_class, get_backend
from neuron_opt.backends.base import Backend, Executor
from neuron_opt.backends.eager import EagerBackend, EagerExecutor
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig, torch_dtype
from neuron_opt.executors.tp import launch_tp_executor, tp_executor_from_state_dict
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel import ParallelContext, head_layout
from neuron_opt.weights import load_weights

SINGLE, SPMD, RANKS = "single", "spmd", "ranks"


def executor_kind(backend: type[Backend], tp: int) -> str:
    """How `tp` ranks of `backend`'s graphs run: SINGLE, SPMD or RANKS (module docstring)."""
    if tp == 1:
        return SINGLE
    return SPMD if backend.spmd else RANKS


@dataclass(frozen=True)
class ArtifactSpec:
    """A compiled artifact: its directory and its (verified) manifest."""

    root: Path
    manifest: Any  # neuron_opt.artifact.Manifest


@dataclass(frozen=True)
class CheckpointSpec:
    """An uncompiled run: a checkpoint's canonical (HF-named) weights on the eager backend."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    parallel: ParallelConfig
    cache: CacheConfig
    dtype: str = "float32"
    lora: LoraConfig | None = None  # a LoRA capacity: the model takes adapters (neuron_opt.lora)


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], max_model_len: int,
                dtype: torch.dtype, lora: LoraConfig | None = None) -> torch.nn.Module:
    """A single-rank model with the given (canonical, HF-named) weights (`lora`: its LoRA capacity)."""
    model = model_class(cfg)(cfg, head_layout(cfg, ParallelConfig()), max_model_len)
    apply_lora_capacity(model, lora)
    load_weights(model, state_dict, "checkpoint")
    return model.to(dtype).eval()


def prepare(spec: ArtifactSpec | CheckpointSpec) -> None:
    """What the spec's backend needs before anything else in the process imports its runtime (the neuron
    backend's SPMD devices); `create_executor` does it too."""
    if isinstance(spec, ArtifactSpec):
        backend_class(spec.manifest.backend).prepare(spec.manifest.parallel.tp, for_compile=False)


def create_executor(spec: ArtifactSpec | CheckpointSpec) -> Executor:
    """The executor for `spec` (module docstring): rank processes are started for RANKS, the device program
    built for SPMD; in every case each rank loads only its own weights."""
    if isinstance(spec, CheckpointSpec):
        return _checkpoint_executor(spec)
    root, m = Path(spec.root), spec.manifest
    cls = backend_class(m.backend)
    tp = m.parallel.tp
    prepare(spec)
    if executor_kind(cls, tp) == RANKS:
        return launch_tp_executor(root, m)
    (unit,) = cls.compile_units(tp)  # SINGLE and SPMD: one unit holds every rank
    dtype = torch_dtype(m.dtype)
    backend = get_backend(m.backend, dtype, m.backend_options, tp=tp)
    comm = backend.rank_collectives(tp, head_layout(m.model, m.parallel).kv_seq_shards)
    contexts = [None if comm is None else ParallelContext(tp, r, comm, m.parallel.sequence_parallel)
                for r in unit.ranks]
    factories = [rank_model_factory(m.model, m.parallel, m.cache, r, dtype, ctx, quant=m.quant, lora=m.lora)
                 for r, ctx in zip(unit.ranks, contexts, strict=True)]
    where = tuple(unit.graph_dir.split("/"))
    files = {b: [f for f in fs if f.relative_to(root).parts[:len(where)] == where]
             for b, fs in m.bucket_files(root).items()}
    weights = [root / "weights" / f"rank{r}.safetensors" for r in unit.ranks]
    return backend.load_unit(files, weights, factories, m.cache)


def _checkpoint_executor(spec: CheckpointSpec) -> Executor:
    if executor_kind(EagerBackend, spec.parallel.tp) == RANKS:
        return tp_executor_from_state_dict(spec.config, spec.state_dict, spec.parallel, spec.cache, dtype=spec.dtype,
                                           lora=spec.lora)
    model = build_model(spec.config, spec.state_dict, spec.cache.max_model_len, torch_dtype(spec.dtype), spec.lora)
    return EagerExecutor(model, spec.cache)
