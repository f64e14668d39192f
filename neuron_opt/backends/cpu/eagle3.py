"""An EAGLE-3 head's draft chain as compiled cpu graphs (runtime/eagle3.HeadChain), beside the cpu backend's model.

Design decisions
- One AOTInductor graph per decode batch of the model: models.eagle3.ChainGraph with Q = K + 1 catch-up positions
  per row (what a row needs after a verify that accepted everything; after a plain decode step: one) and the
  K - 1 chain steps unrolled, so argmax, the d2t map and the next step's embedding stay inside the graph and a
  step makes one call for its proposals. The block tables' width is a dynamic dimension, as in the model's layer
  graphs: one graph serves every KV length of its batch.
- Weight-free, as the model's graphs: the .so is compiled on a placeholder copy and its constants are bound at
  load to the head's own tensors (cpu_graphs.compile_graph's recipes; GEMMs on aten, so they are the tensors as
  held, with no packed copy). A head without embed_tokens reads the model's table as the graph's last
  input: a [V, H] copy made once (the model's own may be held packed inside its LM head's layout).
- Compiled when the chain is built (the engine starts with `--speculative-model`; the head is not part of the
  artifact), into a temporary directory the chain owns; the executor keeps the chain per head, so later engines
  over the same model reuse its graphs.
- A row further behind than Q positions (a new prompt, or plain steps the adaptive rule chose) first runs its
  earlier positions through the head in torch (models.eagle3.fill); the graph then takes its last Q.
- The K/V: pools of the target's block count and size (models.eagle3.PagedKV), inputs the graph writes in place.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.export import Dim

from models.eagle3 import ChainGraph, ChainRow, Eagle3Head, chain_inputs, fill, table_blocks
from neuron_opt.backends.cpu.constants import ConstantRecipe
from neuron_opt.backends.cpu.graphs import compile_graph
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig

# (graph .so, its constant recipes, the tensors they name) -> (a container to `run`, the constants it holds)
BindGraph = Callable[[Path, dict[str, ConstantRecipe], dict[str, torch.Tensor]], tuple[Any, list[torch.Tensor]]]


class CpuEagle3Chain:
    """`head`: the head (its tensors are bound to the graphs); `cache`: the target's KV layout; `buckets`: the
    model's (its decode batches and verify length K + 1 give the graphs); `embed_table`: the model's token
    embeddings [V, H] for a head without its own (else None); `bind`: the cpu backend's loader of a graph."""

    def __init__(self, head: Eagle3Head, cache: CacheConfig, buckets: BucketConfig,
                 embed_table: torch.Tensor | None, bind: BindGraph) -> None:
        if buckets.verify_len < 2:
            raise ValueError("eagle3 on the cpu backend: the model needs verify graphs (num_speculative_tokens >= 1)")
        self.block_size, self.max_blocks = cache.block_size, cache.blocks_per_sequence + 1
        self.K, self.Q = buckets.verify_len - 1, buckets.verify_len
        self.dtype = head.fc.weight.dtype
        self.A = head.cfg.num_aux * head.cfg.aux_hidden_size
        self.k_pool, self.v_pool = head.kv_pools(cache.num_blocks, cache.block_size, self.dtype)
        self.table = () if embed_table is None else (embed_table.to(self.dtype).contiguous(),)
        # the graphs' own copy of the head: a head sharing the model's embeddings holds the executor's function,
        # which the compile's copy of the module cannot take; the table is an input instead
        self.head = Eagle3Head(head.cfg, head.max_model_len).to(self.dtype)
        self.head.load_state_dict(head.state_dict())
        self.head.eval()
        self.graph = ChainGraph(self.head, self.K, table_input=embed_table is not None).eval()
        self._bind = bind
        self._constants: dict[int, list[torch.Tensor]] = {}  # each graph's bound constants, kept alive
        self._dir = tempfile.TemporaryDirectory(prefix="neuron_opt_eagle3_")
        self.batches = sorted(buckets.decode_batches)
        self.runners = {B: self._compile(B) for B in self.batches}
        if self.table:  # the torch fill of rows further behind reads the same table
            table = self.table[0]
            self.head.share_embedding(lambda ids: F.embedding(ids, table))
        self.calls = {"chain": 0, "fill": 0}  # graph calls and torch fills, for tests and benchmarks

    def _example(self, B: int) -> tuple[torch.Tensor, ...]:
        x = chain_inputs([], B, self.Q, self.K, self.block_size, 2, self.head.max_model_len, self.A, self.dtype)
        return (*x.arrays(), self.k_pool, self.v_pool, *self.table)

    def _compile(self, B: int) -> Any:
        blocks = Dim("blocks", min=2, max=max(3, self.max_blocks))
        dyn = (None, None, None, None, None, None, None, {1: blocks}, None, None, *(None for _ in self.table))
        so = Path(self._dir.name) / f"eagle3_chain_b{B}.so"
        recipes = compile_graph(self.graph, self._example(B), dyn, "aten", so, f"cpu eagle3 chain graph for batch {B}")
        tensors = {**dict(self.graph.state_dict()), **dict(self.graph.named_buffers())}
        runner, self._constants[B] = self._bind(so, recipes, tensors)
        return runner

    def propose(self, rows: Sequence[ChainRow]) -> list[list[int]]:
        short = []
        behind = [r for r in rows if len(r.tokens) > self.Q]
        if behind:  # their positions before the last Q, in torch first
            fill(self.head, [replace(r, tokens=r.tokens[:len(r.tokens) - self.Q], aux=r.aux[:len(r.tokens) - self.Q],
                                     k=1) for r in behind], self.k_pool, self.v_pool, self.block_size)
            self.calls["fill"] += 1
        for row in rows:
            if row.k > self.K:
                raise ValueError(f"eagle3 chain graphs make {self.K} proposals, {row.k} asked")
            n = len(row.tokens)
            short.append(row if n <= self.Q else replace(row, start=row.start + n - self.Q,
                                                         tokens=row.tokens[n - self.Q:], aux=row.aux[n - self.Q:]))
        out: list[list[int]] = []
        cap = self.batches[-1]
        for j in range(0, len(short), cap):
            group = short[j:j + cap]
            B = next(b for b in self.batches if b >= len(group))
            nb = min(table_blocks(group, self.K, self.block_size), self.max_blocks)
            x = chain_inputs(group, B, self.Q, self.K, self.block_size, nb, self.head.max_model_len, self.A,
                             self.dtype)
            got = self.runners[B].run([*x.arrays(), self.k_pool, self.v_pool, *self.table])[0]
            self.calls["chain"] += 1
            out += [got[r, :row.k].tolist() for r, row in enumerate(group)]
        return out
