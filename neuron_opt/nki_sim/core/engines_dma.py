"""DMA: HBM <-> SBUF moves (load, store, dma_copy), and HBM tensor plumbing (kernel arguments, reshape).

Rules: load reads HBM only and writes SBUF; store writes HBM only, from SBUF (a PSUM value is first copied to
SBUF by VectorE, as the legacy compiler does); dma_copy cannot touch PSUM. Cost: bytes moved (masked elements
only) plus a fixed cost per transfer (see cost.py).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import cost, dtypes
from neuron_opt.nki_sim.core import tile as _tile
from neuron_opt.nki_sim.core.context import current
from neuron_opt.nki_sim.core.engines_vector import finish
from neuron_opt.nki_sim.core.errors import ShapeError, SimulatorError
from neuron_opt.nki_sim.core.instr import operand, values
from neuron_opt.nki_sim.core.memory import Buffer, Storage, check_partition_size
from neuron_opt.nki_sim.core.tile import Tile


def load(src: Tile, *, mask: Any = None, dtype: Any = None) -> Tile:
    """nl.load: HBM view -> new SBUF tile of the same shape (dim 0 becomes the partition dim)."""
    ctx = current()
    if isinstance(src, _tile.IndirectView):
        return _load_indirect(ctx, src, mask, dtype)
    operand(src, "src", "load", ("hbm",))
    if not src.shape:
        raise ShapeError("nl.load needs at least a 1-D access")
    check_partition_size(src.shape[0], f"nl.load of {src.name}{list(src.shape)}")
    m = src.check_mask(mask)
    src.check_bounds(m)
    ctx.cost.dma(src.masked_count(m) * dtypes.itemsize(src.dtype), to_hbm=False,
                 access_bytes=src.size * dtypes.itemsize(src.dtype), **_geometry(src, m))
    v = None if ctx.count_only else src.read(m)
    out_dt = dtypes.normalize(dtype) if dtype is not None else src.dtype
    return finish(ctx, src.shape, out_dt, None if v is None else _exactish(v), m)


def _load_indirect(ctx: Any, src: _tile.IndirectView, mask: Any, dtype: Any) -> Tile:
    """nl.load of `t[idx_tile, ...]`: partition p <- t[idx[p], ...] (a gather; descriptors built at run time).

    Cost: each partition's row is its own runs of HBM (the rows are anywhere), so descriptors = rows x the runs
    of one row. The DMA waits for the index tile (it reads it) and is taken to read all of `t`'s dim 0.
    """
    if mask is not None:
        raise SimulatorError("nl.load of an indirect (index-tile) access takes no mask")
    n = src.shape[0]
    check_partition_size(n, f"nl.load of {src.name}[index tile]{list(src.shape)}")
    operand(src.idx, "index", "load", ("sbuf",))
    operand(src.base, "src", "load", ("hbm",))
    row_bytes = src.row.size * dtypes.itemsize(src.dtype)
    runs = _runs([a.ravel() for a in src.row.full_index_arrays()], src.base.storage.shape) if src.row.size else 1
    ctx.cost.dma(n * row_bytes, to_hbm=False, rows=n, descriptors=n * runs)
    v = None
    if not ctx.count_only:
        v = _exactish(src.rows(src.idx.read().reshape(-1).astype(np.int64)))
    out_dt = dtypes.normalize(dtype) if dtype is not None else src.dtype
    return finish(ctx, src.shape, out_dt, v, None)


def _geometry(hbm: Tile, mask: np.ndarray | None, par_dim: int = 0) -> dict[str, int]:
    """Partition rows and DMA descriptors of an access to HBM whose dim `par_dim` lands on partitions.

    A descriptor is one contiguous run of HBM that lands in one partition (each SBUF partition is a separate
    DMA buffer, nki.md 4.1): the runs of one partition's elements, in the order the view lists them, times the
    rows (every row of an affine view has the same runs). With a mask, only rows with an element moved count,
    and the runs are those of the first such row's moved elements. `load_transpose2d` (par_dim 1) makes every
    element its own descriptor: that is its cost here (the guide: much lower bandwidth than `load`).
    """
    if not hbm.shape or hbm.size == 0:
        return {"rows": 1, "descriptors": 1}
    if hbm.ndim == 1:  # one element per partition
        n = hbm.shape[0] if mask is None else max(1, int(np.count_nonzero(mask)))
        return {"rows": n, "descriptors": n}
    idx = [np.moveaxis(a, par_dim, 0) for a in hbm.full_index_arrays()]
    r0, rows = 0, hbm.shape[par_dim]
    sel = None
    if mask is not None:
        m = np.moveaxis(np.broadcast_to(mask, hbm.shape), par_dim, 0).reshape(rows, -1)
        active = np.flatnonzero(m.any(axis=1))
        if not active.size:
            return {"rows": 1, "descriptors": 1}
        r0, rows = int(active[0]), int(active.size)
        sel = m[r0]
    row = [a[r0].ravel() for a in idx]
    if sel is not None:
        row = [a[sel] for a in row]
    return {"rows": rows, "descriptors": rows * _runs(row, hbm.storage.shape)}


def _runs(coords: list[np.ndarray], shape: tuple[int, ...]) -> int:
    """Contiguous runs of storage `shape` that the elements at `coords` (one flat array per dim, in the order
    the access lists them) fall into: one DMA descriptor each, when they land in one partition."""
    flat = np.ravel_multi_index(coords, shape)
    return 1 + int(np.count_nonzero(np.diff(flat) != 1))


def _exactish(v: np.ndarray) -> np.ndarray:
    return dtypes.to_f32(v) if dtypes.is_float(v.dtype) else v


def load_transpose2d(src: Tile, *, mask: Any = None, dtype: Any = None) -> Tile:
    """nl.load_transpose2d: HBM [F, P] -> SBUF [P, F] (slower DMA; counted as one transfer)."""
    ctx = current()
    operand(src, "src", "load_transpose2d", ("hbm",))
    if src.ndim != 2:
        raise ShapeError(f"load_transpose2d needs a 2-D access, got {list(src.shape)}")
    check_partition_size(src.shape[1], f"load_transpose2d of {src.name}{list(src.shape)}")
    m = src.check_mask(mask)
    src.check_bounds(m)
    ctx.cost.dma(src.masked_count(m) * dtypes.itemsize(src.dtype), to_hbm=False,
                 access_bytes=src.size * dtypes.itemsize(src.dtype), **_geometry(src, m, par_dim=1))
    v = None if ctx.count_only else _exactish(src.read(m)).T
    out_dt = dtypes.normalize(dtype) if dtype is not None else src.dtype
    return finish(ctx, (src.shape[1], src.shape[0]), out_dt, v, None if m is None else m.T)


def store(dst: Tile, value: Any, *, mask: Any = None) -> None:
    """nl.store: on-chip tile -> HBM view, rounding into the HBM dtype."""
    ctx = current()
    operand(dst, "dst", "store", ("hbm",), access=None)
    if not isinstance(value, Tile):
        raise SimulatorError(f"nl.store value must be a tile, got {type(value).__name__}")
    operand(value, "value", "store")
    if value.size != dst.size:
        raise ShapeError(
            f"nl.store: value of shape {list(value.shape)} does not match destination {list(dst.shape)}"
        )
    m = dst.check_mask(mask)
    dst.check_bounds(m)
    if value.buffer is Buffer.PSUM:
        ctx.cost.instr("vector", "tensor_copy", cost.streaming_cycles(value.free_size), touches=("sbuf",))
    ctx.cost.dma(dst.masked_count(m) * dtypes.itemsize(dst.dtype), to_hbm=True,
                 access_bytes=dst.size * dtypes.itemsize(dst.dtype), **_geometry(dst, m))
    ctx.access(dst, "write", m)  # after the DMA: its result (core/timeline.py)
    v = values(ctx, value)
    value.fresh = False
    if v is not None:
        dst.write(np.asarray(v).reshape(dst.shape), m)


def dma_copy(dst: Tile, src: Tile, *, mask: Any = None) -> None:
    """nisa.dma_copy: HBM/SBUF to HBM/SBUF with equal element counts; PSUM is not a DMA endpoint."""
    ctx = current()
    operand(src, "src", "dma_copy", ("hbm", "sbuf"))
    operand(dst, "dst", "dma_copy", ("hbm", "sbuf"), access=None)
    if src.size != dst.size:
        raise ShapeError(
            f"dma_copy: src{list(src.shape)} and dst{list(dst.shape)} have different element counts"
        )
    if not dst.buffer.is_hbm:
        check_partition_size(dst.partitions, "dma_copy destination")
    m = dst.check_mask(mask)
    dst.check_bounds(m)
    hbm_side = dst if dst.buffer.is_hbm else src
    side_mask = m if hbm_side is dst or (m is not None and src.shape == dst.shape) else None
    if hbm_side.buffer.is_hbm:
        geometry = _geometry(hbm_side, side_mask)
    else:  # SBUF to SBUF: one run per partition row moved
        rows = dst.partitions if m is None else max(1, int(np.count_nonzero(
            np.broadcast_to(m, dst.shape).reshape(dst.shape[0], -1).any(axis=1))))
        geometry = {"rows": rows, "descriptors": rows}
    ctx.cost.dma(dst.masked_count(m) * dtypes.itemsize(dst.dtype), to_hbm=dst.buffer.is_hbm,
                 access_bytes=dst.size * dtypes.itemsize(dst.dtype), **geometry)
    ctx.access(dst, "write", m)
    if not ctx.count_only:
        dst.write(_exactish(src.read()).reshape(dst.shape), m)


def wrap_input(value: Any, name: str) -> Any:
    """A kernel argument: numpy arrays (or count-only shape specs) become HBM tensors, in place."""
    ctx = current()
    if isinstance(value, np.ndarray):
        st = Storage(
            tuple(value.shape),
            dtypes.normalize(value.dtype),
            Buffer.HBM,
            None,
            None if ctx.count_only else value,
            name,
        )
        return Tile(st)
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, Tile):
        if not ctx.count_only:
            raise SimulatorError(
                f"argument '{name}' has no data ({type(value).__name__}); only count_only runs "
                "accept shape/dtype specs"
            )
        return Tile(Storage(tuple(value.shape), dtypes.normalize(value.dtype), Buffer.HBM, None, None, name))
    return value


def reshape(t: Tile, shape: tuple[int, ...]) -> Tile:
    """Reshape a whole HBM tensor (same memory, new shape)."""
    if not t.buffer.is_hbm:
        raise SimulatorError("reshape is only supported on HBM tensors")
    st = t.storage
    if t.advanced or t.shape != st.shape:
        raise SimulatorError("reshape needs the whole, unsliced HBM tensor")
    if math.prod(shape) != math.prod(st.shape):
        raise ShapeError(f"cannot reshape {list(st.shape)} into {list(shape)}: element count differs")
    data = None if st.data is None else st.data.reshape(shape)
    new = Storage(tuple(shape), st.dtype, st.buffer, None, data, st.name)
    return Tile(new)


_tile.implements("engines_dma", sys.modules[__name__])  # Tile's operators call into this module (see core/tile.py)
