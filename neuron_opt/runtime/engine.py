"""Serving engine: step = schedule -> execute -> update, run in one background thread.

Threading model
- All torch work, the scheduler and per-request sampling/stop state live on the engine thread; nothing else
  touches them. Other threads (the HTTP event loop) talk to it only through `add_request` / `abort`, which put
  commands on a thread-safe inbox that the engine drains at the start of every step.
- Results go out through a per-request callback `on_output(RequestOutput)`, called on the engine thread.
  It must be cheap and thread-safe; the server passes `loop.call_soon_threadsafe(queue.put_nowait, ...)`.
- Validation that can fail for user input (context length, queue full) runs synchronously in `add_request`,
  in the caller's thread, so the HTTP layer can answer 400/503 before anything is queued. Admission has one
  bound, checked there once: at most max_num_seqs + max_waiting requests in flight (added, not yet finished).
  The scheduler bounds no queue of its own, so a request admitted here is never refused on the engine thread.

Within a step the decodes run first (one `runner.decode` for all running sequences) and their tokens are
emitted before the step's prefill chunks run, so streams that are already running are not delayed by new
prompts more than the scheduler's token budget allows (runtime/scheduler.py: chunked prefill, prefix caching,
preemption). With speculative decoding on (`speculative=`, runtime/speculative.py) that one call may be a verify
of each row's proposed tokens instead, and a step may emit several tokens per request. Prefill chunks run up to
the artifact's prefill batch per graph call. An abort frees its KV blocks at the start of the next step (at
most one step later). A failing runner call fails only the requests in it (finish_reason "error"); the
engine keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from neuron_opt.buckets import pick_decode
from neuron_opt.errors import ConfigError, NeuronOptError, QueueFullError
from neuron_opt.runtime.request import Request
from neuron_opt.runtime.runner import DecodeRow, ModelRunner, PrefillRow, VerifyRow
from neuron_opt.runtime.sampling import SamplerState, SamplingParams, candidates_needed, sample_batch
from neuron_opt.runtime.scheduler import DecodeWork, KVConfig, PrefillWork, Scheduler
from neuron_opt.runtime.speculative import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    SpecController,
    SpecStats,
    SpeculativeConfig,
    accept,
)
from neuron_opt.runtime.stopping import StopChecker
from neuron_opt.runtime.structured import GrammarCompiler

log = logging.getLogger(__name__)


class EngineDeadError(NeuronOptError):
    """The engine loop died (a bug); new requests are refused (HTTP 500) and /health reports 503."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One engine step's news for one request (one new token, or the end)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None
    time: float = 0.0  # time.monotonic() when the token was produced


@dataclass
class _Sequence:
    request: Request
    params: SamplingParams
    state: SamplerState
    stop: StopChecker
    on_output: Callable[[RequestOutput], object]


@dataclass
class _Command:
    kind: str  # "add" | "abort"
    request_id: str
    seq: _Sequence | None = None


@dataclass
class EngineStats:
    steps: int = 0
    decode_rows: int = 0
    prefills: int = 0  # prefill chunks run
    preemptions: int = 0
    step_times: list[float] = field(default_factory=list)


