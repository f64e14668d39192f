"""`ops=nki` for the neuron backend: which call sites run a kernel (pure selection), and the exact layouts the
device call hands each kernel, run through the kernel on our NKI simulator against TorchOps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels_nki._nki import simulate
from models.llama import TorchOps
from neuron_opt.backends.neuron.nki_device import (
    DeviceKernelOps,
    _kernel,
    attention_from_kernel,
    attention_kernel_call,
    choose_attention,
    choose_paged_attention,
    choose_rms_norm,
    paged_attention_kernel_call,
    rms_norm_kernel_call,
)

F32 = torch.float32


@pytest.mark.parametrize("args, kernel, reason", [
    ((1, 9, 3, 128, 128, 64, F32, None, "NEURON"), "flash_attention", "prefill from position 0"),
    ((4, 8, 2, 1, 512, 128, torch.bfloat16, None, "NEURON"), "decode_attention", "decode step"),
    ((1, 128, 1, 1, 4096, 64, F32, None, "NEURON"), "decode_attention", "decode step"),  # G 128: split 512
    ((1, 4, 2, 128, 128, 64, F32, 8, "NEURON"), None, "sliding window 8"),
    ((1, 4, 2, 16, 32, 64, F32, None, "NEURON"), None, "continue a prefix"),
    ((1, 4, 2, 128, 128, 256, F32, None, "NEURON"), None, "D=256 > 128"),
    ((1, 4, 2, 32768, 32768, 128, torch.bfloat16, None, "NEURON"), "flash_attention", "prefill from position 0"),
    ((1, 4, 2, 1, 600000, 128, torch.bfloat16, None, "NEURON"), None, "SBUF bytes per partition"),
    ((1, 9, 3, 128, 128, 64, F32, None, "CPU"), None, "the CPU device has no NKI runtime"),
    # soft-capped scores (Gemma 2): the kernels cap them themselves
    ((1, 9, 3, 128, 128, 64, F32, None, "NEURON", 50.0), "flash_attention", "prefill from position 0"),
    ((4, 8, 2, 1, 512, 128, torch.bfloat16, None, "NEURON", 50.0), "decode_attention", "decode step"),
    ((1, 4, 2, 128, 128, 64, F32, 8, "NEURON", 50.0), None, "sliding window 8"),
])
def test_attention_call_sites_pick_a_kernel_only_within_its_contract(args, kernel, reason):
    c = choose_attention(*args)
    assert c.kernel == kernel and reason in c.reason, c


def test_rms_norm_call_sites_pick_the_kernel_within_its_contract():
    assert choose_rms_norm(128, 576, F32, "NEURON").kernel == "rmsnorm"
    too_wide = choose_rms_norm(1, 16384, F32, "NEURON")
    assert too_wide.kernel is None and "outside the kernel's contract" in too_wide.reason
    assert choose_rms_norm(128, 576, F32, "CPU").kernel is None


def _causal(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    return torch.arange(kv_len)[None, None, :] <= positions[:, :, None]  # [B, S, kv_len]


@pytest.mark.parametrize("B, n_heads, n_kv, S, kv_len, D", [(1, 4, 2, 128, 128, 32), (2, 6, 3, 1, 256, 32),
                                                       (2, 2, 1, 1, 4096 + 130, 16)])  # a full K chunk: V reordered
def test_the_device_call_layouts_through_the_kernels_equal_torch_ops(B, n_heads, n_kv, S, kv_len, D):
    """The tensors DeviceKernelOps would hand each kernel on a NeuronCore, run through that kernel on the
    simulator, then put back in the model's layout: equal to the reference attention."""
    torch.manual_seed(0)
    q = torch.randn(B, n_heads, S, D)
    keys, values = torch.randn(B, n_kv, kv_len, D), torch.randn(B, n_kv, kv_len, D)
    positions = (torch.arange(S)[None].expand(B, S) if S > 1 else torch.tensor([[100], [kv_len - 1]])[:B])
    scale = 1 / math.sqrt(D)
    c = choose_attention(B, n_heads, n_kv, S, kv_len, D, F32, None, "NEURON")
    grid, args, kwargs = attention_kernel_call(c.kernel, q, keys, values, positions, scale)
    out = simulate(_kernel(c.kernel)[grid], *(a.numpy() for a in args), **kwargs)
    got = attention_from_kernel(c.kernel, torch.from_numpy(np.asarray(out)), q.shape)
    want = TorchOps().attention(q, keys, values, positions, _causal(positions, kv_len), scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_the_device_call_layout_through_the_rmsnorm_kernel_equals_torch_ops():
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 96), torch.randn(96)
    args, kwargs = rms_norm_kernel_call(x, w, 1e-5)
    got = torch.from_numpy(np.asarray(simulate(_kernel("rmsnorm"), *(a.numpy() for a in args), **kwargs)))
    torch.testing.assert_close(got.reshape(x.shape), TorchOps().rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)


