"""Random Idefics3 (SmolVLM's architecture) checkpoints written with transformers, for a benchmark or a test that
needs a vision-language model without the Hub, and PIL-drawn images.

The tokenizer is the default model's (SmolLM2's, embedded in the package) with Idefics3's image tokens added; the
processor is transformers' Idefics3Processor with SmolVLM's chat template. Two shapes (`SHAPES`):
- `tiny`: a 2-layer SigLIP-style encoder over 32-pixel tiles of 8-pixel patches (4 tokens per tile after the pixel
  shuffle), a 2-layer Llama decoder of width 64; images resized to a longest edge of 64, so larger ones are split
  into up to 2 x 2 tiles and a global one. The tests' model: milliseconds per request.
- `256m`: SmolVLM-256M's shapes (a 12-layer, 768-wide SigLIP-B/16 encoder over 512-pixel tiles, 64 tokens per
  tile after the 4 x 4 pixel shuffle; SmolLM2-135M's 30-layer, 576-wide decoder), every image one 512-pixel tile.
  A benchmark's model with a real model's cost per image and per token (random weights: the text is noise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# SmolVLM's chat template, as its checkpoints ship it
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

# text decoder, vision encoder, and the processor's tile sizes (pixels): longest edge after resizing, tile edge
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=32, patch_size=8),
        scale_factor=2, longest_edge=64, tile=32),
    "256m": dict(
        text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0),
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=512, patch_size=16),
        scale_factor=4, longest_edge=512, tile=512),
}


def randomize(model: torch.nn.Module) -> None:
    """HF initialises norms to ones and biases to zeros: randomise them so an oracle comparison sees them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)


def idefics3_tokenizer() -> Any:
    """The default model's tokenizer with Idefics3's image tokens (SmolVLM uses the same)."""
    from neuron_opt.checkpoint import open_checkpoint

    tok = open_checkpoint("default").tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>",
                                                          "<end_of_utterance>"]})
    return tok


def idefics3_sizes(tok: Any, shape: str = "tiny") -> dict[str, Any]:
    """Idefics3's and SmolVLM's config fields for `shape` (a key of SHAPES): a Llama decoder, a SigLIP encoder."""
    s = SHAPES[shape]
    return dict(
        text_config=dict(model_type="llama", vocab_size=len(tok), **s["text"], tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(s["vision"]),
        scale_factor=s["scale_factor"], image_token_id=tok.convert_tokens_to_ids("<image>"))


def image_seq_len(shape: str) -> int:
    """Placeholder tokens per tile: the tile's patches after the pixel shuffle."""
    v = SHAPES[shape]["vision"]
    return (v["image_size"] // v["patch_size"]) ** 2 // SHAPES[shape]["scale_factor"] ** 2


def make_idefics3(out: Path, seed: int = 0, shape: str = "tiny") -> Path:
    """An Idefics3 checkpoint of `shape` (SHAPES) with random weights (seed `seed`) and its processor, written to
    `out`; the connector's weights drawn large enough that the greedy text depends on the image."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    if shape not in SHAPES:
        raise ValueError(f"shape: one of {', '.join(SHAPES)}, got {shape!r}")
    tok = idefics3_tokenizer()
    cfg = Idefics3Config(**idefics3_sizes(tok, shape))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    randomize(model)
    with torch.no_grad():  # image rows as large as token rows' logits effect: the greedy text depends on the image
        model.model.connector.modality_projection.proj.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    ip = Idefics3ImageProcessorPil(size={"longest_edge": SHAPES[shape]["longest_edge"]},
                                   max_image_size={"longest_edge": SHAPES[shape]["tile"]})
    Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=image_seq_len(shape),
                      chat_template=SMOLVLM_TEMPLATE).save_pretrained(out)
    return Path(out)


def draw(w: int, h: int, seed: int) -> Any:
    """An RGB image of w x h pixels with a few shapes, different per seed."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    colors = [tuple(int(c) for c in torch.randint(0, 256, (3,), generator=g)) for _ in range(4)]
    img = Image.new("RGB", (w, h), colors[0])
    d = ImageDraw.Draw(img)
    d.ellipse((w // 8, h // 8, w // 2, h // 2), fill=colors[1])
    d.rectangle((w // 2, h // 3, w - 2, h - 2), fill=colors[2])
    d.line((0, h - 1, w - 1, 0), fill=colors[3], width=max(1, min(w, h) // 10))
    return img
