"""`serve --data-parallel 2 --routing prefix`: requests sharing a prompt prefix go to the replica that cached it.

Workload: 16 prefix groups x 4 requests (a 3-block prefix of its own per group, a distinct tail per request), sent
in 4 waves of 16 (one request of every group at once). The same workload through one single-process server gives
the hit rate one replica reaches; the two replicas behind the prefix router must keep >= 90% of it, with greedy
answers equal to the single-sequence reference. Runs with `make test-cluster`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="Ray Serve is the `cluster` extra: pip install 'neuron-opt[cluster]'")
from cluster_helpers import MODEL, free_port, metrics, reference, replicas, stop_serve, wait

from neuron_opt.config import CacheConfig
from neuron_opt.server.cluster.routing import PrefixKeys

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
BLOCK = CacheConfig.block_size  # the block size of a server run with --model
GROUPS, PER_GROUP, PREFIX_BLOCKS, OUT = 16, 4, 3, 4


def group_prompt(g: int, i: int) -> list[int]:
    prefix = [(7 * g + 3 * j) % 400 + 10 for j in range(PREFIX_BLOCKS * BLOCK)]
    return prefix + [500 + 8 * i + k for k in range(8)]


WAVES = [[group_prompt(g, i) for g in range(GROUPS)] for i in range(PER_GROUP)]


def _start(cmd: list[str], log) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _run_waves(url: str) -> list[list[str]]:
    async def wave(prompts: list[list[int]]) -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        outs = await asyncio.gather(*(client.completions.create(
            model=MODEL, prompt=p, max_tokens=OUT, temperature=0, extra_body={"ignore_eos": True}) for p in prompts))
        return [o.choices[0].text for o in outs]

    return [asyncio.run(wave(w)) for w in WAVES]


def _hit_rate(url: str, name: str) -> float:
    return sum(v for (n, _), v in metrics(url).items() if n == name)


def test_prefix_routing_keeps_a_single_replicas_hit_rate(ckpt, ref, tmp_path):
    flags = ["--model", str(ckpt), "--max-num-seqs", "4", "--max-model-len", "1024", "--served-model-name", MODEL]
    # one replica: the hit rate to keep
    port = free_port()
    one = _start([sys.executable, "-m", "neuron_opt.cli", "serve", *flags, "--port", str(port)], tmp_path / "one.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: one.poll() is not None or httpx.get(url + "/health", timeout=5).status_code == 200, 180,
             "the single server up")
        assert one.poll() is None, (tmp_path / "one.log").read_text()[-3000:]
        single_texts = _run_waves(url)
        single = _hit_rate(url, "neuron_opt:prefix_cache_hit_rate")
    finally:
        stop_serve(one)
    assert single > 0.5  # waves 2-4 find their group's 3 blocks

    port = free_port()
    cmd = [sys.executable, "-m", "neuron_opt.cli", "serve", *flags, "--port", str(port), "--data-parallel", "2",
           "--routing", "prefix", "--routing-balance-threshold", "16"]  # a wave of 16 at once: affinity holds
    two = _start(cmd, tmp_path / "two.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: two.poll() is not None or len(replicas(url)) == 2, 240, "2 replicas up")
        assert two.poll() is None, (tmp_path / "two.log").read_text()[-3000:]
        texts = _run_waves(url)
        assert texts == single_texts == [[reference(ref, p, OUT) for p in w] for w in WAVES]
        # each replica pushes its metrics every second: wait for all 64 requests to be counted
        wait(lambda: sum(replicas(url, "vllm:request_success_total").values()) >= GROUPS * PER_GROUP, 20,
             "every request in the replicas' metrics")
        m = metrics(url)
        cluster = m[("neuron_opt:cluster_prefix_cache_hit_rate", "")]
        assert cluster >= 0.9 * single, (cluster, single)
        routed = {replica: v for (name, replica), v in m.items() if name == "neuron_opt:cluster_routed_total"}
        assert sum(routed.values()) == GROUPS * PER_GROUP and len(routed) == 2, routed
    finally:
        stop_serve(two)


def test_router_keys_equal_the_engines_prefix_keys(ref):
    """The router's keys are the engine's block hashes of the prompt the replica builds, for chat too."""
    from neuron_opt.runtime.block_manager import hash_block

    keys = PrefixKeys(ref.tokenizer, 4, None)

    def chain(ids: list[int]) -> tuple[bytes, ...]:
        out, parent = [], None
        for s in range(0, len(ids) // 4 * 4, 4):
            parent = hash_block(parent, ids[s:s + 4])
            out.append(parent)
        return tuple(out)

    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour."}]
    body = json.dumps({"model": "tiny", "messages": msgs}).encode()
    assert keys("chat", body) == chain(ref.encode_chat(msgs)) != ()
    text = b'{"model": "tiny", "prompt": "The capital of France is a city of many bridges"}'
    assert keys("completions", text) == chain(list(ref.tokenizer("The capital of France is a city of many "
                                                                 "bridges")["input_ids"]))
    assert keys("completions", b'{"model": "tiny", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9]}') == chain(list(range(1, 10)))
    assert keys("chat", b"not json") == ()  # refused by the replica, routed by load


def test_router_keys_read_a_bounded_prefix_of_the_prompt(ref):
    """Routing's work is bounded by the keys' reach: past PROMPT_CHARS_PER_TOKEN characters per keyed token the
    prompt is not read, and the keys still equal the engine's for the whole prompt."""
    from neuron_opt.runtime.block_manager import hash_block

    keys = PrefixKeys(ref.tokenizer, 4, None, max_blocks=3)  # 12 keyed tokens: 384 characters are read
    assert keys.max_chars == 384

    def chain(ids: list[int]) -> tuple[bytes, ...]:
        out, parent = [], None
        for s in range(0, 12, 4):
            parent = hash_block(parent, ids[s:s + 4])
            out.append(parent)
        return tuple(out)

    text = "The capital of France is Paris. " * 200  # 6,400 characters
    want = chain(list(ref.tokenizer(text)["input_ids"]))
    assert keys("completions", json.dumps({"model": "tiny", "prompt": text}).encode()) == want
    assert keys("completions", json.dumps({"model": "tiny", "prompt": text[:384] + "\u00e9" * 9000}).encode()) == want
    msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "And Spain?"}]
    assert keys("chat", json.dumps({"model": "tiny", "messages": msgs}).encode()) == chain(ref.encode_chat(msgs))
    ids = list(range(1, 10_000))
    assert keys("completions", json.dumps({"model": "tiny", "prompt": ids}).encode()) == chain(ids)
