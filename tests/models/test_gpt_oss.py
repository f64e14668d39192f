"""GPT-OSS against HF transformers (fp32, a tiny random checkpoint with every feature switched on: sinks of real
weight, a window of 4 on the sliding layer, YaRN past its original length of 8, biases on attention, router and
experts, the clamped SwiGLU at a limit the weights cross; tests/tiny.py "gpt-oss").

tp 1 eager parity (prefill + 16 decode logits within 1e-4, 32 greedy tokens) runs in tests/models/test_llama_parity.py
with every variant. Here: the MXFP4 reader against transformers' dequantization; an MXFP4 checkpoint (blocks and
scales as published) against HF running the dequantized weights; the ranks (tp 2, tp 3 with query heads padded
4 -> 6 and experts 32 -> 33 features, ep 2, tp 4 = 2 x ep 2, flash decoding) against HF; the cpu backend's
graphs against HF; sinks in the decode loop nest against the reference op; the planner on the published config;
the config and checkpoint errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ThreadRanks, check_tp_against_hf, eager_runner
from safetensors.torch import load_file, save_file
from tiny import load_hf, make_tiny

from models.gpt_oss import mxfp4_dequantize
from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.errors import CheckpointError, ConfigError
from neuron_opt.executors.launcher import RankSpec, write_rank_weights
from neuron_opt.parallel.sharding import MHA, head_layout

CONFIGS = Path(__file__).resolve().parents[2] / "docs" / "configs"
MAX_LEN = 64


def test_mxfp4_reader_matches_transformers():
    """Random blocks over every byte and scales over the whole E8M0 range (fp32: bitwise), and over a normal range
    in bf16 (the dtype checkpoints are served in: FP4 values times powers of two are exact there too)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    for lo, hi, dtype in ((0, 255, torch.float32), (100, 150, torch.bfloat16)):
        scales = torch.randint(lo, hi, (3, 5, 4), generator=g, dtype=torch.uint8)
        ours = mxfp4_dequantize(blocks, scales)  # [3, 5, 128]: rows as stored, inputs last
        theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)  # [3, 128, 5]
        assert ours.shape == (3, 5, 128)
        assert torch.equal(ours.to(dtype), theirs.transpose(1, 2))
    with pytest.raises(CheckpointError, match="do not pair"):
        mxfp4_dequantize(blocks, scales[..., :3])


