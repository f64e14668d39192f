"""Qwen3, Gemma 2, Gemma 3, OLMo 2, Granite 3 and SmolLM3 against HF transformers (fp32, tiny random checkpoints
with every option on: random norm weights, soft-capping, sliding windows of 6 positions, a local rope base, NoPE
layers, multipliers; tests/tiny.py).

tp 1 eager parity (prefill + 16 decode logits within 1e-4, 32 greedy tokens) runs for every variant in
tests/models/test_llama_parity.py, the device path in tests/xla/test_device_families.py. Here: tp 2 and tp 3
(query heads padded 4 -> 6, KV heads expanded) as rank threads against HF, OLMo 2 under flash decoding as rank
processes; the cpu backend's compiled graphs against HF (one artifact per family: the layer graphs are the slow
part, so Gemma 2, which switches on the most options, is in the default tier and the others are slow); the shards,
parameter counts and published configs; a chat template through the server; the config errors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import ThreadRanks, check_tp_against_hf
from safetensors.torch import load_file
from tiny import FAMILIES, load_hf, make_tiny

from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.executors.launcher import RankSpec, write_rank_weights
from neuron_opt.parallel.sharding import MHA, head_layout, shard_state_dict

MAX_LEN = 64


def test_options_are_read_from_the_hf_configs(tiny_dir):
    cfgs = {v: ModelConfig.from_hf(tiny_dir(v)) for v in FAMILIES}
    g2, g3 = cfgs["gemma2"], cfgs["gemma3"]
    assert (g2.norm_layout, g2.norm_offset, g2.hidden_act) == ("sandwich", 1.0, "gelu_pytorch_tanh")
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.attention_scale) == (4.0, 2.5, 24 ** -0.5)
    assert g2.embedding_multiplier == 8.0 and g2.layer_types == ("sliding_attention", "full_attention")
    assert [g2.layer_window(i) for i in range(2)] == [6, None] and g2.mixed_windows
    assert g3.qk_norm and not g3.qk_norm_full and g3.attn_logit_softcapping is None
    assert [g3.layer_rope(i) for i in range(2)] == ["local", "global"]
    assert g3.rope["rope_type"] == "linear" and dict(g3.rope_local_parameters)["rope_theta"] == 1e4
    assert cfgs["olmo2"].norm_layout == "post" and cfgs["olmo2"].qk_norm_full
    gr = cfgs["granite"]
    assert (gr.embedding_multiplier, gr.residual_multiplier, gr.attention_scale, gr.logits_scaling) == \
        (12.0, 0.22, 0.2, 8.0)
    s3 = cfgs["smollm3"]
    assert s3.nope_layers == (1,) and [s3.layer_rope(i) for i in range(2)] == ["global", "none"]
    assert [s3.layer_window(i) for i in range(2)] == [None, 6]  # SmolLM3 slides on its NoPE layers
    q3 = cfgs["qwen3"]
    assert q3.qk_norm and q3.tie_word_embeddings and [q3.layer_window(i) for i in range(2)] == [None, 6]
    for cfg in cfgs.values():  # what an artifact's manifest stores comes back equal
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("variant", FAMILIES)
def test_parameter_counts_and_names_match_hf(variant, tiny_dir):
    from models.build import weight_names
    from neuron_opt.planner.memory import weight_count

    d = tiny_dir(variant)
    cfg = ModelConfig.from_hf(d)
    hf = load_hf(d)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert weight_count(cfg, head_layout(cfg, ParallelConfig())).total == cfg.num_parameters()
    assert set(weight_names(cfg)) == set(load_file(str(d / "model.safetensors")))


@pytest.mark.parametrize("variant", ["olmo2", "gemma3"])
@pytest.mark.parametrize("tp, flash", [(2, False), (3, False), (4, True)])
def test_shards_hold_what_the_planner_counts(variant, tp, flash, tiny_dir):
    """OLMo 2's full-width q/k norms are split head by head (padded, expanded and flash-decoding layouts too)."""
    from neuron_opt.planner.memory import weight_count

    d = tiny_dir(variant)
    cfg = ModelConfig.from_hf(d)
    lay = head_layout(cfg, ParallelConfig(tp=tp, flash_decoding=flash))
    sd = load_file(str(d / "model.safetensors"))
    for rank in range(tp):
        shard = shard_state_dict(sd, cfg, lay, rank)
        assert sum(t.numel() for t in shard.values()) == weight_count(cfg, lay).total
        if variant == "olmo2":
            assert shard["model.layers.0.self_attn.q_norm.weight"].numel() == lay.n_heads_local * cfg.head_dim


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("tp, sp", [(2, False), (3, False), (2, True)])
def test_rank_threads_match_hf(variant, tp, sp, tiny_dir, tmp_path):
    """sp: sequence parallelism (norms and residuals on each rank's chunk of a prefill's positions)."""
    d = tiny_dir(variant)
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=tp, sequence_parallel=sp)
    if tp == 3:
        assert head_layout(cfg, par).strategy == MHA  # 4 query heads padded to 6, one KV copy per query head
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    write_rank_weights(load_file(str(d / "model.safetensors")), cfg, par, tmp_path)
    ranks = ThreadRanks(RankSpec(cfg, par, cache, str(tmp_path)))
    try:
        check_tp_against_hf(ranks, cfg, load_hf(d))
    finally:
        ranks.close()


