"""Incremental detokenization and stop conditions (EOS, stop token ids, stop strings, max_tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neuron_opt.runtime.sampling import SamplingParams


def stream_decoder(tokenizer: object, skip_special_tokens: bool = True) -> Any:
    """A `tokenizers.decoders.DecodeStream` for a fast HF tokenizer whose decode is exactly its backend's (no
    `clean_up_tokenization_spaces`), else None (the caller re-decodes every id instead)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    return DecodeStream(skip_special_tokens=skip_special_tokens)


@dataclass
class StopChecker:
    """Feeds generated tokens one at a time; tracks the visible text and the finish reason.

    Text is decoded incrementally where the tokenizer allows it (`tokenizers`' DecodeStream: O(new tokens) per
    token; it yields nothing until a multi-byte character split across tokens completes), else from all
    generated ids each time (`incremental=False`, the reference: exact for any tokenizer, a trailing U+FFFD, an
    incomplete character, held back until it completes). A sequence that ends on an incomplete character is
    decoded whole once, so both give the same final text. A stop string ends generation and is not included.
    """

    tokenizer: object
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    incremental: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # visible text (stop-string prefixes held back until resolved)
    full_text: str = ""
    finish_reason: str | None = None
    _stream: Any = field(default=None, repr=False)
    _decoded: str = ""  # what the stream has yielded so far: the decoded text of every complete character
    _stop_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        p = self.params  # built once: a token's check is one set lookup, however many stop ids a request sends
        self._stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        if self.incremental:
            self._stream = stream_decoder(self.tokenizer, p.skip_special_tokens)

    def _decode(self, token: int) -> str | None:
        """The text of all generated ids, or None while it ends in an incomplete character."""
        p = self.params
        if self._stream is None:
            full = self.tokenizer.decode(self.token_ids, skip_special_tokens=p.skip_special_tokens)
            return None if full.endswith("\ufffd") and len(self.token_ids) < p.max_tokens else full
        piece = self._stream.step(self.tokenizer.backend_tokenizer, token)  # type: ignore[attr-defined]
        if piece is not None:
            self._decoded += piece
            return self._decoded
        if len(self.token_ids) >= p.max_tokens:  # ends mid-character: what the full decode shows
            return self.tokenizer.decode(  # type: ignore[attr-defined]
                self.token_ids, skip_special_tokens=p.skip_special_tokens)
        return None

    def add(self, token: int, grammar_done: bool = False) -> str:
        """Add a token; returns the newly visible text (delta). Sets finish_reason when done.

        `grammar_done`: the request's grammar accepted `token` as its end (a stop token, even under ignore_eos or
        before min_tokens: the output is complete)."""
        p = self.params
        self.token_ids.append(token)
        if grammar_done or (token in self._stop_ids and len(self.token_ids) > p.min_tokens):
            self.finish_reason = "stop"
            return ""  # the stop token itself is not shown
        full = self._decode(token)
        if full is None:
            return ""
        for s in p.stop:
            idx = full.find(s, max(0, len(self.text) - len(s)))
            if idx != -1:
                full, self.finish_reason = full[:idx], "stop"
                break
        if self.finish_reason is None and len(self.token_ids) >= p.max_tokens:
            self.finish_reason = "length"
        self.full_text = full
        visible = full if self.finish_reason else full[: len(full) - held_back(full, p)]
        if len(visible) <= len(self.text):
            return ""
        delta = visible[len(self.text):]
        self.text = visible
        return delta


def held_back(text: str, params: SamplingParams) -> int:
    """Characters at the end of `text` that could still begin a stop string (not streamed yet)."""
    keep = 0
    for s in params.stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return keep
