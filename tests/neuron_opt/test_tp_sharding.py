"""TP layout as data, no processes: strategy choice, shard shapes and costs, vocab candidates, CLI flags."""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import load_file

from models.llama import LlamaForCausalLM
from neuron_opt.commands.parallel_flags import add_parallel_flags, parallel_config_from_args
from neuron_opt.compiler import check_cp_heads
from neuron_opt.config import ModelConfig, ParallelConfig, QuantConfig
from neuron_opt.errors import ConfigError
from neuron_opt.parallel.sharding import head_layout, head_sources, layout_cost, shard_state_dict
from neuron_opt.parallel.vocab import candidates_needed, scatter_candidates
from neuron_opt.runtime.sampling import SamplerState, SamplingParams, sample_one

# (variant, tp, flags) -> (strategy, q heads per rank, kv heads per rank)
EXPECTED = [
    ("smollm-like-9-3", 2, {}, ("mha", 5, 5)),
    ("smollm-like-9-3", 3, {}, ("shard", 3, 1)),
    ("smollm-like-9-3", 4, {}, ("mha", 3, 3)),
    ("smollm-like-9-3", 3, {"gqa_strategy": "mha"}, ("mha", 3, 3)),
    ("llama-gqa4", 4, {}, ("replicate-kv", 2, 1)),
    ("llama-gqa4", 2, {}, ("shard", 4, 1)),
    ("llama-gqa4", 4, {"flash_decoding": True}, ("kv-seq-shard", 4, 1)),
    ("llama-mqa", 2, {}, ("replicate-kv", 2, 1)),
    ("llama-mqa", 2, {"flash_decoding": True}, ("kv-seq-shard", 4, 1)),
    ("odd-heads-gqa3", 2, {}, ("mha", 2, 2)),
    ("odd-heads-gqa3", 2, {"flash_decoding": True}, ("kv-seq-shard", 3, 1)),
    ("llama-mha", 2, {"flash_decoding": True}, ("shard", 2, 2)),  # n_kv >= tp: nothing to shard by sequence
]


@pytest.mark.parametrize("variant,tp,flags,expected", EXPECTED)
def test_strategy_choice(variant, tp, flags, expected, tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir(variant))
    lay = head_layout(cfg, ParallelConfig(tp=tp, **flags))
    assert (lay.strategy, lay.n_heads_local, lay.n_kv_local) == expected


def test_forced_replicate_kv_that_cannot_work_names_the_fix(tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir("smollm-like-9-3"))
    with pytest.raises(ConfigError, match="gqa_strategy: replicate-kv.*--gqa-strategy mha"):
        head_layout(cfg, ParallelConfig(tp=2, gqa_strategy="replicate-kv"))
    with pytest.raises(ConfigError, match="flash_decoding: tp=4 is not a multiple of num_key_value_heads=3"):
        head_layout(cfg, ParallelConfig(tp=4, flash_decoding=True))



def test_cp_degree_is_the_kv_group_size_and_implies_flash_decoding(tiny_dir):
    gqa4 = ModelConfig.from_hf(tiny_dir("llama-gqa4"))  # 8 q / 2 kv heads
    lay = head_layout(gqa4, ParallelConfig(tp=4, cp_degree=2))
    assert (lay.strategy, lay.kv_seq_shards, lay.cp) == ("kv-seq-shard", 2, True)
    assert not head_layout(gqa4, ParallelConfig(tp=4, flash_decoding=True)).cp
    assert "context-parallel prefill (cp_degree 2)" in layout_cost(gqa4, lay, 8, 16, 2).description
    with pytest.raises(ConfigError, match="cp_degree: .*use --cp-degree 2"):
        head_layout(gqa4, ParallelConfig(tp=4, cp_degree=4))
    # as many KV heads as tp: the shard layout, context parallel over all ranks
    heads = head_layout(gqa4, ParallelConfig(tp=2, cp_degree=2))
    assert (heads.strategy, heads.kv_seq_shards, heads.cp, heads.cp_heads) == ("shard", 1, True, True)
    assert heads.n_kv_local == 1 and heads.n_heads_local == 4
    assert "context-parallel prefill (cp_degree 2)" in layout_cost(gqa4, heads, 8, 16, 2).description
    assert not lay.cp_heads
    check_cp_heads(gqa4, heads, QuantConfig(method="int8", modules_to_not_convert=("self_attn",)), False)
    with pytest.raises(ConfigError, match="cp_degree: .*gathers the float q and o weights.*no quantized q/o"):
        check_cp_heads(gqa4, heads, QuantConfig(method="int8"), False)
    with pytest.raises(ConfigError, match="cp_degree: .*no LoRA adapters"):
        check_cp_heads(gqa4, heads, QuantConfig(), True)
    nine = ModelConfig.from_hf(tiny_dir("smollm-like-9-3"))  # 9 q / 3 kv heads
    with pytest.raises(ConfigError, match=r"cp_degree: with 3 KV heads at tp 2 .*must be tp \(2\) and tp must"):
        head_layout(nine, ParallelConfig(tp=2, cp_degree=2))
    with pytest.raises(ConfigError, match="cp_degree: .*whole KV heads per rank .*drop --sequence-parallel"):
        head_layout(gqa4, ParallelConfig(tp=2, cp_degree=2, sequence_parallel=True))
    with pytest.raises(ConfigError, match="cp_degree: must be an integer >= 1 that divides tp=4"):
        ParallelConfig(tp=4, cp_degree=3)
    olmo = ModelConfig.from_hf(tiny_dir("olmo2"))
    with pytest.raises(ConfigError, match="cp_degree: OLMo 2's q/k norms"):
        head_layout(olmo, ParallelConfig(tp=4, cp_degree=2))


