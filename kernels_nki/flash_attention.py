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

Tiling (per program):
    K^T `[D, S]` and V `[S, D]` (as 128-row chunks side by side) stay resident in SBUF, loaded once.
    Query tiles of 128 rows (stationary operand, `[D, 128]`); key sub-tiles of 512 (moving operand; the
    `[128, 512]` fp32 score tile is exactly one PSUM bank); sub-tiles are grouped in blocks of up to 2048 keys
    (4 banks) so that the online-softmax bookkeeping (max merge, rescale of the output) runs once per block.
    Every loop is `nl.static_range`, so tile extents are Python ints: the tail of S and the causal diagonal
    need no runtime masks, and key tiles entirely in the future of a query tile are never issued.

Pseudocode (per program, per query tile [q0, q0 + qr)):
    kend = min(S, q0 + qr) if causal else S
    for block [k0, k0 + 2048) within [0, kend):
        for sub-tile c:  s[c] = q_tile^T @ K^T[:, keys]              # TensorE -> PSUM [qr, <=512]
                         if it holds keys [q0, q0 + qr): s[c][:, those] += I^T @ tri (0 or -1e30)  # TensorE
                         mx[c] = rowmax(s[c])                         # VectorE, reads PSUM
        m_new = max(m, mx[0], ..., mx[n-1])       # one small VectorE reduce over [m | mx]
        nbias = -scale * m_new                    # GpSimd
        for sub-tile c:  p = exp(scale * s[c] + nbias)  (bf16/fp32)                          # ScalarE
                         for 128-key chunk: pT = transpose(p[:, chunk])  # TensorE -> PSUM; copy to SBUF on
                                                                         # VectorE (23/64) or ScalarE
                                            pv += pT^T @ [V | 1][chunk]  # TensorE, PSUM accumulation
        o = pv (first block)  |  o = exp(scale * (m - m_new)) * o + copy(pv)   # ScalarE copy, GpSimd math
    out[q0:q0 + qr] = o[:, :D] * (1 / o[:, D])   # o[:, D] is the running row sum l; multiply on GpSimd

    The ones column makes TensorE produce the row sums (moving free D + 1 instead of D, +1%), which is
    cheaper than ScalarE's reduce read-out and keeps the sum consistent with the bf16 P actually multiplied.
    Per 128x512 score tile the cost model's floor is ~610 ns (three passes over the scores shared by
    VectorE and ScalarE), TensorE needs 550 ns of which 366 are useful: ~60% at best (docs/kernels.md).

