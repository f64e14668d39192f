"""GGUF files on the device path (torch-xla's CPU device): tiny checkpoints converted by llama.cpp's own converter
(F32, so the file holds the checkpoint's exact values; tests/llamacpp_gguf.py), compiled with `--backend neuron`:
greedy tokens equal HF transformers' on the checkpoint, at tp 1 and as one SPMD program at tp 2.

A representative subset, kept small (each compile is seconds of this tier's time; every family's conversion, and
every family on the eager path, are tests/neuron_opt/test_gguf_families.py's): Gemma 2 (soft-caps, a window of 6
the run crosses, the norm offset, tied embeddings) and Mixtral (a `llama` file: GQA with q/k rows permuted in the
file, experts stacked) at tp 1; Mixtral at tp 2, where the permuted q/k rows and the experts are sharded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import hf_greedy, runner_greedy
from llamacpp_gguf import convert, source_checkpoint
from test_device_path import HERE, compile_tiny
from tiny import load_hf

from neuron_opt.executors import load_model

pytestmark = pytest.mark.xla
FAMILIES = ["gemma2", "mixtral"]
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(12)]  # device_parity.py's: 12 tokens, then 16 decode steps


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (its HF checkpoint, llama.cpp's F32 GGUF of it)."""
    root = tmp_path_factory.mktemp("gguf")
    jobs = [(source_checkpoint(f, root / f), root / f"{f}.gguf", "f32") for f in FAMILIES]
    convert(jobs)
    return {f: (d, out) for f, (d, out, _) in zip(FAMILIES, jobs, strict=True)}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_greedy_tokens_equal_hf(family, files, tmp_path):
    d, path = files[family]
    runner = load_model(compile_tiny(path, tmp_path / "art")).runner
    ours_logits, ours = runner_greedy(runner, PROMPT, 16)  # across the decode buckets' edge (16 -> 32)
    ref_logits, ref = hf_greedy(load_hf(d), PROMPT, 16)
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=0)
    assert ours == ref


def test_tp2_one_spmd_program_greedy_tokens_equal_hf(files, tmp_path):
    """The device's own argmax at each step (fed the eager reference's tokens) equals HF's greedy run."""
    d, path = files["mixtral"]
    out = subprocess.run([sys.executable, str(HERE / "device_parity.py"), str(path), str(tmp_path / "art"), "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(res["diffs"]) < 1e-4, res["diffs"]
    _, ref = hf_greedy(load_hf(d), PROMPT, len(res["tokens"]))
    assert res["tokens"] == ref
