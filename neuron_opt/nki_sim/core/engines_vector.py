"""Vector, Scalar and GpSimd engine instructions (elementwise, reductions, activation, copies, selects).

Every function validates operands (rules), records its cost with the documented formula (nki.md 4.2), and -
unless the run is count-only - computes in fp32 and returns a fresh result tile (SBUF unless stated).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import cost, dtypes, ops
from neuron_opt.nki_sim.core import tile as _tile
from neuron_opt.nki_sim.core.context import SimContext, current
from neuron_opt.nki_sim.core.errors import (
    DtypeError,
    MemoryPlacementError,
    PartitionError,
    ShapeError,
    SimulatorError,
)
from neuron_opt.nki_sim.core.instr import check_same_partitions, new_tile, operand, result, values
from neuron_opt.nki_sim.core.memory import Buffer
from neuron_opt.nki_sim.core.tile import Tile

_FAST_TT_OPS = {"add", "multiply", "subtract"}


def _mask(x: Tile, mask: Any) -> np.ndarray | None:
    return x.check_mask(mask)


def finish(
    ctx: SimContext,
    shape: tuple[int, ...],
    dtype: Any,
    vals: np.ndarray | None,
    mask: np.ndarray | None = None,
    buffer: Buffer = Buffer.SBUF,
) -> Tile:
    """Wrap computed values into a fresh result; masked-out elements stay uninitialised."""
    if vals is not None and mask is not None:
        vals = np.where(mask, vals, np.float32(np.nan) if dtypes.is_float(dtypes.normalize(dtype)) else 0)
    out = result(ctx, shape, dtype, buffer, vals)
    out.result_mask = mask  # type: ignore[attr-defined]
    return out


def _tt_cycles(a: Tile, b: Tile, op: str, n: int, out_dtype: np.dtype) -> float:
    mixed = {a.buffer, b.buffer} == {Buffer.SBUF, Buffer.PSUM}
    fast_bf16 = a.dtype == b.dtype == out_dtype == dtypes.bfloat16 and op in _FAST_TT_OPS
    return cost.streaming_cycles(n, 1.0 if (mixed or fast_bf16) else 2.0)


def _out_dtype(dtype: Any, *ins: np.dtype | None) -> np.dtype:
    if dtype is not None:
        return dtypes.normalize(dtype)
    out: np.dtype | None = None
    for d in ins:
        out = d if out is None else dtypes.promote(out, d)
    return out if out is not None else dtypes.float32


# ---- assignment -------------------------------------------------------------------------------------------
def assign(dst: Tile, value: Any) -> None:
    """`dst[...] = value`: a fresh result is written by its own instruction; a named tile costs a copy."""
    ctx = current()
    if dst.buffer.is_hbm:
        raise MemoryPlacementError(
            f"cannot assign into HBM tensor {dst.name} with '='; use nl.store (DMA) to write HBM"
        )
    dst.check_alive()
    if not isinstance(value, Tile):
        engine = "vector" if dst.buffer is Buffer.PSUM else "gpsimd"
        ctx.cost.instr(engine, "memset", cost.streaming_cycles(dst.free_size))
        ctx.access(dst, "write")  # after the instruction: its result (core/timeline.py)
        if ctx.count_only:
            dst.check_bounds()
        else:
            dst.write(np.float32(value) if dtypes.is_float(dst.dtype) else value)
        return
    if value.buffer.is_hbm:
        raise MemoryPlacementError(
            f"cannot assign HBM tensor {value.name} into on-chip tile {dst.name}; use nl.load (DMA)"
        )
    if value.size != dst.size and np.broadcast_shapes(value.shape, dst.shape) != dst.shape:
        raise ShapeError(
            f"cannot assign a tile of shape {list(value.shape)} into a view of shape {list(dst.shape)}"
        )
    mask = getattr(value, "result_mask", None) if value.fresh else None
    dst_mask = None if mask is None else np.broadcast_to(mask, dst.shape)
    if value.fresh:
        ctx.cost.timeline.written_by(value.storage.serial)  # the instruction that made `value` writes dst
        ctx.access(dst, "write", dst_mask)
        vals = value.exact if value.exact is not None else (None if ctx.count_only else value.storage.data)
        value.fresh = False  # a second assignment of the same tile is a real copy
    else:
        value.check_alive()
        ctx.access(value, "read")
        check_same_partitions("tensor_copy", value, dst, "src", "dst")
        vals = values(ctx, value)
        ctx.cost.instr("vector", "tensor_copy", cost.streaming_cycles(dst.free_size))
        ctx.access(dst, "write", dst_mask)
    if vals is None:
        dst.check_bounds()
        return
    vals = np.asarray(vals).reshape(dst.shape) if np.asarray(vals).size == dst.size else vals
    dst.write(vals, None if mask is None else np.broadcast_to(mask, dst.shape))


# ---- elementwise ------------------------------------------------------------------------------------------
def binary(a: Any, b: Any, op: Any, *, dtype: Any = None, mask: Any = None) -> Tile:
    """`nl.add` & co (and tile operators): tile-tile on VectorE, tile-scalar as tensor_scalar."""
    ctx = current()
    name, fn = ops.resolve_alu(op)
    ta, tb = isinstance(a, Tile), isinstance(b, Tile)
    if not (ta or tb):
        raise SimulatorError(f"'{name}' needs at least one tile operand")
    if ta:
        operand(a, "x", name)
    if tb:
        operand(b, "y", name)
    if ta and tb:
        if a.buffer is Buffer.PSUM and b.buffer is Buffer.PSUM:
            raise MemoryPlacementError(f"operands of '{name}' cannot both be in PSUM")
        if a.partitions != b.partitions and 1 not in (a.partitions, b.partitions):
            check_same_partitions(name, a, b, "x", "y")
        try:
            shape = np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise ShapeError(
                f"operands of '{name}' with shapes {list(a.shape)} and {list(b.shape)} do not broadcast"
            ) from None
        out_dt = _out_dtype(dtype, a.dtype, b.dtype)
        m = _mask_for(shape, mask)
        n = int(np.prod(shape)) // max(1, shape[0] if shape else 1)
        ctx.cost.instr("vector", "tensor_tensor", _tt_cycles(a, b, name, n, out_dt))
        va, vb = values(ctx, a), values(ctx, b)
        vals = None if va is None else fn(va, vb)
        return finish(ctx, tuple(shape), out_dt, vals, m, Buffer.SBUF)
    t, s = (a, b) if ta else (b, a)
    out_dt = _out_dtype(dtype, t.dtype, dtypes.scalar_dtype(s) if not isinstance(s, np.ndarray) else None)
    m = _mask(t, mask)
    ctx.cost.instr("vector", "tensor_scalar", cost.streaming_cycles(t.free_size))
    vt = values(ctx, t)
    vals = None
    if vt is not None:
        sv = np.float32(s) if dtypes.is_float(out_dt) else s
        vals = fn(vt, sv) if ta else fn(sv, vt)
    return finish(ctx, t.shape, out_dt, vals, m)


def _mask_for(shape: tuple[int, ...], mask: Any) -> np.ndarray | None:
    if mask is None:
        return None
    return np.broadcast_to(np.asarray(mask, dtype=bool), shape)


def unary_vector(x: Tile, op: str, *, dtype: Any = None, mask: Any = None) -> Tile:
    """Elementwise ops the VectorE ALU does (negative, abs, logical_not, invert)."""
    ctx = current()
    operand(x, "x", op)
    m = _mask(x, mask)
    ctx.cost.instr("vector", "tensor_scalar", cost.streaming_cycles(x.free_size))
    v = values(ctx, x)
    fns: dict[str, Any] = {
        "negative": np.negative,
        "abs": np.abs,
        "logical_not": lambda y: (y == 0).astype(np.float32),
        "invert": lambda y: np.invert(y.astype(np.int64)),
    }
    return finish(ctx, x.shape, _out_dtype(dtype, x.dtype), None if v is None else fns[op](v), m)


def inplace(dst: Tile, other: Any, op: str) -> None:
    """`dst += x`: PSUM accumulation of a matmul result (free, near-memory), else a VectorE op into dst."""
    ctx = current()
    dst.check_alive()
    psum_acc = isinstance(other, Tile) and other.matmul_result and other.fresh and op == "add"
    outer, ctx.accum_serial = ctx.accum_serial, dst.storage.serial
    try:
        _inplace(ctx, dst, other, op)
    finally:
        ctx.accum_serial = outer
    if psum_acc:  # near-memory accumulation: done by the matmul that produced `other`
        ctx.cost.timeline.written_by(other.storage.serial)
    ctx.access(dst, "accum")  # after the instruction that accumulates


def _inplace(ctx: SimContext, dst: Tile, other: Any, op: str) -> None:
    if isinstance(other, Tile) and other.matmul_result and other.fresh and op == "add":
        if dst.buffer is not Buffer.PSUM:
            raise MemoryPlacementError(
                f"matmul results accumulate in PSUM; cannot accumulate into {dst.name} in {dst.buffer.value}"
            )
        if dst.dtype != dtypes.float32:
            raise DtypeError(f"PSUM accumulation is fp32; accumulation target {dst.name} is {dst.dtype}")
        if other.shape != dst.shape:
            raise ShapeError(
                f"matmul result {list(other.shape)} does not match accumulator view {list(dst.shape)}"
            )
        other.fresh = False
        if ctx.count_only:
            dst.check_bounds()
            return
        assert other.exact is not None
        dst.write(dtypes.to_f32(dst.read()) + other.exact)
        return
    if dst.buffer.is_hbm:
        raise MemoryPlacementError(
            f"Expected operand 'x' of '{op}' to be in address space 'psum|sbuf', but got a tile in 'hbm'"
        )
    res = binary(dst, other, op, dtype=dst.dtype)
    if res.shape != dst.shape:
        raise ShapeError(f"in-place '{op}' would change shape {list(dst.shape)} to {list(res.shape)}")
    assign(dst, res)


def tensor_tensor(
    data1: Tile, data2: Tile, op: Any, *, dtype: Any = None, mask: Any = None, engine: str = "vector"
) -> Tile:
    """nisa.tensor_tensor: same partitions and elements per partition, no broadcast, not both in PSUM."""
    ctx = current()
    name, fn = ops.resolve_alu(op)
    operand(data1, "data1", "tensor_tensor")
    operand(data2, "data2", "tensor_tensor")
    check_same_partitions("tensor_tensor", data1, data2)
    if data1.free_size != data2.free_size:
        raise ShapeError(
            "tensor_tensor operands must have the same number of elements per partition: "
            f"data1{list(data1.shape)}, "
            f"data2{list(data2.shape)}"
        )
    if data1.buffer is Buffer.PSUM and data2.buffer is Buffer.PSUM:
        raise MemoryPlacementError("tensor_tensor: data1 and data2 cannot both be in PSUM")
    _check_gpsimd(engine, "tensor_tensor", data1, data2)
    out_dt = _out_dtype(dtype, data1.dtype, data2.dtype)
    m = _mask(data1, mask)
    ctx.cost.instr(
        engine if engine != "unknown" else "vector",
        "tensor_tensor",
        _tt_cycles(data1, data2, name, data1.free_size, out_dt),
    )
    v1, v2 = values(ctx, data1), values(ctx, data2)
    vals = None if v1 is None else fn(v1, v2.reshape(v1.shape))  # type: ignore[union-attr]
    return finish(ctx, data1.shape, out_dt, vals, m)


def _check_gpsimd(engine: str, op: str, *tiles: Tile | None) -> None:
    if engine == "gpsimd" and any(t is not None and t.buffer is Buffer.PSUM for t in tiles):
        raise MemoryPlacementError(f"'{op}' on GpSimd engine cannot access PSUM (GpSimdE has no PSUM port)")


def _scalar_operand(ctx: SimContext, x: Tile, opnd: Any, what: str) -> Any:
    """A scalar or a [P, 1] per-partition vector broadcast along the free dims."""
    if isinstance(opnd, Tile):
        operand(opnd, what, "tensor_scalar")
        if opnd.partitions != x.partitions or opnd.free_size != 1:
            raise ShapeError(
                f"{what} must be a scalar or a [{x.partitions}, 1] vector, "
                f"got a tile of shape {list(opnd.shape)}"
            )
        v = values(ctx, opnd)
        return None if v is None else v.reshape((x.partitions,) + (1,) * (x.ndim - 1))
    return np.float32(opnd) if isinstance(opnd, (float, np.floating)) else opnd


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
    engine: str = "vector",
) -> Tile:
    """nisa.tensor_scalar: (data op0 operand0) op1 operand1; one or two ops cost the same."""
    ctx = current()
    operand(data, "data", "tensor_scalar")
    _check_gpsimd(engine, "tensor_scalar", data)
    _, f0 = ops.resolve_alu(op0)
    m = _mask(data, mask)
    s0 = _scalar_operand(ctx, data, operand0, "operand0")  # operands before the instruction (core/timeline.py)
    s1 = None
    if op1 is not None:
        s1 = _scalar_operand(ctx, data, operand1, "operand1")
    ctx.cost.instr(
        engine if engine != "unknown" else "vector", "tensor_scalar", cost.streaming_cycles(data.free_size)
    )
    v = values(ctx, data)
    if v is not None:
        v = f0(s0, v) if reverse0 else f0(v, s0)
        if op1 is not None:
            _, f1 = ops.resolve_alu(op1)
            v = f1(s1, v) if reverse1 else f1(v, s1)
    return finish(ctx, data.shape, _out_dtype(dtype, data.dtype), v, m)


def _normalize_axes(x: Tile, axis: Any, op: str) -> tuple[int, ...]:
    axes: tuple[int, ...] = (
        (int(axis),) if isinstance(axis, (int, np.integer)) else tuple(int(a) for a in axis)
    )
    axes = tuple(sorted(a % x.ndim for a in axes))
    par = x.par_pos if x.par_pos is not None else 0
    if par in axes:
        raise ShapeError(
            f"'{op}' cannot reduce along the partition dimension (axis {par}); transpose first or "
            "multiply by a "
            "ones vector on TensorE"
        )
    expected = tuple(range(x.ndim - len(axes), x.ndim))
    if axes != expected:
        raise ShapeError(
            f"'{op}' reduce axes must be the last contiguous free axes of the tile, "
            f"e.g. {expected}; got {axes}"
        )
    return axes


def tensor_reduce(
    op: Any,
    data: Tile,
    axis: Any,
    *,
    dtype: Any = None,
    mask: Any = None,
    negate: bool = False,
    keepdims: bool = False,
    engine: str = "vector",
) -> Tile:
    """nisa.tensor_reduce along trailing free axes; cost N (N/2 for bf16 add/max)."""
    ctx = current()
    name, red = ops.resolve_reducer(op)
    operand(data, "data", "tensor_reduce")
    axes = _normalize_axes(data, axis, "tensor_reduce")
    out_dt = _out_dtype(dtype, data.dtype)
    half = data.dtype == out_dt == dtypes.bfloat16 and name in ("add", "maximum")
    ctx.cost.instr("vector", "tensor_reduce", float(data.free_size) / (2.0 if half else 1.0))
    m = _mask(data, mask)
    shape = (
        tuple(1 if i in axes else s for i, s in enumerate(data.shape))
        if keepdims
        else tuple(s for i, s in enumerate(data.shape) if i not in axes)
    )
    if len(shape) < 2 and not keepdims:
        shape = shape + (1,) * (2 - len(shape))  # reduced tiles keep a [P, 1] layout
    v = values(ctx, data)
    out = None
    if v is not None:
        if m is not None:
            ident = {"add": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}.get(name, 0.0)
            v = np.where(m, v, np.float32(ident))
        out = np.asarray(red(v, axis=axes, keepdims=True), dtype=np.float32).reshape(shape)
        if negate:
            out = -out
    return finish(ctx, shape, out_dt, out)


def activation(
    op: Any,
    data: Tile,
    *,
    bias: Tile | None = None,
    scale: Any = 1.0,
    reduce_op: Any = None,
    reduce_res: Tile | None = None,
    reduce_cmd: Any = None,
    mask: Any = None,
    dtype: Any = None,
    reduce_always: bool = False,
) -> Tile:
    """nisa.activation on ScalarE: op(data * scale + bias), optional add-reduction into reduce_res."""
    ctx = current()
    name, fn = ops.resolve_activation(op)
    operand(data, "data", "activation")
    b = None
    if bias is not None:
        if not isinstance(bias, Tile):
            if ctx.target.nc_version < 3:
                raise DtypeError("activation bias must be a [P, 1] vector tile on NeuronCore-v2 (trn1/inf2)")
            b = np.float32(bias)
        else:
            operand(bias, "bias", "activation")
            if bias.dtype not in (dtypes.float32, dtypes.float16, dtypes.bfloat16):
                raise DtypeError(f"activation bias must be fp32, fp16 or bf16, got {bias.dtype}")
            if bias.partitions != data.partitions or bias.free_size != 1:
                raise ShapeError(
                    f"activation bias must be a [{data.partitions}, 1] vector, got {list(bias.shape)}"
                )
    if isinstance(scale, Tile):
        operand(scale, "scale", "activation")
        if scale.dtype != dtypes.float32 or scale.partitions != data.partitions or scale.free_size != 1:
            raise DtypeError(
                f"activation scale must be an fp32 scalar or [{data.partitions}, 1] fp32 vector, got "
                f"{scale.dtype}{list(scale.shape)}"
            )
    elif not isinstance(scale, (int, float, np.integer, np.floating)):
        raise DtypeError(
            f"activation scale must be a scalar or an fp32 [P, 1] tile, got {type(scale).__name__}"
        )
    do_reduce = reduce_always or (reduce_op is not None and reduce_res is not None)
    if do_reduce:
        rname = ops.op_name(reduce_op) if reduce_op is not None else "add"
        if rname != "add":
            raise SimulatorError(f"activation reduce_op must be nl.add, got {rname}")
        if reduce_res is not None:
            operand(reduce_res, "reduce_res", "activation", access=None)
            if reduce_res.partitions != data.partitions or reduce_res.free_size != 1:
                raise ShapeError(
                    f"reduce_res must be a [{data.partitions}, 1] tile, got {list(reduce_res.shape)}"
                )
    m = _mask(data, mask)
    ctx.cost.instr(
        "scalar",
        "activation_reduce" if do_reduce else "activation",
        cost.streaming_cycles(data.free_size, extra=cost.RED_RES_READOUT if do_reduce else 0.0),
    )
    if do_reduce and reduce_res is not None:
        ctx.access(reduce_res, "write")
    v = values(ctx, data)
    out = None
    if v is not None:
        x = v
        sc = values(ctx, scale) if isinstance(scale, Tile) else np.float32(scale)
        if isinstance(scale, Tile):
            sc = sc.reshape((data.partitions,) + (1,) * (data.ndim - 1))  # type: ignore[union-attr]
        x = x * sc
        if isinstance(bias, Tile):
            x = x + values(ctx, bias).reshape((data.partitions,) + (1,) * (data.ndim - 1))  # type: ignore[union-attr]
        elif b is not None:
            x = x + b
        out = fn(x.astype(np.float32))
        if do_reduce and reduce_res is not None:
            src = out if m is None else np.where(m, out, np.float32(0.0))
            red = src.reshape(data.partitions, -1).sum(axis=1, dtype=np.float32)
            reduce_res.write(red.reshape(reduce_res.shape))
    elif do_reduce and reduce_res is not None:
        reduce_res.check_bounds()
    return finish(ctx, data.shape, _out_dtype(dtype, data.dtype), out, m)


def tensor_copy(src: Tile, *, dtype: Any = None, mask: Any = None, engine: str = "vector") -> Tile:
    """nisa.tensor_copy / nl.copy: SBUF or PSUM source, result in SBUF (assignable to PSUM)."""
    ctx = current()
    operand(src, "src", "tensor_copy")
    _check_gpsimd(engine, "tensor_copy", src)
    m = _mask(src, mask)
    eng = engine if engine not in ("unknown", None) else "vector"
    ctx.cost.instr(eng, "tensor_copy", cost.streaming_cycles(src.free_size))
    return finish(ctx, src.shape, _out_dtype(dtype, src.dtype), values(ctx, src), m)


def memset(
    shape: Sequence[int],
    value: Any,
    dtype: Any,
    *,
    mask: Any = None,
    engine: str = "unknown",
    buffer: Buffer = Buffer.SBUF,
    name: str = "",
    par_axis: int = 0,
) -> Tile:
    """Allocate and fill (nl.zeros/ones/full, nisa.memset); PSUM memsets on VectorE, SBUF on GpSimd."""
    ctx = current()
    dt = dtypes.normalize(dtype)
    t = new_tile(
        tuple(shape), dt, buffer, fill=None if ctx.count_only else value, name=name, par_axis=par_axis
    )
    if engine == "gpsimd" and buffer is Buffer.PSUM:
        raise MemoryPlacementError("memset on GpSimd engine cannot access PSUM")
    eng = "vector" if buffer is Buffer.PSUM or engine == "vector" else "gpsimd"
    if buffer.is_hbm:
        return t
    n = t.free_size
    zero_16 = value == 0 and dt in (dtypes.bfloat16, dtypes.float16)
    ctx.cost.instr(eng, "memset", cost.streaming_cycles(n / 2 if zero_16 else n))
    ctx.access(t, "write")  # its result (core/timeline.py)
    return t


def iota(expr: Any, dtype: Any, *, mask: Any = None) -> Tile:
    """nisa.iota (legacy): materialise an affine nl.arange expression into an SBUF tile on GpSimd."""
    ctx = current()
    e = np.asarray(expr)
    if e.dtype.kind not in "iu":
        raise DtypeError(f"iota expression must be an integer index expression, got {e.dtype}")
    if e.ndim < 2:
        raise SimulatorError(
            "iota needs a 2-D index expression, e.g. nl.arange(64)[:, None] (1-D arange not supported)"
        )
    shape = tuple(e.shape)
    if shape[0] > 128:
        raise PartitionError(f"Size of partition dimension {shape[0]} exceeds architecture limitation of 128")
    ctx.cost.instr("gpsimd", "iota", cost.gpsimd_cycles(int(np.prod(shape[1:]))))
    return finish(
        ctx,
        shape,
        dtypes.normalize(dtype),
        None if ctx.count_only else e.astype(np.float64),
        _mask_for(shape, mask),
    )


def select(
    ctx: SimContext,
    pred: np.ndarray | None,
    on_true: Tile,
    on_false: Any,
    out_dt: np.dtype,
    mask: Any,
    engine: str,
    op: str,
    shape: tuple[int, ...],
) -> Tile:
    """Common part of affine_select / where: pred ? on_true : on_false."""
    n = on_true.free_size
    ctx.cost.instr(engine, op, cost.gpsimd_cycles(n) if engine == "gpsimd" else cost.streaming_cycles(n, 2.0))
    vt = values(ctx, on_true)
    out = None
    if vt is not None:
        vf = values(ctx, on_false) if isinstance(on_false, Tile) else np.float32(on_false)
        out = np.where(np.broadcast_to(pred, shape), vt, vf)  # type: ignore[arg-type]
    return finish(ctx, shape, out_dt, out, _mask_for(shape, mask))


def reciprocal(data: Tile, *, dtype: Any = None, mask: Any = None) -> Tile:
    """nisa.reciprocal on VectorE: max(MIN_II, 8N)."""
    ctx = current()
    operand(data, "data", "reciprocal")
    ctx.cost.instr("vector", "reciprocal", cost.streaming_cycles(data.free_size, 8.0))
    v = values(ctx, data)
    with np.errstate(divide="ignore"):
        out = None if v is None else np.float32(1.0) / v
    return finish(ctx, data.shape, _out_dtype(dtype, data.dtype), out, _mask(data, mask))


def require_partition_first(x: Tile, op: str) -> None:
    if x.par_pos not in (0, None):
        raise PartitionError(
            f"'{op}': the partition dimension must be the leading dimension of the tile {list(x.shape)}"
        )


def scalar_tensor_tensor(
    data: Tile,
    op0: Any,
    operand0: Any,
    op1: Any,
    operand1: Tile,
    *,
    dtype: Any = None,
    mask: Any = None,
    engine: str = "vector",
) -> Tile:
    """(data op0 operand0) op1 operand1: operand0 a scalar or [P, 1] vector, operand1 a tile like data.

    Cost N for bf16 subtract-then-multiply with even N, else 2N (nki.md 4.2).
    """
    ctx = current()
    operand(data, "data", "scalar_tensor_tensor")
    operand(operand1, "operand1", "scalar_tensor_tensor")
    check_same_partitions("scalar_tensor_tensor", data, operand1, "data", "operand1")
    if data.free_size != operand1.free_size:
        raise ShapeError(
            f"scalar_tensor_tensor: data{list(data.shape)} and operand1{list(operand1.shape)} differ in "
            "elements per partition"
        )
    if data.buffer is Buffer.PSUM and operand1.buffer is Buffer.PSUM:
        raise MemoryPlacementError("scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    _check_gpsimd(engine, "scalar_tensor_tensor", data, operand1)
    n0, f0 = ops.resolve_alu(op0)
    n1, f1 = ops.resolve_alu(op1)
    n = data.free_size
    fast = data.dtype == dtypes.bfloat16 and (n0, n1) == ("subtract", "multiply") and n % 2 == 0
    s0 = _scalar_operand(ctx, data, operand0, "operand0")  # operands before the instruction (core/timeline.py)
    ctx.cost.instr(
        engine if engine not in ("unknown", None) else "vector",
        "scalar_tensor_tensor",
        float(n if fast else 2 * n),
    )
    v, v1 = values(ctx, data), values(ctx, operand1)
    out = None if v is None else f1(f0(v, s0), v1.reshape(v.shape))  # type: ignore[union-attr]
    return finish(ctx, data.shape, _out_dtype(dtype, data.dtype, operand1.dtype), out, _mask(data, mask))


_tile.implements("engines_vector", sys.modules[__name__])  # Tile's operators call into this module (see core/tile.py)
