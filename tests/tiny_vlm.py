"""Tiny random vision-language checkpoints built with transformers (model, processor with its chat template, the
default model's tokenizer with the family's image tokens added), and PIL-drawn test images (Idefics3's and `draw`:
neuron_opt.bench.tiny_vlm, which the image serving benchmark shares)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from neuron_opt.bench.tiny_vlm import SMOLVLM_TEMPLATE
from neuron_opt.bench.tiny_vlm import draw as draw  # re-exported: the tests' images
from neuron_opt.bench.tiny_vlm import idefics3_sizes as _idefics3_sizes
from neuron_opt.bench.tiny_vlm import idefics3_tokenizer as _idefics3_tokenizer
from neuron_opt.bench.tiny_vlm import make_idefics3 as make_idefics3  # re-exported: the tests' Idefics3
from neuron_opt.bench.tiny_vlm import randomize as _randomize
from neuron_opt.multimodal.vision import images_only
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.sampling import SamplingParams

N = 8  # tokens generated per request
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, ignore_eos=True)


def hf_generate(model: Any, processor: Any, messages: list[dict[str, Any]], n: int) -> list[int]:
    """HF's greedy tokens for a conversation: exactly `n` (EOS not stopping)."""
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_qwen2_5_vl(out: Path, seed: int = 0) -> Path:
    """A Qwen2.5-VL checkpoint: a 2-block ViT over 4-pixel patches (merged 2 x 2; windows of 16 pixels, the second
    block full attention), a 2-layer Qwen2 decoder with M-RoPE sections (2, 3, 3); images resized to between 8 x 8
    and 64 x 64 pixels in multiples of 8. Its processor is saved without a video processor (transformers makes
    one only with torchvision), as vision.images_only builds it."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
    )

    from neuron_opt.checkpoint import open_checkpoint

    tok = open_checkpoint("default").tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>"]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>")}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                           out_hidden_size=64),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"])
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    _randomize(model)
    with torch.no_grad():  # image rows large enough that the greedy text depends on the image
        model.model.visual.merger.mlp[2].weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    ip = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                  max_pixels=64 * 64)
    processor = images_only(Qwen2_5_VLProcessor)(image_processor=ip, tokenizer=tok, chat_template=QWEN_TEMPLATE)
    processor.save_pretrained(out)
    _video_config(out, "Qwen2VLVideoProcessor", patch_size=4, merge_size=2, temporal_patch_size=2)
    return out


def make_qwen3_vl(out: Path, seed: int = 0, moe: bool = False) -> Path:
    """A Qwen3-VL checkpoint: a 3-block ViT over 4-pixel patches (merged 2 x 2) with a learned 4 x 4 position grid
    and deepstack mergers after blocks 0 and 1 (added after decoder layers 0 and 1), a 3-layer Qwen3 decoder (q/k
    norm) with interleaved M-RoPE sections (2, 3, 3); images resized as make_qwen2_5_vl's. The processor is saved
    without a video processor, as for make_qwen2_5_vl. `moe`: Qwen3-VL-MoE, every decoder MLP 4 experts of width 16
    (top 2), stored stacked inputs first as the published checkpoints store them (transformers' save_pretrained
    writes them outputs first)."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    from neuron_opt.checkpoint import open_checkpoint

    tok = open_checkpoint("default").tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>"]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                     "<|vision_end|>")}
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if moe else {}
    family = "Qwen3VLMoe" if moe else "Qwen3VL"
    cfg = getattr(transformers, f"{family}Config")(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **experts),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(cfg).eval()
    _randomize(model)
    with torch.no_grad():  # image rows (and the deepstack rows) large enough that the greedy text depends on them
        for merger in (model.model.visual.merger, *model.model.visual.deepstack_merger_list):
            merger.linear_fc2.weight.normal_(0.0, 0.5)
        for name, p in model.named_parameters():
            if "experts" in name or "mlp.gate." in name:  # HF leaves the stacked experts and the router at zeros
                p.normal_(0.0, 0.1 if "experts" in name else 0.5)
    model.save_pretrained(out)
    if moe:
        for f in out.glob("*.safetensors"):
            sd = load_file(f)
            save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in sd.items()}, f,
                      metadata={"format": "pt"})
    ip = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                  max_pixels=64 * 64)
    processor = images_only(Qwen3VLProcessor)(image_processor=ip, tokenizer=tok, chat_template=QWEN_TEMPLATE)
    processor.save_pretrained(out)
    _video_config(out, "Qwen3VLVideoProcessor", patch_size=4, merge_size=2, temporal_patch_size=2)
    return out


