"""Memories, storages and the on-chip allocators (SBUF bytes per partition, PSUM banks).

A `Storage` is one allocation: an n-d numpy array (None in count-only mode) plus the memory it lives in and,
on chip, which axis is the partition axis (dims before it are "block" dims, each block a separate tile in the
same partitions). Lifetime follows the legacy NKI rules: a tile lives until its Python object dies
(weakref finalizer) or the loop iteration that allocated it ends (then later use raises ScopeError, like the
compiler's err_local_variable_used_out_of_scope).
"""

from __future__ import annotations

import enum
import itertools
import math
import weakref
from typing import Any

import numpy as np

from neuron_opt.nki_sim.core import dtypes
from neuron_opt.nki_sim.core.errors import CapacityError, PartitionError
from neuron_opt.nki_sim.core.targets import Target

PMAX = 128


class Buffer(enum.Enum):
    """Where a tensor lives. `hbm` is private to one SPMD program, `shared_hbm` visible to all."""

    SHARED_HBM = "shared_hbm"
    HBM = "hbm"
    SBUF = "sbuf"
    PSUM = "psum"

    @property
    def is_hbm(self) -> bool:
        return self in (Buffer.SHARED_HBM, Buffer.HBM)

    @property
    def space(self) -> str:
        """Address-space name used in compiler-style messages."""
        return "hbm" if self.is_hbm else self.value

    def __repr__(self) -> str:
        return f"nl.{self.value}"


_ids = itertools.count()


class _Serials:
    """Allocation order of storages: a loop knows which tensors were allocated before it started."""

    next = 0

    @classmethod
    def take(cls) -> int:
        cls.next += 1
        return cls.next - 1


def next_serial() -> int:
    """The serial the next storage will get."""
    return _Serials.next


