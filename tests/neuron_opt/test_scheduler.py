"""Scheduler unit tests: plain dataclasses in and out, no model.

A tiny simulated "runner" (`run_step`) plays the engine: it feeds back a token for every scheduled item that
ends a request's pending tokens (a decode, or a prefill chunk marked `last`), so the tests can follow requests
through admission, chunked prefill, decode, preemption, finish and block reuse. The token it feeds back is a
function of the request and its tokens so far, as a model's would be, so a preempted-and-recomputed request
must end with exactly the tokens of an unpreempted run.
"""

from __future__ import annotations

import time
import zlib

import pytest

from neuron_opt.config import CacheConfig
from neuron_opt.errors import ConfigError, ContextLengthError
from neuron_opt.runtime.request import Request, RequestStatus
from neuron_opt.runtime.scheduler import DecodeWork, KVConfig, PrefillWork, Scheduler

BS = 4


def kv(num_blocks: int = 64, max_model_len: int = 64, max_prefill_len: int = 32, **kw) -> KVConfig:
    return KVConfig(num_blocks, BS, max_model_len, max_prefill_len, **kw)


def req(rid: str, n_prompt: int = 4, max_tokens: int = 3, first: int = 100) -> Request:
    return Request(rid, list(range(first, first + n_prompt)), max_tokens)


def model_token(r: Request) -> int:
    """What a deterministic model would answer after r's tokens."""
    return zlib.crc32(repr((r.request_id, r.prompt_token_ids + r.output_token_ids)).encode()) % 1000


def run_step(s: Scheduler) -> tuple[list[str], list[str]]:
    """Schedule, 'execute', finish requests at max_tokens. Returns the (decoded, prefilled) request ids."""
    out = s.schedule()
    for w in (*out.decodes, *out.prefills):
        if isinstance(w, PrefillWork) and not w.last:
            s.update_prefill(w.request_id, len(w.token_ids))
            continue
        r = s.update(w.request_id, model_token(s.running[w.request_id]))
        if len(r.output_token_ids) >= r.max_tokens:
            s.finish(w.request_id)
    return [d.request_id for d in out.decodes], [p.request_id for p in out.prefills]


def drain(s: Scheduler, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        s.add(r)
    for _ in range(10_000):
        if not s.has_work():
            break
        run_step(s)
    assert not s.has_work()
    return {r.request_id: r.output_token_ids for r in requests}


def test_admission_prefill_then_decode_positions_and_blocks():
    s = Scheduler(2, kv())
    s.add(req("a", n_prompt=5, max_tokens=5))
    out = s.schedule()
    assert out.decodes == () and out.prefills == (PrefillWork("a", (1, 2), (100, 101, 102, 103, 104), 0, True),)
    r = s.update("a", 42)
    assert (r.num_computed_tokens, r.num_tokens) == (5, 6)
    out = s.schedule()
    # the pending token is the one just sampled, written at position = number of computed tokens
    assert out.decodes == (DecodeWork("a", (1, 2), 42, 5),) and out.prefills == ()
    s.update("a", 43)
    assert s.schedule().decodes == (DecodeWork("a", (1, 2), 43, 6),)
    s.update("a", 44)
    assert s.schedule().decodes == (DecodeWork("a", (1, 2), 44, 7),)
    s.update("a", 45)
    assert s.schedule().decodes == (DecodeWork("a", (1, 2, 3), 45, 8),)  # position 8 needs a third block


def test_all_running_sequences_decode_together_and_new_ones_join():
    s = Scheduler(4, kv())
    for rid in "ab":
        s.add(req(rid, max_tokens=10))
    assert run_step(s) == ([], ["a", "b"])
    s.add(req("c", max_tokens=10))
    assert run_step(s) == (["a", "b"], ["c"])  # c is admitted while a and b keep decoding
    assert run_step(s) == (["a", "b", "c"], [])
    tables = [s.blocks.table(r) for r in "abc"]
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)  # no block shared


def test_several_waiting_prompts_share_one_prefill_step_with_the_running_decodes():
    """Prompts that arrive while others decode are all admitted in the next step, as far as the token budget
    goes (decodes first): one step prefills them together, none waits for another's step."""
    s = Scheduler(8, kv(num_blocks=600, max_model_len=256, max_prefill_len=256), max_num_batched_tokens=2048)
    s.add(req("a", n_prompt=150, max_tokens=20))
    assert run_step(s) == ([], ["a"])
    for i in range(6):
        s.add(req(f"w{i}", n_prompt=150 + i, max_tokens=20, first=1000 * (i + 1)))
    out = s.schedule()
    assert [d.request_id for d in out.decodes] == ["a"]
    assert [(p.request_id, p.start, len(p.token_ids), p.last) for p in out.prefills] == \
        [(f"w{i}", 0, 150 + i, True) for i in range(6)]
    s2 = Scheduler(8, kv(num_blocks=200, max_model_len=256, max_prefill_len=256), max_num_batched_tokens=400)
    for i in range(4):
        s2.add(req(f"w{i}", n_prompt=150, max_tokens=20, first=1000 * (i + 1)))
    # a budget of 400: two whole prompts and a chunk of the third in the first step
    assert [(p.request_id, len(p.token_ids), p.last) for p in s2.schedule().prefills] == \
        [("w0", 150, True), ("w1", 150, True), ("w2", 100, False)]


