"""Weight-only quantization and the fp8 KV cache: formats against numpy/float references, GGUF blocks read as
stored against gguf's own dequantizer, and model logits against fp32 (tiny random HF checkpoints).

Tolerances on logits are relative to the fp32 logits' standard deviation over the vocabulary (a scale-free
measure): int8 per channel and fp8 KV 5%, fp8 weights 10%, int4 (group 32) 15%; the compiled cpu kernels
against the eager (dequantize-then-matmul) reference with the same stored weights 3% (they round
activations to bf16).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_opt.config import QuantConfig
from neuron_opt.errors import ConfigError
from neuron_opt.quant.gguf import q4_block_tensor
from neuron_opt.quant.kv import fold, fold_factor
from neuron_opt.quant.weights import FP8_MAX, dequantize, pack_int4, quantize, unpack_int4


@given(st.integers(1, 6), st.integers(1, 20), st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_int4_pack_unpack_roundtrip(n, half_k, seed):
    u = torch.randint(0, 16, (n, 2 * half_k), generator=torch.Generator().manual_seed(seed))
    p = pack_int4(u)
    assert p.dtype == torch.uint8 and p.shape == (n, half_k)
    assert torch.equal(unpack_int4(p), u.to(torch.uint8))
    assert torch.equal(p[:, 0] & 15, u[:, 0].to(torch.uint8))  # element 0 in the low nibble


@pytest.mark.parametrize("qtype", ["per_channel_symmetric", "per_tensor_symmetric"])
def test_int8_error_within_half_a_step(qtype):
    w = torch.randn(48, 64) * torch.linspace(0.1, 3, 48)[:, None]
    t = quantize(w, QuantConfig("int8", qtype))
    assert t.qweight.dtype == torch.int8 and t.scale.shape == (48, 1)
    if qtype == "per_tensor_symmetric":
        assert torch.all(t.scale == t.scale[0])
    err = (dequantize(t) - w).abs()
    assert torch.all(err <= t.scale / 2 + 1e-6)
    assert t.nbytes() == 48 * 64 + 4 * 48


@pytest.mark.parametrize("qtype", ["group_asymmetric", "group_symmetric"])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_error_within_half_a_step(qtype, group):
    w = torch.randn(16, 128) + torch.linspace(-1, 1, 128)  # groups with an offset
    t = quantize(w, QuantConfig("int4", qtype, group))
    assert t.qweight.shape == (16, 64) and t.scale.shape == (16, 128 // group)
    step = t.scale.repeat_interleave(group, 1)
    err = (dequantize(t) - w).abs()
    if qtype == "group_asymmetric":
        assert torch.all(err <= step / 2 + 1e-5)
    else:  # values -8..7 of amax / 8: +amax itself may clip by one step
        assert torch.all(err <= step + 1e-5)
    assert t.nbytes() == 16 * 64 + 2 * 4 * 16 * (128 // group)


def test_fp8_relative_error():
    w = torch.randn(32, 64)
    t = quantize(w, QuantConfig("fp8"))
    assert t.qweight.dtype == torch.float8_e4m3fn
    assert float((t.qweight.float().abs().amax(1) - FP8_MAX).abs().max()) == 0.0  # each row's max maps to 448
    rel = ((dequantize(t) - w).abs() / w.abs().clamp(min=1e-3)).median()
    assert rel < 2 ** -4


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_map_exactly_onto_int4(kind):
    """Our reading of the raw blocks equals gguf's own dequantizer bit for bit."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)  # uint8 [8, 3 blocks * bytes]
    ref = gguf.quants.dequantize(raw, qtype).reshape(8, 96)
    t = q4_block_tensor(raw, kind, 8, 96)
    assert t.group_size == 32
    assert np.array_equal(dequantize(t).numpy(), ref)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="quantization_type"):
        QuantConfig("int8", "group_asymmetric")
    with pytest.raises(ConfigError, match="group_size"):
        QuantConfig("int4", group_size=48)
    with pytest.raises(ConfigError, match="quantize"):
        QuantConfig("int2")
    with pytest.raises(ConfigError, match="group_size"):
        quantize(torch.randn(4, 40), QuantConfig("int4"))


