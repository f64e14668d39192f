"""The one definition of a sampled token, as batched tensor operations that run on the host (runtime/sampling.py)
and inside a device graph (backends/neuron.py) alike.

A row's logits are processed (logit_bias added, presence/frequency penalties subtracted, the allowed-token mask
applied: `adjust_rows`); a greedy row takes their argmax (the first maximal index). A sampled row divides them by
its temperature and filters them in vLLM's order: min-p (tokens whose probability is below `min_p` times the
largest are dropped), top-k (tokens below the k-th largest value), top-p (the smallest prefix of the sorted
distribution whose mass reaches `top_p` is kept), then draws its token by inverse CDF in vocabulary order from one
uniform number `u` in [0, 1): the first index whose cumulative probability exceeds `u` times the total
(`filter_rows`, `draw_rows`). A parameter at its neutral value (min_p 0, top_k 0, top_p 1) changes nothing, bit for
bit, so the host may skip a filter no row uses while a device graph always runs all of them.

`u` comes from the request's own seeded generator, drawn on the host (one number a step), so a request's stream
does not depend on what else is in the batch or on where its token is sampled.

Speculative verification (`verify_rows`): a verify step's position j of a row tests the proposed token d (a point
mass, runtime/speculative.py). A greedy row accepts d where it is the argmax; a sampled row where its uniform number
`u_accept` is below p(d), the probability of d in the filtered distribution. The token the row emits there if d is
not taken is the argmax (greedy), or a draw by inverse CDF with `u` from the filtered logits with d removed (the
residual max(0, p - delta_d), normalised); a position without a proposal (the bonus) draws from them whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingInputs:
    """One step's sampling parameters for the rows of a graph's batch, as fixed-shape tensors (graph inputs).

    temperature, top_p, min_p, u: [B] fp32 (temperature 0: greedy); top_k: [B] int (0: off); bias_ids / bias:
    [B, A] the logit_bias entries added, penalty_ids / penalty: [B, A] the presence/frequency penalties subtracted
    (unused slots: id 0, value 0, which adds nothing); mask: [B, ceil(V / 32)] int32, bit v % 32 of word v // 32
    set where token v is allowed (xgrammar's token bitmask; None: every token); draft, u_accept: a verify step's
    rows (one per scored position), the proposed token each tests ([B] int, -1: none) and the uniform number of its
    acceptance test ([B] fp32; `verify_rows`), None otherwise; logprobs: how many top logprobs to return per row
    (None: none; 0: the chosen token's only); skip: the steps no row needs, left out of the graph (each is neutral
    for the rows that do not use it, so the tokens are the same; each set is its own graph)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    u: torch.Tensor
    bias_ids: torch.Tensor
    bias: torch.Tensor
    penalty_ids: torch.Tensor
    penalty: torch.Tensor
    mask: torch.Tensor | None = None
    draft: torch.Tensor | None = None
    u_accept: torch.Tensor | None = None
    logprobs: int | None = None
    skip: tuple[str, ...] = ()  # what no row uses: filters ("min_p", "top_k", "top_p"), or "draw" (every row greedy)

    def __post_init__(self) -> None:
        if (self.draft is None) != (self.u_accept is None):
            raise ValueError("a verify step's sampling inputs take both draft and u_accept")

    def tensors(self) -> list[torch.Tensor]:
        """The graph inputs, in a fixed order (then the mask, the drafts and their uniform numbers, where set)."""
        return [t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingInputs:
        """These inputs with `fn` applied to each tensor."""
        changes: dict[str, Any] = {f.name: fn(t) for f in fields(self)
                                   if isinstance(t := getattr(self, f.name), torch.Tensor)}
        return replace(self, **changes)

    def to(self, device: Any) -> SamplingInputs:
        """On `device`, integer tensors as int32 (the step inputs' type: neuron_opt.backends.neuron.backend)."""
        return self.map(lambda x: (x.to(torch.int32) if x.dtype == torch.int64 else x).to(device))

    def padded(self, batch: int) -> SamplingInputs:
        """The inputs of a graph batch of `batch` rows: the rows beyond these are greedy and unadjusted (no mask
        bit cleared, no proposal)."""
        n = self.temperature.shape[0]
        if n == batch:
            return self
        if n > batch:
            raise ValueError(f"sampling inputs for {n} rows, the graph's batch holds {batch}")
        fill = {"top_p": 1, "mask": -1, "draft": -1}
        changes: dict[str, Any] = {
            f.name: torch.cat([t, torch.full((batch - n, *t.shape[1:]), fill.get(f.name, 0), dtype=t.dtype)])
            for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)}
        return replace(self, **changes)


def unpack_mask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's token bitmask [B, W] int32 -> allowed [B, vocab] bool."""
    v = torch.arange(vocab, device=mask.device)
    return bit_set(mask.index_select(1, v // 32), v)


def bit_set(words: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bit v % 32 of each int32 word (words [..., V], v [V]). An AND with the bit, not a right shift: torch-xla
    shifts a negative int32 right by rounding toward zero, not down."""
    one = torch.ones((), dtype=words.dtype, device=words.device)
    return (words & (one << (v % 32).to(words.dtype))) != 0


def adjust_rows(logits: torch.Tensor, s: SamplingInputs) -> torch.Tensor:
    """logits [B, V] + logit_bias - penalties, then the allowed-token mask (-inf elsewhere)."""
    logits = logits.scatter_add(1, s.bias_ids.long(), s.bias)
    logits = logits.scatter_add(1, s.penalty_ids.long(), -s.penalty)
    if s.mask is not None:
        logits = logits.masked_fill(~unpack_mask(s.mask, logits.shape[-1]), NEG_INF)
    return logits


def filter_rows(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                k_max: int | None = None, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """Temperature-scaled logits [R, V] -> the logits a row draws from (-inf where filtered; module docstring).

    `k_max`: the largest top_k of the rows (the host takes a top-k of that size); None sorts the row (a device
    graph, whose shapes are static). `skip`: filters no row uses ("min_p", "top_k", "top_p"), left out on the host;
    each is neutral at its off value, so leaving it out changes nothing."""
    V = z.shape[-1]
    if "min_p" not in skip:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < min_p.to(probs.dtype)[:, None] * probs.amax(-1, keepdim=True), NEG_INF)
    if "top_k" not in skip:
        k = torch.where((top_k > 0) & (top_k < V), top_k, torch.zeros_like(top_k)).long()
        top = z.topk(k_max).values if k_max is not None else z.sort(-1, descending=True).values
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None])  # [R, 1]
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, NEG_INF))
        z = z.masked_fill(z < kth, NEG_INF)
    if "top_p" not in skip:
        zs, order = z.sort(-1, descending=True)
        probs = zs.softmax(-1)
        p = top_p.to(probs.dtype)[:, None]
        drop = (probs.cumsum(-1) - probs >= p) & (p < 1.0)  # keep the smallest prefix whose mass reaches top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)
    return z


def draw_rows(z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of filtered logits [R, V] by inverse CDF in vocabulary order: the first index whose
    cumulative probability exceeds u * total (never a zero-probability token)."""
    cum = z.softmax(-1).cumsum(-1)
    below = cum <= (u.to(cum.dtype)[:, None] * cum[:, -1:])
    return below.sum(-1).clamp(max=z.shape[-1] - 1)


def sample_rows(logits: torch.Tensor, s: SamplingInputs) -> torch.Tensor:
    """Processed logits [B, V] -> token ids [B]: greedy rows their argmax, the others a draw (module docstring).
    What a device graph computes for every row; the host does the same per kind of row (runtime/sampling.py)."""
    if "draw" in s.skip:
        return logits.argmax(-1)
    greedy = s.temperature <= 0.0
    t = torch.where(greedy, torch.ones_like(s.temperature), s.temperature)
    z = filter_rows(logits / t[:, None], s.top_k, s.top_p, s.min_p, skip=s.skip)
    return torch.where(greedy, logits.argmax(-1), draw_rows(z, s.u))


def accept_probability(z: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    """p(d) per row [R] from filtered logits [R, C], `match` [R, C] True at each row's proposed token d (none: 0)."""
    return z.softmax(-1).masked_fill(~match, 0.0).sum(-1)


def residual_rows(z: torch.Tensor, match: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token drawn with `u` from filtered logits [R, C] without each row's proposed token (`match`)."""
    return draw_rows(z.masked_fill(match, NEG_INF), u)


def verify_rows(x: torch.Tensor, s: SamplingInputs, match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify step's processed logits [R, C] (one row per scored position) -> (the token each row emits if its
    proposal is not taken [R], whether it is accepted [R] bool) (module docstring). `match` [R, C]: True at the
    row's proposed token (`s.draft`; none where it is -1). Column c stands for token c, or (vocab-parallel) for the
    candidate the caller maps it to."""
    best = x.argmax(-1)
    if "draw" in s.skip:
        return best, match.gather(1, best[:, None])[:, 0]
    assert s.u_accept is not None
    greedy = s.temperature <= 0.0
    t = torch.where(greedy, torch.ones_like(s.temperature), s.temperature)
    z = filter_rows(x / t[:, None], s.top_k, s.top_p, s.min_p, skip=s.skip)
    accept = torch.where(greedy, match.gather(1, best[:, None])[:, 0],
                         s.u_accept.to(z.dtype) < accept_probability(z, match))
    return torch.where(greedy, best, residual_rows(z, match, s.u)), accept


def verify_outputs(outs: list[torch.Tensor], logprobs: int | None) -> dict[str, torch.Tensor]:
    """A verify step's sampled outputs, in the order a device graph returns them, by name: ids (each position's
    token if its proposal is not taken), accept; with logprobs, chosen (the ids' logprobs), draft (the
    proposals'), and when logprobs > 0 top and top_ids."""
    named = {"ids": outs[0], "accept": outs[1]}
    if logprobs is not None:
        named.update(chosen=outs[2], draft=outs[-1])
        if logprobs:
            named.update(top=outs[3], top_ids=outs[4])
    return named


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """From processed logits [B, V]: the chosen tokens' logprobs [B], and (n > 0) the top-n logprobs [B, n] and
    their ids [B, n]."""
    lp = logits.log_softmax(-1)
    chosen = lp.gather(1, tokens.long()[:, None])[:, 0]
    if not n:
        return (chosen,)
    top = lp.topk(n)
    return chosen, top.values, top.indices
