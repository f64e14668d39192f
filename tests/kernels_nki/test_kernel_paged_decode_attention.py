"""paged decode_attention (KV read through a block table, NKI simulator) vs the float64 numpy reference.

Tolerances as test_kernel_decode_attention: fp32 1e-4, bf16 2e-2. Tables are random permutations of a pool
larger than what they use, and sequences share blocks (a shared prefix), so a kernel that read blocks in pool
order, or one sequence's blocks for another, fails.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels_nki import decode_attention
from kernels_nki.decode_attention_ref import decode_attention_ref, paged_decode_attention_ref
from neuron_opt.errors import KernelArgumentError

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# (B, n_heads, n_kv_heads, block_len, max_blocks, D, split_size or None (default_paged_split), dtype)
CASES = [
    (1, 1, 1, 16, 1, 32, None, "float32"),
    (2, 4, 2, 16, 10, 64, None, "float32"),
    (2, 8, 1, 16, 9, 128, None, "bfloat16"),
    (3, 4, 4, 32, 5, 32, None, "float32"),
    (1, 8, 1, 8, 300, 128, None, "float32"),  # 3 splits of 128 blocks, the last one 44 blocks
    (2, 6, 3, 8, 129, 64, None, "bfloat16"),  # a one-block tail split
    (2, 2, 1, 4, 100, 32, 512, "float32"),
    (1, 16, 2, 1, 200, 64, 128, "float32"),  # one position per block
    (2, 4, 1, 64, 40, 32, None, "float32"),  # 32 blocks per split
    (2, 3, 1, 128, 18, 16, None, "bfloat16"),  # 16 blocks per split, 128 positions each
    (4, 12, 4, 16, 12, 48, 1024, "float32"),
    (2, 32, 8, 16, 33, 128, None, "bfloat16"),
    (3, 2, 2, 24, 7, 80, 3072, "float32"),  # block_len not a power of two
    (2, 4, 2, 48, 70, 32, None, "float32"),  # split 1536: 32 blocks of 48
    (1, 2, 1, 100, 12, 64, None, "bfloat16"),  # split 500: 5 blocks of 100
    (2, 64, 8, 32, 70, 64, None, "float32"),
    (1, 5, 5, 2, 64, 96, 256, "float32"),
    (2, 4, 2, 16, 256, 32, None, "bfloat16"),  # 4096 positions per sequence
]


def _case(rng, b, n_heads, n_kv, block_len, max_blocks, d, dt, shared=0):
    """Random q, a pool of 2 spare blocks beyond the tables' needs, tables drawn from it (the first `shared`
    entries of every row the same blocks), lengths with the first full and the last 1."""
    n_blocks = b * max_blocks + 2
    q = rng.standard_normal((b, n_heads, d)).astype(dt)
    k = rng.standard_normal((n_blocks, n_kv, block_len, d)).astype(dt)
    v = rng.standard_normal((n_blocks, n_kv, block_len, d)).astype(dt)
    tables = rng.permutation(n_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    tables[:, :shared] = tables[0, :shared]
    lengths = rng.integers(1, max_blocks * block_len + 1, size=b)
    lengths[0] = max_blocks * block_len
    if b > 1:
        lengths[-1] = 1
    return q, k, v, tables, lengths


@pytest.mark.parametrize("b,n_heads,n_kv,block_len,max_blocks,d,split,dtype", CASES)
def test_matches_reference(b, n_heads, n_kv, block_len, max_blocks, d, split, dtype):
    rng = np.random.default_rng(max_blocks * 31 + block_len * 7 + d + b)
    q, k, v, tables, lengths = _case(rng, b, n_heads, n_kv, block_len, max_blocks, d, DTYPES[dtype],
                                     shared=max_blocks // 3)
    out = decode_attention.run_paged(q, k, v, tables, lengths, split_size=split)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = paged_decode_attention_ref(q, k, v, tables, lengths)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("b,n_heads,n_kv,block_len,max_blocks,d,split,dtype", [
    (2, 4, 2, 16, 10, 64, None, "float32"),
    (1, 8, 1, 8, 300, 128, None, "float32"),  # 3 splits, the last one short
    (2, 6, 3, 8, 129, 64, None, "bfloat16"),
])
def test_soft_capped_scores_match_reference(b, n_heads, n_kv, block_len, max_blocks, d, split, dtype):
    """cap * tanh(x / cap) on the scaled scores (Gemma 2), read through the block table: scale 1 and a cap of 2
    change the result (checked on the reference)."""
    rng = np.random.default_rng(max_blocks * 3 + d)
    q, k, v, tables, lengths = _case(rng, b, n_heads, n_kv, block_len, max_blocks, d, DTYPES[dtype],
                                     shared=max_blocks // 3)
    out = decode_attention.run_paged(q, k, v, tables, lengths, split_size=split, softmax_scale=1.0, softcap=2.0)
    ref = paged_decode_attention_ref(q, k, v, tables, lengths, softmax_scale=1.0, softcap=2.0)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])
    uncapped = paged_decode_attention_ref(q, k, v, tables, lengths, softmax_scale=1.0)
    assert np.abs(uncapped[0] - ref[0]).max() > 0.1


def test_paged_equals_the_contiguous_kernel_on_the_same_cache():
    """The same positions as a contiguous cache and as blocks: both kernels agree (fp32)."""
    rng = np.random.default_rng(3)
    b, n_kv, bl, mb, d = 2, 2, 16, 20, 64
    q = rng.standard_normal((b, 8, d)).astype(np.float32)
    kc = rng.standard_normal((b, n_kv, mb * bl, d)).astype(np.float32)
    vc = rng.standard_normal((b, n_kv, mb * bl, d)).astype(np.float32)
    lengths = np.array([mb * bl, 77])
    order = rng.permutation(b * mb)  # block i of sequence s lives at pool slot order[s * mb + i]
    tables = order.reshape(b, mb).astype(np.int32)
    pool = {name: np.empty((b * mb, n_kv, bl, d), np.float32) for name in "kv"}
    for name, c in (("k", kc), ("v", vc)):
        pool[name][tables.ravel()] = c.reshape(b, n_kv, mb, bl, d).transpose(0, 2, 1, 3, 4).reshape(-1, n_kv, bl, d)
    paged = decode_attention.run_paged(q, pool["k"], pool["v"], tables, lengths)
    contiguous = decode_attention.run(q, kc, vc, lengths, split_size=256)
    np.testing.assert_allclose(paged, contiguous, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(paged, decode_attention_ref(q, kc, vc, lengths), atol=1e-4, rtol=1e-4)


def test_blocks_past_the_length_are_ignored():
    """Table entries past a sequence's length point at blocks of huge values (another sequence's, or padding):
    they are read and masked, never mixed in."""
    rng = np.random.default_rng(5)
    q, k, v, tables, _ = _case(rng, 2, 4, 2, 8, 40, 32, np.float32)
    lengths = np.array([70, 200])
    for i, n in enumerate(lengths):
        past = tables[i, -(-n // 8):]
        k[past] = 1e4
        v[past] = 1e6
        k[tables[i, n // 8], :, n % 8:] = 1e4  # the rest of the partly used block
        v[tables[i, n // 8], :, n % 8:] = 1e6
    out = decode_attention.run_paged(q, k, v, tables, lengths)
    np.testing.assert_allclose(out, paged_decode_attention_ref(q, k, v, tables, lengths), atol=1e-4, rtol=1e-4)
    assert np.abs(out).max() < 10


def test_argument_errors_are_specific():
    q = np.zeros((2, 4, 32), np.float32)
    kv = np.zeros((10, 2, 16, 32), np.float32)
    tables = np.arange(8, dtype=np.int32).reshape(2, 4)
    lengths = np.array([64, 3])
    decode_attention.run_paged(q, kv, kv, tables, lengths)  # the valid call
    with pytest.raises(KernelArgumentError, match=r"block table entries .* \[0, num_blocks=10\)"):
        decode_attention.run_paged(q, kv, kv, np.where(tables == 7, 10, tables), lengths)
    with pytest.raises(KernelArgumentError, match="block table entries"):
        decode_attention.run_paged(q, kv, kv, np.where(tables == 7, -1, tables), lengths)
    with pytest.raises(KernelArgumentError, match=r"lengths must be .* \[1, max_blocks \* block_len=64\]"):
        decode_attention.run_paged(q, kv, kv, tables, np.array([65, 3]))
    with pytest.raises(KernelArgumentError, match="whole number of blocks"):
        decode_attention.run_paged(q, kv, kv, tables, lengths, split_size=520)
    with pytest.raises(KernelArgumentError, match="at most 128 of them"):
        decode_attention.run_paged(q, np.zeros((10, 2, 2, 32), np.float32), np.zeros((10, 2, 2, 32), np.float32),
                                   tables, np.array([8, 3]), split_size=512)
    wide = np.zeros((10, 2, 128, 32), np.float32)  # 128-position blocks with G = 8: 1024 score columns > 512
    with pytest.raises(KernelArgumentError, match=r"block_len \* G = 128 \* 8 > 512"):
        decode_attention.run_paged(np.zeros((2, 16, 32), np.float32), wide, wide, tables, lengths)
    with pytest.raises(KernelArgumentError, match="do not match"):
        decode_attention.run_paged(q, kv, kv, tables[:1], lengths)
    with pytest.raises(KernelArgumentError, match="share float32 or bfloat16"):
        decode_attention.run_paged(q.astype(ml_dtypes.bfloat16), kv, kv, tables, lengths)


def test_default_split_is_128_blocks_up_to_4096_positions():
    split = decode_attention.default_paged_split
    assert [split(bl) for bl in (1, 8, 16, 32, 128)] == [128, 1024, 2048, 4096, 4096]
    assert [split(bl) for bl in (3, 24, 48, 100, 8192)] == [384, 3072, 4080, 4000, 8192]  # whole blocks


def test_splits_are_rolled_loops_so_the_program_does_not_grow_with_the_cache():
    """Whole splits are one affine_range loop (the simulator checks its iterations are independent); the
    merge is unrolled, one instruction per split."""
    reps = {s: decode_attention.estimate_paged(1, 4, 1, s, 128, block_len=16) for s in (4096, 32768)}
    extra_splits = (32768 - 4096) // decode_attention.default_paged_split(16)
    assert reps[32768].static_instructions - reps[4096].static_instructions <= 2 * extra_splits
    dyn = {s: sum(e.instructions for e in r.engines.values()) for s, r in reps.items()}
    assert dyn[32768] > 6 * dyn[4096]


def test_each_block_is_one_dma_descriptor_per_partition():
    """K and V of a block (block_len * D contiguous elements) land on one partition as one run: per program,
    2 descriptors per block, and the table row is one."""
    b, n_kv, s, bl = 2, 2, 4096, 16
    rep = decode_attention.estimate_paged(b, 8, n_kv, s, 64, block_len=bl)
    blocks = b * n_kv * (s // bl)
    programs = b * n_kv
    # K and V gathers, the table row, q (G rows) and lengths per program, the output store (G rows)
    assert rep.dma_descriptors == 2 * blocks + programs * (1 + 4 + 1 + 4)
