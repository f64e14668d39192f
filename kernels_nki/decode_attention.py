"""Decode attention (one new token per sequence) against a KV cache, flash-decoding split, legacy NKI API.

Dimensions:
    B batch, n_heads query heads, n_kv_heads KV heads, G = n_heads // n_kv_heads query heads per KV head,
    S_max cache capacity, D head dim <= 128, lengths[b] in [1, S_max] valid positions of sequence b.

Kernel layouts (HBM):
    q        `[B, n_kv_heads, G, D]`      the G query heads of one KV group (transposed on chip to [D, G])
    k_t      `[B, n_kv_heads, D, S_max]`  K cache stored transposed, so score tiles need no transpose
    v        `[B, n_kv_heads, S_max, D]`  V cache, positions of each full K chunk in partition-run order
                                          (`v_kernel_layout`), the cache's tail chunk natural
    lengths  `[B, 1]` int32
    out      `[B, n_kv_heads, G, D]`
    `run(...)` takes `[B, n_heads, D]` queries and `[B, n_kv_heads, S_max, D]` caches and converts.

V's order: a P @ V matmul contracts 128 positions of one split over the partitions, and a DMA descriptor moves one
contiguous HBM run into one partition. Partition q takes, for split i of a K chunk, the n = split_size / 128
positions i * split_size + q * n + j (j < n); in natural order those are n rows (2 KiB at split 1024, D 128, bf16),
one descriptor per split and partition. `v_kernel_layout` stores the chunk's positions partition-major, so
partition q's rows of all the chunk's splits are one run (8 KiB at K_LOAD 4096): a quarter of the descriptors.
The caller lays V out so (the device path in its graph, as it transposes K).

Launch: SPMD grid `[B, n_kv_heads]`. All G query heads of a KV group are processed together: they are the
free dim of the stationary operand (`[D, G]`), so each K/V tile is read from HBM once per group.

Flash-decoding: the cache is cut into splits of `split_size` positions. Each split computes, independently
of the others, its partial row max m_s, partial sum l_s = sum exp(scale*(x - m_s)) and unnormalised output
o_s = sum exp(scale*(x - m_s)) v; the splits are merged at the end:
    M = max_s m_s,  w_s = exp(scale*(m_s - M)),  out = sum_s w_s o_s / sum_s w_s l_s.
Independent splits carry no loop dependency (unlike a running online softmax), so the compiler may overlap
them; the same partials are what a sequence-sharded (multi-core) decode would exchange.

Length mask: positions >= lengths[b] get at most -1e30 added to their scores. On one partition,
past = max(pos - len + 1, 0) (GpSimd: an iota and one tensor_scalar) is 0 for valid positions and >= 1 past the
length; a second matmul accumulating into the score PSUM tile adds NEG * past to each of the G rows
(stationary = a [1, G] row of NEG), the TensorE partition-broadcast idiom. Scores stay in PSUM: VectorE
takes the row max and ScalarE the exp and the P^T copies straight from there (GpSimd cannot read PSUM, so it
takes the SBUF-only mask; on ScalarE the mask cost as much as the exp). A split entirely past the length gets
m_s <= -1e30 and merge weight exactly 0.

Loops: the full K chunks (K_LOAD / split_size whole splits each) and the splits inside one are
`nl.affine_range` loops (independent until the merge, identical bodies: the compiler keeps them rolled); the
cache's tail chunk and a short last split are peeled as static code, and the merge is unrolled (one
instruction per split). The compiled program is 62 instructions at S_max = 4096 and 90 at 32768 (split 1024).

Pseudocode (per program = (b, kv head)):
    q^T = transpose(q[b, kvh])                                   # [D, G], TensorE
    for split s: (every K_LOAD / split_size splits: K^T of those splits in one DMA)
        for tile [k0, k0 + w) (w <= 512):
            sc[:, tile] = q^T K^T[:, tile] + NEG^T max(k0 + iota - len + 1, 0)  # PSUM [G, w]
        m_s = rowmax(sc);  p[:, split] = exp(scale*sc - scale*m_s) (rowsum -> l_s)
        V of the K chunk in one DMA as [128, splits * n, D] (one contiguous run per partition, see V's order),
        split i's positions q*n .. q*n + n - 1 on partition q;
        for chunk j: o_s += transpose(p[:, j::n])^T @ V[:, i*n + j]
    merge as above; store [G, D].

Paged variant (`paged_decode_attention_kernel`, `run_paged`): the caches are block pools
`[num_blocks, n_kv_heads, block_len, D]` read through `block_tables [B, max_blocks]`. A split is
split_size / block_len <= 128 blocks; one indirect DMA each gathers its K and its V blocks (partition q <- the
q-th block of the split), which is V's partition-run order with n = block_len; K^T is built by block_len TensorE
transposes of `[blocks, D]` copied to every block_len-th column. Then `_split` as above.

DMA descriptors (one per contiguous HBM run landing in one partition) cost queue time in the cost model, so
every load moves long runs: K^T rows of up to K_LOAD positions, V runs of a K chunk's splits, q rows of D.

Constraints: D <= 128, G <= 128, split_size a multiple of 128 and, above 512, of 512, at most 3584 (a split's
scores take split_size / 512 PSUM banks, the P @ V accumulator one more, of 8); q and caches share float32 or
bfloat16; lengths[b] >= 1. All splits up to S_max are computed (lengths are runtime data). Every split's fp32
partial output and statistics stay in SBUF until the merge: about n_splits * (D + 4) * 4 bytes per partition
plus the working set (`sbuf_bytes`), so S_max <= 33536 for D = 128 and split_size = 128 on trn1
(`max_cache_len`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kernels_nki._nki import DEFAULT_TARGET, nisa, nki, nl, sbuf_capacity, simulate
from neuron_opt.errors import KernelArgumentError
from neuron_opt.nki_sim import get_target

P_CHUNK = 128  # positions per P@V matmul (contraction on partitions)
K_TILE = 512  # positions per score matmul (one PSUM bank of fp32)
NEG = -1.0e30  # added to scores of positions past the length
K_LOAD = 4096  # positions of K^T per DMA (whole splits): 8 KiB per partition in bf16, long DMA descriptors
# SBUF bytes per partition for the small tiles (positions, P^T, row maxes and sums, the queries), with margin;
# the K^T chunk, P and V of a split come on top (`sbuf_bytes`).
SBUF_WORKING_SET = 8 * 1024


@nki.jit
def decode_attention_kernel(q, k_t, v, lengths, softmax_scale=1.0, split_size=1024):
    """Launch as `decode_attention_kernel[B, n_kv_heads](q, k_t, v, lengths, softmax_scale=..., ...)`."""
    n_b, n_kv, g, d = q.shape
    s_max = k_t.shape[3]
    out = nl.ndarray((n_b, n_kv, g, d), dtype=q.dtype, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    kvh = nl.program_id(1)
    mm_dtype = q.dtype
    tile = min(K_TILE, split_size)
    n_splits = (s_max + split_size - 1) // split_size
    per_k = _splits_per_k_load(split_size)

    q_sb, one_minus_len, neg_row = _prologue(q, lengths, b, kvh, g, mm_dtype)

    m_all, l_all, o_all = _partials(g, n_splits, d)
    args = (q_sb, one_minus_len, neg_row, v, b, kvh, m_all, l_all, o_all, tile, d, softmax_scale, mm_dtype)
    chunk = per_k * split_size  # K^T positions per DMA: [D, chunk], whole splits
    n_kc = s_max // chunk
    n = split_size // P_CHUNK  # V rows per partition and split
    for kc in nl.affine_range(n_kc):  # full chunks: independent, identical bodies (rolled)
        k_sb = nl.load(k_t[b, kvh, :, kc * chunk:(kc + 1) * chunk])
        # the chunk's V in partition-run order: one descriptor per partition (`v_kernel_layout`)
        i_p, i_c, i_d = nl.mgrid[0:P_CHUNK, 0:per_k * n, 0:d]
        v_sb = nl.load(v[b, kvh, kc * chunk + i_p * (per_k * n) + i_c, i_d])
        for i in nl.affine_range(per_k):  # the chunk's splits, independent until the merge
            _split(kc * per_k + i, kc * chunk, i * split_size, split_size, k_sb, v_sb, i * n, *args)
    rest = s_max - n_kc * chunk
    if rest:  # the cache's tail chunk, peeled: fewer splits, maybe a short last one
        c0 = n_kc * chunk
        k_sb = nl.load(k_t[b, kvh, :, c0:s_max])
        n_sp = rest // split_size
        for i in nl.affine_range(n_sp):
            _split(n_kc * per_k + i, c0, i * split_size, split_size, k_sb, None, 0, *args)
        if rest % split_size:
            _split(n_kc * per_k + n_sp, c0, n_sp * split_size, rest % split_size, k_sb, None, 0, *args)

    _merge(m_all, l_all, o_all, n_splits, d, softmax_scale, out, b, kvh)
    return out


@nki.jit
def paged_decode_attention_kernel(q, k_cache, v_cache, block_tables, lengths, softmax_scale=1.0, split_size=2048):
    """Decode attention reading the KV cache through a block table (`run_paged`). Launch as
    `paged_decode_attention_kernel[B, n_kv_heads](q, k_cache, v_cache, block_tables, lengths, ...)`.

    k_cache / v_cache `[num_blocks, n_kv_heads, block_len, D]`, block_tables `[B, max_blocks]` int32 (entry i:
    the cache block of the sequence's positions [i * block_len, (i + 1) * block_len)). A split is
    nb = split_size / block_len blocks: their K and V rows are gathered by one indirect DMA each (partition q
    <- block table[b, s * nb + q], one block_len * D run), which lands V exactly as the P @ V matmuls contract
    it (partition q: nb positions' worth of runs, as `v_kernel_layout`'s); K is turned to K^T [D, split] by
    block_len TensorE transposes of [nb, D], each copied (VectorE) to every block_len-th column, natural
    position order. Then the split is `_split`'s, as in `decode_attention_kernel`.
    """
    n_b, n_kv, g, d = q.shape
    block_len = k_cache.shape[2]
    max_blocks = block_tables.shape[1]
    out = nl.ndarray((n_b, n_kv, g, d), dtype=q.dtype, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    kvh = nl.program_id(1)
    mm_dtype = q.dtype
    tile = min(K_TILE, split_size)
    nb = split_size // block_len  # blocks per split (<= 128: one per partition)
    n_splits = (max_blocks + nb - 1) // nb
    n_full = max_blocks // nb

    q_sb, one_minus_len, neg_row = _prologue(q, lengths, b, kvh, g, mm_dtype)
    # the table row in one DMA (one run) onto one partition, as fp32 (block ids < 2^24 are exact) so that each
    # split can turn its nb entries to one per partition with a TensorE transpose (`_paged_split`)
    tbl = nisa.tensor_copy(nl.load(block_tables[nl.ds(b, 1), :]), dtype=nl.float32)  # [1, max_blocks]

    m_all, l_all, o_all = _partials(g, n_splits, d)
    args = (q_sb, one_minus_len, neg_row, v_cache, b, kvh, m_all, l_all, o_all, tile, d, softmax_scale, mm_dtype)
    for sp in nl.affine_range(n_full):  # whole splits: independent, identical bodies (rolled)
        _paged_split(sp, sp * nb, nb, block_len, tbl, k_cache, *args)
    if n_full < n_splits:  # the table's tail: fewer blocks, peeled
        _paged_split(n_full, n_full * nb, max_blocks - n_full * nb, block_len, tbl, k_cache, *args)

    _merge(m_all, l_all, o_all, n_splits, d, softmax_scale, out, b, kvh)
    return out


def _paged_split(sp, first, nb, block_len, tbl, k_cache, q_sb, one_minus_len, neg_row, v_cache, b, kvh, m_all, l_all,
                 o_all, tile, d, softmax_scale, mm_dtype):
    """Split `sp` of a paged cache: table entries [first, first + nb) gathered (K and V), K^T built, then
    `_split`."""
    sw = nb * block_len
    # [nb, 1] int32: the split's cache blocks, one per partition (the indirect DMAs' offsets)
    idx = nisa.tensor_copy(nisa.nc_transpose(tbl[0:1, first:first + nb]), dtype=nl.int32)
    k_blk = nl.load(k_cache[idx, kvh, :, :])  # [nb, block_len, D]: partition q <- block idx[q]
    v_blk = nl.load(v_cache[idx, kvh, :, :])  # the same for V: chunk j of partition q is position q * bl + j
    k_t = nl.ndarray((d, sw), dtype=mm_dtype, buffer=nl.sbuf)
    for j in nl.static_range(block_len):  # position j of every block -> columns j, j + bl, ... (natural order)
        # PSUM -> SBUF on VectorE (ScalarE has the exp and the P^T copies; alternating them was slower: 897 us
        # against 723 at B 8, KV 4096, blocks of 16, as the P^T copies then wait behind them)
        k_t[:, j:sw:block_len] = nisa.tensor_copy(nisa.nc_transpose(k_blk[:, j, :]), dtype=mm_dtype)
    _split(sp, first * block_len, 0, sw, k_t, v_blk, 0, q_sb, one_minus_len, neg_row, v_cache, b, kvh, m_all,
           l_all, o_all, tile, d, softmax_scale, mm_dtype, v_parts=nb)


def _prologue(q, lengths, b, kvh, g, mm_dtype):
    """(q^T [D, G], 1 - len [1, 1], the NEG row [1, G]) of program (b, kvh).

    q comes as [G, D], one descriptor per head, and is transposed on TensorE to the [D, G] stationary operand
    (loading [D, G] directly would cost one descriptor of G elements per partition)."""
    q_sb = nl.copy(nisa.nc_transpose(nl.load(q[b, kvh])), dtype=mm_dtype)
    len_f = nisa.tensor_copy(nl.load(lengths[nl.ds(b, 1), :]), dtype=nl.float32)  # [1, 1]
    one_minus_len = nl.multiply(nl.add(len_f, -1.0), -1.0)  # [1, 1]: 1 - len
    neg_row = nl.full((1, g), NEG, dtype=mm_dtype, buffer=nl.sbuf)
    return q_sb, one_minus_len, neg_row


def _partials(g, n_splits, d):
    """Every split's fp32 row max and row sum `[G, n_splits]` and unnormalised output `[G, n_splits * D]`, in
    SBUF until `_merge`."""
    m_all = nl.ndarray((g, n_splits), dtype=nl.float32, buffer=nl.sbuf)
    l_all = nl.ndarray((g, n_splits), dtype=nl.float32, buffer=nl.sbuf)
    o_all = nl.ndarray((g, n_splits * d), dtype=nl.float32, buffer=nl.sbuf)
    return m_all, l_all, o_all


def _merge(m_all, l_all, o_all, n_splits, d, softmax_scale, out, b, kvh):
    """Merge the splits' partial softmax results (columns of m_all / l_all, D-wide blocks of o_all) and store
    out[b, kvh]."""
    g = m_all.shape[0]
    m_glob = nisa.tensor_reduce(nl.maximum, m_all, axis=(1,), keepdims=True)  # [G, 1]
    wts = nisa.activation(nl.exp, m_all, bias=nl.multiply(m_glob, -softmax_scale), scale=softmax_scale)
    l_glob = nisa.tensor_reduce(nl.add, nl.multiply(wts, l_all), axis=(1,), keepdims=True)  # [G, 1]
    acc = nl.ndarray((g, d), dtype=nl.float32, buffer=nl.sbuf)
    acc[...] = nl.multiply(o_all[:, 0:d], wts[:, 0:1])
    for sp in nl.static_range(1, n_splits):
        acc[...] = nisa.scalar_tensor_tensor(data=o_all[:, sp * d:(sp + 1) * d], op0=nl.multiply,
                                             operand0=wts[:, sp:sp + 1], op1=nl.add, operand1=acc)
    res = nl.multiply(acc, nisa.reciprocal(l_glob), dtype=out.dtype)
    nl.store(out[b, kvh], value=res)


def _split(sp, c0, k_off, sw, k_sb, v_sb, v_off, q_sb, one_minus_len, neg_row, v, b, kvh, m_all, l_all, o_all,
           tile, d, softmax_scale, mm_dtype, v_parts=P_CHUNK):
    """Split `sp`: positions [c0 + k_off, c0 + k_off + sw), keys in `k_sb` (K^T from c0) at column k_off, values
    in `v_sb` from chunk `v_off` (a full K chunk's, partition-run order, or a split's gathered cache blocks) or,
    when `v_sb` is None, loaded here from the natural tail.

    `v_sb` given: its `v_parts` partitions each hold sw / v_parts consecutive positions of the split (chunk j of
    partition q: position q * sw / v_parts + j), 128 for a K chunk's runs, the number of blocks for gathered
    cache blocks.

    Writes the split's row max, row sum and unnormalised output into column sp of m_all / l_all / o_all.
    """
    g = q_sb.shape[1]
    s0 = c0 + k_off
    n_t = (sw + tile - 1) // tile
    s_ps = nl.ndarray((n_t, nl.par_dim(g), tile), dtype=nl.float32, buffer=nl.psum)  # scores stay in PSUM
    # The tile maxes go to PSUM: VectorE then reads and writes PSUM only and leaves the SBUF port, which on
    # NeuronCore-v2 it shares with GpSimd (the masks), free.
    mx = nl.ndarray((g, n_t), dtype=nl.float32, buffer=nl.psum)
    for t in nl.static_range(n_t):
        k0 = s0 + t * tile
        w = min(tile, s0 + sw - k0)
        pos = nisa.iota(k0 + nl.arange(w)[None, :], dtype=nl.float32)  # [1, w] positions
        # max(pos - len + 1, 0): 0 where pos < len, >= 1 past it (GpSimd: SBUF only); times the NEG row below.
        past = nisa.tensor_scalar(pos, nl.add, one_minus_len, op1=nl.maximum, operand1=0.0, dtype=mm_dtype,
                                  engine=nisa.gpsimd_engine)
        s_ps[t, :, 0:w] = nisa.nc_matmul(q_sb, k_sb[:, k_off + t * tile:k_off + t * tile + w])  # [G, w]
        s_ps[t, :, 0:w] += nisa.nc_matmul(neg_row, past)  # + NEG * past, broadcast to the G rows
        mx[:, t:t + 1] = nisa.tensor_reduce(nl.maximum, s_ps[t, :, 0:w], axis=(1,), keepdims=True)
    m_s = m_all[:, sp:sp + 1]
    m_s[...] = nisa.tensor_reduce(nl.maximum, mx, axis=(1,), keepdims=True) if n_t > 1 else mx
    nbias = nisa.activation(nl.copy, m_s, scale=-softmax_scale)  # -scale * m_s
    ls = nl.ndarray((g, n_t), dtype=nl.float32, buffer=nl.sbuf)
    p = nl.ndarray((g, sw), dtype=mm_dtype, buffer=nl.sbuf)  # P of the whole split
    for t in nl.static_range(n_t):
        w = min(tile, sw - t * tile)
        p[:, t * tile:t * tile + w] = nisa.activation_reduce(
            nl.exp, s_ps[t, :, 0:w], reduce_op=nl.add, reduce_res=ls[:, t:t + 1], bias=nbias,
            scale=softmax_scale, dtype=mm_dtype)  # [G, w]
    if v_sb is None:
        v_sb, n_full = _load_v(v, b, kvh, s0, sw)
    else:
        n_full = sw // v_parts  # sw is a multiple of v_parts: runs of n_full positions, no tail
    o_ps = nl.ndarray((g, d), dtype=nl.float32, buffer=nl.psum)
    for j in nl.static_range(n_full + (1 if sw % P_CHUNK and v_parts == P_CHUNK else 0)):
        if j < n_full:  # chunk j holds positions s0 + q * n_full + j on partition q: P columns j::n_full
            cols, cw = p[:, j:n_full * v_parts:n_full], v_parts
        else:  # the tail chunk: positions s0 + n_full * 128 + q
            cols, cw = p[:, n_full * P_CHUNK:sw], sw - n_full * P_CHUNK
        # PSUM -> SBUF copy on ScalarE: VectorE has the row maxes, GpSimd the masks (it cannot read PSUM)
        pt = nisa.activation(nl.copy, nisa.nc_transpose(cols), dtype=mm_dtype)  # [cw, G]
        if j == 0:
            o_ps[...] = nisa.nc_matmul(pt, v_sb[0:cw, v_off + j, :])  # [G, D]
        else:
            o_ps[...] += nisa.nc_matmul(pt, v_sb[0:cw, v_off + j, :])
    l_all[:, sp:sp + 1] = nisa.tensor_reduce(nl.add, ls, axis=(1,), keepdims=True) if n_t > 1 else ls
    o_all[:, sp * d:(sp + 1) * d] = nl.copy(o_ps)


def _load_v(v, b, kvh, k0, w):
    """V rows [k0, k0 + w) as `[128, ceil(w / 128), D]`, and the number of full chunks `full`.

    Partition q holds positions k0 + q * full + j (j < full): `full` consecutive rows of V, one contiguous
    run of full * D elements per partition, so the DMA moves few large descriptors (one per partition). The
    tail (w % 128 positions) is chunk `full`, position k0 + full * 128 + q on partition q, in a second DMA.
    """
    d = v.shape[3]
    n_ch = (w + P_CHUNK - 1) // P_CHUNK
    full = w // P_CHUNK
    v_sb = nl.ndarray((P_CHUNK, n_ch, d), dtype=v.dtype, buffer=nl.sbuf)
    if full:
        i_p, i_c, i_d = nl.mgrid[0:P_CHUNK, 0:full, 0:d]
        v_sb[:, 0:full, :] = nl.load(v[b, kvh, k0 + i_p * full + i_c, i_d])
    if w % P_CHUNK:
        v_sb[0:w % P_CHUNK, full, :] = nl.load(v[b, kvh, k0 + full * P_CHUNK:k0 + w, :])
    return v_sb, full


def _check(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray,
           split_size: int) -> None:
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise KernelArgumentError(f"decode_attention: want q [B, n_heads, D], caches "
                                  f"[B, n_kv_heads, S_max, D]; "
                                  f"got q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    b, n_heads, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or n_heads % k_cache.shape[1]:
        raise KernelArgumentError(f"decode_attention: caches {k_cache.shape} do not match q {q.shape}")
    _check_heads_and_dtypes("decode_attention", q, k_cache, v_cache)
    if lengths.shape != (b,) or lengths.min() < 1 or lengths.max() > k_cache.shape[2]:
        raise KernelArgumentError(f"decode_attention: lengths must be [B]={b} values in [1, S_max="
                                  f"{k_cache.shape[2]}]; got {lengths.tolist()}")
    max_split = (get_target(DEFAULT_TARGET).psum_banks - 1) * K_TILE
    if split_size % P_CHUNK or (split_size > K_TILE and split_size % K_TILE) or split_size > max_split:
        raise KernelArgumentError(f"decode_attention: split_size {split_size} must be a multiple of 128 "
                                  f"(and of 512 above 512), at most {max_split} (its scores stay in PSUM)")
    _check_sbuf(k_cache.shape[2], d, split_size, DEFAULT_TARGET)


def _check_heads_and_dtypes(what: str, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    """Both kernels' limits on q `[B, n_heads, D]` and caches whose dim 1 is the KV heads: D and the query heads
    per KV head at most 128 (partitions), q and caches one dtype, float32 or bfloat16."""
    d, g = q.shape[2], q.shape[1] // k_cache.shape[1]
    if d > 128 or g > 128:
        raise KernelArgumentError(f"{what}: need D <= 128 and <= 128 query heads per KV head; got D={d}, G={g}")
    if not q.dtype == k_cache.dtype == v_cache.dtype or q.dtype.name not in ("float32", "bfloat16"):
        raise KernelArgumentError(f"{what}: q and caches must share float32 or bfloat16; got "
                                  f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")


def _splits_per_k_load(split_size: int) -> int:
    return max(1, K_LOAD // split_size)


def sbuf_bytes(s_max: int, d: int, split_size: int) -> int:
    """SBUF bytes per partition one program holds at its peak, counted as the simulator's allocator does.

    The allocator charges a tile the bytes of its free dims in every partition: the per-split maxes and sums
    `[G, n_splits]` and outputs `[G, n_splits * D]`, all fp32, plus the merge's weights and weighted sums (two
    more `[G, n_splits]`) cost n_splits * (D + 4) * 4; the K^T and V of a K chunk (`K_LOAD` positions, whole
    splits; V as `[128, positions / 128, D]`) and a split's P `[G, split]` at most 4 bytes each per position;
    then `SBUF_WORKING_SET`.
    """
    n_splits = (s_max + split_size - 1) // split_size
    return n_splits * (d + 4) * 4 + _split_bytes(min(s_max, split_size), split_size) + SBUF_WORKING_SET


def _split_bytes(sw: int, split_size: int) -> int:
    return 4 * (2 * _splits_per_k_load(split_size) * split_size + sw)


def _chunking(s_max: int, split_size: int) -> tuple[int, int]:
    """(positions per full K chunk, number of full K chunks) of a cache."""
    chunk = _splits_per_k_load(split_size) * split_size
    return chunk, s_max // chunk


def v_kernel_layout(v: Any, split_size: int) -> Any:
    """V `[B, n_kv_heads, S_max, D]` (numpy or torch) in the kernel's row order: within each full K chunk,
    partition q's rows of every split (split i, row j: position i * split_size + q * n + j, n = split_size / 128)
    are consecutive, a reshape and a transpose; the tail past the last full chunk stays in order."""
    b, n_kv, s_max, d = v.shape
    chunk, n_kc = _chunking(s_max, split_size)
    if not n_kc:
        return v
    per_k, n = chunk // split_size, split_size // P_CHUNK
    cut = n_kc * chunk
    head = v[:, :, :cut].reshape(b, n_kv, n_kc, per_k, P_CHUNK, n, d).swapaxes(3, 4).reshape(b, n_kv, cut, d)
    if cut == s_max:
        return head
    if isinstance(v, np.ndarray):
        return np.concatenate([head, v[:, :, cut:]], axis=2)
    import torch

    return torch.cat([head, v[:, :, cut:]], dim=2)


def max_cache_len(d: int, split_size: int, target: str = DEFAULT_TARGET) -> int:
    """Longest S_max whose `sbuf_bytes` fit the SBUF a kernel may use on `target`."""
    room = sbuf_capacity(target) - SBUF_WORKING_SET - _split_bytes(split_size, split_size)
    return room // ((d + 4) * 4) * split_size


def _check_sbuf(s_max: int, d: int, split_size: int, target: str) -> None:
    need, cap = sbuf_bytes(s_max, d, split_size), sbuf_capacity(target)
    if need > cap:
        raise KernelArgumentError(f"decode_attention: S_max={s_max} with split_size={split_size} and D={d} needs "
                                  f"{need} SBUF bytes per partition (each split's fp32 output and statistics "
                                  f"stay resident until the merge), more than the {cap} a kernel may use on "
                                  f"{target}; S_max <= {max_cache_len(d, split_size, target)} fits, or raise "
                                  f"split_size")


def run(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray, *,
        softmax_scale: float | None = None, split_size: int = 1024) -> np.ndarray:
    """Runs the kernel on logical layouts (simulator here, the SDK's NKI where installed).

    Args:
        q: `[B, n_heads, D]`, float32 or bfloat16.
        k_cache: `[B, n_kv_heads, S_max, D]`, same dtype.
        v_cache: `[B, n_kv_heads, S_max, D]`, same dtype.
        lengths: `[B]` integers in [1, S_max].
        softmax_scale: Defaults to `1 / sqrt(D)`.
        split_size: Cache positions per flash-decoding split.

    Returns:
        `[B, n_heads, D]` in q's dtype.

    Raises:
        KernelArgumentError: Shapes, dtypes or lengths the kernel does not support, or a cache too long for
            SBUF at this split_size on the simulator's default target (`max_cache_len`).
    """
    lengths = np.asarray(lengths)
    _check(q, k_cache, v_cache, lengths, split_size)
    b, n_heads, d = q.shape
    n_kv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    q_g = np.ascontiguousarray(q.reshape(b, n_kv, n_heads // n_kv, d))  # [B, n_kv_heads, G, D]
    k_t = np.ascontiguousarray(k_cache.transpose(0, 1, 3, 2))  # [B, n_kv_heads, D, S_max]
    lens = lengths.astype(np.int32).reshape(b, 1)  # [B, 1]
    v_k = np.ascontiguousarray(v_kernel_layout(v_cache, split_size))  # rows in the kernel's order
    out = simulate(decode_attention_kernel[b, n_kv], q_g, k_t, v_k, lens,
                   softmax_scale=scale, split_size=split_size)
    return np.asarray(out).reshape(b, n_heads, d)  # [B, n_kv, G, D] -> [B, n_heads, D]


def default_paged_split(block_len: int) -> int:
    """Positions per split: as many whole blocks as fit in 128 (one per partition) and 2048 positions, a multiple
    of 512 above 512 (the PSUM rule; 1536 for blocks of 24 or 48), else at most 512 positions."""
    cap = min(P_CHUNK * block_len, 2048)
    step = math.lcm(block_len, K_TILE)
    if cap >= step:
        return cap // step * step
    return max(block_len, min(cap, K_TILE) // block_len * block_len)


def _check_paged(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                 lengths: np.ndarray, split_size: int) -> None:
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape or block_tables.ndim != 2:
        raise KernelArgumentError(f"paged decode_attention: want q [B, n_heads, D], caches [num_blocks, "
                                  f"n_kv_heads, block_len, D], block_tables [B, max_blocks]; got q {q.shape}, "
                                  f"k {k_cache.shape}, v {v_cache.shape}, tables {block_tables.shape}")
    b, n_heads, d = q.shape
    n_blocks, n_kv, block_len, dk = k_cache.shape
    if dk != d or n_heads % n_kv or block_tables.shape[0] != b:
        raise KernelArgumentError(f"paged decode_attention: caches {k_cache.shape} and tables "
                                  f"{block_tables.shape} do not match q {q.shape}")
    _check_heads_and_dtypes("paged decode_attention", q, k_cache, v_cache)
    if n_blocks > 1 << 24:  # the kernel moves block ids through fp32 (a TensorE transpose)
        raise KernelArgumentError(f"paged decode_attention: at most 2^24 cache blocks, got {n_blocks}")
    if block_tables.dtype.kind not in "iu" or block_tables.min() < 0 or block_tables.max() >= n_blocks:
        raise KernelArgumentError(f"paged decode_attention: block table entries must be integers in [0, "
                                  f"num_blocks={n_blocks}) (pad unused entries with any valid block: positions "
                                  f"past the length are masked); got {block_tables.dtype} in "
                                  f"[{block_tables.min()}, {block_tables.max()}]")
    s_max = block_tables.shape[1] * block_len
    if lengths.shape != (b,) or lengths.min() < 1 or lengths.max() > s_max:
        raise KernelArgumentError(f"paged decode_attention: lengths must be [B]={b} values in [1, max_blocks * "
                                  f"block_len={s_max}]; got {lengths.tolist()}")
    max_split = (get_target(DEFAULT_TARGET).psum_banks - 1) * K_TILE
    if (split_size % block_len or split_size // block_len > P_CHUNK or split_size > max_split
            or (split_size > K_TILE and split_size % K_TILE)):
        raise KernelArgumentError(f"paged decode_attention: split_size {split_size} must be a whole number of "
                                  f"blocks (block_len {block_len}), at most 128 of them (one per partition), at "
                                  f"most {max_split} positions (its scores stay in PSUM) and above 512 a multiple "
                                  f"of 512; default_paged_split({block_len}) = {default_paged_split(block_len)}")
    need, cap = paged_sbuf_bytes(s_max, d, block_len, split_size), sbuf_capacity(DEFAULT_TARGET)
    if need > cap:
        raise KernelArgumentError(f"paged decode_attention: {s_max} positions with split_size {split_size}, "
                                  f"block_len {block_len} and D={d} need {need} SBUF bytes per partition, more "
                                  f"than the {cap} a kernel may use on {DEFAULT_TARGET}")


def paged_sbuf_bytes(s_max: int, d: int, block_len: int, split_size: int) -> int:
    """SBUF bytes per partition of `paged_decode_attention_kernel` at its peak (as `sbuf_bytes` counts): the
    splits' partials, the table, a split's gathered K and V blocks (block_len * D each), its K^T and P
    (split_size each), at most 4 bytes an element, and `SBUF_WORKING_SET`."""
    n_splits = -(-s_max // split_size)
    return n_splits * (d + 4) * 4 + 8 * n_splits * split_size // block_len + 4 * (2 * block_len * d + 2 * split_size) \
        + SBUF_WORKING_SET


def run_paged(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
              lengths: np.ndarray, *, softmax_scale: float | None = None,
              split_size: int | None = None) -> np.ndarray:
    """Runs the paged kernel (simulator here, the SDK's NKI where installed).

    Args:
        q: `[B, n_heads, D]`, float32 or bfloat16.
        k_cache: `[num_blocks, n_kv_heads, block_len, D]`, same dtype.
        v_cache: `[num_blocks, n_kv_heads, block_len, D]`, same dtype.
        block_tables: `[B, max_blocks]` integers in [0, num_blocks); entry i holds the sequence's positions
            [i * block_len, (i + 1) * block_len). Entries past a sequence's length are read and masked.
        lengths: `[B]` integers in [1, max_blocks * block_len].
        softmax_scale: Defaults to `1 / sqrt(D)`.
        split_size: Positions per flash-decoding split, a whole number of blocks; `default_paged_split`.

    Returns:
        `[B, n_heads, D]` in q's dtype.

    Raises:
        KernelArgumentError: Shapes, dtypes, table entries, lengths or a split the kernel does not support.
    """
    lengths = np.asarray(lengths)
    block_tables = np.asarray(block_tables)
    split = default_paged_split(k_cache.shape[2]) if split_size is None else int(split_size)
    _check_paged(q, k_cache, v_cache, block_tables, lengths, split)
    b, n_heads, d = q.shape
    n_kv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    q_g = np.ascontiguousarray(q.reshape(b, n_kv, n_heads // n_kv, d))
    out = simulate(paged_decode_attention_kernel[b, n_kv], q_g, np.ascontiguousarray(k_cache),
                   np.ascontiguousarray(v_cache), np.ascontiguousarray(block_tables, dtype=np.int32),
                   lengths.astype(np.int32).reshape(b, 1), softmax_scale=scale, split_size=split)
    return np.asarray(out).reshape(b, n_heads, d)


def estimate_paged(b: int, n_heads: int, n_kv_heads: int, s_max: int, d: int, *, block_len: int = 16,
                   split_size: int | None = None, target: str = "trn1", dtype: Any = None) -> Any:
    """Count-only cost Report of the paged kernel for one decode step over `s_max` positions per sequence
    (s_max / block_len table entries each, blocks of a pool of B * that size)."""
    from neuron_opt import nki_sim

    dt = nl.bfloat16 if dtype is None else dtype
    split = default_paged_split(block_len) if split_size is None else split_size
    g = n_heads // n_kv_heads
    max_blocks = -(-s_max // block_len)
    n_blocks = b * max_blocks
    _, rep = nki_sim.simulate_kernel(paged_decode_attention_kernel[b, n_kv_heads],
                                     nki_sim.ShapeDtype((b, n_kv_heads, g, d), dt),
                                     nki_sim.ShapeDtype((n_blocks, n_kv_heads, block_len, d), dt),
                                     nki_sim.ShapeDtype((n_blocks, n_kv_heads, block_len, d), dt),
                                     nki_sim.ShapeDtype((b, max_blocks), nl.int32),
                                     nki_sim.ShapeDtype((b, 1), nl.int32), target=target, count_only=True,
                                     report=True, softmax_scale=1.0 / math.sqrt(d), split_size=split)
    return rep


def estimate(b: int, n_heads: int, n_kv_heads: int, s_max: int, d: int, *, split_size: int = 1024,
             target: str = "trn1", dtype: Any = None) -> Any:
    """Count-only cost Report of the simulator for one decode step (no values computed).

    Raises:
        KernelArgumentError: A cache too long for SBUF at this split_size on `target` (`max_cache_len`).
    """
    from neuron_opt import nki_sim

    dt = nl.bfloat16 if dtype is None else dtype
    _check_sbuf(s_max, d, split_size, target)
    g = n_heads // n_kv_heads
    _, rep = nki_sim.simulate_kernel(decode_attention_kernel[b, n_kv_heads],
                                     nki_sim.ShapeDtype((b, n_kv_heads, g, d), dt),
                                     nki_sim.ShapeDtype((b, n_kv_heads, d, s_max), dt),
                                     nki_sim.ShapeDtype((b, n_kv_heads, s_max, d), dt),
                                     nki_sim.ShapeDtype((b, 1), nl.int32), target=target, count_only=True,
                                     report=True, softmax_scale=1.0 / math.sqrt(d), split_size=split_size)
    return rep
