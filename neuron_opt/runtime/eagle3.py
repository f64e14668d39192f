"""The EAGLE-3 proposer: an EAGLE-3 head's greedy chain (models/eagle3.py), k tokens per sequence, batched over
the sequences of a step.

- Bookkeeping (`Eagle3Proposer`, host side, the same on every backend): the target's graph calls hand over the
  auxiliary hidden states of the tokens they run (`observe_hidden`: prefill chunks, decode rows, the accepted part
  of verify rows). Head position i pairs the target's states at i with token i + 1; `fed[request id]` counts the
  positions 0.. whose head K/V hold those pairs (one head KV slot per sequence). To propose after `token_ids`
  (length L), positions fed..L - 2 must run through the head's layer, the last one's logits give the first
  proposal, and each proposal then runs at the next position with the layer's own output as its hidden input.
  A position whose states the target never computed (a prefix-cache hit) gets zeros: a weaker proposal, never an
  inexact one, since proposals are only ever verified. A failing head call proposes nothing for that step.
- The arithmetic (a `HeadChain`): `EagerChain` runs the head in torch on the host (eager and cpu backends): one
  batched layer pass over the rows' new positions (rows padded to the longest; pads lie past L - 2, where the
  chain writes next), then k - 1 batched chain steps. The neuron backend runs it as device graphs
  (backends/neuron_eagle3.py: the whole chain one graph call). Either way the chain's entries (positions
  >= L - 1) are rewritten with the target's states once it has them, and attention at position p reads positions
  <= p only, so a stale entry is never read.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from models.eagle3 import Eagle3Head

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainRow:
    """One sequence's head work of a step: `tokens` [n] (token p + 1 of each position p = start, start + 1, ...)
    with the target's states `aux` [n, A] at those positions, then a chain of `k` proposals (k >= 1) from the last
    one; the head's K/V go to KV slot `slot`."""

    slot: int
    start: int
    tokens: list[int]
    aux: torch.Tensor
    k: int


class HeadChain(Protocol):
    def propose(self, rows: Sequence[ChainRow]) -> list[list[int]]:
        """Each row's k proposals (target token ids), its positions' K/V written into its slot."""
        ...


class EagerChain:
    """The head in torch, on the host, with its own contiguous KV per slot ([slots, max_model_len, n_kv, D])."""

    def __init__(self, head: Eagle3Head, num_slots: int) -> None:
        self.head = head
        self.k_cache, self.v_cache = head.kv_cache(num_slots, head.fc.weight.dtype)

    def propose(self, rows: Sequence[ChainRow]) -> list[list[int]]:
        head = self.head
        R, N = len(rows), max(len(r.tokens) for r in rows)
        tokens = torch.zeros(R, N, dtype=torch.long)
        positions = torch.zeros(R, N, dtype=torch.long)
        aux = torch.zeros(R, N, rows[0].aux.shape[-1], dtype=head.fc.weight.dtype)
        for r, row in enumerate(rows):
            n = len(row.tokens)
            tokens[r, :n] = torch.tensor(row.tokens, dtype=torch.long)
            positions[r] = torch.arange(row.start, row.start + N).clamp(max=head.max_model_len - 1)
            aux[r, :n] = row.aux
        slots = torch.tensor([row.slot for row in rows], dtype=torch.long)
        h = head.forward_layer(tokens, head.project(aux), positions, slots, self.k_cache, self.v_cache)
        last = torch.tensor([len(row.tokens) - 1 for row in rows])
        logits, hidden = head.logits(h[torch.arange(R), last])  # [R, V_draft], [R, H]
        token = head.to_target(logits.argmax(-1))
        out = [[int(t)] for t in token]
        pos = torch.tensor([row.start + len(row.tokens) for row in rows], dtype=torch.long)  # of each next entry
        live = torch.arange(R)
        for n in range(1, max(row.k for row in rows)):
            keep = torch.tensor([rows[int(r)].k > n for r in live], dtype=torch.bool)
            live, token, hidden, pos = live[keep], token[keep], hidden[keep], pos[keep]
            h = head.forward_layer(token[:, None], hidden[:, None], pos[:, None], slots[live], self.k_cache,
                                   self.v_cache)
            logits, hidden = head.logits(h[:, 0])
            token, pos = head.to_target(logits.argmax(-1)), pos + 1
            for m, r in enumerate(live.tolist()):
                out[r].append(int(token[m]))
        return out


class Eagle3Proposer:
    """The head's proposals for the engine's sequences (module docstring). `chain`: where the head's arithmetic
    runs (None: `EagerChain`, in torch on the host)."""

    cheap = False

    def __init__(self, head: Eagle3Head, num_slots: int, chain: HeadChain | None = None) -> None:
        self.head = head
        self.num_slots = num_slots
        self.chain: HeadChain = chain if chain is not None else EagerChain(head, num_slots)
        self._free = list(range(num_slots - 1, -1, -1))
        self.slot: dict[str, int] = {}
        self.fed: dict[str, int] = {}
        self.pending: dict[str, dict[int, torch.Tensor]] = {}  # request id -> position -> its states [n_aux * H]

    def observe_hidden(self, request_id: str, start: int, aux: torch.Tensor) -> None:
        """The target ran the sequence's tokens at positions start.. and computed their states `aux` [n, A]."""
        base = self.fed.get(request_id, 0)
        if start + aux.shape[0] <= base:
            return
        kept = aux[max(0, base - start):].clone()
        pend = self.pending.setdefault(request_id, {})
        for j in range(kept.shape[0]):
            pend[max(start, base) + j] = kept[j]

    def forget(self, request_id: str) -> None:
        if (slot := self.slot.pop(request_id, None)) is not None:
            self._free.append(slot)
        self.fed.pop(request_id, None)
        self.pending.pop(request_id, None)

    def propose_batch(self, items: Sequence[tuple[str, list[int], int]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in items]
        rows = []
        for i, (rid, ids, k) in enumerate(items):
            if k < 1 or len(ids) < 2 or len(ids) - 1 + k > self.head.max_model_len:
                continue
            if rid not in self.slot:
                if not self._free:
                    continue
                self.slot[rid] = self._free.pop()
            rows.append(i)
        if not rows:
            return out
        try:
            with torch.inference_mode():
                got = self.chain.propose([self._row(*items[i]) for i in rows])
        except Exception:
            log.error("eagle3 head failed; this step proposes nothing:\n%s", traceback.format_exc())
            for i in rows:
                self.fed[items[i][0]] = 0
            return [[] for _ in items]
        for i, proposal in zip(rows, got, strict=True):
            rid, ids, k = items[i]
            out[i] = proposal[:k]
            self.fed[rid] = len(ids) - 1
            pend = self.pending.get(rid, {})
            for p in [p for p in pend if p < len(ids) - 1]:
                del pend[p]
        return out

    def _row(self, rid: str, ids: list[int], k: int) -> ChainRow:
        """The positions fed..L - 2 of the sequence (at least the last one), with the states the target gave."""
        head = self.head
        s = min(self.fed.get(rid, 0), len(ids) - 2)
        n = len(ids) - 1 - s
        aux = torch.zeros(n, head.cfg.num_aux * head.cfg.aux_hidden_size, dtype=head.fc.weight.dtype)
        pend = self.pending.get(rid, {})
        for j in range(n):
            if (row := pend.get(s + j)) is not None:
                aux[j] = row
        return ChainRow(self.slot[rid], s, list(ids[s + 1:s + 1 + n]), aux, k)
