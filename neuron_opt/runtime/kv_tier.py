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
- Host memory only: the pools of the executors that keep KV as torch tensors in this process (`host_kv`: the eager
  and cpu backends at tp = 1). Window-sized KV (a sliding-window layer group with its own pool) is refused: its
  window group gives blocks back while the full group keeps them, so one key would not name one set of bytes.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from neuron_opt.errors import ConfigError

GIB = 1 << 30


@dataclass
class KVTierStats:
    """Counters of the tier. Tokens, as vLLM counts its external prefix cache: `queries` are prompt tokens looked
    up in the tier (those the pool did not hold, up to the prompt's last full block), `hits` those restored from
    it. Blocks: `stored` copied in, `evicted` dropped for room, `corrupt` found damaged (dropped, recomputed)."""

    queries: int = 0
    hits: int = 0
    stored: int = 0
    evicted: int = 0
    corrupt: int = 0


class _Entry:
    __slots__ = ("data", "digest")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data  # [bytes per block] uint8: every layer's K, then every layer's V
        self.digest: bytes | None = None  # set by the digest thread (or by the first load that comes before it)


def _digest(data: torch.Tensor) -> bytes:
    return hashlib.blake2b(memoryview(data.numpy()), digest_size=16).digest()


def _byte_views(caches: Sequence[torch.Tensor], block: int) -> list[torch.Tensor]:
    """One block of every layer's pool as flat uint8 views (writes through them land in the pool)."""
    return [c[block].view(torch.uint8).reshape(-1) for c in caches]  # [n_kv, bs, D] -> [bytes]


class KVTier:
    """A bounded LRU store of KV blocks in host memory, over one executor's pools.

    Args:
        k_caches, v_caches: the executor's per-layer K and V block pools [num_blocks, n_kv, block positions, D]
            (host tensors; the tier reads and writes their blocks).
        max_bytes: most bytes of entries held (`--kv-offloading-size` GiB).
    """

    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], max_bytes: int) -> None:
        if not k_caches or any(c.device.type != "cpu" for c in (*k_caches, *v_caches)):
            raise ConfigError("kv_offloading_size: the KV tier copies blocks of pools in this process's memory; "
                              "this executor keeps its KV elsewhere (rank processes or a device)",
                              param="kv_offloading_size")
        self.caches = (*k_caches, *v_caches)
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in self.caches)
        if max_bytes < self.block_bytes:
            raise ConfigError(f"kv_offloading_size: {max_bytes} bytes hold no block ({self.block_bytes} bytes each)",
                              param="kv_offloading_size")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self.stats = KVTierStats()
        self._lock = threading.Lock()  # entries and digests: the engine thread and the digest thread
        self._todo: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        thread = threading.Thread(target=_digests, args=(self._todo, self._lock), name="neuron-opt-kv-tier",
                                  daemon=True)
        thread.start()
        weakref.finalize(self, self._todo.put, None)  # the thread ends with the tier

    @property
    def num_bytes(self) -> int:
        return len(self.entries) * self.block_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def store(self, key: bytes, block: int) -> None:
        """Copy pool block `block` (holding the prefix block named `key`) into the tier, evicting LRU entries for
        room. Called as the pool hands the block to a new owner, before anything writes it."""
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return
            while self.num_bytes + self.block_bytes > self.max_bytes:
                self.entries.popitem(last=False)
                self.stats.evicted += 1
            entry = _Entry(torch.cat(_byte_views(self.caches, block)))  # [block_bytes], a copy
            self.entries[key] = entry
            self.stats.stored += 1
        self._todo.put(entry)

    def load(self, keys: Sequence[bytes], blocks: Sequence[int]) -> int:
        """Copy the entries named `keys` into pool blocks `blocks` (pairwise), checking each against its digest;
        stops at the first entry that is missing or corrupted (dropped). Returns how many blocks were loaded."""
        for n, (key, block) in enumerate(zip(keys, blocks, strict=True)):
            with self._lock:
                entry = self.entries.get(key)
                if entry is None:
                    return n
                self.entries.move_to_end(key)
                digest = entry.digest
            if digest is None:  # copied in moments ago, before the digest thread reached it
                with self._lock:
                    entry.digest = _digest(entry.data)
            elif _digest(entry.data) != digest:
                with self._lock:
                    if self.entries.get(key) is entry:
                        del self.entries[key]
                    self.stats.corrupt += 1
                return n
            offset = 0
            for view in _byte_views(self.caches, block):
                view.copy_(entry.data[offset:offset + view.numel()])
                offset += view.numel()
        return len(keys)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted prompt's tokens looked up here (past its pool hits) and restored."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens


def _digests(todo: queue.SimpleQueue[_Entry | None], lock: threading.Lock) -> None:
    """The digest thread: each stored entry's digest, off the engine thread."""
    while (entry := todo.get()) is not None:
        digest = _digest(entry.data)
        with lock:
            if entry.digest is None:
                entry.digest = digest
