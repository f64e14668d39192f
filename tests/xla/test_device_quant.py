"""Quantized weights and the fp8 KV cache on the device path (`--backend neuron`, torch-xla's CPU device).

What a NeuronCore would get: the weights placed on the device in their stored low-bit dtypes (int8, packed int4,
fp8 e4m3) and widened inside each bucket's graph (the HLO's weight parameters are s8 / u8 / f8e4m3fn), the KV
pools in f8e4m3fn. Oracle: the eager backend on the same stored weights (itself checked against fp32 in
tests/neuron_opt/test_quant_model.py), teacher forced through a prefill and 16 decode steps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tiny import make_tiny

from neuron_opt.artifact import read_manifest
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.executors import load_model
from neuron_opt.runtime.runner import DecodeRow

pytestmark = pytest.mark.xla
SMALL = dict(max_model_len=32, prefill_buckets=(16, 32), decode_buckets=(16, 32), dtype="float32", use_cache=False)
HLO_DTYPE = {"int8": "s8", "int4": "u8", "fp8": "f8e4m3fn"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny("llama-gqa2", tmp_path_factory.mktemp("q"), tokenizer=True)


def _compile(ckpt: Path, out: Path, backend: str, **kw) -> Path:
    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend=backend, **{**SMALL, **kw}),
                     log=lambda s: None, progress=False)
    return out


def _teacher_forced(a, b, steps: int = 16) -> list[float]:
    prompt = [(7 * i + 3) % 200 + 3 for i in range(12)]
    x, y = a.prefill(0, prompt), b.prefill(0, prompt)
    diffs = [(x - y).abs().max().item()]
    tok, pos = int(y.argmax()), len(prompt)
    for _ in range(steps):
        x, y = a.decode([DecodeRow(0, tok, pos)]), b.decode([DecodeRow(0, tok, pos)])
        diffs.append((x - y).abs().max().item())
        tok, pos = int(y[0].argmax()), pos + 1
    return diffs


@pytest.mark.parametrize("quantize,kv", [("int8", "auto"), ("int4", "auto"), ("fp8", "fp8"), (None, "fp8")])
def test_low_bit_weights_and_fp8_kv_on_the_device_equal_eager(quantize, kv, ckpt, tmp_path):
    kw = dict(quantize=quantize, kv_cache_dtype=kv)
    dev = _compile(ckpt, tmp_path / "dev", "neuron", **kw)
    ref = _compile(ckpt, tmp_path / "ref", "eager", **kw)
    loaded = load_model(dev)
    ranks = loaded.runner.executor.ranks
    held = {n: p.dtype for n, p in ranks.model.named_parameters()}
    if quantize:
        want = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}[quantize]
        assert held["model.layers.0.mlp.up_proj.quant.qweight"] == want  # stays low-bit on the device
        assert "model.layers.0.mlp.up_proj.weight" not in held
    want_kv = torch.float8_e4m3fn if kv == "fp8" else torch.float32
    assert all(c.dtype == want_kv for c in [*ranks.k_caches, *ranks.v_caches])
    diffs = _teacher_forced(loaded.runner, load_model(ref).runner)
    assert max(diffs) < 1e-4, diffs
    m = read_manifest(dev)
    text = (dev / f"graphs/rank0/{m.buckets.buckets()[-1].key}.hlo.txt").read_text()
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->", text.splitlines()[0]).group(1)
    if quantize:  # the weight parameters arrive in their stored dtype: widened inside the graph
        up = "96,32" if quantize == "int4" else "96,64"  # up_proj [I, H]; int4: two values per byte
        assert f"{HLO_DTYPE[quantize]}[{up}]" in layout, layout[:400]
    if kv == "fp8":
        assert f"f8e4m3fn[{m.cache.num_blocks},2,{m.cache.block_size},16]" in layout
