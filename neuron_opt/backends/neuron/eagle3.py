"""An EAGLE-3 head as device graphs on the neuron backend (runtime/eagle3.HeadChain): its weights and its KV on the
device beside the model's, the draft chain of K steps one graph call per step.

Design decisions
- One graph per step. A graph call costs milliseconds on a NeuronCore whatever it computes (the planner's
  per-call cost), and a head step is a small fraction of a target step, so K separate calls would cost more than
  the head's arithmetic. The chain graph (`chain`) is the catch-up layer pass over the row's new positions and
  K - 1 chain steps, unrolled statically in one traced graph: argmax, the d2t map and the next step's embedding
  stay on the device, and only the [B, K] proposed ids come back.
- Buckets: the chain graph (models.eagle3.ChainGraph) per (batch, KV length) of the model's decode buckets, with
  Q = K + 1 catch-up positions per row, what a row needs after a verify that accepted everything (after a plain
  decode step: one). A row further behind (a new prompt, or plain steps the adaptive rule chose, which ask the
  head for nothing) is first filled by `fill` graphs: the layer pass alone, K/V written and no logits, batch 1,
  one per prefill length of the model, over the whole sequence (KV length max_model_len), in chunks of the
  longest; the chain graph then takes its last Q positions. So a step pays one graph call, plus fill calls only
  for rows that fell behind.
- KV: pools of the target's block count and block size ([num_blocks, n_kv, block_size, D] per K and V,
  models.eagle3.PagedKV) read through the target's block tables, updated in place (torch-xla aliases the updated
  buffers to their inputs). Padding entries write the null block, as the target's do.
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

from models.eagle3 import ChainGraph, ChainInputs, ChainRow, Eagle3Head, PagedKV, chain_inputs
from neuron_opt.buckets import BucketConfig, pick_decode, smallest_fitting
from neuron_opt.config import CacheConfig


class DeviceEagle3Chain:
    """`head`: the host head (its weights are copied to the device); `cache`: the target's KV layout (the head's
    pools have its block count and size); `buckets`: the model's (decode buckets and the verify length K + 1 give
    the chain graphs, prefill lengths the fill graphs); `embed_table`: the model's token embeddings on the device,
    for a head without its own."""

    def __init__(self, head: Eagle3Head, cache: CacheConfig, buckets: BucketConfig, xla: ModuleType, device: Any,
                 embed_table: torch.Tensor | None) -> None:
        if buckets.verify_len < 2:
            raise ValueError("eagle3 on the device: the model needs verify graphs (num_speculative_tokens >= 1)")
        self.xla, self.device, self.buckets = xla, device, buckets
        self.K, self.Q = buckets.verify_len - 1, buckets.verify_len
        self.block_size, self.max_len = cache.block_size, head.max_model_len
        dtype = head.fc.weight.dtype
        self.head = Eagle3Head(head.cfg, head.max_model_len).to(dtype)
        self.head.load_state_dict(head.state_dict())
        self.head = self.head.eval().to(device)
        if self.head.embed_tokens is None:
            assert embed_table is not None, "a head without embed_tokens needs the model's table"
            self.head.share_embedding(lambda ids: torch.nn.functional.embedding(ids, embed_table))
        self.graph = ChainGraph(self.head, self.K)
        self.A = head.cfg.num_aux * head.cfg.aux_hidden_size
        k, v = head.kv_pools(cache.num_blocks, cache.block_size, dtype)
        self.k_pool, self.v_pool = k.to(device), v.to(device)
        xla.sync()
        self.calls = {"chain": 0, "fill": 0}  # graph calls, for tests and benchmarks
        self._warm_up()

    def _table_blocks(self, kv_len: int) -> int:
        """Block-table width of a graph over head positions < kv_len (their entries at logical positions <= kv_len)."""
        return -(-(kv_len + 1) // self.block_size)

    def _inputs(self, rows: Sequence[ChainRow], batch: int, q: int, k: int, kv_len: int) -> ChainInputs:
        return chain_inputs(rows, batch, q, k, self.block_size, self._table_blocks(kv_len), self.max_len, self.A,
                            self.head.fc.weight.dtype)

    def _to_device(self, x: ChainInputs) -> list[torch.Tensor]:
        return [t.to(self.device) if t.is_floating_point() else t.to(torch.int32).to(self.device)
                for t in x.arrays()]

    def _run_chain(self, x: ChainInputs) -> torch.Tensor:
        with torch.no_grad():
            out = self.graph(*self._to_device(x), self.k_pool, self.v_pool)
        self.xla.sync()  # one graph: the proposals and the updated KV
        self.calls["chain"] += 1
        return out.cpu()

    def _run_fill(self, x: ChainInputs) -> None:
        """The layer pass over [1, S] positions for their K/V (its output is not used)."""
        tokens, aux, positions, slots, _, _, _, tables = self._to_device(x)
        head = self.head
        with torch.no_grad():
            head.run_layer(tokens, head.project(aux), positions,
                           PagedKV(positions, slots, tables, self.k_pool, self.v_pool))
        self.xla.sync()
        self.calls["fill"] += 1

    def _warm_up(self) -> None:
        """Compiles every chain and fill graph now, on padding rows (the null block), so none compiles while
        serving."""
        for S in self.buckets.prefill_lens:
            self._run_fill(self._inputs([], 1, S, 1, self.max_len))
        for B in self.buckets.decode_batches:
            for L in self.buckets.decode_kv_lens:
                self._run_chain(self._inputs([], B, self.Q, self.K, L))
        self.calls = {"chain": 0, "fill": 0}

    # ---- the proposer's side --------------------------------------------------------------------------------

    def _fill(self, row: ChainRow, n: int) -> None:
        """Runs the row's first `n` positions through fill graphs, in chunks of the longest prefill length."""
        longest = self.buckets.prefill_lens[-1]
        for c in range(0, n, longest):
            m = min(longest, n - c)
            S = smallest_fitting(m, self.buckets.prefill_lens)
            assert S is not None
            part = ChainRow(row.blocks, row.start + c, row.tokens[c:c + m], row.aux[c:c + m], 1)
            self._run_fill(self._inputs([part], 1, S, 1, self.max_len))

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
            got = self._run_chain(self._inputs(group, bucket.batch, self.Q, self.K, bucket.kv_len))
            out += [got[r, :row.k].tolist() for r, row in enumerate(group)]
        return out
