"""Simulator exceptions: one subclass per family of hardware/compiler rule.

Messages are modelled on the real NKI compiler's (see docs/nki_simulator.md), so a kernel that fails here
fails with a recognisable message, and tests can match on the rule that was broken.
"""

from __future__ import annotations

from neuron_opt.errors import NeuronOptError


class SimulatorError(NeuronOptError):
    """A kernel broke a rule the Neuron compiler or hardware enforces."""


class PartitionError(SimulatorError):
    """Partition dimension too large, not leading, or mismatched between operands."""


class ShapeError(SimulatorError):
    """Operand shapes are inconsistent (matmul limits, reduce axes, broadcast)."""


class MemoryPlacementError(SimulatorError):
    """An operand lives in a memory the engine or instruction cannot access."""


class CapacityError(SimulatorError):
    """SBUF or PSUM capacity exceeded."""


class OutOfBoundsError(SimulatorError):
    """A tensor access exceeds the tensor's dimensions."""


class DtypeError(SimulatorError):
    """An operand has a dtype the instruction does not accept."""


class IndexingError(SimulatorError):
    """An index expression the compiler rejects (mixing basic and advanced indexing, bad mask, ...)."""


class ScopeError(SimulatorError):
    """A tile is used after the loop iteration (scope) that allocated it ended."""


class RolledLoopError(SimulatorError):
    """An `affine_range`/`sequential_range` body differs between iterations (it could not stay rolled)."""


class LoopDependencyError(SimulatorError):
    """An `affine_range` iteration depends on another (err_unexpected_output_dependencies)."""
