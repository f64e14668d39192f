"""Flash attention forward for prefill (causal or not, GQA, any S, D <= 128), legacy `neuronxcc.nki` API.

Dimensions:
    B batch, n_heads query heads, n_kv_heads KV heads (G = n_heads // n_kv_heads query heads share one KV
    head), S sequence (queries = keys), D head dim <= 128.

Kernel layouts (HBM):
    q_t  `[B, n_heads, D, S]`     queries transposed: QK^T contracts over D, which TensorE needs on partitions
    k_t  `[B, n_kv_heads, D, S]`  keys transposed, same reason
    v    `[B, n_kv_heads, S, D]`  natural: P @ V contracts over keys, already the leading (partition) dim
    out  `[B, n_heads, S, D]`     natural
    `run(...)` takes the logical `[B, heads, S, D]` arrays and does the two transposes on the host.

Launch: SPMD grid `[B, n_kv_heads, G]`, one program per (batch, query head); the head is factored as
(kv head, member of its group) so that every index is affine in the program ids (no division).

Streaming (per program): queries are taken in groups of `Q_GROUP` tiles of 128 rows (512 queries); a group's
Q^T `[D, 512]` and its online-softmax state stay in SBUF while K^T and V stream from HBM in blocks of
`K_BLOCK` keys (K^T `[D, 2048]` in one DMA, V as `[128, 16, D + 1]`, its last column 1.0, one DMA per
512-key sub-tile with each partition's 4 keys contiguous: see `_load_kv`). Each block is one online-softmax
step per member tile: its scores leave PSUM a 512-key sub-tile at a time, copied to
SBUF (fp32) by ScalarE, so PSUM holds one sub-tile per step in flight, not the step. Steps are issued
software-pipelined, `LOOKAHEAD` = 1: the next step's matmuls, copies and max go before this step's exp and
P @ V. Every K/V byte is read once per group, so HBM traffic is
S^2 * D * 4 / 512 bytes (bf16): at S = 4096 one head moves 16 MiB where compute takes ~150 us, well under
trn1's DMA rate. SBUF use does not depend on S (`sbuf_bytes`); S is bounded only by HBM.

Loops (core/loops.py in the simulator checks both rules):
    key blocks before the diagonal   `nl.sequential_range` (the online-softmax state is carried); every
                                     iteration issues the same instructions, so the compiler keeps it rolled
    query groups, non-causal         `nl.affine_range` over the full groups (independent), then the tail group
    query groups, causal             `nl.static_range` (each group sees a different number of key blocks)
    sub-tiles, chunks, group members `nl.static_range` (fixed small trip counts; extents are Python ints)
    The key tail (S % K_BLOCK) and the causal diagonal are peeled out of the rolled loop as static steps, so
    tile extents stay Python ints and tiles entirely in the future of a query tile are never issued. The
    compiled program grows with the number of query groups (S / 512), not with S^2.

Pseudocode (per program, per query group [q0, q0 + 512)):
    q = Q^T[:, group];  per member tile t: m_t = -1e30, o_t = 0   (o's last column is the running row sum l)
    for key block kb in [0, kend_full) (sequential):  load K^T block, V block;  for t: step(t, the block)
    tail keys (non-causal) / diagonal keys [q0, q0 + 128 t + qr) (causal, mask on the last 128 columns): step
    step(t, keys):   (first half `_scores`, second half `_softmax_pv`, pipelined one step apart)
        for sub-tile c:  s_ps = q_t^T @ K^T[:, keys c]          # TensorE -> PSUM [qr, <=512]
                         (diagonal: s_ps[:, t's own 128 keys] += I^T @ tri, 0 or -1e30)   # TensorE
                         s[:, c] = copy(s_ps)  (fp32)           # ScalarE: the one read of the scores in PSUM
                         st[:, 1 + c] = rowmax(s[:, c])         # VectorE, from SBUF
        m_new = max(st[:, 0:1 + n]);  nbias = -scale * m_new    # VectorE, ScalarE
        alpha = exp(scale * st[:, 0] + nbias);  st[:, 0] = m_new # ScalarE
        for sub-tile c:  p = exp(scale * s[:, c] + nbias)  (bf16/fp32)                     # ScalarE, from SBUF
                         for 128-key chunk: pT = transpose(p[:, chunk])  # TensorE -> PSUM; copy to SBUF on
                                                                         # VectorE (13/16) or ScalarE
                                            pv += pT^T @ [V | 1][chunk]  # TensorE, PSUM accumulation
        o_t = alpha * o_t + pv                                 # VectorE, one instruction (pv read in PSUM)
    out[tile t] = o_t[:, :D] * (1 / o_t[:, D])                 # VectorE reciprocal, GpSimd multiply

    Starting from m = -1e30 and o = 0 makes the first block an ordinary step (alpha = 0), which keeps the
    rolled loop uniform. The ones column makes TensorE produce the row sums (moving free D + 1 instead of D,
    +1%), cheaper than ScalarE's reduce read-out and consistent with the bf16 P actually multiplied. Per
    128x512 score tile TensorE needs 550 ns of which 366 are useful (66.5% at most), and on NeuronCore-v2,
    where VectorE shares the PSUM port with ScalarE and the SBUF port with GpSimd, the four passes over the
    scores (copy, max, exp, P^T eviction) need ~800 ns of VectorE and ScalarE: ~45% at best (docs/kernels.md).

Soft-capping (`softcap` = c > 0, Gemma 2's attention logit soft-capping: each scaled score x becomes
c * tanh(x / c)): the ScalarE pass that copies a score sub-tile out of PSUM applies tanh with scale sc / c instead
of the identity, so the capped scores cost no extra pass; the exp then takes c where it took sc (exp(c * t - c *
m) over t = tanh(sc * s / c)). The causal mask of a diagonal sub-tile is added after the tanh, to the SBUF copy of
the qr own-key columns (one VectorE add), not in PSUM: tanh would map a masked -1e30 back to -1.

Constraints: D <= 128; q, k, v share one dtype (float32 or bfloat16; matmuls run in that dtype, softmax
statistics in float32). SBUF per partition (`sbuf_bytes`) is about 44 KiB for bf16, D = 128, whatever S.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kernels_nki._nki import check_softcap, nisa, nki, nl, simulate
from neuron_opt import nki_sim
from neuron_opt.errors import KernelArgumentError

Q_TILE = 128  # query rows per tile: the partition count of the score tile
Q_GROUP = 4  # query tiles that share one pass over K/V (512 queries: K/V HBM traffic / 512 per query)
K_TILE = 512  # keys per score matmul: one PSUM bank of fp32
K_BLOCK = 2048  # keys per streamed K/V block and online-softmax step (4 score sub-tiles; fp32 scores 8 KiB in SBUF)
NEG = -1.0e30  # masked score and initial running max; exp(scale * NEG - m) underflows to exactly 0
LOOKAHEAD = 1  # steps whose scores are issued before the oldest pending step's exp and P @ V
EVICT_VECTOR = (13, 16)  # of every 16 P^T evictions, 13 on VectorE, 3 on ScalarE (which copies the scores out)


@nki.jit
def flash_attention_kernel(q_t, k_t, v, causal=True, softmax_scale=1.0, softcap=0.0):
    """Launch as `flash_attention_kernel[B, n_kv_heads, G](q_t, k_t, v, causal=..., softmax_scale=..., softcap=...)`.

    `softcap` > 0: the scaled scores are soft-capped, x -> softcap * tanh(x / softcap), before the mask and the
    softmax (Gemma 2's attention logit soft-capping); 0: not."""
    _, n_heads, d, s = q_t.shape
    group = n_heads // k_t.shape[1]
    out = nl.ndarray((q_t.shape[0], n_heads, s, d), dtype=q_t.dtype, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    kvh = nl.program_id(1)
    h = kvh * group + nl.program_id(2)
    mm_dtype = q_t.dtype
    masks = _causal_masks(mm_dtype) if causal else None
    # soft-capping: the scores tile leaves PSUM as t = tanh(scale / cap * s) (the copy's ScalarE pass, with tanh
    # for its function), and the softmax takes exp(cap * t - cap * m): the same steps with cap for the scale
    exp_scale, cap_scale = (softcap, softmax_scale / softcap) if softcap else (softmax_scale, 0.0)
    args = (q_t, k_t, v, out, b, h, kvh, s, d, masks, exp_scale, cap_scale, mm_dtype)
    rows = Q_GROUP * Q_TILE
    n_groups = (s + rows - 1) // rows
    if causal:
        for gi in nl.static_range(n_groups):
            _query_group(gi * rows, *args)
    else:
        for gi in nl.affine_range(s // rows):  # full groups: independent, identical bodies
            _query_group(gi * rows, *args)
        if s % rows:
            _query_group(s - s % rows, *args)
    return out


def _causal_masks(mm_dtype):
    """Identity [128, 128] and the additive causal mask of a diagonal [128, 128] block (GpSimd, once).

    On its diagonal step a query tile [q0', q0' + qr) sees keys [q0, q0' + qr) and only the last qr of them,
    [q0', q0' + qr), need masking: mask[p, f] = 0 where f <= p, else NEG. Adding `I^T @ mask` into those qr
    columns of the score PSUM tile masks them on TensorE (qr cycles), so VectorE and ScalarE read the masked
    scores straight from PSUM.
    """
    i_p = nl.arange(Q_TILE)[:, None]
    i_q = nl.arange(Q_TILE)[None, :]
    ones = nl.ones((Q_TILE, Q_TILE), dtype=mm_dtype, buffer=nl.sbuf)
    ident = nisa.affine_select(i_p >= i_q, nisa.affine_select(i_p <= i_q, ones, 0.0), 0.0)
    zeros = nl.zeros((Q_TILE, Q_TILE), dtype=mm_dtype, buffer=nl.sbuf)
    tri = nisa.affine_select(i_p >= i_q, zeros, NEG)
    return ident, tri


def _query_group(q0, q_t, k_t, v, out, b, h, kvh, s, d, masks, scale, cap_scale, mm_dtype):
    """Queries [q0, q0 + up to Q_GROUP * 128): stream the keys they attend to, then normalise and store."""
    n_rows = min(Q_GROUP * Q_TILE, s - q0)
    tiles = [(t * Q_TILE, min(Q_TILE, n_rows - t * Q_TILE)) for t in range((n_rows + Q_TILE - 1) // Q_TILE)]
    n_sub = K_BLOCK // K_TILE
    q_sb = nl.load(q_t[b, h, :, q0:q0 + n_rows])  # [D, n_rows] stationary operands of the group
    # Online-softmax state per member tile: column 0 the running max, columns 1.. a step's sub-tile maxes;
    # o's last column is the running row sum.
    st = nl.full((len(tiles), nl.par_dim(Q_TILE), 1 + n_sub), NEG, dtype=nl.float32, buffer=nl.sbuf)
    o = nl.zeros((len(tiles), nl.par_dim(Q_TILE), d + 1), dtype=nl.float32, buffer=nl.sbuf)
    kend = q0 if masks is not None else s  # keys every member sees in full
    n_full = kend // K_BLOCK
    state = (q_sb, tiles, st, o, d, scale, cap_scale, mm_dtype)
    for j in nl.sequential_range(n_full):
        kv = _load_kv(k_t, v, b, kvh, j * K_BLOCK, K_BLOCK, d, mm_dtype)
        _block_steps(kv, K_BLOCK, tiles, state)
    if kend % K_BLOCK:
        kv = _load_kv(k_t, v, b, kvh, n_full * K_BLOCK, kend % K_BLOCK, d, mm_dtype)
        _block_steps(kv, kend % K_BLOCK, tiles, state)
    if masks is not None:  # the group's own keys [q0, q0 + n_rows): member t sees the first r + qr of them
        kv = _load_kv(k_t, v, b, kvh, q0, n_rows, d, mm_dtype)
        _pipelined([(t, kv, 0, _widths(tiles[t][0] + tiles[t][1]), (masks, tiles[t][0]))
                    for t in range(len(tiles))], state)
    for t in nl.static_range(len(tiles)):
        r, qr = tiles[t]
        inv_l = nisa.reciprocal(o[t, 0:qr, d:d + 1])
        o_out = nisa.tensor_scalar(o[t, 0:qr, 0:d], nl.multiply, inv_l, dtype=out.dtype, engine=nisa.gpsimd_engine)
        nl.store(out[b, h, q0 + r:q0 + r + qr, :], value=o_out)


def _widths(n):
    return [min(K_TILE, n - k0) for k0 in range(0, n, K_TILE)]


def _block_steps(kv, n, tiles, state):
    """Every member's step over a block of n <= K_BLOCK keys: the steps one member chains (its running state)
    are separated by the other members' independent ones."""
    _pipelined([(t, kv, 0, _widths(n), None) for t in range(len(tiles))], state)


def _pipelined(steps, state):
    """Issue the steps software-pipelined: step i + 1's scores (matmuls, the PSUM copy, the max) go before step
    i's exp and P @ V, so that each engine has the next step's work queued while this one's chain resolves."""
    queued = []
    for spec in steps:
        queued.append((spec, _scores(*spec, *state)))
        if len(queued) > LOOKAHEAD:
            spec0, res0 = queued.pop(0)
            _softmax_pv(*spec0, *res0, *state)
    for spec0, res0 in queued:
        _softmax_pv(*spec0, *res0, *state)


def _load_kv(k_t, v, b, kvh, k0, n, d, mm_dtype):
    """K^T [D, n], V of keys [k0, k0 + n) as [128, ceil(n / 128), D + 1] (its last column 1.0), and whether
    V is key-interleaved.

    With n % 4 == 0 V is loaded key-interleaved per 512-key sub-tile: for sub-tile u, partition p holds its
    keys u * 512 + p * 4 + c (c < 4) as chunk 4u + c, four consecutive rows of V, so each sub-tile's DMA moves
    one contiguous 4 * D run per partition (1 KiB in bf16, D = 128) instead of four of D. P^T chunk 4u + c is
    then the strided column set c::4 of sub-tile u's P (`_exp_pv`); a prefix of w keys (a diagonal member)
    is columns c:w:4 and partitions [0, w / 4). Otherwise V holds keys k0 + c * 128 + p.
    """
    k_blk = nl.load(k_t[b, kvh, :, k0:k0 + n])
    per = K_TILE // Q_TILE
    interleaved = n % per == 0
    n_ch = (n + K_TILE - 1) // K_TILE * per if interleaved else (n + Q_TILE - 1) // Q_TILE
    full = n // Q_TILE
    v_blk = nl.ndarray((Q_TILE, n_ch, d + 1), dtype=mm_dtype, buffer=nl.sbuf)
    v_blk[:, :, d:d + 1] = 1.0  # the ones column (GpSimd memset of n_ch elements per partition)
    if interleaved:
        for u in nl.static_range((n + K_TILE - 1) // K_TILE):
            rows = min(K_TILE, n - u * K_TILE) // per
            i_p, i_c, i_d = nl.mgrid[0:rows, 0:per, 0:d]
            v_blk[0:rows, u * per:(u + 1) * per, 0:d] = nl.load(v[b, kvh, k0 + u * K_TILE + i_p * per + i_c, i_d])
        return k_blk, v_blk, True
    i_p, i_c, i_d = nl.mgrid[0:Q_TILE, 0:full, 0:d]
    if full:
        v_blk[:, 0:full, 0:d] = nl.load(v[b, kvh, k0 + i_c * Q_TILE + i_p, i_d])  # one DMA for the full chunks
    if n % Q_TILE:
        rem = n % Q_TILE
        v_blk[0:rem, full, 0:d] = nl.load(v[b, kvh, k0 + full * Q_TILE:k0 + n, :])
    return k_blk, v_blk, False


def _scores(t, kv, ko, widths, diag, q_sb, tiles, st, o, d, scale, cap_scale, mm_dtype):
    """First half of one online-softmax step of member tile t over keys [ko, ko + sum(widths)) of `kv`
    (`_load_kv`): the scores in SBUF (fp32) and the new running max. Returns (scores, nbias, alpha).

    `diag` is None, or `(masks, r)`: the last sub-tile's columns [r, r + qr) are t's own keys (causal mask).
    `cap_scale` > 0 (soft-capping): the copy out of PSUM is tanh(cap_scale * s) instead, and the causal mask is
    added after it, to the SBUF copy (VectorE; the diagonal's columns only): tanh would turn a masked score back
    into -1.

    The scores leave PSUM once: ScalarE copies each sub-tile to SBUF, and the row max (VectorE) and the exp
    (ScalarE) read that copy. On NeuronCore-v2 VectorE and ScalarE share one PSUM port, so every pass over PSUM
    is serialized with every other one; two passes per score tile (this copy and the P^T eviction) is the
    least a layout with P transposed on TensorE needs.
    """
    k_blk = kv[0]
    r0, qr = tiles[t]
    q_tile = q_sb[:, r0:r0 + qr]  # [D, qr]
    stt = st[t, 0:qr, :]
    n_sub = len(widths)
    s_sb = nl.ndarray((nl.par_dim(qr), n_sub * K_TILE), dtype=nl.float32, buffer=nl.sbuf)
    for c in nl.static_range(n_sub):
        k0, w = ko + c * K_TILE, widths[c]
        s_ps = nl.ndarray((nl.par_dim(qr), K_TILE), dtype=nl.float32, buffer=nl.psum)
        s_ps[:, 0:w] = nisa.nc_matmul(q_tile, k_blk[:, k0:k0 + w])  # [qr, w] = q^T k
        masked = diag is not None and c == n_sub - 1
        if masked:
            (ident, tri), r = diag
            rc = r - k0
        if masked and not cap_scale:
            s_ps[:, rc:rc + qr] += nisa.nc_matmul(ident[0:qr, 0:qr], tri[0:qr, 0:qr])  # += mask
        if cap_scale:
            s_sb[:, c * K_TILE:c * K_TILE + w] = nisa.activation(nl.tanh, s_ps[:, 0:w], scale=cap_scale,
                                                                 dtype=nl.float32)
            if masked:
                own = s_sb[:, c * K_TILE + rc:c * K_TILE + rc + qr]
                own[...] = nisa.tensor_tensor(own, tri[0:qr, 0:qr], nl.add, dtype=nl.float32)
        else:
            s_sb[:, c * K_TILE:c * K_TILE + w] = nisa.activation(nl.copy, s_ps[:, 0:w], dtype=nl.float32)
        stt[:, 1 + c:2 + c] = nisa.tensor_reduce(nl.maximum, s_sb[:, c * K_TILE:c * K_TILE + w], axis=(1,),
                                                 keepdims=True)
    m_new = nisa.tensor_reduce(nl.maximum, stt[:, 0:1 + n_sub], axis=(1,), keepdims=True)  # [old | sub maxes]
    nbias = nisa.activation(nl.copy, m_new, scale=-scale)  # exp(sc*s - sc*m)
    alpha = nisa.activation(nl.exp, stt[:, 0:1], bias=nbias, scale=scale)  # exp(sc * (m_old - m_new)); 0 at first
    stt[:, 0:1] = nisa.activation(nl.copy, m_new)
    return s_sb, nbias, alpha


def _softmax_pv(t, kv, ko, widths, diag, s_sb, nbias, alpha, q_sb, tiles, st, o, d, scale, cap_scale, mm_dtype):
    """Second half of the step `_scores` began: P, P @ [V | 1], and o = alpha * o + pv (in place)."""
    _, v_blk, interleaved = kv
    qr = tiles[t][1]
    pv_ps = _exp_pv(s_sb, nbias, v_blk, ko // Q_TILE, widths, interleaved, d, scale, mm_dtype)
    # o = alpha * o + pv in one VectorE instruction that reads pv in PSUM
    ot = o[t, 0:qr, :]
    ot[...] = nisa.scalar_tensor_tensor(data=ot, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=pv_ps)


def _exp_pv(s_sb, nbias, v_blk, ch0, widths, interleaved, d, scale, mm_dtype):
    """P = exp(scale * s - scale * m) per sub-tile of the SBUF scores, P^T by TensorE, and P @ [V | 1]
    accumulated in PSUM.

    In a key-interleaved block (`_load_kv`) chunk 4u + c of sub-tile u is its P's columns c:w:4.
    """
    qr = s_sb.shape[0]
    pv_ps = nl.ndarray((qr, d + 1), dtype=nl.float32, buffer=nl.psum)
    n_mm = 0
    per = K_TILE // Q_TILE
    for c in nl.static_range(len(widths)):
        w = widths[c]
        p = nisa.activation(nl.exp, s_sb[:, c * K_TILE:c * K_TILE + w], bias=nbias, scale=scale,
                            dtype=mm_dtype)  # [qr, w]
        if interleaved:
            chunks = [(p[:, j:w:per], w // per, ch0 + c * per + j) for j in range(per)]
        else:
            chunks = [(p[:, j * Q_TILE:j * Q_TILE + min(Q_TILE, w - j * Q_TILE)], min(Q_TILE, w - j * Q_TILE),
                       ch0 + c * per + j) for j in range((w + Q_TILE - 1) // Q_TILE)]
        n_mm = _pv_chunks(chunks, v_blk, pv_ps, qr, n_mm, mm_dtype)
    return pv_ps


def _pv_chunks(chunks, v_blk, pv_ps, qr, n_mm, mm_dtype):
    """Up to 4 chunks (P columns [qr, cw], width cw, V chunk index): transpose into one PSUM tile, then
    P^T chunk @ V chunk into `pv_ps`. Returns the matmul count so far (the first one overwrites)."""
    num, den = EVICT_VECTOR
    pt_ps = nl.ndarray((nl.par_dim(Q_TILE), K_TILE), dtype=nl.float32, buffer=nl.psum)
    for j in nl.static_range(len(chunks)):
        cols, cw, _ = chunks[j]
        pt_ps[0:cw, j * Q_TILE:j * Q_TILE + qr] = nisa.nc_transpose(cols)
    for j in nl.static_range(len(chunks)):
        _, cw, vc = chunks[j]
        src = pt_ps[0:cw, j * Q_TILE:j * Q_TILE + qr]  # [cw keys, qr]
        # PSUM -> SBUF copies of P^T, a fixed pattern of `num` in `den` on VectorE, the rest on ScalarE:
        # ScalarE already copies the scores out of PSUM and takes the exp, VectorE the row max (docs/kernels.md).
        if n_mm * num % den < num:
            pt = nisa.tensor_copy(src, dtype=mm_dtype, engine=nisa.vector_engine)
        else:
            pt = nisa.activation(nl.copy, src, dtype=mm_dtype)
        mm = nisa.nc_matmul(pt, v_blk[0:cw, vc, :])  # [qr, D + 1]
        if n_mm == 0:
            pv_ps[...] = mm
        else:
            pv_ps[...] += mm
        n_mm += 1
    return n_mm


def _check(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise KernelArgumentError(f"flash_attention: want q [B, n_heads, S, D] and k, v "
                                  f"[B, n_kv_heads, S, D]; "
                                  f"got q {q.shape}, k {k.shape}, v {v.shape}")
    b, n_heads, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (s, d) or n_heads % k.shape[1]:
        raise KernelArgumentError(f"flash_attention: k/v {k.shape} do not match q {q.shape} (same B, S, D; "
                                  f"n_heads a multiple of n_kv_heads)")
    if d > 128:
        raise KernelArgumentError(f"flash_attention: head dim D={d} > 128 is not supported")
    if not q.dtype == k.dtype == v.dtype or q.dtype.name not in ("float32", "bfloat16"):
        raise KernelArgumentError(f"flash_attention: q, k, v must share dtype float32 or bfloat16; "
                                  f"got {q.dtype}, {k.dtype}, {v.dtype}")


SBUF_WORKING_SET = 8 * 1024  # per-step temporaries (P, P^T copies, pv, alpha * o) and margin


def sbuf_bytes(d: int, dtype: Any) -> int:
    """SBUF bytes per partition one program holds at its peak, counted as the simulator's allocator does.

    Independent of S: Q^T of a group `[D, 512]`, the two causal masks `[128, 128]`, the group's state
    (`[128, 1 + K_BLOCK / 512]` and `[128, D + 1]` fp32 per member), at most two K/V blocks live at once
    (K^T `[D, K_BLOCK]`, V `[128, K_BLOCK / 128, D + 1]`: the key tail's and the diagonal's), the fp32 scores
    of the `LOOKAHEAD + 1` steps in flight (`[128, K_BLOCK]` each), plus `SBUF_WORKING_SET`. The allocator
    charges a tile the bytes of its free dims in every partition.
    """
    it = np.dtype(dtype).itemsize
    n_sub = K_BLOCK // K_TILE
    state = Q_GROUP * ((1 + n_sub) * 4 + (d + 1) * 4)
    kv = K_BLOCK * it + (K_BLOCK // Q_TILE) * (d + 1) * it
    scores = (LOOKAHEAD + 1) * K_BLOCK * 4
    return Q_GROUP * Q_TILE * it + 2 * Q_TILE * it + state + 2 * kv + scores + SBUF_WORKING_SET


def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool = True,
        softmax_scale: float | None = None, softcap: float | None = None) -> np.ndarray:
    """Runs the kernel on logical layouts (simulator here, the SDK's NKI where installed).

    Args:
        q: `[B, n_heads, S, D]`, float32 or bfloat16 (ml_dtypes).
        k: `[B, n_kv_heads, S, D]`, same dtype.
        v: `[B, n_kv_heads, S, D]`, same dtype.
        causal: Mask keys after each query.
        softmax_scale: Defaults to `1 / sqrt(D)`.
        softcap: Soft-cap the scaled scores, x -> softcap * tanh(x / softcap) (> 0); None: not.

    Returns:
        `[B, n_heads, S, D]` in q's dtype.

    Raises:
        KernelArgumentError: Shapes or dtypes the kernel does not support, or a softcap <= 0.
    """
    _check(q, k, v)
    check_softcap("flash_attention", softcap)
    b, n_heads, _, d = q.shape
    n_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    q_t = np.ascontiguousarray(q.transpose(0, 1, 3, 2))  # [B, n_heads, D, S]
    k_t = np.ascontiguousarray(k.transpose(0, 1, 3, 2))  # [B, n_kv_heads, D, S]
    out = simulate(flash_attention_kernel[b, n_kv, n_heads // n_kv], q_t, k_t, np.ascontiguousarray(v),
                   causal=causal, softmax_scale=scale, softcap=float(softcap or 0.0))
    return np.asarray(out)


def estimate(b: int, n_heads: int, n_kv_heads: int, s: int, d: int, *, causal: bool = True,
             target: str = "trn1", dtype: Any = None) -> Any:
    """Count-only cost Report of the simulator for one launch (no values computed).

    Args:
        b, n_heads, n_kv_heads, s, d: Problem shape, as in `run`.
        causal: Causal masking (skipped tiles are not issued, so this halves the work).
        target: `trn1`, `inf2` or `trn2`.
        dtype: Input dtype, default bfloat16.

    Returns:
        The simulator's `Report` (latency, per-engine busy time, TensorE utilisation).

    """
    dt = nl.bfloat16 if dtype is None else dtype
    grid = flash_attention_kernel[b, n_kv_heads, n_heads // n_kv_heads]
    _, rep = nki_sim.simulate_kernel(grid, nki_sim.ShapeDtype((b, n_heads, d, s), dt),
                                     nki_sim.ShapeDtype((b, n_kv_heads, d, s), dt),
                                     nki_sim.ShapeDtype((b, n_kv_heads, s, d), dt), target=target,
                                     count_only=True, report=True, causal=causal,
                                     softmax_scale=1.0 / math.sqrt(d))
    return rep


def useful_flops(b: int, n_heads: int, s: int, d: int, *, causal: bool = True) -> int:
    """Matmul FLOPs attention needs (QK^T and PV over the keys each query attends to)."""
    pairs = s * (s + 1) // 2 if causal else s * s
    return 4 * b * n_heads * d * pairs
