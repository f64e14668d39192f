"""Sampling: greedy, temperature, min-p, top-k, top-p, seed, logit_bias, presence/frequency penalties, grammars,
logprobs.

`temperature == 0` is greedy (argmax). A request with a seed draws from its own `torch.Generator`, so its
output does not depend on what else is in the batch. A step's rows are sampled together (`sample_batch`): one
argmax over the greedy rows, and for the others temperature, min-p, top-k and top-p as [rows, V] tensor operations
(one top-k to the largest k, one sort for the rows with top-p), then each row's token by inverse CDF from one
uniform number of its own generator. The filters and the draw are neuron_opt.sample_ops's, the definition a device
graph runs too: `device_inputs` turns a step's rows into that graph's inputs (the uniform numbers drawn here, from
the same generators), so a token sampled on the device is the one the host would have sampled.

The logits a row samples from (and its logprobs are computed from) are processed in one order, the same in the
batched and the single-row path: logit_bias is added, presence/frequency penalties subtracted, the grammar's mask
applied (structured outputs: runtime/structured.py), then banned tokens (EOS before min_tokens) set to -inf unless
that would leave no token, when the grammar's end wins; last, a token the thinking budget forces leaves only itself
(0, every other -inf). Each step touches only the rows and ids that have them.

Thinking budget (vLLM's `thinking_token_budget`, Anthropic's `thinking.budget_tokens`): a request with a
`ThinkingBudget` counts the tokens it generates inside its thinking (from the start if the prompt opened it, else
from the tokens of the start marker on); once it has `tokens` of them without writing the end marker, the end
marker's tokens are forced, one a step, and the answer follows. As vLLM's logits processor, markers are matched as
token id sequences (the tokenizer's encoding of the marker text). The budget covers the first thinking block only
(what the reasoning parsers read as the reasoning): once it has ended, nothing more is forced.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neuron_opt.errors import ConfigError
from neuron_opt.parallel.vocab import candidates_needed as needed
from neuron_opt.runtime.structured import GrammarState, StructuredOutputs, apply_grammar_masks
from neuron_opt.sample_ops import SamplingInputs, bit_set, draw_rows, filter_rows

MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI bounds it


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` generated tokens inside the thinking, then its end marker (`end_ids`) forced (module
    docstring). `inside`: the prompt opened the thinking; else it starts at the tokens `start_ids`."""

    tokens: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    inside: bool

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ConfigError(f"thinking_token_budget: must be >= 0, got {self.tokens}", param="thinking_token_budget")
        if not self.end_ids or not self.start_ids:
            raise ValueError("a thinking budget needs the start and end markers' token ids")


@dataclass
class _Thinking:
    """A request's place in its thinking (engine thread): inside it or not, the tokens it has had there, the end
    marker's next token to force (None: none), and whether the budgeted block is over."""

    inside: bool
    count: int = 0
    forcing: int | None = None
    over: bool = False
    recent: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # tokens below min_p x the most likely one's probability are dropped (0 = off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the chosen token)
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit) pairs
    structured: StructuredOutputs | None = None  # the grammar the output must match
    skip_special_tokens: bool = True  # special tokens the model writes are left out of the text
    # logprobs of the prompt's tokens (each after the first) and this many top ones per position, from the prefill's
    # logits at every position (the model's distribution: no penalties, bias or temperature); None: not computed
    prompt_logprobs: int | None = None
    thinking_budget: ThinkingBudget | None = None  # the thinking's end forced after this many of its tokens

    def __post_init__(self) -> None:
        # each error carries the field at fault (`param`): the HTTP server names it, whatever the message says
        def bad(name: str, rule: str) -> ConfigError:
            return ConfigError(f"{name}: {rule}, got {getattr(self, name)}", param=name)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ConfigError(f"logit_bias: token id {token} is negative", param="logit_bias")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ConfigError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}",
                                  param="logit_bias")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.temperature < 0:
            raise bad("temperature", "must be non-negative")
        if self.top_k < 0:
            raise bad("top_k", "must be 0 (disabled) or positive")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "must be in [0, 20]")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


    @property
    def needs_full_logits(self) -> bool:
        """A logit bias, a grammar or a forced token may promote any token: vocab-parallel TP gathers all logits for
        the row."""
        return bool(self.logit_bias) or self.structured is not None or self.thinking_budget is not None