def test_olmo2_flash_decoding_matches_hf(tiny_dir, tmp_path):
    """kv-seq-shard: each q/k head is held by both ranks of its KV group; the full-width norm counts it once. Rank
    processes (gloo): flash decoding's KV-group collective needs the workers' process groups."""
    from neuron_opt.executors.tp import tp_executor_from_state_dict

    d = tiny_dir("olmo2")
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=4, flash_decoding=True)
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    with tp_executor_from_state_dict(cfg, load_file(str(d / "model.safetensors")), par, cache, tmp_path) as ex:
        check_tp_against_hf(ex, cfg, load_hf(d))


def _compiled_greedy_matches_hf(variant: str, tmp_path, decode_attention: str) -> None:
    from neuron_opt.api import LLM
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.runtime.generate import generate_ids
    from neuron_opt.runtime.runner import DecodeRow
    from neuron_opt.runtime.sampling import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny graphs: thread barriers cost more than they save
    try:
        ck = make_tiny(variant, tmp_path / "ck", tokenizer=True)
        out = tmp_path / "art"
        req = CompileRequest(model=str(ck), out=out, backend="cpu", dtype="float32", max_model_len=MAX_LEN,
                             prefill_buckets=(16, MAX_LEN), decode_buckets=(MAX_LEN,), cache_dir=tmp_path / "cache",
                             backend_options={"decode_attention": decode_attention})
        compile_artifact(req, log=lambda s: None, progress=False)
        llm = LLM(out)
        hf = load_hf(ck)
        runner = llm.runner
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(3, hf.config.vocab_size, (1, 24), generator=g)
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
        # a prompt between the compiled prefill lengths (16, 64) runs at its length rounded up to the executor's
        # granularity (37 -> 48 tokens), not at 64
        prompt = torch.randint(3, hf.config.vocab_size, (37,), generator=g).tolist()
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        runner.prefill(0, prompt)
        assert runner.last_bucket.tokens == 48 == -(-37 // runner.prefill_granularity) * runner.prefill_granularity
        assert generate_ids(runner, NoTok(), prompt, SamplingParams(max_tokens=12, min_tokens=12),
                            (2,)).token_ids == want
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # a cpu artifact's compile, about a minute (the default suite's budget)
def test_gemma2_cpu_graphs_match_hf(tmp_path):
    """The family with the most options (soft-capping on the C++ paged attention kernel where it builds, mixed
    windows as a graph input, (1 + w) sandwich norms, GeGLU, scaled embeddings, capped logits)."""
    from neuron_opt.backends.cpu import ops as cpu_ops

    _compiled_greedy_matches_hf("gemma2", tmp_path, "kernel" if cpu_ops.load() is None else "fused")


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in FAMILIES if v != "gemma2"])
def test_cpu_graphs_match_hf(variant, tmp_path):
    _compiled_greedy_matches_hf(variant, tmp_path, "fused")


