"""The limits of the HTTP server (`serve`'s flags of the same names): per request (`ServerLimits`), on runtime LoRA
loading (`LoraRuntimeLoading`), on connections and shutdown (the DEFAULT_* constants).

Plain Python, so that the CLI's parser can show the defaults without importing the server.
"""

from __future__ import annotations

import dataclasses
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

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
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
