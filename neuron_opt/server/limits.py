"""The per-request limits of the HTTP server (`serve`'s flags of the same names), in one frozen dataclass.

Plain Python, so that the CLI's parser can show the defaults without importing the server.
"""

from __future__ import annotations

import dataclasses

from neuron_opt.errors import ConfigError

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

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 1:
                raise ConfigError(f"{f.name}: must be >= 1, got {value}", param=f.name)

    def prompt_chars(self, max_model_len: int) -> int:
        """The prompt bound of a model with this context length."""
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len
