"""TensorE instructions: nc_matmul, matmul, PE transpose, partition broadcast.

nc_matmul computes stationary.T @ moving with the contraction on the partition dim of both operands; the
result is an fp32 PSUM tile [M, N] that must fit one PSUM bank (N <= 512). Cost: max(min(64, M), N) cycles,
4x for fp32 operands (nki.md 3.4, 4.2).

Options of the legacy `nisa.nc_matmul` (its docstring, nki.md 3.4): `is_transpose` promises that `moving` is an
identity, so the result is stationary transposed; we check the promise rather than trust it. PE tiling
(`tile_position`/`tile_size`, PE rows = the contraction, PE columns = the stationary free dim) lets small
matmuls share the 128x128 array; we enforce its rules but do not credit the parallelism in the cost. `mask`
is refused: the compiler masks a matmul per operand (`lhs[i_f < 64]`), which one predicate over the result
cannot express, so a simulated guess could silently differ from the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import cost, dtypes
from neuron_opt.nki_sim.core.context import current
from neuron_opt.nki_sim.core.engines_vector import finish, require_partition_first
from neuron_opt.nki_sim.core.errors import DtypeError, PartitionError, ShapeError, SimulatorError
from neuron_opt.nki_sim.core.instr import operand, values
from neuron_opt.nki_sim.core.memory import PMAX, Buffer
from neuron_opt.nki_sim.core.tile import Tile

STATIONARY_FMAX = 128
MOVING_FMAX = 512
_FP32_LIKE = {dtypes.float32, dtypes.tfloat32}


def _as_2d(x: Tile, name: str) -> tuple[int, int]:
    require_partition_first(x, "nc_matmul")
    return x.partitions, x.free_size


def nc_matmul(
    stationary: Tile,
    moving: Tile,
    *,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    tile_position: tuple[int, ...] = (),
    tile_size: tuple[int, ...] = (),
    mask: Any = None,
    op: str = "nc_matmul",
) -> Tile:
    """result[M, N] (PSUM, fp32) = stationary[K, M].T @ moving[K, N]."""
    ctx = current()
    if mask is not None:
        raise SimulatorError(
            f"'{op}': mask is not simulated (the compiler masks matmul operands, e.g. lhs[i_f < 64]); "
            "slice stationary and moving to the valid rows and columns instead"
        )
    operand(stationary, "stationary", op, ("sbuf",))
    operand(moving, "moving", op, ("sbuf",))
    k1, m = _as_2d(stationary, "stationary")
    k2, n = _as_2d(moving, "moving")
    if k1 != k2:
        raise PartitionError(
            f"'{op}': contraction (partition) dimension mismatch: stationary{list(stationary.shape)} "
            f"has {k1} partitions, moving{list(moving.shape)} has {k2}; the contraction axis must be the "
            "partition axis of both"
        )
    if k1 > PMAX:
        raise PartitionError(f"Size of partition dimension {k1} exceeds architecture limitation of {PMAX}")
    if m > STATIONARY_FMAX:
        raise ShapeError(f"'{op}': stationary free size {m} exceeds gemm_stationary_fmax ({STATIONARY_FMAX})")
    if n > MOVING_FMAX:
        raise ShapeError(
            f"'{op}': moving free size {n} exceeds gemm_moving_fmax ({MOVING_FMAX}); the result must "
            "fit one PSUM bank"
        )
    for t, nm in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype not in dtypes.MATMUL_DTYPES:
            raise DtypeError(f"'{op}': {nm} dtype {t.dtype} not supported (fp8/bf16/fp16/tf32/fp32)")
    fp32 = stationary.dtype in _FP32_LIKE or moving.dtype in _FP32_LIKE
    if fp32 and not (stationary.dtype in _FP32_LIKE and moving.dtype in _FP32_LIKE):
        raise DtypeError(
            f"'{op}': if one input is fp32/tf32 both must be (got {stationary.dtype} and {moving.dtype})"
        )
    _check_pe_tiling(tuple(tile_position), tuple(tile_size), k1, m, ctx.target.nc_version, op)
    vs, vm = values(ctx, stationary), values(ctx, moving)
    if is_transpose:
        _check_identity(vm, k1, n, op)
    cyc = cost.matmul_cycles(m, n, fp32)
    if fp32 and (is_stationary_onezero or is_moving_onezero):
        cyc /= 2
    ctx.cost.instr("tensor", "matmul", cyc)
    ctx.cost.matmul_flops += 2 * k1 * m * n
    out = None
    if vs is not None:
        out = np.matmul(vs.reshape(k1, m).T, vm.reshape(k2, n), dtype=np.float32)  # type: ignore[union-attr]
    res = finish(ctx, (m, n), dtypes.float32, out, None, Buffer.PSUM)
    res.matmul_result = True
    return res


def _check_pe_tiling(
    position: tuple[int, ...], size: tuple[int, ...], k: int, m: int, nc_version: int, op: str
) -> None:
    """PE tiling rules of the legacy nc_matmul docstring, plus the tile staying inside the array."""
    if not position and not size:
        return
    if not (position and size):
        raise ShapeError(f"'{op}': tile_position {position} and tile_size {size} must be both set for PE tiling")
    if len(position) != 2 or len(size) != 2:
        raise ShapeError(f"'{op}': tile_position {position} and tile_size {size} must be (row, column) 2-tuples")
    if any(not isinstance(v, (int, np.integer)) or v % 32 for v in position + size) or min(size) <= 0:
        raise ShapeError(f"'{op}': tile_position {position} and tile_size {size} must be multiples of 32")
    if size[0] < k or size[1] < m:
        raise ShapeError(
            f"'{op}': tile_size {size} (PE rows, columns) is smaller than the stationary tile [K={k}, M={m}]"
        )
    if position[0] + size[0] > PMAX or position[1] + size[1] > PMAX:
        raise ShapeError(f"'{op}': PE tile {size} at {position} reaches past the 128x128 PE array")
    if nc_version == 2 and size[0] == size[1] == 32:
        raise ShapeError(f"'{op}': row and column tile sizes cannot both be 32 on NeuronCore-v2 (trn1/inf2)")


def _check_identity(moving: np.ndarray | None, k: int, n: int, op: str) -> None:
    """is_transpose: `moving` must be the [K, K] identity (values are checked unless counting only)."""
    if n != k:
        raise ShapeError(f"'{op}': is_transpose needs moving to be the [{k}, {k}] identity, got [{k}, {n}]")
    if moving is not None and not np.array_equal(moving.reshape(k, n), np.eye(k, dtype=np.float32)):
        raise SimulatorError(f"'{op}': is_transpose needs moving to be the identity; it holds other values")


def matmul(x: Tile, y: Tile, *, transpose_x: bool = False, mask: Any = None) -> Tile:
    """nl.matmul: x.T @ y if transpose_x (x is [K, M]) else x @ y (x [M, K] transposed on TensorE)."""
    if transpose_x:
        return nc_matmul(x, y, mask=mask, op="matmul")
    operand(x, "x", "matmul", ("sbuf",))
    xt = pe_transpose(x, dtype=x.dtype, to_sbuf=True)
    return nc_matmul(xt, y, mask=mask, op="matmul")


def pe_transpose(x: Tile, *, dtype: Any = None, mask: Any = None, to_sbuf: bool = False) -> Tile:
    """Transpose [P, F] -> [F, P] on TensorE (matmul with identity): input SBUF, both dims <= 128.

    `mask` is a predicate on the input's indices: element [p, f] is read and [f, p] written only where true.
    """
    ctx = current()
    operand(x, "data", "nc_transpose", ("sbuf",))
    require_partition_first(x, "nc_transpose")
    p, f = x.partitions, x.free_size
    if f > PMAX:
        raise ShapeError(
            f"size of dimension 1 ({f}) of the transposed tile exceed architecture limitation of {PMAX}"
        )
    ctx.cost.instr("tensor", "transpose", cost.pe_transpose_cycles(p, f))
    m_in = x.check_mask(mask)
    v = values(ctx, x, m_in)
    m = None if m_in is None else m_in.reshape(p, f).T
    out = None if v is None else v.reshape(p, f).T
    dt = dtypes.normalize(dtype) if dtype is not None else x.dtype
    if to_sbuf:  # result evicted from PSUM to SBUF for use as a matmul operand
        ctx.cost.instr("vector", "tensor_copy", cost.streaming_cycles(p), touches=("psum",))
        return finish(ctx, (f, p), dt, out, m, Buffer.SBUF)
    return finish(ctx, (f, p), dt, out, m, Buffer.PSUM)


def vector_transpose(x: Tile, *, dtype: Any = None, mask: Any = None) -> Tile:
    """Transpose on VectorE: up to 32x32, SBUF or PSUM in and out; `mask` as for pe_transpose."""
    ctx = current()
    operand(x, "data", "nc_transpose")
    require_partition_first(x, "nc_transpose")
    p, f = x.partitions, x.free_size
    if p > 32 or f > 32:
        raise ShapeError(f"VectorE transpose is limited to 32x32, got [{p}, {f}]")
    ctx.cost.instr("vector", "transpose", cost.streaming_cycles(f))
    m_in = x.check_mask(mask)
    v = values(ctx, x, m_in)
    m = None if m_in is None else m_in.reshape(p, f).T
    dt = dtypes.normalize(dtype) if dtype is not None else x.dtype
    return finish(ctx, (f, p), dt, None if v is None else v.reshape(p, f).T, m, x.buffer)


def partition_broadcast(x: Tile, shape: tuple[int, ...], dtype: Any = None) -> Tile:
    """broadcast_to from 1 partition to P: a TensorE matmul with a ones vector, then a copy to SBUF."""
    ctx = current()
    p = shape[0]
    if p > PMAX:
        raise PartitionError(f"Size of partition dimension {p} exceeds architecture limitation of {PMAX}")
    n = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    ctx.cost.instr("tensor", "matmul", cost.matmul_cycles(p, n, x.dtype in _FP32_LIKE))
    ctx.cost.instr("vector", "tensor_copy", cost.streaming_cycles(n), touches=("psum", "sbuf"))
    v = values(ctx, x)
    out = None if v is None else np.broadcast_to(v, shape)
    return finish(ctx, tuple(shape), dtypes.normalize(dtype) if dtype is not None else x.dtype, out)
