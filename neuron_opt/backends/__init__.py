"""Backends behind one narrow interface (base.Backend): eager (reference), cpu (AOT-compiled), neuron (torch-xla:
NeuronCores, or torch-xla's CPU device)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from neuron_opt.errors import ConfigError

if TYPE_CHECKING:
    from neuron_opt.backends.base import Backend

BACKENDS = ("eager", "cpu", "neuron")


def check_backend_tp(name: str, tp: int) -> None:
    """The tp degrees a backend compiles: cpu graphs are single-rank (tp > 1 runs as gloo ranks: eager)."""
    if name == "cpu" and tp != 1:
        raise ConfigError(f"backend: the cpu backend compiles tp=1 only, got --tp {tp}; use --backend eager (gloo "
                          "rank processes) or --backend neuron (one SPMD program) for tp > 1")


def get_backend(name: str, dtype: torch.dtype, options: dict[str, Any] | None = None, for_compile: bool = False,
                tp: int = 1) -> Backend:
    """The backend `name`. For the neuron backend, `for_compile` turns on XLA's HLO dump (the artifact's HLO is
    written from it) and `tp` sets up the SPMD devices; both must happen before torch_xla is first imported."""
    if name == "eager":
        from neuron_opt.backends.eager import EagerBackend

        return EagerBackend(dtype, options)
    if name == "cpu":
        from neuron_opt.backends.cpu import CpuBackend

        return CpuBackend(dtype, options)
    if name == "neuron":
        from neuron_opt.backends.neuron import NeuronBackend

        return NeuronBackend(dtype, options, dump=for_compile, tp=tp)
    raise ConfigError(f"backend: unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