def test_on_a_device_without_nki_every_call_site_is_the_torch_op_and_says_why():
    ops = DeviceKernelOps("CPU", window=None)
    x, w = torch.randn(1, 3, 64), torch.randn(64)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), TorchOps().rms_norm(x, w, 1e-6))
    ops.rms_norm(x, w, 1e-6)  # the same call site again: one distinct choice
    (choice,) = ops.take_choices()
    assert choice["kernel"] is None and "no NKI runtime" in choice["reason"]
    assert ops.take_choices() == []


BF16 = torch.bfloat16


@pytest.mark.parametrize("args, kernel, reason", [
    ((8, 32, 8, 1, 600, 16, 256, 128, BF16, BF16, None, "NEURON"), "paged_decode_attention", "block table"),
    ((2, 9, 3, 1, 64, 24, 20, 64, F32, F32, None, "NEURON"), "paged_decode_attention", "block table"),
    ((2, 9, 3, 1, 64, 16, 20, 64, F32, F32, None, "CPU"), None, "the CPU device has no NKI runtime"),
    ((2, 9, 3, 1, 64, 16, 20, 64, F32, F32, 32, "NEURON"), None, "sliding window 32"),
    ((2, 9, 3, 1, 64, 16, 20, 64, BF16, torch.float8_e4m3fn, None, "NEURON"), None, "float8_e4m3fn cache"),
    ((2, 9, 3, 1, 64, 16, 20, 256, F32, F32, None, "NEURON"), None, "D=256"),
    ((2, 258, 2, 1, 64, 16, 20, 64, F32, F32, None, "NEURON"), None, "outside the kernel's contract"),
    ((2, 9, 3, 1, 64, 32, 20, 64, F32, F32, None, "NEURON"), "paged_decode_attention", "block table"),
    ((2, 9, 3, 1, 64, 128, 20, 64, F32, F32, None, "NEURON"), "paged_decode_attention", "block table"),
    ((2, 9, 3, 1, 64, 256, 20, 64, F32, F32, None, "NEURON"), None, "block_len * G = 256 * 3 > 512"),
    ((2, 9, 3, 1, 64, 16, 20, 64, F32, F32, None, "NEURON", 30.0), "paged_decode_attention", "block table"),
])
def test_decode_call_sites_over_block_pools_pick_the_paged_kernel_within_its_contract(args, kernel, reason):
    c = choose_paged_attention(*args)
    assert c.kernel == kernel and reason in c.reason, c


def test_prefill_call_sites_over_block_pools_gather_and_choose_as_before():
    assert choose_paged_attention(1, 4, 2, 128, 64, 16, 8, 64, F32, F32, None, "NEURON") is None


