"""Memory accounting of the planner against independent oracles: published parameter counts, real HF models,
the real sharded state dict, the published per-token KV size, and AWS's sizing statements."""

from __future__ import annotations

import pytest
import torch

from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.parallel.sharding import head_layout, shard_state_dict
from neuron_opt.planner import Deployment, evaluate, get_instance
from neuron_opt.planner.memory import RUNTIME_RESERVE, kv_bytes, weight_bytes, weight_count, window_kv_bytes

_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
# values from each model's public config.json
LLAMA3_8B = {
    **_LLAMA,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
LLAMA31_70B = {
    **_LLAMA,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
MISTRAL_7B = {
    "model_type": "mistral",
    "architectures": ["MistralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
QWEN2_7B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 131072,
}
SMOLLM2_135M = {
    **_LLAMA,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}

# parameter counts published on each model card / safetensors index (total_size / 2 for bf16)
PUBLISHED_PARAMS = [
    (LLAMA3_8B, 8_030_261_248),
    (LLAMA31_70B, 70_553_706_496),
    (MISTRAL_7B, 7_241_732_096),
    (QWEN2_7B, 7_615_616_512),
    (SMOLLM2_135M, 134_515_008),
]


@pytest.mark.parametrize(
    "hf,count", PUBLISHED_PARAMS, ids=["llama3-8b", "llama3.1-70b", "mistral-7b", "qwen2-7b", "smollm2-135m"]
)
def test_weights_exact_bytes_on_published_configs(hf: dict, count: int) -> None:
    cfg = ModelConfig.from_hf(hf)
    lay = head_layout(cfg, ParallelConfig(tp=1))
    assert cfg.num_parameters() == count
    assert weight_bytes(cfg, lay, "bfloat16") == 2 * count
    assert weight_bytes(cfg, lay, "float32") == 4 * count


def _tiny(model_type: str, heads: int, kv: int, tied: bool) -> tuple[ModelConfig, torch.nn.Module]:
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    hf = AutoConfig.for_model(
        model_type,
        architectures=[arch],
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=8,
        vocab_size=101,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return ModelConfig.from_hf(hf), AutoModelForCausalLM.from_config(hf)


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_num_parameters_matches_real_hf_model(model_type: str, tied: bool) -> None:
    cfg, model = _tiny(model_type, 6, 2, tied)
    real = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    lay = head_layout(cfg, ParallelConfig(tp=1))
    assert cfg.num_parameters() == real
    assert weight_count(cfg, lay).total == real


@pytest.mark.parametrize(
    "heads,kv,tp,strategy",
    [
        (6, 2, 2, "shard"),
        (8, 2, 4, "replicate-kv"),
        (6, 2, 4, "mha"),
        (6, 3, 2, "mha"),
        (8, 2, 4, "kv-seq-shard"),
    ],
)
@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True)])
def test_sharded_weights_match_real_shards(
    heads: int, kv: int, tp: int, strategy: str, model_type: str, tied: bool
) -> None:
    cfg, model = _tiny(model_type, heads, kv, tied)
    lay = head_layout(cfg, ParallelConfig(tp=tp, flash_decoding=strategy == "kv-seq-shard"))
    assert lay.strategy == strategy
    sd = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    want = weight_count(cfg, lay).total
    for rank in range(tp):
        shard = shard_state_dict(sd, cfg, lay, rank)
        assert sum(t.numel() for t in shard.values()) == want


def test_kv_cache_bytes_llama3_8b() -> None:
    cfg = ModelConfig.from_hf(LLAMA3_8B)
    # Llama-3-8B's KV cache is 128 KiB per token in bf16 (32 layers x 8 KV heads x 128 x K,V x 2 B)
    assert kv_bytes(cfg, head_layout(cfg, ParallelConfig(tp=1)), 1, 1, "bfloat16") == 128 * 1024
    # 3 sequences of 4096 in blocks of 32, plus the null block
    assert kv_bytes(cfg, head_layout(cfg, ParallelConfig(tp=8)), 3 * 128 + 1, 32, "bfloat16") == (
        (3 * 4096 + 32) * 16 * 1024)
    # tp 16 > 8 KV heads: each rank keeps one replicated KV head, so per-rank KV stops shrinking
    assert kv_bytes(cfg, head_layout(cfg, ParallelConfig(tp=16)), 1, 1, "fp8") == 8 * 1024
    # flash decoding at tp 32: each KV head split along the sequence over 4 ranks: 8 of every 32-block's positions
    fd = head_layout(cfg, ParallelConfig(tp=32, flash_decoding=True))
    assert kv_bytes(cfg, fd, 2 * 128 + 1, 32, "bfloat16") == (2 * 4096 + 32) // 4 * 16 * 1024


@pytest.mark.parametrize("name, sliding, window", [("gemma-2-2b", 13, 4096), ("gemma-3-1b", 22, 512)])
def test_sliding_layers_need_only_their_window_of_kv(name: str, sliding: int, window: int) -> None:
    """The published Gemma 2/3 configs (docs/configs): the KV their sliding layers hold under window-sized KV
    (blocks of 32: the keys a step's first query still sees through the step's last token, ceil((window - 1 +
    longest prefill chunk) / 32) + 1 per sequence), planned on where the backend holds it and reported beside the
    full-length pool otherwise."""
    import json
    from dataclasses import replace
    from pathlib import Path

    from neuron_opt.planner.report import plan_lines

    raw = json.loads((Path(__file__).resolve().parents[2] / "docs" / "configs" / f"{name}.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    L = cfg.num_hidden_layers
    assert sum(cfg.layer_window(i) is not None for i in range(L)) == sliding and cfg.sliding_window == window
    lay = head_layout(cfg, ParallelConfig())
    per_block = 2 * 32 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V of one block of one layer, bf16
    batch, length, chunk = 4, 8192, 1024
    full = batch * length // 32 + 1  # a layer's blocks: every position of every sequence, and the null block
    windowed = batch * (-(-(window - 1 + chunk) // 32) + 1) + 1
    want = ((L - sliding) * full + sliding * windowed) * per_block
    dep = Deployment(1, batch, chunk, length)
    assert window_kv_bytes(cfg, lay, dep.buckets(), batch, length, 32, "bfloat16") == want
    plan = evaluate(cfg, get_instance("trn1.2xlarge"), dep)
    assert plan.memory.kv_cache == L * full * per_block  # a backend without window-sized KV allocates every position
    assert plan.memory.kv_cache_window == want < plan.memory.kv_cache
    assert any("KV if sliding layers held windows" in line for line in plan_lines(cfg, plan))
    held = evaluate(cfg, get_instance("trn1.2xlarge"), replace(dep, window_kv=True))  # the eager backend's
    assert held.memory.kv_cache == held.memory.kv_cache_window == want
    assert any("window-sized KV" in line for line in plan_lines(cfg, held))
    # sequences no longer than a window: the sliding layers hold them whole, like the full layers
    short = Deployment(1, batch, 256, 256).buckets()
    assert window_kv_bytes(cfg, lay, short, batch, 256, 32, "bfloat16") == kv_bytes(cfg, lay, batch * 8 + 1, 32,
                                                                                     "bfloat16")
    dense = ModelConfig.from_hf(LLAMA3_8B)  # no window: the allocated pool
    dense_lay = head_layout(dense, ParallelConfig())
    assert window_kv_bytes(dense, dense_lay, dep.buckets(), batch, length, 32, "bfloat16") == kv_bytes(
        dense, dense_lay, full, 32, "bfloat16")
    # the plan says why a backend that holds window-sized KV keeps the sliding layers at full length here
    whole = evaluate(cfg, get_instance("trn1.2xlarge"), Deployment(1, batch, 256, 256, window_kv=True))
    assert any("(sliding layers at full length)" in line and "span a whole sequence" in line
               for line in plan_lines(cfg, whole))


def test_compile_defaults_cap_the_prefill_chunk_of_windowed_models() -> None:
    """compile's default largest prefill bucket (planner.memory.window_prompt_len): the largest window, at least 128,
    where the sliding layers then hold fewer blocks than a sequence; else max_model_len's default (None). Every
    backend holds window-sized KV, which `plan` assumes."""
    import json
    from pathlib import Path

    from neuron_opt.backends import backend_class
    from neuron_opt.commands.plan import WINDOW_KV
    from neuron_opt.planner.memory import window_prompt_len

    assert WINDOW_KV and all(backend_class(n).window_kv for n in ("eager", "cpu", "neuron"))
    configs = Path(__file__).resolve().parents[2] / "docs" / "configs"
    gemma3 = ModelConfig.from_hf(json.loads((configs / "gemma-3-1b.json").read_text()))  # window 512
    assert window_prompt_len(gemma3, 8192, 32) == 512
    assert window_prompt_len(gemma3, 1024, 32) is None  # 512 + 512 positions: a whole sequence
    gemma2 = ModelConfig.from_hf(json.loads((configs / "gemma-2-2b.json").read_text()))  # window 4096
    assert window_prompt_len(gemma2, 8192, 32) is None and window_prompt_len(gemma2, 16384, 32) == 4096
    assert window_prompt_len(ModelConfig.from_hf(LLAMA3_8B), 8192, 32) is None  # no window


def test_fit_matches_aws_sizing_examples() -> None:
    # AWS feature guide: Llama-3.1-70B (~148 GB bf16) needs 16 cores of trn1.32xlarge; 8B bf16 fits
    # trn1.2xlarge
    trn1 = get_instance("trn1.32xlarge")
    big = ModelConfig.from_hf(LLAMA31_70B)
    assert evaluate(big, trn1, Deployment(16, 1, 1024, 2048)).fits
    assert not evaluate(big, trn1, Deployment(8, 1, 1024, 2048)).fits
    small = ModelConfig.from_hf(LLAMA3_8B)
    two = get_instance("trn1.2xlarge")
    assert evaluate(small, two, Deployment(2, 1, 1024, 2048)).fits
    one = evaluate(small, two, Deployment(1, 1, 1024, 2048))  # 16.06 GB of weights on one 16 GiB core
    assert not one.fits and one.memory.total - one.memory.kv_cache - one.memory.scratch <= two.hbm_per_core
    assert one.memory.reserve == RUNTIME_RESERVE


def test_largest_batch_and_length_are_tight() -> None:
    cfg, inst = ModelConfig.from_hf(LLAMA3_8B), get_instance("inf2.8xlarge")
    plan = evaluate(cfg, inst, Deployment(2, 8, 1024, 4096))
    b = plan.largest_batch
    assert b > 8
    assert evaluate(cfg, inst, Deployment(2, b, 1024, 4096)).fits
    assert not evaluate(cfg, inst, Deployment(2, b + 1, 1024, 4096)).fits
    n = plan.largest_length
    assert n == cfg.max_position_embeddings or not evaluate(cfg, inst, Deployment(2, 8, 1024, n + 1)).fits
    assert evaluate(cfg, inst, Deployment(2, 8, 1024, n)).fits


def test_quantized_weights_store_linears_in_one_byte() -> None:
    cfg = ModelConfig.from_hf(LLAMA3_8B)
    lay = head_layout(cfg, ParallelConfig(tp=1))
    n = weight_count(cfg, lay)
    saved = weight_bytes(cfg, lay, "bfloat16") - weight_bytes(cfg, lay, "int8")
    assert saved == n.linear - 4 * n.linear_out_channels  # one byte per linear weight, fp32 scale per channel
    assert weight_bytes(cfg, lay, "fp8") == weight_bytes(cfg, lay, "int8")


def test_flash_decoding_is_on_by_default_where_it_saves_weights_plus_kv_per_rank() -> None:
    """Llama-3-8B (8 KV heads) at tp 32: flash decoding divides each rank's KV by 4 and holds the q/o weights of its
    group 4 times. Auto (None) takes it where weights + KV per rank are smaller with it, by the plan's own counts:
    for a long pool (16 x 8K tokens), not for a tiny one; an explicit flag, a forced GQA strategy or LoRA stay."""
    from dataclasses import replace

    from neuron_opt.planner.memory import resolve_flash_decoding

    cfg = ModelConfig.from_hf(LLAMA3_8B)
    auto = ParallelConfig(tp=32)
    assert auto.flash_decoding is None

    def per_rank(par: ParallelConfig, blocks: int) -> int:
        lay = head_layout(cfg, par)
        return weight_bytes(cfg, lay, "bfloat16") + kv_bytes(cfg, lay, blocks, 32, "bfloat16")

    long_pool, tiny_pool = 16 * 256 + 1, 2
    par, why = resolve_flash_decoding(cfg, auto, long_pool, 32, "bfloat16", "bfloat16")
    assert par.flash_decoding is True and head_layout(cfg, par).strategy == "kv-seq-shard"
    assert per_rank(par, long_pool) < per_rank(replace(par, flash_decoding=False), long_pool)
    assert why.startswith("flash decoding (auto): on: weights + KV per rank")
    par, why = resolve_flash_decoding(cfg, auto, tiny_pool, 32, "bfloat16", "bfloat16")
    assert par.flash_decoding is False and "off" in why
    assert per_rank(replace(par, flash_decoding=True), tiny_pool) > per_rank(par, tiny_pool)
    for kept in (replace(auto, flash_decoding=False), replace(auto, flash_decoding=True)):
        assert resolve_flash_decoding(cfg, kept, long_pool, 32, "bfloat16", "bfloat16") == (kept, None)
    for off in (dict(par=replace(auto, gqa_strategy="replicate-kv")), dict(par=auto, lora=True),
                dict(par=ParallelConfig(tp=8))):  # tp 8 = the 8 KV heads: nothing to split
        par, why = resolve_flash_decoding(cfg, off["par"], long_pool, 32, "bfloat16", "bfloat16",
                                          lora=off.get("lora", False))
        assert par.flash_decoding is False and why is None
