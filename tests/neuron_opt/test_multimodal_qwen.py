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
