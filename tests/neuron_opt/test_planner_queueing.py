"""The planner's queue model (neuron_opt.planner.queueing) against a simulation of our own scheduler: the real
runtime/scheduler.py, device-free, fed the same arrivals, with the same step clock advancing time; and against
the closed forms of the simple cases."""

from __future__ import annotations

import math

import pytest

from neuron_opt.buckets import BucketConfig
from neuron_opt.config import ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner import get_instance
from neuron_opt.planner import queueing as qm
from neuron_opt.planner.validation import models
from neuron_opt.runtime.request import Request
from neuron_opt.runtime.scheduler import KVConfig, Scheduler

REL = 1e-9  # the model restates the scheduler's policy: only float summation order may differ


def scheduler_sim(policy: qm.Policy, clock: qm.StepClock, arrivals: list[float], input_len: int,
                  output_len: int) -> tuple[list[float], list[float]]:
    """(TTFT of each request, every inter-token gap) from the real scheduler; time advances by `clock` per step:
    one decode call, then one prefill call per group of `prefill_batch` chunks (runtime/engine.py)."""
    block = 16
    max_len = input_len + output_len
    kv = KVConfig(num_blocks=policy.max_num_seqs * math.ceil(max_len / block) + 1, block_size=block,
                  max_model_len=max_len, max_prefill_len=policy.max_prefill_len, enable_prefix_caching=False,
                  enable_chunked_prefill=policy.chunked)
    sched = Scheduler(policy.max_num_seqs, kv, max_num_batched_tokens=policy.max_num_batched_tokens)
    t, nxt, done = 0.0, 0, 0
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []

    def token(rid: str) -> None:
        req = sched.update(rid, 7)
        if rid in first:
            gaps.append(t - last[rid])
        else:
            first[rid] = t
        last[rid] = t
        if len(req.output_token_ids) >= output_len:
            sched.finish(rid)

    while done < len(arrivals):
        while nxt < len(arrivals) and arrivals[nxt] <= t:
            sched.add(Request(f"r{nxt}", list(range(1, input_len + 1)), output_len, arrival_time=arrivals[nxt]))
            nxt += 1
        out = sched.schedule()
        assert not out.preempted
        if out.is_empty:
            t = arrivals[nxt]
            continue
        dt = clock.decode(len(out.decodes), max(d.position for d in out.decodes)) if out.decodes else 0.0
        for i in range(0, len(out.prefills), policy.prefill_batch):
            group = out.prefills[i:i + policy.prefill_batch]
            dt += clock.prefill(len(group), max(len(p.token_ids) for p in group))
        t += dt
        for d in out.decodes:
            token(d.request_id)
        for p in out.prefills:
            if p.last:
                token(p.request_id)
            else:
                sched.update_prefill(p.request_id, len(p.token_ids))
        done = len(arrivals) - sched.num_running - sched.num_waiting - (len(arrivals) - nxt)
    return [first[f"r{i}"] - arrivals[i] for i in range(len(arrivals))], gaps


