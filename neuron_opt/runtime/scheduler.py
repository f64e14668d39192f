"""Continuous-batching scheduler: which requests run in the next engine step. Device-free.

Design decisions
- One KV slot per running sequence (the cache is `max_batch` contiguous lines, not paged blocks), so
  admission is "a slot is free", and a finished or aborted request returns its slot to the free list at
  once; the next `schedule()` can hand it to a waiting request.
- Every step, all running sequences that have a pending token decode together in one `runner.decode` call (the
  runner picks the smallest decode bucket, batch x KV length, that fits them).
- Prefills: one prompt per `runner.prefill` call. New requests are admitted FCFS while slots are free and the
  step's prompt tokens stay within `max_prefill_tokens` (at least one prefill per step whenever one waits,
  so a prompt longer than the budget still runs). The budget bounds how long running streams stall while new
  prompts are processed (their inter-token latency), like vLLM's token budget, without chunking a prompt.
  A request is admitted in the step its prefill runs, so a slot is never held by an unprocessed prompt.
- A request that can never fit (prompt + max_tokens beyond the model's limit) is rejected by `validate`
  before it is queued; the check is pure, so the engine calls it in the caller's thread and the HTTP layer
  gets the error synchronously.
- No preemption: a slot always holds a sequence's whole context (max_model_len), so a running request can
  always finish.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from neuron_opt.errors import ConfigError, QueueFullError
from neuron_opt.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class PrefillWork:
    request_id: str
    slot: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class DecodeWork:
    request_id: str
    slot: int
    token: int
    position: int


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: tuple[DecodeWork, ...] = ()
    prefills: tuple[PrefillWork, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Tracks waiting and running requests and the free KV slots.

    Args:
        num_slots: KV slots usable by sequences (0..num_slots-1); also the most requests running at once.
        max_waiting: most queued requests; `add` raises QueueFullError beyond it.
        max_prefill_tokens: prompt tokens prefilled per step (soft: the first prefill of a step always runs).
        check_fits: `(prompt_len, max_tokens) -> None`, raising ContextLengthError when a request can never
            run (the runner's `check_fits`).
    """

    def __init__(
        self,
        num_slots: int,
        *,
        max_waiting: int = 1024,
        max_prefill_tokens: int = 2048,
        check_fits: Callable[[int, int], None] | None = None,
    ) -> None:
        if num_slots < 1:
            raise ConfigError(f"num_slots: must be >= 1, got {num_slots}")
        if max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens: must be >= 1, got {max_prefill_tokens}")
        self.num_slots, self.max_waiting, self.max_prefill_tokens = num_slots, max_waiting, max_prefill_tokens
        self._check_fits = check_fits
        self.waiting: deque[Request] = deque()
        self.running: OrderedDict[str, Request] = OrderedDict()  # admission order = decode row order
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def validate(self, prompt_len: int, max_tokens: int) -> None:
        """Raise if a request with these sizes can never run. Pure: safe to call from any thread."""
        if prompt_len < 1:
            raise ConfigError("prompt: must contain at least one token")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens: must be at least 1, got {max_tokens}", param="max_tokens")
        if self._check_fits is not None:
            self._check_fits(prompt_len, max_tokens)

    # ---- mutations -----------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.validate(req.num_prompt_tokens, req.max_tokens)
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(
                f"server busy: {len(self.waiting)} requests already waiting "
                f"(max_waiting={self.max_waiting}); retry later"
            )
        if req.request_id in self.running or any(r.request_id == req.request_id for r in self.waiting):
            raise ConfigError(f"request_id: {req.request_id!r} is already in use")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        """Decode every running sequence with a pending token; admit and prefill waiting ones."""
        decodes = []
        for req in self.running.values():
            pending = req.num_tokens - req.num_computed_tokens
            assert req.slot is not None and req.num_computed_tokens > 0 and pending == 1, req.request_id
            decodes.append(DecodeWork(req.request_id, req.slot, req.last_token, req.num_computed_tokens))
        prefills: list[PrefillWork] = []
        budget = self.max_prefill_tokens
        while self.waiting and self._free_slots:
            n = self.waiting[0].num_prompt_tokens
            if prefills and n > budget:
                break  # FCFS: do not let a shorter prompt overtake the head of the queue
            req = self.waiting.popleft()
            req.slot, req.status = self._free_slots.pop(), RequestStatus.RUNNING
            self.running[req.request_id] = req
            prefills.append(PrefillWork(req.request_id, req.slot, tuple(req.prompt_token_ids)))
            budget -= n
        return SchedulerOutput(tuple(decodes), tuple(prefills))

    def update(self, request_id: str, token: int) -> Request:
        """Record the token sampled from the last computed position: everything before it now has K/V."""
        req = self.running[request_id]
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(token)
        return req

    def finish(self, request_id: str) -> Request | None:
        """Release a request (finished, aborted or failed) and its slot. Unknown ids are ignored (a client may
        cancel a request that has just finished)."""
        req = self.running.pop(request_id, None)
        if req is not None:
            assert req.slot is not None
            self._free_slots.append(req.slot)
            req.slot = None
        else:
            req = next((r for r in self.waiting if r.request_id == request_id), None)
            if req is None:
                return None
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        return req