@dataclass
class SamplerState:
    """Per-request mutable sampling state: its generator, the token counts penalties need, its grammar's state."""

    params: SamplingParams
    generator: torch.Generator | None = None
    counts: dict[int, int] = field(default_factory=dict)
    grammar: GrammarState | None = None
    _bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, biases) of params.logit_bias
    _thinking: _Thinking | None = None  # with params.thinking_budget

    @classmethod
    def create(cls, params: SamplingParams, grammar: GrammarState | None = None) -> SamplerState:
        """`grammar`: the request's grammar state, required exactly when `params.structured` is set."""
        if (grammar is None) != (params.structured is None):
            raise ValueError("a grammar state goes with structured outputs, and only with them")
        gen = None
        if not params.greedy:
            gen = torch.Generator()
            gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        bias = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            bias = (torch.tensor(ids, dtype=torch.long), torch.tensor(values, dtype=torch.float32))
        thinking = None
        if params.thinking_budget is not None:
            thinking = _Thinking(params.thinking_budget.inside)
            if thinking.inside and params.thinking_budget.tokens == 0:
                thinking.forcing = 0
        return cls(params, gen, grammar=grammar, _bias=bias, _thinking=thinking)

    @property
    def adjusts(self) -> bool:
        """Its logits change before masking: a logit bias, or penalties with tokens to count."""
        p = self.params
        return self._bias is not None or bool(self.counts and (p.presence_penalty or p.frequency_penalty))

    @property
    def grammar_done(self) -> bool:
        return self.grammar is not None and self.grammar.terminated

    @property
    def forced_token(self) -> int | None:
        """The token the thinking budget forces next (None: sampling chooses)."""
        t = self._thinking
        if t is None or t.forcing is None:
            return None
        assert self.params.thinking_budget is not None
        return self.params.thinking_budget.end_ids[t.forcing]

    def observe(self, token: int) -> None:
        """Record an emitted token: penalty counts, the grammar's next position, the thinking budget's count."""
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.grammar is not None:
            self.grammar.accept(token)
        if self._thinking is not None and not self._thinking.over:
            self._observe_thinking(token)

    def _observe_thinking(self, token: int) -> None:
        t, b = self._thinking, self.params.thinking_budget
        assert t is not None and b is not None
        if t.forcing is not None:
            t.forcing += 1
            if t.forcing == len(b.end_ids):
                t.forcing, t.inside, t.over = None, False, True
            return
        t.recent = [*t.recent, token][-max(len(b.start_ids), len(b.end_ids)):]
        if t.inside:
            if t.recent[-len(b.end_ids):] == list(b.end_ids):  # it closed its thinking itself
                t.inside, t.over = False, True
                return
            t.count += 1
        elif t.recent[-len(b.start_ids):] == list(b.start_ids):
            t.inside = True
        if t.inside and t.count >= b.tokens:
            t.forcing = 0


@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def _adjust(logits: torch.Tensor, st: SamplerState) -> torch.Tensor:
    """logits [V] + the request's logit bias - its presence/frequency penalties (a new tensor)."""
    p = st.params
    logits = logits.clone()
    if st._bias is not None:
        logits[st._bias[0]] += st._bias[1].to(logits.dtype)
    if st.counts and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
        ids = torch.tensor(list(st.counts), dtype=torch.long)
        cnt = torch.tensor(list(st.counts.values()), dtype=logits.dtype)
        logits[ids] -= p.frequency_penalty * cnt + p.presence_penalty
    return logits


