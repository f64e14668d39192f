"""Qwen2.5-VL and Qwen3-VL on the eager backend: dynamic-resolution images through the ViT and patch merger
(Qwen3-VL: its learned position grid and deepstack features added after the decoder's first layers), the decoder's
3-D rotary positions (M-RoPE; Qwen3-VL's interleaved) over prompt, chunks, preemption and decode.

Oracle: HF transformers' `generate` (greedy, fp32) on the same processor outputs, with a tiny random checkpoint of
each family built in the test (tests/tiny_vlm.py) and PIL-drawn images of several sizes and aspect ratios (grids of
2 x 2 up to 16 x 16 patches, several windows each); for the interleaved rotary rows, transformers' own rotary
module. The model loads from disk through `LLM(path)`; transformers builds these processors only with their video
processors, which need torchvision, so where that is missing both sides take the processor the loader builds
without it (vision.load_processor: transformers' own classes).
"""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import GREEDY, N, chat, draw, hf_generate, make_qwen2_5_vl, make_qwen3_vl, run
from transformers.utils import is_torchvision_available

from neuron_opt.api import LLM
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig, ModelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.multimodal.vision import load_processor
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.runner import ModelRunner

BS = 8


FAMILIES = {"qwen2_5_vl": (make_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration"),
            "qwen3_vl": (make_qwen3_vl, "Qwen3VLForConditionalGeneration")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def qwen(request, tmp_path_factory):
    import transformers

    make, arch = FAMILIES[request.param]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = make(tmp_path_factory.mktemp(request.param))
    llm = LLM(path, batch_size=4, max_model_len=512)
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    processor = load_processor(path, hf.config)
    yield llm, hf, processor
    torch.set_num_threads(threads)


def engine_for(llm: LLM, num_blocks: int = 0, **kw) -> Engine:
    cache = CacheConfig(max_batch=4, max_model_len=256, block_size=BS, num_blocks=num_blocks)
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=256, max_batch=4, min_prefill=16, min_decode=16)
    runner = ModelRunner(EagerExecutor(llm.runner.executor.model, cache), buckets, cache, llm.config.vocab_size,
                         llm.config, llm.runner.vision)
    return Engine(runner, llm.tokenizer, llm.eos_token_ids, **kw)


def test_images_of_several_shapes_give_hf_greedy_text(qwen):
    llm, hf, processor = qwen
    assert llm.config.mrope_section == (2, 3, 3)
    assert llm.config.mrope_interleaved == llm.config.qk_norm == (hf.config.model_type == "qwen3_vl")
    if not is_torchvision_available():  # the processor the loader built without its video processor
        assert not hasattr(llm.runner.vision.processor, "video_processor")
    assert ModelConfig.from_dict(llm.config.to_dict()) == llm.config  # as a manifest stores it
    for messages in (chat(draw(70, 40, 1), "What is this?"),
                     chat("Compare", draw(20, 50, 2), "with", draw(9, 9, 3), "and", draw(64, 30, 4))):
        prompt = llm.encode_multimodal_chat(messages)
        assert prompt.rope_positions is not None and prompt.rope_positions[1] < 0
        # one row per placeholder token; Qwen3-VL's carries its two deepstack mergers' features beside the merger's
        rows = llm.runner.encode_image(prompt.images[0])
        wide = 3 if hf.config.model_type == "qwen3_vl" else 1
        assert rows.shape == (len(prompt.images[0].positions), wide * llm.config.hidden_size)
        assert llm.chat(messages, GREEDY).token_ids == hf_generate(hf, processor, messages, N)


def test_image_and_text_requests_batch_with_their_own_outputs(qwen):
    llm, hf, processor = qwen
    convs = [chat(draw(40, 40, 5), "Describe it."), chat("Hello, who are you?"), chat("Two:", draw(70, 40, 1))]
    outs = llm.generate_batch([llm.encode_multimodal_chat(m) for m in convs], GREEDY)
    assert [o.token_ids for o in outs] == [hf_generate(hf, processor, m, N) for m in convs]


def test_chunks_and_preemption_keep_the_3d_positions(qwen):
    llm, hf, processor = qwen
    convs = [chat(f"Question {i}:", draw(70 - 9 * i, 40 + 5 * i, i)) for i in range(4)]
    prompts = [llm.encode_multimodal_chat(m) for m in convs]
    want = [hf_generate(hf, processor, m, N) for m in convs]
    chunked = engine_for(llm, max_num_batched_tokens=11, enable_chunked_prefill=True, enable_prefix_caching=False)
    assert run(chunked, prompts)[0] == want
    assert any(len(im.positions) > 11 for p in prompts for im in p.images)
    longest = max(len(p.token_ids) for p in prompts) + N
    small = engine_for(llm, num_blocks=max(1 + 3 * -(-longest // BS), 33), enable_prefix_caching=False)
    assert run(small, prompts)[0] == want
    assert small.stats.preemptions > 0 and small.encoder_cache.num_encoded == len(prompts)
    with pytest.raises(ConfigError, match="async_scheduling: the pipelined step does not yet carry image"):
        engine_for(llm, async_scheduling=True)
    assert not engine_for(llm).async_scheduling


def test_prefix_cache_hits_only_for_the_same_image(qwen):
    llm, hf, processor = qwen
    text = "Describe the picture in one short sentence, please, and name its main colours. " * 2
    x, y = draw(70, 40, 1), draw(70, 40, 12)
    convs = [chat(text, x, "Answer:"), chat(text, x, "Answer:"), chat(text, y, "Answer:")]
    prompts = [llm.encode_multimodal_chat(m) for m in convs]
    engine = engine_for(llm, enable_prefix_caching=True)
    got, cached = run(engine, prompts, stagger=True)
    assert got == [hf_generate(hf, processor, m, N) for m in convs]
    assert cached["1"] > prompts[1].images[0].positions[-1]
    assert 0 < cached["2"] <= prompts[2].images[0].positions[0]


QWEN3_VL_CONFIG = dict(
    model_type="qwen3_vl", architectures=["Qwen3VLForConditionalGeneration"],
    text_config=dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                      "mrope_interleaved": True}),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=256, num_position_embeddings=16,
                       deepstack_visual_indexes=[0]))


def test_interleaved_mrope_rows_equal_transformers(tmp_path):
    """Qwen3-VL's rotary rows at 3-D positions, with a published checkpoint's sections (24, 20, 20) of 128-wide
    heads, equal transformers' own rotary module's; Qwen2.5-VL's consecutive sections give other rows."""
    import json

    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from models.llama import model_rope_tables, mrope_rows
    from neuron_opt.multimodal.vision import decoder_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_VL_CONFIG))
    cfg = decoder_config(tmp_path)
    assert cfg.mrope_interleaved and cfg.qk_norm and cfg.mrope_section == (24, 20, 20)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    pos = torch.randint(0, 4096, (3, 2, 7), generator=torch.Generator().manual_seed(0))
    table = model_rope_tables(cfg, 4096)["global"]
    d = dict(QWEN3_VL_CONFIG)
    hf = Qwen3VLTextRotaryEmbedding(AutoConfig.for_model(d.pop("model_type"), **d).text_config)
    want = hf(torch.zeros(1, dtype=torch.float32), pos)
    got = mrope_rows(cfg.mrope_section, table, pos, torch.float32, interleaved=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g[:, :, 0], w, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mrope_rows(cfg.mrope_section, table, pos, torch.float32)[0][:, :, 0], want[0])


