"""Helpers every instruction uses: allocate results, validate operands, read operand values.

Engines compute in fp32 (nki.md 3.1): `values()` returns fp32 (int64 for integer tiles, so integer ALU ops
stay exact), and results are rounded once when written into their destination dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import dtypes
from neuron_opt.nki_sim.core.context import SimContext, current
from neuron_opt.nki_sim.core.errors import CapacityError, MemoryPlacementError, PartitionError, SimulatorError
from neuron_opt.nki_sim.core.memory import PMAX, Buffer, Storage, check_partition_size, new_data
from neuron_opt.nki_sim.core.tile import Tile

ONCHIP = ("psum", "sbuf")


def new_tile(
    shape: tuple[int, ...],
    dtype: Any,
    buffer: Buffer,
    *,
    par_axis: int | None = None,
    fill: Any = None,
    name: str = "",
    temporary: bool = False,
) -> Tile:
    """Allocate a tensor. On chip: partition axis checked (<= 128) and memory accounted.

    `temporary` marks an instruction result: if it does not fit, the tile is still created but any use other
    than assigning it into another tile raises the capacity error (the hardware writes results straight into
    their destination, so a result that is immediately assigned never occupies memory of its own).
    """
    ctx = current()
    dt = dtypes.normalize(dtype)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise SimulatorError(f"negative dimension in shape {shape}")
    if buffer.is_hbm:
        par_axis = None
    else:
        if not shape:
            raise PartitionError("an on-chip tile needs at least one dimension (the partition dimension)")
        par_axis = 0 if par_axis is None else par_axis
        check_partition_size(shape[par_axis], f"tile of shape {list(shape)} in {buffer.value}")
    st = Storage(shape, dt, buffer, par_axis, new_data(shape, dt, ctx.count_only, fill), name)
    tile = Tile(st)
    if not buffer.is_hbm:
        try:
            ctx.register(st)
        except CapacityError as exc:
            if not temporary:
                raise
            tile.unplaced = exc
    return tile


def result(
    ctx: SimContext, shape: tuple[int, ...], dtype: Any, buffer: Buffer, values: np.ndarray | None
) -> Tile:
    """A fresh instruction result holding `values` (fp32, before rounding)."""
    t = new_tile(shape, dtype, buffer, temporary=True)
    t.fresh = True
    ctx.cost.timeline.access(t.storage.serial, t.box(), "write")  # written by the instruction just issued
    if values is not None and not ctx.count_only:
        v = np.broadcast_to(values, t.shape)
        t.exact = v
        t.storage.data[...] = dtypes.cast(v, t.dtype)  # type: ignore[index]
    return t


def operand(x: Any, arg: str, op: str, spaces: Iterable[str] = ONCHIP, access: str | None = "read") -> Tile:
    """Validate a tile operand: a live Tile in one of the allowed address spaces.

    `access` is what the instruction does with it, for the affine_range independence rule: `read` (inputs), or
    None where the caller records the write itself (destinations, with their masks).
    """
    if not isinstance(x, Tile):
        raise SimulatorError(f"operand '{arg}' of '{op}' must be a tile, got {type(x).__name__}")
    x.check_alive()
    spaces = tuple(spaces)
    if x.buffer.space not in spaces:
        raise MemoryPlacementError(
            f"Expected operand '{arg}' of '{op}' to be in address space '{'|'.join(spaces)}', "
            "but got a tile in "
            f"'{x.buffer.space}' instead."
        )
    if not x.buffer.is_hbm and x.partitions > PMAX:
        check_partition_size(x.partitions, f"operand '{arg}' of '{op}'")
    if access is not None:
        current().access(x, access)
    return x


def values(ctx: SimContext, x: Tile, mask: np.ndarray | None = None) -> Any:
    """Operand values as engines see them (fp32; int64 for integer tiles); None in count-only mode."""
    x.check_bounds(mask)
    if ctx.count_only:
        return None
    if x.fresh and x.exact is not None:
        return x.exact
    v = x.read(mask)
    if dtypes.is_float(x.dtype):
        return dtypes.to_f32(v)
    return v.astype(np.int64)


def check_same_partitions(op: str, a: Tile, b: Tile, an: str = "data1", bn: str = "data2") -> None:
    if a.partitions != b.partitions:
        raise PartitionError(
            f"number of partitions (dimension 0 size of a tile) mismatch in parameters ({an}{list(a.shape)}, "
            f"{bn}{list(b.shape)}) of '{op}'"
        )
