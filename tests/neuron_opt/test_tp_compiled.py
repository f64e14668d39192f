"""Compiled TP graphs: AOTInductor per bucket per rank with the gloo collectives inside the graph.

Slow (two AOTInductor compiles per rank, ~1 min on this machine). Oracle: HF logits; counts vs the formula;
a second set of ranks (a new process group) loads the packages instead of compiling them.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from neuron_opt.buckets import BucketConfig, pick_decode, pick_prefill
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.parallel.comm_cost import expected_calls
from neuron_opt.parallel.executor import tp_executor_from_state_dict
from neuron_opt.runtime.runner import DecodeRow, ModelRunner

pytestmark = pytest.mark.slow


def test_aoti_rank_graphs_match_hf_and_reload(tiny_dir, tmp_path):
    d = tiny_dir("smollm-like-9-3")
    cfg = ModelConfig.from_hf(d)
    sd = load_file(str(d / "model.safetensors"))
    sd.pop("lm_head.weight", None)
    par = ParallelConfig(tp=2, sequence_parallel=True)  # MHA padding + all_gather/reduce_scatter in the graph
    cache = CacheConfig(max_batch=1, max_length=64)
    buckets = BucketConfig.build(
        max_context=64, max_length=64, max_batch=1, prefill_seqs=(16,), decode_seqs=(16,)
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = [1, 17, 42, 99, 5, 123, 7, 8, 9, 10, 11, 12, 13, 14]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for attempt in ("compile", "load"):
        ex = tp_executor_from_state_dict(
            cfg, sd, par, cache, tmp_path / attempt, graphs="aoti", graph_dir=tmp_path / "graphs"
        )
        try:
            paths = ex.precompile(buckets.buckets())
            assert all((tmp_path / "graphs").exists() and p.endswith("tp_model.pt2") for p in paths)
            runner = ModelRunner(ex, buckets, cache, cfg.vocab_size)
            ex.reset_collective_calls()
            got = [runner.prefill(0, ids[:10])]
            assert ex.collective_calls() == expected_calls(cfg, par, pick_prefill(10, buckets), 4, None)
            ex.reset_collective_calls()
            for t in range(10, len(ids)):
                got.append(runner.decode([DecodeRow(0, ids[t], t)])[0])
            assert ex.collective_calls() == expected_calls(cfg, par, pick_decode(1, 10, buckets), 4, None) * 4
            torch.testing.assert_close(torch.stack(got), ref[9:], atol=1e-4, rtol=0)
        finally:
            ex.close()
