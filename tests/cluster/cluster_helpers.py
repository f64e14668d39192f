"""Helpers of the cluster tests: the prompts, the single-process reference, the router's merged /metrics, and
Serve's replica processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from neuron_opt.bench.cluster import router_metrics as metrics
from neuron_opt.bench.cluster import stop_process_group
from neuron_opt.runtime.sampling import SamplingParams

MODEL = "tiny"
REPLICA = "x-neuron-opt-replica"
PROMPTS = [[5 + i, 40 + 3 * i, 7, 99 + i, 12] for i in range(8)]  # token ids: no tokenizer subtleties


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replicas(url: str, name: str = "vllm:num_requests_running") -> dict[str, float]:
    return {r: v for (n, r), v in metrics(url).items() if n == name}


def wait(pred, timeout: float, what: str, every: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if v := pred():
                return v
        except httpx.HTTPError:
            pass
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def replica_pids() -> list[int]:
    import psutil  # a Ray dependency

    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any("ServeReplica:neuron_opt:EngineReplica" in part for part in (p.info["cmdline"] or []))]


def reference(ref, prompt: list[int], n: int) -> str:
    return ref.generate_ids(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)).text


def stop_serve(proc) -> None:
    """SIGTERM to a `serve` command, SIGKILL to its process group after 90 s; its replicas must be gone."""
    stop_process_group(proc, 90)
    assert not replica_pids(), "replica processes outlived `serve`"


@contextmanager
def serve_replicas(args: list[str], log: Path, n: int = 2) -> Iterator[tuple[str, subprocess.Popen]]:
    """`neuron-opt serve ARGS --data-parallel n` on a free port, its output in `log`: (url, process) once the router
    lists n replicas; the process group is stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "neuron_opt.cli", "serve", *args, "--data-parallel", str(n), "--port", str(port)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: proc.poll() is not None or len(replicas(url)) == n, 240, f"{n} replicas up")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield url, proc
    finally:
        stop_serve(proc)
