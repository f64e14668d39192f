"""The second KV tier: prefix-cache blocks evicted from the process pool kept in bounded host memory, and copied
back on a later prefix hit instead of being recomputed (vLLM's native CPU offloading, `--kv-offloading-size`).

Design decisions
- Keyed by the prefix-cache hash chain (runtime/block_manager.py `hash_block`): an entry is one block's K and V
  of every layer, found by the same hash that named the block in the pool, so equal keys mean equal prefixes
  (salted by a LoRA adapter's identity as in the pool).
- Stored at eviction: when the pool hands out a free block that still holds a cached prefix block, the block's
  bytes are copied out first (`store`, called by the block manager before the block is given to its new owner;
  nothing writes a block between the scheduler's eviction and the step's graph calls). Blocks that are never
  evicted cost the tier nothing. A block whose key the tier already holds is only marked recently used.
- Restored at admission: the scheduler continues a prompt's hash chain past its pool hits while the tier holds
  the next key, allocates pool blocks as for any prompt, and `load` copies the entries into them before the
  step's graph calls; those tokens then count as computed, and the blocks are hashed into the pool as the
  sequence commits them.
- Integrity: every entry carries a blake2b digest of its bytes, taken off the engine thread by a background
  thread (hashing releases the GIL). `load` recomputes it and compares: a mismatch (a corrupted entry) drops the
  entry and ends the restored run there, so those blocks are recomputed, never used. An entry restored before
  the background thread reached it is hashed at that moment and used as stored (it was copied an instant ago).
- Bounded: entries are counted by their bytes against `max_bytes`; inserting evicts the least recently used
  entries (a restore marks an entry used) until the new one fits.
- An optional disk level (`disk_dir`, `disk_bytes`): what RAM evicts is written there by the background thread
  (the entry stays readable from memory until its file is in place), one file per entry (its digest, then its
  bytes), under its own size limit and LRU. The files live in a private (0700) directory made for this tier inside
  `disk_dir` and removed with it: no other process's file is ever read. A restore reads the file on the engine
  thread and checks its digest as above; the block is then in the pool, and back in RAM when the pool evicts it.
- Pools it copies: an executor's block pools through `PoolBlocks` (read a block's bytes to host memory, write them
  back): in place through uint8 views for pools of CPU tensors in this process (`HostBlocks`: the eager and cpu
  backends at tp = 1), and by the executor's own copier where the pool is on a device (`executor.tier_blocks(layers)`:
  the neuron backend's, one small graph each way over the pools of a layer subset, at any tp). Rank processes hold
  their pools out of reach and are refused.
- Window-sized KV (sliding-window layers with a pool of their own, block_manager.WindowedBlockManager): entries
  per (group, key). The full layers' pools and the window layers' pools are two `PoolBlocks` (`group_blocks`),
  each group's evictions store that group's layers only (the window group gives its blocks back as the window
  slides, so its copy of a key is evicted long before the full group's), and the scheduler restores the two
  groups' blocks apart; a device copier copies each group by a pair of graphs of its own. Entries of both groups
  share the size limit and the LRU order; each counts its own bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from neuron_opt.errors import ConfigError

log = logging.getLogger(__name__)
GIB = 1 << 30
DIGEST_BYTES = 16
FULL, WINDOW = "full", "window"  # the KV groups of window-sized KV (one group, FULL, without it)
_GROUP_TAG = {FULL: b"", WINDOW: b"window:"}  # a window group's entry is keyed apart from the full group's


@dataclass
class KVTierStats:
    """Counters of the tier. Tokens, as vLLM counts its external prefix cache: `queries` are prompt tokens looked
    up in the tier (those the pool did not hold, up to the prompt's last full block), `hits` those restored from
    it. Blocks: `stored` copied in, `evicted` dropped for room (from the last level), `corrupt` found damaged
    (dropped, recomputed), `restored_ram` / `restored_disk` copied back from each level."""

    queries: int = 0
    hits: int = 0
    stored: int = 0
    evicted: int = 0
    corrupt: int = 0
    restored_ram: int = 0
    restored_disk: int = 0


class _Entry:
    __slots__ = ("data", "digest")

    def __init__(self, data: torch.Tensor, digest: bytes | None = None) -> None:
        self.data = data  # [bytes per block] uint8: every layer's K, then every layer's V
        self.digest = digest  # set by the background thread (or by the first load that comes before it)


def _digest(data: torch.Tensor) -> bytes:
    return hashlib.blake2b(data.numpy().data, digest_size=DIGEST_BYTES).digest()


class PoolBlocks(Protocol):
    """An executor's KV block pools as the tier sees them: `block_bytes` bytes a block (every layer's K, then every
    layer's V), read out as a host copy and written back."""

    block_bytes: int

    def read(self, block: int) -> torch.Tensor:
        """Block `block` of every pool: a new [block_bytes] uint8 host tensor."""
        ...

    def write(self, block: int, data: torch.Tensor) -> None:
        """`data` ([block_bytes] uint8, as `read` returns it) into block `block` of every pool."""
        ...


class HostBlocks:
    """Pools of CPU tensors in this process [num_blocks, n_kv, block positions, D], read and written in place."""

    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        if not k_caches or any(c.device.type != "cpu" for c in (*k_caches, *v_caches)):
            raise ConfigError("kv_offloading_size: the KV tier copies blocks of pools in this process's memory or "
                              "on its device; this executor keeps its KV elsewhere (rank processes)",
                              param="kv_offloading_size")
        self.caches = (*k_caches, *v_caches)
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in self.caches)

    def _views(self, block: int) -> list[torch.Tensor]:
        return [c[block].view(torch.uint8).reshape(-1) for c in self.caches]  # [n_kv, bs, D] -> [bytes]

    def read(self, block: int) -> torch.Tensor:
        return torch.cat(self._views(block))

    def write(self, block: int, data: torch.Tensor) -> None:
        offset = 0
        for view in self._views(block):
            view.copy_(data[offset:offset + view.numel()])
            offset += view.numel()