class Storage:
    """One allocation in one memory."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype,
        buffer: Buffer,
        par_axis: int | None,
        data: np.ndarray | None,
        name: str = "",
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.buffer = buffer
        self.par_axis = par_axis
        self.data = data
        self.name = name or f"t{next(_ids)}"
        self.serial = _Serials.take()
        self.alive = True
        self.freed_by_scope = False
        # Set by the allocator: how to give the memory back.
        self._finalizer: weakref.finalize | None = None
        # PSUM locations written by a matmul since allocation (for accumulate-before-write checks).
        self.matmul_written = False

    @property
    def num_partitions(self) -> int:
        assert self.par_axis is not None
        return self.shape[self.par_axis]

    @property
    def block_count(self) -> int:
        assert self.par_axis is not None
        return math.prod(self.shape[: self.par_axis])

    @property
    def bytes_per_block(self) -> int:
        """Bytes per partition of one block (the free dims after the partition dim)."""
        assert self.par_axis is not None
        return math.prod(self.shape[self.par_axis + 1 :]) * dtypes.itemsize(self.dtype)

    @property
    def bytes_per_partition(self) -> int:
        return self.block_count * self.bytes_per_block

    def release(self) -> None:
        """Give the memory back now (scope exit); later accesses raise ScopeError."""
        if self._finalizer is not None:
            self._finalizer()
        self.alive = False

    def __repr__(self) -> str:
        return f"{self.name}{list(self.shape)}:{self.dtype}@{self.buffer.value}"


def new_data(
    shape: tuple[int, ...], dtype: np.dtype, count_only: bool, fill: Any = None
) -> np.ndarray | None:
    """Allocate backing numpy memory, filled with the uninitialised-memory sentinel unless `fill` is given."""
    if count_only:
        return None
    value = dtypes.sentinel(dtype) if fill is None else fill
    return np.full(shape, value, dtype=dtypes.storage_dtype(dtype))


class OnChipAllocator:
    """Tracks SBUF bytes per partition and PSUM bank occupancy of the live tiles of one kernel run.

    SBUF: every tile occupies the same byte range in each of its partitions, so usage is the sum of
    `bytes_per_partition` over live tiles, checked against what the compiler lets a kernel use
    (`nl.tile_size.total_available_sbuf_size`, 180224 of the physical 196608 bytes on trn1), not the physical
    partition size: a kernel that fits only the physical size fails to compile.
    PSUM: 8 banks of 2 KiB per partition; a tile block may not straddle banks (an accumulation group lives in
    one bank), small blocks share a bank first-fit.
    """

    def __init__(self, target: Target) -> None:
        self.target = target
        self.sbuf_used = 0
        self.sbuf_peak = 0
        self.bank_used = [0] * target.psum_banks
        self.banks_peak = 0

    def allocate(self, storage: Storage) -> None:
        if storage.buffer is Buffer.SBUF:
            self._alloc_sbuf(storage)
        elif storage.buffer is Buffer.PSUM:
            self._alloc_psum(storage)

    def _alloc_sbuf(self, storage: Storage) -> None:
        need = storage.bytes_per_partition
        cap = self.target.sbuf_usable_bytes_per_partition
        if self.sbuf_used + need > cap:
            raise CapacityError(
                f"SBUF capacity exceeded: allocating {storage!r} needs {need} bytes per partition, "
                f"{self.sbuf_used} of {cap} usable bytes per partition are live on {self.target.name}"
            )
        self.sbuf_used += need
        self.sbuf_peak = max(self.sbuf_peak, self.sbuf_used)
        storage._finalizer = weakref.finalize(storage, self._free_sbuf, need)

    def copy_units(self, storage: Storage) -> int:
        """What one more copy of `storage` takes: SBUF bytes per partition, or PSUM banks (packed as
        `_alloc_psum` packs blocks); 0 elsewhere."""
        if storage.buffer is Buffer.SBUF:
            return storage.bytes_per_partition
        if storage.buffer is Buffer.PSUM:
            per_bank = max(1, self.target.psum_bank_bytes // max(1, storage.bytes_per_block))
            return -(-storage.block_count // per_bank)
        return 0

    def has_room_for_copy(self, storage: Storage, granted: int) -> bool:
        """Whether one more copy of `storage` fits on top of the run's peak so far and the `granted` extra
        copies of other tiles (in `copy_units` of the same memory): a loop-local tile's second buffer
        (core/timeline.py). The peak, not the current use: the simulator frees an iteration's tiles before the
        next iteration allocates, while on the device both iterations' tiles are live when they overlap."""
        units = self.copy_units(storage)
        if storage.buffer is Buffer.SBUF:
            return self.sbuf_peak + granted + units <= self.target.sbuf_usable_bytes_per_partition
        if storage.buffer is Buffer.PSUM:
            return self.banks_peak + granted + units <= self.target.psum_banks
        return True

    def _free_sbuf(self, need: int) -> None:
        self.sbuf_used -= need

    def _alloc_psum(self, storage: Storage) -> None:
        bank = self.target.psum_bank_bytes
        block = storage.bytes_per_block
        if block > bank:
            raise CapacityError(
                f"PSUM tile {storage!r} needs {block} bytes per partition; a PSUM tile must fit one bank "
                f"({bank} bytes = {bank // 4} fp32 elements per partition)"
            )
        placed: list[tuple[int, int]] = []
        for _ in range(storage.block_count):
            slot = next((i for i, used in enumerate(self.bank_used) if used + block <= bank), None)
            if slot is None:
                for i, b in placed:
                    self.bank_used[i] -= b
                raise CapacityError(
                    f"PSUM exhausted: allocating {storage!r} ({block} bytes per partition per block) but all "
                    f"{len(self.bank_used)} PSUM banks of {bank} bytes are live"
                )
            self.bank_used[slot] += block
            placed.append((slot, block))
        self.banks_peak = max(self.banks_peak, sum(1 for u in self.bank_used if u))
        storage._finalizer = weakref.finalize(storage, self._free_psum, placed)

    def _free_psum(self, placed: list[tuple[int, int]]) -> None:
        for i, b in placed:
            self.bank_used[i] -= b


def check_partition_size(size: int, what: str) -> None:
    """TC#1: a tile spans at most 128 partitions."""
    if size > PMAX:
        raise PartitionError(
            f"Size of partition dimension {size} exceeds architecture limitation of {PMAX} ({what})"
        )
