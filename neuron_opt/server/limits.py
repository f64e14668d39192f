"""The limits of the HTTP server (`serve`'s flags of the same names): per request (`ServerLimits`, its images'
`MediaLimits`), on runtime LoRA loading (`LoraRuntimeLoading`), on connections and shutdown (the DEFAULT_* constants).

Plain Python, so that the CLI's parser can show the defaults without importing the server.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from neuron_opt.errors import ConfigError
from neuron_opt.runtime.structured import MAX_REPEAT

DEFAULT_MAX_CONNECTIONS = 1024  # `serve --max-connections`: uvicorn's limit_concurrency (connections + requests)
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5  # `serve --timeout-keep-alive`: an idle keep-alive connection is closed after it
MAX_HEADER_BYTES = 16 * 2**10  # h11's max incomplete event: a request line + headers past it is a 400
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # `serve --shutdown-timeout`: the most a drain waits for requests in flight
GRAMMAR_QUEUE_PER_WORKER = 16  # grammar compiles waiting for the pool, per worker, before 503
PROMPT_CHARS_PER_TOKEN = 32  # the default prompt bound: generous for any tokenizer (English averages about 4)


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """What images a request may carry and where they may come from (server/media.py; `serve`'s flags).

    Args:
        max_images: most images per request (`--limit-mm-per-prompt '{"image": N}'`, vLLM's form).
        max_image_bytes: most bytes of one encoded image (a data URL's decoded bytes, a download, a file).
        max_image_pixels: most pixels (width x height) of one image, read from its header before decoding.
        allowed_media_domains: the hosts remote http(s) image URLs may name (exact names); empty: none.
        allowed_local_media_path: the directory `file://` image URLs must resolve inside; None: no file URLs.
        media_fetch_timeout: seconds a remote image may take to download, redirects included.
    """

    max_images: int = 8
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: Path | None = None
    media_fetch_timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_bytes", "max_image_pixels"):
            bound = 0 if name == "max_images" else 1  # {"image": 0}: no images at all
            if getattr(self, name) < bound:
                raise ConfigError(f"{name}: must be >= {bound}, got {getattr(self, name)}", param=name)
        if not (math.isfinite(self.media_fetch_timeout) and self.media_fetch_timeout > 0):
            raise ConfigError(f"media_fetch_timeout: must be > 0, got {self.media_fetch_timeout}",
                              param="media_fetch_timeout")
        for host in self.allowed_media_domains:
            if not host or host != host.lower() or any(c in host for c in "/:@ "):
                raise ConfigError(f"allowed_media_domains: {host!r} is not a lower-case host name (no scheme, port "
                                  "or path)", param="allowed_media_domains")
        root = self.allowed_local_media_path
        if root is not None and not root.is_dir():
            raise ConfigError(f"allowed_local_media_path: {root} is not a directory", param="allowed_local_media_path")

    @staticmethod
    def parse_limit_mm_per_prompt(text: str) -> int:
        """The image count of `--limit-mm-per-prompt`'s JSON object (`{"image": N}`); other modalities are refused."""
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                   for v in value.values()):
            raise ConfigError(f"--limit-mm-per-prompt: a JSON object of counts, e.g. '{{\"image\": 4}}', got "
                              f"{text!r}", param="limit_mm_per_prompt")
        others = sorted(set(value) - {"image"})
        if others:
            raise ConfigError(f"--limit-mm-per-prompt: only 'image' is served, not {', '.join(others)}",
                              param="limit_mm_per_prompt")
        return value.get("image", MediaLimits.max_images)


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Per-request bounds the server enforces before doing any work for a request that grows with them: 413 past
    the body size, 400 past the others. The fields named like `serve`'s flags are set by them.

    Args:
        max_n: most samples per request (`n`).
        max_logit_bias: most entries of `logit_bias`.
        max_tools: most tools per request.
        max_body_bytes: most bytes of a request body, counted while it is read (also without Content-Length).
        max_prompt_chars: most characters of a prompt (chat: of all messages), checked before tokenizing, and most
            token ids of a prompt given as ids; None: PROMPT_CHARS_PER_TOKEN x max_model_len.
        max_stop_strings: most `stop` strings.
        max_stop_chars: most characters of one stop string.
        max_stop_token_ids: most `stop_token_ids`.
        max_schema_bytes: most bytes, as JSON, of each of `response_format`, `structured_outputs`, `guided_*`,
            `tools` and `chat_template_kwargs`.
        max_messages: most chat messages.
        max_embedding_inputs: most inputs of one `/v1/embeddings` request (OpenAI's bound: 2048).
        max_grammar_repeat: the cap on every count a request's grammar gives (maxLength, maxItems, {m,n}, ...):
            upper bounds past it are lowered to it, lower bounds past it are a 400 (runtime/structured.py).
        max_grammar_compiles: grammars compiled at once, in a pool of their own; GRAMMAR_QUEUE_PER_WORKER x as
            many more wait for it, past that 503.
        grammar_compile_timeout: seconds one grammar may take to compile before its request is a 400 (the compile
            itself runs on and keeps its worker; its result stays cached).
        media: the bounds on a request's images.
    """

    max_n: int = 16
    max_logit_bias: int = 1024
    max_tools: int = 128
    max_body_bytes: int = 8 * 2**20
    max_prompt_chars: int | None = None
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256
    max_schema_bytes: int = 256 * 2**10
    max_messages: int = 1024
    max_embedding_inputs: int = 2048
    max_grammar_repeat: int = MAX_REPEAT
    max_grammar_compiles: int = 2
    grammar_compile_timeout: float = 10.0
    media: MediaLimits = MediaLimits()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "media":  # (checked by its own __post_init__)
                continue
            if value is not None and (value <= 0 if isinstance(value, float) else value < 1):
                raise ConfigError(f"{f.name}: must be {'> 0' if isinstance(value, float) else '>= 1'}, got {value}",
                                  param=f.name)

    def prompt_chars(self, max_model_len: int) -> int:
        """The prompt bound of a model with this context length."""
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len


DEFAULT_MAX_CPU_LORAS = 16  # adapters registered at once when runtime loading is on (--max-cpu-loras)


@dataclasses.dataclass(frozen=True)
class LoraRuntimeLoading:
    """What `/v1/load_lora_adapter` may do (`serve`'s flags): load adapters from under `root` only, at most
    `max_cpu_loras` registered in all."""

    root: Path
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS

    def __post_init__(self) -> None:
        if not self.root.is_dir():
            raise ConfigError(f"--lora-runtime-root: {self.root} is not a directory", param="lora_runtime_root")
        if self.max_cpu_loras < 1:
            raise ConfigError(f"--max-cpu-loras: must be >= 1, got {self.max_cpu_loras}", param="max_cpu_loras")

    def resolve(self, path: str) -> Path:
        """`path` (relative to the root, or absolute) resolved, ConfigError unless it lies inside the root."""
        root = self.root.resolve()
        target = (root / path).resolve()
        if not target.is_relative_to(root):
            raise ConfigError("lora_path: must be a directory under the server's --lora-runtime-root",
                              param="lora_path")
        return target
