"""Vision-language models (Idefics3 / SmolVLM) on the eager backend: images merged at their placeholder tokens, the
encoder cache, prefix-cache keys over image content.

Oracle: HF transformers' `generate` (greedy, fp32) on the same processor outputs, with a tiny random checkpoint
built in the test (tests/tiny_vlm.py) and PIL-drawn images of several sizes and aspect ratios, so the processor
takes its different paths (one tile, 2 x 1, 1 x 2 and 2 x 2 tiles plus the global one, padded tiles).
"""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import GREEDY, N, chat, draw, hf_generate, make_idefics3, make_smolvlm, run

from neuron_opt.api import LLM
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.errors import ConfigError
from neuron_opt.multimodal.encoder_cache import EncoderCache
from neuron_opt.multimodal.inputs import ImageItem, cache_token_ids
from neuron_opt.multimodal.vision import hf_config, load_processor
from neuron_opt.runtime.engine import Engine, encode_multimodal_chat
from neuron_opt.runtime.runner import ModelRunner

MAX_LEN, BS = 512, 8


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = make_idefics3(tmp_path_factory.mktemp("idefics3"))
    llm = LLM(path, batch_size=4, max_model_len=MAX_LEN)
    hf = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    yield llm, hf, processor
    torch.set_num_threads(threads)



def engine_for(llm: LLM, num_blocks: int = 0, **kw) -> Engine:
    """An engine over the loaded model's weights with its own block pool and buckets (prefill up to 64 tokens a
    call, so longer prompts run in chunks)."""
    cache = CacheConfig(max_batch=4, max_model_len=128, block_size=BS, num_blocks=num_blocks)
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=128, max_batch=4, min_prefill=16,
                                 min_decode=16)
    runner = ModelRunner(EagerExecutor(llm.runner.executor.model, cache), buckets, cache, llm.config.vocab_size,
                         llm.config, llm.runner.vision)
    return Engine(runner, llm.tokenizer, llm.eos_token_ids, **kw)


IMAGES = [(70, 40, 1), (20, 30, 2), (33, 97, 3), (64, 64, 4)]  # wide (2 x 2 tiles), small, tall, square


def test_images_in_one_prompt_give_hf_greedy_text(vlm):
    llm, hf, processor = vlm
    a, b, c, _ = (draw(*s) for s in IMAGES)
    for messages in (chat(a, "What is in the picture?"), chat("Compare", b, "with", c, "and", a)):
        prompt = llm.encode_multimodal_chat(messages)
        assert len(prompt.images) == len(messages[0]["content"]) - sum(isinstance(p.get("text"), str)
                                                                       for p in messages[0]["content"])
        assert llm.chat(messages, GREEDY).token_ids == hf_generate(hf, processor, messages, N)
    other = llm.chat(chat("Compare", b, "with", c, "and", draw(70, 40, 9)), GREEDY).token_ids
    assert other != hf_generate(hf, processor, chat("Compare", b, "with", c, "and", a), N)  # the image matters


def test_image_and_text_requests_batch_with_their_own_outputs(vlm):
    llm, hf, processor = vlm
    # a string content is one text part (the processor's chat template iterates over parts)
    convs = [chat(draw(*IMAGES[3]), "Describe it."), [{"role": "user", "content": "Hello, who are you?"}],
             chat("Two:", draw(*IMAGES[0]), draw(*IMAGES[2]))]
    outs = llm.generate_batch([llm.encode_multimodal_chat(m) for m in convs], GREEDY)
    convs[1] = chat("Hello, who are you?")
    assert [o.token_ids for o in outs] == [hf_generate(hf, processor, m, N) for m in convs]


def test_chunked_prefill_splits_images_and_encodes_each_once(vlm):
    llm, hf, processor = vlm
    convs = [chat("First", draw(*IMAGES[0]), "then", draw(*IMAGES[2])), chat(draw(*IMAGES[3]), "What?")]
    prompts = [llm.encode_multimodal_chat(m) for m in convs]
    engine = engine_for(llm, max_num_batched_tokens=13, enable_chunked_prefill=True, enable_prefix_caching=False)
    got, _ = run(engine, prompts)
    assert got == [hf_generate(hf, processor, m, N) for m in convs]
    # chunks of at most 13 tokens: the 2 x 2 image's 20 placeholder tokens were split over several chunks
    assert any(len(im.positions) > 13 for p in prompts for im in p.images)
    assert engine.encoder_cache.num_encoded == sum(len(p.images) for p in prompts)
    assert not engine.encoder_cache.entries  # released with their requests