@pytest.mark.parametrize(
    "variant,tp,flags",
    [
        ("smollm-like-9-3", 2, {}),
        ("smollm-like-9-3", 4, {}),
        ("llama-gqa4", 4, {}),
        ("odd-heads-gqa3", 2, {"flash_decoding": True}),
    ],
)
def test_head_sources_cover_every_query_head_with_its_own_kv_head(variant, tp, flags, tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir(variant))
    lay = head_layout(cfg, ParallelConfig(tp=tp, **flags))
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    seen = []
    for rank in range(tp):
        q, kv = head_sources(cfg, lay, rank)
        per_kv = len(q) // len(kv)
        for i, h in enumerate(q):
            if h is not None:
                assert kv[i // per_kv] == h // group  # SDPA's GQA grouping on the rank matches the model's
                seen.append(h)
    multiplicity = lay.kv_seq_shards
    assert sorted(seen) == sorted(list(range(cfg.num_attention_heads)) * multiplicity)


@pytest.mark.parametrize(
    "variant,tp,flags",
    [
        ("smollm-like-9-3", 2, {}),
        ("smollm-like-9-3", 3, {}),
        ("llama-mqa", 2, {"flash_decoding": True}),
        ("llama-gqa4", 4, {}),
    ],
)
def test_layout_cost_counts_the_real_shards(variant, tp, flags, tiny_dir):
    d = tiny_dir(variant)
    cfg = ModelConfig.from_hf(d)
    sd = load_file(str(d / "model.safetensors"))
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    lay = head_layout(cfg, ParallelConfig(tp=tp, **flags))
    cost = layout_cost(cfg, lay, num_blocks=7, block_size=32, dtype_bytes=4)
    for rank in range(tp):
        shard = shard_state_dict(sd, cfg, lay, rank)
        assert sum(t.numel() * 4 for t in shard.values()) == cost.weight_bytes_per_rank
        model = LlamaForCausalLM(cfg, lay, 64)
        model.load_state_dict(shard, strict=not cfg.tie_word_embeddings)  # shapes agree with the model
    kv_numel = torch.Size(model.kv_shape(7, 32)).numel()
    assert cost.kv_bytes_per_rank == 2 * cfg.num_hidden_layers * kv_numel * 4
    assert cost.line().startswith(f"heads: {lay.strategy}: ")
    assert f"({lay.n_heads_local} q / {lay.n_kv_local} kv per rank)" in cost.line()


def test_candidates_scatter_gives_the_samplers_result(tiny_dir):
    """Per-rank top-K candidates scattered into -inf logits sample exactly like the full logits."""
    V, tp, vocab_padded = 257, 3, 258
    g = torch.Generator().manual_seed(0)
    full = torch.randn(4, V, generator=g) * 3
    padded = torch.cat([full, torch.full((4, vocab_padded - V), float("-inf"))], dim=1)
    for k in (1, 5, 40):
        vals, ids = [], []
        for r, shard in enumerate(padded.chunk(tp, dim=1)):
            v, i = torch.topk(shard, k, dim=1)
            vals.append(v)
            ids.append(i + r * shard.shape[1])
        got = scatter_candidates(torch.cat(vals, 1), torch.cat(ids, 1), vocab_padded, V)
        for row in range(4):
            params = [SamplingParams(temperature=0.0)]
            params += [SamplingParams(temperature=0.8, top_k=t, seed=7) for t in (1, 3, 5) if t <= k]
            for p in params:
                assert candidates_needed(p.greedy, p.top_k, p.top_p, False, False, 0) <= k
                a = sample_one(full[row], SamplerState.create(p)).token
                b = sample_one(got[row], SamplerState.create(p)).token
                assert a == b


def test_candidates_needed_falls_back_to_full_logits_when_the_distribution_matters():
    assert candidates_needed(True, 0, 1.0, False, False, 0) == 1
    assert candidates_needed(True, 0, 1.0, False, False, 1) == 2  # EOS banned before min_tokens
    assert candidates_needed(False, 20, 1.0, False, False, 0) == 20
    assert candidates_needed(False, 0, 1.0, False, False, 0) is None  # plain temperature sampling
    assert candidates_needed(False, 20, 0.9, False, False, 0) is None  # top-p
    assert candidates_needed(True, 0, 1.0, True, False, 0) is None  # penalties
    assert candidates_needed(True, 0, 1.0, False, True, 0) is None  # logprobs


def _parse(argv):
    p = argparse.ArgumentParser()
    add_parallel_flags(p)
    return parallel_config_from_args(p.parse_args(argv))


def test_cli_flags_build_the_parallel_config():
    par = _parse(
        [
            "--tp",
            "4",
            "--sequence-parallel",
            "--flash-decoding",
            "--gqa-strategy",
            "mha",
            "--instance",
            "inf2.48xlarge",
        ]
    )
    assert par == ParallelConfig(
        tp=4, sequence_parallel=True, flash_decoding=True, gqa_strategy="mha", instance="inf2.48xlarge"
    )
    assert not _parse(["--no-vocab-parallel-sampling"]).vocab_parallel_sampling
    assert _parse(["--tp", "4", "--cp-degree", "2"]) == ParallelConfig(tp=4, cp_degree=2)


@pytest.mark.parametrize(
    "instance,tp,allowed", [("inf2.48xlarge", 3, "1, 2, 4, 8, 24"), ("trn1.32xlarge", 4, "1, 2, 8, 16, 32")]
)
def test_instance_rejects_degrees_it_does_not_offer(instance, tp, allowed):
    with pytest.raises(ConfigError, match=f"allowed: {allowed}"):
        _parse(["--tp", str(tp), "--instance", instance])


def test_compile_turns_flash_decoding_on_where_the_plan_says_it_saves_memory(tmp_path):
    """One KV head at tp 2, a pool of 4 x 1,024 positions: weights + KV per rank are smaller with the KV split along
    the sequence, so compile's default (auto) takes flash decoding, says why, and the manifest holds the choice."""
    from tiny import make_tiny

    from neuron_opt.artifact import read_manifest
    from neuron_opt.compiler import CompileRequest, compile_artifact

    said: list[str] = []
    ckpt = make_tiny("llama-mqa", tmp_path / "mqa", tokenizer=True)
    compile_artifact(CompileRequest(model=str(ckpt), out=tmp_path / "art", backend="eager",
                                    dtype="float32", max_model_len=1024, batch_size=4, parallel=ParallelConfig(tp=2),
                                    use_cache=False), log=said.append, progress=False)
    par = read_manifest(tmp_path / "art", verify_hashes=False).parallel
    assert par.flash_decoding is True
    assert any("flash decoding (auto): on" in s for s in said), said
    assert "kv-seq-shard" in said[0]


def test_plan_shows_context_parallel_prefill(tiny_dir, capsys):
    from neuron_opt.cli import main

    mqa = str(tiny_dir("llama-mqa"))
    assert main(["plan", "--model", mqa, "--instance", "trn1.32xlarge", "--tp", "2", "--cp-degree", "2",
                 "--max-model-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "kv-seq-shard" in out and "context-parallel prefill: cp_degree 2" in out
    assert main(["plan", "--model", mqa, "--instance", "trn1.32xlarge", "--cp-degree", "2"]) == 2
    assert "cp_degree: context-parallel prefill is planned at a given tp" in capsys.readouterr().err
