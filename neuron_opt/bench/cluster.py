"""What a benchmark or a test reads from `serve --data-parallel N`'s router: its merged /metrics.

The router answers /metrics with every replica's families, each sample labelled with its replica, plus its own
(`cluster_routed_total{replica,reason}`, `cluster_prefix_cache_hit_rate`; neuron_opt/server/cluster/prometheus.py). The
replicas push their metrics about once a second, so a reader that needs every finished request counted waits
for the replicas' `request_success_total` to reach it (`wait_counted`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

PREFIX = "neuron_opt:"  # the router's own metrics
VLLM = "vllm:"  # the replicas' metrics that vLLM has too (server/metrics.py)


def router_metrics(url: str, label: str = "replica") -> dict[tuple[str, str], float]:
    """{(sample name, value of `label`): value} of the router's merged /metrics (samples summed over the other
    labels; samples without `label` under "")."""
    import httpx  # the `serve` extra, as the router this reads
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=10)
    r.raise_for_status()  # while the app deploys, Ray's proxy answers 404 with a text of its own
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = (s.name, s.labels.get(label, ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def summed(m: dict[tuple[str, str], float], name: str) -> float:
    """A sample of vLLM's name (`vllm:` + `name`) summed over the replicas."""
    return sum(v for (n, _), v in m.items() if n == VLLM + name)


def routed(m: dict[tuple[str, str], float]) -> dict[str, float]:
    """Requests the router sent to each replica (all reasons)."""
    return {replica: v for (n, replica), v in m.items() if n == PREFIX + "cluster_routed_total"}


def wait_counted(url: str, requests: float, timeout: float = 30.0) -> dict[tuple[str, str], float]:
    """The router's metrics once the replicas' `request_success_total` sums to at least `requests`."""
    end = time.monotonic() + timeout
    while True:
        m = router_metrics(url)
        if summed(m, "request_success_total") >= requests:
            return m
        if time.monotonic() > end:
            raise TimeoutError(f"the replicas' metrics counted {summed(m, 'request_success_total'):.0f} of "
                               f"{requests:.0f} requests after {timeout:g} s")
        time.sleep(0.5)


def stop_process_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """Stop a command started in its own process group (`serve`, with its Ray processes): SIGTERM, then SIGKILL to
    the whole group if it has not exited after `timeout_s` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
