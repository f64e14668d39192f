"""The EAGLE-3 proposer: an EAGLE-3 head's greedy chain (models/eagle3.py), k tokens per sequence, batched over
the sequences of a step, its one-layer KV in the target's block layout.

- Bookkeeping (`Eagle3Proposer`, host side, the same on every backend): the target's graph calls hand over the
  auxiliary hidden states of the tokens they run (`observe_hidden`: prefill chunks, decode rows, the accepted part
  of verify rows). Head position i pairs the target's states at i with token i + 1; `fed[request id]` counts the
  positions 0.. whose head K/V hold those pairs. To propose after `token_ids` (length L), positions fed..L - 2 must
  run through the head's layer, the last one's logits give the first proposal, and each proposal then runs at the
  next position with the layer's own output as its hidden input. A position whose states the target never gave (a
  prefix-cache hit whose head entries are not kept, below) gets zeros: a weaker proposal, never an inexact one,
  since proposals are only ever verified. A failing head call proposes nothing for that step.
- Where the head's K/V live: in pools of the target's block count and block size, through the target's own block
  tables (`models.eagle3.PagedKV`: head position p at the sequence's logical position p + 1, so a block's head
  entries depend on the tokens its prefix-cache hash covers and nothing after them). So they follow the target's
  blocks: a preempted sequence gives them back with its blocks, and a prefix-cache hit finds the head's entries of
  the shared blocks where the sequence that computed them left them.
- Which entries hold what (`records`): the proposer writes every head entry itself, so it knows what each block
  holds. After a call, each full block of a row whose head entries all came from the target's states is recorded
  under the prefix-cache key of its tokens (runtime/block_manager.hash_block chained over the request's
  `cache_tokens` from its `cache_salt`: the key the block manager uses, adapter and images included); a write into
  a block drops its record first. A sequence whose `fed` is unknown (a new one, or one preempted since:
  `preempted`) starts after the longest run of its leading blocks whose records carry its own keys, so a shared
  prefix is neither recomputed nor rewritten, and its entries are exactly those the sequence would compute. The
  records hold the target's states at each block's last position too: the head's next position reads them, and
  the target does not recompute them for a hit.
- The arithmetic (a `HeadChain`): `EagerChain` runs `models.eagle3.ChainGraph` in torch on the host (the eager
  backend and its TP rank processes): one batched layer pass over the rows' new positions
  (rows padded to the longest; pads write the null block), then k - 1 batched chain steps. The cpu backend
  compiles the same graph per decode batch (backends/cpu/eagle3.py), the neuron backend per decode bucket
  (backends/neuron_eagle3.py). Either way the chain's entries (positions >= L - 1) are rewritten from the
  target's states once it has them, and attention at position p reads positions <= p only, so a stale entry is
  never read.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from models.eagle3 import ChainRow, run_chain
from neuron_opt.config import CacheConfig
from neuron_opt.runtime.block_manager import hash_block

if TYPE_CHECKING:
    from models.eagle3 import Eagle3Head

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeqBlocks:
    """What the head needs of a sequence's KV blocks: its block table, and the prefix-cache view of its tokens
    (`Request.cache_tokens()`, `Request.cache_salt`) that keys its full blocks."""

    blocks: tuple[int, ...]
    cache_tokens: list[int]
    salt: bytes | None = None


class HeadChain(Protocol):
    block_size: int

    def propose(self, rows: Sequence[ChainRow]) -> list[list[int]]:
        """Each row's k proposals (target token ids), its positions' K/V written into its blocks."""
        ...


class EagerChain:
    """The head in torch on the host, with K/V pools of the target's block count and size (`Eagle3Head.kv_pools`)."""

    def __init__(self, head: Eagle3Head, cache: CacheConfig) -> None:
        self.head, self.block_size = head, cache.block_size
        self.k_pool, self.v_pool = head.kv_pools(cache.num_blocks, cache.block_size, head.fc.weight.dtype)

    def propose(self, rows: Sequence[ChainRow]) -> list[list[int]]:
        return run_chain(self.head, rows, self.k_pool, self.v_pool, self.block_size)