def test_fold_factors_leave_attention_unchanged():
    ks, vs = [2.0, 0.5], [4.0, 0.25]
    assert fold_factor("model.layers.1.self_attn.q_proj.weight", ks, vs) == 0.5
    assert fold_factor("model.layers.1.self_attn.k_proj.bias", ks, vs) == 2.0
    assert fold_factor("model.layers.0.self_attn.v_proj.weight", ks, vs) == 0.25
    assert fold_factor("model.layers.0.self_attn.o_proj.weight", ks, vs) == 4.0
    assert fold_factor("model.layers.0.self_attn.o_proj.bias", ks, vs) == 1.0  # added after the product
    assert fold_factor("model.layers.0.mlp.up_proj.weight", ks, vs) == 1.0
    t = quantize(torch.randn(8, 32), QuantConfig("int4"))
    (_, folded), = fold([("model.layers.0.self_attn.o_proj.weight", t)], ks, vs)
    assert torch.allclose(dequantize(folded), 4.0 * dequantize(t))


def _quantized_linears(method: str, sizes: list[int], k: int, bias: bool, seed: int = 0) -> list:
    from neuron_opt.parallel import SINGLE, ColumnParallelLinear

    g = torch.Generator().manual_seed(seed)
    qc = QuantConfig(method=method, group_size=32) if method == "int4" else QuantConfig(method=method)
    out = []
    for n in sizes:
        lin = ColumnParallelLinear(k, n, bias, SINGLE)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
        lin.quantize_as(qc)
        lin.quant.load(torch.randn(n, k, generator=g) * 0.05)
        out.append(lin)
    return out


@pytest.mark.parametrize("method,bias", [("int8", False), ("int8", True), ("int4", False), ("int4", True)])
def test_fused_linears_equal_the_separate_linears(method, bias):
    """One GEMM over the concatenated stored weights (q/k/v, gate/up on the cpu backend) gives each projection's
    output: on the reference (dequantize) kernel and on torch's CPU kernels, for one row and for several."""
    from neuron_opt.backends.cpu.weights import CpuQuantizedWeight, use_cpu_kernels
    from neuron_opt.parallel import FusedLinears

    linears = _quantized_linears(method, [96, 32, 32], 64, bias)
    fused = FusedLinears(linears)
    assert fused.quant.out_features == 160 and fused.sizes == [96, 32, 32]
    for rows in (1, 3):
        x = torch.randn(1, rows, 64)
        for got, lin in zip(fused(x), linears, strict=True):
            torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-5)
    for m in [fused, *linears]:
        use_cpu_kernels(m)
        assert isinstance(m.quant, CpuQuantizedWeight)  # a linear's own weight (`quant`, a direct child) converts
    for rows in (1, 3):  # one row: the int8 dot-product form; several: torch's weight-only GEMM
        x = torch.randn(1, rows, 64)
        for got, lin in zip(fused(x), linears, strict=True):
            torch.testing.assert_close(got, lin(x), rtol=1e-2, atol=1e-2)


def test_fusion_needs_linears_quantized_alike():
    from neuron_opt.parallel import FusedLinears

    int8, int4 = _quantized_linears("int8", [32], 64, False), _quantized_linears("int4", [32], 64, False)
    assert not FusedLinears.can_fuse(int8 + int4)
    assert not FusedLinears.can_fuse(int8)  # nothing to fuse
    assert not FusedLinears.can_fuse(int8 + _quantized_linears("int8", [32], 64, True))  # a bias on one only
    with pytest.raises(ValueError, match="quantized alike"):
        FusedLinears(int8 + int4)


def test_int8_one_row_dot_product_matches_the_gemm_kernel():
    """A one-row int8 product (batch-1 decode) is computed as a dot product per output row in fp32; torch's int8
    GEMM computes the same sums from bf16 activations. Checked on the rows of a 4-row call."""
    from neuron_opt.backends.cpu.weights import use_cpu_kernels

    (lin,) = _quantized_linears("int8", [200], 576, False, seed=3)
    use_cpu_kernels(lin)
    x = torch.randn(4, 576).bfloat16().float()  # bf16-exact activations: both forms see the same values
    many = lin(x)
    for i in range(4):
        torch.testing.assert_close(lin(x[i:i + 1]), many[i:i + 1], rtol=2e-2, atol=2e-2)


def test_int8_cpu_kernel_with_input_features_not_a_multiple_of_16():
    """torch's int8 GEMM crashes (reads past each weight row) at K = 72; such linears take the dot-product form at
    every row count, equal to the dequantized reference."""
    from neuron_opt.backends.cpu.weights import use_cpu_kernels

    (lin,) = _quantized_linears("int8", [40], 72, False, seed=4)
    x = torch.randn(5, 72).bfloat16().float()
    ref = lin(x)  # the dequantize-then-matmul reference
    use_cpu_kernels(lin)
    torch.testing.assert_close(lin(x), ref, rtol=1e-2, atol=1e-2)