def _ban(logits: torch.Tensor, banned: tuple[int, ...]) -> torch.Tensor:
    """logits [V] with `banned` at -inf, unless nothing would be left (a grammar that allows only those)."""
    if not banned:
        return logits
    out = logits.clone()
    out[list(banned)] = float("-inf")
    return out if bool(torch.isfinite(out).any()) else logits


def _force(logits: torch.Tensor, token: int) -> torch.Tensor:
    """logits [V] that leave only `token` (0; every other -inf)."""
    out = torch.full_like(logits, float("-inf"))
    out[token] = 0.0
    return out


def processed_logits(logits: torch.Tensor, st: SamplerState, banned: tuple[int, ...] = ()) -> torch.Tensor:
    """logits [V] after the request's bias, penalties, grammar mask, banned tokens (-inf) and a forced token: what
    greedy takes the argmax of and logprobs are computed from."""
    forced = st.forced_token
    if forced is not None:
        return _force(logits, forced)
    if st.adjusts:
        logits = _adjust(logits, st)
    if st.grammar is not None:
        rows = logits[None].clone()  # [1, V]
        apply_grammar_masks(rows, {0: st.grammar})
        logits = rows[0]
    return _ban(logits, banned)


def result_for(token: int, logits: torch.Tensor, st: SamplerState) -> SampleResult:
    """The chosen `token` with its logprobs (when the request asks for them) from processed `logits`."""
    p = st.params
    if p.logprobs is None:
        return SampleResult(token)
    lp = logits.log_softmax(-1)
    top = torch.topk(lp, p.logprobs) if p.logprobs else None
    tops = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
    return SampleResult(token, float(lp[token].item()), tops)


def sample_one(logits: torch.Tensor, st: SamplerState, banned: tuple[int, ...] = ()) -> SampleResult:
    """logits [V] fp32 -> one token. `banned` (e.g. EOS before min_tokens) gets -inf."""
    return sample_batch(logits[None], [st], [banned])[0]


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform number in [0, 1) from each row's generator [R]: the draw of its step."""
    return torch.stack([torch.rand((), generator=g) for g in generators])


