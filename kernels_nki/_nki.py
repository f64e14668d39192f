"""One import point for NKI: the real SDK (`neuronxcc.nki`) when it imports, else our simulator.

Kernels do `from kernels_nki._nki import nki, nl, nisa` so that the same kernel file runs on a Neuron host
(with the SDK's own `simulate_kernel`, or compiled for the device) and here on the numpy simulator
`neuron_opt.nki_sim`. The PyPI placeholder packages named like the SDK raise a plain Exception ("WRONG
PACKAGE") on import, hence the broad `except Exception`.

Host wrappers check SBUF needs against the simulator's memory model (`sbuf_capacity`), the same figure its
allocator enforces, so an input too large for a kernel is a `KernelArgumentError` before anything runs.
"""

from __future__ import annotations

import math
from typing import Any

from neuron_opt.errors import KernelArgumentError
from neuron_opt.nki_sim import get_target
from neuron_opt.nki_sim.runtime import DEFAULT_TARGET

try:  # pragma: no cover - only on hosts with the Neuron SDK
    import neuronxcc.nki as nki
    import neuronxcc.nki.isa as nisa
    import neuronxcc.nki.language as nl

    HAVE_SDK = True
except Exception:  # noqa: BLE001 - placeholders raise Exception, not ImportError
    from neuron_opt import nki_sim as nki
    from neuron_opt.nki_sim import isa as nisa
    from neuron_opt.nki_sim import language as nl

    HAVE_SDK = False

__all__ = ["DEFAULT_TARGET", "HAVE_SDK", "check_softcap", "nisa", "nki", "nl", "sbuf_capacity", "simulate"]


def simulate(kernel: Any, *arrays: Any, **kwargs: Any) -> Any:
    """Runs `kernel` (a jitted kernel, grid already applied: `kernel[b, h]`) on numpy arrays.

    Args:
        kernel: The kernel, launched with its SPMD grid if it has one.
        *arrays: Numpy inputs in the kernel's own layouts.
        **kwargs: Compile-time keyword arguments of the kernel.

    Returns:
        What the kernel returns, as numpy arrays (a tuple when it returns several).
    """
    return nki.simulate_kernel(kernel, *arrays, **kwargs)


def sbuf_capacity(target: str = DEFAULT_TARGET) -> int:
    """SBUF bytes per partition a kernel may use on `target` (`nl.tile_size.total_available_sbuf_size`).

    Host wrappers check against the simulator's default target (trn1; inf2 has the same figure, trn2 more).
    """
    return get_target(target).sbuf_usable_bytes_per_partition


def check_softcap(what: str, softcap: float | None) -> None:
    """An attention kernel's soft-cap (scaled scores x -> softcap * tanh(x / softcap)): a finite number > 0, or None
    for none."""
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise KernelArgumentError(f"{what}: softcap must be a finite number > 0 (or None: no capping), got "
                                  f"{softcap!r}")
