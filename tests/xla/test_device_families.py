"""The model families on the neuron backend's device path (torch-xla's CPU device; tests/xla): every option of
Qwen3, Gemma 2, Gemma 3, OLMo 2, Granite 3, SmolLM3, GPT-OSS (sinks, biased router and experts, YaRN) and Phi-3
(longrope switching to its long factors at position 12, partial rotary, fused checkpoint projections) and dynamic
NTK rope scaling (its base grown per row past position 12) traced into
the static bucket graphs, logits against the eager reference (itself checked against HF in tests/models), at tp 1
and as one SPMD program at tp 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import eager_runner
from test_device_path import HERE, compile_tiny, planned_bytes, teacher_forced
from tiny import FAMILIES, make_tiny

from neuron_opt.artifact import read_manifest
from neuron_opt.executors import load_model

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_tiny(variant, tmp_path_factory.mktemp(variant), tokenizer=True)
        return made[variant]

    return get


# gpt-oss: sinks, window 4, YaRN, biased router and experts; llama-dynamic-rope: dynamic NTK past position 12
ALL = [*FAMILIES, "phi3-long", "gpt-oss", "llama-dynamic-rope"]


@pytest.mark.parametrize("variant", ALL)
def test_tp1_logits_equal_eager(variant, ckpt, tmp_path):
    art = compile_tiny(ckpt(variant), tmp_path / "art")
    runner = load_model(art).runner
    diffs, buckets = teacher_forced(runner, eager_runner(ckpt(variant), max_model_len=32, prefill_lens=[16, 32],
                                                         decode_kv_lens=[16, 32]))
    assert max(diffs) < 1e-4, diffs
    assert "decode_b1_s32" in buckets  # past the windows (6) and across both decode buckets


@pytest.mark.parametrize("variant", ALL)
def test_tp2_one_spmd_program_equals_eager(variant, ckpt, tmp_path):
    out = subprocess.run([sys.executable, str(HERE / "device_parity.py"), str(ckpt(variant)), str(tmp_path / "art"),
                          "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(res["diffs"]) < 1e-4, res["diffs"]
    assert res["device_bytes"] == planned_bytes(read_manifest(tmp_path / "art"))
