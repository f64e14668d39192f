"""Incremental detokenization and stop conditions (EOS, stop token ids, stop strings, max_tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron_opt.runtime.sampling import SamplingParams


@dataclass
class StopChecker:
    """Feeds generated tokens one at a time; tracks the visible text and the finish reason.

    Text is decoded from all generated ids each time (exact for any tokenizer, including multi-byte characters
    split across tokens); a trailing U+FFFD (an incomplete character) is held back until it completes. A stop
    string ends generation and is not included in the text.
    """

    tokenizer: object
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # visible text (stop-string prefixes held back until resolved)
    full_text: str = ""
    finish_reason: str | None = None

    def add(self, token: int) -> str:
        """Add a token; returns the newly visible text (delta). Sets finish_reason when done."""
        p = self.params
        self.token_ids.append(token)
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        if token in stop_ids and len(self.token_ids) > p.min_tokens:
            self.finish_reason = "stop"
            return ""  # the stop token itself is not shown
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if full.endswith("\ufffd") and len(self.token_ids) < p.max_tokens:
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
