"""Backends behind one interface (base.Backend): eager (reference), cpu (AOT-compiled), neuron (torch-xla:
NeuronCores, or torch-xla's CPU device). The only place that maps a backend's name to its class."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from neuron_opt.errors import ConfigError

if TYPE_CHECKING:
    from neuron_opt.backends.base import Backend

BACKENDS = ("eager", "cpu", "neuron")


def backend_class(name: str) -> type[Backend]:
    """The class of backend `name` (importing it imports no device runtime)."""
    # each backend's module only when its name is asked for: the CLI's parser imports this package
    if name == "eager":
        from neuron_opt.backends.eager import EagerBackend

        return EagerBackend
    if name == "cpu":
        from neuron_opt.backends.cpu.backend import CpuBackend

        return CpuBackend
    if name == "neuron":
        from neuron_opt.backends.neuron.backend import NeuronBackend

        return NeuronBackend
    raise ConfigError(f"backend: unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


def get_backend(name: str, dtype: torch.dtype, options: dict[str, Any] | None = None, for_compile: bool = False,
                tp: int = 1) -> Backend:
    """The backend `name`. For the neuron backend, `for_compile` turns on XLA's HLO dump (the artifact's HLO is
    written from it) and `tp` sets up the SPMD devices; both must happen before torch_xla is first imported."""
    return backend_class(name).create(dtype, options, for_compile, tp)
