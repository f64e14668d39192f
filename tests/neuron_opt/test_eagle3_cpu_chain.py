"""The EAGLE-3 draft chain as the cpu backend runs it: `models.eagle3.ChainGraph` at a decode batch's fixed shape
(rows padded to the batch and to K + 1 catch-up positions, the block table cut to the positions' reach), and
compiled (backends/cpu/eagle3.CpuEagle3Chain, one AOTInductor graph per decode batch). Its proposals equal the
head's in torch on the host (runtime/eagle3.EagerChain, itself equal to the chain recomputed from scratch in
test_eagle3_engine.py) over the same calls, each with its own block pools: new prompts (a torch fill first), rows
one step behind, several rows of different k in one call, rows sharing their first block.

Oracle: EagerChain (models/eagle3.run_chain), the host head checked against speculators in tests/models."""

from __future__ import annotations

import pytest
import torch
from eagle3_heads import write_random_head
from tiny import make_tiny

from models.eagle3 import ChainGraph, ChainRow, chain_inputs, run_chain
from neuron_opt.api import LLM
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.runtime.eagle3 import EagerChain

K = 3
BS = 8


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    path = make_tiny("llama-gqa2", tmp_path_factory.mktemp("ckpt"), tokenizer=True)
    head_dir = write_random_head(tmp_path_factory.mktemp("head"), path, [0, 1, 2], draft_vocab=64)
    llm = LLM(path, batch_size=2, max_model_len=64)
    return llm.eagle3(head_dir), llm, path, head_dir


def _calls(A: int) -> list[list[ChainRow]]:
    """Three steps of two sequences (blocks 1..8 and 9..16, sharing nothing): a new prompt of 20 positions and one
    of 5, then each one step on (k 3 and 2), then the first after a verify that accepted everything (K + 1 new
    positions) beside the second one position on."""
    g = torch.Generator().manual_seed(0)

    def row(blocks: tuple[int, ...], start: int, n: int, k: int) -> ChainRow:
        return ChainRow(blocks, start, torch.randint(3, 250, (n,), generator=g).tolist(),
                        torch.randn(n, A, generator=g), k)

    a, b = tuple(range(1, 9)), tuple(range(9, 17))
    return [[row(a, 0, 20, 3), row(b, 0, 5, 3)],
            [row(a, 20, 1, 3), row(b, 5, 1, 2)],
            [row(a, 21, K + 1, 3), row(b, 6, 1, 1)]]


def test_the_chain_graph_at_a_buckets_shape_equals_the_host_chain(head):
    """What the compiled graph computes, in torch: rows padded to batch 4 and K + 1 positions (padding entries to
    the null block) over a cut block table give the host chain's proposals, call after call (cheap: no compile)."""
    head, *_ = head
    cache = CacheConfig(max_batch=4, max_model_len=64, block_size=BS, num_blocks=17)
    A = head.cfg.num_aux * head.cfg.aux_hidden_size
    host = EagerChain(head, cache)
    kp, vp = head.kv_pools(cache.num_blocks, BS, torch.float32)
    with torch.inference_mode():
        for rows in _calls(A):
            want = host.propose(rows)
            short = []
            for r in rows:
                if len(r.tokens) > K + 1:  # the torch fill of what the graph does not take, as CpuEagle3Chain does
                    n = len(r.tokens) - K - 1
                    run_chain(head, [ChainRow(r.blocks, r.start, r.tokens[:n], r.aux[:n], 1)], kp, vp, BS)
                    r = ChainRow(r.blocks, r.start + n, r.tokens[n:], r.aux[n:], r.k)
                short.append(r)
            x = chain_inputs(short, 4, K + 1, K, BS, 5, head.max_model_len, A, torch.float32)
            got = ChainGraph(head, K)(*x.arrays(), kp, vp)
            assert [got[i, :r.k].tolist() for i, r in enumerate(rows)] == want


@pytest.mark.slow  # compiles two AOTInductor graphs
def test_compiled_cpu_chain_proposes_as_the_host_chain(head):
    """CpuEagle3Chain (a graph per decode batch 1 and 2, the model's table as an input: the head has no
    embeddings of its own) gives EagerChain's proposals over the same calls, and one graph call per call."""
    from neuron_opt.backends.cpu.backend import bind_graph
    from neuron_opt.backends.cpu.eagle3 import CpuEagle3Chain

    head, llm, *_ = head
    cache = CacheConfig(max_batch=2, max_model_len=64, block_size=BS, num_blocks=17)
    buckets = BucketConfig.build(max_prompt_len=32, max_model_len=64, max_batch=2, min_prefill=16, min_decode=32,
                                 num_speculative_tokens=K)
    table = llm.runner.embedding_fn()(torch.arange(llm.config.vocab_size))
    chain = CpuEagle3Chain(head, cache, buckets, table, bind_graph)
    assert sorted(chain.runners) == [1, 2]
    host = EagerChain(head, cache)
    A = head.cfg.num_aux * head.cfg.aux_hidden_size
    with torch.inference_mode():
        for rows in _calls(A):
            assert chain.propose(rows) == host.propose(rows)
            assert chain.propose(rows[1:]) == host.propose(rows[1:])  # batch 1's graph
    assert chain.calls == {"chain": 6, "fill": 2}  # the new prompts of the first call, twice


@pytest.mark.slow  # compiles a cpu artifact and its chain graph
def test_a_cpu_artifact_speculates_through_its_compiled_chain_exactly(head, tmp_path):
    """A cpu artifact of the tiny model with verify graphs: greedy with the head (its chain the compiled graph)
    equals the eager plain loop's, two prompts at once, and the chain graph made the proposals."""
    from helpers import reference_generate

    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.runtime.sampling import SamplingParams
    from neuron_opt.runtime.speculative import SpeculativeConfig

    _, llm, path, head_dir = head
    req = CompileRequest(model=str(path), out=tmp_path / "art", backend="cpu", dtype="float32", batch_size=2,
                         max_model_len=64, prefill_buckets=(32,), decode_buckets=(64,), cache_dir=tmp_path / "cache",
                         num_speculative_tokens=K)
    compile_artifact(req, log=lambda s: None, progress=False)
    compiled = LLM(tmp_path / "art")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 14)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = compiled.generate_batch(prompts, params,
                                   speculative=SpeculativeConfig(K, "eagle3", adaptive=False, model=str(head_dir)))
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_generate(llm, p, params).token_ids
    chain = compiled.runner.executor._chain[1]
    assert type(chain).__name__ == "CpuEagle3Chain" and chain.calls["chain"] > 0