def test_max_num_seqs_queueing_and_reuse():
    s = Scheduler(2, kv())
    for rid, mt in (("a", 1), ("b", 3), ("c", 2)):
        s.add(req(rid, max_tokens=mt, first=100 + 10 * ord(rid)))
    assert run_step(s) == ([], ["a", "b"])
    # a finished at its prefill (max_tokens=1): c runs in the very next step
    assert s.num_running == 1 and s.num_waiting == 1
    out = s.schedule()
    assert [d.request_id for d in out.decodes] == ["b"] and [p.request_id for p in out.prefills] == ["c"]
    assert s.running["c"].status is RequestStatus.RUNNING and s.num_waiting == 0


def test_fcfs_order():
    """The scheduler queues whatever the engine admitted (admission is the engine's: test_engine.py)."""
    s = Scheduler(1, kv())
    s.add(req("a"))
    s.add(req("b"))
    assert run_step(s) == ([], ["a"])
    s.add(req("c"))
    order = []
    while s.has_work():
        order += run_step(s)[1]
    assert order == ["b", "c"]


def test_cancel_running_frees_blocks_at_once():
    s = Scheduler(1, kv(num_blocks=17))
    s.add(req("a", n_prompt=60, max_tokens=4))
    s.add(req("b", n_prompt=4, max_tokens=100, first=500))
    run_step(s)
    run_step(s)  # a: 60 tokens in two chunks of 32 and 28
    assert s.blocks.num_free_blocks == 16 - 15 and s.num_waiting == 1
    r = s.finish("a")  # client went away
    assert r.status is RequestStatus.FINISHED and s.blocks.num_free_blocks == 16
    out = s.schedule()
    assert out.decodes == () and out.prefills[0].request_id == "b"


def test_cancel_waiting_and_unknown_ids():
    s = Scheduler(1, kv())
    s.add(req("a"))
    s.add(req("b"))
    assert s.finish("b").status is RequestStatus.FINISHED and s.num_waiting == 1
    assert s.finish("nope") is None
    run_step(s)
    run_step(s)
    run_step(s)  # a finishes (3 tokens)
    assert s.finish("a") is None  # cancelling a request that already finished is harmless
    assert not s.has_work() and s.blocks.num_free_blocks == 63


def test_rejection_up_front():
    seen = []

    def check_fits(prompt_len: int, max_tokens: int, chunked: bool) -> None:
        seen.append(chunked)
        if prompt_len + max_tokens > 32:
            raise ContextLengthError(f"{prompt_len} + {max_tokens} > 32")

    s = Scheduler(2, kv(), check_fits=check_fits)
    with pytest.raises(ContextLengthError, match="30 \\+ 3 > 32"):
        s.add(req("big", n_prompt=30, max_tokens=3))
    with pytest.raises(ConfigError, match="at least one token"):
        s.add(req("empty", n_prompt=0))
    with pytest.raises(ConfigError, match="already in use"):
        s.add(req("x"))
        s.add(req("x"))
    s.add(req("ok", n_prompt=29, max_tokens=3))
    assert [r.request_id for r in s.waiting] == ["x", "ok"] and set(seen) == {True}


def test_whole_prompt_budget_without_chunking():
    s = Scheduler(8, kv(enable_chunked_prefill=False), max_num_batched_tokens=10)
    for rid, n in (("a", 4), ("b", 4), ("c", 4), ("d", 30), ("e", 1)):
        s.add(req(rid, n_prompt=n, max_tokens=50, first=100 * ord(rid)))
    assert run_step(s)[1] == ["a", "b"]  # 4 + 4 <= 10; c would exceed
    assert run_step(s)[1] == ["c"]  # d (30) exceeds what is left; e may not overtake it
    assert run_step(s)[1] == ["d"]  # a prompt over the budget still runs, alone and whole
    assert run_step(s) == (["a", "b", "c", "d"], ["e"])


