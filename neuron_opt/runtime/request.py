"""What the scheduler knows about a request: token counts, nothing else (its KV blocks are the block manager's).

A request's tokens are its prompt followed by the tokens generated so far (`num_tokens` of them in all).
`num_computed_tokens` of those already have their K/V in the request's blocks. The runner's next call for it is:
- a prefill (of a chunk) of the tokens from `num_computed_tokens` on while more than one is pending;
- otherwise a decode of the last token at position `num_computed_tokens` (exactly one token is pending then).
Sampling state, detokenization and callbacks stay in the engine, so the scheduler is testable with this
plain dataclass alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# async scheduling (runtime/engine.py): the token of a step still in flight, which `Scheduler.update` records before
# it is sampled and `Scheduler.resolve` replaces once it is (never more than one, always the last output token)
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (or preempted): no KV blocks
    RUNNING = "running"  # holds KV blocks
    FINISHED = "finished"  # blocks released (stopped, length, aborted or failed)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    scheduled_time: float = 0.0  # time.monotonic() when first scheduled (0: not yet)
    # its prompt's logprobs are asked for: every prompt token is prefilled (no prefix-cache hit), as they come from
    # the prefill's logits
    scores_prompt: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache at its first admission
    status: RequestStatus = RequestStatus.WAITING
    # a request with the same prompt queued before this one (a sibling sample of `n`): admitted after that one's
    # prompt has its K/V, so its full blocks come from the prefix cache
    share_prefix_with: str | None = None
    # LoRA (neuron_opt.lora): the adapter's name (None: the base model), the slot it runs in while running (0:
    # none held), and its prefix-cache salt (block hashes under one adapter never match another's)
    lora_name: str | None = None
    lora_slot: int = 0
    cache_salt: bytes | None = None
    # a prompt with images: the prompt as prefix-cache keys see it, each image's placeholder tokens replaced by
    # its content hash (neuron_opt.multimodal.inputs.cache_token_ids); None: the prompt's own ids
    cache_token_ids: list[int] | None = None
    # [start, end) prompt ranges a prefill chunk never ends inside: a bidirectional decoder's image blocks (Gemma 3;
    # neuron_opt.multimodal.inputs.image_blocks), whose tokens see each other, so each is prefilled in one chunk
    atomic_spans: tuple[tuple[int, int], ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def cache_tokens(self) -> list[int]:
        """Its tokens as the prefix cache keys them: the prompt (`cache_token_ids` where it has images), then the
        generated tokens."""
        prompt = self.prompt_token_ids if self.cache_token_ids is None else self.cache_token_ids
        return prompt + self.output_token_ids

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
