"""A tiny model whose attention and RMSNorm run our NKI kernels (on the simulator) matches the torch model.

The ops object is chosen at build time (`LlamaForCausalLM(..., ops=NkiSimOps())`); the oracle is the same
model built with the default torch ops, fed the same steps. Slow: every kernel call runs the numpy simulator.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from models.llama import LlamaForCausalLM
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.errors import KernelArgumentError
from neuron_opt.parallel import head_layout
from neuron_opt.runtime.runner import DecodeRow, ModelRunner


def runner_for(d, ops=None, max_model_len=32):
    cfg = ModelConfig.from_hf(d)
    kw = {} if ops is None else {"ops": ops}
    model = LlamaForCausalLM(cfg, head_layout(cfg, ParallelConfig()), max_model_len, **kw)
    model.load_state_dict(load_file(str(d / "model.safetensors")), strict=False)
    cache = CacheConfig(max_batch=2, max_model_len=max_model_len)
    buckets = BucketConfig.build(
        max_prompt_len=16,
        max_model_len=max_model_len,
        max_batch=2,
        prefill_lens=[16],
        decode_kv_lens=[32],
        decode_batches=[2],
    )
    return ModelRunner(EagerExecutor(model.eval(), cache), buckets, cache, cfg.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("paged", [True, False])
def test_tiny_model_through_simulated_kernels_matches_torch_ops(tiny_dir, paged):
    """Decode through the paged kernel (the block pools in place) or the contiguous one (the blocks gathered)."""
    from neuron_opt.backends.nki_ops import NkiSimOps

    d = tiny_dir("llama-gqa2")
    ref, nki = runner_for(d), runner_for(d, NkiSimOps(paged=paged))
    prompts = {0: [1, 17, 42, 99, 5, 123, 7], 1: [9, 8, 250, 3, 77, 31, 64, 12, 100, 4, 5]}
    for slot, p in prompts.items():
        torch.testing.assert_close(nki.prefill(slot, p), ref.prefill(slot, p), atol=1e-4, rtol=0)
    for step in range(3):
        rows = [DecodeRow(s, 10 + step + s, len(p) + step) for s, p in prompts.items()]
        torch.testing.assert_close(nki.decode(rows), ref.decode(rows), atol=1e-4, rtol=0)


def test_nki_ops_refuse_a_mask_their_kernels_do_not_apply(tiny_dir):
    from neuron_opt.backends.nki_ops import NkiSimOps

    ops = NkiSimOps()
    q = torch.randn(1, 4, 1, 16)
    kv = torch.randn(1, 2, 8, 16)
    pos = torch.tensor([[5]])
    window = (torch.arange(8) <= 5) & (torch.arange(8) > 5 - 3)  # sliding window of 3
    with pytest.raises(KernelArgumentError, match="mask"):
        ops.attention(q, kv, kv, pos, window[None, None], 0.25)
    with pytest.raises(KernelArgumentError, match="prefill from position 0"):
        ops.attention(
            torch.randn(1, 4, 2, 16),
            kv,
            kv,
            torch.tensor([[3, 4]]),
            torch.ones(1, 2, 8, dtype=torch.bool),
            0.25,
        )


def test_nki_ops_cap_the_scores_in_the_kernels(monkeypatch):
    """Soft-capped attention (Gemma 2) runs the kernels with their `softcap` (prefill, contiguous and paged
    decode), equal to TorchOps' capped attention; no call falls back to the torch op."""
    from kernels_nki import decode_attention, flash_attention
    from models.llama import TorchOps
    from neuron_opt.backends.nki_ops import NkiSimOps

    calls: list[tuple[str, float]] = []
    for module, name in ((flash_attention, "run"), (decode_attention, "run"), (decode_attention, "run_paged")):
        real = getattr(module, name)

        def record(*a, _real=real, _name=f"{module.__name__}.{name}", **kw):
            calls.append((_name, kw["softcap"]))
            return _real(*a, **kw)

        monkeypatch.setattr(module, name, record)
    torch.manual_seed(0)
    cap, scale = 1.5, 0.5
    q, k, v = torch.randn(1, 4, 16, 16), torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    pos = torch.arange(16)[None]
    mask = (torch.arange(16)[None, :] <= torch.arange(16)[:, None])[None]
    for ops in (NkiSimOps(paged=False), NkiSimOps(paged=True)):
        got = ops.attention(q, k, v, pos, mask, scale, softcap=cap)
        torch.testing.assert_close(got, TorchOps().attention(q, k, v, pos, mask, scale, softcap=cap), atol=1e-4,
                                   rtol=0)
        k_pool, v_pool = k[0].reshape(2, 2, 8, 16).transpose(0, 1), v[0].reshape(2, 2, 8, 16).transpose(0, 1)
        tables, dpos = torch.tensor([[0, 1]]), torch.tensor([[11]])
        dmask = (torch.arange(16) <= 11)[None, None]
        got = ops.attention_blocks(q[:, :, :1], k_pool, v_pool, tables, dpos, dmask, scale, softcap=cap)
        want = TorchOps().attention_blocks(q[:, :, :1], k_pool, v_pool, tables, dpos, dmask, scale, softcap=cap)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    names = [n for n, _ in calls]
    assert all(c == cap for _, c in calls) and names.count("kernels_nki.flash_attention.run") == 2
    assert "kernels_nki.decode_attention.run" in names and "kernels_nki.decode_attention.run_paged" in names
