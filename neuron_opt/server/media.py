"""Images in chat messages: OpenAI `image_url` content parts (and the PIL images `LLM.chat` takes) -> validated PIL
images, and the messages in Hugging Face's multimodal form (`{"type": "image", "image": <PIL.Image>}` parts) that a
processor's chat template renders.

Design decisions
- Sources: `data:` URLs (base64 PNG, JPEG or WebP; the declared media type must be the decoded format's), remote
  `http(s)` URLs only for hosts `serve --allowed-media-domains` lists (exact host names; redirects followed only to
  listed hosts, at most MAX_REDIRECTS), `file://` URLs only under `serve --allowed-local-media-path` (the path
  resolved, symlinks included, must stay under it). Without those flags remote and local URLs are refused.
- Every bound is checked before the work it bounds: the image count (`--limit-mm-per-prompt`) before anything is
  fetched or decoded; a data URL's length before base64 decoding; a download's bytes while it streams
  (`--max-image-bytes`; past it the connection is dropped), within `--media-fetch-timeout` seconds in all; the
  pixel count from the image header (PIL's `Image.open` reads only the header) before the pixels are decoded
  (`--max-image-pixels`): a decompression bomb is refused from its header. PIL's own guard (past twice
  Image.MAX_IMAGE_PIXELS, a process-wide setting left as it is) refuses first only where --max-image-pixels is set
  above it, and is reported the same.
- Only PIL's PNG, JPEG and WebP readers ever parse request bytes (`Image.open(..., formats=...)`); another format
  is named from its magic bytes in the refusal, never parsed.
- Base64 and image decoding and file reads run in worker threads, downloads on an async client: none blocks the
  event loop.
- Each refusal is a ConfigError (HTTP 400) naming the field, `messages[0].content[1].image_url.url`, so the server
  answers it and serves on. A text-only model refuses any image part before any of it is loaded.
- Decoded images are converted to RGB, as the processors' own `convert_rgb` does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from PIL import Image, UnidentifiedImageError

from neuron_opt.errors import ConfigError
from neuron_opt.server.limits import MediaLimits

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}  # PIL format -> its media type
MEDIA_TYPES = {v: k for k, v in FORMATS.items()} | {"image/jpg": "JPEG"}  # (a common misspelling of image/jpeg)
OTHER_FORMATS = ((b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
                 (b"\x00\x00\x01\x00", "ICO"), (b"%PDF", "PDF"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"))
IMAGE_PART_TYPES = ("image_url", "image", "image_pil")  # OpenAI's; HF's and vLLM's (PIL images, `LLM.chat` only)
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class ImagePrompt:
    """A conversation with images, rendered for the engine.

    Args:
        prompt_ids: the prompt's token ids, the images' placeholder tokens included.
        engine_inputs: the keyword arguments of `Engine.add_request` that carry the images' inputs.
    """

    prompt_ids: list[int]
    engine_inputs: dict[str, Any]


# (HF-form messages with their images in place, tools for the template, template variables) -> the rendered
# prompt: the image-capable model's renderer (the server answers images with a 400 without one).
EncodeImageChat = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None", "dict[str, Any] | None"],
                           ImagePrompt]


def image_renderer(engine: Any) -> EncodeImageChat | None:
    """`engine`'s renderer of conversations with images (its processor: runtime.engine.encode_multimodal_chat), with
    the images' inputs as `Engine.add_request`'s keywords; None for a model that takes text only."""
    if engine.runner.vision is None:
        return None

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               template_kwargs: dict[str, Any] | None) -> ImagePrompt:
        p = engine.encode_multimodal_chat(messages, tools, template_kwargs)
        return ImagePrompt(p.token_ids, {"images": p.images, "rope_positions": p.rope_positions})

    return render


def _image_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(message index, part index, part) of each image part, in order."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    yield i, j, part


def refuse_images(messages: list[dict[str, Any]], modalities: tuple[str, ...], model: str) -> None:
    """ConfigError naming the first image part when the model takes no images."""
    if "image" in modalities:
        return
    for i, j, _ in _image_parts(messages):
        field = f"messages[{i}].content[{j}]"
        raise ConfigError(f"{field}: model {model!r} does not accept images (it takes {', '.join(modalities)})",
                          param=field)


def _field(i: int, j: int, part: dict[str, Any]) -> str:
    return f"messages[{i}].content[{j}]" + (".image_url.url" if part["type"] == "image_url" else f".{part['type']}")


def _too_many(n: int, limits: MediaLimits) -> None:
    if n > limits.max_images:
        raise ConfigError(f"messages: at most {limits.max_images} images per request (this server's "
                            f"--limit-mm-per-prompt), got {n}", param="messages")


async def load_chat_images(messages: list[dict[str, Any]],
                           limits: MediaLimits) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """`messages` (OpenAI's, with `image_url` parts) in HF's multimodal form, and their images in order: each image
    part becomes `{"type": "image", "image": <PIL.Image>}`, text parts stay. ConfigError naming the field of the
    first image that is refused."""
    parts = list(_image_parts(messages))
    _too_many(len(parts), limits)
    images: dict[tuple[int, int], Image.Image] = {}
    for i, j, part in parts:
        images[i, j] = await _load(part, _field(i, j, part), limits)
    return _hf_messages(messages, images), list(images.values())


def _hf_messages(messages: list[dict[str, Any]], images: dict[tuple[int, int], Image.Image]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [{"type": "image", "image": images[i, j]} if (i, j) in images else p
                                  for j, p in enumerate(content)]}
        out.append(m)
    return out


async def _load(part: dict[str, Any], field: str, limits: MediaLimits) -> Image.Image:
    kind = part["type"]
    if kind != "image_url":  # a PIL image given in Python (`LLM.chat`)
        img = part.get(kind)
        if not isinstance(img, Image.Image):
            raise ConfigError(f"{field}: must be a PIL.Image.Image, got {type(img).__name__}", param=field)
        _check_pixels(img, field, limits)
        return img.convert("RGB")
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(url, str):
        raise ConfigError(f"{field}: an image URL is required", param=field)
    detail = spec.get("detail") if isinstance(spec, dict) else None
    if detail not in (None, "auto"):  # the model's own processor picks the resolution
        detail_field = field.removesuffix(".url") + ".detail"
        raise ConfigError(f"{detail_field}: only 'auto' is supported (the model's image processor picks the "
                            f"resolution), got {detail!r}", param=detail_field)
    scheme = urlsplit(url[:16]).scheme.lower()
    declared = None
    if scheme == "data":
        declared, data = await asyncio.to_thread(_data_url, url, field, limits)  # (base64 of up to the body size)
    elif scheme in ("http", "https"):
        data = await _fetch(url, field, limits)
    elif scheme == "file":
        data = await asyncio.to_thread(_read_local, url, field, limits)
    else:
        raise ConfigError(f"{field}: the URL must be a data:, http(s): or file: URL, got scheme {scheme!r}",
                          param=field)
    return await asyncio.to_thread(decode_image, data, field, limits, declared)


def _data_url(url: str, field: str, limits: MediaLimits) -> tuple[str, bytes]:
    """(declared PIL format, bytes) of a `data:<media type>;base64,<data>` URL."""
    head, sep, payload = url.partition(",")
    params = head[len("data:"):].split(";")
    media_type = params[0].strip().lower()
    if not sep or params[-1].strip().lower() != "base64":
        raise ConfigError(f"{field}: a data URL must be base64: data:image/png;base64,...", param=field)
    if media_type not in MEDIA_TYPES:
        raise ConfigError(f"{field}: unsupported image format {media_type or 'none'!r}; this server reads "
                            f"{', '.join(FORMATS.values())}", param=field)
    if len(payload) * 3 // 4 > limits.max_image_bytes + 2:  # bounded before decoding
        raise ConfigError(f"{field}: the image is larger than this server takes ({limits.max_image_bytes} bytes, "
                            "--max-image-bytes)", param=field)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{field}: the data URL is not valid base64", param=field) from None
    _check_bytes(len(data), field, limits)
    return MEDIA_TYPES[media_type], data


def _check_bytes(n: int, field: str, limits: MediaLimits) -> None:
    if n > limits.max_image_bytes:
        raise ConfigError(f"{field}: the image is larger than this server takes ({limits.max_image_bytes} bytes, "
                            "--max-image-bytes)", param=field)


def _check_pixels(img: Image.Image, field: str, limits: MediaLimits) -> None:
    w, h = img.size
    if w * h > limits.max_image_pixels:
        raise ConfigError(f"{field}: the image is {w}x{h} = {w * h} pixels, more than this server decodes "
                            f"({limits.max_image_pixels}, --max-image-pixels)", param=field)
    if w < 1 or h < 1:
        raise ConfigError(f"{field}: the image is empty ({w}x{h})", param=field)


def decode_image(data: bytes, field: str, limits: MediaLimits, declared: str | None = None) -> Image.Image:
    """`data` decoded as PNG, JPEG or WebP into an RGB image; its size checked from its header first, and its
    format against `declared` (a PIL format name) when given. ConfigError naming `field` otherwise."""
    try:
        img = Image.open(io.BytesIO(data), formats=tuple(FORMATS))  # the header only
    except UnidentifiedImageError:
        other = next((name for magic, name in OTHER_FORMATS if data.startswith(magic)), None)
        what = (f"unsupported image format {other}" if other is not None
                else "not a readable PNG, JPEG or WebP image (corrupt, truncated, or another format)")
        raise ConfigError(f"{field}: {what}; this server reads {', '.join(FORMATS.values())}", param=field) from None
    except Image.DecompressionBombError:  # PIL's own guard, past twice Image.MAX_IMAGE_PIXELS
        raise ConfigError(f"{field}: the image has more pixels than this server decodes "
                            f"({limits.max_image_pixels}, --max-image-pixels)", param=field) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ConfigError(f"{field}: a corrupt or truncated image header ({e})", param=field) from None
    with img:
        if declared is not None and img.format != declared:
            raise ConfigError(f"{field}: the data URL says {FORMATS[declared]}, but the image is "
                                f"{FORMATS[str(img.format)]}", param=field)
        _check_pixels(img, field, limits)
        try:
            img.load()  # the pixels: only now, within the bound
            return img.convert("RGB")
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
            raise ConfigError(f"{field}: a corrupt or truncated {img.format} image ({e})", param=field) from None


def _read_local(url: str, field: str, limits: MediaLimits) -> bytes:
    """The bytes of a `file://` URL inside `--allowed-local-media-path` (symlinks resolved before the check)."""
    root = limits.allowed_local_media_path
    if root is None:
        raise ConfigError(f"{field}: file URLs are not allowed (serve --allowed-local-media-path DIR allows "
                            "those under DIR)", param=field)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise ConfigError(f"{field}: a file URL is file:///absolute/path (no host, query or fragment)", param=field)
    path = Path(unquote(parts.path))
    outside = ConfigError(f"{field}: the file is not under this server's --allowed-local-media-path", param=field)
    if not path.is_absolute():
        raise outside
    resolved = path.resolve()  # every symlink that exists followed, so a link pointing out is refused
    if not resolved.is_relative_to(root.resolve()):
        raise outside
    try:  # non-blocking (a FIFO), and no symlink swapped in since the check
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ConfigError(f"{field}: no such file", param=field) from None
    except OSError as e:
        raise ConfigError(f"{field}: cannot read the file ({e.strerror})", param=field) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{field}: not a regular file", param=field)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limits.max_image_bytes + 1)
    _check_bytes(len(data), field, limits)
    return data


def _check_host(url: str, field: str, limits: MediaLimits) -> None:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise ConfigError(f"{field}: not an http(s) URL with a host", param=field)
    if host not in limits.allowed_media_domains:
        listed = ", ".join(limits.allowed_media_domains) or "none"
        raise ConfigError(f"{field}: the host {host!r} is not in this server's --allowed-media-domains "
                            f"({listed})", param=field)


async def _fetch(url: str, field: str, limits: MediaLimits) -> bytes:
    """The body of a remote image: its host (and every redirect's) allowed, at most `max_image_bytes` read, all
    within `media_fetch_timeout` seconds."""
    _check_host(url, field, limits)
    try:
        return await asyncio.wait_for(_download(url, field, limits), limits.media_fetch_timeout)
    except asyncio.TimeoutError:
        raise ConfigError(f"{field}: fetching the image took longer than {limits.media_fetch_timeout:g} s "
                            "(--media-fetch-timeout)", param=field) from None


async def _download(url: str, field: str, limits: MediaLimits) -> bytes:
    import httpx  # the `serve` extra's HTTP client (imported here: `LLM.chat` reads no remote URLs)

    async with httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                 timeout=httpx.Timeout(limits.media_fetch_timeout)) as client:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                async with client.stream("GET", url) as r:
                    if r.is_redirect:
                        url = urljoin(url, r.headers.get("location", ""))
                        _check_host(url, field, limits)  # a redirect only to a listed host
                        continue
                    if r.status_code != 200:
                        raise ConfigError(f"{field}: fetching the image answered HTTP {r.status_code}", param=field)
                    length = r.headers.get("content-length", "")
                    if length.isdigit():
                        _check_bytes(int(length), field, limits)
                    chunks, size = [], 0
                    async for chunk in r.aiter_bytes():
                        size += len(chunk)
                        _check_bytes(size, field, limits)
                        chunks.append(chunk)
                    return b"".join(chunks)
            except httpx.HTTPError as e:
                raise ConfigError(f"{field}: cannot fetch the image ({type(e).__name__})", param=field) from None
    raise ConfigError(f"{field}: more than {MAX_REDIRECTS} redirects", param=field)
