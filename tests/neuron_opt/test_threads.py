"""serve's thread policy and OpenMP threads (runtime/threads.py): the torch thread count of each graph call, set on
the calling thread by the runner; the loading thread's OpenMP workers freed once the engine thread takes over; a bad
policy name refused before anything loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neuron_opt.buckets import DECODE, PREFILL, Bucket, BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.errors import ConfigError
from neuron_opt.runtime.runner import DecodeRow, ModelRunner
from neuron_opt.runtime.threads import ThreadPolicy


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_threads_of_each_policy(cores):
    assert ThreadPolicy("all", cores).threads == cores
    assert ThreadPolicy("reserve", cores).threads == max(1, cores - 1)


def test_an_unknown_policy_names_the_variable():
    with pytest.raises(ConfigError, match=r"NEURON_OPT_THREAD_POLICY: must be one of \['all', 'reserve'\]"):
        ThreadPolicy("adaptive", 2)


class Recorder:
    """An executor that records the torch thread count each call ran with."""

    def __init__(self) -> None:
        self.k_caches, self.v_caches = [torch.zeros(1)], [torch.zeros(1)]
        self.seen: list[tuple[str, int, int]] = []

    def run(self, bucket: Bucket, inputs) -> torch.Tensor:  # noqa: ANN001
        self.seen.append((bucket.phase, bucket.batch, torch.get_num_threads()))
        return torch.zeros(bucket.batch, 8)


def test_the_runner_sets_its_count_on_the_calling_thread():
    threads = torch.get_num_threads()
    try:
        cache = CacheConfig(max_batch=4, max_model_len=64, block_size=8)
        buckets = BucketConfig.build(max_prompt_len=32, max_model_len=64, max_batch=4, min_prefill=16, min_decode=16)
        ex = Recorder()
        runner = ModelRunner(ex, buckets, cache, 8)
        torch.set_num_threads(1)
        runner.prefill(0, [3, 4, 5])  # no count: left as it is
        runner.num_threads = 3
        runner.prefill(0, [3, 4, 5])
        torch.set_num_threads(2)  # another caller changed this thread's count between calls
        runner.decode([DecodeRow(0, 6, 3)])
        assert ex.seen == [(PREFILL, 1, 1), (PREFILL, 1, 3), (DECODE, 1, 3)]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc/self/task")
def test_the_loading_thread_frees_its_openmp_workers_for_the_engine_thread():
    """In a fresh process (whose threads are known): the main thread runs a parallel region on 3 threads (its pool:
    2 workers), hands over, and an engine thread runs one on 3. The process then holds the engine thread's team only:
    libgomp counts every pool's workers, and cuts its spin-wait while they outnumber the cores."""
    code = (
        "import os, threading, torch\n"
        "from neuron_opt.runtime.threads import hand_threads_to_engine\n"
        "def tasks(): return len(os.listdir('/proc/self/task'))\n"
        "x = torch.rand(1 << 22)\n"
        "torch.set_num_threads(3)\n"
        "before = tasks(); (x * 2).sum(); loaded = tasks()\n"
        "hand_threads_to_engine([], 3)\n"
        "handed = tasks()\n"
        "def step():\n"
        "    torch.set_num_threads(3); (x * 2).sum(); print(before, loaded, handed, tasks(), torch.get_num_threads())\n"
        "t = threading.Thread(target=step); t.start(); t.join()\n"
        "print(torch.get_num_threads())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (before, loaded, handed, stepping, engine_threads), (main_threads,) = (
        [int(v) for v in line.split()] for line in r.stdout.splitlines()[-2:])
    assert loaded == before + 2, "the main thread's parallel region started no pool of 2 workers"
    assert handed == before, "the main thread's workers are still there"
    assert stepping == before + 1 + 2, "expected the engine thread and its 2 workers only"
    assert (engine_threads, main_threads) == (3, 1)


def test_serve_refuses_a_bad_policy_before_loading(monkeypatch):
    from neuron_opt import envs
    from neuron_opt.cli import build_parser

    monkeypatch.setattr(envs, "THREAD_POLICY", "fastest")
    args = build_parser().parse_args(["serve", "--model", "no/such/checkpoint"])
    with pytest.raises(ConfigError, match="NEURON_OPT_THREAD_POLICY"):
        args.func(args)