class Engine:
    """Continuous-batching engine over a ModelRunner.

    Args:
        runner: the model runner (eager or compiled backend).
        tokenizer: used for incremental detokenization and stop strings.
        eos_token_ids: tokens that end a sequence unless `ignore_eos`.
        max_num_seqs: most sequences running at once (capped by the artifact's largest decode batch).
        max_waiting: requests in flight beyond max_num_seqs before `add_request` raises QueueFullError.
        max_num_batched_tokens: tokens per step, decodes first, then prefill chunks (see scheduler.py).
        enable_prefix_caching, enable_chunked_prefill: None = on when the artifact has offset prefill buckets;
            True where it has none is an error.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: object,
        eos_token_ids: tuple[int, ...],
        *,
        max_num_seqs: int | None = None,
        max_waiting: int = 1024,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool | None = None,
        enable_chunked_prefill: bool | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: ModelRunner | None = None,
    ) -> None:
        self.runner, self.tokenizer, self.eos_token_ids = runner, tokenizer, tuple(eos_token_ids)
        self.spec = speculative
        self.spec_stats = SpecStats()
        if speculative is not None:
            k = speculative.num_speculative_tokens
            if runner.verify_len != k + 1:
                have = runner.verify_len - 1 if runner.verify_len else 0
                raise ConfigError(
                    f"num_speculative_tokens: {k} needs verify graphs of {k + 1} tokens; this model has "
                    + (f"them for {have} (use --num-speculative-tokens {have})" if have
                       else "none (compile with --num-speculative-tokens K)"), param="num_speculative_tokens")
            self.controller = SpecController(k, speculative.adaptive)
        largest = runner.buckets.decode_batches[-1]
        seqs = largest if max_num_seqs is None else min(max_num_seqs, largest)
        if (draft is not None) != (speculative is not None and speculative.method == "draft_model"):
            raise ConfigError("speculative_model: a draft runner goes with the draft_model method, and only with it",
                              param="speculative_model")
        if speculative is not None:
            self.proposer: Proposer = (
                NgramProposer(speculative.prompt_lookup_max, speculative.prompt_lookup_min) if draft is None
                else self._draft_proposer(draft, seqs))
        offset = runner.buckets.offset_prefill
        cache = runner.cache
        kv = KVConfig(cache.num_blocks, cache.block_size, cache.max_model_len, runner.max_prompt_len,
                      offset if enable_prefix_caching is None else enable_prefix_caching,
                      offset if enable_chunked_prefill is None else enable_chunked_prefill, offset)
        self.scheduler = Scheduler(
            seqs,
            kv,
            max_num_batched_tokens=max_num_batched_tokens,
            check_fits=runner.check_fits,
            lookahead=speculative.num_speculative_tokens if speculative is not None else 0,
        )
        self.max_waiting = max_waiting
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._seqs: dict[str, _Sequence] = {}  # engine thread only
        self._pending = 0  # requests added but not yet finished (any thread; guarded by _lock)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None  # set if the loop itself died (a bug)
        self.grammars = GrammarCompiler(tokenizer, runner.vocab_size, self.eos_token_ids)

    def _draft_proposer(self, draft: ModelRunner, seqs: int) -> DraftModelProposer:
        """The draft must hold a KV slot per running sequence and reach every position the target does."""
        prop = DraftModelProposer(draft)
        if draft.vocab_size != self.runner.vocab_size:
            raise ConfigError(f"speculative_model: the draft's vocabulary has {draft.vocab_size} tokens, the "
                              f"target's {self.runner.vocab_size}; a draft model must share the target's tokenizer",
                              param="speculative_model")
        if prop.num_slots < seqs:
            raise ConfigError(f"speculative_model: the draft holds KV for {prop.num_slots} sequence(s), the engine "
                              f"runs up to {seqs}; compile the draft with --batch-size {seqs} (or lower "
                              "--max-num-seqs)", param="speculative_model")
        if draft.max_model_len < self.runner.max_model_len:
            raise ConfigError(f"speculative_model: the draft's max_model_len is {draft.max_model_len}, the target's "
                              f"{self.runner.max_model_len}; compile the draft with --max-model-len "
                              f"{self.runner.max_model_len}", param="speculative_model")
        return prop

    # ---- public, thread-safe -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV block pool held by sequences (0-1); cached free blocks count as free."""
        bm = self.scheduler.blocks
        return 1.0 - bm.num_free_blocks / (bm.num_blocks - 1)

    @property
    def prefix_cache_stats(self) -> Any:
        return self.scheduler.blocks.stats

    @property
    def num_unfinished(self) -> int:
        return self._pending

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of `params.structured` (None without one); ConfigError if it does not compile.
        Thread-safe and cached: the server calls it in a worker thread before `add_request`, so the event loop and
        the engine thread never wait for a compile."""
        return None if params.structured is None else self.grammars.compile(params.structured)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], object],
        arrival_time: float | None = None,
        grammar: Any = None,
        share_prefix_with: str | None = None,
    ) -> None:
        """Queue a request. Raises ContextLengthError / ConfigError / QueueFullError synchronously.

        Args:
            grammar: `compile_grammar(params)`'s result when the caller compiled it already (else compiled here).
            share_prefix_with: a request queued before this one with the same prompt (a sibling sample of `n`):
                this one is admitted after that one's prompt has K/V, so it takes its blocks from the prefix cache.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.error!r}")
        self.scheduler.validate(len(prompt_token_ids), params.max_tokens)
        state = None
        if params.structured is not None:
            state = self.grammars.state(params.structured, params.stop_token_ids, grammar)
        with self._lock:
            if self._pending >= self.scheduler.max_num_seqs + self.max_waiting:
                raise QueueFullError(
                    f"server busy: {self._pending} requests in flight "
                    f"({self.scheduler.max_num_seqs} running + {self.max_waiting} waiting); retry later"
                )
            self._pending += 1
        req = Request(
            request_id,
            list(prompt_token_ids),
            params.max_tokens,
            arrival_time if arrival_time is not None else time.monotonic(),
            share_prefix_with=share_prefix_with,
        )
        seq = _Sequence(
            req,
            params,
            SamplerState.create(params, state),
            StopChecker(self.tokenizer, params, self.eos_token_ids),
            on_output,
        )
        self._inbox.put(_Command("add", request_id, seq))

    def abort(self, request_id: str) -> None:
        """Cancel a request (e.g. its client went away); its KV blocks are freed at the start of the next step."""
        self._inbox.put(_Command("abort", request_id))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="neuron-opt-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after the current step. Unfinished requests are aborted (callers drain first)."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.scheduler.has_work():
                    cmd = self._inbox.get()  # idle: block until a request arrives
                    if cmd is None:
                        break
                    self._apply(cmd)
                self.step()
        except BaseException as e:  # a bug in the engine itself: fail every request, report unhealthy
            self.error = e
            log.error("engine loop died:\n%s", traceback.format_exc())
            for rid in list(self._seqs):
                self._fail(rid, f"engine failure: {e}")
        finally:
            for rid in list(self._seqs):
                self._finish(rid, "abort", "", ())

    def _apply(self, cmd: _Command) -> None:
        if cmd.kind == "add":
            assert cmd.seq is not None
            try:
                self.scheduler.add(cmd.seq.request)
            except Exception as e:  # a bug (admission and validation ran in add_request): fail this request only
                with self._lock:
                    self._pending -= 1
                self._emit(
                    cmd.seq,
                    RequestOutput(
                        cmd.request_id,
                        (),
                        "",
                        cmd.seq.request.num_prompt_tokens,
                        0,
                        True,
                        "error",
                        error=str(e),
                        time=time.monotonic(),
                    ),
                )
                return
            self._seqs[cmd.request_id] = cmd.seq
        elif cmd.request_id in self._seqs:
            self._finish(cmd.request_id, "abort", "", ())

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd is None:
                self._stop.set()
                return
            self._apply(cmd)

    def step(self) -> bool:
        """One engine iteration. Returns False when there was nothing to do."""
        self._drain_inbox()
        out = self.scheduler.schedule()
        if out.is_empty:
            return False
        t0 = time.perf_counter()
        if out.decodes:
            self._decode_or_verify(out.decodes)
        per_call = self.runner.buckets.prefill_batch
        for i in range(0, len(out.prefills), per_call):
            self._prefill(out.prefills[i:i + per_call])
        st = self.stats
        st.steps, st.decode_rows, st.prefills, st.preemptions = (
            st.steps + 1,
            st.decode_rows + len(out.decodes),
            st.prefills + len(out.prefills),
            st.preemptions + len(out.preempted),
        )
        if len(st.step_times) < 100_000:
            st.step_times.append(time.perf_counter() - t0)
        return True

    def _prefill(self, group: tuple[PrefillWork, ...]) -> None:
        """Prefill chunks in one graph call; the chunks that end a request's tokens sample its next token."""
        rows = [PrefillRow(p.blocks, p.token_ids, p.start) for p in group]
        sampled = [p.request_id for p in group if p.last]
        try:
            logits = self.runner.prefill_rows(rows, candidates=self._candidates(sampled) if sampled else 1)
        except Exception as e:
            log.error("prefill failed:\n%s", traceback.format_exc())
            for p in group:
                self._fail(p.request_id, f"prefill failed: {e}")
            return
        for p in group:
            if not p.last:
                self.scheduler.update_prefill(p.request_id, len(p.token_ids))
        if sampled:
            self._update(sampled, logits[[i for i, p in enumerate(group) if p.last]])

    def _budget(self, d: DecodeWork) -> int:
        """How many tokens the sequence could use from a proposal: at most k, none past its max_tokens or the
        verify graph's reach into the KV cache."""
        req = self._seqs[d.request_id].request
        k = min(self.controller.num_speculative_tokens, req.max_tokens - len(req.output_token_ids) - 1)
        return 0 if k < 1 or d.position + self.runner.verify_len > self.runner.max_model_len else k

    def _propose(self, decodes: tuple[DecodeWork, ...], budget: dict[str, int]) -> dict[str, list[int]]:
        reqs = [self._seqs[d.request_id].request for d in decodes]
        items = [(d.request_id, r.prompt_token_ids + r.output_token_ids, budget[d.request_id])
                 for d, r in zip(decodes, reqs, strict=True)]
        out = {rid: p for (rid, _, _), p in zip(items, self.proposer.propose_batch(items), strict=True)}
        for rid, p in out.items():  # a grammar's request verifies only the part of its draft the grammar allows
            grammar = self._seqs[rid].state.grammar
            if grammar is not None and p:
                out[rid] = p[:grammar.valid_prefix(p)]
        return out

    def _decode_or_verify(self, decodes: tuple[DecodeWork, ...]) -> None:
        """One graph call for every running sequence: a plain decode, or, when speculating and the controller
        says it pays, a verify of each row's proposals (rows without one ride along with their single token)."""
        ids = [d.request_id for d in decodes]
        proposals: dict[str, list[int]] = {}
        verify, skipped, batch = False, False, 0  # skipped: it could have verified, the controller said no
        t0 = time.perf_counter()
        try:
            if self.spec is not None:  # the batch bucket the step runs in: what the cost ratio is kept per
                batch = pick_decode(len(decodes), max(d.position for d in decodes), self.runner.buckets).batch
                budget = {d.request_id: self._budget(d) for d in decodes}
                if self.proposer.cheap:  # propose, then decide on what was found
                    proposals = self._propose(decodes, budget)
                    verify = self.controller.should_verify({r: len(p) for r, p in proposals.items()}, batch)
                    skipped = not verify and any(proposals.values())
                else:  # a draft model: decide on what it would propose; a plain step asks it for nothing
                    verify = self.controller.should_verify(budget, batch)
                    proposals = self._propose(decodes, budget) if verify else {}
                    skipped = not verify and any(budget.values())
                    verify = verify and any(proposals.values())
            if verify:
                rows = [VerifyRow(d.blocks, (d.token, *proposals[d.request_id]), d.position) for d in decodes]
                logits = self.runner.verify(rows, candidates=self._candidates(ids))
            else:
                logits = self.runner.decode([DecodeRow(d.blocks, d.token, d.position) for d in decodes],
                                            candidates=self._candidates(ids))
        except Exception as e:
            log.error("%s failed:\n%s", "verify" if verify else "decode", traceback.format_exc())
            for d in decodes:
                self._fail(d.request_id, f"{'verify' if verify else 'decode'} failed: {e}")
            return
        if self.spec is not None:
            self.controller.observe_step("verify" if verify else "decode", batch, time.perf_counter() - t0)
            st = self.spec_stats
            if verify:
                st.verify_steps += 1
            elif skipped:
                st.skipped_steps += 1
        if verify:
            for i, d in enumerate(decodes):
                self._update_verified(d.request_id, logits[i], proposals.get(d.request_id, []))
            return
        for d, token in zip(decodes, self._update(ids, logits), strict=True):
            draft = proposals.get(d.request_id, [])
            if draft:  # the first proposal against the token actually sampled: acceptance, measured for free
                self.controller.observe_acceptance(d.request_id, int(token == draft[0]), 1)

    def _update_verified(self, request_id: str, logits: torch.Tensor, draft: list[int]) -> None:
        """Accept a prefix of `draft` from its verify logits [q, V], emit the tokens, stop where a stop
        condition hits."""
        seq = self._seqs[request_id]
        done, min_tokens = len(seq.stop.token_ids), seq.params.min_tokens
        banned_for = [self.eos_token_ids if done + j < min_tokens else () for j in range(len(draft) + 1)]
        results = accept(logits, draft, seq.state, banned_for)
        if draft:
            st = self.spec_stats
            st.drafts, st.draft_tokens, st.accepted_tokens = (st.drafts + 1, st.draft_tokens + len(draft),
                                                              st.accepted_tokens + len(results) - 1)
            self.controller.observe_acceptance(request_id, len(results) - 1, len(draft))
        tokens: list[int] = []
        lps: list[TokenLogprob] = []
        delta = ""
        for j, res in enumerate(results):
            tokens.append(res.token)
            if res.logprob is not None:
                lps.append(TokenLogprob(res.token, res.logprob, res.top_logprobs))
            delta += seq.stop.add(res.token, seq.state.grammar_done and j == len(results) - 1)
            self.scheduler.update(request_id, res.token)
            if seq.stop.finish_reason is not None:
                self._finish(request_id, seq.stop.finish_reason, delta, tuple(tokens), tuple(lps))
                return
        self._emit(seq, RequestOutput(request_id, tuple(tokens), delta, seq.request.num_prompt_tokens,
                                      len(seq.request.output_token_ids), logprobs=tuple(lps), time=time.monotonic()))

    def _candidates(self, request_ids: list[str]) -> int | None:
        """Top logits per rank the batch's sampling needs (vocab-parallel TP); None when any row needs them all."""
        ks = []
        for rid in request_ids:
            seq = self._seqs[rid]
            n_banned = len(self.eos_token_ids) if len(seq.stop.token_ids) < seq.params.min_tokens else 0
            k = candidates_needed(seq.params, n_banned)
            if k is None:
                return None
            ks.append(k)
        return max(ks)

    def _update(self, request_ids: list[str], logits: torch.Tensor) -> list[int]:
        """Sample each request's next token from its row of `logits` [len(request_ids), V] in one batch, emit it,
        and finish the requests a stop condition hits. Returns the tokens."""
        seqs = [self._seqs[rid] for rid in request_ids]
        banned = [self.eos_token_ids if len(seq.stop.token_ids) < seq.params.min_tokens else () for seq in seqs]
        results = sample_batch(logits, [seq.state for seq in seqs], banned)
        for rid, seq, res in zip(request_ids, seqs, results, strict=True):
            seq.state.observe(res.token)
            delta = seq.stop.add(res.token, seq.state.grammar_done)
            self.scheduler.update(rid, res.token)
            lp = (TokenLogprob(res.token, res.logprob, res.top_logprobs),) if res.logprob is not None else ()
            if seq.stop.finish_reason is not None:
                self._finish(rid, seq.stop.finish_reason, delta, (res.token,), lp)
                continue
            self._emit(seq, RequestOutput(rid, (res.token,), delta, seq.request.num_prompt_tokens,
                                          len(seq.request.output_token_ids), logprobs=lp, time=time.monotonic()))
        return [res.token for res in results]

    def _finish(
        self,
        request_id: str,
        reason: str,
        delta: str,
        tokens: tuple[int, ...],
        logprobs: tuple[TokenLogprob, ...] = (),
        error: str | None = None,
    ) -> None:
        seq = self._seqs.pop(request_id)
        self.scheduler.finish(request_id)
        if self.spec is not None:
            self.controller.forget(request_id)
            self.proposer.forget(request_id)
        with self._lock:
            self._pending -= 1
        out = RequestOutput(
            request_id,
            tokens,
            delta,
            seq.request.num_prompt_tokens,
            len(seq.request.output_token_ids),
            True,
            reason,
            logprobs,
            error,
            time.monotonic(),
        )
        self._emit(seq, out)

    @staticmethod
    def _emit(seq: _Sequence, out: RequestOutput) -> None:
        try:
            seq.on_output(out)
        except Exception:  # a broken callback (e.g. a closed event loop) must not take the engine down
            log.warning("output callback failed for %s:\n%s", out.request_id, traceback.format_exc())

    def _fail(self, request_id: str, message: str) -> None:
        if request_id in self._seqs:
            self._finish(request_id, "error", "", (), error=message)
