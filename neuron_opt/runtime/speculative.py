"""Speculative decoding: propose k tokens cheaply, score them in one verify graph call, keep the longest prefix
the target model agrees with (plus one token of its own).

- Proposer: prompt lookup (`method="ngram"`, vLLM's name). The last n tokens of the sequence (n from
  `prompt_lookup_max` down to `prompt_lookup_min`) are searched for earlier in the prompt and the text so far;
  the k tokens that followed their most recent earlier occurrence are the proposal. No draft model, no device
  work; pays on input-grounded text (repeating, editing, quoting the prompt). The `Proposer` protocol is what a
  draft model or an EAGLE-style head implements later.
- Acceptance (`accept`), position by position over the verify logits, with the request's own sampling
  (penalties, banned tokens, temperature, top-k/top-p) applied to each position's logits exactly as `sample_one`
  does for a decode step:
  greedy: the proposed token is accepted while it equals the argmax; the first mismatch emits the argmax.
  sampling: a proposal is a point mass q = delta(d), so rejection sampling (Leviathan et al. 2023) accepts d with
  probability min(1, p(d) / q(d)) = p(d), and on rejection samples from max(0, p - q) normalised = p with d
  removed. Either way the emitted tokens are distributed exactly as non-speculative sampling from p.
  When every proposal is accepted the last position's logits give one more token (the "bonus" token).
- Greedy output is identical token for token to non-speculative greedy decoding (tested).
- When it pays (`SpecController`): a verify call of batch B costs r(B) decode calls (measured online, an EMA per
  batch bucket). A row whose proposals are accepted with rate a (an EMA per sequence, also updated on plain
  decode steps by comparing the sampled token with the first proposed one) yields E = (1 - a^(n+1)) / (1 - a)
  tokens from a verify call with n proposals. The step speculates iff the mean E over its rows is >= r(B);
  otherwise it decodes, and the proposals still feed the acceptance estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from neuron_opt.errors import ConfigError
from neuron_opt.runtime.sampling import (
    SampleResult,
    SamplerState,
    processed_logits,
    result_for,
    sample_one,
    sampling_logits,
)

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` fields for prompt lookup."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1  # single-token matches too: measured better than 2 (docs/speculative.md)
    adaptive: bool = True  # speculate only in steps where the measured acceptance says it pays

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_method: {self.method!r} is not one of {', '.join(METHODS)}",
                              param="speculative_method")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens: must be >= 1, got {self.num_speculative_tokens}",
                              param="num_speculative_tokens")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min/max: need 1 <= min <= max, got {self.prompt_lookup_min} and "
                              f"{self.prompt_lookup_max}", param="prompt_lookup_min")


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `token_ids` (may be empty)."""
        ...


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: continue the most recent earlier occurrence of the sequence's last n tokens."""

    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        ids = np.asarray(token_ids, dtype=np.int64)
        L = len(ids)
        for n in range(min(self.prompt_lookup_max, L - 1), self.prompt_lookup_min - 1, -1):
            pattern = ids[L - n:]
            windows = np.lib.stride_tricks.sliding_window_view(ids[: L - 1], n)  # starts 0 .. L - 1 - n
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            hits = hits[hits + n < L]  # an occurrence with at least one token after it (excludes the suffix)
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []


def accept(
    logits: torch.Tensor, draft: list[int], state: SamplerState, banned_for: list[tuple[int, ...]]
) -> list[SampleResult]:
    """Tokens to emit from one verify row: the accepted prefix of `draft`, then one token of the target's own.

    Args:
        logits: [len(draft) + 1 or more, V] fp32; row j holds the target's logits for the token after the j-th
            scored token (row 0 follows the last accepted token, row j the j-th proposal).
        draft: the proposed tokens.
        state: the request's sampler state; `observe` is called here for every emitted token, in order, so
            penalties at position j count the tokens accepted before it.
        banned_for: tokens banned at each emitted position (EOS before min_tokens), len(draft) + 1 entries.
    """
    out: list[SampleResult] = []
    p = state.params
    for j, d in enumerate(draft):
        logits_j = processed_logits(logits[j], state, banned_for[j])
        if p.greedy:
            token = int(torch.argmax(logits_j).item())
            res = result_for(token, logits_j, state)
            out.append(res)
            state.observe(token)
            if token != d:
                return out
            continue
        probs = torch.softmax(sampling_logits(logits_j, p), -1)
        u = float(torch.rand((), generator=state.generator).item())
        if u < float(probs[d].item()):
            res = result_for(d, logits_j, state)
            out.append(res)
            state.observe(d)
            continue
        residual = probs.clone()
        residual[d] = 0.0  # max(0, p - delta_d), renormalised by multinomial
        token = int(torch.multinomial(residual, 1, generator=state.generator).item())
        out.append(result_for(token, logits_j, state))
        state.observe(token)
        return out
    res = sample_one(logits[len(draft)], state, banned_for[len(draft)])  # every proposal accepted: a bonus token
    state.observe(res.token)
    out.append(res)
    return out


@dataclass
class SpecStats:
    """Counters for /metrics (vLLM's spec_decode_* names, ours prefixed)."""

    verify_steps: int = 0
    drafts: int = 0  # verify rows that carried at least one proposal
    draft_tokens: int = 0  # proposed tokens scored
    accepted_tokens: int = 0  # proposed tokens accepted
    skipped_steps: int = 0  # steps with proposals that decoded instead (the controller's choice)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per draft: accepted proposals + the target's own token."""
        return (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else 0.0


@dataclass
class SpecController:
    """Decides per step whether verifying the proposals beats plain decoding (module docstring)."""

    num_speculative_tokens: int
    adaptive: bool = True
    smoothing: float = 0.2  # EMA weight of the newest observation
    prior_acceptance: float = 0.5
    acceptance: dict[str, float] = field(default_factory=dict)  # request id -> EMA of per-token acceptance
    step_time: dict[tuple[str, int], float] = field(default_factory=dict)  # (phase, batch bucket) -> EMA seconds

    def expected_tokens(self, request_id: str, n: int) -> float:
        a = min(self.acceptance.get(request_id, self.prior_acceptance), 0.999)
        return (1.0 - a ** (n + 1)) / (1.0 - a)

    def cost_ratio(self, batch: int) -> float:
        """Verify over decode step time at this batch bucket; 1.0 until both have been measured."""
        v, d = self.step_time.get(("verify", batch)), self.step_time.get(("decode", batch))
        return v / d if v and d else 1.0

    def should_verify(self, proposals: dict[str, list[int]], batch: int) -> bool:
        if not any(proposals.values()):
            return False
        if not self.adaptive:
            return True
        mean = sum(self.expected_tokens(r, len(p)) for r, p in proposals.items()) / len(proposals)
        return mean >= self.cost_ratio(batch)

    def observe_step(self, phase: str, batch: int, seconds: float) -> None:
        key = (phase, batch)
        old = self.step_time.get(key)
        self.step_time[key] = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds

    def observe_acceptance(self, request_id: str, accepted: int, proposed: int) -> None:
        """`accepted` of `proposed` consecutive proposals were taken (a rejection ends the run)."""
        if proposed == 0:
            return
        # per-token rate of a geometric run: accepted / (accepted + 1 rejection), or all of them
        rate = 1.0 if accepted == proposed else accepted / (accepted + 1)
        old = self.acceptance.get(request_id, self.prior_acceptance)
        self.acceptance[request_id] = (1 - self.smoothing) * old + self.smoothing * rate

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