def filtered_rows(logits: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """Processed logits [R, V] of sampled rows -> the logits each draws from: its temperature, then min-p, top-k
    and top-p (sample_ops.filter_rows; the filters no row uses are left out)."""
    z = logits / torch.tensor([p.temperature for p in ps], dtype=logits.dtype)[:, None]  # [R, V]
    V = z.shape[-1]
    ks = torch.tensor([p.top_k if 0 < p.top_k < V else 0 for p in ps])
    skip = tuple(name for name, used in (("min_p", any(p.min_p > 0 for p in ps)), ("top_k", bool(ks.any())),
                                         ("top_p", any(p.top_p < 1.0 for p in ps))) if not used)
    return filter_rows(z, ks, torch.tensor([p.top_p for p in ps]), torch.tensor([p.min_p for p in ps]),
                       k_max=int(ks.max()), skip=skip)


def sample_batch(logits: torch.Tensor, states: list[SamplerState],
                 banned: list[tuple[int, ...]]) -> list[SampleResult]:
    """logits [>= len(states), V] fp32 -> one token per state's row (`banned[i]`: ids row i may not take)."""
    B = len(states)
    logits = logits[:B]
    edits = [i for i, st in enumerate(states) if st.adjusts]
    masked = {i: st.grammar for i, st in enumerate(states) if st.grammar is not None}
    bans = [i for i in range(B) if banned[i]]
    forced = [(i, t) for i, st in enumerate(states) if (t := st.forced_token) is not None]
    if edits or masked or bans or forced:  # processed_logits' order, batched
        logits = logits.clone()
        for i in edits:
            logits[i] = _adjust(logits[i], states[i])
        if masked:
            apply_grammar_masks(logits, masked)
        for i in bans:
            logits[i] = _ban(logits[i], banned[i])
        for i, t in forced:
            logits[i] = _force(logits[i], t)
    tokens = torch.empty(B, dtype=torch.long)
    greedy = [i for i, st in enumerate(states) if st.params.greedy]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(-1)
    rows = [i for i, st in enumerate(states) if not st.params.greedy]
    if rows:
        z = filtered_rows(logits[rows], [states[i].params for i in rows])
        tokens[rows] = draw_rows(z, _uniforms([states[i].generator for i in rows]))
    out = tokens.tolist()
    return [result_for(out[i], logits[i], st) if st.params.logprobs is not None else SampleResult(out[i])
            for i, st in enumerate(states)]


def candidates_needed(params: SamplingParams, n_banned: int = 0) -> int | None:
    """Top logits per rank this request's sampling needs (None: the full distribution), for vocab-parallel TP."""
    return needed(params.greedy, params.top_k, params.top_p,
                  params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.needs_full_logits,
                  params.logprobs is not None, n_banned)


# logit_bias entries, and tokens with presence/frequency penalties, a row may carry into a device graph (each a
# [B, ADJUST_SLOTS] input); a row with more is sampled on the host that step
ADJUST_SLOTS = 64
DEVICE_TOP_LOGPROBS = 20  # a device graph returns this many top logprobs when any row asks for some


def host_sampling_reason(st: SamplerState | None, candidates: int | None) -> str | None:
    """Why this row's sampling must run on the host this step (None: a device graph can sample it exactly).
    `candidates`: the device's vocab-parallel candidates per rank (tp > 1), None where it holds the whole row."""
    if st is None:
        return None
    p = st.params
    if st._bias is not None and len(st._bias[0]) > ADJUST_SLOTS:
        return "logit_bias"
    if (p.presence_penalty or p.frequency_penalty) and len(st.counts) > ADJUST_SLOTS:
        return "penalties"
    if st.forced_token is not None and p.logprobs:
        return "forced_logprobs"  # the top logprobs of a forced row are ties at -inf, in no defined order
    if candidates is not None and not p.greedy and not 0 < p.top_k <= candidates:
        return "full_distribution"  # sampling over more than the ranks' candidates
    return None


def verify_host_reason(st: SamplerState, draft: list[int], candidates: int | None) -> str | None:
    """`host_sampling_reason` for a verify row that tests `draft`: also the penalised tokens once the proposals are
    counted, and a thinking budget's row with logprobs (a token it forces at some position has no top logprobs in a
    defined order)."""
    p = st.params
    if (p.presence_penalty or p.frequency_penalty) and len(set(st.counts) | set(draft)) > ADJUST_SLOTS:
        return "penalties"
    if st._thinking is not None and p.logprobs:
        return "forced_logprobs"
    return host_sampling_reason(st, candidates)


class _Rows:
    """A graph's sampling inputs (neuron_opt.sample_ops.SamplingInputs), written row by row from sampler states."""

    def __init__(self, n: int, vocab_size: int) -> None:
        A = ADJUST_SLOTS
        self.n, self.vocab_size = n, vocab_size
        self.temperature, self.top_p, self.min_p, self.u = torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
        self.top_k = torch.zeros(n, dtype=torch.long)
        self.bias_ids, self.bias = torch.zeros(n, A, dtype=torch.long), torch.zeros(n, A)
        self.pen_ids, self.pen = torch.zeros(n, A, dtype=torch.long), torch.zeros(n, A)
        self.mask: torch.Tensor | None = None
        self.sampled: list[SamplingParams] = []
        self.asks: list[int] = []

    def write(self, i: int, st: SamplerState, banned: tuple[int, ...], u: float) -> None:
        """Row i: `st` as it is now (its penalty counts, its grammar's next tokens, a forced token), `banned` ids
        masked (unless they would leave none: `_ban`), `u` the uniform number its draw takes (a sampled row)."""
        p = st.params
        if p.logprobs is not None:
            self.asks.append(p.logprobs)
        if not p.greedy:
            self.temperature[i], self.top_k[i], self.top_p[i], self.min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            self.u[i] = u
            self.sampled.append(p)
        if st._bias is not None:
            n = len(st._bias[0])
            self.bias_ids[i, :n], self.bias[i, :n] = st._bias
        if st.counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(st.counts), dtype=torch.long)
            cnt = torch.tensor(list(st.counts.values()), dtype=torch.float32)
            self.pen_ids[i, : len(ids)], self.pen[i, : len(ids)] = ids, p.frequency_penalty * cnt + p.presence_penalty
        forced = st.forced_token
        if st.grammar is None and not banned and forced is None:
            return
        if self.mask is None:
            self.mask = torch.full((self.n, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        mask = self.mask
        if forced is not None:
            mask[i] = 0
            mask[i, forced // 32] = _bit(forced % 32)
            return
        if st.grammar is not None:
            st.grammar.fill(mask, i)
        grammar_row = mask[i].clone()
        for t in banned:
            mask[i, t // 32] &= ~_bit(t % 32)
        if not bool(_allowed(mask[i], self.vocab_size).any()):  # nothing left: the grammar's end wins
            mask[i] = grammar_row

    def inputs(self, draft: torch.Tensor | None = None, u_accept: torch.Tensor | None = None) -> SamplingInputs:
        sampled, asks = self.sampled, self.asks
        skip = ("draw",) if not sampled else tuple(
            name for name, used in (("min_p", any(p.min_p > 0 for p in sampled)),
                                    ("top_k", any(p.top_k for p in sampled)),
                                    ("top_p", any(p.top_p < 1.0 for p in sampled))) if not used)
        return SamplingInputs(self.temperature, self.top_k, self.top_p, self.min_p, self.u, self.bias_ids, self.bias,
                              self.pen_ids, self.pen, self.mask, draft, u_accept,
                              (DEVICE_TOP_LOGPROBS if any(asks) else 0) if asks else None, skip)


def device_inputs(states: list[SamplerState | None], banned: list[tuple[int, ...]], vocab_size: int) -> SamplingInputs:
    """A step's rows as a device graph's sampling inputs (neuron_opt.sample_ops.SamplingInputs); a None state is
    a row that samples nothing (a prefill chunk before the prompt's last), run as greedy. Each sampled row's uniform
    number is the next draw of its generator, the one `sample_batch` would make; `device_results` takes it once the
    graph has run (a failed call leaves the streams where they were). Check every row with `host_sampling_reason`
    first. The allowed-token mask carries the grammar, the banned tokens (unless they
    would leave none: `_ban`) and a forced token (only itself)."""
    rows = _Rows(len(states), vocab_size)
    for i, st in enumerate(states):
        if st is not None:
            rows.write(i, st, banned[i], 0.0 if st.params.greedy else _peek(st.generator, 1)[0])
    return rows.inputs()


def verify_inputs(states: list[SamplerState], drafts: list[list[int]], banned_for: list[list[tuple[int, ...]]],
                  q: int, vocab_size: int) -> SamplingInputs:
    """A verify step's rows as a device graph's sampling inputs: one row per scored position (row r's position j at
    r * q + j), for a graph that accepts the proposals itself (neuron_opt.sample_ops.verify_rows). Position j is
    written as the request's state will be once `drafts[r][:j]` are accepted (their penalty counts, its grammar and
    thinking budget advanced; `banned_for[r][j]` masked), tests proposal j with the uniform number u_j of its
    generator and draws its residual token with u_{j+1}; the position after the last proposal draws the bonus
    token with the same number as the last one's residual (the host verifier's order: `speculative.accept`).
    Positions past a proposal that ends the grammar, and past the bonus, are greedy padding. Check every row with
    `verify_host_reason` first; `device_verified` takes the numbers used once the graph has run."""
    rows = _Rows(len(states) * q, vocab_size)
    draft_t, u_accept = torch.full((len(states) * q,), -1, dtype=torch.long), torch.zeros(len(states) * q)
    for r, (st, draft) in enumerate(zip(states, drafts, strict=True)):
        us = [0.0] * (len(draft) + 1) if st.params.greedy else _peek(st.generator, len(draft) + 1)
        with _Lookahead(st) as ahead:
            for j in range(len(draft) + 1):
                i = r * q + j
                rows.write(i, st, banned_for[r][j], us[min(j + 1, len(draft))])
                if j == len(draft):
                    break
                draft_t[i], u_accept[i] = draft[j], us[j]
                if not ahead(draft[j]):
                    break  # the grammar ends on this proposal: nothing after it is read
    return rows.inputs(draft_t, u_accept)


def warm_inputs(rows: int, vocab_size: int, top_k: int = 0, q: int = 0) -> list[SamplingInputs]:
    """The sampling inputs of a graph batch of `rows` rows, all greedy, then all sampled at temperature 1 (with
    `top_k`: the largest the vocab-parallel path samples), as `device_inputs` builds them (q > 0: `verify_inputs`
    of rows / q rows each testing q - 1 proposals): the graph shapes warmed at load (`ModelRunner.warm_sampling`).
    Each set of filters, the mask and logprobs are other shapes, compiled on first use."""
    out = []
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=top_k, seed=0)):
        if not q:
            states: list[SamplerState | None] = [SamplerState.create(params) for _ in range(rows)]
            out.append(device_inputs(states, [()] * rows, vocab_size))
            continue
        n = rows // q
        out.append(verify_inputs([SamplerState.create(params) for _ in range(n)], [[0] * (q - 1)] * n,
                                 [[()] * q] * n, q, vocab_size))
    return out


class _Lookahead:
    """Within it, `ahead(token)` observes a proposal into the state's penalty counts, thinking budget and grammar
    (False once the grammar has ended); on exit the state is as before."""

    def __init__(self, st: SamplerState) -> None:
        self.st, self.fed = st, 0
        self.counts, self.thinking = dict(st.counts), copy.deepcopy(st._thinking)

    def __enter__(self) -> Callable[[int], bool]:
        return self.ahead

    def ahead(self, token: int) -> bool:
        st = self.st
        st.counts[token] = st.counts.get(token, 0) + 1
        if st._thinking is not None and not st._thinking.over:
            st._observe_thinking(token)
        if st.grammar is None:
            return True
        st.grammar.accept(token)
        self.fed += 1
        return not st.grammar.terminated

    def __exit__(self, *exc: object) -> None:
        st = self.st
        st.counts, st._thinking = self.counts, self.thinking
        if self.fed:
            assert st.grammar is not None
            st.grammar.rollback(self.fed)


def _peek(g: torch.Generator | None, n: int) -> list[float]:
    """The next `n` uniform numbers of `g`, one at a time (as the host sampler draws them), leaving `g` where it
    is."""
    assert g is not None
    ahead = torch.Generator()
    ahead.set_state(g.get_state())
    return [float(torch.rand((), generator=ahead)) for _ in range(n)]


def _bit(b: int) -> int:
    """Bit b of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << b) - (1 << 32) * (b == 31)


def _allowed(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    v = torch.arange(vocab_size)
    return bit_set(words[v // 32], v)


def advance(st: SamplerState, n: int) -> None:
    """Move a sampled request's generator past the `n` uniform numbers a device graph used (`verify_inputs`)."""
    if not st.params.greedy:
        for _ in range(n):
            _uniforms([st.generator])


def device_results(tokens: list[int], logprobs: tuple[torch.Tensor, ...] | None,
                   states: list[SamplerState]) -> list[SampleResult]:
    """A device graph's sampled tokens (and its chosen / top logprobs) as each row's SampleResult; each sampled
    row's generator moves past the draw the graph used (`device_inputs`)."""
    out = []
    for i, st in enumerate(states):
        if not st.params.greedy:
            _uniforms([st.generator])
        n = st.params.logprobs
        if n is None or logprobs is None:
            out.append(SampleResult(tokens[i]))
            continue
        tops = ()
        if n:
            tops = tuple(zip(logprobs[2][i, :n].tolist(), logprobs[1][i, :n].tolist(), strict=True))
        out.append(SampleResult(tokens[i], float(logprobs[0][i]), tops))
    return out