@pytest.mark.slow
def test_gemma2_fused_decode_attention_matches_hf(tmp_path):
    """The Inductor loop nest (decode_attention=fused) caps its scores too."""
    _compiled_greedy_matches_hf("gemma2", tmp_path, "fused")


def test_paged_attention_kernel_caps_scores():
    import shutil

    from torch.utils.cpp_extension import get_cxx_compiler

    from neuron_opt.backends.cpu import ops as cpu_ops

    err = cpu_ops.load()  # as in test_cpu_ops.py: a build error fails; only a machine with no compiler skips
    if err is not None and shutil.which(get_cxx_compiler()) is None:
        pytest.skip(f"no C++ compiler ({get_cxx_compiler()!r} is not on PATH) to build the operators: {err}")
    assert err is None, f"the cpu backend's C++ operators did not build: {err}"
    from models.llama import TorchOps

    g = torch.Generator().manual_seed(0)
    B, H, n_kv, D, bs, nb = 2, 4, 2, 16, 8, 3
    q = torch.randn(B, H, 1, D, generator=g) * 3
    k = torch.randn(8, n_kv, bs, D, generator=g)
    v = torch.randn(8, n_kv, bs, D, generator=g)
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]])
    pos = torch.tensor([[20], [11]])
    kp = torch.arange(nb * bs)
    mask = (kp[None, None] <= pos[:, :, None]) & (kp[None, None] > pos[:, :, None] - 6)
    want = TorchOps().attention_blocks(q, k, v, tables, pos, mask, 0.25, softcap=2.0)
    got = cpu_ops.paged_attention_softcap(q, k, v, tables, mask, 0.25, 2.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = cpu_ops.paged_attention(q, k, v, tables, mask, 0.25)
    assert (plain - got).abs().max() > 1e-3  # the cap changes the result at these scores


def test_bad_options_name_the_field(tiny_dir):
    cfg = ModelConfig.from_hf(tiny_dir("gemma3"))
    bad = [
        (dict(layer_types=("sliding_attention",)), "layer_types"),
        (dict(layer_types=("sliding_attention", "chunked_attention")), "layer_types"),
        (dict(sliding_window=None), "sliding_window"),
        (dict(rope_local_parameters=(("rope_type", "dynamic"),)), "rope_local_parameters.rope_type"),
        (dict(layer_types=(), sliding_window=None), "rope_local_parameters"),
        (dict(nope_layers=(5,)), "nope_layers"),
        (dict(norm_layout="peri"), "norm_layout"),
        (dict(qk_norm=False, qk_norm_full=True), "qk_norm_full"),
        (dict(attn_logit_softcapping=0.0), "attn_logit_softcapping"),
        (dict(logits_scaling=-1.0), "logits_scaling"),
        (dict(hidden_act="relu"), "hidden_act"),
        (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8), "hidden_act"),  # GeGLU experts
    ]
    for change, field in bad:
        with pytest.raises(ConfigError, match=f"^{field}:"):
            dataclasses.replace(cfg, **change)
    hf = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 11, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 4, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    with pytest.raises(ConfigError, match="^rope_parameters.rope_type: 'dynamic' with a rotary embedding of its own"):
        ModelConfig.from_hf(hf)


CONFIGS = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "configs"
# published parameter counts (model cards / safetensors indexes); the rest are checked against HF's own model only
PUBLISHED = {"qwen3-8b": 8_190_735_360, "gemma-2-2b": 2_614_341_888, "gemma-3-1b": 999_885_952,
             "smollm3-3b": 3_075_098_624}


