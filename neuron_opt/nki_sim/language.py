"""`nki.language` (as `nl`) of the legacy `neuronxcc.nki` API, on the simulator core.

Swap `import neuronxcc.nki.language as nl` for `import neuron_opt.nki_sim.language as nl`. Signatures follow
the legacy stubs (nki.md 3): compute ops take keyword `dtype=` and `mask=`; index expressions are
`nl.arange` / `nl.mgrid` (broadcastable int arrays) and masks are predicates on them. The stubs end in
`**kwargs`; here signatures list the documented keywords only, so a misspelled keyword raises TypeError
(naming the function and the keyword) instead of being ignored.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from neuron_opt.nki_sim.core import dtypes as _dt
from neuron_opt.nki_sim.core import engines_dma as _dma
from neuron_opt.nki_sim.core import engines_tensor as _pe
from neuron_opt.nki_sim.core import engines_vector as _ve
from neuron_opt.nki_sim.core import tile as _tile
from neuron_opt.nki_sim.core.context import current as _current
from neuron_opt.nki_sim.core.context import maybe_current as _maybe_current
from neuron_opt.nki_sim.core.errors import PartitionError, ShapeError, SimulatorError
from neuron_opt.nki_sim.core.instr import new_tile as _new_tile
from neuron_opt.nki_sim.core.instr import operand as _operand
from neuron_opt.nki_sim.core.memory import Buffer
from neuron_opt.nki_sim.core.targets import get_target as _get_target
from neuron_opt.nki_sim.core.tile import Tile

# ---- memories and dtypes ----------------------------------------------------------------------------------
sbuf = Buffer.SBUF
psum = Buffer.PSUM
hbm = Buffer.HBM
private_hbm = Buffer.HBM
shared_hbm = Buffer.SHARED_HBM

bool_ = _dt.bool_
int8, int16, int32 = _dt.int8, _dt.int16, _dt.int32
uint8, uint16, uint32 = _dt.uint8, _dt.uint16, _dt.uint32
float16, float32, bfloat16, tfloat32 = _dt.float16, _dt.float32, _dt.bfloat16, _dt.tfloat32
float8_e4m3, float8_e4m3fn, float8_e5m2 = _dt.float8_e4m3, _dt.float8_e4m3fn, _dt.float8_e5m2


class _FInfo:
    """`nl.fp32.min` & co: the most negative finite value, as kernels use for -inf-like fills."""

    def __init__(self, dtype: np.dtype) -> None:
        fi = ml_dtypes.finfo(dtype)
        self.min = float(fi.min)
        self.max = float(fi.max)


fp32 = _FInfo(_dt.float32)
bfp16 = _FInfo(_dt.bfloat16)
fp16 = _FInfo(_dt.float16)


class _TileSize:
    """`nl.tile_size`: hardware tile limits (nki.md 2.3)."""

    pmax = 128
    psum_fmax = 512
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    psum_num_banks = 8
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @property
    def total_available_sbuf_size(self) -> int:
        ctx = _maybe_current()
        tgt = ctx.target if ctx is not None else _get_target("trn1")
        return tgt.sbuf_usable_bytes_per_partition


tile_size = _TileSize()


class par_dim(int):
    """Marks the partition dimension in a shape with leading block dims: (B, nl.par_dim(128), F)."""

    def __repr__(self) -> str:
        return f"par_dim({int(self)})"


# ---- allocation -------------------------------------------------------------------------------------------
def _par_axis(shape: Sequence[int]) -> tuple[tuple[int, ...], int]:
    marks = [i for i, s in enumerate(shape) if isinstance(s, par_dim)]
    if len(marks) > 1:
        raise PartitionError("at most one nl.par_dim in a shape")
    return tuple(int(s) for s in shape), (marks[0] if marks else 0)


def ndarray(
    shape: Sequence[int], dtype: Any, *, buffer: Buffer | None = None, name: str = ""
) -> Tile:
    """Allocate an uninitialised tensor (NaN-filled in the simulator so stray reads show)."""
    return _alloc(shape, dtype, buffer, None, name)


def _alloc(shape: Sequence[int], dtype: Any, buffer: Buffer | None, fill: Any, name: str) -> Tile:
    buf = sbuf if buffer is None else buffer
    if not isinstance(buf, Buffer):
        raise SimulatorError(f"buffer must be nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm, got {buf!r}")
    shp, par = _par_axis(shape)
    if buf is Buffer.SHARED_HBM:
        return _shared(shp, dtype, fill, name)
    if fill is not None:
        return _ve.memset(shp, fill, dtype, buffer=buf, name=name, par_axis=par)
    return _new_tile(shp, dtype, buf, par_axis=par, fill=fill, name=name)


def _shared(shape: tuple[int, ...], dtype: Any, fill: Any, name: str) -> Tile:
    """shared_hbm tensors are one tensor for all SPMD programs (allocated by the first)."""
    ctx = _current()
    i = ctx.shared_index
    ctx.shared_index += 1
    if i < len(ctx.shared_hbm):
        t = ctx.shared_hbm[i]
        assert isinstance(t, Tile)
        if t.shape != shape:
            raise ShapeError(f"SPMD programs allocate shared_hbm tensor #{i} with different shapes")
        return t
    t = _new_tile(shape, dtype, Buffer.SHARED_HBM, fill=fill, name=name)
    ctx.shared_hbm.append(t)
    return t


def zeros(
    shape: Sequence[int], dtype: Any, *, buffer: Buffer | None = None, name: str = ""
) -> Tile:
    return _alloc(shape, dtype, buffer, 0, name)


def ones(shape: Sequence[int], dtype: Any, *, buffer: Buffer | None = None, name: str = "") -> Tile:
    return _alloc(shape, dtype, buffer, 1, name)


def full(
    shape: Sequence[int],
    fill_value: Any,
    dtype: Any,
    *,
    buffer: Buffer | None = None,
    name: str = "",
) -> Tile:
    return _alloc(shape, dtype, buffer, fill_value, name)


def _like(x: Tile, dtype: Any, buffer: Buffer | None) -> tuple[tuple[int, ...], Any, Buffer]:
    return x.shape, (x.dtype if dtype is None else dtype), (x.buffer if buffer is None else buffer)


def empty_like(x: Tile, dtype: Any = None, *, buffer: Buffer | None = None, name: str = "") -> Tile:
    s, d, b = _like(x, dtype, buffer)
    return _alloc(s, d, b, None, name)


def zeros_like(x: Tile, dtype: Any = None, *, buffer: Buffer | None = None, name: str = "") -> Tile:
    s, d, b = _like(x, dtype, buffer)
    return _alloc(s, d, b, 0, name)


def ones_like(x: Tile, dtype: Any = None, *, buffer: Buffer | None = None, name: str = "") -> Tile:
    s, d, b = _like(x, dtype, buffer)
    return _alloc(s, d, b, 1, name)


def full_like(
    x: Tile, fill_value: Any, dtype: Any = None, *, buffer: Buffer | None = None, name: str = ""
) -> Tile:
    s, d, b = _like(x, dtype, buffer)
    return _alloc(s, d, b, fill_value, name)


def shared_identity_matrix(n: int, dtype: Any = uint8) -> Tile:
    """An [n, n] identity matrix in SBUF."""
    t = _new_tile((n, n), dtype, sbuf)
    if not _current().count_only:
        t.write(np.eye(n, dtype=np.float32))
    return t


# ---- index expressions and loops ---------------------------------------------------------------------------
def arange(*args: int) -> np.ndarray:
    """An index vector; make it 2-D for tile indexing: `nl.arange(128)[:, None]`."""
    return np.arange(*args, dtype=np.int64)


class _Grid(tuple):  # type: ignore[type-arg]
    """Result of nl.mgrid: iterable open grids, with `.p` (partition) and `.x` (free) for 2-D grids."""

    @property
    def p(self) -> np.ndarray:
        return self[0]

    @property
    def x(self) -> np.ndarray:
        return self[-1]


class _MGrid:
    def __getitem__(self, key: Any) -> _Grid:
        key = key if isinstance(key, tuple) else (key,)
        return _Grid(a.astype(np.int64) for a in np.ogrid[key])


mgrid = _MGrid()


def ds(start: int, size: int) -> slice:
    """Dynamic slice `start : start + size`."""
    return slice(int(start), int(start) + int(size))


def affine_range(*args: int) -> Iterator[int]:
    """Rolled loop whose iterations are independent (accumulation with += excepted); checked, run in order."""
    return _current().loop("affine_range", args)


def sequential_range(*args: int) -> Iterator[int]:
    """Rolled loop whose iterations may carry state (an online softmax, a running sum read back)."""
    return _current().loop("sequential_range", args)


def static_range(*args: int) -> Iterator[int]:
    """Loop unrolled at trace time: the body may differ per iteration (its index is a Python int)."""
    return _current().loop("static_range", args)


def program_id(axis: int) -> int:
    ctx = _current()
    if not 0 <= axis < len(ctx.grid):
        raise SimulatorError(f"program_id({axis}) outside the launch grid {ctx.grid}")
    return ctx.program_ids[axis]


def num_programs(axes: int | Sequence[int] | None = None) -> Any:
    ctx = _current()
    if axes is None:
        return int(np.prod(ctx.grid)) if ctx.grid else 1
    if isinstance(axes, int):
        return ctx.grid[axes] if ctx.grid else 1
    return tuple(ctx.grid[a] for a in axes)


def program_ndim() -> int:
    return len(_current().grid)


# ---- memory ops -------------------------------------------------------------------------------------------
def load(src: Tile, *, mask: Any = None, dtype: Any = None) -> Tile:
    return _dma.load(src, mask=mask, dtype=dtype)


def store(dst: Tile, value: Tile, *, mask: Any = None) -> None:
    _dma.store(dst, value, mask=mask)


def load_transpose2d(src: Tile, *, mask: Any = None, dtype: Any = None) -> Tile:
    return _dma.load_transpose2d(src, mask=mask, dtype=dtype)


def copy(src: Tile, *, mask: Any = None, dtype: Any = None) -> Tile:
    return _ve.tensor_copy(src, dtype=dtype, mask=mask)


copy._nki_op = "copy"  # type: ignore[attr-defined]


# ---- TensorE ----------------------------------------------------------------------------------------------
def matmul(x: Tile, y: Tile, *, transpose_x: bool = False, mask: Any = None) -> Tile:
    """x.T @ y (transpose_x=True, x is [K, M]) or x @ y; returns an fp32 PSUM tile."""
    return _pe.matmul(x, y, transpose_x=transpose_x, mask=mask)


def transpose(x: Tile, *, dtype: Any = None, mask: Any = None) -> Tile:
    """Swap partition and free dims of a 2-D tile (both <= 128); result in SBUF; `mask` on x's indices."""
    _operand(x, "x", "transpose")
    if x.partitions <= 32 and x.free_size <= 32:
        return _pe.vector_transpose(x, dtype=dtype, mask=mask)
    if x.partitions > 128 or x.free_size > 128:
        raise ShapeError(
            f"size of dimension of the transposed tile {list(x.shape)} exceed architecture limitation of 128"
        )
    return _pe.pe_transpose(x, dtype=dtype, mask=mask, to_sbuf=True)


