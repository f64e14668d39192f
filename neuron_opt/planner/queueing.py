"""Queue-aware TTFT and TPOT: prompts wait for each other's prefill under our scheduler's policy.

A step-level latency model (planner.latency) prices one graph call on an idle instance. Under load a prompt also
waits: for a free decode slot, for the prompts ahead of it in the queue, for the token budget of each engine step
that the running streams' decodes take first. This module replays that policy as an event model over a stream
of arrivals and reports TTFT and per-token latency percentiles.

Design decisions:
- The policy is runtime/scheduler.py's, restated over request counters instead of token lists and block tables:
  each step decodes every running sequence whose prompt is computed (one token each), then spends what is left
  of `max_num_batched_tokens` on prompt chunks, first of running sequences part-way through their prompt, then
  new requests first come first served while fewer than `max_num_seqs` run. With chunked prefill a chunk takes
  what is left of the budget (at most the largest prefill bucket); without it a prompt runs whole (longer than the
  largest prefill bucket: in chunks of that bucket's length), the first prefill of a step always runs, and a prompt
  (chunk) that does not fit the rest of the budget waits for the next step.
  The engine runs the step's decodes as one graph call and its prefill chunks in groups of `prefill_batch`, one
  call per group (runtime/engine.py); the step lasts the sum of those calls.
- KV blocks are assumed ample (the default pool holds `max_num_seqs` sequences of `max_model_len`), so no
  sequence is preempted and no prefix is cached (the arrivals' prompts are taken as distinct).
- The clock is the planner's step-time model (`StepClock`): a decode call is priced at its decode bucket (batch
  bucket x the KV length bucket of its furthest position), a prefill call at its prefill bucket (rows padded to
  the prefill batch, tokens to the prefill length of its longest chunk). A chunk after cached tokens is priced
  as a prompt of its own length: its attention over the earlier positions is not counted (an underestimate for
  the later chunks of a long prompt).
- Runs of steps that only decode are priced in one move (every step of the run costs the same until a sequence
  finishes, a request can be admitted, or the decode length bucket changes): the work grows with the number of
  requests and prefill steps, not with the number of generated tokens.
- Arrivals: `together` (all at t = 0, the C prompts of a batch), or `poisson` (seeded exponential gaps at a mean
  rate, POISSON_REQUESTS requests, the same draws on every run). Percentiles are nearest-rank: the p-th of n
  values is the ceil(p n)-th smallest. TPOT percentiles are over every inter-token gap of every request (each
  gap is the duration of the step that produced the token).

tests/neuron_opt/test_planner_queueing.py drives the real runtime/scheduler.py with the same arrivals and clock and
checks this model against it, and checks the closed forms of the simple cases.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from neuron_opt.buckets import BucketConfig, pick_decode, smallest_fitting
from neuron_opt.config import ModelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel.sharding import HeadLayout
from neuron_opt.planner.hardware import Instance
from neuron_opt.planner.latency import decode_time, prefill_time

ARRIVALS = ("together", "poisson")
POISSON_REQUESTS = 2000
POISSON_SEED = 0
SATURATED_BACKLOG = 0.05


@dataclass(frozen=True)
class Arrival:
    """How requests arrive: `together` (the C requests at once) or `poisson` (at `rate` requests per second)."""

    kind: str = "together"
    rate: float | None = None
    requests: int | None = None  # poisson only: how many arrivals are simulated (None: POISSON_REQUESTS)
    seed: int = POISSON_SEED  # poisson only

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ConfigError(f"arrival: {self.kind!r} is not one of {', '.join(ARRIVALS)}", param="arrival")
        if self.kind == "poisson" and (self.rate is None or not self.rate > 0 or math.isinf(self.rate)):
            raise ConfigError(f"rate: poisson arrivals need a finite rate > 0 requests/s, got {self.rate}",
                              param="rate")
        if self.kind == "together" and (self.rate is not None or self.requests is not None
                                        or self.seed != POISSON_SEED):
            raise ConfigError("rate: only poisson arrivals have a rate, a request count and a seed (together: the "
                              "--concurrency requests arrive at once)", param="rate")
        if self.requests is not None and self.requests < 1:
            raise ConfigError(f"requests: must be >= 1, got {self.requests}", param="requests")

    def times(self, concurrency: int) -> list[float]:
        """Arrival times in seconds: `concurrency` zeros, or `requests` Poisson arrivals from t = 0."""
        if self.kind == "together":
            return [0.0] * concurrency
        assert self.rate is not None
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(self.requests or POISSON_REQUESTS):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


@dataclass(frozen=True)
class Policy:
    """The scheduler's knobs (runtime/scheduler.py `Scheduler`, `KVConfig`; runtime/engine.py's prefill groups)."""

    max_num_seqs: int
    max_prefill_len: int  # the largest prefill bucket: the longest chunk
    max_num_batched_tokens: int = 2048
    prefill_batch: int = 1
    chunked: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_prefill_len", "max_num_batched_tokens", "prefill_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}", param=name)


@dataclass(frozen=True)
class StepClock:
    """Seconds of one graph call: `decode(rows, max_position)`, `prefill(rows, longest_chunk)`."""

    decode: Callable[[int, int], float]
    prefill: Callable[[int, int], float]


@dataclass(frozen=True)
class QueueEstimate:
    """TTFT (arrival to first token) and inter-token latency percentiles, in seconds, over the simulated requests."""

    arrival: Arrival
    policy: Policy
    requests: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float | None  # None when no request produced a second token
    tpot_p99: float | None
    # arrivals faster than the deployment serves them: when the last request arrived, more than SATURATED_BACKLOG
    # of all requests (and more than max_num_seqs) were still queued, so the queue grows with time and the TTFT
    # percentiles with `requests`
    saturated: bool = False


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the ceil(q n)-th smallest of n values."""
    a = sorted(values)
    return a[max(0, math.ceil(q * len(a)) - 1)]


