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

Scores transposed: a split's scores are computed with positions on partitions, `[positions, G]` per chunk of
128 (stationary: the chunk's K^T columns `[D, 128]`; moving: q^T `[D, G]`), side by side in one PSUM tile
`[128, chunks * G]`. Laid out the other way, `[G, split]`, every vector pass would run over the split's
positions on G (typically 4 or 8) of 128 partitions; transposed it runs over chunks * G elements per partition
(32 at split 1024, G 4), and the exp writes P^T, which the P @ V matmuls take as their stationary operand with no
transpose. The per-head max and shift then cross partitions and columns:
    - max: VectorE over the chunks (a `[128, G, chunks]` view), a TensorE transpose, VectorE over the positions;
    - shift: `-m` of each head is added to its columns on TensorE (`ones[G, 128]^T @ (selector * -m)`, fp32, so the
      shift is exactly the m the merge uses), and ScalarE takes exp(scale * x) straight from PSUM;
    - row sums: V carries a ones column, so `P^T[chunk]^T @ [V | 1][chunk]` accumulates o_s and l_s together.

Length mask: positions >= lengths[b] get at most -1e30 added to their scores. GpSimd computes
past = max(pos - len + 1, 0) over `[128, chunks, G]` (an iota of the positions and one tensor_scalar against
1 - len broadcast to the partitions once per program); a TensorE matmul `(NEG * I)^T @ past` adds NEG * past into
the score tile. A split entirely past the length gets m_s <= -1e30 and merge weight exactly 0.

Soft-capping (`softcap` = c > 0, Gemma 2: each scaled score x becomes c * tanh(x / c)): one ScalarE pass turns a
split's raw scores in PSUM into t = tanh(scale / c * s) in place, before the length mask is added (tanh would map a
masked -1e30 back to -1); every later step, the merge included, takes c where it took the softmax scale, since
the softmax of c * t is what remains.

Engines: on NeuronCore-v2 VectorE shares the PSUM port with ScalarE and the SBUF port with GpSimd (the cost
model serializes them, docs/nki_simulator.md). Per split the vector engines do a handful of instructions of
chunks * G elements each, so the kernel is bound by its DMA (K^T and V, long runs: see V's order).

Loops: the full K chunks (K_LOAD / split_size whole splits each) and the splits inside one are
`nl.affine_range` loops (independent until the merge, identical bodies: the compiler keeps them rolled); the
cache's tail chunk and a short last split are peeled as static code, and the merge is unrolled (one
instruction per split). The compiled program is 58 instructions at S_max = 4096 (split 1024).

Pseudocode (per program = (b, kv head)):
    q^T = transpose(q[b, kvh])                                   # [D, G], TensorE
    for split s: (every K_LOAD / split_size splits: K^T of those splits in one DMA; their V, with a ones
                  column, in one DMA as [128, splits * n, D + 1]; split i's positions q*n .. q*n + n - 1 on
                  partition q, n = split_size / 128)
        for chunk j < n:  sT[:, j] = K^T[:, i*split + j :: n]^T @ q^T       # PSUM [128, G]: position q*n + j
        sT += (NEG I)^T @ max(pos - len + 1, 0)                  # TensorE
        m_s = max over (partitions, chunks) of sT                 # VectorE, transpose, VectorE
        sT += ones^T @ (selector * -m_s)                         # TensorE, fp32
        pT = exp(scale * sT)                                     # ScalarE, PSUM -> SBUF, matmul dtype
        o_s | l_s = sum_j pT[:, j]^T @ [V | 1][:, i*n + j]       # TensorE, PSUM accumulation
    merge as above; store [G, D].

