"""flash_attention kernel (NKI simulator) vs the float64 numpy reference over a table of shapes.

Tolerances per dtype: float32 runs every matmul in fp32, so only summation order differs (1e-4);
bfloat16 rounds the probabilities to bf16 before P @ V and the output to bf16 (~2^-8 relative each),
on outputs of magnitude <= ~1 (2e-2).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels_nki import flash_attention
from kernels_nki.flash_attention_ref import flash_attention_ref
from neuron_opt.errors import KernelArgumentError

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# (B, n_heads, n_kv_heads, S, D, causal, dtype): odd S, S % 128 != 0, GQA ratios 1/2/3/4/8, batch > 1.
CASES = [
    (1, 1, 1, 1, 32, True, "float32"),
    (1, 1, 1, 7, 32, False, "float32"),
    (1, 1, 1, 128, 64, True, "float32"),
    (1, 1, 1, 129, 64, True, "bfloat16"),
    (1, 2, 2, 200, 48, True, "float32"),
    (1, 2, 1, 130, 64, True, "bfloat16"),
    (2, 2, 1, 77, 32, False, "float32"),
    (1, 3, 1, 150, 96, True, "float32"),
    (1, 3, 1, 255, 128, True, "bfloat16"),
    (1, 4, 1, 64, 128, True, "float32"),
    (2, 4, 2, 100, 64, True, "bfloat16"),
    (1, 8, 1, 33, 32, True, "float32"),
    (1, 8, 1, 40, 64, False, "bfloat16"),
    (1, 16, 2, 17, 32, True, "float32"),
    (2, 1, 1, 300, 128, True, "float32"),
    (1, 1, 1, 300, 128, False, "bfloat16"),
    (1, 1, 1, 257, 80, False, "float32"),
    (1, 2, 2, 511, 64, True, "bfloat16"),
    (1, 1, 1, 513, 32, True, "float32"),
    (1, 1, 1, 513, 32, False, "float32"),
    (3, 2, 2, 50, 40, True, "bfloat16"),
    (2, 6, 3, 90, 64, True, "float32"),
    (1, 6, 2, 140, 32, False, "bfloat16"),
    (1, 4, 4, 128, 128, False, "float32"),
    (1, 1, 1, 384, 128, True, "bfloat16"),
    (1, 2, 1, 256, 100, True, "float32"),
    (2, 3, 3, 31, 128, False, "float32"),
    (1, 8, 8, 20, 64, True, "bfloat16"),
    (1, 12, 4, 45, 32, True, "float32"),
    (1, 1, 1, 1, 128, False, "bfloat16"),
    (1, 2, 1, 2, 16, True, "float32"),
    (1, 1, 1, 640, 64, True, "bfloat16"),
]


def _inputs(b, n_heads, n_kv, s, d, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    q = rng.standard_normal((b, n_heads, s, d)).astype(dt)
    k = rng.standard_normal((b, n_kv, s, d)).astype(dt)
    v = rng.standard_normal((b, n_kv, s, d)).astype(dt)
    return q, k, v


@pytest.mark.parametrize("b,n_heads,n_kv,s,d,causal,dtype", CASES)
def test_matches_reference(b, n_heads, n_kv, s, d, causal, dtype):
    q, k, v = _inputs(b, n_heads, n_kv, s, d, dtype, seed=s * 31 + d)
    out = flash_attention.run(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = flash_attention_ref(q, k, v, causal=causal)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_custom_scale_and_large_logits():
    # A large scale makes the softmax nearly one-hot: exercises the max subtraction and the rescaling.
    q, k, v = _inputs(1, 2, 1, 140, 64, "float32", seed=3)
    out = flash_attention.run(q, k, v, causal=True, softmax_scale=2.0)
    np.testing.assert_allclose(out, flash_attention_ref(q, k, v, causal=True, softmax_scale=2.0), atol=1e-4)


# (B, n_heads, n_kv_heads, S, D, causal, dtype, K_BLOCK): the causal diagonal (its mask added after the tanh), a
# query tile past 512 keys, GQA, bf16, and key blocks shrunk so that the online-softmax rescale runs on capped scores
SOFTCAP_CASES = [
    (1, 2, 1, 200, 64, True, "float32", 2048),
    (2, 4, 2, 100, 64, True, "bfloat16", 2048),
    (1, 1, 1, 77, 32, False, "float32", 2048),
    (1, 3, 1, 600, 32, True, "float32", 2048),
    (1, 1, 1, 700, 64, True, "float32", 512),
    (1, 2, 2, 600, 32, False, "bfloat16", 512),
]


@pytest.mark.parametrize("b,n_heads,n_kv,s,d,causal,dtype,k_block", SOFTCAP_CASES)
def test_soft_capped_scores_match_reference(monkeypatch, b, n_heads, n_kv, s, d, causal, dtype, k_block):
    """Gemma 2's soft-capping, cap * tanh(x / cap) on the scaled scores: scale 1 makes the scores large (std
    sqrt(D)) so that a cap of 2 changes every row's softmax (checked on the reference)."""
    monkeypatch.setattr(flash_attention, "K_BLOCK", k_block)
    q, k, v = _inputs(b, n_heads, n_kv, s, d, dtype, seed=s * 13 + d)
    out = flash_attention.run(q, k, v, causal=causal, softmax_scale=1.0, softcap=2.0)
    ref = flash_attention_ref(q, k, v, causal=causal, softmax_scale=1.0, softcap=2.0)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])
    uncapped = flash_attention_ref(q, k, v, causal=causal, softmax_scale=1.0)
    assert np.abs(uncapped - ref).max() > 0.1


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("nan"), float("inf")])
def test_a_softcap_that_is_not_a_positive_number_is_refused(softcap):
    q, k, v = _inputs(1, 1, 1, 8, 16, "float32", seed=0)
    with pytest.raises(KernelArgumentError, match="softcap"):
        flash_attention.run(q, k, v, softcap=softcap)


