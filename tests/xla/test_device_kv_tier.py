"""The second KV tier over the device pools (torch-xla's CPU device): prefix-cache blocks evicted from the pool on
the device are copied to host memory (`NeuronExecutor.tier_blocks`, two small graphs) and copied back on a returning
prompt, which then prefills only what the tier did not hold and answers as HF transformers does, at tp 1 and as
one SPMD program at tp 2 (tests/xla/device_kv_tier.py runs the engine). Under window-sized KV (tiny Gemma 2: window 6,
sliding and full layers alternating) the same at tp 1 and tp 2 with the tier's two groups, each copied by its own
pair of graphs; noise written in place of the restored blocks changes the tokens."""

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


W = 8  # tokens generated each turn of the window-sized KV case


@pytest.fixture(scope="module")
def window_case(tmp_path_factory):
    """A first turn of 20 tokens and its second turn (the first's prompt, HF's reply and 4 more tokens): 6 blocks of
    the first turn hold K/V, past the window of 6."""
    ck = make_tiny("gemma2", tmp_path_factory.mktemp("gemma2"), tokenizer=True)
    hf = load_hf(ck)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, hf.config.vocab_size, (20,), generator=g).tolist()

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            return hf.generate(torch.tensor([ids]), max_new_tokens=W, min_new_tokens=W, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()

    first = greedy(prompt)
    turn2 = prompt + first + torch.randint(3, hf.config.vocab_size, (4,), generator=g).tolist()
    eos = hf.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    return ck, [prompt, turn2], [first, greedy(turn2)], eos


def run_window(window_case, tmp_path, tp: int, mode: str = "plain") -> dict:
    """A fresh process (SPMD mode and torch-xla's graph count are per process)."""
    ck, prompts, _, eos = window_case
    out = subprocess.run([sys.executable, str(HERE / "device_kv_tier.py"), "window", str(ck), str(tmp_path / "art"),
                          str(tp), json.dumps(prompts), str(W), json.dumps(eos), mode], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_window(res: dict, window_case) -> None:
    _, prompts, want, _ = window_case
    assert res["first"] == want[0]
    kept, seen = res["kept"], res["seen"]
    assert res["evicted"] and kept == 6 and 0 < seen < kept
    # the first turn's 6 full-layer blocks and the 2 window-layer blocks the next query sees, from the tier
    assert res["hits"] == kept * BS and res["restored"] == kept + (kept - seen) and res["corrupt"] == 0
    assert res["first_prefilled"] == len(prompts[0]) and res["again_prefilled"] == len(prompts[1]) - kept * BS
    # each group's entry is one block of its own layers' K and V pools, every rank's
    assert sum(b * n for b, n in zip(res["block_bytes"], res["num_blocks"], strict=True)) == res["pool_bytes"]
    # a read and a write graph per group, whatever the block: every store and restore after the first runs them
    assert res["copier_graphs"] == 4 and res["stored"] > 4


@pytest.mark.parametrize("tp", [1, 2])
def test_window_kv_groups_come_back_from_host_memory(window_case, tmp_path, tp):
    res = run_window(window_case, tmp_path, tp)
    check_window(res, window_case)
    assert res["again"] == window_case[2][1]


def test_window_kv_noise_written_back_changes_the_tokens(window_case, tmp_path):
    """The same restore with every written-back block replaced by noise: the second turn's tokens are not HF's, so
    the test above reads what the tier restored."""
    res = run_window(window_case, tmp_path, 1, "corrupt-write")
    check_window(res, window_case)
    assert res["again"] != window_case[2][1]
