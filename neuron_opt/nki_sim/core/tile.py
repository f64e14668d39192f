"""Tiles: views (storage + index) with the legacy NKI indexing rules, bounds checks, masked read/write.

An index is normalised per storage dim to an int, a slice, or an int ndarray (an `nl.arange`/`nl.mgrid`
expression is a plain broadcastable int ndarray). Two view kinds:
- basic: only ints and slices (numpy basic indexing, no copies);
- advanced: ints and arrays first, then trailing slices; result shape = broadcast(arrays) + slice lengths, and
  the partition axis of an on-chip result is its dim 0.
On chip an integer index on the partition axis keeps a size-1 partition dim (nki.md 3.3).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import dtypes
from neuron_opt.nki_sim.core.errors import IndexingError, OutOfBoundsError, ScopeError
from neuron_opt.nki_sim.core.memory import Buffer, Storage

# Tile's operators (`a + b`, `t[i] = x`, `t.reshape`) are instructions of the engines, and the engines import
# Tile. So that the import graph stays a DAG, each of those modules registers itself here when imported
# (neuron_opt.nki_sim imports them all) instead of Tile importing them back.
_IMPL: dict[str, Any] = {}


def implements(name: str, module: Any) -> None:
    """Called by engines_vector, engines_dma and nki_sim.language at import."""
    _IMPL[name] = module


def _impl(name: str) -> Any:
    try:
        return _IMPL[name]
    except KeyError:
        raise ImportError(f"Tile operators need neuron_opt.nki_sim ({name} not loaded); import neuron_opt.nki_sim "
                          "or its neuronxcc.nki front end first") from None

Entry = Any  # int | slice | np.ndarray


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


class Tile:
    """A view of a storage; what NKI calls a tensor or a tile."""

    def __init__(
        self,
        storage: Storage,
        index: tuple[Entry, ...] | None = None,
        shape: tuple[int, ...] | None = None,
        par_pos: int | None = None,
        advanced: bool = False,
    ) -> None:
        self.storage = storage
        if index is None:
            index = tuple(slice(0, n, 1) for n in storage.shape)
            shape = storage.shape
            par_pos = storage.par_axis
        assert shape is not None
        self.index = index
        self.shape = tuple(int(s) for s in shape)
        self.par_pos = par_pos
        self.advanced = advanced
        # Result of an instruction not yet bound anywhere: assigning it into a tile costs nothing extra
        # (the instruction writes there directly), and `exact` holds its fp32 values before rounding.
        self.fresh = False
        self.exact: np.ndarray | None = None
        self.matmul_result = False
        # Set when the allocator could not place a temporary result: using it for anything other than an
        # assignment/accumulation raises `unplaced`.
        self.unplaced: Exception | None = None
        self._inplace_done = False
        self._bounds_ok = False

    # ---- attributes ---------------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    @property
    def buffer(self) -> Buffer:
        return self.storage.buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def partitions(self) -> int:
        """Partition count of an on-chip view (dim 0 of an HBM view, as when it is loaded)."""
        if not self.shape:
            return 1
        pos = self.par_pos if self.par_pos is not None else 0
        return self.shape[pos]

    @property
    def free_size(self) -> int:
        """Elements per partition: the N of the cost formulas."""
        p = self.partitions
        return self.size // p if p else 0

    @property
    def name(self) -> str:
        return self.storage.name

    def __repr__(self) -> str:
        return (
            f"Tile({self.storage.name}, shape={list(self.shape)}, dtype={self.dtype}, "
            f"buffer={self.buffer.value})"
        )

    def __len__(self) -> int:
        return self.shape[0]

    def __bool__(self) -> bool:
        raise IndexingError("a tile has no truth value: control flow cannot depend on tensor data")

    def check_alive(self) -> None:
        if not self.storage.alive:
            raise ScopeError(
                f"Local variable '{self.storage.name}' is used out of its scope: the loop iteration that "
                "allocated it has ended (tensors defined in if/else/for blocks are local to that block)"
            )
        if self.unplaced is not None:
            raise self.unplaced

    # ---- indexing -----------------------------------------------------------------------------------
    def view(self, key: Any) -> Any:
        self.check_alive()
        key = _expand_key(key, self.ndim)
        if any(isinstance(k, Tile) for k in key):
            return IndirectView(self, key)
        has_array = any(isinstance(k, np.ndarray) and k.ndim > 0 for k in key)
        if has_array and any(isinstance(k, slice) for k in key[: _last_explicit(key)]):
            raise IndexingError(
                "Mixing basic tensor indexing and advanced tensor indexing is not supported: use nl.arange / "
                "nl.mgrid for every dimension, or slices for every dimension"
            )
        if self.advanced:  # re-indexing an advanced view: go through explicit coordinates
            return self._view_from_arrays(key)
        return self._compose_basic(key, has_array)

    def _compose_basic(self, key: tuple[Any, ...], has_array: bool) -> Tile:
        st = self.storage
        kept = [d for d, e in enumerate(self.index) if isinstance(e, slice)]
        new = list(self.index)
        for j, u in enumerate(key):
            d = kept[j]
            base: slice = self.index[d]
            length = _slice_len(base)
            onchip_par = st.par_axis == d and not st.buffer.is_hbm
            if _is_int(u) or (isinstance(u, np.ndarray) and u.ndim == 0):
                u = int(u)
                if not 0 <= u < length:
                    raise OutOfBoundsError(
                        f"Out-of-bound access for tensor {st.name} on dimension {j}: index {u} exceeds "
                        f"dimension size of {length}"
                    )
                pos = base.start + u * base.step
                new[d] = slice(pos, pos + 1, 1) if (onchip_par and not has_array) else pos
            elif isinstance(u, slice):
                start, stop, step = _checked_slice(u, length, st.name, j)
                new[d] = slice(
                    base.start + start * base.step, base.start + stop * base.step, base.step * step
                )
            elif isinstance(u, np.ndarray):
                if u.dtype.kind not in "iu":
                    raise IndexingError(
                        f"index arrays must be integer (nl.arange expressions), got {u.dtype}"
                    )
                new[d] = base.start + u * base.step
            else:
                raise IndexingError(f"unsupported index {u!r} of type {type(u).__name__}")
        if has_array:
            arrays = [e for e in new if isinstance(e, np.ndarray)]
            bshape = np.broadcast_shapes(*(a.shape for a in arrays))
            trailing = [_slice_len(e) for e in new if isinstance(e, slice)]
            # Trailing slices must come after every array (guaranteed by the mixing rule).
            return Tile(
                st, tuple(new), tuple(bshape) + tuple(trailing), 0 if st.par_axis is not None else None, True
            )
        shape = tuple(_slice_len(e) for e in new if isinstance(e, slice))
        par_pos = None
        if st.par_axis is not None:
            par_pos = sum(1 for e in new[: st.par_axis] if isinstance(e, slice))
        return Tile(st, tuple(new), shape, par_pos, False)

    def _view_from_arrays(self, key: tuple[Any, ...]) -> Tile:
        full = self.full_index_arrays()
        np_key = tuple(k if not isinstance(k, np.ndarray) or k.ndim else int(k) for k in key)
        try:
            new = tuple(f[np_key] for f in full)
        except IndexError as exc:
            raise OutOfBoundsError(f"Out-of-bound access for tensor {self.storage.name}: {exc}") from None
        shape = new[0].shape if new else ()
        par = 0 if self.storage.par_axis is not None else None
        return Tile(self.storage, new, shape, par, True)

    def full_index_arrays(self) -> list[np.ndarray]:
        """One int array per storage dim, each of the view's shape: storage coordinates."""
        out: list[np.ndarray] = []
        if not self.advanced:
            view_dim = 0
            nd = self.ndim
            for e in self.index:
                if isinstance(e, slice):
                    shp = [1] * nd
                    shp[view_dim] = _slice_len(e)
                    out.append(np.broadcast_to(np.arange(e.start, e.stop, e.step).reshape(shp), self.shape))
                    view_dim += 1
                else:
                    out.append(np.broadcast_to(np.asarray(e), self.shape))
            return out
        arrays = [np.asarray(e) for e in self.index if not isinstance(e, slice)]
        nb = len(np.broadcast_shapes(*(a.shape for a in arrays))) if arrays else 0
        slices = [e for e in self.index if isinstance(e, slice)]
        ns = len(slices)
        k = 0
        for e in self.index:
            if isinstance(e, slice):
                shp = [1] * (nb + ns)
                shp[nb + k] = _slice_len(e)
                out.append(np.broadcast_to(np.arange(e.start, e.stop, e.step).reshape(shp), self.shape))
                k += 1
            else:
                a = np.asarray(e)
                a = a.reshape((1,) * (nb - a.ndim) + a.shape + (1,) * ns)
                out.append(np.broadcast_to(a, self.shape))
        return out

    # ---- bounds and masks -----------------------------------------------------------------------------
    def check_bounds(self, mask: np.ndarray | None = None) -> None:
        """Raise OutOfBoundsError if an (unmasked) element lies outside the storage."""
        if mask is None and (self._bounds_ok or not self.advanced):
            return  # basic views are checked when built
        st = self.storage
        if mask is None:
            for d, e in enumerate(self.index):
                if isinstance(e, np.ndarray) and e.size:
                    lo, hi = int(e.min()), int(e.max())
                    if lo < 0 or hi >= st.shape[d]:
                        _oob(st, d, lo, hi)
                elif _is_int(e) and not 0 <= int(e) < st.shape[d]:
                    _oob(st, d, int(e), int(e))
            self._bounds_ok = True
            return
        full = self.full_index_arrays()
        for d, f in enumerate(full):
            sel = f[mask] if mask.shape == self.shape else f[np.broadcast_to(mask, self.shape)]
            if sel.size and (sel.min() < 0 or sel.max() >= st.shape[d]):
                _oob(st, d, int(sel.min()), int(sel.max()))

    def check_mask(self, mask: Any) -> np.ndarray | None:
        if mask is None:
            return None
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise IndexingError(f"mask must be a predicate on nl.arange indices (boolean), got {m.dtype}")
        try:
            if np.broadcast_shapes(m.shape, self.shape) != self.shape:
                raise ValueError
        except ValueError:
            raise IndexingError(
                f"mask of shape {m.shape} does not broadcast to the access shape {self.shape}"
            ) from None
        return np.broadcast_to(m, self.shape)

    def box(self, mask: np.ndarray | None = None) -> tuple[tuple[int, int], ...]:
        """Per storage dim, the half-open range of indices this access touches (masked-out elements excluded)."""
        if mask is None and not self.advanced:
            out = []
            for e in self.index:
                if isinstance(e, slice):
                    out.append((e.start, max(e.start, e.stop)))
                elif isinstance(e, np.ndarray):
                    out.append((int(e.min()), int(e.max()) + 1) if e.size else (0, 0))
                else:
                    out.append((int(e), int(e) + 1))
            return tuple(out)
        full = self.full_index_arrays()
        sel = None if mask is None else np.broadcast_to(mask, self.shape)
        out = []
        for f in full:
            v = f if sel is None else f[sel]
            out.append((int(v.min()), int(v.max()) + 1) if v.size else (0, 0))
        return tuple(out)

    def masked_count(self, mask: np.ndarray | None) -> int:
        return self.size if mask is None else int(np.count_nonzero(mask))

    # ---- data -----------------------------------------------------------------------------------------
    def read(self, mask: np.ndarray | None = None) -> np.ndarray:
        """Values of the view (storage dtype). With a mask, unselected elements are NaN/undefined."""
        self.check_alive()
        self.check_bounds(mask)
        data = self.storage.data
        assert data is not None, "read() in count-only mode"
        if mask is None:
            return data[self.index]
        full = self.full_index_arrays()
        clipped = tuple(np.clip(f, 0, n - 1) for f, n in zip(full, self.storage.shape, strict=True))
        return data[clipped]

    def write(self, values: Any, mask: np.ndarray | None = None) -> None:
        """Store values (any dtype) into the view, rounding into the storage dtype."""
        self.check_alive()
        self.check_bounds(mask)
        data = self.storage.data
        if data is None:
            return
        vals = dtypes.cast(np.broadcast_to(np.asarray(values), self.shape), self.storage.dtype)
        if mask is None:
            data[self.index] = vals
            return
        full = self.full_index_arrays()
        data[tuple(f[mask] for f in full)] = vals[mask]

    # ---- NKI tensor conveniences ------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Tile:
        return self.view(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        engines_vector = _impl("engines_vector")
        if isinstance(value, Tile) and value._inplace_done and value.storage is self.storage:
            value._inplace_done = False  # `t[...] += x` already wrote through the view
            return
        engines_vector.assign(self.view(key), value)

    def reshape(self, shape: tuple[int, ...] | list[int]) -> Tile:
        """Reshape a whole, contiguous HBM tensor (a new view of the same memory)."""
        engines_dma = _impl("engines_dma")
        return engines_dma.reshape(self, tuple(shape))

    def broadcast_to(self, shape: tuple[int, ...] | list[int]) -> Tile:
        """Same as nl.broadcast_to(self, shape)."""
        language = _impl("language")
        return language.broadcast_to(self, tuple(shape))

    # Python operators map to the same instructions as nl.add & co.
    def _bin(self, other: Any, op: str, reverse: bool = False) -> Tile:
        engines_vector = _impl("engines_vector")
        return engines_vector.binary(other, self, op) if reverse else engines_vector.binary(self, other, op)

    def __add__(self, o: Any) -> Tile:
        return self._bin(o, "add")

    def __radd__(self, o: Any) -> Tile:
        return self._bin(o, "add", True)

    def __sub__(self, o: Any) -> Tile:
        return self._bin(o, "subtract")

    def __rsub__(self, o: Any) -> Tile:
        return self._bin(o, "subtract", True)

    def __mul__(self, o: Any) -> Tile:
        return self._bin(o, "multiply")

    def __rmul__(self, o: Any) -> Tile:
        return self._bin(o, "multiply", True)

    def __truediv__(self, o: Any) -> Tile:
        return self._bin(o, "divide")

    def __rtruediv__(self, o: Any) -> Tile:
        return self._bin(o, "divide", True)

    def __pow__(self, o: Any) -> Tile:
        return self._bin(o, "power")

    def __lt__(self, o: Any) -> Tile:
        return self._bin(o, "less")

    def __le__(self, o: Any) -> Tile:
        return self._bin(o, "less_equal")

    def __gt__(self, o: Any) -> Tile:
        return self._bin(o, "greater")

    def __ge__(self, o: Any) -> Tile:
        return self._bin(o, "greater_equal")

    def __and__(self, o: Any) -> Tile:
        return self._bin(o, "logical_and")

    def __or__(self, o: Any) -> Tile:
        return self._bin(o, "logical_or")

    def __neg__(self) -> Tile:
        engines_vector = _impl("engines_vector")
        return engines_vector.unary_vector(self, "negative")

    def __iadd__(self, other: Any) -> Tile:
        return self._inplace(other, "add")

    def __isub__(self, other: Any) -> Tile:
        return self._inplace(other, "subtract")

    def __imul__(self, other: Any) -> Tile:
        return self._inplace(other, "multiply")

    def _inplace(self, other: Any, op: str) -> Tile:
        engines_vector = _impl("engines_vector")
        engines_vector.inplace(self, other, op)
        self._inplace_done = True
        return self

    __hash__ = object.__hash__


class IndirectView:
    """An HBM tensor indexed on its first dim by an on-chip integer tile: legacy NKI's indirect DMA,
    `nl.load(t[idx_tile, ...])` (`idx_tile` one index per partition, `[n]` or `[n, 1]`, as `nl.load` of an index
    table gives). Partition p of the load gets `t[idx[p], ...]`; the indices are runtime data, so only `nl.load`
    takes such a view, and an index outside dim 0 raises OutOfBoundsError when the load runs (the hardware's
    default `oob_mode.error`).
    """

    def __init__(self, base: Tile, key: tuple[Any, ...]) -> None:
        if not base.buffer.is_hbm:
            raise IndexingError("indirect indexing (a tile as an index) reads HBM: only an HBM tensor takes it")
        if base.advanced or not isinstance(base.index[0], slice) or base.par_pos is not None:
            raise IndexingError("indirect indexing takes a whole HBM tensor or a view of it by slices")
        idx, rest = key[0], key[1:]
        if not isinstance(idx, Tile) or any(isinstance(k, Tile) for k in rest):
            raise IndexingError("indirect indexing: the index tile must be the first (partition) index, and the "
                                "only one")
        idx.check_alive()
        if idx.buffer.is_hbm or idx.buffer.space != "sbuf":
            raise IndexingError(f"indirect indexing: the index tile must be in SBUF, got {idx.buffer.space}")
        if idx.dtype.kind not in "iu":
            raise IndexingError(f"indirect indexing: the index tile must hold integers, got {idx.dtype}")
        if idx.size != idx.partitions:
            raise IndexingError(f"indirect indexing: one index per partition ([n] or [n, 1]), got an index tile "
                                f"of shape {list(idx.shape)}")
        self.base = base
        self.idx = idx
        self.rest = rest
        self.row = base.view((0, *rest))  # one partition's access (checks the other indices)
        row_shape = self.row.shape
        if self.row.advanced and len(row_shape) >= 2 and row_shape[0] == 1:
            row_shape = row_shape[1:]  # `t[idx_tile[i_p, 0], i_f]`: i_f's leading 1 is the partition dim
        self.shape = (idx.partitions, *row_shape)
        self.dtype = base.dtype
        self.storage = base.storage
        self.buffer = base.buffer

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """The values each partition reads, for runtime `indices` (bounds checked against dim 0)."""
        n0 = _slice_len(self.base.index[0])
        bad = (indices < 0) | (indices >= n0)
        if bad.any():
            v = int(indices[np.flatnonzero(bad)[0]])
            raise OutOfBoundsError(f"Out-of-bound indirect access for tensor {self.base.name}: index {v} on "
                                   f"dimension 0 of size {n0} (oob_mode.error)")
        return np.stack([self.base.view((int(i), *self.rest)).read() for i in indices]).reshape(self.shape)


def _expand_key(key: Any, ndim: int) -> tuple[Any, ...]:
    if not isinstance(key, tuple):
        key = (key,)
    if any(k is None for k in key):
        raise IndexingError("None (np.newaxis) is not a valid tensor index")
    n_ell = sum(1 for k in key if k is Ellipsis)
    if n_ell > 1:
        raise IndexingError("at most one '...' in an index")
    if n_ell:
        i = next(i for i, k in enumerate(key) if k is Ellipsis)
        fill = ndim - (len(key) - 1)
        key = key[:i] + (slice(None),) * fill + key[i + 1 :]
    if len(key) > ndim:
        raise IndexingError(f"too many indices ({len(key)}) for a tensor of rank {ndim}")
    conv = []
    for k in key:
        if isinstance(k, (list, tuple)):
            raise IndexingError("lists are not valid tensor indices; use nl.arange expressions")
        if isinstance(k, np.ndarray) and k.dtype == np.bool_:
            raise IndexingError("boolean index arrays are not supported; pass predicates as mask=")
        conv.append(k)
    return tuple(conv) + (slice(None),) * (ndim - len(key))


def _last_explicit(key: tuple[Any, ...]) -> int:
    """Index just past the last array entry: slices after it are implicit trailing dims, not mixing."""
    last = -1
    for i, k in enumerate(key):
        if isinstance(k, np.ndarray) and k.ndim > 0:
            last = i
    # Any slice before the last array counts as mixing; explicit slices after it as well when written by the
    # user, but _expand_key pads with slice(None) so we cannot tell: only the region before counts.
    return last + 1


def _slice_len(s: slice) -> int:
    return max(0, -(-(s.stop - s.start) // s.step))


def _checked_slice(u: slice, length: int, name: str, dim: int) -> tuple[int, int, int]:
    step = 1 if u.step is None else int(u.step)
    start = 0 if u.start is None else int(u.start)
    stop = length if u.stop is None else int(u.stop)
    if step <= 0:
        raise IndexingError(f"slice step must be positive, got {step}")
    if start < 0 or stop > length or start > stop:
        raise OutOfBoundsError(
            f"Out-of-bound access for tensor {name} on dimension {dim}: index range [{start}, {stop - 1}] "
            f"exceed dimension size of {length}"
        )
    return start, stop, step


def _oob(st: Storage, dim: int, lo: int, hi: int) -> None:
    raise OutOfBoundsError(
        f"Out-of-bound access for tensor {st.name} on dimension {dim}: index range [{lo}, {hi}] exceed "
        f"dimension size of {st.shape[dim]}"
    )