# ---- elementwise math -------------------------------------------------------------------------------------
def _unary_act(name: str) -> Any:
    def fn(x: Tile, *, dtype: Any = None, mask: Any = None) -> Tile:
        return _ve.activation(name, x, dtype=dtype, mask=mask)

    fn.__name__ = fn.__qualname__ = name  # TypeErrors name the NKI function
    fn.__doc__ = f"Elementwise {name} on ScalarE (nisa.activation)."
    fn._nki_op = name  # type: ignore[attr-defined]
    return fn


exp = _unary_act("exp")
log = _unary_act("log")
tanh = _unary_act("tanh")
sigmoid = _unary_act("sigmoid")
relu = _unary_act("relu")
silu = _unary_act("silu")
gelu = _unary_act("gelu")
gelu_apprx_tanh = _unary_act("gelu_apprx_tanh")
gelu_apprx_sigmoid = _unary_act("gelu_apprx_sigmoid")
softplus = _unary_act("softplus")
mish = _unary_act("mish")
erf = _unary_act("erf")
square = _unary_act("square")
sqrt = _unary_act("sqrt")
rsqrt = _unary_act("rsqrt")
reciprocal = _unary_act("reciprocal")
sin = _unary_act("sin")
cos = _unary_act("cos")
tan = _unary_act("tan")
arctan = _unary_act("arctan")
sign = _unary_act("sign")
floor = _unary_act("floor")
ceil = _unary_act("ceil")
trunc = _unary_act("trunc")
identity = _unary_act("identity")


