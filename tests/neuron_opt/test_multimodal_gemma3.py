"""Gemma 3 vision on the eager backend: SigLIP and the pooling projector, and the decoder's bidirectional attention
among each image's soft tokens on top of its causal and sliding-window masks, under chunked prefill (a chunk never
ends inside an image) and prefix caching (a hit may end inside one).

Oracle: HF transformers' `generate` (greedy, fp32) on the same processor outputs (its token_type_ids mask), with a
tiny random checkpoint built in the test (tests/tiny_vlm.py: sliding layers with a window of 8 positions, shorter than
an image's 16 soft tokens) and PIL-drawn images of several sizes and aspect ratios.
"""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import GREEDY, N, chat, draw, hf_generate, make_gemma3, run

from neuron_opt.api import LLM
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.errors import ConfigError
from neuron_opt.multimodal.inputs import ImageItem, image_blocks, last_keys
from neuron_opt.planner.memory import kv_window
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.request import Request
from neuron_opt.runtime.runner import ModelRunner
from neuron_opt.runtime.scheduler import KVConfig, Scheduler

BS = 8


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = make_gemma3(tmp_path_factory.mktemp("gemma3"))
    llm = LLM(path, batch_size=4, max_model_len=512)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    yield llm, hf, processor
    torch.set_num_threads(threads)


def engine_for(llm: LLM, max_prompt_len: int = 64, window_kv: bool = False, num_blocks: int = 0, **kw) -> Engine:
    """An engine over the loaded model's weights with its own block pool and buckets; `window_kv`: the sliding
    layers hold window-sized KV (a pool of their own whose blocks go back as the window moves on)."""
    buckets = BucketConfig.build(max_prompt_len=max_prompt_len, max_model_len=256, max_batch=4, min_prefill=16,
                                 min_decode=16)
    window, per_seq = kv_window(llm.config, buckets, BS, 256) if window_kv else (0, 0)
    assert window_kv == bool(window)
    cache = CacheConfig(max_batch=4, max_model_len=256, block_size=BS, num_blocks=num_blocks, sliding_window=window,
                        window_blocks_per_sequence=per_seq)
    runner = ModelRunner(EagerExecutor(llm.runner.executor.model, cache), buckets, cache, llm.config.vocab_size,
                         llm.config, llm.runner.vision)
    return Engine(runner, llm.tokenizer, llm.eos_token_ids, **kw)


def hf_causal(hf, processor, messages) -> list[int]:
    """HF's greedy tokens without token_type_ids: image tokens attend causally only."""
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    inputs.pop("token_type_ids")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_images_give_hf_greedy_text_with_bidirectional_image_blocks(gemma):
    llm, hf, processor = gemma
    windows = [llm.config.layer_window(i) for i in range(llm.config.num_hidden_layers)]
    assert windows == [8, 8, None]
    assert llm.runner.vision.bidirectional
    causal_differs = False
    for messages in (chat(draw(70, 40, 1), "What is in the picture?"),
                     chat("Compare", draw(20, 30, 2), "with", draw(33, 97, 3), "and", draw(64, 64, 4))):
        prompt = llm.encode_multimodal_chat(messages)
        assert [len(im.positions) for im in prompt.images] == [16] * len(prompt.images)
        want = hf_generate(hf, processor, messages, N)
        assert llm.chat(messages, GREEDY).token_ids == want
        causal_differs |= hf_causal(hf, processor, messages) != want
    assert causal_differs  # the bidirectional blocks change the text: the parity above checks them
    other = llm.chat(chat(draw(70, 40, 9), "What is in the picture?"), GREEDY).token_ids
    assert other != hf_generate(hf, processor, chat(draw(70, 40, 1), "What is in the picture?"), N)


def test_image_and_text_requests_batch_with_their_own_outputs(gemma):
    llm, hf, processor = gemma
    convs = [chat(draw(40, 40, 5), "Describe it."), chat("Hello, who are you? Tell me a story."),
             chat("Two:", draw(70, 40, 1), draw(20, 50, 6))]
    outs = llm.generate_batch([llm.encode_multimodal_chat(m) for m in convs], GREEDY)
    assert [o.token_ids for o in outs] == [hf_generate(hf, processor, m, N) for m in convs]