def executor_blocks(executor: Any) -> PoolBlocks:
    """The pools of `executor` for the tier: its own copier (a device pool), else its host tensors."""
    own = getattr(executor, "tier_blocks", None)
    return own() if own is not None else HostBlocks(executor.k_caches, executor.v_caches)


def tier_pools(executor: Any, cfg: Any, cache: Any) -> tuple[PoolBlocks, PoolBlocks | None]:
    """The pools a tier over `executor` copies, and the window layers' apart under window-sized KV (the layers with
    a sliding window when `cache` (CacheConfig) keeps a window pool: CacheConfig.pool_blocks); else None."""
    if not cache.sliding_window:
        return executor_blocks(executor), None
    return group_blocks(executor, [i for i in range(cfg.num_hidden_layers) if cfg.layer_window(i) is not None])


def group_blocks(executor: Any, window_layers: Sequence[int]) -> tuple[PoolBlocks, PoolBlocks]:
    """Window-sized KV: the pools of `executor`'s full layers and of its sliding-window layers (`window_layers`,
    whose pools hold the window pool's blocks: CacheConfig.pool_blocks), as the tier's two groups: its own copier
    over each layer subset (a device pool: `executor.tier_blocks(layers)`), else its host tensors."""
    ks, vs, window = executor.k_caches, executor.v_caches, set(window_layers)
    if not window or len(window) == len(ks) or not window <= set(range(len(ks))):
        raise ValueError(f"group_blocks: window layers {sorted(window)} are not some, and not all, of the model's "
                         f"{len(ks)} layers")
    full, sliding = [i for i in range(len(ks)) if i not in window], sorted(window)
    own = getattr(executor, "tier_blocks", None)
    if own is not None:
        return own(full), own(sliding)
    return (HostBlocks([ks[i] for i in full], [vs[i] for i in full]),
            HostBlocks([ks[i] for i in sliding], [vs[i] for i in sliding]))


class _Disk:
    """The disk level: files in a private directory, an LRU index of the keys written, the entries on their way."""

    def __init__(self, parent: Path, max_bytes: int) -> None:
        parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix="kv-tier-", dir=parent))  # 0700, this tier's alone
        self.max_bytes = max_bytes
        self.index: OrderedDict[bytes, int] = OrderedDict()  # written files and their sizes, LRU first
        self.num_bytes = 0  # of the files in `index`
        self.pending: dict[bytes, _Entry] = {}  # spilled from RAM, not yet written

    def file(self, key: bytes) -> Path:
        return self.path / key.hex()

    def forget(self, key: bytes) -> bool:
        """Drop `key` from the index (its file is the caller's); whether it was there."""
        size = self.index.pop(key, None)
        if size is not None:
            self.num_bytes -= size
        return size is not None

    def __contains__(self, key: bytes) -> bool:
        return key in self.index or key in self.pending