def weighted_quantile(pairs: dict[float, int], q: float) -> float | None:
    """Nearest rank over values each repeated `weight` times."""
    total = sum(pairs.values())
    if total == 0:
        return None
    rank, seen = max(1, math.ceil(q * total)), 0
    for value in sorted(pairs):
        seen += pairs[value]
        if seen >= rank:
            return value
    raise AssertionError("unreachable")


class _Req:
    __slots__ = ("arrival", "computed", "out", "first")

    def __init__(self, arrival: float) -> None:
        self.arrival, self.computed, self.out, self.first = arrival, 0, 0, -1.0


def simulate(policy: Policy, clock: StepClock, arrivals: Sequence[float], input_len: int,
             output_len: int, arrival: Arrival | None = None) -> QueueEstimate:
    """Serve requests of `input_len` prompt tokens and `output_len` generated tokens arriving at `arrivals` (sorted
    seconds) under `policy`, each step priced by `clock`; the TTFT and TPOT percentiles."""
    if input_len < 1 or output_len < 1:
        raise ConfigError(f"input_len and output_len must be >= 1, got {input_len} and {output_len}")
    if list(arrivals) != sorted(arrivals):
        raise ValueError("arrivals must be sorted")
    reqs = [_Req(a) for a in arrivals]
    nxt, t = 0, 0.0  # next request not yet arrived; the clock
    waiting: deque[_Req] = deque()
    running: list[_Req] = []  # admission order
    gaps: dict[float, int] = {}
    done, backlog = 0, 0
    while done < len(reqs):
        while nxt < len(reqs) and reqs[nxt].arrival <= t:
            waiting.append(reqs[nxt])
            nxt += 1
            backlog = len(waiting)  # the last time this is set: the queue the last arrival joins
        if not running and not waiting:
            t = reqs[nxt].arrival
            continue
        decoding = [r for r in running if input_len + r.out - r.computed == 1]
        room = len(running) < policy.max_num_seqs
        if len(decoding) == len(running) and all(r.out for r in running) and not (waiting and room):
            # a run of decode-only steps: priced in one move up to the next event
            n = len(running)
            pos = max(r.computed for r in running)
            dt = clock.decode(n, pos)
            k = _same_bucket_steps(clock, n, pos, dt, min(output_len - r.out for r in running))
            if room and nxt < len(reqs):  # steps that start before the next arrival
                k = min(k, max(1, math.ceil((reqs[nxt].arrival - t) / dt)))
            t += k * dt
            gaps[dt] = gaps.get(dt, 0) + k * n
            for r in running:
                r.computed += k
                r.out += k
            finished = [r for r in running if r.out == output_len]
            running = [r for r in running if r.out < output_len]
            done += len(finished)
            continue
        budget = policy.max_num_batched_tokens - len(decoding)
        prefills: list[tuple[_Req, int]] = []  # (request, chunk)
        for r in running:
            left = input_len + r.out - r.computed
            if left <= 1:
                continue
            chunk = min(left, policy.max_prefill_len)
            if policy.chunked:
                if budget <= 0:
                    continue
                chunk = min(chunk, budget)
            elif prefills and chunk > budget:
                continue
            prefills.append((r, chunk))
            budget -= chunk
        while (waiting and len(running) < policy.max_num_seqs
               and (budget > 0 or not (prefills or policy.chunked))):
            r = waiting[0]
            if policy.chunked:
                chunk = min(input_len, max(budget, 1), policy.max_prefill_len)
            else:
                chunk = min(input_len, policy.max_prefill_len)
                if prefills and chunk > budget:
                    break
            waiting.popleft()
            running.append(r)
            prefills.append((r, chunk))
            budget -= chunk
        dt = clock.decode(len(decoding), max(r.computed for r in decoding)) if decoding else 0.0
        for i in range(0, len(prefills), policy.prefill_batch):
            group = prefills[i:i + policy.prefill_batch]
            dt += clock.prefill(len(group), max(c for _, c in group))
        t += dt
        for r in decoding:
            r.computed += 1
            if r.out:
                gaps[dt] = gaps.get(dt, 0) + 1
            else:
                r.first = t
            r.out += 1
        for r, chunk in prefills:
            r.computed += chunk
            if r.computed == input_len + r.out:
                r.first = t if not r.out else r.first
                r.out += 1
        finished = [r for r in running if r.out >= output_len]
        running = [r for r in running if r.out < output_len]
        done += len(finished)
    ttfts = [r.first - r.arrival for r in reqs]
    arrival = arrival or Arrival()
    saturated = backlog > max(policy.max_num_seqs, SATURATED_BACKLOG * len(reqs))
    return QueueEstimate(arrival, policy, len(reqs), quantile(ttfts, 0.5), quantile(ttfts, 0.99),
                         weighted_quantile(gaps, 0.5), weighted_quantile(gaps, 0.99), saturated)


