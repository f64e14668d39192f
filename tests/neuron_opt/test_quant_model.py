"""Quantized artifacts end to end on a tiny random HF checkpoint: `compile --quantize` / `--kv-cache-dtype fp8` on
the eager (reference) and cpu (torch's weight-only kernels) backends, against fp32 logits.

Measured on this checkpoint (max |logit error| / std of the fp32 logits, prompt + 20 teacher-forced steps):
int8 0.017, fp8 weights 0.074, fp8 KV 0.026, int4 (group 32) 0.25 (random N(0, 0.02) weights are the hardest case
for 16 levels; the real model's int4 check is the slow test in test_quant_default.py); compiled cpu kernels
against the eager reference with the same stored weights: 0.006 (int8), 0.008 (int4). Bounds below leave about
2x.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from neuron_opt.artifact import read_manifest
from neuron_opt.backends.cpu.backend import cpu_has_native_bf16, onednn_bf16_supported
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.config import ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.executors import load_model
from neuron_opt.parallel import head_layout
from neuron_opt.planner.memory import weight_bytes
from neuron_opt.runtime.runner import DecodeRow

PROMPT = list(range(3, 40))
FORCED = list(range(50, 70))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tiny import make_tiny

    return make_tiny("llama-gqa2", tmp_path_factory.mktemp("qck"), tokenizer=True)


@pytest.fixture(scope="module")
def build(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("qart")
    made: dict[str, Path] = {}

    def get(name: str, backend: str = "eager", dtype: str = "float32", **kw) -> Path:
        if name not in made:
            out = root / name
            compile_artifact(CompileRequest(model=str(ckpt), out=out, backend=backend, dtype=dtype, max_model_len=128,
                                            prefill_buckets=(64,), decode_buckets=(128,), cache_dir=root / "cache",
                                            **kw), log=lambda s: None, progress=False)
            made[name] = out
        return made[name]

    return get


def logits(art: Path) -> torch.Tensor:
    """Prompt logits, then 20 teacher-forced decode steps: [21, V]."""
    r = load_model(art).runner
    out = [r.prefill(0, PROMPT)]
    for i, t in enumerate(FORCED):
        out.append(r.decode([DecodeRow(0, t, len(PROMPT) + i)])[0])
    return torch.stack(out)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.std())


@pytest.mark.parametrize("name,kw,bound", [
    ("int8", dict(quantize="int8"), 0.05),
    ("int8-tensor", dict(quantize="int8", quantization_type="per_tensor_symmetric"), 0.10),
    ("fp8", dict(quantize="fp8"), 0.15),
    ("kv-fp8", dict(kv_cache_dtype="fp8"), 0.06),
    ("int4", dict(quantize="int4"), 0.40),
])
def test_eager_quantized_logits_near_fp32(build, name, kw, bound):
    ref = logits(build("fp32"))
    assert rel_err(logits(build(name, **kw)), ref) < bound


@pytest.mark.slow  # a cpu artifact's compile (the default suite's budget)
def test_cpu_int8_kernels_with_fp8_kv_match_the_eager_reference(build):
    kw = dict(quantize="int8", kv_cache_dtype="fp8")
    cpu, eager = build("cpu-int8-kv", "cpu", **kw), build("eager-int8-kv", **kw)
    m = read_manifest(cpu)
    assert m.quant.method == "int8" and m.cache.dtype == "float8_e4m3fn"
    with safe_open(str(cpu / "weights" / "rank0.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.quant.qweight").dtype == torch.int8
        assert "model.layers.0.mlp.up_proj.weight" not in f.keys()
    runner = load_model(cpu).runner
    assert runner.executor.k_caches[0].dtype == torch.float8_e4m3fn
    # the prefill graph's int8 products: widened to one bf16 GEMM where the CPU has native bf16, else aten's kernel
    prefill = [f for f in (cpu / "graphs" / "rank0" / "cpu").glob("layer_prefill_*.json") if ".meta" not in f.name]
    assert prefill
    for f in prefill:
        targets = {n["node"]["target"] for n in json.loads(f.read_text())["nodes"]}
        assert ("neuron_opt::int8_linear_widened" in targets) == cpu_has_native_bf16(), (f.name, targets)
    ref = logits(eager)
    assert rel_err(logits(cpu), ref) < 0.03
    assert rel_err(ref, logits(build("fp32"))) < 0.08


@pytest.mark.slow  # ~45 s of Inductor compiles; the operator form is checked against the eager reference above
def test_cpu_int8_operator_and_inductor_forms_agree(build):
    """int8 products of few rows (decode, the one-row head) call torch.ops.neuron_opt.int8_linear by default; the
    `int8_linear=inductor` graphs (Inductor's dot-product loop, aten's int8 GEMM) compute the same logits."""
    kw = dict(quantize="int8", kv_cache_dtype="fp8")
    kernel = build("cpu-int8-kv", "cpu", **kw)
    inductor = build("cpu-int8-kv-inductor", "cpu", backend_options={"int8_linear": "inductor"}, **kw)
    for art, calls in ((kernel, True), (inductor, False)):
        call_list = art / "graphs" / "rank0" / "cpu" / "layer_decode_b1.json"
        targets = [n["node"]["target"] for n in json.loads(call_list.read_text())["nodes"]]
        assert ("neuron_opt::int8_linear" in targets) == calls, targets
        meta = json.loads(call_list.with_name("layer_decode_b1.meta.json").read_text())
        assert meta["options"]["int8_linear"] == ("kernel" if calls else "inductor")
    assert rel_err(logits(kernel), logits(inductor)) < 0.01


@pytest.mark.slow  # ~30-80 s of cold cpu compile each (make test-slow)
@pytest.mark.parametrize("variant", ["llama-gqa2", "smollm-like-9-3"])
def test_quantized_lm_head(variant, tmp_path_factory):
    """`--quantize-lm-head`: the head in int8 per channel (a tied head gets its own quantized copy; the embedding
    lookup keeps the float table), on the eager reference and the cpu kernels, near fp32."""
    from tiny import make_tiny

    ck = make_tiny(variant, tmp_path_factory.mktemp(variant), tokenizer=True)
    root = tmp_path_factory.mktemp("head")

    def art(name, backend, **kw):
        compile_artifact(CompileRequest(model=str(ck), out=root / name, backend=backend, dtype="float32",
                                        max_model_len=128, prefill_buckets=(64,), decode_buckets=(128,),
                                        cache_dir=root / "cache", **kw), log=lambda s: None, progress=False)
        return root / name

    q = dict(quantize="int8", quantize_lm_head=True)
    eager, cpu = art("eager", "eager", **q), art("cpu", "cpu", **q)
    with safe_open(str(cpu / "weights" / "rank0.safetensors"), framework="pt") as f:
        assert f.get_tensor("lm_head.quant.qweight").dtype == torch.int8
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    ref = logits(art("fp32", "eager"))
    assert rel_err(logits(eager), ref) < 0.05
    assert rel_err(logits(cpu), logits(eager)) < 0.03


def test_cpu_int4_kernels_match_the_eager_reference(build):
    cpu, eager = build("cpu-int4", "cpu", quantize="int4"), build("int4", quantize="int4")
    assert rel_err(logits(cpu), logits(eager)) < 0.03


@pytest.mark.skipif(not onednn_bf16_supported(), reason="bf16 cpu graphs need oneDNN bf16 (AVX-512 BW/VL/DQ or "
                    "AVX-NE-CONVERT); the cpu backend refuses them on this CPU")
@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=pytest.mark.slow)])  # int4: ~60 s, slow tier
def test_cpu_bf16_quantized_graphs_match_the_eager_reference(build, method):
    """bf16 compute, the cpu backend's default dtype where oneDNN has bf16 (and so what `compile --quantize auto`
    builds there): its graphs take bf16 activations as they come, fuse q/k/v and gate/up into one weight-only GEMM
    each, and run one-row int8 products as dot-product loops. (torch 2.13's int4 concat-linear pass crashed
    these graphs before the projections were fused here.)"""
    cpu = build(f"cpu-bf16-{method}", "cpu", dtype="bfloat16", quantize=method)
    eager = build(f"bf16-{method}", dtype="bfloat16", quantize=method)
    assert rel_err(logits(cpu), logits(eager)) < 0.05  # measured 0.018 (int8), 0.021 (int4)


def test_fold_alone_is_exact(ckpt, tmp_path):
    """fp8 KV's scales are folded into q/k/v/o: with the cache kept in fp32 the model computes the same function
    (only the weights' rounding changes)."""
    import shutil

    from helpers import eager_runner
    from safetensors.torch import save_file

    from neuron_opt.checkpoint import open_checkpoint
    from neuron_opt.quant.kv import fold

    folded = tmp_path / "folded"
    shutil.copytree(ckpt, folded, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(dict(fold(open_checkpoint(str(ckpt)).tensors(), [3.0, 0.2], [0.1, 7.0])),
              str(folded / "model.safetensors"))
    a, b = eager_runner(ckpt), eager_runner(folded)
    ref = a.prefill(0, PROMPT)
    assert torch.allclose(b.prefill(0, PROMPT), ref, atol=1e-4, rtol=1e-4)


def test_modules_to_not_convert(build):
    art = build("int8-skip", quantize="int8", modules_to_not_convert=("mlp.down_proj",))
    with safe_open(str(art / "weights" / "rank0.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.down_proj.weight" in keys
    assert "model.layers.0.mlp.up_proj.quant.qweight" in keys
    assert read_manifest(art).quant.modules_to_not_convert == ("mlp.down_proj",)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_plan_counts_the_bytes_compile_stores(build, ckpt, method):
    """The planner's weight bytes for a quantized dtype are the artifact's (bf16 compute, as the plan assumes)."""
    art = build(f"bytes-{method}", dtype="bfloat16", quantize=method)
    with safe_open(str(art / "weights" / "rank0.safetensors"), framework="pt") as f:
        stored = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    m = read_manifest(art)
    assert weight_bytes(m.model, head_layout(m.model, ParallelConfig()), method) == stored


@pytest.mark.parametrize("kw,match", [
    (dict(backend="cpu", quantize="fp8"), "fp8 weights have no CPU kernel"),
    (dict(quantization_type="per_tensor_symmetric"), "need --quantize"),
    (dict(quantize_lm_head=True), "need --quantize"),
    (dict(quantize="int4", group_size=48), "group_size"),
    (dict(quantize="auto", group_size=64), "quantize auto"),
    (dict(backend="cpu", quantize="int8", modules_to_not_convert=("layers.1.mlp",)), "each layer must quantize"),
])
def test_compile_refuses_what_it_cannot_build(ckpt, tmp_path, kw, match):
    req = CompileRequest(model=str(ckpt), out=tmp_path / "a", max_model_len=128, prefill_buckets=(64,),
                         decode_buckets=(128,), use_cache=False, **{"backend": "eager", **kw})
    with pytest.raises(ConfigError, match=match):
        compile_artifact(req, log=lambda s: None, progress=False)
    assert not (tmp_path / "a").exists()  # nothing half-written


def test_tp2_ranks_quantize_their_own_shards(build):
    """--backend eager --tp 2: each rank process holds its shard quantized (per-channel scales of its own rows /
    columns), joined by gloo collectives; logits stay near fp32 like tp=1's."""
    art = build("int8-tp2", quantize="int8", parallel=ParallelConfig(tp=2))
    with safe_open(str(art / "weights" / "rank1.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.o_proj.quant.qweight").shape == (64, 32)  # [H, in / tp]
    assert rel_err(logits(art), logits(build("fp32"))) < 0.05
