"""A numpy simulator of NKI (the `neuronxcc.nki` generation that inf2/trn1 run).

Swap three imports and a kernel runs here:

    from neuron_opt import nki_sim as nki           # import neuronxcc.nki as nki
    from neuron_opt.nki_sim import language as nl   # import neuronxcc.nki.language as nl
    from neuron_opt.nki_sim import isa as nisa      # import neuronxcc.nki.isa as nisa

`nki.simulate_kernel(kernel, *arrays)` runs it; `report=True` also returns the cost Report, `count_only=True`
checks rules and counts costs without computing values. See docs/nki_simulator.md.
"""

from __future__ import annotations

from neuron_opt.nki_sim import isa, language
from neuron_opt.nki_sim.core.cost import EngineStats, Report
from neuron_opt.nki_sim.core.errors import (
    CapacityError,
    DtypeError,
    IndexingError,
    LoopDependencyError,
    MemoryPlacementError,
    OutOfBoundsError,
    PartitionError,
    RolledLoopError,
    ScopeError,
    ShapeError,
    SimulatorError,
)
from neuron_opt.nki_sim.core.targets import TARGETS, Target, get_target
from neuron_opt.nki_sim.runtime import Kernel, ShapeDtype, jit, last_report, simulate_kernel, use_target

__all__ = [
    "TARGETS",
    "CapacityError",
    "DtypeError",
    "EngineStats",
    "IndexingError",
    "Kernel",
    "LoopDependencyError",
    "MemoryPlacementError",
    "OutOfBoundsError",
    "PartitionError",
    "Report",
    "RolledLoopError",
    "ScopeError",
    "ShapeDtype",
    "ShapeError",
    "SimulatorError",
    "Target",
    "get_target",
    "isa",
    "jit",
    "language",
    "last_report",
    "simulate_kernel",
    "use_target",
]