@pytest.mark.parametrize("k_block,s,causal,dtype", [
    (512, 700, True, "float32"), (512, 600, False, "bfloat16"),
    (1024, 1100, True, "bfloat16"), (1024, 1030, False, "float32"),
])
def test_online_softmax_across_key_blocks(monkeypatch, k_block, s, causal, dtype):
    # The rescaling between key blocks (running max, alpha, o = alpha * o + pv) only runs when a query tile
    # sees more than K_BLOCK keys; shrink K_BLOCK so that short sequences cross several blocks. A large
    # scale makes later blocks raise the running max often.
    monkeypatch.setattr(flash_attention, "K_BLOCK", k_block)
    q, k, v = _inputs(1, 1, 1, s, 64, dtype, seed=s)
    out = flash_attention.run(q, k, v, causal=causal, softmax_scale=0.5)
    ref = flash_attention_ref(q, k, v, causal=causal, softmax_scale=0.5)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_rejects_unsupported_arguments():
    q, k, v = _inputs(1, 3, 2, 8, 16, "float32", seed=0)
    with pytest.raises(KernelArgumentError):
        flash_attention.run(q, k, v)  # 3 heads over 2 KV heads
    q, k, v = _inputs(1, 1, 1, 8, 160, "float32", seed=0)
    with pytest.raises(KernelArgumentError):
        flash_attention.run(q, k, v)  # D > 128


def test_cost_model_counts_exact_flops_and_skips_future_tiles():
    # Count-only run (no values): non-causal issues exactly QK^T (2*S*S*D) and P@[V|1] (2*S*S*(D+1)) FLOPs.
    # Causal issues, per 128-query tile, only the keys up to its last query, plus one mask matmul
    # (I[128,128] @ mask[128,128]) on the diagonal block: future tiles are skipped, not masked.
    s, d = 1024, 128
    full = flash_attention.estimate(1, 1, 1, s, d, causal=False)
    assert full.matmul_flops == 2 * s * s * d + 2 * s * s * (d + 1)
    expected = 0
    for q0 in range(0, s, 128):
        kend = q0 + 128
        expected += 2 * 128 * kend * (2 * d + 1) + 2 * 128 * 128 * 128
    causal = flash_attention.estimate(1, 1, 1, s, d, causal=True)
    assert causal.matmul_flops == expected
    # the skipped tiles are work not done (at S=1024 the latency is mostly dependency chains, not work)
    assert causal.engines["tensor"].busy_us < 0.75 * full.engines["tensor"].busy_us
    assert causal.latency_us < full.latency_us


USABLE_SBUF = 180224  # bytes per partition the compiler lets a trn1 kernel use (docs/nki_simulator.md)


@pytest.mark.parametrize("causal", [True, False])
def test_sbuf_use_does_not_grow_with_sequence(causal):
    # K/V stream in blocks: the peak is set by the tiles, not by S (count-only runs, SBUF rules still apply).
    peaks = {s: flash_attention.estimate(1, 1, 1, s, 128, causal=causal).sbuf_peak_bytes_per_partition
             for s in (4096, 8192, 12288)}
    assert len(set(peaks.values())) == 1, peaks
    assert peaks[4096] <= flash_attention.sbuf_bytes(128, ml_dtypes.bfloat16) <= USABLE_SBUF
    assert flash_attention.sbuf_bytes(128, np.float32) <= USABLE_SBUF


def test_compiled_program_grows_linearly_not_quadratically():
    # Static instructions (rolled loops counted once): constant in S without a mask (the key-block and
    # query-group loops stay rolled), linear with the causal mask (one unrolled body per 512-query group),
    # while the instructions executed grow with S^2.
    def counts(s, causal):
        rep = flash_attention.estimate(1, 1, 1, s, 128, causal=causal)
        return rep.static_instructions, sum(e.instructions for e in rep.engines.values()) + rep.dma_transfers

    (f1, d1), (f2, d2) = counts(4096, False), counts(8192, False)
    assert f1 == f2 and d2 > 3.5 * d1
    (c1, e1), (c2, e2), (c3, e3) = counts(2048, True), counts(4096, True), counts(8192, True)
    assert c3 - c2 == 2 * (c2 - c1)  # each doubling of S adds twice the groups of the previous doubling
    assert e3 > 3.5 * e2 and e2 > 3 * e1


@pytest.mark.slow
@pytest.mark.parametrize("s,causal", [(16384, True), (16384, False), (32768, True)])
def test_long_sequences_match_reference(s, causal):
    # Model-length contexts run with the same tiles (K/V streamed); checked on a sample of query rows that
    # covers tile, group and block boundaries (the full float64 score matrix would take 8 GiB at 32k).
    q, k, v = _inputs(1, 1, 1, s, 64, "bfloat16", seed=s)
    out = flash_attention.run(q, k, v, causal=causal)
    rows = np.unique(np.concatenate([[0, 1, 127, 128, 511, 512, 2047, 2048, 2049, s // 2, s - 129, s - 1],
                                     np.random.default_rng(s).integers(0, s, 52)]))
    ref = flash_attention_ref(q, k, v, causal=causal, query_rows=rows)
    np.testing.assert_allclose(out[:, :, rows].astype(np.float64), ref, atol=TOL["bfloat16"], rtol=TOL["bfloat16"])
