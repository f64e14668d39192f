"""EAGLE-3 on the device path (torch-xla's CPU device): the model's graphs return the head's auxiliary states, the
head's draft chain runs as one device graph per step, and speculative greedy equals plain greedy.

Oracles: the same artifact's plain greedy decoding (no speculation) for the text; for the proposals, the head in
torch on the host (runtime/eagle3.EagerChain, models/eagle3.py, itself checked against the `speculators` package
in tests/models/test_eagle3.py) fed the same calls in the same order. The head is written by our own saver in the
EAGLE layout (tests/eagle3_heads.py): `speculators` is not installed in the XLA environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3_heads import write_random_head
from tiny import make_tiny

from neuron_opt.artifact import read_manifest

pytestmark = pytest.mark.xla
HERE = Path(__file__).parent
K = 3


@pytest.mark.parametrize("tp", [1, 2])
def test_eagle3_head_on_device_graphs_is_exact_in_a_mixed_batch(tp, tmp_path):
    """A random head over the tiny model's layers 0, 1 and 2 (2: its last layer's output), always verifying, three
    requests two at a time (one never speculates): the text equals plain decoding's, every device chain call's
    proposals equal the host head's, one chain graph call per proposing step (fill graphs only for rows that fell
    behind); the states of a prefill and a verify step equal the eager model's; at tp 2 they come from the one SPMD
    program (rank 0's copy)."""
    ckpt = make_tiny("llama-gqa2", tmp_path / "ckpt", tokenizer=True)
    head = write_random_head(tmp_path / "head", ckpt, [0, 1, 2], draft_vocab=64)
    out = subprocess.run([sys.executable, str(HERE / "device_eagle3.py"), str(ckpt), str(head), str(tmp_path / "art"),
                          str(tp)], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["chain"] == "DeviceEagle3Chain"
    assert max(res["aux_diff"]) < 1e-4, res["aux_diff"]  # prefill and verify states equal eager fp32's
    assert res["speculative"] == res["plain"]
    assert [len(res["plain"][str(i)]) for i in range(3)] == [30, 2, 24]
    assert res["verify_steps"] > 0 and res["device"]
    assert res["device"] == res["host"]
    assert res["graph_calls"]["chain"] == len(res["device"])  # one graph per step, whatever the batch
    assert res["graph_calls"]["fill"] >= res["behind"] > 0  # new prompts were filled first
    assert res["reused"]
    m = read_manifest(tmp_path / "art")
    assert sorted(k for k in m.graphs if k.startswith("verify")) == ["verify_b1_q4_s32", "verify_b1_q4_s64",
                                                                    "verify_b2_q4_s32", "verify_b2_q4_s64"]
    # every bucket's graph recompiled with the states as a second output (replayed at tp 1, traced at tp 2)
    assert res["outputs"] == {key: 2 if tp == 1 else None for key in m.graphs}