def _video_config(out: Path, video_processor_type: str, **fields: Any) -> None:
    """The video processor's settings as the family's checkpoints ship them (video_preprocessor_config.json):
    transformers' AutoProcessor reads them and then needs torchvision for the class they name."""
    import json

    (out / "video_preprocessor_config.json").write_text(json.dumps({"video_processor_type": video_processor_type,
                                                                    **fields}, indent=2))


def make_smolvlm(out: Path, seed: int = 0) -> Path:
    """A SmolVLM checkpoint: make_idefics3's shapes under SmolVLM's config and processor (its image-token layout);
    the processor is saved without a video processor, as for make_qwen2_5_vl."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil, SmolVLMProcessor

    tok = _idefics3_tokenizer()
    cfg = SmolVLMConfig(**_idefics3_sizes(tok))
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(cfg).eval()
    _randomize(model)
    with torch.no_grad():
        model.model.connector.modality_projection.proj.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    ip = SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    images_only(SmolVLMProcessor)(image_processor=ip, tokenizer=tok, video_processor=None, image_seq_len=4,
                                  chat_template=SMOLVLM_TEMPLATE).save_pretrained(out)
    _video_config(out, "SmolVLMVideoProcessor", size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    return out


GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else "
    "message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def make_gemma3(out: Path, seed: int = 0) -> Path:
    """A Gemma 3 checkpoint: a 2-layer SigLIP encoder over 32-pixel images of 4-pixel patches (8 x 8 patches,
    average-pooled 2 x 2 to 16 soft tokens), a 3-layer Gemma 3 decoder whose first two layers slide over a window of
    8 positions (shorter than an image) and whose last attends globally; the processor resizes every image to 32 x
    32 (pan-and-scan crops are 32 x 32 images too: `pan_and_scan_min_crop_size` 8)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    from neuron_opt.checkpoint import open_checkpoint

    tok = open_checkpoint("default").tokenizer()
    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok.add_special_tokens({"additional_special_tokens": [*named.values(), "<start_of_turn>", "<end_of_turn>"]})
    tok._set_model_specific_special_tokens(named)  # what Gemma 3's tokenizer_config.json names them
    cfg = Gemma3Config(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                         max_position_embeddings=2048, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=4, vision_use_head=False),
        mm_tokens_per_image=16, boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    _randomize(model)
    with torch.no_grad():  # the projection starts at zeros: image rows large enough that the text depends on them
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    model.save_pretrained(out)
    ip = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, pan_and_scan_min_crop_size=8)
    Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=GEMMA3_TEMPLATE,
                    image_seq_length=16).save_pretrained(out)
    return out


def chat(*parts) -> list[dict]:
    """One user message of text and image parts (PIL images as HF's {"type": "image"} parts)."""
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else
                                         {"type": "image", "image": p} for p in parts]}]


def run(engine: Engine, prompts, stagger: bool = False) -> tuple[list[list[int]], dict[str, int]]:
    """Every prompt (a MultimodalPrompt) through `engine`; each one's tokens and cached prompt tokens. `stagger`:
    each request is added after the one before it has finished."""
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def on(o):
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            cached[o.request_id] = o.num_cached_tokens

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p.token_ids, GREEDY, on, images=p.images, rope_positions=p.rope_positions)
        while stagger and engine.step():
            pass
    while engine.step():
        pass
    assert engine.num_unfinished == 0 and engine.kv_usage == 0
    return [got[str(i)] for i in range(len(prompts))], cached
