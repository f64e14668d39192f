"""Phi-3 / Phi-3.5-mini / Phi-4-mini (`Phi3ForCausalLM`) against HF transformers: fused qkv_proj / gate_up_proj
split at load, partial rotary, a sliding window on every layer, longrope's short and long factors (tests/tiny.py's
phi3 variants).

transformers picks longrope's factor set per forward call: the long one, for every token of the call, once the
call's highest position is past original_max_position_embeddings. The oracle here is therefore HF stepped as its
generate steps (one call for the prompt, then one per token, with its cache), and the texts cross the original
length (12) in a prefill (a 16-token prompt) and in decode (a 9-token prompt), the two in one batch. tp 1 eager
parity against HF's full forward (short factors only) runs in tests/models/test_llama_parity.py, the device path
in tests/xla/test_device_families.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ThreadRanks, check_stepwise_against_hf, eager_runner
from safetensors.torch import load_file, save_file
from tiny import load_hf, make_tiny

from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.errors import CheckpointError, ConfigError
from neuron_opt.runtime.runner import ModelRunner

MAX_LEN = 64
CONFIGS = Path(__file__).resolve().parents[2] / "docs" / "configs"


def test_options_are_read_from_the_hf_config(tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir("phi3-long"))
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.fused_projections
    assert (cfg.head_dim, cfg.rotary_dim) == (16, 12)
    rope = cfg.rope
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 12
    assert rope["short_factor"] == (1.0, 1.1, 1.3, 1.6, 2.0, 2.5) and len(rope["long_factor"]) == 6
    assert [cfg.layer_window(i) for i in range(2)] == [6, 6] and not cfg.mixed_windows
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # a manifest's copy comes back
    # the factor set's earlier name, "su", as older Phi-3 configs write it in rope_scaling
    raw = json.loads((tiny_dir("phi3-long") / "config.json").read_text())
    rope_raw = raw.pop("rope_parameters")
    raw["rope_scaling"] = {**{k: v for k, v in rope_raw.items() if k != "rope_type"}, "type": "su"}
    assert ModelConfig.from_hf(raw).rope == rope


def test_fused_weights_split_into_the_canonical_names(tiny_dir):
    from models.build import stored_weight_names, weight_names
    from neuron_opt.parallel.sharding import head_layout
    from neuron_opt.planner.memory import weight_count

    d = tiny_dir("phi3")
    cfg = ModelConfig.from_hf(d)
    stored = load_file(str(d / "model.safetensors"))
    assert set(stored_weight_names(cfg)) == set(stored)
    sd = open_checkpoint(d).state_dict()
    assert set(sd) == set(weight_names(cfg))
    qkv = stored["model.layers.1.self_attn.qkv_proj.weight"]  # q rows (4 heads x 16), then k, then v (2 x 16)
    torch.testing.assert_close(sd["model.layers.1.self_attn.k_proj.weight"], qkv[64:96], atol=0, rtol=0)
    gate_up = stored["model.layers.0.mlp.gate_up_proj.weight"]  # gate rows, then up
    torch.testing.assert_close(sd["model.layers.0.mlp.up_proj.weight"], gate_up[96:], atol=0, rtol=0)
    streamed = dict(open_checkpoint(d).tensors())  # compile's tensor-by-tensor read splits the same way
    assert streamed.keys() == sd.keys() and all(torch.equal(streamed[k], sd[k]) for k in sd)
    hf = load_hf(d)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert weight_count(cfg, head_layout(cfg, ParallelConfig())).total == cfg.num_parameters()


# HF -> GGUF names of a phi3 file, as llama.cpp's convert_hf_to_gguf.py writes them (fused projections kept fused)
_PHI3_GGUF = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def write_phi3_gguf(hf_dir: Path, out: Path, qtype=None) -> Path:
    """A tiny HF Phi-3 checkpoint as llama.cpp's converter writes it (architecture `phi3`): fused attn_qkv and ffn_up,
    the rotary dimension count (partial rotary), the sliding window, longrope's original length and attention
    factor as metadata and its factor sets as the tensors rope_factors_long / rope_factors_short. F32, or `qtype`
    for the 2-D weights."""
    import math

    import gguf

    c = json.loads((hf_dir / "config.json").read_text())
    rope = c["rope_parameters"]
    n_head, hidden, max_pos = c["num_attention_heads"], c["hidden_size"], c["max_position_embeddings"]
    orig = c.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
    w = gguf.GGUFWriter(str(out), "phi3")
    w.add_context_length(max_pos)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // n_head)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.get("sliding_window") or 0)
    scale = max_pos / orig
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(c["vocab_size"])])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name in _TOP_GGUF:
            gname = _TOP_GGUF[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_PHI3_GGUF[module]}.{kind}"
        x = t.float().numpy()
        if qtype is not None and x.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_phi3_reads_the_fused_weights_and_longrope_and_generates_hf_tokens(tiny_dir, tmp_path, monkeypatch):
    """llama.cpp's `phi3` file of the tiny Phi-3 (longrope switching at 12, partial rotary, a window of 6): the
    config is the HF checkpoint's, the weights are its canonical (split) ones, and the model built from the file
    gives HF's logits stepwise across the original length and HF's greedy tokens."""
    from neuron_opt import envs
    from neuron_opt.api import build_model
    from neuron_opt.backends.eager import EagerExecutor
    from neuron_opt.buckets import BucketConfig
    from neuron_opt.checkpoint import native_quant

    monkeypatch.setattr(envs, "CACHE_DIR", tmp_path / "cache")
    d = tiny_dir("phi3-long")
    ck = open_checkpoint(write_phi3_gguf(d, tmp_path / "phi3.gguf"))
    assert ck.format == "gguf" and ck.config == ModelConfig.from_hf(d)
    want = open_checkpoint(d).state_dict()
    sd = ck.state_dict()
    assert sorted(sd) == sorted(want) and "model.layers.0.self_attn.q_proj.weight" in sd
    assert all(torch.equal(sd[k], want[k]) for k in want)
    streamed = dict(ck.tensors())  # compile's tensor-by-tensor read: the same canonical tensors
    assert streamed.keys() == sd.keys() and all(torch.equal(streamed[k], sd[k]) for k in sd)
    cfg = ck.config
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    buckets = BucketConfig.build(max_prompt_len=MAX_LEN, max_model_len=MAX_LEN, max_batch=2, min_prefill=16,
                                 min_decode=16)
    runner = ModelRunner(EagerExecutor(build_model(cfg, sd, MAX_LEN, torch.float32), cache), buckets, cache,
                         cfg.vocab_size)
    check_stepwise_against_hf(runner, load_hf(d))
    # a Q4_0 file: int4 for `--quantize auto`, but its fused blocks are not kept as stored (they span two or three
    # of our linears): dequantized, split, quantized again at compile
    import gguf

    q4 = open_checkpoint(write_phi3_gguf(d, tmp_path / "q4.gguf", gguf.GGMLQuantizationType.Q4_0))
    qc = native_quant(q4)
    assert (qc.method, qc.source) == ("int4", "")


def test_rope_tables_equal_hf_on_both_sides_of_the_original_length(tiny_dir):
    """Our short and long tables (partial rotary: 12 of 16 features, times longrope's attention factor) are what
    HF's rotary embedding gives for a call that stays within 12 positions and for one that goes past them."""
    from models.llama import model_rope_tables

    d = tiny_dir("phi3-long")
    cfg = ModelConfig.from_hf(d)
    tables = model_rope_tables(cfg, MAX_LEN)
    rotary = load_hf(d).model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    for n, kind in ((12, "global"), (13, "long")):
        cos, sin = rotary(x, torch.arange(n)[None])
        torch.testing.assert_close(tables[kind][0][:n], cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(tables[kind][1][:n], sin[0], atol=1e-6, rtol=0)
    assert (tables["global"][0] - tables["long"][0]).abs().max() > 1e-2  # the two sets differ


def test_eager_matches_hf_stepped_across_the_original_length(tiny_dir):
    d = tiny_dir("phi3-long")
    check_stepwise_against_hf(eager_runner(d, max_model_len=MAX_LEN, max_batch=2), load_hf(d))


@pytest.mark.parametrize("tp, sp", [(2, False), (3, False), (2, True)])
def test_rank_threads_match_hf(tp, sp, tiny_dir, tmp_path):
    """tp 3: 4 query heads padded to 6 (MHA layout); the fused rows split before sharding."""
    from helpers import _buckets

    from neuron_opt.executors.launcher import RankSpec, write_rank_weights
    from neuron_opt.parallel.sharding import MHA, head_layout

    d = tiny_dir("phi3-long")
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=tp, sequence_parallel=sp)
    if tp == 3:
        assert head_layout(cfg, par).strategy == MHA
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    write_rank_weights(open_checkpoint(d).state_dict(), cfg, par, tmp_path)
    ranks = ThreadRanks(RankSpec(cfg, par, cache, str(tmp_path)))
    try:
        check_stepwise_against_hf(ModelRunner(ranks, _buckets(), cache, cfg.vocab_size), load_hf(d))
    finally:
        ranks.close()


@pytest.mark.slow
def test_cpu_graphs_match_hf_stepped_across_the_original_length(tmp_path):
    """The compiled artifact: the rope tables are host inputs of the layer graphs (partial: 12 features), picked
    per row and step; one prefill bucket (16) holds the 9-token prompt (padding positions past 12 must not switch
    it to the long factors) and the 16-token one (long)."""
    from neuron_opt.api import LLM
    from neuron_opt.compiler import CompileRequest, compile_artifact

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny graphs: thread barriers cost more than they save
    try:
        ck = make_tiny("phi3-long", tmp_path / "ck", tokenizer=True)
        out = tmp_path / "art"
        req = CompileRequest(model=str(ck), out=out, backend="cpu", dtype="float32", max_model_len=MAX_LEN,
                             batch_size=2, prefill_buckets=(16,), decode_buckets=(MAX_LEN,), decode_batches=(2,),
                             cache_dir=tmp_path / "cache", backend_options={"decode_attention": "fused"})
        compile_artifact(req, log=lambda s: None, progress=False)
        check_stepwise_against_hf(LLM(out).runner, load_hf(ck))
    finally:
        torch.set_num_threads(threads)


# published parameter counts (model cards / safetensors indexes)
PUBLISHED = {"phi-3-mini-4k": 3_821_079_552, "phi-3.5-mini": 3_821_079_552, "phi-4-mini": 3_836_021_760}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_plan_the_checkpoint_sizes(name):
    """`plan`'s weight sizes are HF's parameter count (its model built on the meta device from the same
    config.json) in the planned dtype, and the checkpoint's published count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from neuron_opt.parallel.sharding import head_layout
    from neuron_opt.planner.memory import weight_bytes

    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    d = dict(raw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
    count = sum(p.numel() for p in hf.parameters())
    assert cfg.num_parameters() == count == PUBLISHED[name]
    assert weight_bytes(cfg, head_layout(cfg, ParallelConfig()), "bfloat16") == 2 * count
    if name == "phi-4-mini":
        assert (cfg.rotary_dim, cfg.tie_word_embeddings) == (96, True)


def test_plan_cli_on_a_published_phi_config(capsys):
    from neuron_opt.cli import main

    argv = ["plan", "--model", str(CONFIGS / "phi-3.5-mini.json"), "--instance", "inf2.xlarge", "--tp", "2"]
    assert main(argv) in (0, 1)
    assert "Phi3ForCausalLM (3.82 B params)" in capsys.readouterr().out


def test_bad_options_name_the_field(tiny_dir, tmp_path):
    cfg = ModelConfig.from_hf(tiny_dir("phi3-long"))
    rope = cfg.rope

    def with_rope(**change):
        return dict(rope_parameters=tuple(sorted({**rope, **change}.items())))

    bad = [
        (with_rope(long_factor=(1.0, 2.0)), "rope_parameters.long_factor"),
        (with_rope(short_factor=(1.0, 1.0, 1.0, 1.0, 1.0, -1.0)), "rope_parameters.short_factor"),
        (with_rope(original_max_position_embeddings=None), "rope_parameters.original_max_position_embeddings"),
        (with_rope(partial_rotary_factor=0.0), "rope_parameters.partial_rotary_factor"),
        (with_rope(partial_rotary_factor=1.5), "rope_parameters.partial_rotary_factor"),
        (with_rope(partial_rotary_factor=0.0625), "rope_parameters.partial_rotary_factor"),  # 1 rotary feature
        (with_rope(rope_type="su"), "rope_parameters.rope_type"),  # from_hf renames it; a manifest never has it
        (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8), "fused_projections"),
    ]
    for change, field in bad:
        with pytest.raises(ConfigError, match=f"^{field}:"):
            dataclasses.replace(cfg, **change)
    # a fused tensor whose rows do not add up to its parts is named
    d = make_tiny("phi3", tmp_path / "ck")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.mlp.gate_up_proj.weight"] = sd["model.layers.0.mlp.gate_up_proj.weight"][:-1]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.gate_up_proj.weight has 191 rows"):
        open_checkpoint(d).state_dict()


def test_fp8_kv_calibration_bounds_partially_rotated_keys(tiny_dir):
    """quant.kv's key bound: rope rotates pairs (i, i + 6) of the first 12 features and passes the other 4 through;
    the calibrated scale covers every rotated key at every position, with both factor sets."""
    from models.llama import apply_rope, model_rope_tables
    from neuron_opt.quant.kv import HEADROOM, calibrate
    from neuron_opt.quant.weights import FP8_MAX

    d = tiny_dir("phi3-long")
    cfg = ModelConfig.from_hf(d)
    model = eager_runner(d, max_model_len=MAX_LEN).executor.model
    keys = []
    hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, i, out: keys.append(out))
    tokens = [(5 * i + 3) % 250 + 3 for i in range(20)]
    try:
        s_k, _ = calibrate(model, tokens, 32)
    finally:
        hook.remove()
    k = keys[0].view(1, -1, cfg.num_key_value_heads, cfg.head_dim)  # [1, S, n_kv, D]
    rotated = [apply_rope(k, cos[p].view(1, 1, 1, -1), sin[p].view(1, 1, 1, -1)).abs().amax().item()
               for cos, sin in model_rope_tables(cfg, MAX_LEN).values() for p in range(MAX_LEN)]
    assert max(rotated) <= s_k[0] * FP8_MAX / HEADROOM * (1 + 1e-5)
