"""The second KV tier over the device pools (torch-xla's CPU device): prefix-cache blocks evicted from the pool on
the device are copied to host memory (`NeuronExecutor.tier_blocks`, two small graphs) and copied back on a returning
prompt, which then prefills only what the tier did not hold and answers as HF transformers does, at tp 1 and as
one SPMD program at tp 2 (tests/xla/device_kv_tier.py runs the engine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from device_kv_tier import BS, main
from test_device_path import HERE
from tiny import load_hf, make_tiny

pytestmark = pytest.mark.xla
N = 4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    ck = make_tiny("llama-gqa2", tmp_path_factory.mktemp("llama"), tokenizer=True)
    hf = load_hf(ck)
    prompt = torch.randint(3, hf.config.vocab_size, (3 * BS + 1,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    return ck, prompt, want


def check(res: dict, prompt: list[int], want: list[int], tp: int) -> None:
    assert res["first"] == want and res["again"] == want
    assert res["evicted"] and res["stored"] >= 3  # the filler evicted the prompt's three full blocks
    assert res["restored"] == 3 and res["hits"] == 3 * BS and res["corrupt"] == 0
    assert res["first_prefilled"] == len(prompt) and res["again_prefilled"] == len(prompt) - 3 * BS
    assert res["block_bytes"] * res["num_blocks"] == res["pool_bytes"]  # every layer's K and V, every rank's


def test_tp1_device_pool_blocks_come_back_from_host_memory(case, tmp_path):
    ck, prompt, want = case
    check(main(ck, tmp_path / "art", 1, prompt, N), prompt, want, 1)


def test_tp2_spmd_pool_blocks_come_back_from_host_memory(case, tmp_path):
    ck, prompt, want = case
    out = subprocess.run([sys.executable, str(HERE / "device_kv_tier.py"), str(ck), str(tmp_path / "art"), "2",
                          json.dumps(prompt), str(N)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    check(json.loads(out.stdout.strip().splitlines()[-1]), prompt, want, 2)
