"""Mixture of experts against HF transformers (fp32, tiny random Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints).

tp 1 eager parity (prefill + 16 decode logits within 1e-4, 32 greedy tokens) runs for every variant in
tests/models/test_llama_parity.py. Here: the three ways of applying experts against each other, and the
parallel layouts as real ranks: tp 2 (each expert split over both ranks), ep 2 (four whole experts per rank),
and tp 4 = 2 x ep 2 (both), each against HF, also as hybrid layouts (another ep for decode); the expert shards
themselves; and the config errors.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ThreadRanks, check_tp_against_hf
from safetensors.torch import load_file
from tiny import load_hf

from models.build import rank_model_factory
from models.moe import CPU_GRAPH, DENSE, DEVICE, EAGER, GATHER, GROUPED, SparseMoeBlock, moe_strategy
from neuron_opt.buckets import BucketConfig, pick_decode, pick_prefill
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.executors.launcher import RankSpec, write_rank_weights
from neuron_opt.executors.tp import tp_executor_from_state_dict
from neuron_opt.parallel import SINGLE, ParallelContext
from neuron_opt.parallel.sharding import head_layout, shard_state_dict, shard_tensor
from neuron_opt.planner.collectives import expected_calls
from neuron_opt.runtime.runner import DecodeRow, ModelRunner
from neuron_opt.weights import load_weights

MOE = ["mixtral", "qwen2-moe", "qwen3-moe"]


def _block(cfg: ModelConfig, lay, pctx=SINGLE, seed: int = 0) -> SparseMoeBlock:
    block = SparseMoeBlock(cfg, lay, pctx)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block.eval()


@pytest.mark.parametrize("variant", MOE)
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gather_grouped_and_dense_agree(variant, tokens, tiny_dir, monkeypatch):
    """The same block on the same tokens through each strategy (forced), fp32: equal to 1e-5."""
    import models.moe as moe

    cfg = ModelConfig.from_hf(tiny_dir(variant))
    lay = head_layout(cfg, ParallelConfig())
    block = _block(cfg, lay)
    x = torch.randn(1, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    outs = {}
    for how in (GATHER, "gather-traced", GROUPED, DENSE):
        if how == GROUPED and cfg.moe_intermediate_size * 4 % 16:
            continue  # torch's grouped GEMM needs 16-byte strides (the block then takes dense itself)
        monkeypatch.setattr(moe, "moe_strategy", lambda *a, how=how: how.removesuffix("-traced"))
        # the traced form of gather (the broadcast product a compiler fuses), run eagerly
        monkeypatch.setattr(moe, "_tracing", lambda how=how: how.endswith("-traced"))
        with torch.no_grad():
            outs[how] = block(x)
    for how, out in outs.items():
        torch.testing.assert_close(out, outs[DENSE], atol=1e-5, rtol=1e-5, msg=how)


def test_strategy_crossover():
    """Gather while the selected (token, expert) pairs are fewer than the experts held; then all experts once on a
    device, grouped GEMMs eagerly on the host; cpu graphs keep gathering."""
    assert moe_strategy(1, 2, 8, DEVICE) == GATHER
    assert moe_strategy(3, 2, 8, DEVICE) == GATHER
    assert moe_strategy(4, 2, 8, DEVICE) == DENSE
    assert moe_strategy(4, 2, 8, EAGER) == GROUPED
    assert moe_strategy(1, 2, 2, EAGER) == GROUPED  # ep 4: two experts per rank
    assert moe_strategy(64, 2, 8, CPU_GRAPH) == GATHER  # cpu decode graphs always gather


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("variant, tokens", [("qwen2-moe", 1), ("qwen2-moe", 10), ("qwen3-moe", 10)])
@pytest.mark.parametrize("traced", [False, True])
def test_expert_shards_sum_to_the_block(variant, tokens, traced, tp, ep, tiny_dir, monkeypatch):
    """Each rank's model built and loaded from its shard of the checkpoint (its experts, its features, its slice of
    the shared expert); the ranks' sparse blocks, summed as the all-reduce sums them, equal the unsharded block: no
    token is lost or counted twice across expert groups. `traced`: the forms traced graphs take (the broadcast
    gather, dense), run eagerly."""
    import models.moe as moe

    monkeypatch.setattr(moe, "_tracing", lambda: traced)
    d = tiny_dir(variant)  # 1 token: gather; 10: grouped (qwen2-moe) or dense (qwen3-moe's unaligned width)
    cfg = ModelConfig.from_hf(d)
    sd = load_file(str(d / "model.safetensors"))
    cache = CacheConfig(max_batch=1, max_model_len=64)
    par = ParallelConfig(tp=tp, ep=ep)
    lay = head_layout(cfg, par)
    assert lay.experts_local == 8 // ep and lay.moe_tp == tp // ep
    x = torch.randn(1, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(3))

    def block(rank: int, p: ParallelConfig):
        model = rank_model_factory(cfg, p, cache, rank, torch.float32, ParallelContext(p.tp, rank))()
        load_weights(model, shard_state_dict(sd, cfg, head_layout(cfg, p), rank), "test")
        return model.model.layers[0].mlp

    held = [lay.expert_range(r) for r in range(tp)]
    assert held == [range(g * 8 // ep, (g + 1) * 8 // ep) for g in range(ep) for _ in range(tp // ep)]
    with torch.no_grad():
        total = sum(block(r, par)(x) for r in range(tp))  # NoCollectives: each rank's partial sum
        torch.testing.assert_close(total, block(0, ParallelConfig())(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp, ep, ep_decode", [(2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 1, 4), (4, 2, 4)])
@pytest.mark.parametrize("tokens", [1, 10])
@pytest.mark.parametrize("traced", [False, True])
def test_hybrid_layout_shards_sum_to_the_block_in_each_phase(tokens, traced, tp, ep, ep_decode, tiny_dir,
                                                              monkeypatch):
    """A hybrid layout: each rank holds its `ep` experts and, as `experts_decode`, its `ep_decode` experts (other
    experts, other feature slices), both loaded from one stream of checkpoint tensors. Summed over ranks, the
    prefill form and the decode form each equal the unsharded block; and the decode form really applies the
    second copy (zeroing it leaves only the shared expert in decode, prefill unchanged)."""
    import models.moe as moe

    monkeypatch.setattr(moe, "_tracing", lambda: traced)
    d = tiny_dir("qwen2-moe")
    cfg = ModelConfig.from_hf(d)
    sd = load_file(str(d / "model.safetensors"))
    cache = CacheConfig(max_batch=1, max_model_len=64)
    par = ParallelConfig(tp=tp, ep=ep, ep_decode=ep_decode)
    lay = head_layout(cfg, par)
    dec = lay.decode_layout()
    assert lay.hybrid and (lay.ep, dec.ep) == (ep, ep_decode) and dec.experts_local == 8 // ep_decode
    assert dec.moe_intermediate_local == -(-cfg.moe_intermediate_size // (tp // ep_decode))
    x = torch.randn(1, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    blocks = []
    for r in range(tp):
        model = rank_model_factory(cfg, par, cache, r, torch.float32, ParallelContext(tp, r))()
        load_weights(model, shard_state_dict(sd, cfg, lay, r), "test")  # every parameter filled, or it raises
        blocks.append(model.model.layers[0].mlp)
    one = rank_model_factory(cfg, ParallelConfig(), cache, 0, torch.float32)()
    load_weights(one, shard_state_dict(sd, cfg, head_layout(cfg, ParallelConfig()), 0), "test")
    with torch.no_grad():
        ref = one.model.layers[0].mlp(x)
        for decode in (False, True):
            torch.testing.assert_close(sum(b(x, False, decode) for b in blocks), ref, atol=1e-5, rtol=1e-5)
        for b in blocks:
            b.experts_decode.gate_up_proj.zero_()
        torch.testing.assert_close(sum(b(x, False, False) for b in blocks), ref, atol=1e-5, rtol=1e-5)
        shared_only = sum(b(x, False, True) for b in blocks)
        assert (shared_only - ref).abs().max() > 0.1 * ref.abs().max()  # the routed experts are gone


@pytest.mark.parametrize("variant, tp, ep, sp, ep_decode", [
    ("mixtral", 2, 1, False, None), ("qwen2-moe", 2, 2, False, None), ("qwen3-moe", 2, 2, False, None),
    ("qwen2-moe", 2, 2, True, None), ("mixtral", 2, 2, False, 1)])
def test_rank_processes_match_hf(variant, tp, ep, sp, ep_decode, tiny_dir, tmp_path):
    """Real gloo rank processes: prefill + 4 teacher-forced decode steps within 1e-4, 16 greedy tokens = HF; then the
    collectives one prefill and one decode step issue, counted, against the dense layout's formula (the sparse
    block adds none). `sp`: sequence-parallel prefill (the block all-gathers the sequence, reduce-scatters back).
    `ep_decode`: a hybrid layout (whole experts per rank in prefill, every expert split over both ranks in decode):
    the same collectives, since either copy's partial sums meet in the layer's one all-reduce."""
    d = tiny_dir(variant)
    cfg = ModelConfig.from_hf(d)
    cache = CacheConfig(max_batch=2, max_model_len=64)
    par = ParallelConfig(tp=tp, ep=ep, sequence_parallel=sp, ep_decode=ep_decode)
    with tp_executor_from_state_dict(cfg, load_file(str(d / "model.safetensors")), par, cache, tmp_path) as ex:
        check_tp_against_hf(ex, cfg, load_hf(d))
        buckets = BucketConfig.build(max_prompt_len=64, max_model_len=64, max_batch=2, min_prefill=16,
                                     min_decode=16)
        runner = ModelRunner(ex, buckets, cache, cfg.vocab_size)
        ex.reset_collective_calls()
        runner.prefill(0, list(range(3, 24)))
        prefill_calls = ex.collective_calls()
        ex.reset_collective_calls()
        runner.decode([DecodeRow(0, 5, 21), DecodeRow(1, 6, 0)])
        assert prefill_calls == expected_calls(cfg, par, pick_prefill(21, buckets), 4, None)
        assert ex.collective_calls() == expected_calls(cfg, par, pick_decode(2, 21, buckets), 4, None)


@pytest.mark.parametrize("variant, ep_decode", [("mixtral", None), ("qwen2-moe", None), ("qwen2-moe", 4)])
def test_tp4_as_two_expert_groups_of_two_matches_hf(variant, ep_decode, tiny_dir, tmp_path):
    """tp 4 = moe tp 2 x ep 2 as four threaded ranks: experts 0-3 split over ranks 0-1, 4-7 over ranks 2-3;
    attention and the shared expert split over all four. `ep_decode` 4: decode steps on a second copy, two whole
    experts per rank (the rank weight files hold both)."""
    d = tiny_dir(variant)
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=4, ep=2, ep_decode=ep_decode)
    write_rank_weights(load_file(str(d / "model.safetensors")), cfg, par, tmp_path)
    ranks = ThreadRanks(RankSpec(cfg, par, CacheConfig(max_batch=2, max_model_len=64), str(tmp_path)))
    try:
        check_tp_against_hf(ranks, cfg, load_hf(d))
    finally:
        ranks.close()


def test_hybrid_artifact_from_compile_matches_hf(tmp_path, capsys):
    """`compile --backend eager --tp 2 --ep 2 --ep-decode 1` on tiny Mixtral: the checkpoint streamed once into both
    copies of each rank's experts, the manifest records the layout (and `inspect` prints it), and the loaded
    artifact's rank processes match HF (prefill, teacher-forced decode, greedy tokens)."""
    from safetensors import safe_open
    from tiny import make_tiny

    from neuron_opt.artifact import read_manifest
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.executors import load_model

    d = make_tiny("mixtral", tmp_path / "ckpt", tokenizer=True)  # the same weights as tiny_dir's (seed 0)
    cfg = ModelConfig.from_hf(d)
    art = tmp_path / "art"
    compile_artifact(CompileRequest(model=str(d), out=art, backend="eager", dtype="float32", max_model_len=64,
                                    batch_size=2, parallel=ParallelConfig(tp=2, ep=2, ep_decode=1), use_cache=False),
                     log=lambda s: None, progress=False)
    m = read_manifest(art)
    assert (m.parallel.ep, m.parallel.ep_decode) == (2, 1)
    from neuron_opt.cli import main

    assert main(["inspect", str(art)]) == 0
    assert "tp: 2, ep: 2 (decode and verify: 1, a second copy of the experts)" in capsys.readouterr().out
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    with safe_open(str(art / "weights" / "rank1.safetensors"), framework="pt") as f:
        prefix = "model.layers.0.block_sparse_moe."
        assert f.get_slice(prefix + "experts.gate_up_proj").get_shape() == [4, 2 * I, H]  # experts 4-7, whole
        assert f.get_slice(prefix + "experts_decode.gate_up_proj").get_shape() == [8, I, H]  # all 8, half each
    loaded = load_model(art)
    try:
        check_tp_against_hf(loaded.runner.executor, cfg, load_hf(d))
    finally:
        loaded.runner.executor.close()