def _write_mxfp4(src: Path, out: Path, oracle: Path) -> None:
    """From the float tiny checkpoint `src`: random MXFP4 experts written as published (`out`: blocks, scales, a
    quantization_config), and the HF oracle holding transformers' dequantization of the same blocks (`oracle`)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    sd = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    E, H, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(1)
    packed, floats = dict(sd), dict(sd)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(121, 124, (E, rows, cols // 32), generator=g, dtype=torch.uint8)  # 2^-6..2^-4
            del packed[p + proj]
            packed[p + proj + "_blocks"], packed[p + proj + "_scales"] = blocks, scales
            floats[p + proj] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    for d, tensors, quant in ((out, packed, True), (oracle, floats, False)):
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        c = dict(cfg, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}) \
            if quant else cfg
        (d / "config.json").write_text(json.dumps(c))
        for f in src.glob("generation_config.json"):
            shutil.copy(f, d / f.name)


def test_mxfp4_checkpoint_matches_hf_on_the_dequantized_weights(tiny_dir, tmp_path):
    """Our loader reads the blocks and scales (one expert at a time) and the model equals HF running transformers'
    dequantization of them: logits through prefill and decode, 16 greedy tokens."""
    _write_mxfp4(tiny_dir("gpt-oss"), tmp_path / "mxfp4", tmp_path / "oracle")
    ck = open_checkpoint(tmp_path / "mxfp4")
    assert ck.config.experts_mxfp4
    sd = ck.state_dict()
    assert sd["model.layers.0.mlp.experts.5.gate_proj.weight"].shape == (32, 64)
    hf = load_hf(tmp_path / "oracle")
    want = hf.model.layers[1].mlp.experts.gate_up_proj[5]  # [H, 2I], gate and up interleaved
    torch.testing.assert_close(sd["model.layers.1.mlp.experts.5.up_proj.weight"], want[:, 1::2].t(), rtol=0, atol=0)
    runner = eager_runner(tmp_path / "mxfp4", max_model_len=MAX_LEN, max_batch=2)
    check_tp_against_hf(runner.executor, ck.config, hf)


@pytest.mark.parametrize("tp, ep, sp", [(2, 1, False), (3, 1, False), (2, 2, False), (4, 2, False), (2, 1, True)])
def test_rank_threads_match_hf(tp, ep, sp, tiny_dir, tmp_path):
    """tp 3: query heads padded 4 -> 6 (zero q rows, zero sinks), each expert's 32 features padded to 33; ep 2: four
    whole experts per rank (a down bias added once per expert); sp: sequence-parallel prefill."""
    d = tiny_dir("gpt-oss")
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=tp, ep=ep, sequence_parallel=sp)
    lay = head_layout(cfg, par)
    if tp == 3:
        assert lay.strategy == MHA and lay.moe_intermediate_local * 3 == 33
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    write_rank_weights(open_checkpoint(d).state_dict(), cfg, par, tmp_path)
    ranks = ThreadRanks(RankSpec(cfg, par, cache, str(tmp_path)))
    try:
        check_tp_against_hf(ranks, cfg, load_hf(d))
    finally:
        ranks.close()


def test_flash_decoding_adds_each_sink_once(tiny_dir, tmp_path):
    """kv-seq-shard (tp 4 over 2 KV heads): each rank holds every other position of its group's blocks; the sink
    joins the group's combined softmax once. Rank processes (gloo): the group collective needs process groups."""
    from neuron_opt.executors.tp import tp_executor_from_state_dict

    d = tiny_dir("gpt-oss")
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=4, flash_decoding=True)
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    with tp_executor_from_state_dict(cfg, open_checkpoint(d).state_dict(), par, cache, tmp_path) as ex:
        check_tp_against_hf(ex, cfg, load_hf(d))


@pytest.mark.slow  # ~40 s of cold cpu compile (make test-slow); Gemma 2 keeps capped scores in the default suite
def test_cpu_graphs_match_hf(tmp_path):
    """The cpu backend's compiled graphs: sinks in the prefill GEMMs and in the decode loop nest (the C++ paged
    attention kernel has no sink: recorded in the graph's metadata), the window as a graph input, the experts'
    biases and clamped SwiGLU in the gathered and dense forms."""
    from neuron_opt.api import LLM
    from neuron_opt.backends.cpu.backend import SINKS_NOT_ON_KERNEL
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.runtime.generate import generate_ids
    from neuron_opt.runtime.runner import DecodeRow
    from neuron_opt.runtime.sampling import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ck = make_tiny("gpt-oss", tmp_path / "ck", tokenizer=True)
        out = tmp_path / "art"
        # the C++ operators asked for: neither can take this model (built or not, so this runs everywhere)
        req = CompileRequest(model=str(ck), out=out, backend="cpu", dtype="float32", max_model_len=MAX_LEN,
                             prefill_buckets=(16, MAX_LEN), decode_buckets=(MAX_LEN,), cache_dir=tmp_path / "cache",
                             backend_options={"decode_attention": "kernel", "moe_gather": "kernel"})
        compile_artifact(req, log=lambda s: None, progress=False)
        meta = json.loads(next(out.rglob("layer_decode_b1.meta.json")).read_text())
        assert meta["torch_ops"] == {"decode_attention": SINKS_NOT_ON_KERNEL,
                                     "moe_gather": "expert biases and the clamped SwiGLU (GPT-OSS): moe_gather has "
                                                   "neither"}
        llm = LLM(out)
        hf = load_hf(ck)
        runner = llm.runner
        ids = torch.randint(3, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref = hf(ids).logits[0]
        got = [runner.prefill(0, ids[0, :11].tolist())]
        for t in range(11, 24):
            got.append(runner.decode([DecodeRow(0, int(ids[0, t]), t)])[0])
        torch.testing.assert_close(torch.stack(got), ref[10:], atol=1e-4, rtol=0)
        prompt = [1, 17, 42, 99, 5, 123, 7]
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()

        class NoTok:
            def decode(self, ids, skip_special_tokens=True):
                return ""

        assert generate_ids(runner, NoTok(), prompt, SamplingParams(max_tokens=20, min_tokens=20),
                            (2,)).token_ids == want
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("S, rows_as_decode", [(1, False), (3, True)])
def test_decode_loop_nest_takes_sinks_as_the_reference_op(S, rows_as_decode):
    from models.llama import TorchOps
    from neuron_opt.backends.cpu.graphs import DecodeAttention

    g = torch.Generator().manual_seed(0)
    B, H, n_kv, D, bs = 2, 4, 2, 16, 8
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(8, n_kv, bs, D, generator=g)
    v = torch.randn(8, n_kv, bs, D, generator=g)
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]])
    pos = torch.tensor([[20 + i for i in range(S)], [11 + i for i in range(S)]])
    mask = torch.arange(24)[None, None, :] <= pos[:, :, None]
    mask &= torch.arange(24)[None, None, :] > pos[:, :, None] - 6  # a window of 6
    sinks = torch.randn(H, generator=g) * 2
    ref = TorchOps().attention_blocks(q, k, v, tables, pos, mask, 0.25, sinks=sinks)
    got = DecodeAttention(TorchOps(), rows_as_decode=rows_as_decode).attention_blocks(q, k, v, tables, pos, mask,
                                                                                      0.25, sinks=sinks)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    plain = TorchOps().attention_blocks(q, k, v, tables, pos, mask, 0.25)
    assert (plain - ref).abs().max() > 1e-2  # the sinks took their share