def toy_clock(prefill_s: float = 0.05, decode_base: float = 0.004, decode_row: float = 0.0005,
              per_token: float = 1e-5, bucket: int = 64) -> qm.StepClock:
    """Decode cost grows with rows and with the position's bucket; prefill with rows and chunk length."""
    return qm.StepClock(
        decode=lambda rows, pos: decode_base + decode_row * rows + 1e-6 * bucket * (pos // bucket + 1),
        prefill=lambda rows, tokens: prefill_s + per_token * rows * tokens,
    )


def planner_clock(prefill_batch: int = 1) -> qm.StepClock:
    cfg, inst = models()["Llama-3-8B"], get_instance("inf2.48xlarge")
    buckets = BucketConfig.build(max_prompt_len=1024, max_model_len=1536, max_batch=8, prefill_batch=prefill_batch)
    return qm.bucket_clock(cfg, head_layout(cfg, ParallelConfig(tp=24)), inst, buckets, dtype="bfloat16")


def check_against_scheduler(policy: qm.Policy, clock: qm.StepClock, arrival: qm.Arrival, concurrency: int,
                            input_len: int, output_len: int) -> qm.QueueEstimate:
    est = qm.estimate(policy, clock, arrival, concurrency, input_len, output_len)
    ttfts, gaps = scheduler_sim(policy, clock, arrival.times(concurrency), input_len, output_len)
    assert est.requests == len(ttfts)
    assert est.ttft_p50 == pytest.approx(qm.quantile(ttfts, 0.5), rel=REL)
    assert est.ttft_p99 == pytest.approx(qm.quantile(ttfts, 0.99), rel=REL)
    if output_len > 1:
        assert est.tpot_p50 == pytest.approx(qm.quantile(gaps, 0.5), rel=REL)
        assert est.tpot_p99 == pytest.approx(qm.quantile(gaps, 0.99), rel=REL)
    return est


def test_together_one_prefill_per_step_the_ith_prompt_waits_i_prefills() -> None:
    """Budget = one prompt, no chunking: each step decodes the running streams and prefills one more prompt, so
    the i-th prompt's first token comes after i + 1 prefills and the decodes of the i steps before it."""
    c, n_in, p = 6, 200, 0.05
    clock = toy_clock(prefill_s=p, per_token=0.0)
    policy = qm.Policy(max_num_seqs=c, max_prefill_len=256, max_num_batched_tokens=n_in, chunked=False)
    closed = [(i + 1) * p + sum(clock.decode(j, n_in + i - j) for j in range(1, i + 1)) for i in range(c)]
    ttfts, _ = scheduler_sim(policy, clock, [0.0] * c, n_in, 20)
    assert ttfts == pytest.approx(closed, rel=REL)
    est = check_against_scheduler(policy, clock, qm.Arrival(), c, n_in, 20)
    assert est.ttft_p50 == pytest.approx(closed[2]) and est.ttft_p99 == pytest.approx(closed[-1])
    # no decode cost: the i-th prompt waits exactly i prefills
    free = qm.StepClock(decode=lambda rows, pos: 0.0, prefill=lambda rows, tokens: p)
    est = qm.estimate(policy, free, qm.Arrival(), c, n_in, 20)
    assert (est.ttft_p50, est.ttft_p99) == pytest.approx((3 * p, c * p))


def test_together_in_one_batched_prefill_every_prompt_waits_for_the_whole_batch() -> None:
    """transformers-neuronx's policy (the validation rows): the batch prefilled in one call."""
    clock = toy_clock()
    policy = qm.Policy(max_num_seqs=8, max_prefill_len=512, max_num_batched_tokens=8 * 512, prefill_batch=8,
                       chunked=False)
    est = check_against_scheduler(policy, clock, qm.Arrival(), 8, 300, 30)
    assert est.ttft_p50 == est.ttft_p99 == pytest.approx(clock.prefill(8, 300))


def test_together_admitted_whole_one_row_per_call_every_prompt_waits_for_every_row() -> None:
    """optimum-neuron's continuous-batching policy (its benchmark rows in the validation): the batch is admitted
    in one step and prefilled one row per call, so every prompt's first token comes after all the rows' calls."""
    clock = toy_clock()
    policy = qm.Policy(max_num_seqs=8, max_prefill_len=512, max_num_batched_tokens=8 * 512, prefill_batch=1,
                       chunked=False)
    est = check_against_scheduler(policy, clock, qm.Arrival(), 8, 300, 30)
    assert est.ttft_p50 == est.ttft_p99 == pytest.approx(8 * clock.prefill(1, 300))
    # four of eight slots' prompts: four calls, not eight
    est = check_against_scheduler(policy, clock, qm.Arrival(), 4, 300, 30)
    assert est.ttft_p50 == pytest.approx(4 * clock.prefill(1, 300))


@pytest.mark.parametrize("chunked,budget,prefill_batch", [(True, 512, 1), (True, 256, 2), (False, 1024, 1)])
def test_poisson_arrivals_agree_with_the_scheduler(chunked: bool, budget: int, prefill_batch: int) -> None:
    policy = qm.Policy(max_num_seqs=4, max_prefill_len=512, max_num_batched_tokens=budget,
                       prefill_batch=prefill_batch, chunked=chunked)
    arrival = qm.Arrival("poisson", rate=6.0, requests=150, seed=3)
    est = check_against_scheduler(policy, toy_clock(), arrival, 4, 300, 25)
    assert est.ttft_p99 > est.ttft_p50 > 0 and not est.saturated


def test_without_chunked_prefill_long_prompts_run_in_bucket_chunks_as_the_scheduler_runs_them() -> None:
    """Prompts longer than the largest prefill bucket (300 over 128), no chunked prefill: chunks of 128, 128, 44
    that a budget of 200 never cuts, agreeing with the scheduler step by step."""
    policy = qm.Policy(max_num_seqs=4, max_prefill_len=128, max_num_batched_tokens=200, chunked=False)
    est = check_against_scheduler(policy, toy_clock(), qm.Arrival("poisson", rate=4.0, requests=80, seed=2), 4,
                                  300, 25)
    alone = qm.estimate(policy, toy_clock(per_token=0.0), qm.Arrival(), 1, 300, 2)
    assert est.ttft_p50 > 0 and alone.ttft_p50 == pytest.approx(3 * 0.05)  # three prefill calls


def test_planner_clock_with_buckets_agrees_with_the_scheduler() -> None:
    """The plan's own clock (Llama-3-8B on inf2, tp 24): decode length buckets change mid-run."""
    policy = qm.Policy(max_num_seqs=8, max_prefill_len=1024, max_num_batched_tokens=2048)
    check_against_scheduler(policy, planner_clock(), qm.Arrival(), 8, 1000, 300)
    check_against_scheduler(policy, planner_clock(), qm.Arrival("poisson", rate=3.0, requests=120), 8, 700, 120)
    batched = qm.Policy(max_num_seqs=8, max_prefill_len=1024, max_num_batched_tokens=2048, prefill_batch=4)
    check_against_scheduler(batched, planner_clock(4), qm.Arrival(), 8, 600, 50)


def test_poisson_is_seeded_and_saturation_is_flagged() -> None:
    a = qm.Arrival("poisson", rate=5.0, requests=400)
    assert a.times(1) == qm.Arrival("poisson", rate=5.0, requests=400).times(1)
    assert a.times(1) != qm.Arrival("poisson", rate=5.0, requests=400, seed=1).times(1)
    assert 400 / 5.0 * 0.85 < a.times(1)[-1] < 400 / 5.0 * 1.15
    policy = qm.Policy(max_num_seqs=2, max_prefill_len=512)
    slow = qm.estimate(policy, toy_clock(), qm.Arrival("poisson", rate=50.0, requests=300), 2, 300, 50)
    fast = qm.estimate(policy, toy_clock(), qm.Arrival("poisson", rate=0.5, requests=300), 2, 300, 50)
    assert slow.saturated and not fast.saturated and slow.ttft_p50 > 10 * fast.ttft_p50


def test_bad_arrivals_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="rate"):
        qm.Arrival("poisson")
    with pytest.raises(ConfigError, match="rate"):
        qm.Arrival("together", rate=2.0)
    with pytest.raises(ConfigError, match="arrival"):
        qm.Arrival("bursty")
    with pytest.raises(ConfigError, match="together"):
        qm.Arrival("together", requests=3)
    with pytest.raises(ConfigError, match="requests"):
        qm.Arrival("poisson", rate=1.0, requests=0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        qm.Policy(max_num_seqs=1, max_prefill_len=128, max_num_batched_tokens=0)
