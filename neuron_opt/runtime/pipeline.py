"""Async scheduling's device side: a step's graph calls and sampling as one task on the graph thread.

With async scheduling (runtime/engine.py, vLLM's `--async-scheduling`) the engine thread hands each step to a
single graph thread as a `StepTask` and, while it runs, lands the step before it (detokenizing, stop checks,
callbacks) and schedules and builds the next one. A task returns one `RowOutcome` per row it samples: token ids
out. On an executor that samples in its graphs (`ModelRunner.samples_on_device`: the neuron backend) the task hands
its calls the rows' sampling inputs, built on the graph thread, and the logits stay on the device, as in the
synchronous loop (the same rows fall back to the host sampler: `runtime.sampling.host_sampling_reason`).
Rows of a call that fails are run again one per call, as the synchronous
engine does (`Engine._isolate_failure`), so only the row that fails carries an error.

What the graph thread touches: the runner (its graph calls), and the `SamplerState` of the rows it samples (their
generators, penalty counts, grammar matchers), which the engine thread leaves alone until the task's result is
taken; a grammar row's mask for the task is filled by the engine thread before `masks_ready` is set (a graph
that samples takes it as an input, so its call waits for it; the host sampler waits only to sample).
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
from neuron_opt.runtime.sampling import (
    SampleResult,
    SamplerState,
    device_inputs,
    device_results,
    host_sampling_reason,
    sample_batch,
)
from neuron_opt.runtime.scheduler import DecodeWork, PrefillWork
from neuron_opt.sample_ops import SamplingInputs


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
        _decode(runner, task, task.decodes, task.decode_call, out)
    for group, candidates in zip(task.prefill_groups, task.prefill_candidates, strict=True):
        _prefill(runner, task, group, candidates, out)
    out.busy_s = time.perf_counter() - t0
    return out


def _device_sampling(runner: ModelRunner, task: StepTask, ids: Sequence[str | None],
                     out: TaskResult) -> SamplingInputs | None:
    """The call's sampling inputs for a graph that samples its rows (a None row samples nothing), built once the
    grammar masks are filled; None where the executor's graphs return logits, or a row needs the host sampler this
    step (counted in the runner's `host_fallback`), as the synchronous engine decides (`Engine._device_sampling`)."""
    if not runner.samples_on_device or not any(rid is not None for rid in ids):
        return None
    t0 = time.perf_counter()
    states = [None if rid is None else task.states[rid] for rid in ids]
    if any(host_sampling_reason(st, runner.sample_candidates) is not None for st in states):
        runner.stats.host_fallback += sum(st is not None for st in states)
        return None
    if any(st is not None and st.grammar is not None for st in states):
        task.masks_ready.wait()
    sampling = device_inputs(states, [() if rid is None else task.banned[rid] for rid in ids], runner.vocab_size)
    out.sample_s += time.perf_counter() - t0
    return sampling


def _decode(runner: ModelRunner, task: StepTask, decodes: tuple[DecodeWork, ...], call: tuple[Bucket, StepInputs],
            out: TaskResult) -> None:
    """One decode call (each row alone after a failure: it rewrites only its own position's K/V, from the same
    token), its rows sampled in the graph or from its logits."""
    t0 = time.perf_counter()
    ids = [d.request_id for d in decodes]
    try:
        sampling = _device_sampling(runner, task, ids, out)
        t0 = time.perf_counter()
        bucket, inputs = call
        logits = (runner.run_decode(bucket, inputs, len(ids), task.decode_candidates) if sampling is None
                  else runner.run_decode_sampled(bucket, inputs, len(ids), sampling))
    except Exception as e:
        if len(decodes) == 1:
            out.rows[ids[0]] = RowOutcome(error=e, what="decode")
        else:
            for d in decodes:
                row = DecodeRow(d.blocks, d.token, d.position, d.lora_slot, d.window_blocks)
                _decode(runner, task, (d,), runner.decode_inputs([row]), out)
        return
    out.graph_s += time.perf_counter() - t0
    _sample(task, ids, logits, out)


def _sample(task: StepTask, ids: Sequence[str], logits: torch.Tensor | list[torch.Tensor], out: TaskResult) -> None:
    """Sample the rows of `ids` from `logits` [len(ids), V] (the grammar masks once filled), or take the tokens a
    graph sampled (a list: `ModelRunner.decode_sampled`'s outputs), and record them."""
    t0 = time.perf_counter()
    states = [task.states[rid] for rid in ids]
    if isinstance(logits, torch.Tensor):
        if any(st.grammar is not None for st in states):
            task.masks_ready.wait()
        results = sample_batch(logits, states, [task.banned[rid] for rid in ids])
    else:
        results = device_results(logits[0].tolist(), tuple(logits[1:]) or None, states)
    for rid, st, res in zip(ids, states, results, strict=True):
        st.observe(res.token)
        out.rows[rid] = RowOutcome(res, st.grammar_done)
    out.sample_s += time.perf_counter() - t0


def _prefill(runner: ModelRunner, task: StepTask, group: tuple[PrefillWork, ...], candidates: int | None,
             out: TaskResult) -> None:
    """One prefill call (each chunk alone after a failure); the chunks that end their prompt sample a token."""
    t0 = time.perf_counter()
    rows = [PrefillRow(p.blocks, p.token_ids, p.start, p.lora_slot, p.window_blocks) for p in group]
    try:
        sampling = _device_sampling(runner, task, [p.request_id if p.last else None for p in group], out)
        t0 = time.perf_counter()
        logits = (runner.prefill_rows(rows, candidates=candidates) if sampling is None
                  else runner.prefill_sampled(rows, sampling))
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
        taken = logits[last] if isinstance(logits, torch.Tensor) else [t[last] for t in logits]
        _sample(task, [group[i].request_id for i in last], taken, out)