class KVTier:
    """A bounded LRU store of KV blocks in host memory (and optionally on disk), over one executor's pools.

    Args:
        pools: the executor's block pools (`executor_blocks`; `HostBlocks` over pools of host tensors); with
            window-sized KV, the full layers' pools (`group_blocks`).
        max_bytes: most bytes of entries held in RAM (`--kv-offloading-size` GiB).
        disk_dir: a directory for the disk level (None: RAM only); `disk_bytes`: its size limit.
        window_pools: with window-sized KV, the sliding-window layers' pools (`group_blocks`): entries of the
            WINDOW group.
    """

    def __init__(self, pools: PoolBlocks, max_bytes: int, disk_dir: Path | None = None,
                 disk_bytes: int = 0, window_pools: PoolBlocks | None = None) -> None:
        self.pools = pools
        self.groups: dict[str, PoolBlocks] = {FULL: pools, **({WINDOW: window_pools} if window_pools else {})}
        self.block_bytes = pools.block_bytes  # of a FULL entry
        largest = max(g.block_bytes for g in self.groups.values())
        for name, size in (("kv_offloading_size", max_bytes), ("kv_offloading_disk_size", disk_bytes)):
            if (name == "kv_offloading_size" or disk_dir is not None) and size < largest:
                raise ConfigError(f"{name}: {size} bytes hold no block ({largest} bytes each)", param=name)
        self.max_bytes = max_bytes
        self._ram_bytes = 0
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # RAM, LRU first
        self.disk = _Disk(disk_dir, disk_bytes) if disk_dir is not None else None
        self.stats = KVTierStats()
        self._lock = threading.Lock()  # entries, digests and the disk index: the engine thread and the worker
        self._todo: queue.SimpleQueue[tuple[bytes, _Entry, bool] | None] = queue.SimpleQueue()  # (.., spill)
        thread = threading.Thread(target=_work, args=(self._todo, self._lock, self.disk, self.stats),
                                  name="neuron-opt-kv-tier", daemon=True)
        thread.start()
        weakref.finalize(self, self._todo.put, None)  # the thread ends (and removes the disk level) with the tier

    @property
    def num_bytes(self) -> int:
        """Bytes held in RAM."""
        return self._ram_bytes

    @property
    def disk_num_bytes(self) -> int:
        """Bytes of the disk level's files."""
        return 0 if self.disk is None else self.disk.num_bytes

    @property
    def windowed(self) -> bool:
        """It holds the window layers' group too (window-sized KV)."""
        return WINDOW in self.groups

    def __contains__(self, key: bytes) -> bool:
        return self.holds(key)

    def holds(self, key: bytes, group: str = FULL) -> bool:
        """Whether an entry of `group`'s layers named `key` is here (in RAM or on disk)."""
        key = _GROUP_TAG[group] + key
        return key in self.entries or (self.disk is not None and key in self.disk)

    def store(self, key: bytes, block: int, group: str = FULL) -> None:
        """Copy block `block` of `group`'s pools (holding the prefix block named `key`) into the tier, making room
        by LRU (to the disk level, when there is one). Called as the pool hands the block to a new owner, before
        anything writes it."""
        pools, key = self.groups[group], _GROUP_TAG[group] + key
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return
            while self.entries and self._ram_bytes + pools.block_bytes > self.max_bytes:
                old_key, old = self.entries.popitem(last=False)
                self._ram_bytes -= old.data.numel()
                if self.disk is None:
                    self.stats.evicted += 1
                elif old_key not in self.disk:  # (one already there only leaves RAM)
                    self.disk.pending[old_key] = old
                    self._todo.put((old_key, old, True))  # written by the worker, in eviction order
            entry = _Entry(pools.read(block))  # [block_bytes], a copy
            self.entries[key] = entry
            self._ram_bytes += entry.data.numel()
            self.stats.stored += 1
        self._todo.put((key, entry, False))  # its digest

    def load(self, keys: Sequence[bytes], blocks: Sequence[int], group: str = FULL) -> int:
        """Copy the entries of `group` named `keys` into its pools' blocks `blocks` (pairwise), checking each against
        its digest; stops at the first entry that is missing or corrupted (dropped). Returns how many blocks were
        loaded."""
        pools = self.groups[group]
        for n, (key, block) in enumerate(zip(keys, blocks, strict=True)):
            entry, level = self._take(_GROUP_TAG[group] + key, pools.block_bytes)
            if entry is None:
                return n
            pools.write(block, entry.data)
            if level == "disk":
                self.stats.restored_disk += 1
            else:
                self.stats.restored_ram += 1
        return len(keys)

    def _take(self, key: bytes, size: int) -> tuple[_Entry | None, str]:
        """The verified entry named `key` (`size` bytes) and the level it came from; (None, "") when missing or
        damaged."""
        with self._lock:
            entry, level = self.entries.get(key), "ram"
            if entry is not None:
                self.entries.move_to_end(key)
            elif self.disk is not None and key in self.disk.pending:
                entry, level = self.disk.pending[key], "ram"  # not written yet: still in memory
            elif self.disk is not None and key in self.disk.index:
                level = "disk"
            else:
                return None, ""
            digest = entry.digest if entry is not None else None
        if level == "disk":
            assert self.disk is not None
            try:
                raw = self.disk.file(key).read_bytes()
            except OSError as e:  # removed for room since the check above, or unreadable: a miss
                with self._lock:
                    if self.disk.forget(key):
                        log.warning("kv tier: %s unreadable (%s); recomputing its block", self.disk.file(key), e)
                return None, ""
            digest = raw[:DIGEST_BYTES]
            entry = _Entry(torch.frombuffer(bytearray(raw[DIGEST_BYTES:]), dtype=torch.uint8), digest)
        assert entry is not None
        if digest is None:  # copied in moments ago, before the worker reached it
            with self._lock:
                entry.digest = _digest(entry.data)
        elif entry.data.numel() != size or _digest(entry.data) != digest:
            self._drop(key, entry, level)
            return None, ""
        if level == "disk":  # marked used there; the pool holds it now, and gives it back to RAM when it evicts it
            with self._lock:
                if key in self.disk.index:  # type: ignore[union-attr]
                    self.disk.index.move_to_end(key)  # type: ignore[union-attr]
        return entry, level

    def _drop(self, key: bytes, entry: _Entry, level: str) -> None:
        """A damaged entry: counted, and forgotten at its level (its file removed)."""
        with self._lock:
            self.stats.corrupt += 1
            if level == "ram" and self.entries.get(key) is entry:
                del self.entries[key]
                self._ram_bytes -= entry.data.numel()
            elif level == "ram" and self.disk is not None and self.disk.pending.get(key) is entry:
                del self.disk.pending[key]
            elif level == "disk" and self.disk is not None and self.disk.forget(key):
                self.disk.file(key).unlink(missing_ok=True)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted prompt's tokens looked up here (past its pool hits) and restored."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens


def _work(todo: queue.SimpleQueue[tuple[bytes, _Entry, bool] | None], lock: threading.Lock, disk: _Disk | None,
          stats: KVTierStats) -> None:
    """The background thread: each stored entry's digest, and the disk level's writes (an entry RAM evicted:
    digest and bytes to a temporary file, renamed into place, then indexed; the oldest files removed for room).
    Ends, removing the disk level's directory, when the tier is gone."""
    while (item := todo.get()) is not None:
        key, entry, spill = item
        digest = entry.digest or _digest(entry.data)
        with lock:
            if entry.digest is None:
                entry.digest = digest
            spill = spill and disk is not None and disk.pending.get(key) is entry  # (not damaged and dropped since)
        if not spill:
            continue
        assert disk is not None
        tmp = disk.path / (key.hex() + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(digest)
                f.write(entry.data.numpy().data)
            os.replace(tmp, disk.file(key))
        except OSError as e:
            log.warning("kv tier: writing %s failed (%s); the block is dropped", tmp, e)
            tmp.unlink(missing_ok=True)
            with lock:
                disk.pending.pop(key, None)
                stats.evicted += 1
            continue
        with lock:
            disk.pending.pop(key, None)
            disk.forget(key)
            disk.index[key] = entry.data.numel() + DIGEST_BYTES
            disk.num_bytes += entry.data.numel() + DIGEST_BYTES
            while disk.num_bytes > disk.max_bytes:
                old, size = disk.index.popitem(last=False)
                disk.num_bytes -= size
                disk.file(old).unlink(missing_ok=True)
                stats.evicted += 1
    if disk is not None:
        shutil.rmtree(disk.path, ignore_errors=True)