def _record_chunks(engine: Engine) -> list[tuple[str, int, int]]:
    """Every prefill chunk the engine's scheduler hands out, as (request id, start, end)."""
    chunks: list[tuple[str, int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend((p.request_id, p.start, p.start + len(p.token_ids)) for p in out.prefills)
        return out

    engine.scheduler.schedule = recording
    return chunks


@pytest.mark.parametrize("window_kv", [False, True], ids=["full_kv", "window_kv"])
def test_chunked_prefill_never_ends_a_chunk_inside_an_image(gemma, window_kv):
    llm, hf, processor = gemma
    convs = [chat("First", draw(70, 40, 1), "then", draw(33, 97, 3)), chat(draw(64, 64, 4), "What?"),
             chat("Hello, who are you? Tell me a story about it.")]
    prompts = [llm.encode_multimodal_chat(m) for m in convs]
    engine = engine_for(llm, window_kv=window_kv, max_num_batched_tokens=10, enable_chunked_prefill=True,
                        enable_prefix_caching=False)
    chunks = _record_chunks(engine)
    got, _ = run(engine, prompts)
    assert got == [hf_generate(hf, processor, m, N) for m in convs]
    for rid, start, end in chunks:
        for a, b in image_blocks(prompts[int(rid)].images):
            assert not a < end < b and not a < start < b, (rid, start, end, a, b)
    # an image's 16 tokens are one chunk over the budget of 10, which runs as its step's first prefill
    assert any(end - start == 16 for _, start, end in chunks)
    assert engine.encoder_cache.num_encoded == sum(len(p.images) for p in prompts)


def test_preempted_requests_prefill_their_images_again_whole(gemma):
    llm, hf, processor = gemma
    convs = [chat(f"Question {i}: what is in it? Name every shape, colour and line " * 3,
                  draw(70 - 9 * i, 40 + 5 * i, i), "Answer:") for i in range(4)]
    prompts = [llm.encode_multimodal_chat(m) for m in convs]
    assert 4 * -(-(len(prompts[0].token_ids) + N) // BS) > 32  # more than the smallest pool (one 256-token sequence)
    engine = engine_for(llm, num_blocks=33, max_num_batched_tokens=40,
                        enable_chunked_prefill=True, enable_prefix_caching=False)
    chunks = _record_chunks(engine)
    got, _ = run(engine, prompts)
    assert got == [hf_generate(hf, processor, m, N) for m in convs]
    assert engine.stats.preemptions > 0 and engine.encoder_cache.num_encoded == len(prompts)
    for rid, _, end in chunks:
        assert not any(a < end < b for a, b in image_blocks(prompts[int(rid)].images))


@pytest.mark.parametrize("window_kv", [False, True], ids=["full_kv", "window_kv"])
def test_prefix_cache_hits_only_for_the_same_image_and_may_end_inside_it(gemma, window_kv):
    """Request 1 has request 0's text and image, then other text in the block the image ends in: its hit ends at
    that block's start, inside the image (K/V there were computed with the whole image in view, as request 1 would
    compute them), and its first chunk holds the rest of the image. Request 2 has another image: no block of it
    hits."""
    llm, hf, processor = gemma
    x, y = draw(70, 40, 1), draw(70, 40, 12)
    for k in range(BS):  # a text length that puts the image's end early in a block
        text = "Describe the picture in one short sentence, please, and name its main colours." + " ok" * k
        prompt = llm.encode_multimodal_chat(chat(text, x, "Answer:"))
        first, last = prompt.images[0].positions[0], prompt.images[0].positions[-1]
        if last % BS <= 2:
            break
    convs = [chat(text, x, "Answer:"), chat(text, x, "Reply in French:"), chat(text, y, "Answer:")]
    prompts = [llm.encode_multimodal_chat(m) for m in convs]
    assert prompts[1].token_ids[:last + 3] == prompts[0].token_ids[:last + 3] != prompts[1].token_ids[:last + 5]
    engine = engine_for(llm, window_kv=window_kv, enable_prefix_caching=True, max_num_batched_tokens=12,
                        enable_chunked_prefill=True)
    chunks = _record_chunks(engine)
    got, cached = run(engine, prompts, stagger=True)
    assert got == [hf_generate(hf, processor, m, N) for m in convs]
    assert cached["0"] == 0
    assert cached["1"] == last // BS * BS and first < cached["1"] <= last  # a hit that ends inside the image
    assert any(c[0] == "1" and c[1] == cached["1"] and c[2] > last for c in chunks)
    assert 0 < cached["2"] <= first  # another image: nothing from it on
    assert engine.encoder_cache.num_encoded == 3  # x twice (request 1 needs the image's last rows), y once


def test_an_image_longer_than_the_largest_prefill_chunk_is_refused(gemma):
    llm, _, _ = gemma
    engine = engine_for(llm, max_prompt_len=8, enable_chunked_prefill=True)
    prompt = llm.encode_multimodal_chat(chat(draw(40, 40, 1), "Hi"))
    with pytest.raises(ConfigError, match="an image of 16 tokens attends to itself bidirectionally"):
        engine.add_request("0", prompt.token_ids, GREEDY, lambda o: None, images=prompt.images)


def test_image_blocks_last_keys_and_chunks_that_fit_them():
    t = {"pixel_values": torch.ones(1)}
    images = [ImageItem((3, 4, 5), t), ImageItem((9, 10, 11, 12), t), ImageItem((13, 20), t)]
    blocks = image_blocks(images)
    assert blocks == ((3, 6), (9, 14), (20, 21))  # adjacent runs of two images are one block, as HF groups them
    assert last_keys(blocks, 2, 6).tolist() == [2, 5, 5, 5, 6, 7]
    assert last_keys(blocks, 10, 2).tolist() == [13, 13]
    sched = Scheduler(2, KVConfig(num_blocks=16, block_size=4, max_model_len=64, max_prefill_len=16,
                                  enable_prefix_caching=False), max_num_batched_tokens=8)
    req = Request("a", list(range(24)), 4, atomic_spans=blocks)
    sched.add(req)
    ends = []
    while req.num_computed_tokens < req.num_prompt_tokens:
        (p,) = sched.schedule().prefills
        ends.append(p.start + len(p.token_ids))
        if not p.last:
            sched.update_prefill("a", len(p.token_ids))
        else:
            break
    assert ends == [8, 16, 24]  # 8 ends outside the blocks; 16 too (the block 9..13 fits)
    sched = Scheduler(2, KVConfig(num_blocks=16, block_size=4, max_model_len=64, max_prefill_len=16,
                                  enable_prefix_caching=False), max_num_batched_tokens=8)
    req = Request("b", list(range(24)), 4, atomic_spans=((6, 15),))
    sched.add(req)
    (p,) = sched.schedule().prefills
    assert (p.start, len(p.token_ids)) == (0, 6)  # cut before the block it would end inside
    assert Scheduler._fit_spans(req, 8, 4) == 7  # starting inside it (a prefix hit): grown to its end


def test_encoder_equals_transformers():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from models.gemma3 import Gemma3Vision, VisionConfig, text_key, vision_key

    cfg = Gemma3Config(text_config=dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=32, patch_size=4, vision_use_head=False),
                       mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_()
        hf.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_()
    ours = Gemma3Vision(VisionConfig.from_hf(cfg))
    v5 = {k.removeprefix("model."): v for k, v in hf.state_dict().items()
          if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}  # transformers 5's names

    def deep(k: str) -> str:
        return k.replace("vision_tower.", "vision_tower.vision_model.")

    for stored in (v5, {deep(k): v for k, v in v5.items()}, {"model." + deep(k): v for k, v in v5.items()}):
        ours.load_state_dict({vision_key(k): v for k, v in stored.items()})  # 5's, the released, 4.5x's layouts
    for prefix in ("language_model.model.", "model.language_model."):
        assert text_key(prefix + "layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_key("language_model.lm_head.weight") == text_key("lm_head.weight") == "lm_head.weight"
    pixels = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        want = hf.model.get_image_features(pixels).pooler_output
        got = ours(pixels)
    torch.testing.assert_close(got, want.reshape(-1, 64), rtol=1e-5, atol=1e-5)


def test_pan_and_scan_crops_are_images_of_their_own(gemma):
    """With pan-and-scan on (a processor argument, passed through the chat template's call), the processor adds an
    image's crops as further soft-token runs: each is an image item and a bidirectional block of its own."""
    llm, hf, processor = gemma
    pas = {"processor_kwargs": {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}}
    messages = chat("Compare", draw(70, 40, 1), "with", draw(33, 97, 3), "and", draw(40, 40, 4))
    prompt = llm.encode_multimodal_chat(messages, template_kwargs=pas)
    assert len(prompt.images) == 3 + 2 + 3  # the wide image and 2 crops, the tall one and 3 crops, the square one
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt", **pas)
    assert inputs["input_ids"][0].tolist() == prompt.token_ids
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    assert llm.generate_batch([prompt], GREEDY)[0].token_ids == out[0, len(prompt.token_ids):].tolist()