def test_layout_errors(tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir("mixtral"))
    with pytest.raises(ConfigError, match=r"ep: 3 does not divide num_experts=8; use one of \[1, 2\]"):
        head_layout(cfg, ParallelConfig(tp=6, ep=3))
    with pytest.raises(ConfigError, match="ep: must be an integer >= 1 that divides tp=2"):
        ParallelConfig(tp=2, ep=4)
    with pytest.raises(ConfigError, match=r"ep_decode: 3 does not divide num_experts=8; use one of \[1, 2\]"):
        head_layout(cfg, ParallelConfig(tp=6, ep=2, ep_decode=3))
    with pytest.raises(ConfigError, match="ep_decode: must be an integer >= 1 that divides tp=4"):
        ParallelConfig(tp=4, ep_decode=8)
    dense = ModelConfig.from_hf(tiny_dir("llama-gqa2"))
    with pytest.raises(ConfigError, match="expert parallelism needs a mixture-of-experts model"):
        head_layout(dense, ParallelConfig(tp=2, ep=2))
    with pytest.raises(ConfigError, match="expert parallelism needs a mixture-of-experts model"):
        head_layout(dense, ParallelConfig(tp=2, ep_decode=2))
    assert not head_layout(cfg, ParallelConfig(tp=2, ep=2, ep_decode=2)).hybrid  # the same degree: one layout


