"""Speculative decoding: propose k tokens cheaply, score them in one verify graph call, keep the longest prefix
the target model agrees with (plus one token of its own).

- Proposers (the `Proposer` protocol):
  prompt lookup (`method="ngram"`, vLLM's name). The last n tokens of the sequence (n from `prompt_lookup_max`
  down to `prompt_lookup_min`) are searched for earlier in the prompt and the text so far; the k tokens that
  followed their most recent earlier occurrence are the proposal. No model, no device work; pays on
  input-grounded text (repeating, editing, quoting the prompt).
  a draft model (`method="draft_model"`, `model=`): a smaller model with the same tokenizer, run by its own
  ModelRunner (its own artifact and buckets, or eager) with its own KV slot per sequence, decodes k tokens
  greedily. It keeps the tokens its slot holds K/V for and, each step, first feeds what the target emitted
  since (the bonus token, and the last proposal when all were accepted): no rollback, only a shorter prefix.
  an EAGLE-3 head (`method="eagle3"`, `model=` its directory; runtime/eagle3.py): one decoder layer over the
  target's own hidden states, which the engine hands over after each graph call (`observe_hidden`), chained k
  steps greedily with its own one-layer KV in the target's blocks.
- Acceptance (`accept`), position by position over the verify logits, with the request's own sampling
  (penalties, banned tokens, temperature, min-p/top-k/top-p) applied to each position's logits exactly as
  `sample_one` does for a decode step:
  greedy: the proposed token is accepted while it equals the argmax; the first mismatch emits the argmax.
  sampling: a proposal is a point mass q = delta(d), so rejection sampling (Leviathan et al. 2023) accepts d with
  probability min(1, p(d) / q(d)) = p(d), and on rejection samples from max(0, p - q) normalised = p with d
  removed. Either way the emitted tokens are distributed exactly as non-speculative sampling from p.
  When every proposal is accepted the last position's logits give one more token (the "bonus" token).
  The uniform numbers come from the request's generator in a fixed order (one per tested proposal, one for the
  residual or bonus token's inverse-CDF draw), so an executor that accepts in its graphs (the neuron backend:
  `accept_device`, inputs from runtime.sampling.verify_inputs) emits the host verifier's tokens.
- Greedy output is identical token for token to non-speculative greedy decoding (tested).
  Its proposal is a deterministic function of the sequence (greedy), so the point-mass acceptance below is
  exact for it too, whatever the request's sampling.
- When it pays (`SpecController`): a verify step of batch B costs r(B) plain steps (measured online, an EMA per
  phase and batch bucket of the whole step: proposing, then the graph call). A row whose proposals are accepted
  with rate a (an EMA per sequence; with prompt lookup also updated on plain decode steps by comparing the sampled
  token with the first proposed one) yields E = (1 - a^(n+1)) / (1 - a) tokens from a verify call with n proposals.
  The step speculates iff the mean E over its rows is >= r(B); otherwise it decodes, and prompt lookup's proposals
  still feed the acceptance estimate. Prompt lookup proposes first and decides on what it found; a draft model
  costs a graph call per token, so the step decides on the lengths it would propose and a plain step asks the draft
  for nothing (its slots fall behind and catch up, in one prefill call, when it next proposes). Until both phases
  are measured at a batch bucket, one verify step and then one plain step measure them; after `explore_every` plain
  steps in a row one verify step re-measures the acceptance (a draft's is seen only when it verifies), and each
  such step that the rule then still refuses doubles the gap to the next (up to `max_explore_gap`).
- The engine's side (`SpeculativeDecoding`, one per engine): each decode step it budgets every row (at most k,
  none past the request's max_tokens or the verify graph's reach), proposes, trims a grammar's proposals to what
  the grammar allows, and asks the controller (`plan` -> `SpecStep`); after the graph call it accepts each verify
  row (`accept`) and feeds the measurements back. The engine does the rest: the graph call, sampling a plain
  step's rows, output processing.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from neuron_opt.buckets import pick_decode
from neuron_opt.errors import ConfigError
from neuron_opt.runtime.eagle3 import Eagle3Proposer, SeqBlocks
from neuron_opt.runtime.request import Request
from neuron_opt.runtime.runner import DecodeRow, ModelRunner, PrefillRow
from neuron_opt.runtime.sampling import (
    SampleResult,
    SamplerState,
    advance,
    filtered_rows,
    processed_logits,
    result_for,
    sample_one,
)
from neuron_opt.runtime.scheduler import DecodeWork
from neuron_opt.runtime.structured import GrammarState
from neuron_opt.sample_ops import accept_probability, residual_rows

if TYPE_CHECKING:
    from models.eagle3 import Eagle3Head

log = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model", "eagle3")
MODEL_METHODS = ("draft_model", "eagle3")  # the methods that take a model (`SpeculativeConfig.model`)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` fields: prompt lookup (`ngram`) or a draft model (`draft_model`, `model` = its
    artifact or checkpoint; the engine is handed the draft's runner, see `Engine(draft=...)`)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1  # single-token matches too: measured better than 2 (scripts/bench_spec.py)
    adaptive: bool = True  # speculate only in steps where the measured acceptance says it pays
    model: str | None = None  # the draft model (method "draft_model") or EAGLE-3 head (method "eagle3")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_method: {self.method!r} is not one of {', '.join(METHODS)}",
                              param="speculative_method")
        if (self.method in MODEL_METHODS) != (self.model is not None):
            raise ConfigError(("speculative_model: the draft_model method needs a draft model (--speculative-model "
                               "PATH|ARTIFACT)" if self.method == "draft_model" else
                               f"speculative_model: the {self.method} method needs a model: an EAGLE-3 head "
                               "(--speculative-model PATH)") if self.model is None else
                              f"speculative_model: {self.model!r} is a draft model; the {self.method} method takes "
                              "none (use --speculative-method draft_model or eagle3, or leave the method unset)",
                              param="speculative_model")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens: must be >= 1, got {self.num_speculative_tokens}",
                              param="num_speculative_tokens")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min/max: need 1 <= min <= max, got {self.prompt_lookup_min} and "
                              f"{self.prompt_lookup_max}", param="prompt_lookup_min")


class Proposer(Protocol):
    cheap: bool  # proposing costs no graph call: propose first, then decide whether to verify

    def propose_batch(self, items: Sequence[tuple[str, list[int], int]]) -> list[list[int]]:
        """For each (request id, token ids so far, k): up to k tokens likely to follow (may be empty)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: drop what is kept for it."""
        ...


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: continue the most recent earlier occurrence of the sequence's last n tokens."""

    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    cheap: bool = field(default=True, init=False)

    def propose_batch(self, items: Sequence[tuple[str, list[int], int]]) -> list[list[int]]:
        return [self.propose(ids, k) if k > 0 else [] for _, ids, k in items]

    def forget(self, request_id: str) -> None:
        pass

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


