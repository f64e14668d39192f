"""Window-sized KV on the device path (torch-xla's CPU device): the sliding layers' pools hold only the blocks their
window sees, as the planner says, and greedy text past 8x the window equals HF transformers', with prefix caching and
chunked prefill on, at tp 1 and as one SPMD program at tp 2.

Tiny Gemma 2 (window 6, sliding and full layers alternating) at a context of 48 (8x the window), blocks of 4,
prefill chunks of 8 (tests/xla/device_window_kv.py runs the engine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from device_window_kv import BATCH, MAX_LEN, main
from test_device_path import HERE, planned_bytes
from tiny import load_hf, make_tiny

from neuron_opt.artifact import read_manifest

pytestmark = pytest.mark.xla
N = MAX_LEN - 20  # generated tokens: the longest prompt (20) + N reaches the context's end


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    ck = make_tiny("gemma2", tmp_path_factory.mktemp("gemma2"), tokenizer=True)
    hf = load_hf(ck)
    g = torch.Generator().manual_seed(5)
    V = hf.config.vocab_size
    shared = torch.randint(3, V, (14,), generator=g).tolist()
    prompts = [shared + torch.randint(3, V, (6,), generator=g).tolist() for _ in range(2)]
    prompts.append(torch.randint(3, V, (7,), generator=g).tolist())
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eos = hf.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    return ck, prompts, want, eos


def check(res: dict, art, want: list[list[int]]) -> None:
    m = read_manifest(art)
    cache = m.cache
    assert cache.sliding_window == 6 and MAX_LEN >= 8 * cache.sliding_window
    sliding = [m.model.layer_window(i) is not None for i in range(m.model.num_hidden_layers)]
    assert any(sliding) and not all(sliding)
    assert res["pool_blocks"] == [cache.window_num_blocks if s else cache.num_blocks for s in sliding]
    assert 2 * cache.window_num_blocks < cache.num_blocks and cache.num_blocks == BATCH * MAX_LEN // 4 + 1
    assert res["kv_bytes"] == planned_bytes(m)["kv"]  # the planner's figure is what the device holds
    assert res["tokens"] == want
    assert res["prefix_hits"] >= 8 and res["prefills"] > len(want)  # a shared prefix; prompts ran in chunks
    free, total = res["window_blocks_free"]
    assert free == total  # every window block given back
    assert "prefill_b1_q8_s48" in res["buckets"]


def test_tp1_window_pools_and_greedy_text_equal_hf(case, tmp_path):
    ck, prompts, want, eos = case
    check(main(ck, tmp_path / "art", 1, prompts, N, eos), tmp_path / "art", want)


def test_tp2_one_spmd_program_holds_window_pools(case, tmp_path):
    ck, prompts, want, eos = case
    out = subprocess.run([sys.executable, str(HERE / "device_window_kv.py"), str(ck), str(tmp_path / "art"), "2",
                          json.dumps(prompts), str(N), json.dumps(eos)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    check(json.loads(out.stdout.strip().splitlines()[-1]), tmp_path / "art", want)