def test_config_options_and_parameter_counts(tiny_dir):
    from models.build import weight_names
    from neuron_opt.planner.memory import weight_count

    d = tiny_dir("gpt-oss")
    cfg = ModelConfig.from_hf(d)
    assert (cfg.attention_sinks, cfg.router_bias, cfg.router_topk_softmax, cfg.expert_bias) == (True,) * 4
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.experts_mxfp4) == (0.1, 1.702, False)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert [cfg.layer_window(i) for i in range(2)] == [4, None] and cfg.o_bias and cfg.attention_bias
    assert cfg.rope["rope_type"] == "yarn" and cfg.rope["original_max_position_embeddings"] == 8
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    hf = load_hf(d)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert weight_count(cfg, head_layout(cfg, ParallelConfig())).total == cfg.num_parameters()
    sd = open_checkpoint(d).state_dict()
    assert set(sd) == set(weight_names(cfg))
    assert sum(t.numel() for t in sd.values()) == cfg.num_parameters()


@pytest.mark.parametrize("tp, ep", [(2, 1), (3, 1), (4, 2), (4, 4)])
def test_shards_hold_what_the_planner_counts(tp, ep, tiny_dir):
    from neuron_opt.parallel.sharding import shard_state_dict
    from neuron_opt.planner.memory import weight_count

    d = tiny_dir("gpt-oss")
    cfg = ModelConfig.from_hf(d)
    lay = head_layout(cfg, ParallelConfig(tp=tp, ep=ep))
    sd = open_checkpoint(d).state_dict()
    down_bias = 0
    for rank in range(tp):
        shard = shard_state_dict(sd, cfg, lay, rank)
        assert sum(t.numel() for t in shard.values()) == weight_count(cfg, lay).total
        assert shard["model.layers.0.self_attn.sinks"].numel() == lay.n_heads_local
        down_bias += sum(shard[f"model.layers.0.mlp.experts.{j}.down_proj.bias"] for j in lay.expert_range(rank))
    torch.testing.assert_close(down_bias, sum(sd[f"model.layers.0.mlp.experts.{j}.down_proj.bias"]
                                              for j in range(8)))  # each expert's down bias once over the ranks