# a draft slot behind the sequence by more than this many tokens catches up with one prefill call (from where it
# diverged where the draft has offset prefill buckets, else from the start), fewer with decode steps
CATCH_UP_DECODES = 4


def _by_prefill(start: int, n: int) -> bool:
    """Whether `n` tokens fed from position `start` run as one prefill call (else as decode steps)."""
    return start == 0 or n > CATCH_UP_DECODES


def check_draft_tokenizer(draft: Any, target: Any, model: str | Path) -> None:
    """A draft model must tokenize as the target does: the same vocabulary (ConfigError otherwise)."""
    if draft.get_vocab() != target.get_vocab():
        raise ConfigError(f"speculative_model: {model}'s tokenizer differs from the target's; a draft model must "
                          "share the target's vocabulary", param="speculative_model")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    a_, b_ = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(a_ != b_)
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class _DraftRow:
    index: int  # in the propose_batch items
    slot: int  # the draft's KV slot
    start: int  # position of feed[0]
    feed: list[int]  # tokens to run before proposing (the last one's logits give the first proposal)
    k: int


class DraftModelProposer:
    """A draft model's greedy continuation, k tokens per sequence, batched over the sequences of a step.

    Every sequence gets one of the draft's KV slots (its runner's `slot_blocks` layout) for its lifetime;
    `known[request id]` lists the tokens whose K/V that slot holds, in position order. To propose after
    `token_ids` (length L) the slot must hold token_ids[:L - 1]: the tokens past the common prefix of `known` and
    `token_ids` are fed first (in step-aligned decode calls, or one prefill call when there are more than
    CATCH_UP_DECODES), the last one's logits give the first proposal, and each proposal is then decoded for the
    next. The last proposal is never fed, so after a verify the slot is behind by the target's own token (and,
    when every proposal was accepted, by the last proposal too): one or two tokens to feed next time. Rejected
    proposals need no rollback: they lie past the common prefix and are overwritten.

    A failing draft call proposes nothing for that step (the target decodes as usual) and forgets the slots' state.
    """

    cheap = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_slots = runner.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.slot: dict[str, int] = {}
        self.known: dict[str, list[int]] = {}
        self.draft_calls = 0  # graph calls of the draft (decode and prefill), for tests and benchmarks

    def forget(self, request_id: str) -> None:
        if (slot := self.slot.pop(request_id, None)) is not None:
            self._free.append(slot)
        self.known.pop(request_id, None)

    def _feed(self, request_id: str, ids: list[int]) -> tuple[int, list[int]] | None:
        """(start position, tokens to run) so that the slot holds ids[:-1] and the last one's logits come out;
        None when the draft cannot take the sequence (no slot left, or a prompt longer than its prefill reach)."""
        if request_id not in self.slot:
            if not self._free:
                return None
            self.slot[request_id] = self._free.pop()
            self.known[request_id] = []
        c = min(_common_prefix(self.known[request_id], ids), len(ids) - 1)
        if len(ids) - c > CATCH_UP_DECODES and not self.runner.buckets.offset_prefill:
            c = 0  # no offset prefill buckets: a long catch-up prefills the whole sequence again
        if _by_prefill(c, len(ids) - c) and len(ids) - c > self.runner.max_prompt_len:
            return None  # longer than one prefill call of the draft reaches
        return c, ids[c:]

    def propose_batch(self, items: Sequence[tuple[str, list[int], int]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in items]
        rows = []
        for i, (rid, ids, k) in enumerate(items):
            if k < 1 or len(ids) - 1 + k > self.runner.max_model_len:
                continue
            if (fed := self._feed(rid, ids)) is not None:
                rows.append(_DraftRow(i, self.slot[rid], fed[0], fed[1], k))
        if not rows:
            return out
        try:
            self._run(rows, out)
        except Exception:
            log.error("draft model failed; this step proposes nothing:\n%s", traceback.format_exc())
            for row in rows:
                self.known[items[row.index][0]] = []
            return [[] for _ in items]
        for row in rows:
            rid, ids, _ = items[row.index]
            self.known[rid] = list(ids) + out[row.index][:-1]  # the last proposal is never fed
        return out

    def _run(self, rows: list[_DraftRow], out: list[list[int]]) -> None:
        r = self.runner
        last: dict[int, torch.Tensor] = {}  # item index -> logits after its fed tokens
        long = [row for row in rows if _by_prefill(row.start, len(row.feed))]
        for j in range(0, len(long), r.buckets.prefill_batch):
            group = long[j:j + r.buckets.prefill_batch]
            logits = r.prefill_rows([PrefillRow(row.slot, tuple(row.feed), row.start) for row in group], candidates=1)
            self.draft_calls += 1
            last.update({row.index: logits[n] for n, row in enumerate(group)})
        short = [row for row in rows if row.index not in last]
        width = max((len(row.feed) for row in short), default=0)
        for t in range(width):  # aligned on the last fed token: a row with f tokens joins at step width - f
            step = [(row, row.feed[t - width + len(row.feed)], row.start + t - width + len(row.feed))
                    for row in short if t >= width - len(row.feed)]
            logits = self._decode(step)
            if t == width - 1:
                last.update({row.index: logits[n] for n, (row, *_) in enumerate(step)})
        for i, logits_i in last.items():
            out[i].append(int(torch.argmax(logits_i).item()))
        for n in range(1, max(row.k for row in rows)):  # proposal n - 1 is decoded for proposal n
            step = [(row, out[row.index][-1], row.start + len(row.feed) + n - 1) for row in rows if row.k > n]
            logits = self._decode(step)
            for m, (row, *_) in enumerate(step):
                out[row.index].append(int(torch.argmax(logits[m]).item()))

    def _decode(self, step: list[tuple[_DraftRow, int, int]]) -> torch.Tensor:
        """(row, token, position) through the draft's decode graphs, as many calls as its largest decode batch
        needs; greedy logits [len(step), V]."""
        cap = self.runner.buckets.decode_batches[-1]
        parts = []
        for j in range(0, len(step), cap):
            parts.append(self.runner.decode([DecodeRow(row.slot, tok, p) for row, tok, p in step[j:j + cap]],
                                            candidates=1))
            self.draft_calls += 1
        return torch.cat(parts)


def accept_device(out: dict[str, torch.Tensor], draft: list[int], state: SamplerState) -> list[SampleResult]:
    """`accept` for a verify row whose acceptance ran in the graph (neuron_opt.sample_ops.verify_rows, inputs from
    runtime.sampling.verify_inputs): the proposals while the graph accepted them, then the token it drew where the
    run stopped; `out`: the row's named outputs [q] (sample_ops.verify_outputs). The request's generator moves past
    the uniform numbers the host verifier would have drawn (one per tested proposal, one for the token that ends
    the run), so its stream goes on as if the host had accepted."""
    res: list[SampleResult] = []
    n = state.params.logprobs
    for j in range(len(draft) + 1):
        take = j < len(draft) and bool(out["accept"][j])
        token = draft[j] if take else int(out["ids"][j])
        advance(state, 1 if take or j == len(draft) else 2)
        if n is None:
            res.append(SampleResult(token))
        else:
            tops = tuple(zip(out["top_ids"][j, :n].tolist(), out["top"][j, :n].tolist(), strict=True)) if n else ()
            res.append(SampleResult(token, float(out["draft" if take else "chosen"][j]), tops))
        state.observe(token)
        if not take or state.grammar_done:  # a grammar that ends on an accepted proposal: nothing may follow it
            return res
    return res


def accept(
    logits: torch.Tensor, draft: list[int], state: SamplerState, banned_for: list[tuple[int, ...]]
) -> list[SampleResult]:
    """Tokens to emit from one verify row: the accepted prefix of `draft`, then one token of the target's own.

    A sampled row tests proposal j with one uniform number of its generator (accepted below p(d_j) in the filtered
    distribution: neuron_opt.sample_ops.accept_probability) and on rejection draws its token with the next one by
    inverse CDF from that distribution without d_j (`residual_rows`); the bonus token is a plain draw
    (`sample_one`). A device graph that accepts in the graph runs the same operations (`accept_device`).

    Args:
        logits: [len(draft) + 1 or more, V] fp32; row j holds the target's logits for the token after the j-th
            scored token (row 0 follows the last accepted token, row j the j-th proposal).
        draft: the proposed tokens.
        state: the request's sampler state; `observe` is called here for every emitted token, in order, so
            penalties and the grammar's mask at position j follow the tokens accepted before it (nothing is
            emitted after the token that ends the grammar).
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
            if token != d or state.grammar_done:
                return out
            continue
        z = filtered_rows(logits_j[None], [p])  # [1, V]
        match = torch.zeros_like(z, dtype=torch.bool)
        match[0, d] = True
        u = torch.rand((), generator=state.generator)
        if bool(u < accept_probability(z, match)[0]):
            res = result_for(d, logits_j, state)
            out.append(res)
            state.observe(d)
            if state.grammar_done:  # the grammar ended on an accepted proposal: nothing may follow it
                return out
            continue
        token = int(residual_rows(z, match, torch.rand((), generator=state.generator)[None])[0])
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
    explore_every: int = 32  # plain steps in a row (that could have verified) before one verify re-measures
    max_explore_gap: int = 1024
    plain_run: int = 0
    explore_gap: int = 0  # the current gap; 0: explore_every
    acceptance: dict[str, float] = field(default_factory=dict)  # request id -> EMA of per-token acceptance
    step_time: dict[tuple[str, int], float] = field(default_factory=dict)  # (phase, batch bucket) -> EMA seconds

    def expected_tokens(self, request_id: str, n: int) -> float:
        a = min(self.acceptance.get(request_id, self.prior_acceptance), 0.999)
        return (1.0 - a ** (n + 1)) / (1.0 - a)

    def cost_ratio(self, batch: int) -> float | None:
        """Verify over decode step time at this batch bucket; None until both have been measured."""
        v, d = self.step_time.get(("verify", batch)), self.step_time.get(("decode", batch))
        return v / d if v and d else None

    def should_verify(self, lengths: dict[str, int], batch: int) -> bool:
        """`lengths`: request id -> tokens proposed (or that would be) for each row of the step."""
        if not any(lengths.values()):
            return False
        if not self.adaptive:
            return True
        ratio = self.cost_ratio(batch)
        if ratio is None:  # measure each phase once: a verify step first, then a plain one
            return ("verify", batch) not in self.step_time
        mean = sum(self.expected_tokens(r, n) for r, n in lengths.items()) / len(lengths)
        gap = self.explore_gap or self.explore_every
        if mean >= ratio:
            self.plain_run, self.explore_gap = 0, self.explore_every
            return True
        self.plain_run += 1
        if self.plain_run >= gap:  # explore; if the rule still refuses after it, wait twice as long next time
            self.plain_run, self.explore_gap = 0, min(2 * gap, self.max_explore_gap)
            return True
        return False

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


@dataclass(frozen=True)
class SpecStep:
    """What one decode step of the engine runs: a verify of `proposals` (request id -> tokens; rows without any
    ride along with their single token) or a plain decode (`verify` False; prompt lookup's proposals are still
    there, to measure acceptance against the sampled token)."""

    verify: bool
    proposals: dict[str, list[int]]
    batch: int  # the decode batch bucket of the step: what the cost ratio is kept per
    skipped: bool  # it could have verified; the controller chose a plain decode


class SpeculativeDecoding:
    """The engine's speculative policy: per decode step, what each row may use of a proposal, the proposals, the
    controller's verify-or-decode choice (`plan`); then the acceptance of a verify row (`accept`) and the
    measurements the controller learns from. Holds the proposer, the controller and the counters (`stats`).

    Args:
        config: the speculative settings.
        runner: the target's runner (must have verify graphs of k + 1 tokens).
        draft: the draft model's runner, for the draft_model method; the EAGLE-3 head (api.load_eagle3), for
            eagle3; None otherwise.
        max_num_seqs: sequences the engine runs at once (the draft needs a KV slot for each).
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, draft: ModelRunner | Eagle3Head | None,
                 max_num_seqs: int) -> None:
        k = config.num_speculative_tokens
        if runner.verify_len != k + 1:
            have = runner.verify_len - 1 if runner.verify_len else 0
            raise ConfigError(
                f"num_speculative_tokens: {k} needs verify graphs of {k + 1} tokens; this model has "
                + (f"them for {have} (use --num-speculative-tokens {have})" if have
                   else "none (compile with --num-speculative-tokens K)"), param="num_speculative_tokens")
        if (draft is not None) != (config.method in MODEL_METHODS):
            raise ConfigError("speculative_model: a draft runner goes with the draft_model method, and an EAGLE-3 "
                              f"head with eagle3; the {config.method} method "
                              + ("takes none" if draft is not None else "needs one"), param="speculative_model")
        self.config, self.runner = config, runner
        self.controller = SpecController(k, config.adaptive)
        self.proposer: Proposer | Eagle3Proposer
        if config.method == "eagle3":
            self.proposer = self._eagle3_proposer(draft)
        elif config.method == "draft_model":
            if not isinstance(draft, ModelRunner):
                raise ConfigError("speculative_model: the draft_model method takes a draft model's runner",
                                  param="speculative_model")
            self.proposer = self._draft_proposer(draft, max_num_seqs)
        else:
            self.proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        self.stats = SpecStats()

    def _eagle3_proposer(self, head: Any) -> Eagle3Proposer:
        """The head (api.load_eagle3 checked it against the model) reads the layers it names, at every position
        the target reaches."""
        from models.eagle3 import Eagle3Head  # here: the CLI's parser imports this module for SpeculativeConfig

        if not isinstance(head, Eagle3Head):
            raise ConfigError("speculative_model: the eagle3 method takes an EAGLE-3 head (api.load_eagle3)",
                              param="speculative_model")
        if not head.aux_layer_ids:
            raise ConfigError("speculative_model: the eagle3 head was not checked against the model "
                              "(api.load_eagle3 does)", param="speculative_model")
        if head.max_model_len < self.runner.max_model_len:
            raise ConfigError(f"speculative_model: the eagle3 head reaches position {head.max_model_len - 1}, the "
                              f"model {self.runner.max_model_len - 1}", param="speculative_model")
        self.runner.capture_aux_hidden(head.aux_layer_ids)
        return Eagle3Proposer(head, self.runner.cache, self.runner.eagle3_chain(head))

    @property
    def wants_hidden(self) -> bool:
        """The proposer reads the target's auxiliary hidden states: the engine hands each graph call's over
        (`observe_hidden`)."""
        return isinstance(self.proposer, Eagle3Proposer)

    def observe_hidden(self, request_id: str, start: int, aux: torch.Tensor) -> None:
        """The target ran the request's tokens at positions start.. with these states [n, A] (`wants_hidden`)."""
        if isinstance(self.proposer, Eagle3Proposer):
            self.proposer.observe_hidden(request_id, start, aux)

    def _draft_proposer(self, draft: ModelRunner, seqs: int) -> DraftModelProposer:
        """The draft must hold a KV slot per running sequence and reach every position the target does."""
        prop = DraftModelProposer(draft)
        target = self.runner
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(f"speculative_model: the draft's vocabulary has {draft.vocab_size} tokens, the "
                              f"target's {target.vocab_size}; a draft model must share the target's tokenizer",
                              param="speculative_model")
        if prop.num_slots < seqs:
            raise ConfigError(f"speculative_model: the draft holds KV for {prop.num_slots} sequence(s), the engine "
                              f"runs up to {seqs}; compile the draft with --batch-size {seqs} (or lower "
                              "--max-num-seqs)", param="speculative_model")
        if draft.max_model_len < target.max_model_len:
            raise ConfigError(f"speculative_model: the draft's max_model_len is {draft.max_model_len}, the target's "
                              f"{target.max_model_len}; compile the draft with --max-model-len "
                              f"{target.max_model_len}", param="speculative_model")
        return prop

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def _budget(self, d: DecodeWork, req: Request) -> int:
        """How many tokens the sequence could use from a proposal: at most k, none past its max_tokens or the
        verify graph's reach into the KV cache."""
        k = min(self.controller.num_speculative_tokens, req.max_tokens - len(req.output_token_ids) - 1)
        return 0 if k < 1 or d.position + self.runner.verify_len > self.runner.max_model_len else k

    def _propose(self, decodes: Sequence[DecodeWork], reqs: Sequence[Request],
                 grammars: Sequence[GrammarState | None], budget: dict[str, int]) -> dict[str, list[int]]:
        items = [(d.request_id, r.prompt_token_ids + r.output_token_ids, budget[d.request_id])
                 for d, r in zip(decodes, reqs, strict=True)]
        if isinstance(self.proposer, Eagle3Proposer):  # the head's KV lives in the rows' blocks
            got = self.proposer.propose_batch(items, [SeqBlocks(d.blocks, r.cache_tokens(), r.cache_salt)
                                                      for d, r in zip(decodes, reqs, strict=True)])
        else:
            got = self.proposer.propose_batch(items)
        out = {rid: p for (rid, _, _), p in zip(items, got, strict=True)}
        for d, grammar in zip(decodes, grammars, strict=True):  # a grammar's request verifies only what it allows
            p = out[d.request_id]
            if grammar is not None and p:
                out[d.request_id] = p[:grammar.valid_prefix(p)]
        return out

    def plan(self, decodes: Sequence[DecodeWork], reqs: Sequence[Request],
             grammars: Sequence[GrammarState | None]) -> SpecStep:
        """The step for these running sequences (`reqs`, `grammars`: each row's request and grammar state or
        None). Prompt lookup proposes first and the controller decides on what it found; a draft model costs graph
        calls, so the controller decides on the lengths it could propose and a plain step asks it for nothing."""
        batch = pick_decode(len(decodes), max(d.position for d in decodes), self.runner.buckets).batch
        budget = {d.request_id: self._budget(d, r) for d, r in zip(decodes, reqs, strict=True)}
        if self.proposer.cheap:
            proposals = self._propose(decodes, reqs, grammars, budget)
            verify = self.controller.should_verify({r: len(p) for r, p in proposals.items()}, batch)
            return SpecStep(verify, proposals, batch, not verify and any(proposals.values()))
        verify = self.controller.should_verify(budget, batch)
        proposals = self._propose(decodes, reqs, grammars, budget) if verify else {}
        return SpecStep(verify and any(proposals.values()), proposals, batch, not verify and any(budget.values()))

    def observe_step(self, step: SpecStep, seconds: float) -> None:
        """The step ran in `seconds` (proposing and the graph call)."""
        self.controller.observe_step("verify" if step.verify else "decode", step.batch, seconds)
        if step.verify:
            self.stats.verify_steps += 1
        elif step.skipped:
            self.stats.skipped_steps += 1

    def accept(self, request_id: str, logits: torch.Tensor | dict[str, torch.Tensor], draft: list[int],
               state: SamplerState, banned_for: list[tuple[int, ...]]) -> list[SampleResult]:
        """`accept` for one verify row, counted in the stats and the request's acceptance estimate. A dict is the
        row's outputs of a graph that accepted in the graph (`accept_device`)."""
        results = (accept_device(logits, draft, state) if isinstance(logits, dict)
                   else accept(logits, draft, state, banned_for))
        if draft:
            st = self.stats
            st.drafts, st.draft_tokens, st.accepted_tokens = (st.drafts + 1, st.draft_tokens + len(draft),
                                                              st.accepted_tokens + len(results) - 1)
            self.controller.observe_acceptance(request_id, len(results) - 1, len(draft))
        return results

    def observe_decoded(self, request_id: str, draft: list[int], token: int) -> None:
        """A plain step sampled `token` where `draft` was proposed: the first proposal's acceptance, for free."""
        if draft:
            self.controller.observe_acceptance(request_id, int(token == draft[0]), 1)

    def preempted(self, request_id: str) -> None:
        """The request gave its KV blocks back (it runs again later): an EAGLE-3 head's entries went with them."""
        if isinstance(self.proposer, Eagle3Proposer):
            self.proposer.preempted(request_id)

    def forget(self, request_id: str) -> None:
        """The request finished: drop its acceptance estimate and the proposer's state (a draft's KV slot)."""
        self.controller.forget(request_id)
        self.proposer.forget(request_id)