def test_mixed_dense_and_sparse_layers_are_refused():
    from transformers import Qwen2MoeConfig

    hf = Qwen2MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError, match=r"layers \[0, 2\] .* are dense MLPs"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("variant", MOE)
def test_parameter_counts_match_hf(variant, tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir(variant))
    hf = load_hf(tiny_dir(variant))
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert cfg.num_parameters() - cfg.active_parameters() == cfg.num_hidden_layers * 6 * per_expert  # 8 - 2 idle


def test_fp8_kv_is_refused_where_a_qk_norm_would_undo_its_scales(tiny_dir, tmp_path):
    from neuron_opt.compiler import CompileRequest, compile_artifact

    with pytest.raises(ConfigError, match="q/k RMSNorm after them would undo the fold"):
        compile_artifact(CompileRequest(model=str(tiny_dir("qwen3-moe")), out=tmp_path / "a", backend="eager",
                                        kv_cache_dtype="fp8"), log=lambda s: None, progress=False)
    assert not (tmp_path / "a").exists()


def test_expert_ids_out_of_range_and_unsharded_tensors_are_errors(tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir("mixtral"))
    lay = head_layout(cfg, ParallelConfig(tp=2, ep=2))
    w = torch.zeros(cfg.moe_intermediate_size, cfg.hidden_size)
    with pytest.raises(ValueError, match="expert 8 does not exist"):
        shard_tensor("model.layers.0.block_sparse_moe.experts.8.w1.weight", w, cfg, lay, 0)
    assert shard_tensor("model.layers.0.block_sparse_moe.experts.5.w1.weight", w, cfg, lay, 0) is None  # rank 1's
    model = rank_model_factory(cfg, ParallelConfig(tp=2, ep=2), CacheConfig(max_model_len=64), 0, torch.float32)()
    with pytest.raises(ValueError, match="expert 5 is not one of this rank's experts 0..3"):
        load_weights(model, {"model.layers.0.block_sparse_moe.experts.5.w1.weight": w}, "test")
