"""Any tp works for any Llama-family model: widths tp does not divide are zero-padded per rank.

`intermediate_size`, the vocabulary and the query heads are padded to a multiple of tp with zero weights (as
transformers-neuronx did for Llama-3-8B / Mistral-7B / Llama-3-70B at tp 24 on inf2.48xlarge). Checked:
- the layout and the shards of the published configurations at tp 24 (what `plan` and `compile` refused before);
- tp=3 as real rank processes (gloo) against HF on a tiny model whose MLP width (101) no tp divides;
- tp=24 as 24 ranks in one process: threads joined by torch's threaded process group (the in-process backend
  torch tests its own collectives with), running the worker's own collectives, build and logits-gather code on
  24 shards of tiny widths; the gathered logits and greedy tokens against HF.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ThreadRanks, check_tp_against_hf
from safetensors.torch import load_file
from tiny import load_hf

from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.executors.launcher import RankSpec, write_rank_weights
from neuron_opt.executors.tp import tp_executor_from_state_dict
from neuron_opt.parallel.sharding import MHA, head_layout, shard_state_dict

MAX_LEN = 64

MISTRAL_7B = dict(
    architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
)
LLAMA3_70B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, intermediate_size=28672,
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=False,
)


@pytest.mark.parametrize(
    "hf, tp, inter_local, heads",
    [(MISTRAL_7B, 24, 598, 48), (LLAMA3_70B, 24, 1195, 72), (MISTRAL_7B, 3, 4779, 33)],
)
def test_published_configs_shard_at_any_tp(hf, tp, inter_local, heads):
    """Mistral-7B (14336 = 24 x 597.3) and Llama-3-70B (28672 = 24 x 1194.7) at tp 24; tp 3 likewise."""
    cfg = ModelConfig.from_hf(hf)
    lay = head_layout(cfg, ParallelConfig(tp=tp))
    assert lay.intermediate_local == inter_local and lay.intermediate_padded >= cfg.intermediate_size
    assert lay.intermediate_padded - cfg.intermediate_size < tp  # the least padding that divides
    assert lay.n_heads == heads and lay.strategy == MHA


def test_padded_mlp_shards_are_the_weights_plus_zeros():
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf({**MISTRAL_7B, "hidden_size": 8, "intermediate_size": 13, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 11})
    lay = head_layout(cfg, ParallelConfig(tp=3))  # 13 -> 15 features, 5 per rank
    sd = {"model.layers.0.mlp.gate_proj.weight": torch.randn(13, 8),
          "model.layers.0.mlp.up_proj.weight": torch.randn(13, 8),
          "model.layers.0.mlp.down_proj.weight": torch.randn(8, 13)}
    shards = [shard_state_dict(sd, cfg, lay, r) for r in range(3)]
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        key = f"model.layers.0.mlp.{name}.weight"
        assert all(s[key].shape[dim] == 5 for s in shards)
        full = torch.cat([s[key] for s in shards], dim=dim)
        torch.testing.assert_close(full.narrow(dim, 0, 13), sd[key], rtol=0, atol=0)
        assert not full.narrow(dim, 13, 2).any()  # two zero features, on the last rank
    # the sharded MLP sums to the unsharded one
    x = torch.randn(4, 8)
    def mlp(w, x):
        g, u, d = (w[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        return (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ d.t()
    torch.testing.assert_close(sum(mlp(s, x) for s in shards), mlp(sd, x), rtol=1e-5, atol=1e-6)


def _hf(d: Path):
    return load_hf(d)


def test_tp3_rank_processes_match_hf_with_a_padded_mlp(tiny_dir, tmp_path):
    d = tiny_dir("llama-odd-mlp")
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=3)
    lay = head_layout(cfg, par)
    assert (lay.intermediate_local, lay.n_heads, lay.vocab_padded) == (34, 6, 258)  # 101->102, 4->6, 257->258
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    with tp_executor_from_state_dict(cfg, load_file(str(d / "model.safetensors")), par, cache, tmp_path) as ex:
        check_tp_against_hf(ex, cfg, _hf(d))


def test_tp24_sharding_of_tiny_widths_matches_hf(tiny_dir, tmp_path):
    """inf2.48xlarge's degree: 4 query heads padded to 24 (20 zero heads), 2 KV heads expanded to one per query
    head, MLP 101 -> 120 features (5 per rank, 19 zero), vocabulary 257 -> 264."""
    d = tiny_dir("llama-odd-mlp")
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=24)
    lay = head_layout(cfg, par)
    assert (lay.n_heads, lay.n_kv_heads, lay.intermediate_local, lay.vocab_padded) == (24, 24, 5, 264)
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    write_rank_weights(load_file(str(d / "model.safetensors")), cfg, par, tmp_path)
    ranks = ThreadRanks(RankSpec(cfg, par, cache, str(tmp_path)))
    try:
        check_tp_against_hf(ranks, cfg, _hf(d))
    finally:
        ranks.close()