def test_chunked_prefill_decodes_first_then_spends_the_budget_on_chunks():
    s = Scheduler(8, kv(max_model_len=128), max_num_batched_tokens=16)
    s.add(req("a", n_prompt=4, max_tokens=50))
    run_step(s)
    s.add(req("long", n_prompt=70, max_tokens=3, first=300))  # longer than the largest prefill bucket (32)
    chunks = []
    for _ in range(5):
        out = s.schedule()
        assert [d.request_id for d in out.decodes] == ["a"]  # a decodes every step
        for p in out.prefills:
            chunks.append((p.start, len(p.token_ids), p.last))
        for w in (*out.decodes, *out.prefills):
            if isinstance(w, PrefillWork) and not w.last:
                s.update_prefill(w.request_id, len(w.token_ids))
            else:
                s.update(w.request_id, 7)
        assert sum(len(p.token_ids) for p in out.prefills) + len(out.decodes) <= 16
    # 15 tokens per step (16 minus a's decode), the last chunk ends the prompt and samples its first token
    assert chunks == [(0, 15, False), (15, 15, False), (30, 15, False), (45, 15, False), (60, 10, True)]
    assert s.running["long"].num_computed_tokens == 70 and s.running["long"].output_token_ids == [7]


def test_prefix_cache_hit_prefills_only_the_rest():
    s = Scheduler(4, kv())
    shared = list(range(100, 113))  # 13 tokens: 3 full blocks of 4
    a = Request("a", shared + [1, 2], 2)
    assert drain(s, [a])
    b = Request("b", shared + [3], 2)
    s.add(b)
    out = s.schedule()
    (p,) = out.prefills
    # 3 cached blocks = 12 tokens reused; the prefill starts at 12 and writes a new block
    assert (p.start, p.token_ids) == (12, (112, 3)) and p.blocks[:3] == (1, 2, 3) and p.blocks[3] not in (1, 2, 3)
    assert (s.blocks.stats.queries, s.blocks.stats.hits) == (15 + 14, 12)
    # a prompt that is entirely cached still computes its last token (its logits are needed)
    s.update("b", 9)
    c = Request("c", shared[:12], 1)
    s.add(c)
    (p,) = s.schedule().prefills
    assert (p.start, p.token_ids) == (8, tuple(shared[8:12]))


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prefix_evicted_into_the_kv_tier_comes_back_and_a_damaged_entry_is_prefilled(chunked):
    """A real KVTier over pools of the scheduler's 8 blocks: a prompt's 3 full blocks are evicted by another
    prompt, copied into the tier as the pool hands them out, and restored into new blocks for the same prompt (the
    prefill starts after them, the tier's counters say so); one damaged entry ends the restored run there."""
    import torch

    from neuron_opt.runtime.block_manager import hash_block
    from neuron_opt.runtime.kv_tier import HostBlocks, KVTier

    pools = [torch.randn(8, 1, BS, 2) for _ in range(4)]  # [blocks, n_kv, BS, D]: K and V of 2 layers
    tier = KVTier(HostBlocks(pools[:2], pools[2:]), 1 << 20)
    s = Scheduler(1, kv(num_blocks=8, enable_chunked_prefill=chunked), tier=tier)
    shared = list(range(100, 113))  # 13 tokens: 3 full blocks of 4, then the last token
    drain(s, [Request("a", shared, 1)])
    a_blocks = {b: [p[b].clone() for p in pools] for b in (1, 2, 3)}
    drain(s, [Request("b", list(range(500, 527)), 1)])  # 7 blocks: the pool's, a's evicted
    assert tier.stats.stored == 3 and s.blocks.cached_prefix(shared) == []
    for damaged in (None, 1):
        if damaged is not None:  # a's second block, damaged in the tier (its digest taken first)
            key = hash_block(hash_block(None, shared[:BS]), shared[BS:2 * BS])
            for _ in range(1000):  # the background thread's digest first
                if tier.entries[key].digest is not None:
                    break
                time.sleep(0.01)
            tier.entries[key].data[0] ^= 1
            drain(s, [Request("fill", list(range(700, 727)), 1)])  # a's blocks out of the pool again
        s.add(Request("c", shared, 1))
        (p,) = s.schedule().prefills
        restored = 3 if damaged is None else damaged
        assert p.start == restored * BS and p.token_ids == tuple(shared[restored * BS:])
        for i, b in enumerate(p.blocks[:restored]):
            assert all(torch.equal(pool[b], want) for pool, want in zip(pools, a_blocks[i + 1], strict=True))
        s.update("c", 1)
        s.finish("c")
    assert tier.stats.corrupt == 1 and tier.stats.hits == (3 + 1) * BS


def test_without_prefix_caching_nothing_is_reused():
    s = Scheduler(4, kv(enable_prefix_caching=False))
    drain(s, [Request("a", list(range(100, 116)), 2)])
    s.add(Request("b", list(range(100, 116)), 2))
    assert s.schedule().prefills[0].start == 0 and s.blocks.stats.hits == 0


