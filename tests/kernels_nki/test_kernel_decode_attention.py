"""decode_attention kernel (NKI simulator) vs the float64 numpy reference over a table of shapes.

Tolerances per dtype: float32 matmuls are fp32 (1e-4); bfloat16 rounds the probabilities before P @ V
and the output to bf16 (2e-2 on outputs of magnitude <= ~1).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels_nki import decode_attention
from kernels_nki.decode_attention_ref import decode_attention_ref
from neuron_opt.errors import KernelArgumentError

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# (B, n_heads, n_kv_heads, S_max, D, split_size, dtype); lengths are drawn per case (first = S_max,
# last = 1 when B > 1), so some splits are entirely past a sequence's length.
CASES = [
    (1, 1, 1, 1, 32, 128, "float32"),
    (1, 1, 1, 100, 64, 128, "float32"),
    (2, 2, 1, 130, 64, 128, "bfloat16"),
    (2, 3, 1, 200, 32, 128, "float32"),
    (3, 4, 1, 257, 128, 256, "float32"),
    (2, 8, 1, 300, 64, 128, "bfloat16"),
    (4, 8, 2, 64, 128, 128, "float32"),
    (2, 6, 3, 129, 96, 256, "bfloat16"),
    (1, 4, 4, 511, 64, 512, "float32"),
    (2, 2, 2, 33, 48, 128, "bfloat16"),
    (3, 12, 4, 150, 32, 128, "float32"),
    (2, 16, 2, 99, 64, 256, "float32"),
    (1, 32, 4, 128, 128, 128, "bfloat16"),
    (2, 4, 2, 1100, 64, 1024, "float32"),
    (2, 4, 1, 1030, 32, 1024, "bfloat16"),
    (5, 2, 1, 17, 16, 128, "float32"),
    (2, 1, 1, 384, 80, 128, "float32"),
    (2, 8, 8, 60, 32, 128, "bfloat16"),
    (1, 24, 8, 90, 64, 128, "float32"),
    (2, 9, 3, 250, 128, 256, "float32"),
    (3, 5, 1, 45, 40, 128, "bfloat16"),
    (2, 64, 8, 70, 64, 128, "float32"),
    (1, 2, 1, 640, 128, 512, "bfloat16"),
    (4, 4, 4, 31, 64, 128, "float32"),
    (2, 3, 3, 513, 32, 512, "float32"),
    (2, 8, 2, 2, 64, 128, "bfloat16"),
    (3, 16, 16, 20, 32, 128, "float32"),
    (2, 4, 1, 777, 64, 256, "float32"),
    (2, 2, 1, 129, 128, 128, "bfloat16"),
    (1, 8, 1, 1024, 128, 1024, "float32"),
    (2, 12, 3, 160, 96, 128, "bfloat16"),
    (6, 4, 2, 50, 64, 128, "float32"),
    # full K chunks (K_LOAD positions): V read in partition-run order (`v_kernel_layout`), then a natural tail
    (2, 2, 1, 4096, 32, 1024, "bfloat16"),
    (2, 4, 2, 4096 + 300, 16, 512, "float32"),
    (1, 3, 1, 2 * 4096 + 130, 32, 2048, "float32"),
]


@pytest.mark.parametrize("b,n_heads,n_kv,s_max,d,split,dtype", CASES)
def test_matches_reference(b, n_heads, n_kv, s_max, d, split, dtype):
    rng = np.random.default_rng(s_max * 7 + d + b)
    dt = DTYPES[dtype]
    q = rng.standard_normal((b, n_heads, d)).astype(dt)
    k = rng.standard_normal((b, n_kv, s_max, d)).astype(dt)
    v = rng.standard_normal((b, n_kv, s_max, d)).astype(dt)
    lengths = rng.integers(1, s_max + 1, size=b)
    lengths[0] = s_max
    if b > 1:
        lengths[-1] = 1
    out = decode_attention.run(q, k, v, lengths, split_size=split)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = decode_attention_ref(q, k, v, lengths)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])


# (B, n_heads, n_kv_heads, S_max, D, split_size, dtype): splits past a length (the last row's length is 1), GQA,
# a short tail split, a full K chunk then a tail
SOFTCAP_CASES = [
    (2, 4, 2, 300, 64, 128, "float32"),
    (3, 8, 1, 129, 32, 128, "bfloat16"),
    (2, 6, 3, 777, 64, 256, "float32"),
    (2, 4, 2, 4096 + 300, 16, 512, "float32"),
]


@pytest.mark.parametrize("b,n_heads,n_kv,s_max,d,split,dtype", SOFTCAP_CASES)
def test_soft_capped_scores_match_reference(b, n_heads, n_kv, s_max, d, split, dtype):
    """cap * tanh(x / cap) on the scaled scores before the softmax (Gemma 2); scale 1 and a cap of 2 change
    every row (checked on the reference), and the merge of the splits takes the cap for its scale."""
    rng = np.random.default_rng(s_max * 5 + d)
    dt = DTYPES[dtype]
    q = rng.standard_normal((b, n_heads, d)).astype(dt)
    k = rng.standard_normal((b, n_kv, s_max, d)).astype(dt)
    v = rng.standard_normal((b, n_kv, s_max, d)).astype(dt)
    lengths = rng.integers(1, s_max + 1, size=b)
    lengths[0], lengths[-1] = s_max, 1
    out = decode_attention.run(q, k, v, lengths, split_size=split, softmax_scale=1.0, softcap=2.0)
    ref = decode_attention_ref(q, k, v, lengths, softmax_scale=1.0, softcap=2.0)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])
    uncapped = decode_attention_ref(q, k, v, lengths, softmax_scale=1.0)
    assert np.abs(uncapped[0] - ref[0]).max() > 0.1
    with pytest.raises(KernelArgumentError, match="softcap"):
        decode_attention.run(q, k, v, lengths, split_size=split, softcap=-2.0)


@pytest.mark.parametrize("s_max,split", [(4096, 1024), (4096 + 300, 512), (2 * 4096 + 130, 128), (500, 256)])
def test_v_kernel_layout_is_the_row_order_the_kernel_reads(s_max, split):
    """Row r of the kernel's V is cache position order[r]; in a full K chunk partition q's rows of every split
    are consecutive (one DMA descriptor per partition), past the last full chunk the rows stay in order."""
    import torch

    order = decode_attention.v_kernel_layout(np.arange(s_max).reshape(1, 1, s_max, 1), split).reshape(-1)
    assert sorted(order.tolist()) == list(range(s_max))
    v = np.arange(2 * s_max * 3, dtype=np.float32).reshape(1, 2, s_max, 3)
    np.testing.assert_array_equal(decode_attention.v_kernel_layout(v, split), v[:, :, order])
    np.testing.assert_array_equal(decode_attention.v_kernel_layout(torch.from_numpy(v), split).numpy(),
                                  v[:, :, order])
    chunk = (4096 // split) * split
    n = split // 128
    for c in range(s_max // chunk):
        rows = order[c * chunk:(c + 1) * chunk].reshape(128, chunk // 128)  # partition q's run
        for i in range(chunk // split):
            np.testing.assert_array_equal(rows[:, i * n:(i + 1) * n],
                                          c * chunk + i * split + np.arange(128)[:, None] * n + np.arange(n))
    tail = s_max - s_max % chunk
    np.testing.assert_array_equal(order[tail:], np.arange(tail, s_max))


def test_garbage_past_length_is_ignored():
    # Positions past the length hold huge values: they must not leak into the result.
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k = rng.standard_normal((2, 2, 300, 32)).astype(np.float32)
    v = rng.standard_normal((2, 2, 300, 32)).astype(np.float32)
    lengths = np.array([70, 260])
    for i, n in enumerate(lengths):
        k[i, :, n:] = 1e4
        v[i, :, n:] = 1e6
    out = decode_attention.run(q, k, v, lengths, split_size=128)
    np.testing.assert_allclose(out, decode_attention_ref(q, k, v, lengths), atol=1e-4, rtol=1e-4)


def test_rejects_bad_lengths():
    q = np.zeros((2, 2, 16), np.float32)
    kv = np.zeros((2, 1, 8, 16), np.float32)
    with pytest.raises(KernelArgumentError):
        decode_attention.run(q, kv, kv, np.array([0, 3]))
    with pytest.raises(KernelArgumentError):
        decode_attention.run(q, kv, kv, np.array([9, 3]))


USABLE_SBUF = 180224  # bytes per partition the compiler lets a trn1 kernel use (docs/nki_simulator.md)


@pytest.mark.parametrize("d,split", [(128, 128), (32, 512)])
def test_sbuf_boundary_largest_cache_runs_next_is_refused(d, split):
    # Every split keeps its partial output [G, D] and statistics in SBUF until the merge (fp32).
    s_max = decode_attention.max_cache_len(d, split)
    rep = decode_attention.estimate(1, 4, 1, s_max, d, split_size=split)  # count-only: SBUF rules still apply
    assert rep.sbuf_peak_bytes_per_partition <= USABLE_SBUF
    q = np.zeros((1, 1, d), np.float32)
    kv = np.zeros((1, 1, s_max + 1, d), np.float32)
    with pytest.raises(KernelArgumentError) as info:
        decode_attention.run(q, kv, kv, np.array([1]), split_size=split)
    for part in (f"S_max={s_max + 1}", f"split_size={split}", f"D={d}", str(USABLE_SBUF)):
        assert part in str(info.value), str(info.value)


def test_cache_past_sbuf_is_an_argument_error():
    q = np.zeros((1, 1, 128), np.float32)
    kv = np.zeros((1, 1, 128 * 400, 128), np.float32)  # 400 splits x (128 + 4) x 4 B > 176 KiB
    with pytest.raises(KernelArgumentError, match="S_max=51200"):
        decode_attention.run(q, kv, kv, np.array([7]), split_size=128)


def test_default_split_keeps_the_transposed_scores_in_one_psum_bank():
    assert [decode_attention.default_split(g) for g in (1, 4, 64, 65, 128)] == [1024, 1024, 1024, 896, 512]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 128, 16)).astype(np.float32)  # G = 128 over one KV head: split 512
    k = rng.standard_normal((1, 1, 1100, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 1100, 16)).astype(np.float32)
    lengths = np.array([1037])
    out = decode_attention.run(q, k, v, lengths)
    np.testing.assert_allclose(out, decode_attention_ref(q, k, v, lengths), atol=1e-4, rtol=1e-4)


def test_split_whose_scores_overflow_psum_is_an_argument_error():
    # A split's transposed scores are [128, split / 128 * G] fp32 in one PSUM bank (512 columns): with 64 query
    # heads per KV head 1024 positions fit, 1152 do not.
    kv = np.zeros((1, 1, 2304, 32), np.float32)
    q = np.zeros((1, 64, 32), np.float32)
    decode_attention.run(q, kv, kv, np.array([5]), split_size=1024)
    with pytest.raises(KernelArgumentError, match="split_size 1152 .* G=64 allows at most 1024"):
        decode_attention.run(q, kv, kv, np.array([5]), split_size=1152)
    with pytest.raises(KernelArgumentError, match="split_size 200"):
        decode_attention.run(q, kv, kv, np.array([5]), split_size=200)


def test_splits_are_rolled_loops_so_the_program_does_not_grow_with_the_cache():
    """Full K chunks and their splits are affine_range loops (checked by the simulator's rolled-loop and
    independence rules); only the merge is unrolled, one instruction per split."""
    reps = {s: decode_attention.estimate(1, 4, 1, s, 128) for s in (4096, 32768)}
    extra_splits = 32768 // 1024 - 4096 // 1024  # the default split_size
    assert reps[32768].static_instructions - reps[4096].static_instructions <= 2 * extra_splits
    dyn = {s: sum(e.instructions for e in r.engines.values()) for s, r in reps.items()}
    assert dyn[32768] > 6 * dyn[4096]  # the work still grows with the cache
