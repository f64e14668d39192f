"""The vocab-parallel LM head's last step: from per-rank logit shards to what the sampler sees.

Each rank holds logits [B, V/tp] for its slice of the (padded) vocabulary. Two ways to finish:

- full: all-gather the shards -> [B, V_pad] fp32. Needed when a request uses the whole distribution
  (top-p, logprobs, presence/frequency penalties, banned tokens beyond the candidate budget).
- candidates (sampling on the ranks): each rank keeps its top-K (value, global id) pairs and only those are
  gathered: tp x B x K x 12 bytes instead of B x V x 4. The driver scatters them into a [B, V] tensor of -inf,
  which the unchanged sampler then reads. That is exact for greedy (K >= 1: the global max is some rank's max)
  and for top-k sampling with top_k <= K (the global top-k are inside the union of the ranks' top-K; after
  the sampler's own top-k filter the tensor is identical to filtering the full logits).

`candidates_needed` is the rule the runner applies per batch.
"""

from __future__ import annotations

import torch

from neuron_opt.parallel.context import Collectives


def mask_padded_vocab(local: torch.Tensor, rank: int, vocab_size: int) -> torch.Tensor:
    """Padding rows of the LM head give logit 0, which could win an argmax: set them to -inf."""
    v_local = local.shape[-1]
    gid = torch.arange(rank * v_local, (rank + 1) * v_local)
    return local.masked_fill(gid >= vocab_size, float("-inf"))


def gather_full(local: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """[B, V/tp] -> [B, V_pad] on every rank (one all-gather)."""
    return comm.all_gather(local, dim=1)


def gather_candidates(
    local: torch.Tensor, rank: int, k: int, comm: Collectives
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V/tp] -> (values [B, tp*K] fp32, global ids [B, tp*K] int64) on every rank (two all-gathers)."""
    k = min(k, local.shape[-1])
    vals, idx = torch.topk(local, k, dim=-1)  # [B, K]
    gid = idx + rank * local.shape[-1]
    return comm.all_gather(vals.contiguous(), dim=1), comm.all_gather(gid.contiguous(), dim=1)


def scatter_candidates(
    values: torch.Tensor, ids: torch.Tensor, vocab_padded: int, vocab_size: int
) -> torch.Tensor:
    """Candidates -> fp32 logits [B, V] that are -inf outside the candidates."""
    out = torch.full((values.shape[0], vocab_padded), float("-inf"), dtype=torch.float32)
    out.scatter_(1, ids, values.float())
    return out[:, :vocab_size]


def candidates_needed(
    greedy: bool, top_k: int, top_p: float, penalties: bool, logprobs: bool, n_banned: int
) -> int | None:
    """How many candidates per rank one request needs, or None if it needs the full logits.

    Args:
        greedy: temperature == 0.
        top_k: the request's top_k (0 = off).
        top_p: the request's top_p (< 1 needs the full distribution's mass).
        penalties: presence/frequency penalties, a logit bias or a grammar mask are active (they re-rank
            arbitrary tokens).
        logprobs: logprobs are requested (log_softmax needs the full normaliser).
        n_banned: tokens the sampler will set to -inf (e.g. EOS before min_tokens); each may cost a candidate.
    """
    if penalties or logprobs or top_p < 1.0:
        return None
    if greedy:
        return 1 + n_banned
    if top_k > 0:
        return top_k + n_banned
    return None