def _unary_vec(name: str) -> Any:
    def fn(x: Tile, *, dtype: Any = None, mask: Any = None) -> Tile:
        return _ve.unary_vector(x, name, dtype=dtype, mask=mask)

    fn.__name__ = fn.__qualname__ = name  # TypeErrors name the NKI function
    fn._nki_op = name  # type: ignore[attr-defined]
    return fn


negative = _unary_vec("negative")
abs = _unary_vec("abs")  # noqa: A001 - NKI name
logical_not = _unary_vec("logical_not")
invert = _unary_vec("invert")


def _binary(name: str) -> Any:
    def fn(x: Any, y: Any, *, dtype: Any = None, mask: Any = None) -> Tile:
        return _ve.binary(x, y, name, dtype=dtype, mask=mask)

    fn.__name__ = fn.__qualname__ = name  # TypeErrors name the NKI function
    fn.__doc__ = f"Elementwise {name} on VectorE (tile-tile or tile-scalar)."
    fn._nki_op = name  # type: ignore[attr-defined]
    return fn


add = _binary("add")
subtract = _binary("subtract")
multiply = _binary("multiply")
divide = _binary("divide")
maximum = _binary("maximum")
minimum = _binary("minimum")
power = _binary("power")
equal = _binary("equal")
not_equal = _binary("not_equal")
greater = _binary("greater")
greater_equal = _binary("greater_equal")
less = _binary("less")
less_equal = _binary("less_equal")
logical_and = _binary("logical_and")
logical_or = _binary("logical_or")
logical_xor = _binary("logical_xor")
bitwise_and = _binary("bitwise_and")
bitwise_or = _binary("bitwise_or")
bitwise_xor = _binary("bitwise_xor")
left_shift = _binary("left_shift")
right_shift = _binary("right_shift")
abs_max = _binary("abs_max")
abs_min = _binary("abs_min")


