"""Context-parallel prefill on the device path (torch-xla's CPU device), tp 2 as one SPMD program.

An MQA checkpoint (4 q heads, 1 KV head) at tp 2 forms one flash-decoding KV group of two ranks; `cp_degree 2`
splits each prefill's q/k/v work over them. A 700-token prompt prefilled in two chunks (the second at the odd start
301, in an offset bucket) then 8 greedy tokens: HF transformers' tokens, and the KV pools after the prefill equal,
bit for bit, those of the same artifact without context parallelism (tests/xla/device_cp.py runs both). The same
with as many KV heads as tp (8 q / 2 KV heads at tp 2: each rank holds one whole KV head), where context parallelism
splits each prefill's attention over both ranks by tokens: HF's tokens, the pools equal up to fp32 rounding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from device_cp import NEW, PROMPT
from test_device_path import HERE
from tiny import load_hf, make_tiny

pytestmark = pytest.mark.xla


def test_cp_prefill_at_tp2_answers_like_hf_and_writes_the_same_kv_blocks(tmp_path):
    ck = make_tiny("llama-mqa", tmp_path / "mqa", tokenizer=True)
    out = subprocess.run([sys.executable, str(HERE / "device_cp.py"), str(ck), str(tmp_path / "art")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        want = load_hf(ck).generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW,
                                    do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got["tokens_cp"] == want
    assert got["tokens_fd"] == want
    assert got["pools_equal"], got["pool_max_diff"]
    # the chunk from 0 and the chunk at 301 ran in a plain and an offset prefill bucket
    assert got["cp"]["buckets"] == ["prefill_b1_s512", "prefill_b1_q512_s1024"]
    # per layer (2): three group all-gathers (q, k, v) more than flash decoding alone, each an HLO all-reduce
    for key, fd in got["fd"]["hlo"].items():
        assert got["cp"]["hlo"][key]["all-reduce"] == fd["all-reduce"] + 3 * 2


def test_cp_prefill_with_whole_kv_heads_per_rank_answers_like_hf_and_writes_the_same_kv_blocks(tmp_path):
    ck = make_tiny("llama-gqa4", tmp_path / "gqa4", tokenizer=True)
    out = subprocess.run([sys.executable, str(HERE / "device_cp.py"), str(ck), str(tmp_path / "art"), "heads"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        want = load_hf(ck).generate(torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW,
                                    do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got["tokens_fd"] == want
    assert got["tokens_cp"] == want
    # equal up to fp32 rounding, not bit for bit: o_proj sums every head in one product where plain tp sums two
    # partial products in its all-reduce, so from the second layer on the K/V differ in the last bits (1.5e-7 here)
    assert got["pool_max_diff"] < 1e-5, got["pool_max_diff"]
    assert got["cp"]["buckets"] == ["prefill_b1_s512", "prefill_b1_q512_s1024"]
    # per layer (2): the attention's all-reduce replaced by five all-gathers (K, V, q weight, o weight, the
    # output), each an HLO all-reduce
    for key, plain in got["fd"]["hlo"].items():
        assert got["cp"]["hlo"][key]["all-reduce"] == plain["all-reduce"] + 4 * 2
