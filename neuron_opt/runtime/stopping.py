"""Incremental detokenization and stop conditions (EOS, stop token ids, stop strings, max_tokens).

A token's stop-string work is proportional to the text it could newly complete, not to the text so far: each stop
string is searched for only from where it could first end in the new text, and the held-back tail (the longest
suffix that could still begin a stop string) is found with one pass over at most the longest stop string's
length, looking each candidate suffix up in the set of the stop strings' prefixes (built once per request). The
server bounds how many stop strings a request may send and how long they may be (server/protocol.py).
"""

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


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings and what held_back looks them up in.

    Args:
        strings: the stop strings.
        prefixes: every non-empty proper prefix of a stop string.
        first_chars: the stop strings' first characters (a suffix starting with another cannot begin one).
        longest: the longest stop string's length.
    """

    strings: tuple[str, ...]
    prefixes: frozenset[str]
    first_chars: frozenset[str]
    longest: int

    @classmethod
    def of(cls, strings: tuple[str, ...]) -> StopStrings:
        return cls(strings, frozenset(s[:k] for s in strings for k in range(1, len(s))),
                   frozenset(s[0] for s in strings if s), max(map(len, strings), default=0))


def held_back(text: str, stops: StopStrings) -> int:
    """Characters at the end of `text` that could still begin a stop string (not streamed yet): the longest suffix
    of `text` that is a proper prefix of a stop string. Looks at the last `stops.longest - 1` characters only."""
    first = max(0, len(text) - stops.longest + 1)
    for i in range(first, len(text)):  # the longest candidate suffix first
        if text[i] in stops.first_chars and text[i:] in stops.prefixes:
            return len(text) - i
    return 0


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
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it (None: EOS)
    _stream: Any = field(default=None, repr=False)
    _decoded: str = ""  # what the stream has yielded so far: the decoded text of every complete character
    _stop_ids: frozenset[int] = frozenset()
    _stops: StopStrings = field(default=StopStrings.of(()), repr=False)

    def __post_init__(self) -> None:
        p = self.params  # built once: a token's check is one set lookup, however many stop ids a request sends
        self._stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        self._stops = StopStrings.of(p.stop)
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

    def ends_on(self, token: int, grammar_done: bool = False) -> bool:
        """Whether `add(token, grammar_done)` would finish the request by a rule that needs no text: the grammar's
        end, a stop or EOS token, max_tokens (stop strings need the text: only `add` sees them)."""
        n = len(self.token_ids) + 1
        return (grammar_done or (token in self._stop_ids and n > self.params.min_tokens)
                or n >= self.params.max_tokens)

    def add(self, token: int, grammar_done: bool = False) -> str:
        """Add a token; returns the newly visible text (delta). Sets finish_reason when done.

        `grammar_done`: the request's grammar accepted `token` as its end (a stop token, even under ignore_eos or
        before min_tokens: the output is complete)."""
        p = self.params
        self.token_ids.append(token)
        if grammar_done or (token in self._stop_ids and len(self.token_ids) > p.min_tokens):
            self.finish_reason = "stop"
            if token in p.stop_token_ids and not grammar_done:
                self.stop_reason = token
            return ""  # the stop token itself is not shown
        full = self._decode(token)
        if full is None:
            return ""
        for s in self._stops.strings:  # from where s could first end in the new text (held-back text is not shown)
            idx = full.find(s, max(0, len(self.text) - len(s)))
            if idx != -1:
                full, self.finish_reason, self.stop_reason = full[:idx], "stop", s
                break
        if self.finish_reason is None and len(self.token_ids) >= p.max_tokens:
            self.finish_reason = "length"
        self.full_text = full
        visible = full if self.finish_reason else full[: len(full) - held_back(full, self._stops)]
        if len(visible) <= len(self.text):
            return ""
        delta = visible[len(self.text):]
        self.text = visible
        return delta
