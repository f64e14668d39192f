"""A prompt with images, as the engine takes it: token ids and, per image, its placeholder positions, its encoder
inputs and its content hash. `processor_chat` renders HF-format chat messages (content parts
{"type": "image", "image": PIL.Image} and {"type": "text", "text": ...}) through the model's own processor
(transformers AutoProcessor: resizing, tiling, normalisation and the placeholder expansion are never ours).

Design decisions
- An image's content hash is sha256 over its encoder inputs as the processor made them (each tensor's name,
  dtype, shape and bytes): two images the model sees identically share it, and any pixel that differs changes it.
- Prefix-cache keys (`cache_token_ids`): the prompt's token ids with each image's placeholder positions replaced
  by negative numbers drawn from its content hash (the hash's four 64-bit words in turn, each shifted below zero:
  never a token id). The block hash chain (runtime/block_manager.py) then covers the image's content at every
  block that holds its tokens, and every block after them: the same text with another image never hits.
- Bidirectional image blocks (a decoder that attends among an image's tokens in both directions: Gemma 3): the
  blocks are the runs of consecutive placeholder positions over all of a prompt's images (`image_blocks`), as
  transformers groups its token_type_ids; a query in a block sees every key of its block (`last_keys`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from neuron_opt.errors import ConfigError


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt (or a crop of one that its processor adds as an image of its own: Gemma 3's
    pan-and-scan): its placeholder positions (prompt indices, ascending: the rows its embeddings fill,
    in order), what its vision encoder takes (tensors for this image alone) and its content hash."""

    positions: tuple[int, ...]
    encoder_inputs: dict[str, torch.Tensor] = field(compare=False)
    content_hash: bytes = b""

    def __post_init__(self) -> None:
        if not self.positions or list(self.positions) != sorted(set(self.positions)) or self.positions[0] < 0:
            raise ConfigError("images: an image's placeholder positions must be distinct, ascending and >= 0",
                              param="messages")
        if not self.content_hash:
            object.__setattr__(self, "content_hash", content_hash(self.encoder_inputs))


@dataclass(frozen=True)
class MultimodalPrompt:
    """A rendered conversation: its token ids and its images (in prompt order; () for a text-only prompt).
    `rope_positions`: for a model with 3-D rotary positions (M-RoPE), the prompt's [3, len(token_ids)] positions
    and the delta later tokens rotate by (at position + delta on every axis); None otherwise."""

    token_ids: list[int]
    images: tuple[ImageItem, ...] = ()
    rope_positions: tuple[torch.Tensor, int] | None = None


def content_hash(tensors: dict[str, torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def cache_token_ids(token_ids: Sequence[int], images: Sequence[ImageItem]) -> list[int]:
    """The prompt as prefix-cache keys see it (module docstring)."""
    out = list(token_ids)
    for img in images:
        words = [int.from_bytes(img.content_hash[i:i + 8], "little") >> 1 for i in range(0, 32, 8)]
        for j, p in enumerate(img.positions):
            out[p] = -1 - words[j % 4]
    return out


def image_blocks(images: Sequence[ImageItem]) -> tuple[tuple[int, int], ...]:
    """The runs of consecutive placeholder positions over `images`, as [start, end) ranges in prompt order."""
    blocks: list[list[int]] = []
    for p in sorted(p for img in images for p in img.positions):
        if blocks and blocks[-1][1] == p:
            blocks[-1][1] = p + 1
        else:
            blocks.append([p, p + 1])
    return tuple((a, b) for a, b in blocks)


def last_keys(blocks: Sequence[tuple[int, int]], start: int, count: int) -> torch.Tensor:
    """The last key position each of the tokens at [start, start + count) attends to [count] (int64): its own,
    or for a token inside a bidirectional image block [a, b), the block's last (b - 1)."""
    out = torch.arange(start, start + count)
    for a, b in blocks:
        if a < start + count and b > start:
            out[max(a, start) - start:min(b, start + count) - start] = b - 1
    return out


def check_images(images: Sequence[ImageItem], num_tokens: int) -> None:
    """ConfigError unless every image's positions lie inside the prompt and no two images share one."""
    seen: set[int] = set()
    for i, img in enumerate(images):
        if img.positions[-1] >= num_tokens:
            raise ConfigError(f"images[{i}]: placeholder position {img.positions[-1]} is past the prompt's "
                              f"{num_tokens} tokens", param="messages")
        if seen & set(img.positions):
            raise ConfigError(f"images[{i}]: its placeholder positions overlap another image's", param="messages")
        seen |= set(img.positions)


def image_parts(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Every image content part of `messages` as (its field path, the PIL image); ConfigError for an image part
    that holds no PIL image."""
    from PIL import Image  # pillow comes with transformers' image processors; only image prompts need it

    found = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image":
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part.get("image"), Image.Image):
                    raise ConfigError(f"{where}.image: an image content part holds a PIL.Image.Image, got "
                                      f"{type(part.get('image')).__name__}", param=f"{where}.image")
                found.append((where, part["image"]))
    return found


def _as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose string content becomes one text part: processors' chat templates iterate over parts."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


def processor_chat(vision: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> MultimodalPrompt:
    """A conversation rendered for a vision-language model (`vision`: its multimodal.vision.VisionModel) through its
    processor's chat template, each image preprocessed by the processor and split per image. Text models render
    through their tokenizer (runtime.engine.encode_multimodal_chat picks).

    Args:
        messages: HF-format chat messages; content a string or a list of {"type": "text", "text": str} and
            {"type": "image", "image": PIL.Image.Image} parts.
        tools, template_kwargs: as `runtime.engine.encode_chat`.
    """
    parts = image_parts(messages)
    kw: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        kw["tools"] = tools
    try:
        out = vision.processor.apply_chat_template(_as_parts(messages), add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt", **kw)
    except ValueError as e:  # the processor's own checks: image tokens typed in the text, sizes it refuses
        raise ConfigError(f"messages: the model's processor refused them: {str(e)[:300]}", param="messages") from None
    ids = [int(t) for t in out["input_ids"][0]]
    images = tuple(ImageItem(pos, inputs) for pos, inputs in vision.split(dict(out), ids)) if parts else ()
    if len(images) < len(parts):  # more: crops the processor added as images of their own (Gemma 3's pan-and-scan)
        raise ConfigError(f"messages: {len(parts)} image parts, but the rendered prompt holds {len(images)} images "
                          "(does the chat template render image parts?)", param="messages")
    return MultimodalPrompt(ids, images, vision.rope_positions(ids, images))
