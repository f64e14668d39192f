"""serve's thread policy (runtime/threads.py): the torch thread count of each graph call, set on the calling thread
by the runner; a bad policy name is refused before anything loads."""

from __future__ import annotations

import pytest
import torch

from neuron_opt.buckets import DECODE, PREFILL, Bucket, BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.errors import ConfigError
from neuron_opt.runtime.runner import DecodeRow, ModelRunner
from neuron_opt.runtime.threads import ADAPTIVE_MIN_ROWS, ThreadPolicy


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_threads_per_call_for_each_policy(cores):
    one, many, pre = Bucket(DECODE, 1, 64), Bucket(DECODE, ADAPTIVE_MIN_ROWS, 64), Bucket(PREFILL, 1, 32)
    reserve, all_, adaptive = (ThreadPolicy(n, cores) for n in ("reserve", "all", "adaptive"))
    free = max(1, cores - 1)
    assert [reserve.threads_for(b) for b in (one, many, pre)] == [free] * 3 and not reserve.varies
    assert [all_.threads_for(b) for b in (one, many, pre)] == [cores] * 3 and all_.base == cores
    assert [adaptive.threads_for(b) for b in (one, many, pre)] == [free, cores, cores]
    assert adaptive.base == free and adaptive.varies == (cores > 1)


def test_an_unknown_policy_names_the_variable():
    with pytest.raises(ConfigError, match=r"NEURON_OPT_THREAD_POLICY: must be one of \['reserve', 'all', 'adaptive'\]"):
        ThreadPolicy("fast", 2)


class Recorder:
    """An executor that records the torch thread count each call ran with."""

    def __init__(self) -> None:
        self.k_caches, self.v_caches = [torch.zeros(1)], [torch.zeros(1)]
        self.seen: list[tuple[str, int, int]] = []

    def run(self, bucket: Bucket, inputs) -> torch.Tensor:  # noqa: ANN001
        self.seen.append((bucket.phase, bucket.batch, torch.get_num_threads()))
        return torch.zeros(bucket.batch, 8)


def test_the_runner_sets_each_calls_threads_on_the_calling_thread():
    threads = torch.get_num_threads()
    try:
        cache = CacheConfig(max_batch=4, max_model_len=64, block_size=8)
        buckets = BucketConfig.build(max_prompt_len=32, max_model_len=64, max_batch=4, min_prefill=16, min_decode=16)
        ex = Recorder()
        runner = ModelRunner(ex, buckets, cache, 8)
        torch.set_num_threads(1)
        runner.prefill(0, [3, 4, 5])  # no policy: the count is left as it is
        runner.thread_policy = ThreadPolicy("adaptive", 3)
        runner.prefill(0, [3, 4, 5])
        runner.decode([DecodeRow(0, 6, 3)])
        runner.decode([DecodeRow(0, 7, 4), DecodeRow(1, 7, 0)])
        assert ex.seen == [(PREFILL, 1, 1), (PREFILL, 1, 3), (DECODE, 1, 2), (DECODE, 2, 3)]
    finally:
        torch.set_num_threads(threads)


def test_serve_refuses_a_bad_policy_before_loading(monkeypatch):
    from neuron_opt import envs
    from neuron_opt.cli import build_parser

    monkeypatch.setattr(envs, "THREAD_POLICY", "fastest")
    args = build_parser().parse_args(["serve", "--model", "no/such/checkpoint"])
    with pytest.raises(ConfigError, match="NEURON_OPT_THREAD_POLICY"):
        args.func(args)