def test_preempted_requests_keep_their_images_encoded(vlm):
    llm, hf, processor = vlm
    convs = [chat(draw(*IMAGES[i]), f"Question {i}?") for i in range(4)]
    prompts = [llm.encode_multimodal_chat(m) for m in convs]
    longest = max(len(p.token_ids) for p in prompts) + N
    engine = engine_for(llm, num_blocks=1 + 3 * -(-longest // BS), enable_prefix_caching=False)
    got, _ = run(engine, prompts)
    assert got == [hf_generate(hf, processor, m, N) for m in convs]
    assert engine.stats.preemptions > 0
    assert engine.encoder_cache.num_encoded == len(prompts)


def test_prefix_cache_hits_only_for_the_same_image(vlm):
    llm, hf, processor = vlm
    text = "Describe the picture in one short sentence, please, and name its main colours. " * 2
    x, y = draw(*IMAGES[0]), draw(70, 40, 11)  # same size and tiling: the same token ids
    convs = [chat(text, x, "Answer:"), chat(text, x, "Answer:"), chat(text, y, "Answer:")]
    prompts = [llm.encode_multimodal_chat(m) for m in convs]
    assert prompts[0].token_ids == prompts[2].token_ids
    engine = engine_for(llm, enable_prefix_caching=True)
    got, cached = run(engine, prompts, stagger=True)
    assert got == [hf_generate(hf, processor, m, N) for m in convs]
    first_image = prompts[0].images[0].positions[0]
    assert cached["0"] == 0
    assert cached["1"] > prompts[1].images[0].positions[-1]  # the same image: its blocks hit
    assert 0 < cached["2"] <= first_image  # the text before it hits, nothing from the image on
    assert engine.encoder_cache.num_encoded == 2  # x for request 0 (request 1 took it from the prefix cache), y


def test_prefix_cache_keys_carry_the_image_content():
    t = {"pixel_values": torch.ones(1, 3, 4, 4)}
    a, b = ImageItem((2, 3, 4), t), ImageItem((2, 3, 4), {"pixel_values": torch.zeros(1, 3, 4, 4)})
    ids = [5, 6, 7, 7, 7, 8]
    ka, kb = cache_token_ids(ids, [a]), cache_token_ids(ids, [b])
    assert ka[:2] == kb[:2] == ids[:2] and ka[5:] == kb[5:] == [8]
    assert all(k < 0 for k in ka[2:5]) and ka[2:5] != kb[2:5]
    assert ka == cache_token_ids(ids, [ImageItem((2, 3, 4), {"pixel_values": torch.ones(1, 3, 4, 4)})])


def test_encoder_cache_shares_an_image_until_its_last_request_ends():
    calls = []
    cache = EncoderCache(lambda item: calls.append(item) or torch.ones(len(item.positions), 2))
    img = ImageItem((1, 2), {"x": torch.ones(1)})
    assert cache.chunk_embeds("a", [img], 0, 2)[0].tolist() == [1]  # only position 1 lies in [0, 2)
    cache.chunk_embeds("a", [img], 2, 4)
    cache.chunk_embeds("b", [img], 0, 4)
    assert len(calls) == 1 and cache.chunk_embeds("a", [img], 3, 4) is None
    cache.release("a", [img])
    assert cache.entries
    cache.release("b", [img])
    assert not cache.entries and not cache.users


def test_images_are_refused_by_a_text_model(tiny_dir):
    text = LLM(tiny_dir("smollm-tok"), max_model_len=64)
    with pytest.raises(ConfigError, match=r"messages\[0\]\.content\[1\]: model .* does not accept images"):
        text.chat(chat("look", draw(8, 8, 0)))
    with pytest.raises(ConfigError, match=r"messages\[0\]\.content\[1\]: this model takes text only"):
        encode_multimodal_chat(text.tokenizer, None, chat("look", draw(8, 8, 0)))
    with pytest.raises(ConfigError, match="PIL"):
        encode_multimodal_chat(text.tokenizer, None, [{"role": "user", "content": [{"type": "image", "image": 1}]}])
    assert text.loaded.modalities == ("text",)


def test_a_vlm_says_it_takes_images_and_refuses_typed_image_tokens(vlm):
    llm, _, _ = vlm
    assert llm.loaded.modalities == ("text", "image")
    for parts in (("hi <image> there",), (draw(40, 40, 1), "hi <image> there")):
        with pytest.raises(ConfigError, match="messages: the model's processor refused them"):
            llm.encode_multimodal_chat(chat(*parts))


@pytest.mark.parametrize("arch", ["Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"])
def test_encoder_equals_transformers_on_padded_tiles(arch):
    """The encoder and connector against transformers' own on tiles the processor padded (part of each pixel mask
    off: variable-resolution positions, masked keys); SmolVLM's vision side is Idefics3's (its processor needs
    torchvision for its video processor; test_smolvlm_loads_from_disk_... runs it end to end)."""
    import transformers

    from models.idefics3 import Idefics3Vision, VisionConfig

    cfg = getattr(transformers, arch.replace("ForConditionalGeneration", "Config"))(
        text_config=dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8), scale_factor=2)
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(cfg).eval()
    ours = Idefics3Vision(VisionConfig.from_hf(cfg))
    sd = {k[len("model."):]: v for k, v in hf.state_dict().items()
          if k.startswith(("model.vision_model.", "model.connector."))}
    ours.load_state_dict(sd)
    pixels = torch.randn(3, 3, 32, 32)
    mask = torch.ones(3, 32, 32, dtype=torch.long)
    mask[1, :, 20:] = 0  # a tile 20 pixels wide: 3 of 4 patch columns real
    mask[2, 9:, :] = 0  # 9 pixels high: 2 patch rows
    with torch.inference_mode():
        want = hf.model.get_image_features(pixels[None], mask[None]).pooler_output[0]
        got = ours(pixels, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_openai_client_sends_a_base64_image_and_gets_llm_chat_text(vlm):
    """`serve`'s path: the official client's `image_url` part (a base64 PNG data URL), decoded and checked by
    server/media.py, rendered by the engine's processor (server/media.image_renderer); the reply is `LLM.chat`'s on
    the same image, and HF's greedy tokens."""
    import base64
    import io

    import openai
    from helpers import live_server
    from PIL import Image

    from neuron_opt.runtime.sampling import SamplingParams

    llm, hf, processor = vlm
    buf = io.BytesIO()
    draw(70, 40, 1).save(buf, format="PNG")
    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")  # what the server decodes
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    want = llm.chat(chat(image, "What is in the picture?"), SamplingParams(max_tokens=N, min_tokens=N,
                                                                          temperature=0.0))
    assert want.token_ids == hf_generate(hf, processor, chat(image, "What is in the picture?"), N)
    with live_server(llm, max_num_seqs=2, model="vlm") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        assert client.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]
        out = client.chat.completions.create(model="vlm", max_tokens=N, temperature=0, extra_body={
            "min_tokens": N}, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in the picture?"}]}])
    assert out.choices[0].message.content == want.text and out.usage.completion_tokens == N


def test_smolvlm_loads_from_disk_without_torchvision_and_gives_hf_greedy_text(tmp_path, caplog):
    """SmolVLM through `LLM(path)`. transformers builds SmolVLM's processor only with its video processor, which
    needs torchvision: where that is missing the loader builds SmolVLMProcessor from the checkpoint's image
    processor and tokenizer without it and says so at INFO; HF's AutoProcessor cannot load it either, so the
    oracle takes the same processor (transformers' classes: the preprocessing is theirs either way)."""
    import logging

    from transformers import SmolVLMForConditionalGeneration
    from transformers.utils import is_torchvision_available

    path = make_smolvlm(tmp_path / "smolvlm")
    with caplog.at_level(logging.INFO, logger="neuron_opt.multimodal.vision"):
        llm = LLM(path, batch_size=2, max_model_len=MAX_LEN)
    hf = SmolVLMForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = load_processor(path, hf.config)
    if not is_torchvision_available():
        assert not hasattr(llm.runner.vision.processor, "video_processor")
        assert "SmolVLMProcessor built without its video processor" in caplog.text
        with pytest.raises(ConfigError, match="video parts are not served"):
            llm.encode_multimodal_chat([{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}])
    for messages in (chat(draw(70, 40, 1), "What is in the picture?"), chat("Compare", draw(20, 30, 2), "and",
                                                                          draw(33, 97, 3))):
        assert llm.chat(messages, GREEDY).token_ids == hf_generate(hf, processor, messages, N)


def test_a_processor_failure_other_than_torchvision_propagates(tmp_path):
    """Only AutoProcessor's torchvision failure falls back: a checkpoint without its tokenizer files is refused."""
    import shutil

    src = make_smolvlm(tmp_path / "full")
    (tmp_path / "part").mkdir()
    for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, tmp_path / "part" / name)
    with pytest.raises(ValueError, match="tokenizer"):
        load_processor(tmp_path / "part", hf_config(tmp_path / "part"))
