"""TensorE instructions: nc_matmul, matmul, PE transpose, partition broadcast.

nc_matmul computes stationary.T @ moving with the contraction on the partition dim of both operands; the
result is an fp32 PSUM tile [M, N] that must fit one PSUM bank (N <= 512). Cost: max(min(64, M), N) cycles,
4x for fp32 operands (nki.md 3.4, 4.2).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import cost, dtypes
from neuron_opt.nki_sim.core.context import current
from neuron_opt.nki_sim.core.engines_vector import finish, require_partition_first
from neuron_opt.nki_sim.core.errors import DtypeError, PartitionError, ShapeError
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
    mask: Any = None,
    op: str = "nc_matmul",
) -> Tile:
    """result[M, N] (PSUM, fp32) = stationary[K, M].T @ moving[K, N]."""
    ctx = current()
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
    cyc = cost.matmul_cycles(m, n, fp32)
    if fp32 and (is_stationary_onezero or is_moving_onezero):
        cyc /= 2
    ctx.cost.instr("tensor", "matmul", cyc)
    ctx.cost.matmul_flops += 2 * k1 * m * n
    vs, vm = values(ctx, stationary), values(ctx, moving)
    out = None
    if vs is not None:
        out = np.matmul(vs.reshape(k1, m).T, vm.reshape(k2, n), dtype=np.float32)  # type: ignore[union-attr]
    res = finish(ctx, (m, n), dtypes.float32, out, None, Buffer.PSUM)
    res.matmul_result = True
    return res


def matmul(x: Tile, y: Tile, *, transpose_x: bool = False, mask: Any = None) -> Tile:
    """nl.matmul: x.T @ y if transpose_x (x is [K, M]) else x @ y (x [M, K] transposed on TensorE)."""
    if transpose_x:
        return nc_matmul(x, y, mask=mask, op="matmul")
    operand(x, "x", "matmul", ("sbuf",))
    xt = pe_transpose(x, dtype=x.dtype, to_sbuf=True)
    return nc_matmul(xt, y, mask=mask, op="matmul")


def pe_transpose(x: Tile, *, dtype: Any = None, to_sbuf: bool = False) -> Tile:
    """Transpose [P, F] -> [F, P] on TensorE (matmul with identity): input SBUF, both dims <= 128."""
    ctx = current()
    operand(x, "data", "nc_transpose", ("sbuf",))
    require_partition_first(x, "nc_transpose")
    p, f = x.partitions, x.free_size
    if f > PMAX:
        raise ShapeError(
            f"size of dimension 1 ({f}) of the transposed tile exceed architecture limitation of {PMAX}"
        )
    ctx.cost.instr("tensor", "transpose", cost.pe_transpose_cycles(p, f))
    v = values(ctx, x)
    out = None if v is None else v.reshape(p, f).T
    dt = dtypes.normalize(dtype) if dtype is not None else x.dtype
    if to_sbuf:  # result evicted from PSUM to SBUF for use as a matmul operand
        ctx.cost.instr("vector", "tensor_copy", cost.streaming_cycles(p))
        return finish(ctx, (f, p), dt, out, None, Buffer.SBUF)
    return finish(ctx, (f, p), dt, out, None, Buffer.PSUM)


def vector_transpose(x: Tile, *, dtype: Any = None) -> Tile:
    """Transpose on VectorE: up to 32x32, SBUF or PSUM in and out."""
    ctx = current()
    operand(x, "data", "nc_transpose")
    require_partition_first(x, "nc_transpose")
    p, f = x.partitions, x.free_size
    if p > 32 or f > 32:
        raise ShapeError(f"VectorE transpose is limited to 32x32, got [{p}, {f}]")
    ctx.cost.instr("vector", "transpose", cost.streaming_cycles(f))
    v = values(ctx, x)
    dt = dtypes.normalize(dtype) if dtype is not None else x.dtype
    return finish(ctx, (f, p), dt, None if v is None else v.reshape(p, f).T, None, x.buffer)


def partition_broadcast(x: Tile, shape: tuple[int, ...], dtype: Any = None) -> Tile:
    """broadcast_to from 1 partition to P: a TensorE matmul with a ones vector, then a copy to SBUF."""
    ctx = current()
    p = shape[0]
    if p > PMAX:
        raise PartitionError(f"Size of partition dimension {p} exceeds architecture limitation of {PMAX}")
    n = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    ctx.cost.instr("tensor", "matmul", cost.matmul_cycles(p, n, x.dtype in _FP32_LIKE))
    ctx.cost.instr("vector", "tensor_copy", cost.streaming_cycles(n))
    v = values(ctx, x)
    out = None if v is None else np.broadcast_to(v, shape)
    return finish(ctx, tuple(shape), dtypes.normalize(dtype) if dtype is not None else x.dtype, out)
