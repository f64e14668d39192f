"""Kernel launch: `jit`, SPMD grids, `simulate_kernel`, reports.

How a caller gets the cost report: `simulate_kernel(kernel, *args, report=True)` returns `(outputs, report)`;
code that must keep the real SDK's call shape (e.g. `kernel(*args)` or `simulate_kernel(kernel, *args)`)
reads `last_report()` afterwards.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import dtypes
from neuron_opt.nki_sim.core.context import SimContext, activate, maybe_current
from neuron_opt.nki_sim.core.cost import Report
from neuron_opt.nki_sim.core.engines_dma import wrap_input
from neuron_opt.nki_sim.core.errors import MemoryPlacementError, SimulatorError
from neuron_opt.nki_sim.core.targets import get_target
from neuron_opt.nki_sim.core.tile import Tile

DEFAULT_TARGET = "trn1"
_target_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("nki_sim_target", default=None)
_last_report: list[Report | None] = [None]  # the report of the most recent top-level run (see module doc)


@dataclass(frozen=True)
class ShapeDtype:
    """Stand-in for an input array in count-only runs: the kernel sees its shape and dtype, no data."""

    shape: tuple[int, ...]
    dtype: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", dtypes.normalize(self.dtype))


@contextmanager
def use_target(name: str) -> Iterator[None]:
    """Select the target for runs that do not pass `target=` (e.g. kernels called directly)."""
    get_target(name)
    token = _target_override.set(name)
    try:
        yield
    finally:
        _target_override.reset(token)


def last_report() -> Report | None:
    """Cost report of the most recent top-level kernel run in this process."""
    return _last_report[0]


class Kernel:
    """A decorated NKI kernel. `kernel[a, b]` launches an SPMD grid; calling it runs it on the simulator."""

    def __init__(self, func: Callable[..., Any], grid: tuple[int, ...] = ()) -> None:
        self.func = func
        self.grid = grid
        functools.update_wrapper(self, func)

    def __getitem__(self, grid: Any) -> Kernel:
        g = grid if isinstance(grid, tuple) else (grid,)
        if self.grid:
            raise SimulatorError("nested SPMD grids are not supported (err_nested_kernel_with_spmd_grid)")
        return Kernel(self.func, tuple(int(x) for x in g))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if maybe_current() is not None:
            if self.grid:
                raise SimulatorError("a kernel with an SPMD grid cannot be called from inside another kernel")
            return self.func(*args, **kwargs)  # sub-kernel: inlined into the running kernel
        return simulate_kernel(self, *args, **kwargs)


def jit(func: Callable[..., Any] | None = None, mode: str = "auto", **kwargs: Any) -> Any:
    """`@nki.jit` / `@nki.jit(mode=...)`: every mode runs on this simulator."""
    if func is None:
        return lambda f: Kernel(f)
    return Kernel(func)


def simulate_kernel(
    kernel: Any,
    *args: Any,
    target: str | None = None,
    count_only: bool = False,
    report: bool = False,
    **kwargs: Any,
) -> Any:
    """Run a kernel on numpy inputs and return its outputs as numpy arrays.

    Args:
        kernel: a `@jit` kernel (optionally with a grid, `kernel[b, h]`) or a plain function.
        *args: numpy arrays (HBM inputs, updated in place if the kernel writes them) or other values; in
            count-only mode `ShapeDtype` stand-ins are accepted.
        target: `trn1` (default), `inf2` or `trn2`; else the `use_target` context's.
        count_only: check rules and count costs without computing values (outputs are None).
        report: also return the cost Report.
        **kwargs: keyword arguments of the kernel.

    Returns:
        The kernel's outputs (numpy arrays; tuples preserved), or `(outputs, report)` if `report`.
    """
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    tgt = get_target(target or _target_override.get() or DEFAULT_TARGET)
    ctx = SimContext(tgt, count_only)
    with activate(ctx):
        names = _param_names(k.func, len(args))
        wrapped = [wrap_input(a, n) for a, n in zip(args, names, strict=True)]
        wkw = {n: wrap_input(v, n) for n, v in kwargs.items()}
        out: Any = None
        grid = k.grid or ()
        ctx.grid = grid
        static = 0
        for pid in itertools.product(*(range(g) for g in grid)) if grid else [()]:
            ctx.program_ids = tuple(pid)
            ctx.shared_index = 0
            ctx.loops.static_instructions = 0
            with ctx.scope():
                out = k.func(*wrapped, **wkw)
                result = _to_numpy(out, count_only)
            static = max(static, ctx.loops.static_instructions)
        rep = ctx.cost.report(ctx.allocator.sbuf_peak, ctx.allocator.banks_peak, static)
    _last_report[0] = rep
    return (result, rep) if report else result


def _param_names(func: Callable[..., Any], n: int) -> list[str]:
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


def _to_numpy(out: Any, count_only: bool) -> Any:
    if isinstance(out, Tile):
        if not out.buffer.is_hbm:
            raise MemoryPlacementError(
                f"kernel output {out.name} is in {out.buffer.value}; kernel outputs must be HBM tensors "
                "(allocate with nl.ndarray(..., buffer=nl.shared_hbm) and nl.store into it)"
            )
        if count_only:
            return None
        return np.array(out.read(), copy=True)
    if isinstance(out, (tuple, list)):
        return type(out)(_to_numpy(o, count_only) for o in out)
    return out