def test_preemption_recomputes_and_gives_identical_outputs():
    """A pool too small for everyone: the newest sequence is preempted, resumes later from its tokens so far,
    and every request ends with the tokens of a run with blocks to spare."""
    def workload() -> list[Request]:
        return [Request(f"r{i}", [i * 10 + j for j in range(3 + i % 5)], 20 + 3 * (i % 4)) for i in range(8)]

    ample = drain(Scheduler(8, kv()), workload())
    tight = Scheduler(8, kv(num_blocks=12))  # 11 blocks of 4 = 44 positions for 8 sequences of up to 36
    got = drain(tight, workload())
    assert tight.num_preemptions > 0
    assert got == ample
    assert tight.blocks.num_free_blocks == 11


def test_without_offset_prefill_requests_reserve_their_length_and_are_never_preempted():
    s = Scheduler(8, kv(num_blocks=12, enable_prefix_caching=False, enable_chunked_prefill=False,
                        offset_prefill=False))
    reqs = [Request(f"r{i}", [i * 10 + j for j in range(3 + i % 5)], 20 + 3 * (i % 4)) for i in range(8)]
    got = drain(s, reqs)
    assert s.num_preemptions == 0 and got == drain(Scheduler(8, kv()), [
        Request(r.request_id, r.prompt_token_ids, r.max_tokens) for r in reqs])
    with pytest.raises(ConfigError, match="no offset prefill buckets"):
        kv(offset_prefill=False)


def test_many_requests_each_get_exact_token_count_and_blocks_never_shared():
    s = Scheduler(3, kv(num_blocks=20))
    lengths = {f"r{i}": 1 + (i * 7) % 5 for i in range(20)}
    for rid, mt in lengths.items():
        i = int(rid[1:])
        s.add(req(rid, max_tokens=mt, n_prompt=3 + i % 10, first=1000 * i))  # distinct prompts: no prefix hits
    finished: dict[str, Request] = {}
    while s.has_work():
        held = [b for rid in s.running for b in s.blocks.table(rid)]
        assert len(held) == len(set(held)) and 0 not in held and s.num_running <= 3
        out = s.schedule()
        for w in (*out.decodes, *out.prefills):
            if isinstance(w, PrefillWork) and not w.last:
                s.update_prefill(w.request_id, len(w.token_ids))
                continue
            r = s.update(w.request_id, 1)
            if len(r.output_token_ids) >= r.max_tokens:
                finished[w.request_id] = s.finish(w.request_id)
    assert {k: len(v.output_token_ids) for k, v in finished.items()} == lengths
    assert s.blocks.num_free_blocks == 19


def test_a_prompt_waits_for_pool_blocks_before_it_prefills_and_no_step_runs_past_its_blocks():
    """Memory is admitted against the pool before a prefill runs: a prompt whose first chunk finds too few free
    blocks waits in the queue holding nothing, and every item of every step already holds the blocks of the
    positions it writes (a late shortage is a preemption, never a write past the pool). The pool itself always
    holds one whole max_model_len sequence, so an admitted request can always finish."""
    s = Scheduler(4, kv(num_blocks=9, max_model_len=32, enable_chunked_prefill=False))  # 8 blocks = 32 positions
    a, b = req("a", n_prompt=20, max_tokens=8), req("b", n_prompt=16, max_tokens=4, first=500)
    s.add(a)
    assert run_step(s) == ([], ["a"])  # a holds 5 blocks
    s.add(b)  # its 16 tokens need 4 blocks, 3 are free
    for _ in range(100):
        out = s.schedule()
        for w in out.prefills:
            assert len(w.blocks) * BS >= w.start + len(w.token_ids)
        for d in out.decodes:
            assert len(d.blocks) * BS >= d.position + 1
        held = {blk for rid in s.running for blk in s.blocks.table(rid)}
        assert len(held) <= 8
        if s.waiting:
            assert "b" not in s.blocks.tables and all(w.request_id != "b" for w in out.prefills)
        for w in (*out.decodes, *out.prefills):
            r = s.update(w.request_id, model_token(s.running[w.request_id]))
            if len(r.output_token_ids) >= r.max_tokens:
                s.finish(w.request_id)
        if not s.has_work():
            break
    assert b.output_token_ids == drain(Scheduler(4, kv()), [req("b", n_prompt=16, max_tokens=4, first=500)])["b"]
    assert len(a.output_token_ids) == 8 and s.num_preemptions == 0
    with pytest.raises(ConfigError, match="at least one sequence of max_model_len=128"):
        CacheConfig(max_model_len=128, block_size=32, num_blocks=4)