def _same_bucket_steps(clock: StepClock, rows: int, pos: int, dt: float, limit: int) -> int:
    """How many of the next `limit` decode steps, from position `pos` on, cost `dt` (the KV length bucket has not
    changed): bisection on the clock, which is non-decreasing in the position."""
    lo, hi = 1, limit  # step j (1-based) decodes position pos + j - 1; step 1 costs dt
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if clock.decode(rows, pos + mid - 1) == dt:
            lo = mid
        else:
            hi = mid - 1
    return lo


def estimate(policy: Policy, clock: StepClock, arrival: Arrival, concurrency: int, input_len: int,
             output_len: int) -> QueueEstimate:
    """`simulate` over the arrivals `arrival` draws (together: `concurrency` requests)."""
    return simulate(policy, clock, arrival.times(concurrency), input_len, output_len, arrival)


def bucket_clock(cfg: ModelConfig, lay: HeadLayout, inst: Instance, buckets: BucketConfig, *, dtype: str,
                 kv_dtype: str = "bfloat16", flash_from: int | None = None,
                 prefill_buckets: Sequence[int] | None = None, lora: LoraConfig | None = None) -> StepClock:
    """The planner's step-time model as a clock: a call costs its bucket's `prefill_time` / `decode_time` (the
    decode layout's for decode graphs). `flash_from`: prefill lengths from which the stack runs a flash-attention
    kernel (None: never, our default graphs). `prefill_buckets`: the prefill lengths of a stack whose chunks are
    padded to other lengths than `buckets` (validation rows); default `buckets.prefill_lens`. `lora`: the LoRA
    capacity the graphs carry (None: none)."""
    lens = tuple(prefill_buckets or buckets.prefill_lens)
    dec_lay = lay.decode_layout()
    decode_cache: dict[tuple[int, int], float] = {}
    prefill_cache: dict[tuple[int, int], float] = {}

    def decode(rows: int, max_position: int) -> float:
        b = pick_decode(rows, max_position, buckets)
        key = (b.batch, b.kv_len)
        if key not in decode_cache:
            decode_cache[key] = decode_time(cfg, dec_lay, inst, batch=b.batch, kv_len=b.kv_len, dtype=dtype,
                                            kv_dtype=kv_dtype, lora=lora).total
        return decode_cache[key]

    def prefill(rows: int, tokens: int) -> float:
        seq = smallest_fitting(tokens, lens)
        if seq is None:
            raise ConfigError(f"a prefill chunk of {tokens} tokens exceeds the largest prefill bucket ({lens[-1]})")
        key = (buckets.prefill_batch, seq)
        if key not in prefill_cache:
            flash = flash_from is not None and seq >= flash_from
            prefill_cache[key] = prefill_time(cfg, lay, inst, batch=buckets.prefill_batch, seq=seq, dtype=dtype,
                                              flash=flash, lora=lora).total
        return prefill_cache[key]

    return StepClock(decode, prefill)
