"""An EAGLE-3 head as device graphs on the neuron backend (runtime/eagle3.HeadChain): its weights and its KV on the
device beside the model's, the draft chain of K steps one graph call per step.

Design decisions
- One graph per step. A graph call costs milliseconds on a NeuronCore whatever it computes (the planner's
  per-call cost), and a head step is a small fraction of a target step, so K separate calls would cost more than
  the head's arithmetic. The chain graph (`chain`) is the catch-up layer pass over the row's new positions and
  K - 1 chain steps, unrolled statically in one traced graph: argmax, the d2t map and the next step's embedding
  stay on the device, and only the [B, K] proposed ids come back.
- Buckets: the chain graph per (batch, KV length) of the model's decode buckets, with Q = K + 1 catch-up
  positions per row, what a row needs after a verify that accepted everything (after a plain decode step: one).
  A row further behind (a new prompt, or plain steps the adaptive rule chose, which ask the head for nothing) is
  first filled by `fill` graphs: the layer pass alone, K/V written and no logits, batch 1, one per prefill length
  of the model, over the whole slot (KV length max_model_len), in chunks of the longest; the chain graph then
  takes its last Q positions. So a step pays one graph call, plus fill calls only for rows that fell behind.
- KV: one contiguous slot per sequence ([slots + 1, max_model_len, n_kv, D] per K and V; the last slot is scratch,
  written by a bucket's padding rows), updated in place (torch-xla aliases the updated buffers to their inputs).
  A row's padding positions write past its sequence, where the chain writes next (runtime/eagle3.py).
- tp > 1: the head is small and runs replicated, the same graph on every device of the SPMD program (no
  sharding annotations); a head without embeddings gets a replicated copy of the model's table. At tp 1 it reads
  the model's own device table.
- Traced, not replayed: the host records K head steps per call (small beside the target's layers); the graphs
  compile once per bucket, all of them when the chain is built (on a NeuronCore neuronx-cc runs once per graph).
- The target's states still cross the host (the proposer's bookkeeping is there): [B, S, n_aux * H] per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any

import torch

from models.eagle3 import Eagle3Head, SlotKV
from neuron_opt.buckets import BucketConfig, pick_decode, smallest_fitting

# the rows are runtime/eagle3.ChainRow (slot, start, tokens, aux, k); not imported: runtime imports backends
ChainRow = Any


class DeviceEagle3Chain:
    """`head`: the host head (its weights are copied to the device); `num_slots`: sequences it keeps KV for;
    `buckets`: the model's (decode buckets and the verify length K + 1 give the chain graphs, prefill lengths the
    fill graphs); `embed_table`: the model's token embeddings on the device, for a head without its own."""

    def __init__(self, head: Eagle3Head, num_slots: int, buckets: BucketConfig, xla: ModuleType, device: Any,
                 embed_table: torch.Tensor | None) -> None:
        if buckets.verify_len < 2:
            raise ValueError("eagle3 on the device: the model needs verify graphs (num_speculative_tokens >= 1)")
        self.xla, self.device, self.buckets = xla, device, buckets
        self.K, self.Q = buckets.verify_len - 1, buckets.verify_len
        self.num_slots, self.max_len = num_slots, head.max_model_len
        dtype = head.fc.weight.dtype
        self.head = Eagle3Head(head.cfg, head.max_model_len).to(dtype)
        self.head.load_state_dict(head.state_dict())
        self.head = self.head.eval().to(device)
        if self.head.embed_tokens is None:
            assert embed_table is not None, "a head without embed_tokens needs the model's table"
            self.head.share_embedding(lambda ids: torch.nn.functional.embedding(ids, embed_table))
        self.A = head.cfg.num_aux * head.cfg.aux_hidden_size
        k, v = head.kv_cache(num_slots + 1, dtype)  # the last slot: padding rows' scratch
        self.k_cache, self.v_cache = k.to(device), v.to(device)
        xla.sync()
        self.calls = {"chain": 0, "fill": 0}  # graph calls, for tests and benchmarks
        self._warm_up()

    # ---- the graphs -----------------------------------------------------------------------------------------

    def _chain_graph(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                     slots: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Records the chain: the layer over tokens/aux/positions [B, Q(, A)], the first proposal from each row's
        position `last` [B], then K - 1 chain steps; returns the proposals [B, K] (target ids)."""
        head, B = self.head, tokens.shape[0]
        h = head.run_layer(tokens, head.project(aux), positions, SlotKV(positions, slots, self.k_cache,
                                                                         self.v_cache, kv_len))
        rows = torch.arange(B, dtype=torch.int32, device=self.device)
        logits, hidden = head.logits(h[rows, last])  # [B, V_draft], [B, H]
        token = head.to_target(logits.argmax(-1))
        out = [token]
        pos = positions[rows, last] + 1  # each row's next entry
        for _ in range(1, self.K):
            p = pos.clamp(max=self.max_len - 1)[:, None]  # [B, 1]; a clamped step's proposal is never used
            h = head.run_layer(token[:, None], hidden[:, None], p, SlotKV(p, slots, self.k_cache, self.v_cache,
                                                                            kv_len))
            logits, hidden = head.logits(h[:, 0])
            token = head.to_target(logits.argmax(-1))
            out.append(token)
            pos = pos + 1
        return torch.stack(out, dim=1)  # [B, K]

    def _fill_graph(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """Records the layer pass over [1, S] positions for their K/V (its output is not used)."""
        head = self.head
        head.run_layer(tokens, head.project(aux), positions, SlotKV(positions, slots, self.k_cache, self.v_cache,
                                                                    self.max_len))

    def _run_chain(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                   slots: torch.Tensor, kv_len: int) -> torch.Tensor:
        d = self.device
        with torch.no_grad():
            out = self._chain_graph(tokens.to(torch.int32).to(d), aux.to(d), positions.to(torch.int32).to(d),
                                    last.to(torch.int32).to(d), slots.to(torch.int32).to(d), kv_len)
        self.xla.sync()  # one graph: the proposals and the updated KV
        self.calls["chain"] += 1
        return out.cpu()

    def _run_fill(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor) -> None:
        d = self.device
        with torch.no_grad():
            self._fill_graph(tokens.to(torch.int32).to(d), aux.to(d), positions.to(torch.int32).to(d),
                             slots.to(torch.int32).to(d))
        self.xla.sync()
        self.calls["fill"] += 1

    def _warm_up(self) -> None:
        """Compiles every chain and fill graph now, on the scratch slot, so none compiles while serving."""
        scratch = torch.tensor([self.num_slots])
        for S in self.buckets.prefill_lens:
            self._run_fill(torch.zeros(1, S, dtype=torch.long), torch.zeros(1, S, self.A, dtype=self._dtype),
                           torch.arange(S)[None].clamp(max=self.max_len - 1), scratch)
        for B in self.buckets.decode_batches:
            for L in self.buckets.decode_kv_lens:
                self._run_chain(*self._chain_inputs([], B), scratch.repeat(B), L)
        self.calls = {"chain": 0, "fill": 0}

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.fc.weight.dtype

    # ---- the proposer's side --------------------------------------------------------------------------------

    def _chain_inputs(self, rows: Sequence[ChainRow], B: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of at most Q positions, padded to Q (positions continuing, clamped) and to B rows (the scratch
        slot's, from position 0): tokens, aux, positions [B, Q(, A)], each row's last real index [B]."""
        Q = self.Q
        tokens = torch.zeros(B, Q, dtype=torch.long)
        aux = torch.zeros(B, Q, self.A, dtype=self._dtype)
        positions = torch.arange(Q).repeat(B, 1)
        last = torch.zeros(B, dtype=torch.long)
        for r, row in enumerate(rows):
            n = len(row.tokens)
            tokens[r, :n] = torch.tensor(row.tokens, dtype=torch.long)
            aux[r, :n] = row.aux
            positions[r] = torch.arange(row.start, row.start + Q).clamp(max=self.max_len - 1)
            last[r] = n - 1
        return tokens, aux, positions, last

    def _fill(self, row: ChainRow, n: int) -> None:
        """Runs the row's first `n` positions through fill graphs, in chunks of the longest prefill length."""
        longest = self.buckets.prefill_lens[-1]
        for c in range(0, n, longest):
            m = min(longest, n - c)
            S = smallest_fitting(m, self.buckets.prefill_lens)
            assert S is not None
            tokens = torch.zeros(1, S, dtype=torch.long)
            tokens[0, :m] = torch.tensor(row.tokens[c:c + m], dtype=torch.long)
            aux = torch.zeros(1, S, self.A, dtype=self._dtype)
            aux[0, :m] = row.aux[c:c + m]
            start = row.start + c
            positions = torch.arange(start, start + S)[None].clamp(max=self.max_len - 1)
            self._run_fill(tokens, aux, positions, torch.tensor([row.slot]))

    def propose(self, rows: Sequence[ChainRow]) -> list[list[int]]:
        # torch-xla's lazy tensors cannot be inference tensors (the proposer calls under inference_mode)
        with torch.inference_mode(False), torch.no_grad():
            return self._propose(rows)

    def _propose(self, rows: Sequence[ChainRow]) -> list[list[int]]:
        short = []
        for row in rows:
            if row.k > self.K:
                raise ValueError(f"eagle3 on the device: {row.k} proposals asked, the chain graphs make {self.K}")
            n = len(row.tokens)
            if n > self.Q:  # behind by more than a step: fill up to its last Q positions first
                self._fill(row, n - self.Q)
                row = replace(row, start=row.start + n - self.Q, tokens=row.tokens[n - self.Q:],
                              aux=row.aux[n - self.Q:])
            short.append(row)
        out: list[list[int]] = []
        cap = self.buckets.decode_batches[-1]
        for j in range(0, len(short), cap):
            group = short[j:j + cap]
            # the furthest position whose output is used: the catch-up's last, or the chain's last step
            furthest = max(min(r.start + len(r.tokens) - 1 + self.K - 1, self.max_len - 1) for r in group)
            bucket = pick_decode(len(group), furthest, self.buckets)
            slots = torch.tensor([r.slot for r in group] + [self.num_slots] * (bucket.batch - len(group)))
            got = self._run_chain(*self._chain_inputs(group, bucket.batch), slots, bucket.kv_len)
            out += [got[r, :row.k].tolist() for r, row in enumerate(group)]
        return out
