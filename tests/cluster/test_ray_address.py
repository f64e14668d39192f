"""`neuron-opt serve --ray-address ADDR`: join a Ray cluster someone else started (`ray start --head`, as on the head
node of a cluster of instances), serve on it, and on exit remove only our application: the cluster stays up. The
test's cluster runs on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray use 127.0.0.1 as the node address)
with token authentication, as docs/scale_out.md sets a cluster up."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

pytest.importorskip("ray", reason="Ray Serve is the `cluster` extra: pip install 'neuron-opt[cluster]'")
from cluster_helpers import MODEL, PROMPTS, REPLICA, free_port, reference, replica_pids, replicas, wait

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
RAY = str(Path(sys.executable).with_name("ray"))
LOOPBACK = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture
def head():
    """A one-node Ray cluster with 2 CPUs, started by `ray start --head` and stopped after the test."""
    port = free_port()
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats"], env=LOOPBACK, check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=LOOPBACK, capture_output=True, timeout=120)


def _cluster_up(address: str) -> bool:
    return subprocess.run([RAY, "status", f"--address={address}"], env=LOOPBACK, capture_output=True,
                          timeout=60).returncode == 0


def test_serve_joins_an_existing_cluster_and_leaves_it_running(head, ckpt, ref, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "neuron_opt.cli", "serve", "--model", str(ckpt), "--ray-address", head,
           "--data-parallel", "2", "--replica-cpus", "1", "--port", str(port), "--max-num-seqs", "2",
           "--max-model-len", "256", "--served-model-name", MODEL]
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=LOOPBACK, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: proc.poll() is not None or len(replicas(url)) == 2, 240, "2 replicas on the joined cluster")
        assert proc.poll() is None, log.read_text()[-3000:]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for p in PROMPTS[:4]:
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                                               extra_body={"ignore_eos": True})
            assert raw.parse().choices[0].text == reference(ref, p, 8) and raw.headers[REPLICA]
        assert "Started a local Ray instance" not in log.read_text()  # it joined; it started nothing of its own
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert rc == 0, log.read_text()[-3000:]
    wait(lambda: not replica_pids(), 60, "our replicas to leave the cluster")
    assert _cluster_up(head)  # the cluster is someone else's: it outlives the command

