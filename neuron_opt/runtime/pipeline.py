"""Async scheduling's device side: a step's graph calls and sampling as one task on the graph thread.

With async scheduling (runtime/engine.py, vLLM's `--async-scheduling`) the engine thread hands each step to a
single graph thread as a `StepTask` and, while it runs, lands the step before it (detokenizing, stop checks,
callbacks) and schedules and builds the next one. A task returns one `RowOutcome` per row it samples: token ids
out, as a device that samples would. Rows of a call that fails are run again one per call, as the synchronous
engine does (`Engine._isolate_failure`), so only the row that fails carries an error.

What the graph thread touches: the runner (its graph calls), and the `SamplerState` of the rows it samples (their
generators, penalty counts, grammar matchers), which the engine thread leaves alone until the task's result is
taken; a grammar row's mask for the task is filled by the engine thread before `masks_ready` is set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from neuron_opt.backends.base import StepInputs
from neuron_opt.buckets import Bucket
from neuron_opt.runtime.runner import DecodeRow, ModelRunner, PrefillRow
from neuron_opt.runtime.sampling import SampleResult, SamplerState, sample_batch
from neuron_opt.runtime.scheduler import DecodeWork, PrefillWork


@dataclass
class StepTask:
    """A planned step: one decode call (its inputs built, tokens in place) and prefill calls, and what sampling
    each sampled row needs (its state, its banned ids; `candidates`: `ModelRunner`'s, per call)."""

    decodes: tuple[DecodeWork, ...]
    decode_call: tuple[Bucket, StepInputs] | None
    prefill_groups: tuple[tuple[PrefillWork, ...], ...]
    states: dict[str, SamplerState]
    banned: dict[str, tuple[int, ...]]
    decode_candidates: int | None = None
    prefill_candidates: tuple[int | None, ...] = ()
    threads: int = 1  # torch intra-op threads of the graph thread (the engine thread's own count)
    masks_ready: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class RowOutcome:
    """A row's sampled token (`result`), whether its grammar ended on it, or the error of its graph call."""

    result: SampleResult | None = None
    grammar_done: bool = False
    error: BaseException | None = None
    what: str = ""  # "decode" | "prefill": the call that failed


@dataclass
class TaskResult:
    rows: dict[str, RowOutcome]
    graph_s: float = 0.0  # graph calls, input building of the prefill calls included
    sample_s: float = 0.0
    busy_s: float = 0.0  # the whole task on the graph thread
    prefill_graph_tokens: int = 0


def run_task(runner: ModelRunner, task: StepTask) -> TaskResult:
    """Run `task` (on the graph thread): the decode call, then each prefill call, sampling their rows."""
    t0 = time.perf_counter()
    if torch.get_num_threads() != task.threads:
        torch.set_num_threads(task.threads)
    out = TaskResult({})
    if task.decodes:
        assert task.decode_call is not None
        bucket, inputs = task.decode_call
        try:
            logits = runner.run_decode(bucket, inputs, len(task.decodes), task.decode_candidates)
        except Exception as e:  # each row alone: it rewrites only its own position's K/V, from the same token
            if len(task.decodes) == 1:
                out.rows[task.decodes[0].request_id] = RowOutcome(error=e, what="decode")
            else:
                for d in task.decodes:
                    _alone(runner, task, d, out)
        else:
            out.graph_s += time.perf_counter() - t0
            _sample(task, [d.request_id for d in task.decodes], logits, out)
    for group, candidates in zip(task.prefill_groups, task.prefill_candidates, strict=True):
        _prefill(runner, task, group, candidates, out)
    out.busy_s = time.perf_counter() - t0
    return out


def _sample(task: StepTask, ids: Sequence[str], logits: torch.Tensor, out: TaskResult) -> None:
    """Sample the rows of `ids` from `logits` [len(ids), V] and record them (the grammar masks once filled)."""
    t0 = time.perf_counter()
    if any(task.states[rid].grammar is not None for rid in ids):
        task.masks_ready.wait()
    states = [task.states[rid] for rid in ids]
    results = sample_batch(logits, states, [task.banned[rid] for rid in ids])
    for rid, st, res in zip(ids, states, results, strict=True):
        st.observe(res.token)
        out.rows[rid] = RowOutcome(res, st.grammar_done)
    out.sample_s += time.perf_counter() - t0


def _alone(runner: ModelRunner, task: StepTask, d: DecodeWork, out: TaskResult) -> None:
    try:
        logits = runner.decode([DecodeRow(d.blocks, d.token, d.position, d.lora_slot, d.window_blocks)],
                               candidates=task.decode_candidates)
    except Exception as e:
        out.rows[d.request_id] = RowOutcome(error=e, what="decode")
        return
    _sample(task, [d.request_id], logits, out)


def _prefill(runner: ModelRunner, task: StepTask, group: tuple[PrefillWork, ...], candidates: int | None,
             out: TaskResult) -> None:
    """One prefill call (each chunk alone after a failure); the chunks that end their prompt sample a token."""
    t0 = time.perf_counter()
    rows = [PrefillRow(p.blocks, p.token_ids, p.start, p.lora_slot, p.window_blocks) for p in group]
    try:
        logits = runner.prefill_rows(rows, candidates=candidates)
    except Exception as e:
        if len(group) == 1:
            out.rows[group[0].request_id] = RowOutcome(error=e, what="prefill")
        else:
            for p in group:
                _prefill(runner, task, (p,), candidates, out)
        return
    out.graph_s += time.perf_counter() - t0
    if runner.last_bucket is not None:
        out.prefill_graph_tokens += runner.last_bucket.num_tokens
    last = [i for i, p in enumerate(group) if p.last]
    if last:
        _sample(task, [group[i].request_id for i in last], logits[last], out)
