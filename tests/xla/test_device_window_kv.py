"""Window-sized KV on the device path (torch-xla's CPU device): the sliding layers' pools hold only the blocks their
window sees, as the planner says, and greedy text past 8x the window equals HF transformers', with prefix caching and
chunked prefill on, at tp 1 and as one SPMD program at tp 2; and at tp 1 with a pool of one sequence's blocks (the
scheduler preempts and recomputes) and with prompt-lookup speculative decoding (verify rows cross the window).

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


def check(res: dict, art, want: list[list[int]], num_blocks: int | None = None) -> None:
    """`num_blocks`: the full-length pool's blocks when the compile set them (else enough for BATCH sequences)."""
    m = read_manifest(art)
    cache = m.cache
    assert cache.sliding_window == 6 and MAX_LEN >= 8 * cache.sliding_window
    sliding = [m.model.layer_window(i) is not None for i in range(m.model.num_hidden_layers)]
    assert any(sliding) and not all(sliding)
    assert res["pool_blocks"] == [cache.window_num_blocks if s else cache.num_blocks for s in sliding]
    if num_blocks is None:
        assert 2 * cache.window_num_blocks < cache.num_blocks == BATCH * MAX_LEN // 4 + 1
        assert res["kv_bytes"] == planned_bytes(m)["kv"]  # the planner's figure is what the device holds
    else:  # a pool size the compile set (the planner plans BATCH sequences): K and V blocks of fp32, tp 1
        assert cache.window_num_blocks < cache.num_blocks == num_blocks
        assert res["kv_bytes"] == sum(res["pool_blocks"]) * 2 * m.model.num_key_value_heads * 4 * m.model.head_dim * 4
    assert res["tokens"] == want and res["unfinished"] == 0
    assert res["prefills"] > len(want)  # prompts ran in chunks
    free, total = res["window_blocks_free"]
    assert free == total  # every window block given back
    assert "prefill_b1_q8_s48" in res["buckets"]


def test_tp1_window_pools_and_greedy_text_equal_hf(case, tmp_path):
    ck, prompts, want, eos = case
    res = main(ck, tmp_path / "art", 1, prompts, N, eos)
    check(res, tmp_path / "art", want)
    assert res["prefix_hits"] >= 8  # the second prompt took the shared prefix's blocks from both pools


def run_mode(case, tmp_path, mode: str, n: int) -> tuple[dict, list[list[int]]]:
    """A fresh process (one compile per process keeps torch-xla's graph cache of the other tests' shapes out)."""
    ck, prompts, want, eos = case
    out = subprocess.run([sys.executable, str(HERE / "device_window_kv.py"), str(ck), str(tmp_path / "art"), "1",
                          json.dumps(prompts), str(n), json.dumps(eos), mode], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), [w[:n] for w in want]


def test_tp1_preemption_with_window_pools_equals_hf(case, tmp_path):
    """A pool of one sequence's blocks (13, the null block included) for three requests a step apart: the scheduler
    preempts, frees both pools' blocks and recomputes, and the text stays HF's."""
    res, want = run_mode(case, tmp_path, "preempt", N)
    check(res, tmp_path / "art", want, num_blocks=MAX_LEN // 4 + 1)
    assert res["preemptions"] > 0


def test_tp1_speculative_decoding_with_window_pools_equals_hf(case, tmp_path):
    """Prompt-lookup speculation, 2 tokens a step, verified by 3-token rows that write and read the window pools;
    two tokens short of the context (a verify row there would reach past the largest decode bucket)."""
    res, want = run_mode(case, tmp_path, "ngram", N - 2)
    check(res, tmp_path / "art", want)
    assert res["accepted"] > 0


def test_tp2_one_spmd_program_holds_window_pools(case, tmp_path):
    ck, prompts, want, eos = case
    out = subprocess.run([sys.executable, str(HERE / "device_window_kv.py"), str(ck), str(tmp_path / "art"), "2",
                          json.dumps(prompts), str(N), json.dumps(eos)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    check(json.loads(out.stdout.strip().splitlines()[-1]), tmp_path / "art", want)