# ---- reductions -------------------------------------------------------------------------------------------
def _reduction(name: str, op: str) -> Any:
    def fn(
        x: Tile, axis: Any, *, dtype: Any = None, mask: Any = None, keepdims: bool = False
    ) -> Tile:
        return _ve.tensor_reduce(op, x, axis, dtype=dtype, mask=mask, keepdims=keepdims)

    fn.__name__ = fn.__qualname__ = name  # TypeErrors name the NKI function
    fn._nki_op = op  # type: ignore[attr-defined]  # nl.max can be passed as a reduce op
    return fn


sum = _reduction("sum", "add")  # noqa: A001 - NKI names
max = _reduction("max", "maximum")  # noqa: A001
min = _reduction("min", "minimum")  # noqa: A001
prod = _reduction("prod", "multiply")
all = _reduction("all", "logical_and")  # noqa: A001


def mean(
    x: Tile, axis: Any, *, dtype: Any = None, mask: Any = None, keepdims: bool = False
) -> Tile:
    """Sum along free axes, then scale by 1/count (tensor_reduce + tensor_scalar)."""
    s = _ve.tensor_reduce("add", x, axis, dtype=_dt.float32, mask=mask, keepdims=keepdims)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    count = int(np.prod([x.shape[a] for a in axes]))
    return _ve.tensor_scalar(s, "multiply", 1.0 / count, dtype=dtype or x.dtype)