def _pools(B: int, n_kv: int, block_len: int, max_blocks: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = B * max_blocks + 3
    k = torch.randn(n_blocks, n_kv, block_len, D, generator=g)
    v = torch.randn(n_blocks, n_kv, block_len, D, generator=g)
    tables = torch.randperm(n_blocks, generator=g)[:B * max_blocks].view(B, max_blocks)
    return k, v, tables


@pytest.mark.parametrize("B, n_heads, n_kv, block_len, max_blocks, D", [(2, 6, 3, 16, 20, 32), (3, 4, 1, 8, 300, 16),
                                                                      (1, 8, 2, 24, 9, 64)])
def test_the_paged_device_call_through_the_kernel_equals_torch_ops(B, n_heads, n_kv, block_len, max_blocks, D):
    """The pools and tables DeviceKernelOps hands the paged kernel (the pools as they are, no gather), run
    through it on the simulator: equal to TorchOps.attention_blocks (gather, then SDPA)."""
    k, v, tables = _pools(B, n_kv, block_len, max_blocks, D)
    q = torch.randn(B, n_heads, 1, D)
    kv_len = max_blocks * block_len
    positions = torch.tensor([[kv_len - 1], [0], [kv_len // 2]])[:B]
    scale = 1 / math.sqrt(D)
    grid, args, kwargs = paged_attention_kernel_call(q, k, v, tables, positions, scale)
    assert args[1] is k and args[2] is v  # the device pools themselves
    out = simulate(_kernel("paged_decode_attention")[grid], *(a.numpy() for a in args), **kwargs)
    got = attention_from_kernel("paged_decode_attention", torch.from_numpy(np.asarray(out)), q.shape)
    want = TorchOps().attention_blocks(q, k, v, tables, positions, _causal(positions, kv_len), scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_on_a_device_without_nki_block_attention_gathers_and_says_why():
    k, v, tables = _pools(2, 2, 16, 4, 32)
    q, positions = torch.randn(2, 4, 1, 32), torch.tensor([[63], [5]])
    ops = DeviceKernelOps("CPU", window=None)
    mask = _causal(positions, 64)
    got = ops.attention_blocks(q, k, v, tables, positions, mask, 0.25)
    assert torch.equal(got, TorchOps().attention_blocks(q, k, v, tables, positions, mask, 0.25))
    choices = ops.take_choices()
    assert [c["shape"].split("]")[0] for c in choices] == ["q [2, 4, 1, 32"] * 2  # the paged site, then the gather's
    assert "blocks [11, 2, 16, 32]" in choices[0]["shape"] and "kv [2, 2, 64, 32]" in choices[1]["shape"]
    assert all(c["kernel"] is None and "no NKI runtime" in c["reason"] for c in choices)


@pytest.mark.parametrize("B, n_heads, n_kv, S, kv_len, D", [(1, 4, 2, 128, 128, 32), (2, 6, 3, 1, 256, 32)])
def test_soft_capped_device_calls_through_the_kernels_equal_torch_ops(B, n_heads, n_kv, S, kv_len, D):
    """A soft-capped call site (Gemma 2) picks the kernel, hands it the cap, and the kernel's result on the
    simulator equals TorchOps' capped attention (which differs from the uncapped one)."""
    torch.manual_seed(1)
    q = torch.randn(B, n_heads, S, D)
    keys, values = torch.randn(B, n_kv, kv_len, D), torch.randn(B, n_kv, kv_len, D)
    positions = (torch.arange(S)[None].expand(B, S) if S > 1 else torch.tensor([[100], [kv_len - 1]])[:B])
    scale, cap = 0.5, 2.0
    c = choose_attention(B, n_heads, n_kv, S, kv_len, D, F32, None, "NEURON", cap)
    assert c.kernel is not None and "softcap 2" in c.shape, c
    grid, args, kwargs = attention_kernel_call(c.kernel, q, keys, values, positions, scale, cap)
    assert kwargs["softcap"] == cap
    out = simulate(_kernel(c.kernel)[grid], *(a.numpy() for a in args), **kwargs)
    got = attention_from_kernel(c.kernel, torch.from_numpy(np.asarray(out)), q.shape)
    mask = _causal(positions, kv_len)
    want = TorchOps().attention(q, keys, values, positions, mask, scale, softcap=cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert (want - TorchOps().attention(q, keys, values, positions, mask, scale)).abs().max() > 0.1


def test_soft_capped_paged_device_call_through_the_kernel_equals_torch_ops():
    k, v, tables = _pools(2, 3, 16, 20, 32, seed=2)
    q, positions = torch.randn(2, 6, 1, 32), torch.tensor([[319], [40]])
    scale, cap = 0.5, 2.0
    c = choose_paged_attention(2, 6, 3, 1, k.shape[0], 16, 20, 32, F32, F32, None, "NEURON", cap)
    assert c.kernel == "paged_decode_attention" and "softcap 2" in c.shape, c
    grid, args, kwargs = paged_attention_kernel_call(q, k, v, tables, positions, scale, cap)
    out = simulate(_kernel("paged_decode_attention")[grid], *(a.numpy() for a in args), **kwargs)
    got = attention_from_kernel("paged_decode_attention", torch.from_numpy(np.asarray(out)), q.shape)
    mask = _causal(positions, 320)
    want = TorchOps().attention_blocks(q, k, v, tables, positions, mask, scale, softcap=cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert (want - TorchOps().attention_blocks(q, k, v, tables, positions, mask, scale)).abs().max() > 0.1