Constraints: D <= 128; q, k, v share one dtype (float32 or bfloat16; matmuls run in that dtype, softmax
statistics in float32). Q^T, K^T and V stay resident in SBUF: a `[D, S]` tile costs S * itemsize bytes in
each partition whatever D is, V `ceil(S / 128) * (D + 1) * itemsize`, plus the per-tile working set
(`sbuf_bytes`); against the 180224 bytes per partition a trn1 kernel may use, S <= 28560 for bf16 and D = 128
(`max_seq_len`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kernels_nki._nki import DEFAULT_TARGET, nisa, nki, nl, sbuf_capacity, simulate
from neuron_opt.errors import KernelArgumentError

Q_TILE = 128  # query rows per tile: the partition count of the score tile
K_TILE = 512  # keys per score matmul: one PSUM bank of fp32
K_BLOCK = 2048  # keys per online-softmax step (4 PSUM banks of scores)
NEG = -1.0e30  # masked score; exp(scale * NEG - m) underflows to exactly 0
# SBUF bytes per partition for the tiles of one query tile (statistics, output accumulator, P, P^T, the causal
# masks, temporaries awaiting release); the simulator counts at most 4144 (fp32, D = 128), the rest is margin.
SBUF_WORKING_SET = 8 * 1024
EVICT_VECTOR = (23, 64)  # share of P^T evictions on VectorE (the rest on ScalarE), see docs/kernels.md


@nki.jit
def flash_attention_kernel(q_t, k_t, v, causal=True, softmax_scale=1.0):
    """Launch as `flash_attention_kernel[B, n_kv_heads, G](q_t, k_t, v, causal=..., softmax_scale=...)`."""
    _, n_heads, d, s = q_t.shape
    group = n_heads // k_t.shape[1]
    out = nl.ndarray((q_t.shape[0], n_heads, s, d), dtype=q_t.dtype, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    kvh = nl.program_id(1)
    h = kvh * group + nl.program_id(2)
    mm_dtype = q_t.dtype
    n_chunks = (s + Q_TILE - 1) // Q_TILE
    dv = d + 1  # V with a ones column: P @ [V | 1] yields the output and the row sums in one matmul

    # Resident operands: all queries and keys transposed [D, S]; values as 128-row chunks side by side, each
    # chunk [128, D + 1] with its last column 1.0 (memset once, then V loaded over the first D columns).
    q_sb = nl.load(q_t[b, h])  # [D, S]
    k_sb = nl.load(k_t[b, kvh])  # [D, S]
    v_sb = nl.ones((Q_TILE, n_chunks * dv), dtype=mm_dtype, buffer=nl.sbuf)  # chunk t: keys t*128 + p
    for t in nl.static_range(n_chunks):
        rows = min(Q_TILE, s - t * Q_TILE)
        v_sb[0:rows, t * dv:t * dv + d] = nl.load(v[b, kvh, t * Q_TILE:t * Q_TILE + rows, :])

    masks = _causal_masks(mm_dtype) if causal else None
    evictions = [0]  # running count of P^T evictions, to spread them over VectorE and ScalarE
    for qi in nl.static_range(n_chunks):
        q0 = qi * Q_TILE
        qr = min(Q_TILE, s - q0)
        kend = min(s, q0 + qr) if causal else s
        q_tile = q_sb[:, q0:q0 + qr]  # [D, qr] stationary
        # Online-softmax state of this query tile: two statistics buffers swapped every block (column 0: the
        # running max before the block, columns 1..: the block's sub-tile maxes) and the unnormalised output,
        # whose last column is the running row sum.
        stats = [nl.ndarray((qr, 1 + K_BLOCK // K_TILE), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
        o = nl.ndarray((qr, dv), dtype=nl.float32, buffer=nl.sbuf)
        for blk in nl.static_range((kend + K_BLOCK - 1) // K_BLOCK):
            kb = blk * K_BLOCK
            widths = [min(K_TILE, kend - k0) for k0 in range(kb, min(kend, kb + K_BLOCK), K_TILE)]
            _block(q_tile, k_sb, v_sb, stats[blk % 2], stats[(blk + 1) % 2], o, q0, qr, kb, widths, d,
                   masks, softmax_scale, mm_dtype, blk == 0, evictions)
        # Epilogue on GpSimd (SBUF only, otherwise idle): out = o[:, :D] / l.
        inv_l = nisa.reciprocal(o[:, d:dv])
        o_out = nisa.tensor_scalar(o[:, 0:d], nl.multiply, inv_l, dtype=out.dtype, engine=nisa.gpsimd_engine)
        nl.store(out[b, h, q0:q0 + qr, :], value=o_out)
    return out


def _causal_masks(mm_dtype):
    """Identity [128, 128] and the additive causal mask of a diagonal [128, 128] block (GpSimd, once).

    Only the last key sub-tile of a query tile [q0, q0 + qr) reaches past q0 (the sub-tiles start at
    multiples of 512 <= q0 and end at q0 + qr), and in it only the keys [q0, q0 + qr) need masking:
    mask[p, f] = 0 where f <= p, else NEG. Adding `I^T @ mask` into those qr columns of the score PSUM tile
    masks them on TensorE (qr cycles), so VectorE and ScalarE read the masked scores straight from PSUM.
    """
    i_p = nl.arange(Q_TILE)[:, None]
    i_q = nl.arange(Q_TILE)[None, :]
    ones = nl.ones((Q_TILE, Q_TILE), dtype=mm_dtype, buffer=nl.sbuf)
    ident = nisa.affine_select(i_p >= i_q, nisa.affine_select(i_p <= i_q, ones, 0.0), 0.0)
    zeros = nl.zeros((Q_TILE, Q_TILE), dtype=mm_dtype, buffer=nl.sbuf)
    tri = nisa.affine_select(i_p >= i_q, zeros, NEG)
    return ident, tri


def _block(q_tile, k_sb, v_sb, st_old, st_new, o, q0, qr, kb, widths, d, masks, scale, mm_dtype, first,
           evictions):
    """One online-softmax step of a query tile over the keys [kb, kb + sum(widths)).

    `st_old[:, 0]` holds the running max before this block (unless `first`); the block's sub-tile maxes go to
    `st_old[:, 1:]` and the new running max to `st_new[:, 0]`. Updates `o` in place. `masks` is
    `_causal_masks(...)` for causal attention, else None.
    """
    n_sub = len(widths)
    s_ps = nl.ndarray((n_sub, nl.par_dim(qr), K_TILE), dtype=nl.float32, buffer=nl.psum)
    scores = []
    for c in nl.static_range(n_sub):
        k0, w = kb + c * K_TILE, widths[c]
        s_ps[c, :, 0:w] = nisa.nc_matmul(q_tile, k_sb[:, k0:k0 + w])  # [qr, w] = q^T k
        if masks is not None and k0 + w - 1 > q0:  # the diagonal block: keys [q0, q0 + qr) = columns r..
            r = q0 - k0
            s_ps[c, :, r:r + qr] += nisa.nc_matmul(masks[0][0:qr, 0:qr], masks[1][0:qr, 0:qr])  # += mask
        scores.append(s_ps[c, :, 0:w])
        st_old[:, 1 + c:2 + c] = nisa.tensor_reduce(nl.maximum, scores[c], axis=(1,), keepdims=True)
    # New running max = max over [old max | sub-tile maxes] in one small reduce (no separate max merge).
    lo = 1 if first else 0
    st_new[:, 0:1] = nisa.tensor_reduce(nl.maximum, st_old[:, lo:1 + n_sub], axis=(1,), keepdims=True)
    m_new = st_new[:, 0:1]
    nbias = nisa.tensor_scalar(m_new, nl.multiply, -scale, engine=nisa.gpsimd_engine)  # exp(sc*s - sc*m)
    pv_ps = _exp_pv(scores, nbias, v_sb, kb, widths, d, scale, mm_dtype, evictions)
    if first:
        o[...] = nisa.activation(nl.copy, pv_ps, dtype=nl.float32)
        return
    alpha = nisa.activation(nl.exp, st_old[:, 0:1], bias=nbias, scale=scale)  # exp(sc * (m_old - m_new))
    # o = alpha * o + pv: ScalarE moves pv out of PSUM (the only PSUM read), GpSimd does the arithmetic.
    pv_sb = nisa.activation(nl.copy, pv_ps, dtype=nl.float32)
    o_scaled = nisa.tensor_scalar(o, nl.multiply, alpha, engine=nisa.gpsimd_engine)
    o[...] = nisa.tensor_tensor(o_scaled, pv_sb, nl.add, engine=nisa.gpsimd_engine)


def _exp_pv(scores, nbias, v_sb, kb, widths, d, scale, mm_dtype, evictions):
    """P = exp(scale * s - scale * m) per sub-tile, P^T by TensorE, and P @ [V | 1] accumulated in PSUM."""
    qr = scores[0].shape[0]
    dv = d + 1
    pv_ps = nl.ndarray((qr, dv), dtype=nl.float32, buffer=nl.psum)
    n_mm = 0
    for c in nl.static_range(len(widths)):
        w = widths[c]
        p = nisa.activation(nl.exp, scores[c], bias=nbias, scale=scale, dtype=mm_dtype)  # [qr, w]
        pt_ps = nl.ndarray((nl.par_dim(Q_TILE), K_TILE), dtype=nl.float32, buffer=nl.psum)
        for j in nl.static_range((w + Q_TILE - 1) // Q_TILE):
            cw = min(Q_TILE, w - j * Q_TILE)
            pt_ps[0:cw, j * Q_TILE:j * Q_TILE + qr] = nisa.nc_transpose(p[:, j * Q_TILE:j * Q_TILE + cw])
        for j in nl.static_range((w + Q_TILE - 1) // Q_TILE):
            cw = min(Q_TILE, w - j * Q_TILE)
            kt = (kb + c * K_TILE) // Q_TILE + j
            src = pt_ps[0:cw, j * Q_TILE:j * Q_TILE + qr]  # [cw keys, qr]
            # PSUM -> SBUF copies of P^T, EVICT_VECTOR[0] of every EVICT_VECTOR[1] on VectorE and the rest on
            # ScalarE: VectorE already does the row max, ScalarE the exp (see docs/kernels.md).
            num, den = EVICT_VECTOR
            if evictions[0] * num % den < num:
                pt = nisa.tensor_copy(src, dtype=mm_dtype, engine=nisa.vector_engine)
            else:
                pt = nisa.activation(nl.copy, src, dtype=mm_dtype)
            evictions[0] += 1
            mm = nisa.nc_matmul(pt, v_sb[0:cw, kt * dv:(kt + 1) * dv])  # [qr, D + 1]
            if n_mm == 0:
                pv_ps[...] = mm
            else:
                pv_ps[...] += mm
            n_mm += 1
    return pv_ps


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
    _check_sbuf(s, d, q.dtype, DEFAULT_TARGET)


def sbuf_bytes(s: int, d: int, dtype: Any) -> int:
    """SBUF bytes per partition one program holds at its peak, counted as the simulator's allocator does.

    The allocator charges a tile the bytes of its free dims in every partition: Q^T and K^T `[D, S]` cost
    S * itemsize each, V `[128, n_chunks * (D + 1)]` n_chunks * (D + 1) * itemsize; then `SBUF_WORKING_SET`.
    """
    itemsize = np.dtype(dtype).itemsize
    n_chunks = (s + Q_TILE - 1) // Q_TILE
    return 2 * s * itemsize + n_chunks * (d + 1) * itemsize + SBUF_WORKING_SET


def max_seq_len(d: int, dtype: Any, target: str = DEFAULT_TARGET) -> int:
    """Longest S whose `sbuf_bytes` fit the SBUF a kernel may use on `target`."""
    cap = sbuf_capacity(target)
    lo, hi = 0, cap  # sbuf_bytes grows with S and exceeds cap at S = cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sbuf_bytes(mid, d, dtype) <= cap else (lo, mid)
    return lo


def _check_sbuf(s: int, d: int, dtype: Any, target: str) -> None:
    need, cap = sbuf_bytes(s, d, dtype), sbuf_capacity(target)
    if need > cap:
        raise KernelArgumentError(f"flash_attention: S={s}, D={d}, {np.dtype(dtype).name} needs {need} SBUF bytes "
                                  f"per partition (Q^T, K^T and V resident plus the working set), more than the "
                                  f"{cap} a kernel may use on {target}; S <= {max_seq_len(d, dtype, target)} fits")


def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool = True,
        softmax_scale: float | None = None) -> np.ndarray:
    """Runs the kernel on logical layouts (simulator here, the SDK's NKI where installed).

    Args:
        q: `[B, n_heads, S, D]`, float32 or bfloat16 (ml_dtypes).
        k: `[B, n_kv_heads, S, D]`, same dtype.
        v: `[B, n_kv_heads, S, D]`, same dtype.
        causal: Mask keys after each query.
        softmax_scale: Defaults to `1 / sqrt(D)`.

    Returns:
        `[B, n_heads, S, D]` in q's dtype.

    Raises:
        KernelArgumentError: Shapes or dtypes the kernel does not support, or S too long for SBUF on the
            simulator's default target (`max_seq_len`).
    """
    _check(q, k, v)
    b, n_heads, _, d = q.shape
    n_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    q_t = np.ascontiguousarray(q.transpose(0, 1, 3, 2))  # [B, n_heads, D, S]
    k_t = np.ascontiguousarray(k.transpose(0, 1, 3, 2))  # [B, n_kv_heads, D, S]
    out = simulate(flash_attention_kernel[b, n_kv, n_heads // n_kv], q_t, k_t, np.ascontiguousarray(v),
                   causal=causal, softmax_scale=scale)
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

    Raises:
        KernelArgumentError: S too long for SBUF on `target` (`max_seq_len`).
    """
    from neuron_opt import nki_sim

    dt = nl.bfloat16 if dtype is None else dtype
    _check_sbuf(s, d, dt, target)
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
