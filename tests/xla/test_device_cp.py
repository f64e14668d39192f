"""Context-parallel prefill on the device path (torch-xla's CPU device), tp 2 as one SPMD program.

An MQA checkpoint (4 q heads, 1 KV head) at tp 2 forms one flash-decoding KV group of two ranks; `cp_degree 2`
splits each prefill's q/k/v work over them. A 700-token prompt prefilled in two chunks (the second at the odd start
301, in an offset bucket) then 8 greedy tokens: HF transformers' tokens, and the KV pools after the prefill equal,
bit for bit, those of the same artifact without context parallelism (tests/xla/device_cp.py runs both)."""

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