@pytest.mark.parametrize("name", ["qwen3-8b", "gemma-2-2b", "gemma-3-1b", "olmo-2-7b", "granite-3.1-2b",
                                  "smollm3-3b"])
def test_published_configs_plan_the_checkpoint_sizes(name):
    """`plan`'s weight sizes are HF's parameter count (its model built on the meta device from the same config.json)
    in the planned dtype."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from neuron_opt.planner.memory import weight_bytes

    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    d = dict(raw)
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    count = sum(p.numel() for p in hf.parameters())  # a tied table once
    assert cfg.num_parameters() == count
    if name in PUBLISHED:
        assert count == PUBLISHED[name]
    assert weight_bytes(cfg, head_layout(cfg, ParallelConfig()), "bfloat16") == 2 * count


def test_plan_cli_on_a_published_gemma_config(capsys):
    from neuron_opt.cli import main

    argv = ["plan", "--model", str(CONFIGS / "gemma-2-2b.json"), "--instance", "inf2.xlarge", "--tp", "2"]
    assert main(argv) in (0, 1)
    out = capsys.readouterr().out
    assert "Gemma2ForCausalLM (2.61 B params)" in out


# A chat template in the form Gemma's checkpoints ship (turns between <start_of_turn> and <end_of_turn>, the
# assistant's role named "model", a system message refused by the template itself), written for this test.
TURN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + m['content'] + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def test_a_family_chat_template_is_used_as_is_through_the_server(tmp_path):
    import httpx
    from helpers import live_server
    from transformers import AutoTokenizer

    from neuron_opt.api import LLM

    ck = make_tiny("gemma2-tok", tmp_path / "ck")
    tok = AutoTokenizer.from_pretrained(ck)
    tok.chat_template = TURN_TEMPLATE
    tok.save_pretrained(ck)
    llm = LLM(ck, batch_size=2, max_model_len=128)
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert llm.encode_chat(msgs) == want
    with live_server(llm, max_num_seqs=2) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "system", "content": "x"}, *msgs]})
        assert r.status_code == 400 and "System role not supported" in r.text


def test_kernel_call_sites_cap_scores_in_the_kernels_and_record_the_cap():
    from models.llama import TorchOps
    from neuron_opt.backends.neuron.nki_device import DeviceKernelOps, choose_attention, choose_paged_attention
    from neuron_opt.backends.nki_ops import NkiSimOps

    c = choose_attention(1, 4, 2, 1, 32, 128, torch.bfloat16, None, "NEURON", softcap=50.0)
    assert c.kernel == "decode_attention" and c.shape.endswith("softcap 50")
    c = choose_paged_attention(1, 4, 2, 1, 8, 16, 2, 128, torch.bfloat16, torch.bfloat16, None, "NEURON", 50.0)
    assert c is not None and c.kernel is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1, 16, generator=g) * 4, torch.randn(1, 2, 8, 16, generator=g),
               torch.randn(1, 2, 8, 16, generator=g))
    mask, pos = torch.ones(1, 1, 8, dtype=torch.bool), torch.tensor([[7]])
    want = TorchOps().attention(q, k, v, pos, mask, 0.25, softcap=2.0)
    assert (want - TorchOps().attention(q, k, v, pos, mask, 0.25)).abs().max() > 1e-3  # the cap bites
    torch.testing.assert_close(NkiSimOps().attention(q, k, v, pos, mask, 0.25, softcap=2.0), want)
    ops = DeviceKernelOps("CPU", None)
    torch.testing.assert_close(ops.attention(q, k, v, pos, mask, 0.25, softcap=2.0), want)
    x, w = torch.randn(3, 16, generator=g), torch.randn(16, generator=g) * 0.1
    torch.testing.assert_close(ops.rms_norm_offset(x, w, 1e-6, 1.0), TorchOps().rms_norm_offset(x, w, 1e-6, 1.0))
    assert [c["op"] for c in ops.take_choices()] == ["attention", "rms_norm"]