def test_published_config_plans_the_checkpoint_size(capsys):
    """gpt-oss-20b's published config.json: HF's parameter count (its model on the meta device), the model card's
    21 B; the checkpoint's tensors as stored (MXFP4 experts, the rest bf16) are the 13,761,264,768 bytes its
    safetensors index lists (total_size), and `plan` prints them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from neuron_opt.cli import main
    from neuron_opt.planner.memory import checkpoint_bytes, weight_bytes

    raw = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    assert cfg.experts_mxfp4 and cfg.num_experts == 32 and cfg.num_experts_per_tok == 4
    assert sum(cfg.layer_window(i) == 128 for i in range(24)) == 12
    d = {k: v for k, v in raw.items() if k != "quantization_config"}
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    count = sum(p.numel() for p in hf.parameters())
    assert cfg.num_parameters() == count and round(count / 1e9) == 21
    assert checkpoint_bytes(cfg) == 13_761_264_768
    assert weight_bytes(cfg, head_layout(cfg, ParallelConfig()), "bfloat16") == 2 * count  # dequantized at load
    argv = ["plan", "--model", str(CONFIGS / "gpt-oss-20b.json"), "--instance", "trn1.32xlarge", "--tp", "8"]
    assert main(argv) in (0, 1)
    out = capsys.readouterr().out
    assert "checkpoint: 13.76 GB as stored (MXFP4 experts)" in out
    # every backend holds window-sized KV: the plan sizes the sliding layers' pools as compile allocates them
    assert "(window-sized KV)" in out and "12 of 24 layers slide over 128 positions" in out
    assert "KV if sliding layers held windows" not in out


def test_bad_configs_and_checkpoints_are_refused(tiny_dir, tmp_path):
    raw = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    with pytest.raises(ConfigError, match="^quantization_config.quant_method:"):
        ModelConfig.from_hf(dict(raw, quantization_config={"quant_method": "gptq"}))
    cfg = ModelConfig.from_hf(raw)
    with pytest.raises(ConfigError, match="^swiglu_limit:"):
        ModelConfig(**{**cfg.__dict__, "swiglu_alpha": None})
    with pytest.raises(ConfigError, match="^router_bias:"):
        ModelConfig(**{**cfg.__dict__, "num_experts": 0, "num_experts_per_tok": 0, "router_bias": True})
    # a float checkpoint whose config says MXFP4: refused when its experts are read, naming the tensor
    d = tmp_path / "wrong"
    shutil.copytree(tiny_dir("gpt-oss"), d)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(c, quantization_config={"quant_method": "mxfp4"})))
    with pytest.raises(CheckpointError, match="experts"):
        open_checkpoint(d)


def test_kernel_call_sites_take_the_torch_op_for_sinks_with_the_reason():
    """The NKI kernels' softmax has no sink logit: the device call sites choose the torch op and record why; the
    simulator's ops take the torch op too. Sinks against transformers' eager attention on the same tensors."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from models.llama import TorchOps
    from neuron_opt.backends.neuron.nki_device import (
        SINKS_REASON,
        DeviceKernelOps,
        choose_attention,
        choose_paged_attention,
    )
    from neuron_opt.backends.nki_ops import NkiSimOps

    c = choose_attention(1, 4, 2, 1, 32, 128, torch.bfloat16, None, "NEURON", sinks=True)
    assert c.kernel is None and c.reason == SINKS_REASON
    c = choose_paged_attention(1, 4, 2, 1, 8, 16, 2, 128, torch.bfloat16, torch.bfloat16, None, "NEURON", None, True)
    assert c.kernel is None and c.reason == SINKS_REASON
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g),
               torch.randn(1, 2, 8, 16, generator=g))
    pos = torch.tensor([[5, 6, 7]])
    mask = torch.arange(8)[None, None, :] <= pos[:, :, None]
    sinks = torch.randn(4, generator=g)
    want = TorchOps().attention(q, k, v, pos, mask, 0.25, sinks=sinks)

    class Module:  # what transformers' eager attention reads off its module
        num_key_value_groups, training = 2, False

    Module.sinks = sinks
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[:, None]
    hf, _ = eager_attention_forward(Module(), q, k, v, additive, scaling=0.25)
    torch.testing.assert_close(want, hf.transpose(1, 2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(NkiSimOps().attention(q, k, v, pos, mask, 0.25, sinks=sinks), want)
    ops = DeviceKernelOps("CPU", None)
    torch.testing.assert_close(ops.attention(q, k, v, pos, mask, 0.25, sinks=sinks), want)