class Eagle3Proposer:
    """The head's proposals for the engine's sequences (module docstring). `cache`: the target's KV layout (the
    head's pools have its block count and size); `chain`: where the head's arithmetic runs (None: `EagerChain`)."""

    cheap = False

    def __init__(self, head: Eagle3Head, cache: CacheConfig, chain: HeadChain | None = None) -> None:
        self.head = head
        self.chain: HeadChain = chain if chain is not None else EagerChain(head, cache)
        if self.chain.block_size != cache.block_size:
            raise ValueError(f"eagle3: the chain's blocks hold {self.chain.block_size} positions, the model's "
                             f"{cache.block_size}")
        self.block_size = cache.block_size
        self.fed: dict[str, int] = {}
        self.pending: dict[str, dict[int, torch.Tensor]] = {}  # request id -> position -> its states [n_aux * H]
        self.keys: dict[str, list[bytes]] = {}  # request id -> prefix-cache keys of its full blocks, in order
        self.guessed: dict[str, set[int]] = {}  # request id -> logical blocks holding entries of zero states
        # block -> (the key of the tokens its head entries were computed for, the target's states at its last
        # position: what the head's next position, in the next block, reads)
        self.records: dict[int, tuple[bytes, torch.Tensor]] = {}
        self.reused = 0  # head positions taken from records instead of computed (a prefix hit, a resumed preemption)

    def observe_hidden(self, request_id: str, start: int, aux: torch.Tensor) -> None:
        """The target ran the sequence's tokens at positions start.. and computed their states `aux` [n, A]."""
        pend = self.pending.setdefault(request_id, {})
        kept = aux.clone()
        for j in range(kept.shape[0]):
            pend[start + j] = kept[j]

    def preempted(self, request_id: str) -> None:
        """The sequence gave its blocks back: what its head entries were is found again from the records."""
        self.fed.pop(request_id, None)
        self.guessed.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self.fed.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.keys.pop(request_id, None)
        self.guessed.pop(request_id, None)

    def _keys(self, rid: str, seq: SeqBlocks, full: int) -> list[bytes]:
        """The prefix-cache keys of the sequence's first `full` blocks (extended as it grows)."""
        keys, bs = self.keys.setdefault(rid, []), self.block_size
        for i in range(len(keys), full):
            keys.append(hash_block(keys[-1] if keys else seq.salt, seq.cache_tokens[i * bs:(i + 1) * bs]))
        return keys

    def _recorded(self, rid: str, seq: SeqBlocks, num_tokens: int) -> int:
        """Head positions 0.. whose entries the sequence's leading blocks hold for its own tokens (records); the
        target's states at the position after them come with the last block's record."""
        full = min(num_tokens, len(seq.cache_tokens)) // self.block_size
        keys = self._keys(rid, seq, full)
        m = 0
        while m < min(full, len(seq.blocks)) and (rec := self.records.get(seq.blocks[m])) is not None \
                and rec[0] == keys[m]:
            m += 1
        if m == 0:
            return 0
        fed = m * self.block_size - 1
        self.pending.setdefault(rid, {}).setdefault(fed, self.records[seq.blocks[m - 1]][1])
        return fed

    def propose_batch(self, items: Sequence[tuple[str, list[int], int]], seqs: Sequence[SeqBlocks]
                      ) -> list[list[int]]:
        """For each (request id, token ids so far, k) and its blocks: up to k proposals."""
        out: list[list[int]] = [[] for _ in items]
        rows = [i for i, (_, ids, k) in enumerate(items) if k >= 1 and len(ids) >= 2
                and len(ids) - 1 + k <= self.head.max_model_len]
        if not rows:
            return out
        for i in rows:
            rid, ids, _ = items[i]
            if rid not in self.fed:
                fed = self._recorded(rid, seqs[i], len(ids))
                self.reused += min(fed, len(ids) - 2)
                self.fed[rid] = fed
        chain_rows = [self._row(*items[i], seqs[i]) for i in rows]
        for row in chain_rows:  # what these rows write no longer holds what a record says
            self._drop_records(row)
        try:
            with torch.inference_mode():
                got = self.chain.propose(chain_rows)
        except Exception:
            log.error("eagle3 head failed; this step proposes nothing:\n%s", traceback.format_exc())
            for i in rows:
                self.preempted(items[i][0])  # its entries may be half written: found again from the records
            return [[] for _ in items]
        for i, row, proposal in zip(rows, chain_rows, got, strict=True):
            rid, ids, k = items[i]
            out[i] = proposal[:k]
            self.fed[rid] = len(ids) - 1
            self._record(rid, row, seqs[i], len(ids))
            # the states of its last, partial block stay: a preemption may lose its entries before a record has them
            pend = self.pending.get(rid, {})
            keep = (len(ids) // self.block_size) * self.block_size - 1
            for p in [p for p in pend if p < keep]:
                del pend[p]
        return out

    def _row(self, rid: str, ids: list[int], k: int, seq: SeqBlocks) -> ChainRow:
        """The positions fed..L - 2 of the sequence (at least the last one), with the states the target gave."""
        head, bs = self.head, self.block_size
        s = min(self.fed[rid], len(ids) - 2)
        n = len(ids) - 1 - s
        aux = torch.zeros(n, head.cfg.num_aux * head.cfg.aux_hidden_size, dtype=head.fc.weight.dtype)
        pend = self.pending.get(rid, {})
        guessed = self.guessed.setdefault(rid, set())
        first = (s + 1) // bs + ((s + 1) % bs > 0)  # the first block rewritten from its start
        guessed -= {b for b in guessed if b >= first}
        for j in range(n):
            if (row := pend.get(s + j)) is not None:
                aux[j] = row
            else:
                guessed.add((s + j + 1) // bs)
        return ChainRow(seq.blocks, s, list(ids[s + 1:s + 1 + n]), aux, k)

    def _drop_records(self, row: ChainRow) -> None:
        """Forget the records of every block the row writes (its new positions and its chain's)."""
        bs = self.block_size
        first, last = (row.start + 1) // bs, (row.start + len(row.tokens) + row.k - 1) // bs
        for b in row.blocks[first:last + 1]:
            self.records.pop(b, None)

    def _record(self, rid: str, row: ChainRow, seq: SeqBlocks, num_tokens: int) -> None:
        """Record the sequence's full blocks whose head entries all came from the target's states, once the states
        at their last position are known too (the block before the row's first write completes now, at the
        latest): module docstring."""
        bs = self.block_size
        full = min(num_tokens, len(seq.cache_tokens)) // bs
        keys = self._keys(rid, seq, full)
        guessed, pend = self.guessed.get(rid, set()), self.pending.get(rid, {})
        for i in range(max(0, (row.start + 1) // bs - 1), min(full, len(seq.blocks))):
            if i not in guessed and (last := pend.get((i + 1) * bs - 1)) is not None:
                self.records[seq.blocks[i]] = (keys[i], last)