def test_qwen3_vl_moe_gives_hf_greedy_text(tmp_path):
    """Qwen3-VL-MoE: the same vision side beside a Qwen3-MoE decoder, its stacked experts stored inputs first as
    published (split per expert at load): two images of different shapes in one prompt beside a text-only row."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = make_qwen3_vl(tmp_path / "moe", moe=True)
        llm = LLM(path, batch_size=2, max_model_len=256)
        assert llm.config.num_experts == 4 and llm.config.norm_topk_prob and llm.config.mrope_interleaved
        hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        processor = load_processor(path, hf.config)
        convs = [chat("Compare", draw(20, 50, 2), "with", draw(64, 30, 4)), chat("Hello, who are you?")]
        outs = llm.generate_batch([llm.encode_multimodal_chat(m) for m in convs], GREEDY)
        assert [o.token_ids for o in outs] == [hf_generate(hf, processor, m, N) for m in convs]
    finally:
        torch.set_num_threads(threads)


def test_qwen3_vl_bad_checkpoints_are_refused(tmp_path):
    """A vision config the encoder cannot build, interleaved M-RoPE without sections, a stacked expert tensor of the
    wrong shape, a checkpoint without a deepstack merger's tensor: each an error naming the field or tensor."""
    import dataclasses
    import shutil

    from safetensors.torch import load_file, save_file

    from models import qwen3_vl
    from neuron_opt.errors import CheckpointError
    from neuron_opt.multimodal.vision import hf_config, open_multimodal

    base = dict(QWEN3_VL_CONFIG["vision_config"], depth=2, in_channels=3, hidden_act="gelu_pytorch_tanh",
                deepstack_visual_indexes=(0,), rope_theta=1e4)
    base.pop("num_heads")
    for bad, field in ((dict(num_position_embeddings=15), "num_position_embeddings"),
                       (dict(deepstack_visual_indexes=(2,)), "deepstack_visual_indexes"),
                       (dict(deepstack_visual_indexes=(0, 0)), "deepstack_visual_indexes")):
        with pytest.raises(ConfigError, match=f"vision_config.{field}"):
            qwen3_vl.VisionConfig(**{**base, "num_heads": 2, **bad})
    moe = ModelConfig(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=10, hidden_size=8,
                      intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=4, max_position_embeddings=64, num_experts=2, num_experts_per_tok=1,
                      moe_intermediate_size=4)
    with pytest.raises(ConfigError, match="mrope_interleaved: needs mrope_section"):
        dataclasses.replace(moe, mrope_interleaved=True)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    parts = dict(qwen3_vl.split_experts(moe, name, torch.randn(2, 8, 8)))  # inputs first: [E, H, 2I]
    assert sorted(parts) == [f"model.layers.0.mlp.experts.{j}.{p}.weight" for j in (0, 1)
                             for p in ("gate_proj", "up_proj")]
    with pytest.raises(CheckpointError, match=f"{name}: shape \\(2, 8, 4\\)"):
        list(qwen3_vl.split_experts(moe, name, torch.randn(2, 8, 4)))
    path = make_qwen3_vl(tmp_path / "ok")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (f,) = broken.glob("*.safetensors")
    sd = load_file(f)
    del sd["model.visual.deepstack_merger_list.1.linear_fc2.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    assert hf_config(broken).architectures == ["Qwen3VLForConditionalGeneration"]
    with pytest.raises(CheckpointError, match="deepstack_merger_list.1.linear_fc2.weight"):
        open_multimodal(broken, torch.float32)