Paged variant (`paged_decode_attention_kernel`, `run_paged`): the caches are block pools
`[num_blocks, n_kv_heads, block_len, D]` read through `block_tables [B, max_blocks]`. A split is
split_size / block_len <= 128 blocks; one indirect DMA each gathers its K and its V blocks (partition q <- the
q-th block of the split), which is V's partition-run order with n = block_len; K^T is built by block_len TensorE
transposes of `[blocks, D]` (ScalarE copies them out of PSUM) to every block_len-th column, so chunk j of the
split's scores takes K^T columns j::block_len. Then `_split` as above. The transposes are `[blocks, D]`: 128
blocks per split (`default_paged_split`, up to 4096 positions) keep them full width.

DMA descriptors (one per contiguous HBM run landing in one partition) cost queue time in the cost model, so
every load moves long runs: K^T rows of up to K_LOAD positions, V runs of a K chunk's splits, q rows of D.

Constraints: D <= 128, G <= 128, split_size a multiple of 128 with split_size / 128 * G <= 512 (a split's
transposed fp32 scores take one PSUM bank); q and caches share float32 or bfloat16; lengths[b] >= 1. All
splits up to S_max are computed (lengths are runtime data). Every split's fp32 partial output and statistics
stay in SBUF until the merge: about n_splits * (D + 4) * 4 bytes per partition plus the working set
(`sbuf_bytes`), so S_max <= 32128 for D = 128 and split_size = 128 on trn1 (`max_cache_len`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kernels_nki._nki import DEFAULT_TARGET, check_softcap, nisa, nki, nl, sbuf_capacity, simulate
from neuron_opt import nki_sim
from neuron_opt.errors import KernelArgumentError

P_CHUNK = 128  # positions per P@V matmul (contraction on partitions)
SCORE_COLUMNS = 512  # fp32 columns of one PSUM bank: a split's transposed scores, chunks * G, must fit
DEFAULT_SPLIT = 1024  # positions per split where G allows (`default_split`)
# The paged kernel's default split: 128 blocks (one per partition: K^T's transposes are then [128, D], full width),
# at most this many positions (K^T [D, split] in SBUF).
PAGED_SPLIT_POSITIONS = 4096
NEG = -1.0e30  # added to scores of positions past the length
K_LOAD = 4096  # positions of K^T per DMA (whole splits): 8 KiB per partition in bf16, long DMA descriptors
# SBUF bytes per partition for the small tiles (positions, P^T, row maxes and sums, the queries), with margin;
# the K^T chunk, P and V of a split come on top (`sbuf_bytes`).
SBUF_WORKING_SET = 8 * 1024


@nki.jit
def decode_attention_kernel(q, k_t, v, lengths, softmax_scale=1.0, split_size=1024, softcap=0.0):
    """Launch as `decode_attention_kernel[B, n_kv_heads](q, k_t, v, lengths, softmax_scale=..., ...)`.
    `softcap` > 0: scaled scores x -> softcap * tanh(x / softcap) before the softmax (module docstring)."""
    n_b, n_kv, g, d = q.shape
    s_max = k_t.shape[3]
    out = nl.ndarray((n_b, n_kv, g, d), dtype=q.dtype, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    kvh = nl.program_id(1)
    mm_dtype = q.dtype
    n_splits = (s_max + split_size - 1) // split_size
    per_k = _splits_per_k_load(split_size)

    n = split_size // P_CHUNK  # V rows per partition and split
    exp_scale, cap_scale = _scales(softmax_scale, softcap)
    consts = (*_prologue(q, lengths, b, kvh, g, n, mm_dtype), cap_scale)

    m_all, l_all, o_all = _partials(g, n_splits, d)
    args = (consts, v, b, kvh, m_all, l_all, o_all, d, exp_scale, mm_dtype)
    chunk = per_k * split_size  # K^T positions per DMA: [D, chunk], whole splits
    n_kc = s_max // chunk
    for kc in nl.affine_range(n_kc):  # full chunks: independent, identical bodies (rolled)
        k_sb = nl.load(k_t[b, kvh, :, kc * chunk:(kc + 1) * chunk])
        # the chunk's V in partition-run order: one descriptor per partition (`v_kernel_layout`), and a ones
        # column that makes the P @ V matmuls produce the row sums
        v_sb = nl.ndarray((P_CHUNK, per_k * n, d + 1), dtype=mm_dtype, buffer=nl.sbuf)
        v_sb[:, :, d:d + 1] = 1.0
        i_p, i_c, i_d = nl.mgrid[0:P_CHUNK, 0:per_k * n, 0:d]
        v_sb[:, :, 0:d] = nl.load(v[b, kvh, kc * chunk + i_p * (per_k * n) + i_c, i_d])
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

    _merge(m_all, l_all, o_all, n_splits, d, exp_scale, out, b, kvh)
    return out


@nki.jit
def paged_decode_attention_kernel(q, k_cache, v_cache, block_tables, lengths, softmax_scale=1.0, split_size=2048,
                                  softcap=0.0):
    """Decode attention reading the KV cache through a block table (`run_paged`). Launch as
    `paged_decode_attention_kernel[B, n_kv_heads](q, k_cache, v_cache, block_tables, lengths, ...)`.

    k_cache / v_cache `[num_blocks, n_kv_heads, block_len, D]`, block_tables `[B, max_blocks]` int32 (entry i:
    the cache block of the sequence's positions [i * block_len, (i + 1) * block_len)). A split is
    nb = split_size / block_len blocks: their K and V rows are gathered by one indirect DMA each (partition q
    <- block table[b, s * nb + q], one block_len * D run), which lands V exactly as the P @ V matmuls contract
    it (partition q: nb positions' worth of runs, as `v_kernel_layout`'s); K is turned to K^T [D, split] by
    block_len TensorE transposes of [nb, D], each copied (ScalarE) to every block_len-th column, natural
    position order. Then the split is `_split`'s, as in `decode_attention_kernel`.
    """
    n_b, n_kv, g, d = q.shape
    block_len = k_cache.shape[2]
    max_blocks = block_tables.shape[1]
    out = nl.ndarray((n_b, n_kv, g, d), dtype=q.dtype, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    kvh = nl.program_id(1)
    mm_dtype = q.dtype
    nb = split_size // block_len  # blocks per split (<= 128: one per partition)
    n_splits = (max_blocks + nb - 1) // nb
    n_full = max_blocks // nb

    exp_scale, cap_scale = _scales(softmax_scale, softcap)
    consts = (*_prologue(q, lengths, b, kvh, g, block_len, mm_dtype), cap_scale)
    # the table row in one DMA (one run) onto one partition, as fp32 (block ids < 2^24 are exact) so that each
    # split can turn its nb entries to one per partition with a TensorE transpose (`_paged_split`)
    tbl = nisa.tensor_copy(nl.load(block_tables[nl.ds(b, 1), :]), dtype=nl.float32)  # [1, max_blocks]

    m_all, l_all, o_all = _partials(g, n_splits, d)
    args = (consts, v_cache, b, kvh, m_all, l_all, o_all, d, exp_scale, mm_dtype)
    for sp in nl.affine_range(n_full):  # whole splits: independent, identical bodies (rolled)
        _paged_split(sp, sp * nb, nb, block_len, tbl, k_cache, *args)
    if n_full < n_splits:  # the table's tail: fewer blocks, peeled
        _paged_split(n_full, n_full * nb, max_blocks - n_full * nb, block_len, tbl, k_cache, *args)

    _merge(m_all, l_all, o_all, n_splits, d, exp_scale, out, b, kvh)
    return out


def _scales(softmax_scale, softcap):
    """(the scale the softmax's exp and the merge take, the scale of the tanh before them or 0.0 for none).

    Soft-capped, the scores become t = tanh(softmax_scale / softcap * s) and the softmax is that of softcap * t:
    the kernel's steps unchanged with softcap for the scale."""
    if softcap:
        return softcap, softmax_scale / softcap
    return softmax_scale, 0.0


def _paged_split(sp, first, nb, block_len, tbl, k_cache, consts, v_cache, b, kvh, m_all, l_all, o_all, d,
                 softmax_scale, mm_dtype):
    """Split `sp` of a paged cache: table entries [first, first + nb) gathered (K and V), K^T built, then
    `_split`."""
    sw = nb * block_len
    # [nb, 1] int32: the split's cache blocks, one per partition (the indirect DMAs' offsets)
    idx = nisa.tensor_copy(nisa.nc_transpose(tbl[0:1, first:first + nb]), dtype=nl.int32)
    k_blk = nl.load(k_cache[idx, kvh, :, :])  # [nb, block_len, D]: partition q <- block idx[q]
    # the same for V (chunk j of partition q is position q * bl + j), beside a ones column (the row sums)
    v_blk = nl.ndarray((nb, block_len, d + 1), dtype=mm_dtype, buffer=nl.sbuf)
    v_blk[:, :, d:d + 1] = 1.0
    v_blk[:, :, 0:d] = nl.load(v_cache[idx, kvh, :, :])
    k_t = nl.ndarray((d, sw), dtype=mm_dtype, buffer=nl.sbuf)
    for j in nl.static_range(block_len):  # position j of every block -> columns j, j + bl, ... (natural order)
        k_t[:, j:sw:block_len] = nisa.activation(nl.copy, nisa.nc_transpose(k_blk[:, j, :]), dtype=mm_dtype)
    _split(sp, first * block_len, 0, sw, k_t, v_blk, 0, consts, v_cache, b, kvh, m_all, l_all, o_all, d,
           softmax_scale, mm_dtype, v_parts=nb)


def _prologue(q, lengths, b, kvh, g, max_chunks, mm_dtype):
    """Per-program constants for `_split` (the kernels add the soft-cap's tanh scale, 0.0 for none): (q^T [D, G],
    1 - len on every partition [128, 1], NEG * I [128, 128], ones [G, 128] fp32, the head selector
    [G, max_chunks, G] fp32 (1 where the first and last index agree)).

    q comes as [G, D], one descriptor per head, and is transposed on TensorE to the [D, G] moving operand
    (loading [D, G] directly would cost one descriptor of G elements per partition)."""
    q_sb = nl.copy(nisa.nc_transpose(nl.load(q[b, kvh])), dtype=mm_dtype)
    len_f = nisa.tensor_copy(nl.load(lengths[nl.ds(b, 1), :]), dtype=nl.float32)  # [1, 1]
    one_minus_len = nl.multiply(nl.add(len_f, -1.0), -1.0)  # [1, 1]: 1 - len
    len_col = nl.broadcast_to(one_minus_len, (P_CHUNK, 1))  # TensorE partition broadcast
    i_p = nl.arange(P_CHUNK)[:, None]
    i_q = nl.arange(P_CHUNK)[None, :]
    negs = nl.full((P_CHUNK, P_CHUNK), NEG, dtype=mm_dtype, buffer=nl.sbuf)
    neg_eye = nisa.affine_select(i_p >= i_q, nisa.affine_select(i_p <= i_q, negs, 0.0), 0.0)
    ones_g = nl.full((g, P_CHUNK), 1.0, dtype=nl.float32, buffer=nl.sbuf)
    i_a, i_j, i_h = nl.mgrid[0:g, 0:max_chunks, 0:g]
    ones_sel = nl.full((g, max_chunks, g), 1.0, dtype=nl.float32, buffer=nl.sbuf)
    sel = nisa.affine_select(i_a >= i_h, nisa.affine_select(i_a <= i_h, ones_sel, 0.0), 0.0)
    return q_sb, len_col, neg_eye, ones_g, sel


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


def _split(sp, c0, k_off, sw, k_sb, v_sb, v_off, consts, v, b, kvh, m_all, l_all, o_all, d, softmax_scale,
           mm_dtype, v_parts=P_CHUNK):
    """Split `sp`: positions [c0 + k_off, c0 + k_off + sw), keys in `k_sb` (K^T from c0) at column k_off, values
    in `v_sb` (with its ones column) from chunk `v_off` (a full K chunk's, partition-run order, or a split's
    gathered cache blocks) or, when `v_sb` is None, loaded here from the natural tail.

    `v_sb` given: its `v_parts` partitions each hold sw / v_parts consecutive positions of the split (chunk j of
    partition q: position q * sw / v_parts + j), 128 for a K chunk's runs, the number of blocks for gathered
    cache blocks.

    The scores are computed transposed, positions on partitions: chunk j's are `K^T[:, chunk j]^T @ q^T`
    (stationary: the chunk's K^T columns, moving: the G queries), `[positions, G]`, in chunk j's columns of
    one PSUM tile `[v_parts, chunks * G]`. All of the split's vector work then runs over chunks * G elements per
    partition instead of the split's positions on G partitions, and P^T is what the exp writes: the P @ V
    matmuls take it as their stationary operand with no transpose. Per split:
      - length mask: `NEG * max(pos - len + 1, 0)` (GpSimd iota and tensor_scalar) added on TensorE
        (`(NEG I)^T @ past`);
      - max: VectorE over the chunks (free dim), TensorE transpose, VectorE over the positions: m [G, 1];
      - `-m` added to every column of its head on TensorE (`ones^T @ (selector * -m)`, fp32, exact);
      - P^T = exp(scale * (s - m)) by ScalarE straight from PSUM, in the matmul dtype;
      - `o_s | l_s = sum_j P^T[chunk j]^T @ [V | 1][chunk j]` accumulated in PSUM.

    Writes the split's row max, row sum and unnormalised output into column sp of m_all / l_all / o_all.
    """
    q_sb, len_col, neg_eye, ones_g, sel, cap_scale = consts
    g = q_sb.shape[1]
    s0 = c0 + k_off
    if v_sb is None:  # the natural tail: partition q holds positions q * nf + j (j < nf), then the tail chunk
        v_sb, nf = _load_v(v, b, kvh, s0, sw, d, mm_dtype)
        rem = sw - nf * P_CHUNK
        parts = P_CHUNK if nf else rem
        chunks = [(k_sb[:, k_off + j:k_off + nf * P_CHUNK:nf], P_CHUNK) for j in range(nf)]
        if rem:
            chunks.append((k_sb[:, k_off + nf * P_CHUNK:k_off + sw], rem))
    else:
        nf, rem, parts = sw // v_parts, 0, v_parts
        chunks = [(k_sb[:, k_off + j:k_off + sw:nf], v_parts) for j in range(nf)]
    n_ch = len(chunks)
    s_ps = nl.ndarray((nl.par_dim(parts), n_ch * g), dtype=nl.float32, buffer=nl.psum)
    if rem and nf:  # the tail chunk fills rem of 128 partitions: the rest must hold a number before the mask
        s_ps[...] = 0.0
    for j in nl.static_range(n_ch):
        cols, cw = chunks[j]
        s_ps[0:cw, j * g:(j + 1) * g] = nisa.nc_matmul(cols, q_sb)  # [cw, G]
    if cap_scale:  # soft-capping: t = tanh(scale / cap * s) in place (ScalarE), before the mask is added
        s_ps[...] = nisa.activation(nl.tanh, s_ps, scale=cap_scale, dtype=nl.float32)
    # positions on (partition, chunk), the same for each head; past the length -> +NEG (at least)
    pos = nl.ndarray((parts, n_ch, g), dtype=nl.float32, buffer=nl.sbuf)
    if nf:
        i_p, i_j, i_g = nl.mgrid[0:parts, 0:nf, 0:g]
        pos[:, 0:nf, :] = nisa.iota(s0 + i_p * nf + i_j + 0 * i_g, dtype=nl.float32)
    if rem:
        i_p, i_g = nl.mgrid[0:parts, 0:g]
        pos[:, nf, :] = nisa.iota(s0 + nf * P_CHUNK + i_p + 0 * i_g, dtype=nl.float32)
    past = nisa.tensor_scalar(pos, nl.add, len_col[0:parts, :], op1=nl.maximum, operand1=0.0, dtype=mm_dtype,
                              engine=nisa.gpsimd_engine)
    s_ps[...] += nisa.nc_matmul(neg_eye[0:parts, 0:parts], past)
    # max over the chunks (a [parts, G, chunks] view), then over the partitions (transposed)
    i_p, i_g, i_j = nl.mgrid[0:parts, 0:g, 0:n_ch]
    m_part = nisa.tensor_reduce(nl.maximum, s_ps[i_p, i_j * g + i_g], axis=(2,))  # [parts, G]
    m_s = m_all[:, sp:sp + 1]
    m_s[...] = nisa.tensor_reduce(nl.maximum, nisa.nc_transpose(m_part), axis=(1,), keepdims=True)  # [G, 1]
    neg_m = nisa.tensor_scalar(sel[:, 0:n_ch, :], nl.multiply, m_s, op1=nl.multiply, operand1=-1.0)
    s_ps[...] += nisa.nc_matmul(ones_g[:, 0:parts], neg_m)  # s - m of its own head, in every column
    p_t = nisa.activation(nl.exp, s_ps, scale=softmax_scale, dtype=mm_dtype)  # P^T [parts, chunks * G]
    o_ps = nl.ndarray((g, d + 1), dtype=nl.float32, buffer=nl.psum)
    for j in nl.static_range(n_ch):
        cw = chunks[j][1]
        if j == 0:
            o_ps[...] = nisa.nc_matmul(p_t[0:cw, j * g:(j + 1) * g], v_sb[0:cw, v_off + j, :])  # [G, D + 1]
        else:
            o_ps[...] += nisa.nc_matmul(p_t[0:cw, j * g:(j + 1) * g], v_sb[0:cw, v_off + j, :])
    o_all[:, sp * d:(sp + 1) * d] = nisa.tensor_copy(o_ps[:, 0:d])
    l_all[:, sp:sp + 1] = nisa.activation(nl.copy, o_ps[:, d:d + 1])


def _load_v(v, b, kvh, k0, w, d, mm_dtype):
    """V rows [k0, k0 + w) as `[128, ceil(w / 128), D + 1]` (its last column 1.0), and the number of full
    chunks `full`.

    Partition q holds positions k0 + q * full + j (j < full): `full` consecutive rows of V, one contiguous
    run of full * D elements per partition, so the DMA moves few large descriptors (one per partition). The
    tail (w % 128 positions) is chunk `full`, position k0 + full * 128 + q on partition q, in a second DMA.
    """
    n_ch = (w + P_CHUNK - 1) // P_CHUNK
    full = w // P_CHUNK
    v_sb = nl.ndarray((P_CHUNK, n_ch, d + 1), dtype=mm_dtype, buffer=nl.sbuf)
    v_sb[:, :, d:d + 1] = 1.0
    if full:
        i_p, i_c, i_d = nl.mgrid[0:P_CHUNK, 0:full, 0:d]
        v_sb[:, 0:full, 0:d] = nl.load(v[b, kvh, k0 + i_p * full + i_c, i_d])
    if w % P_CHUNK:
        v_sb[0:w % P_CHUNK, full, 0:d] = nl.load(v[b, kvh, k0 + full * P_CHUNK:k0 + w, :])
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
    g = n_heads // k_cache.shape[1]
    if split_size < P_CHUNK or split_size % P_CHUNK or split_size > max_split(g):
        raise KernelArgumentError(f"decode_attention: split_size {split_size} must be a multiple of 128 with "
                                  f"split_size / 128 * G <= {SCORE_COLUMNS} (a split's transposed fp32 scores, "
                                  f"[128, split_size / 128 * G], take one PSUM bank); G={g} allows at most "
                                  f"{max_split(g)}")
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
    return n_splits * (d + 4) * 4 + _split_bytes(split_size) + SBUF_WORKING_SET


def _split_bytes(split_size: int) -> int:
    """A K chunk's K^T `[D, chunk]` and V `[128, chunk / 128, D + 1]` (D <= 128), at most 4 bytes an element, and
    a split's positions, mask and P^T (`[parts, chunks * G]`, at most SCORE_COLUMNS fp32 each)."""
    chunk = _splits_per_k_load(split_size) * split_size
    return 4 * (2 * chunk + chunk // P_CHUNK) + 12 * SCORE_COLUMNS


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
    import torch  # here: the kernels import without torch (numpy on the simulator); only a tensor brings it

    return torch.cat([head, v[:, :, cut:]], dim=2)


def max_cache_len(d: int, split_size: int, target: str = DEFAULT_TARGET) -> int:
    """Longest S_max whose `sbuf_bytes` fit the SBUF a kernel may use on `target`."""
    room = sbuf_capacity(target) - SBUF_WORKING_SET - _split_bytes(split_size)
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
        softmax_scale: float | None = None, split_size: int | None = None,
        softcap: float | None = None) -> np.ndarray:
    """Runs the kernel on logical layouts (simulator here, the SDK's NKI where installed).

    Args:
        q: `[B, n_heads, D]`, float32 or bfloat16.
        k_cache: `[B, n_kv_heads, S_max, D]`, same dtype.
        v_cache: `[B, n_kv_heads, S_max, D]`, same dtype.
        lengths: `[B]` integers in [1, S_max].
        softmax_scale: Defaults to `1 / sqrt(D)`.
        split_size: Cache positions per flash-decoding split; default `default_split(G)` (1024 up to G = 64).
        softcap: Soft-cap the scaled scores, x -> softcap * tanh(x / softcap) (> 0); None: not.

    Returns:
        `[B, n_heads, D]` in q's dtype.

    Raises:
        KernelArgumentError: Shapes, dtypes or lengths the kernel does not support, or a cache too long for
            SBUF at this split_size on the simulator's default target (`max_cache_len`).
    """
    lengths = np.asarray(lengths)
    if split_size is None:
        shaped = q.ndim == 3 and k_cache.ndim == 4 and k_cache.shape[1] > 0
        split_size = default_split(max(1, q.shape[1] // k_cache.shape[1]) if shaped else 1)
    _check(q, k_cache, v_cache, lengths, split_size)
    check_softcap("decode_attention", softcap)
    b, n_heads, d = q.shape
    n_kv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    q_g = np.ascontiguousarray(q.reshape(b, n_kv, n_heads // n_kv, d))  # [B, n_kv_heads, G, D]
    k_t = np.ascontiguousarray(k_cache.transpose(0, 1, 3, 2))  # [B, n_kv_heads, D, S_max]
    lens = lengths.astype(np.int32).reshape(b, 1)  # [B, 1]
    v_k = np.ascontiguousarray(v_kernel_layout(v_cache, split_size))  # rows in the kernel's order
    out = simulate(decode_attention_kernel[b, n_kv], q_g, k_t, v_k, lens,
                   softmax_scale=scale, split_size=split_size, softcap=float(softcap or 0.0))
    return np.asarray(out).reshape(b, n_heads, d)  # [B, n_kv, G, D] -> [B, n_heads, D]


def max_split(g: int) -> int:
    """The longest split for G query heads per KV head: the largest multiple of 128 whose transposed scores
    `[128, split / 128 * G]` fit one PSUM bank (512 at G = 128; 0 above G = 512)."""
    return SCORE_COLUMNS // g * P_CHUNK


def default_split(g: int) -> int:
    """Positions per split for G query heads per KV head: DEFAULT_SPLIT, or `max_split(g)` where that is less."""
    return max(P_CHUNK, min(DEFAULT_SPLIT, max_split(g)))


def default_paged_split(block_len: int) -> int:
    """Positions per split: as many whole blocks as fit in 128 (one per partition) and 4096 positions (at least
    one block)."""
    return max(1, min(P_CHUNK, PAGED_SPLIT_POSITIONS // block_len)) * block_len


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
    if split_size < block_len or split_size % block_len or split_size // block_len > P_CHUNK:
        raise KernelArgumentError(f"paged decode_attention: split_size {split_size} must be a whole number of "
                                  f"blocks (block_len {block_len}), at most 128 of them (one per partition); "
                                  f"default_paged_split({block_len}) = {default_paged_split(block_len)}")
    g = n_heads // n_kv
    if block_len * g > SCORE_COLUMNS:
        raise KernelArgumentError(f"paged decode_attention: block_len * G = {block_len} * {g} > {SCORE_COLUMNS}: a "
                                  f"split's transposed fp32 scores, [blocks, block_len * G], must fit one PSUM bank")
    need, cap = paged_sbuf_bytes(s_max, d, block_len, split_size), sbuf_capacity(DEFAULT_TARGET)
    if need > cap:
        raise KernelArgumentError(f"paged decode_attention: {s_max} positions with split_size {split_size}, "
                                  f"block_len {block_len} and D={d} need {need} SBUF bytes per partition, more "
                                  f"than the {cap} a kernel may use on {DEFAULT_TARGET}")


def paged_sbuf_bytes(s_max: int, d: int, block_len: int, split_size: int) -> int:
    """SBUF bytes per partition of `paged_decode_attention_kernel` at its peak (as `sbuf_bytes` counts): the
    splits' partials, the table, a split's gathered K and V blocks (block_len * D and block_len * (D + 1)) and its
    K^T (split_size), at most 4 bytes an element, its positions, mask and P^T (at most SCORE_COLUMNS fp32 each),
    and `SBUF_WORKING_SET`."""
    n_splits = -(-s_max // split_size)
    return (n_splits * (d + 4) * 4 + 8 * n_splits * split_size // block_len
            + 4 * (block_len * (2 * d + 1) + split_size) + 12 * SCORE_COLUMNS + SBUF_WORKING_SET)


def run_paged(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
              lengths: np.ndarray, *, softmax_scale: float | None = None,
              split_size: int | None = None, softcap: float | None = None) -> np.ndarray:
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
        softcap: Soft-cap the scaled scores, x -> softcap * tanh(x / softcap) (> 0); None: not.

    Returns:
        `[B, n_heads, D]` in q's dtype.

    Raises:
        KernelArgumentError: Shapes, dtypes, table entries, lengths or a split the kernel does not support.
    """
    lengths = np.asarray(lengths)
    block_tables = np.asarray(block_tables)
    split = default_paged_split(k_cache.shape[2]) if split_size is None else int(split_size)
    _check_paged(q, k_cache, v_cache, block_tables, lengths, split)
    check_softcap("paged decode_attention", softcap)
    b, n_heads, d = q.shape
    n_kv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    q_g = np.ascontiguousarray(q.reshape(b, n_kv, n_heads // n_kv, d))
    out = simulate(paged_decode_attention_kernel[b, n_kv], q_g, np.ascontiguousarray(k_cache),
                   np.ascontiguousarray(v_cache), np.ascontiguousarray(block_tables, dtype=np.int32),
                   lengths.astype(np.int32).reshape(b, 1), softmax_scale=scale, split_size=split,
                   softcap=float(softcap or 0.0))
    return np.asarray(out).reshape(b, n_heads, d)


def estimate_paged(b: int, n_heads: int, n_kv_heads: int, s_max: int, d: int, *, block_len: int = 16,
                   split_size: int | None = None, target: str = "trn1", dtype: Any = None) -> Any:
    """Count-only cost Report of the paged kernel for one decode step over `s_max` positions per sequence
    (s_max / block_len table entries each, blocks of a pool of B * that size)."""
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
