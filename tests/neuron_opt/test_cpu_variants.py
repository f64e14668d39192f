"""The cpu backend on architecture variants the main compiled-vs-eager test (tied SmolLM2 shape) does not cover:
Qwen2 q/k/v biases (fused with their projections: a concatenated bias constant), an untied LM head, a Mistral
sliding window shorter than the decoded context (the fused decode attention's mask). Oracle: the eager runner
on the same checkpoint, logits step by step, prefill then decode past the window."""

from __future__ import annotations

import pytest
import torch
from helpers import eager_runner

from neuron_opt.backends.cpu.backend import CpuBackend
from neuron_opt.runtime.runner import DecodeRow, ModelRunner

# in the default suite: MoE with a shared expert and q/k/v biases, untied head (decode at batch 1 gathers its 2
# experts; the prefill graph runs all 8, dense); windows on cpu graphs: Gemma 2 in tests/models/test_families.py
# ~40-80 s of compile each (make test-slow): MoE with a shared expert, biases and an untied head; a sliding window of
# 8; dense biases and the untied head alone; MoE with renormalised top-2; q/k norm
VARIANTS = ["qwen2-moe", "mistral-window", "qwen2", "llama-gqa2", "mixtral", "qwen3-moe"]


def _compare(tiny_dir, tmp_path, variant: str, dtype: str, rtol: float, atol: float,
             options: dict | None = None) -> None:
    ck = tiny_dir(variant)
    ref = eager_runner(ck, max_model_len=64, prefill_lens=(16,), decode_kv_lens=(32, 64))
    model = ref.executor.model  # fp32, the checkpoint's weights
    backend = CpuBackend(getattr(torch, dtype), options)
    files = {b: [tmp_path / f for f in backend.compile_bucket(model, b, ref.cache, tmp_path)]
             for b in ref.buckets.buckets()}
    backend.save_weights(model, tmp_path / "w.safetensors")
    factory = lambda: type(model)(model.cfg, model.layout, model.max_model_len)  # noqa: E731 (weights come from the file)
    got = ModelRunner(backend.load(files, tmp_path / "w.safetensors", factory, ref.cache), ref.buckets, ref.cache,
                      model.cfg.vocab_size)
    prompt = torch.randint(3, 200, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = got.prefill(0, prompt), ref.prefill(0, prompt)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    tok = int(b.argmax())
    for pos in range(len(prompt), len(prompt) + 30):  # past the window (8) and across the 32 -> 64 KV bucket
        a, b = got.decode([DecodeRow(0, tok, pos)])[0], ref.decode([DecodeRow(0, tok, pos)])[0]
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        tok = int(b.argmax())  # teacher-forced by the reference
    assert got.last_bucket.kv_len == 64


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_fp32_variants_match_eager(tiny_dir, tmp_path, variant: str) -> None:
    _compare(tiny_dir, tmp_path, variant, "float32", rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~45 s; the fallback when the operators do not build (the default form runs above)
def test_cpu_moe_without_the_gather_operator_matches_eager(tiny_dir, tmp_path) -> None:
    """`moe_gather=inductor`: the selected experts as Inductor's fused loop (the form before the operator, and the
    fallback where it does not build); the default form is the qwen2-moe case above. The decode graph calls the
    operator only in the default form."""
    import json

    _compare(tiny_dir, tmp_path, "qwen2-moe", "float32", rtol=1e-4, atol=1e-4, options={"moe_gather": "inductor"})
    calls = tmp_path / "cpu" / "layer_decode_b1.json"  # only operator calls left: paged attention
    assert "moe_gather" not in calls.read_text()
    assert json.loads(calls.with_name("layer_decode_b1.meta.json").read_text())["options"]["moe_gather"] == "inductor"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen2", "llama-gqa2"])
def test_cpu_bf16_variants_match_eager_within_bf16(tiny_dir, tmp_path, variant: str) -> None:
    _compare(tiny_dir, tmp_path, variant, "bfloat16", rtol=0.05, atol=0.05)
