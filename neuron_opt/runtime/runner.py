"""Model runner: picks the bucket, pads inputs to its shape, runs the graph, returns logits.

Prefill vs decode is decided here, once, by the bucket choice. Padding rules:
- prefill: token ids padded with 0 up to the bucket's seq; pad positions continue past the prompt (they write
  K/V beyond the prompt, which later decode steps overwrite before any read, and the causal mask hides them).
- decode: missing batch rows use the scratch slot (CacheConfig.scratch_slot) at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_opt.backends.base import Executor, StepInputs
from neuron_opt.buckets import Bucket, BucketConfig, pick_decode, pick_prefill, pick_verify
from neuron_opt.config import CacheConfig
from neuron_opt.errors import BucketOverflowError, ContextLengthError


@dataclass(frozen=True)
class DecodeRow:
    slot: int
    token: int
    position: int


@dataclass(frozen=True)
class VerifyRow:
    """A verify row: `tokens` (the last accepted token, then the proposed ones) at positions `position`,
    `position + 1`, ...; fewer than the bucket's q_len are padded (their K/V land beyond the accepted tokens, and
    are overwritten before any later step reads them)."""

    slot: int
    tokens: tuple[int, ...]
    position: int


class ModelRunner:
    def __init__(self, executor: Executor, buckets: BucketConfig, cache: CacheConfig, vocab_size: int) -> None:
        self.executor, self.buckets, self.cache, self.vocab_size = executor, buckets, cache, vocab_size
        self.last_bucket: Bucket | None = None

    @property
    def max_prompt_len(self) -> int:
        return self.buckets.prefill_lens[-1]

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + generated) one sequence can hold: the KV cache length, which is also the largest
        decode bucket (BucketConfig.build keeps them one number)."""
        return self.cache.max_model_len

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len > self.max_prompt_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_prompt_len} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input.")
        if prompt_len + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {prompt_len} input tokens "
                f"({max_tokens} > {self.max_model_len} - {prompt_len}).", param="max_tokens")

    def _run(self, bucket: Bucket, inputs: StepInputs, candidates: int | None) -> torch.Tensor:
        self.last_bucket = bucket
        if candidates is not None and getattr(self.executor, "gathers_candidates", False):
            # vocab-parallel TP: ranks send only their top-`candidates` logits (see neuron_opt.parallel.vocab)
            return self.executor.run(bucket, inputs, candidates=candidates)
        return self.executor.run(bucket, inputs)

    def prefill(self, slot: int, token_ids: list[int], candidates: int | None = None) -> torch.Tensor:
        """Run a prompt into `slot`; returns fp32 logits [V] of its last token.

        `candidates`: how many top logits per rank the sampler needs (None = the full distribution); executors
        that gather candidates return -inf for the rest, which is exact for greedy and top-k sampling."""
        n = len(token_ids)
        bucket = pick_prefill(n, self.buckets)
        ids = torch.zeros(1, bucket.tokens, dtype=torch.long)
        ids[0, :n] = torch.tensor(token_ids, dtype=torch.long)
        inputs = StepInputs(ids, torch.arange(bucket.tokens, dtype=torch.long)[None],
                            torch.tensor([slot], dtype=torch.long), torch.tensor([n - 1], dtype=torch.long))
        return self._run(bucket, inputs, candidates)[0, : self.vocab_size]

    def decode(self, rows: list[DecodeRow], candidates: int | None = None) -> torch.Tensor:
        """One token per row at its position; returns fp32 logits [len(rows), V]."""
        bucket = pick_decode(len(rows), max(r.position for r in rows), self.buckets)
        B = bucket.batch
        ids = torch.zeros(B, 1, dtype=torch.long)
        pos = torch.zeros(B, 1, dtype=torch.long)
        slots = torch.full((B,), self.cache.scratch_slot, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, 0], pos[i, 0], slots[i] = r.token, r.position, r.slot
        inputs = StepInputs(ids, pos, slots, torch.zeros(B, dtype=torch.long))
        return self._run(bucket, inputs, candidates)[: len(rows), : self.vocab_size]

    @property
    def verify_len(self) -> int:
        """Tokens per row of the verify graphs (num_speculative_tokens + 1), 0 when the artifact has none."""
        return self.buckets.verify_len

    def verify(self, rows: list[VerifyRow], candidates: int | None = None) -> torch.Tensor:
        """Score each row's tokens at consecutive positions in one graph call; returns fp32 logits
        [len(rows), q_len, V]: position j's logits predict the token after `tokens[j]`."""
        q = self.verify_len
        if not q:
            raise BucketOverflowError("this model has no verify graphs; recompile with --num-speculative-tokens K")
        if any(not 1 <= len(r.tokens) <= q for r in rows):
            raise ValueError(f"verify rows take 1..{q} tokens, got {[len(r.tokens) for r in rows]}")
        bucket = pick_verify(len(rows), max(r.position + q - 1 for r in rows), self.buckets)
        B = bucket.batch
        ids = torch.zeros(B, q, dtype=torch.long)
        pos = torch.arange(q).repeat(B, 1)  # padding rows: the scratch slot at positions 0..q-1
        slots = torch.full((B,), self.cache.scratch_slot, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
            pos[i] = torch.arange(r.position, r.position + q)
            slots[i] = r.slot
        inputs = StepInputs(ids, pos, slots, torch.arange(q).expand(B, q).contiguous())
        return self._run(bucket, inputs, candidates)[: len(rows), :, : self.vocab_size]
