"""Scheduler unit tests: plain dataclasses in and out, no model.

A tiny simulated "runner" (`run_step`) plays the engine: it feeds back a token for every scheduled item, so
the tests can follow requests through admission, decode, finish and slot reuse.
"""

from __future__ import annotations

import pytest

from neuron_opt.errors import ConfigError, ContextLengthError, QueueFullError
from neuron_opt.runtime.request import Request, RequestStatus
from neuron_opt.runtime.scheduler import DecodeWork, PrefillWork, Scheduler


def req(rid: str, n_prompt: int = 4, max_tokens: int = 3) -> Request:
    return Request(rid, list(range(100, 100 + n_prompt)), max_tokens)


def run_step(s: Scheduler, token: int = 7) -> tuple[list[str], list[str]]:
    """Schedule, 'execute' (every item yields `token`), finish requests at max_tokens.

    Returns the (decoded, prefilled) request ids."""
    out = s.schedule()
    for w in (*out.decodes, *out.prefills):
        r = s.update(w.request_id, token)
        if len(r.output_token_ids) >= r.max_tokens:
            s.finish(w.request_id)
    return [d.request_id for d in out.decodes], [p.request_id for p in out.prefills]


def test_admission_prefill_then_decode_positions():
    s = Scheduler(num_slots=2)
    s.add(req("a", n_prompt=5, max_tokens=3))
    out = s.schedule()
    assert out.decodes == () and out.prefills == (PrefillWork("a", 0, (100, 101, 102, 103, 104)),)
    r = s.update("a", 42)
    assert (r.num_computed_tokens, r.num_tokens) == (5, 6)
    out = s.schedule()
    # the pending token is the one just sampled, written at position = number of computed tokens
    assert out.decodes == (DecodeWork("a", 0, 42, 5),) and out.prefills == ()
    s.update("a", 43)
    assert s.schedule().decodes == (DecodeWork("a", 0, 43, 6),)


def test_all_running_sequences_decode_together_and_new_ones_join():
    s = Scheduler(num_slots=4)
    for rid in "ab":
        s.add(req(rid, max_tokens=10))
    assert run_step(s) == ([], ["a", "b"])
    s.add(req("c", max_tokens=10))
    assert run_step(s) == (["a", "b"], ["c"])  # c is admitted while a and b keep decoding
    assert run_step(s) == (["a", "b", "c"], [])
    assert sorted(r.slot for r in s.running.values()) == [0, 1, 2]


def test_queueing_when_slots_are_busy_and_slot_reuse():
    s = Scheduler(num_slots=2)
    for rid, mt in (("a", 1), ("b", 3), ("c", 2)):
        s.add(req(rid, max_tokens=mt))
    assert run_step(s) == ([], ["a", "b"])
    # a finished at its prefill (max_tokens=1): its slot is free for c in the very next step
    assert s.num_running == 1 and s.num_waiting == 1 and s.num_free_slots == 1
    slot_a = 0
    out = s.schedule()
    assert [d.request_id for d in out.decodes] == ["b"]
    assert out.prefills == (PrefillWork("c", slot_a, tuple(range(100, 104))),)
    assert s.running["c"].status is RequestStatus.RUNNING and s.num_waiting == 0


def test_fcfs_order_and_waiting_limit():
    s = Scheduler(num_slots=1, max_waiting=2)
    s.add(req("a"))
    s.add(req("b"))
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        s.add(req("c"))
    assert run_step(s) == ([], ["a"])
    s.add(req("c"))  # a left the queue, so there is room again
    order = []
    while s.has_work():
        order += run_step(s)[1]
    assert order == ["b", "c"]


def test_cancel_running_frees_slot_at_once():
    s = Scheduler(num_slots=1)
    s.add(req("a", max_tokens=100))
    s.add(req("b", max_tokens=100))
    run_step(s)
    assert s.running["a"].slot == 0 and s.num_waiting == 1
    r = s.finish("a")  # client went away
    assert r.status is RequestStatus.FINISHED and r.slot is None and s.num_free_slots == 1
    out = s.schedule()
    assert out.decodes == () and out.prefills[0].request_id == "b" and out.prefills[0].slot == 0


def test_cancel_waiting_and_unknown_ids():
    s = Scheduler(num_slots=1)
    s.add(req("a"))
    s.add(req("b"))
    assert s.finish("b").status is RequestStatus.FINISHED and s.num_waiting == 1
    assert s.finish("nope") is None
    run_step(s)
    run_step(s)
    run_step(s)  # a finishes (3 tokens)
    assert s.finish("a") is None  # cancelling a request that already finished is harmless
    assert not s.has_work() and s.num_free_slots == 1


def test_rejection_up_front():
    def check_fits(prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > 32:
            raise ContextLengthError(f"{prompt_len} + {max_tokens} > 32")

    s = Scheduler(num_slots=2, check_fits=check_fits)
    with pytest.raises(ContextLengthError, match="30 \\+ 3 > 32"):
        s.add(req("big", n_prompt=30, max_tokens=3))
    with pytest.raises(ConfigError, match="at least one token"):
        s.add(req("empty", n_prompt=0))
    with pytest.raises(ConfigError, match="already in use"):
        s.add(req("x"))
        s.add(req("x"))
    s.add(req("ok", n_prompt=29, max_tokens=3))
    assert [r.request_id for r in s.waiting] == ["x", "ok"]


def test_prefill_token_budget_bounds_prefills_per_step():
    s = Scheduler(num_slots=8, max_prefill_tokens=10)
    for rid, n in (("a", 4), ("b", 4), ("c", 4), ("d", 30), ("e", 1)):
        s.add(req(rid, n_prompt=n, max_tokens=50))
    assert run_step(s)[1] == ["a", "b"]  # 4 + 4 <= 10; c would exceed
    assert run_step(s)[1] == ["c"]  # d (30) exceeds what is left; e may not overtake it
    assert run_step(s)[1] == ["d"]  # a prompt over the budget still runs, alone
    assert run_step(s) == (["a", "b", "c", "d"], ["e"])


def test_many_requests_each_get_exact_token_count_and_slots_never_shared():
    s = Scheduler(num_slots=3)
    lengths = {f"r{i}": 1 + (i * 7) % 5 for i in range(20)}
    for rid, mt in lengths.items():
        s.add(req(rid, max_tokens=mt))
    finished: dict[str, Request] = {}
    while s.has_work():
        slots = [r.slot for r in s.running.values()]
        assert len(slots) == len(set(slots)) <= 3
        out = s.schedule()
        for w in (*out.decodes, *out.prefills):
            r = s.update(w.request_id, 1)
            if len(r.output_token_ids) >= r.max_tokens:
                finished[w.request_id] = s.finish(w.request_id)
    assert {k: len(v.output_token_ids) for k, v in finished.items()} == lengths
    assert s.num_free_slots == 3
