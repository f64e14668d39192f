"""KV block manager: which blocks of the pool each sequence owns, and automatic prefix caching. Device-free.

Design decisions
- Block 0 is the null block (padding writes it); blocks 1..num_blocks-1 are handed out. A sequence's block
  table lists its blocks in logical order: block i holds its positions [i * block_size, (i + 1) * block_size).
- Prefix caching (vLLM's scheme): a block that is full of computed tokens gets a hash chained over (parent
  block's hash, the block's token ids), so equal hashes mean equal whole prefixes, not just equal blocks. A
  hash -> block map finds them; a new prompt takes its longest run of cached full blocks (reference counts go
  up, so one block serves many sequences) and prefills only the rest. Hashes are sha256 (no collision can
  make one user's prefix serve another's text).
- Free blocks (reference count 0) wait in an LRU queue, oldest first. A freed block keeps its hash and stays
  findable until it is handed out again, so a prefix outlives the request that computed it; a sequence's
  blocks are freed tail first, so its prefix's head, the part other prompts are likeliest to share, is evicted
  last. Taking a cached block out of the queue (a hit) or handing it out (eviction) is O(1).
- A salt (a LoRA adapter's identity, neuron_opt.lora) seeds the first block's hash, so K/V computed under one
  adapter is found only by requests under the same adapter; no salt: the base model's chain, as before.
- A block is never written while shared: a prefix hit covers only full blocks, and it stops before the last
  prompt token (which must be computed for its logits), so a sequence only ever writes blocks it owns alone.
- `allocate` is all or nothing: it either gives a sequence every block it asked for or changes nothing, so
  the scheduler can try, preempt (free another sequence's blocks) and retry.
- Window-sized KV (`WindowedBlockManager`, vLLM's hybrid KV cache manager): a model with sliding-window layers
  keeps two groups of the same logical blocks, the full layers' and the window layers' (each its own pool,
  tables and free queue). Once a sequence's next query lies at position c, keys at positions <= c - window are
  never seen again (the attention mask hides them), so the window group gives back every block wholly before
  c - window + 1 and its table entry becomes the null block: masked, never read for a visible key. Released
  blocks keep their hash, so a prefix outlives them as in one group. A prefix hit of n blocks needs the full
  group's n blocks and the window group's blocks that the hit's next query sees; the hit is the longest n for
  which both are cached (both groups hash the same logical blocks, so one hash names a block in each).
- A second KV tier (runtime/kv_tier.py) hears of every eviction (`on_evict`: the evicted hash and block, before
  the block's new owner writes it), so it can keep the block's bytes; the manager itself stays device-free. Under
  window-sized KV each group has its own hook (its pools, its layers), and a new sequence may start with logical
  blocks that neither group holds in its pool: `WindowedBlockManager.allocate` gives those new blocks, which the
  tier fills.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from neuron_opt.errors import ConfigError

NULL_BLOCK = 0


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: sha256 over the parent block's key and the block's token ids."""
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in cached blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Block tables, reference counts, the prefix-cache map and the LRU free queue.

    Args:
        num_blocks: blocks in the pool, the null block included.
        block_size: positions per block.
        enable_prefix_caching: keep and reuse full blocks by their prefix hash.
        on_evict: called with (hash, block) when a cached block is handed out again, before its new owner writes
            it (the second KV tier keeps its bytes).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 on_evict: Callable[[bytes, int], None] | None = None) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ConfigError(f"kv blocks: need at least 2 blocks (one is the null block) of >= 1 position, got "
                              f"{num_blocks} of {block_size}")
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding that prefix block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))  # LRU first
        self.tables: dict[str, list[int]] = {}  # sequence -> its blocks in logical order
        self.hashes: dict[str, list[bytes]] = {}  # sequence -> hashes of its leading full, computed blocks
        self.stats = PrefixCacheStats()
        self.on_evict = on_evict

    # ---- queries ----------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free ones, cached or not)."""
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self.tables[seq_id]

    def cached_prefix(self, token_ids: Sequence[int], salt: bytes | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids` (full blocks only, and never the block that
        holds the last token, whose logits must be computed) computed under `salt`. Looks, changes nothing."""
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        parent: bytes | None = salt
        for i in range((len(token_ids) - 1) // self.block_size):
            h = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
            parent = h
        return out

    # ---- mutations --------------------------------------------------------------------------------------

    def fits(self, seq_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Whether `allocate` with these arguments would succeed. Looks, changes nothing."""
        table = self.tables.get(seq_id)
        if table is not None:
            prefix = ()  # only a new sequence takes a cached prefix
        new = max(0, self.blocks_needed(num_tokens) - (len(table) if table is not None else len(prefix)))
        # a hit on a free block takes it off the queue
        taken = sum(1 for b in prefix if b != NULL_BLOCK and self.ref[b] == 0)
        return new + taken <= len(self.free)

    def allocate(self, seq_id: str, num_tokens: int, prefix: Sequence[int] = (),
                 prefix_hashes: Sequence[bytes] = ()) -> bool:
        """Make `seq_id`'s table cover `num_tokens` positions. A new sequence may first take `prefix` (the
        blocks `cached_prefix` returned, still cached: nothing has run in between); a window group's prefix may
        start with null blocks (out of the window), whose hashes `prefix_hashes` gives. All or nothing: False,
        and no change, when the free blocks do not suffice."""
        if not self.fits(seq_id, num_tokens, prefix):
            return False
        table = self.tables.get(seq_id)
        new = max(0, self.blocks_needed(num_tokens) - (len(table) if table is not None else len(prefix)))
        if table is None:
            table, hashes = self.tables.setdefault(seq_id, []), self.hashes.setdefault(seq_id, [])
            for i, b in enumerate(prefix):
                if b == NULL_BLOCK:
                    table.append(b)
                    hashes.append(prefix_hashes[i])
                    continue
                h = self.block_hash[b]
                assert h is not None and self.cached.get(h) == b, "prefix blocks must be cached"
                if self.ref[b] == 0:
                    del self.free[b]
                self.ref[b] += 1
                table.append(b)
                hashes.append(h)
        for _ in range(new):
            b, _ = self.free.popitem(last=False)  # the least recently used
            h = self.block_hash[b]
            if h is not None:  # evict its cached prefix block
                del self.cached[h]
                self.block_hash[b] = None
                if self.on_evict is not None:
                    self.on_evict(h, b)
            self.ref[b] = 1
            table.append(b)
        return True

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted prompt for the hit rate (not counted in `cached_prefix`: a prompt may be looked up
        several times before it is admitted)."""
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    def has_new_full_block(self, seq_id: str, num_computed: int) -> bool:
        """Whether `commit` with `num_computed` would hash a block."""
        return self.enable_prefix_caching and num_computed // self.block_size > len(self.hashes[seq_id])

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int, salt: bytes | None = None) -> None:
        """`seq_id` now holds K/V for its first `num_computed` tokens (`token_ids`, at least that many), computed
        under `salt`: every block that became full is hashed and, when no other block holds the same prefix, made
        findable."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.tables[seq_id], self.hashes[seq_id]
        bs = self.block_size
        for i in range(len(hashes), num_computed // bs):
            h = hash_block(hashes[-1] if hashes else salt, token_ids[i * bs:(i + 1) * bs])
            hashes.append(h)
            b = table[i]
            if b != NULL_BLOCK and self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b

    def free_sequence(self, seq_id: str) -> None:
        """Release a sequence's blocks (finished, aborted or preempted); unknown ids are ignored. Blocks nobody
        else holds go to the free queue, tail first; cached ones stay findable until handed out again."""
        table = self.tables.pop(seq_id, None)
        self.hashes.pop(seq_id, None)
        for b in reversed(table or []):
            if b != NULL_BLOCK:  # a window group's released block
                self._release(b)

    def release_blocks(self, seq_id: str, start: int, stop: int) -> None:
        """Give back `seq_id`'s logical blocks [start, stop) (a window group: no query will see them again); their
        table entries become the null block. Cached ones stay findable until handed out again."""
        table = self.tables[seq_id]
        for i in range(start, min(stop, len(table))):
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None


class WindowedBlockManager:
    """The two KV groups of a model with sliding-window layers (module docstring): `full` for the layers that
    attend to every position, `window` for those that see the last `sliding_window` positions. The scheduler
    uses it as it uses a BlockManager (the full group answers the queries about the pool) and calls `slide` as a
    sequence's next query moves on.

    Args:
        num_blocks: the full group's pool, the null block included.
        window_num_blocks: the window group's pool, the null block included.
        block_size: positions per block (both groups).
        sliding_window: the window the window group serves.
        enable_prefix_caching: keep and reuse full blocks by their prefix hash (both groups).
        on_evict, on_evict_window: the second KV tier's hooks for the full and the window group (BlockManager).
    """

    def __init__(self, num_blocks: int, window_num_blocks: int, block_size: int, sliding_window: int,
                 enable_prefix_caching: bool = True, on_evict: Callable[[bytes, int], None] | None = None,
                 on_evict_window: Callable[[bytes, int], None] | None = None) -> None:
        self.full = BlockManager(num_blocks, block_size, enable_prefix_caching, on_evict)
        self.window = BlockManager(window_num_blocks, block_size, enable_prefix_caching, on_evict_window)
        self.block_size, self.sliding_window = block_size, sliding_window
        self.released: dict[str, int] = {}  # sequence -> its leading logical blocks the window group gave back
        self.stats = self.full.stats

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    def table(self, seq_id: str) -> list[int]:
        return self.full.table(seq_id)

    def window_table(self, seq_id: str) -> list[int]:
        """The window group's table: the null block for logical blocks out of the window."""
        return self.window.table(seq_id)

    def first_visible_block(self, position: int) -> int:
        """The first logical block a query at `position` or later can see (keys at positions > position -
        window)."""
        return max(0, position - self.sliding_window + 1) // self.block_size

    def cached_prefix(self, token_ids: Sequence[int], salt: bytes | None = None) -> list[int]:
        """The full group's blocks of the longest prefix both groups hold (BlockManager.cached_prefix)."""
        full = self.full.cached_prefix(token_ids, salt)
        for n in range(len(full), 0, -1):
            seen = full[self.first_visible_block(n * self.block_size):n]
            if all(self.full.block_hash[b] in self.window.cached for b in seen):
                return full[:n]
        return []

    def window_hits(self, hashes: Sequence[bytes]) -> int:
        """For a sequence starting with the logical blocks named `hashes`: the end of the window group's cached run
        among the blocks its next query sees (first_visible_block .. the first it lacks)."""
        n = len(hashes)
        m = self.first_visible_block(n * self.block_size)
        while m < n and hashes[m] in self.window.cached:
            m += 1
        return m

    def allocate(self, seq_id: str, num_tokens: int, prefix: Sequence[int] = (),
                 hashes: Sequence[bytes] = ()) -> bool:
        """BlockManager.allocate in both groups, all or nothing. A new sequence's window group takes the blocks of
        `prefix` its next query sees (cached: `cached_prefix` checked) and the null block before them. With a KV
        tier, `hashes` names n >= len(prefix) logical blocks the new sequence starts with: the full group takes
        `prefix` and new blocks for the rest, the window group its cached run of the blocks the next query sees
        (`window_hits`) and new blocks after it; the tier fills the new ones."""
        hashes = list(hashes) or [h for b in prefix if (h := self.full.block_hash[b]) is not None]
        window_prefix: list[int] = []
        lo = 0
        if hashes and seq_id not in self.full.tables:
            lo, m = self.first_visible_block(len(hashes) * self.block_size), self.window_hits(hashes)
            window_prefix = [NULL_BLOCK] * lo + [self.window.cached[h] for h in hashes[lo:m]]
        if not (self.full.fits(seq_id, num_tokens, prefix) and self.window.fits(seq_id, num_tokens, window_prefix)):
            return False
        self.full.allocate(seq_id, num_tokens, prefix)
        self.window.allocate(seq_id, num_tokens, window_prefix, hashes)
        if lo:
            self.released[seq_id] = lo
        return True

    def slide(self, seq_id: str, next_position: int) -> None:
        """`seq_id`'s next query lies at `next_position`: the window group gives back the blocks it will not see."""
        start, stop = self.released.get(seq_id, 0), self.first_visible_block(next_position)
        if stop > start:
            self.window.release_blocks(seq_id, start, stop)
            self.released[seq_id] = stop

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.full.record_lookup(num_prompt_tokens, num_hit_tokens)

    def has_new_full_block(self, seq_id: str, num_computed: int) -> bool:
        return self.full.has_new_full_block(seq_id, num_computed)

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int, salt: bytes | None = None) -> None:
        self.full.commit(seq_id, token_ids, num_computed, salt)
        self.window.commit(seq_id, token_ids, num_computed, salt)

    def free_sequence(self, seq_id: str) -> None:
        self.full.free_sequence(seq_id)
        self.window.free_sequence(seq_id)
        self.released.pop(seq_id, None)
