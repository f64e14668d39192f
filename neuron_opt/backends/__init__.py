"""Backends behind one narrow interface (see base.py): eager (reference), cpu (AOT-compiled), neuron (SDK)."""

from __future__ import annotations

from typing import Any

import torch

from neuron_opt.errors import ConfigError

BACKENDS = ("eager", "cpu", "neuron")


def get_backend(name: str, dtype: torch.dtype, options: dict[str, Any] | None = None, for_compile: bool = False,
                tp: int = 1):
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