def softmax(x: Tile, axis: Any = -1, *, dtype: Any = None, mask: Any = None) -> Tile:
    """exp(x - max) / sum along the (last) free axis, built from the primitive instructions."""
    m = _ve.tensor_reduce("maximum", x, axis, dtype=_dt.float32, keepdims=True)
    e = _ve.activation("exp", x, bias=_ve.unary_vector(m, "negative"), dtype=_dt.float32)
    s = _ve.tensor_reduce("add", e, axis, dtype=_dt.float32, keepdims=True)
    r = _ve.reciprocal(s)
    return _ve.tensor_scalar(e, "multiply", r, dtype=dtype or x.dtype)


# ---- selection and shape ops ------------------------------------------------------------------------------
def where(condition: Tile, x: Any, y: Any, *, dtype: Any = None, mask: Any = None) -> Tile:
    """condition ? x : y elementwise (condition a 1.0/0.0 tile) on VectorE."""
    ctx = _current()
    _operand(condition, "condition", "where")
    for t, n in ((x, "x"), (y, "y")):
        if isinstance(t, Tile):
            _operand(t, n, "where")
    ref = x if isinstance(x, Tile) else y
    if not isinstance(ref, Tile):
        raise SimulatorError("nl.where needs at least one tile among x and y")
    cv = None if ctx.count_only else _ve.values(ctx, condition)
    pred = None if cv is None else (cv != 0)
    if isinstance(x, Tile):
        out_dt = _ve._out_dtype(dtype, x.dtype, y.dtype if isinstance(y, Tile) else None)
        return _ve.select(ctx, pred, x, y, out_dt, mask, "vector", "select", x.shape)
    # Only y is a tile: swap branches and negate the predicate.
    out_dt = _ve._out_dtype(dtype, y.dtype)
    return _ve.select(ctx, None if pred is None else ~pred, y, x, out_dt, mask, "vector", "select", y.shape)


def broadcast_to(src: Tile, shape: Sequence[int]) -> Tile:
    """Broadcast dims of size 1 (same rank); a partition broadcast runs on TensorE."""
    _operand(src, "src", "broadcast_to")
    shape = tuple(int(s) for s in shape)
    if len(shape) != src.ndim or any(a not in (1, b) for a, b in zip(src.shape, shape, strict=True)):
        raise ShapeError(
            f"broadcast_to: cannot broadcast {list(src.shape)} to {list(shape)} (same rank, dims 1 or equal)"
        )
    if src.shape[0] == 1 and shape[0] > 1:
        return _pe.partition_broadcast(src, shape)
    ctx = _current()
    ctx.cost.instr(
        "vector", "tensor_copy", _ve.cost.streaming_cycles(int(np.prod(shape[1:])) if len(shape) > 1 else 1)
    )
    v = _ve.values(ctx, src)
    return _ve.finish(ctx, shape, src.dtype, None if v is None else np.broadcast_to(v, shape))


def expand_dims(data: Tile, axis: int) -> Tile:
    """A copy of `data` with a size-1 free dim inserted (a VectorE tensor_copy)."""
    _operand(data, "data", "expand_dims")
    if axis == 0:
        raise PartitionError("expand_dims cannot insert a dimension before the partition dimension")
    ctx = _current()
    shape = data.shape[:axis] + (1,) + data.shape[axis:]
    ctx.cost.instr("vector", "tensor_copy", _ve.cost.streaming_cycles(data.free_size))
    v = _ve.values(ctx, data)
    return _ve.finish(ctx, shape, data.dtype, None if v is None else v.reshape(shape))


def device_print(prefix: str, x: Tile) -> None:
    """Print a tile's values (simulation only)."""
    ctx = _current()
    if ctx.count_only:
        print(prefix, f"<{list(x.shape)} {x.dtype} (count-only)>")
        return
    print(prefix, x.read() if x.buffer.is_hbm else _ve.values(ctx, x))


_tile.implements("language", sys.modules[__name__])  # Tile's operators call into this module (see core/tile.py)
