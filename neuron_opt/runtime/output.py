"""Output processing: what a request's sampled tokens mean for its caller.

The engine samples tokens; this module turns them into the request's text (incremental detokenization), decides
when it is finished (EOS and stop token ids, stop strings, max_tokens, the end of its grammar) and with which
finish reason, and packs each step's news into a `RequestOutput` for the request's callback: the new tokens,
their text delta (stop-string prefixes held back until resolved: runtime/stopping.py), their logprobs.

- A step hands over one token per request (a decode or a prefill's last chunk) or several (a verify's accepted
  proposals plus the target's own token). They are taken in order up to the first that finishes the request;
  the rest are dropped, so a stop string or EOS inside accepted proposals ends the text exactly where plain
  decoding would.
- Finish reasons: "stop" (EOS, a stop token id or stop string, or the grammar's end), "length" (max_tokens),
  "abort" (cancelled, or the engine stopped) and "error" (a failed runner call; the output carries the message,
  and the exception for callers in the same process).
- `collect` joins one request's outputs into a `GenerationOutput`, the synchronous API's result.

Engine-thread only, like the rest of a request's state: nothing here is locked.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from neuron_opt.runtime.sampling import SampleResult, SamplingParams
from neuron_opt.runtime.stopping import StopChecker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs)


@dataclass(frozen=True)
class RequestOutput:
    """One engine step's news for one request (its new tokens, or the end)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # with "stop": the stop string or stop token id that matched (None: EOS)
    num_cached_tokens: int = 0  # in the finished output: prompt tokens taken from the prefix cache
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None
    time: float = 0.0  # time.monotonic() when the token was produced
    scheduled_time: float = 0.0  # in a finished output: time.monotonic() when first scheduled (0: never)
    # in a request's first output, with SamplingParams.prompt_logprobs: one per prompt token (None for the first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # the runner's exception behind an "error" (for a caller in this process; never sent over the wire)
    exception: BaseException | None = field(default=None, repr=False, compare=False)
    # an embedding request's pooled vector, fp32 [H] (a torch tensor), in its one finished output
    embedding: Any = field(default=None, repr=False, compare=False)


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """Row i's logprob of token targets[i] under logits [n, V] (the model's distribution), its rank, and the top
    `k` (prompt logprobs: row i holds the logits that predict targets[i])."""
    lp = logits.float().log_softmax(-1)  # [n, V]
    t = torch.tensor(list(targets), dtype=torch.long)
    chosen = lp[torch.arange(len(t)), t]  # [n]
    ranks = (lp > chosen[:, None]).sum(-1) + 1  # [n]
    top = torch.topk(lp, k) if k else None
    out = []
    for i, tok in enumerate(t.tolist()):
        pairs = tuple(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True)) if top is not None else ()
        out.append(TokenLogprob(tok, float(chosen[i]), pairs, int(ranks[i])))
    return out


def model_eos_token_ids(config_eos_token_ids: Sequence[int], tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a sequence: the model config's end tokens and the tokenizer's EOS, sorted."""
    ids = set(config_eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def send(on_output: Callable[[RequestOutput], object], out: RequestOutput) -> None:
    """Hand `out` to its callback; a broken callback (e.g. a closed event loop) must not take the engine down."""
    try:
        on_output(out)
    except Exception:
        log.warning("output callback failed for %s:\n%s", out.request_id, traceback.format_exc())


@dataclass
class _Stream:
    params: SamplingParams
    stop: StopChecker
    num_prompt_tokens: int
    on_output: Callable[[RequestOutput], object]


class OutputProcessor:
    """Per request: its detokenizer and stop checks (`StopChecker`), and the callback its outputs go to.

    Args:
        tokenizer: the model's tokenizer (incremental detokenization, stop strings).
        eos_token_ids: the tokens that end a sequence unless `ignore_eos`; banned before `min_tokens`.
    """

    def __init__(self, tokenizer: object, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, tuple(eos_token_ids)
        self._streams: dict[str, _Stream] = {}

    def add(self, request_id: str, params: SamplingParams, num_prompt_tokens: int,
            on_output: Callable[[RequestOutput], object]) -> None:
        self._streams[request_id] = _Stream(params, StopChecker(self.tokenizer, params, self.eos_token_ids),
                                            num_prompt_tokens, on_output)

    def banned(self, request_id: str, ahead: int = 0) -> tuple[int, ...]:
        """The tokens the request may not emit `ahead` tokens from now: its EOS ids until `min_tokens` are out."""
        s = self._streams[request_id]
        return self.eos_token_ids if len(s.stop.token_ids) + ahead < s.params.min_tokens else ()

    def ends_on(self, request_id: str, token: int, grammar_done: bool = False) -> bool:
        """Whether `token`, the request's next, finishes it by a rule that needs no text (`StopChecker.ends_on`)."""
        return self._streams[request_id].stop.ends_on(token, grammar_done)

    def process(self, request_id: str, results: Sequence[SampleResult],
                grammar_done: bool = False) -> tuple[RequestOutput, int]:
        """Take a step's tokens for the request, in order, up to the first one that finishes it. Returns the
        output to send (`send_output`, once the engine has recorded the tokens) and how many tokens it took.

        `grammar_done`: the request's grammar ended on the last of `results` (the sampler observed them all)."""
        s = self._streams[request_id]
        tokens: list[int] = []
        lps: list[TokenLogprob] = []
        delta = ""
        for j, res in enumerate(results):
            tokens.append(res.token)
            if res.logprob is not None:
                lps.append(TokenLogprob(res.token, res.logprob, res.top_logprobs))
            delta += s.stop.add(res.token, grammar_done and j == len(results) - 1)
            if s.stop.finish_reason is not None:
                break
        reason = s.stop.finish_reason
        out = RequestOutput(request_id, tuple(tokens), delta, s.num_prompt_tokens, len(s.stop.token_ids),
                            reason is not None, reason, stop_reason=s.stop.stop_reason, logprobs=tuple(lps),
                            time=time.monotonic())
        return out, len(tokens)

    def finish(self, request_id: str, reason: str, error: str | None = None,
               exception: BaseException | None = None) -> RequestOutput:
        """The last output of a request that ends without a token of its own ("abort" or "error")."""
        s = self._streams[request_id]
        return RequestOutput(request_id, (), "", s.num_prompt_tokens, len(s.stop.token_ids), True, reason,
                             error=error, time=time.monotonic(), exception=exception)

    def send_output(self, out: RequestOutput) -> None:
        """Send `out` to its request's callback; a finished request is forgotten."""
        s = self._streams.pop(out.request_id) if out.finished else self._streams[out.request_id]
        send(s.on_output, out)


def collect(prompt_token_ids: Sequence[int], outputs: Sequence[RequestOutput]) -> GenerationOutput:
    """One finished request's outputs, in order, joined: its tokens, text, finish reason and chosen tokens'
    logprobs."""
    last = outputs[-1]
    assert last.finished, "collect: the request has not finished"
    return GenerationOutput(list(prompt_token_ids), [t for o in outputs for t in o.new_token_ids],
                            "".join(o.text_delta for o in outputs), last.finish_reason or "stop",
                            [lp.logprob for o in outputs for lp in o.logprobs])
