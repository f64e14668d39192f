"""`nki.isa` (as `nisa`) of the legacy `neuronxcc.nki` API: instructions that return their result tile.

Swap `import neuronxcc.nki.isa as nisa` for `import neuron_opt.nki_sim.isa as nisa`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import dtypes as _dt
from neuron_opt.nki_sim.core import engines_dma as _dma
from neuron_opt.nki_sim.core import engines_tensor as _pe
from neuron_opt.nki_sim.core import engines_vector as _ve
from neuron_opt.nki_sim.core.context import current as _current
from neuron_opt.nki_sim.core.errors import IndexingError, PartitionError, ShapeError, SimulatorError
from neuron_opt.nki_sim.core.instr import operand as _operand
from neuron_opt.nki_sim.core.tile import Tile


class engine:  # noqa: N801 - NKI spelling
    """Engine selector for instructions that can run on several engines."""

    unknown = "unknown"
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    sync = "sync"


# Legacy spellings of the engine selectors.
unknown_engine = engine.unknown
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd


class reduce_cmd:  # noqa: N801
    """Control of the ScalarE reduction registers (accepted; each activation reduces its own result)."""

    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"
    load_reduce = "load_reduce"


class nc_version:  # noqa: N801
    gen2 = 2
    gen3 = 3


class dge_mode:  # noqa: N801
    unknown = "unknown"
    swdge = "swdge"
    hwdge = "hwdge"
    none = "none"


class oob_mode:  # noqa: N801
    error = "error"
    skip = "skip"


def get_nc_version() -> int:
    """NeuronCore version of the simulated target (2: trn1/inf2, 3: trn2)."""
    return _current().target.nc_version


def nc_matmul(
    stationary: Tile,
    moving: Tile,
    *,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    tile_position: Any = (),
    tile_size: Any = (),
    mask: Any = None,
) -> Tile:
    """stationary[K, M].T @ moving[K, N] -> fp32 PSUM [M, N]; accumulate: `psum += nc_matmul(...)`.

    `is_transpose` requires `moving` to be the identity; `tile_position`/`tile_size` are checked PE tiling;
    `mask` is refused (see core/engines_tensor.py).
    """
    return _pe.nc_matmul(
        stationary,
        moving,
        is_stationary_onezero=is_stationary_onezero,
        is_moving_onezero=is_moving_onezero,
        is_transpose=is_transpose,
        tile_position=tuple(tile_position),
        tile_size=tuple(tile_size),
        mask=mask,
    )


def nc_transpose(
    data: Tile, *, mask: Any = None, dtype: Any = None, engine: str = engine.unknown
) -> Tile:
    """Swap partition and free dims: TensorE (<= 128x128, SBUF in, PSUM out) or VectorE (<= 32x32).

    `mask` is a predicate on the indices of `data`; masked-out elements are neither read nor written.
    """
    _operand(data, "data", "nc_transpose")
    eng = engine
    if eng == "unknown":
        eng = "vector" if data.partitions <= 32 and data.free_size <= 32 else "tensor"
    if eng == "vector":
        return _pe.vector_transpose(data, dtype=dtype, mask=mask)
    return _pe.pe_transpose(data, dtype=dtype, mask=mask)


def activation(
    op: Any,
    data: Tile,
    *,
    bias: Any = None,
    scale: Any = 1.0,
    reduce_op: Any = None,
    reduce_res: Tile | None = None,
    reduce_cmd: Any = reduce_cmd.idle,
    mask: Any = None,
    dtype: Any = None,
) -> Tile:
    """op(data * scale + bias) on ScalarE; with reduce_op=nl.add and reduce_res, also the free-dim sum."""
    return _ve.activation(
        op,
        data,
        bias=bias,
        scale=scale,
        reduce_op=reduce_op,
        reduce_res=reduce_res,
        reduce_cmd=reduce_cmd,
        mask=mask,
        dtype=dtype,
    )


def activation_reduce(
    op: Any,
    data: Tile,
    *,
    reduce_op: Any,
    reduce_res: Tile,
    bias: Any = None,
    scale: Any = 1.0,
    mask: Any = None,
    dtype: Any = None,
) -> Tile:
    """activation plus the reduction of its result along all free dims into reduce_res ([P, 1])."""
    return _ve.activation(
        op,
        data,
        bias=bias,
        scale=scale,
        reduce_op=reduce_op,
        reduce_res=reduce_res,
        mask=mask,
        dtype=dtype,
        reduce_always=True,
    )


def tensor_reduce(
    op: Any,
    data: Tile,
    axis: Any,
    *,
    mask: Any = None,
    dtype: Any = None,
    negate: bool = False,
    keepdims: bool = False,
) -> Tile:
    """Reduce along the trailing free axes on VectorE."""
    return _ve.tensor_reduce(op, data, axis, dtype=dtype, mask=mask, negate=negate, keepdims=keepdims)


def tensor_scalar(
    data: Tile,
    op0: Any,
    operand0: Any,
    reverse0: bool = False,
    op1: Any = None,
    operand1: Any = None,
    reverse1: bool = False,
    *,
    dtype: Any = None,
    mask: Any = None,
    engine: str = engine.unknown,
) -> Tile:
    """(data op0 operand0) op1 operand1 with scalar or [P, 1] operands."""
    return _ve.tensor_scalar(
        data, op0, operand0, reverse0, op1, operand1, reverse1, dtype=dtype, mask=mask, engine=engine
    )


def tensor_tensor(
    data1: Tile,
    data2: Tile,
    op: Any,
    *,
    dtype: Any = None,
    mask: Any = None,
    engine: str = engine.unknown,
) -> Tile:
    """Elementwise op of two tiles with the same partitions and elements per partition."""
    return _ve.tensor_tensor(data1, data2, op, dtype=dtype, mask=mask, engine=engine)


def tensor_copy(
    src: Tile, *, mask: Any = None, dtype: Any = None, engine: str = engine.unknown
) -> Tile:
    """Copy a tile (SBUF or PSUM source) into a new SBUF tile."""
    return _ve.tensor_copy(src, dtype=dtype, mask=mask, engine=engine)


def scalar_tensor_tensor(
    *,
    data: Tile,
    op0: Any,
    operand0: Any,
    op1: Any,
    operand1: Tile,
    dtype: Any = None,
    mask: Any = None,
    engine: str = engine.unknown,
) -> Tile:
    """(data op0 operand0) op1 operand1 on VectorE: operand0 scalar or [P, 1], operand1 a tile like data."""
    return _ve.scalar_tensor_tensor(data, op0, operand0, op1, operand1, dtype=dtype, mask=mask, engine=engine)


def reciprocal(data: Tile, *, dtype: Any = None, mask: Any = None) -> Tile:
    """1 / data on VectorE (8 cycles per element)."""
    return _ve.reciprocal(data, dtype=dtype, mask=mask)


def memset(
    shape: Any, value: Any, dtype: Any, *, mask: Any = None, engine: str = engine.unknown
) -> Tile:
    """A new SBUF tile filled with value."""
    return _ve.memset(tuple(shape), value, dtype, mask=mask, engine=engine)


def iota(expr: Any, dtype: Any, *, mask: Any = None) -> Tile:
    """Materialise an affine index expression (e.g. `i_p * 512 + i_f`) as a tile, on GpSimd."""
    return _ve.iota(expr, dtype, mask=mask)


def affine_select(
    pred: Any, on_true_tile: Tile, on_false_value: Any, *, mask: Any = None, dtype: Any = None
) -> Tile:
    """pred ? on_true_tile : on_false_value, pred an affine comparison of nl.arange/mgrid indices (GpSimd)."""
    ctx = _current()
    p = np.asarray(pred)
    if p.dtype != np.bool_:
        raise IndexingError(
            "affine_select predicate must be a comparison of nl.arange / nl.mgrid expressions"
        )
    if not isinstance(on_true_tile, Tile):
        raise SimulatorError("affine_select on_true_tile must be a tile")
    # Legacy kernels (flash_fwd) pass a PSUM tile here: accepted, as the legacy compiler did.
    _operand(on_true_tile, "on_true_tile", "affine_select")
    if not isinstance(on_false_value, (int, float, np.integer, np.floating)):
        raise SimulatorError("affine_select on_false_value must be a scalar")
    try:
        np.broadcast_shapes(p.shape, on_true_tile.shape)
    except ValueError:
        raise ShapeError(
            f"affine_select predicate {p.shape} does not match tile {list(on_true_tile.shape)}"
        ) from None
    out_dt = _dt.normalize(dtype) if dtype is not None else on_true_tile.dtype
    return _ve.select(
        ctx, p, on_true_tile, on_false_value, out_dt, mask, "gpsimd", "affine_select", on_true_tile.shape
    )


def dma_copy(
    *,
    dst: Tile,
    src: Tile,
    mask: Any = None,
    dst_rmw_op: Any = None,
    oob_mode: str = oob_mode.error,
    dge_mode: str = dge_mode.unknown,
) -> None:
    """DMA between HBM and SBUF tensors of equal element count (PSUM is not a DMA endpoint).

    `dge_mode` only picks who generates descriptors (same data moved), so it is accepted, except hardware DGE
    before NeuronCore-v3. `oob_mode.skip` concerns indirect (gather/scatter) access: the simulator
    has indirect loads (`nl.load(t[idx_tile, ...])`, with the default `oob_mode.error`), not indirect dma_copy.
    """
    if dst_rmw_op is not None:
        raise SimulatorError("dma_copy dst_rmw_op is not supported by the simulator")
    if oob_mode != "error":
        raise SimulatorError(f"dma_copy oob_mode={oob_mode!r} is not supported by the simulator (only 'error')")
    modes = ("unknown", "swdge", "hwdge", "none")
    if dge_mode not in modes:
        raise SimulatorError(f"dma_copy dge_mode must be one of nisa.dge_mode {modes}, got {dge_mode!r}")
    if dge_mode == "hwdge" and get_nc_version() < 3:
        raise SimulatorError("dma_copy dge_mode=hwdge needs NeuronCore-v3 (trn2); trn1/inf2 have no hardware DGE")
    _dma.dma_copy(dst, src, mask=mask)


def tensor_copy_predicated(*, src: Tile, dst: Tile, predicate: Tile, mask: Any = None) -> None:
    """Copy src into dst where predicate != 0 (VectorE); dst untouched elsewhere."""
    ctx = _current()
    for t, n in ((src, "src"), (predicate, "predicate")):
        _operand(t, n, "tensor_copy_predicated")
    _operand(dst, "dst", "tensor_copy_predicated", access=None)
    if src.partitions != dst.partitions or predicate.partitions != dst.partitions:
        raise PartitionError("tensor_copy_predicated operands must have the same number of partitions")
    both_sbuf = src.buffer.value == predicate.buffer.value == "sbuf"
    ctx.cost.instr(
        "vector",
        "tensor_copy_predicated",
        _ve.cost.streaming_cycles(dst.free_size, 2.0 if both_sbuf else 1.0),
    )
    ctx.access(dst, "write")
    if ctx.count_only:
        return
    pv = _ve.values(ctx, predicate).reshape(dst.shape) != 0  # type: ignore[union-attr]
    sv = _ve.values(ctx, src).reshape(dst.shape)  # type: ignore[union-attr]
    dst.write(np.where(pv, sv, _ve.values(ctx, dst)))
