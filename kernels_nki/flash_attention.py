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
                         if the sub-tile crosses the diagonal: s[c] = where(q >= k, s[c], -1e30)  # GpSimd
                         mx[c] = rowmax(s[c])                         # VectorE, reads PSUM
        m_new = max(m, max_c mx[c]);  alpha = exp(scale * (m - m_new))
        for sub-tile c:  p = exp(scale * s[c] - scale * m_new)  (bf16/fp32), rowsum -> rs[c]   # ScalarE
                         for 128-key chunk: pT = transpose(p[:, chunk])  # TensorE -> PSUM, copy to SBUF
                                            pv += pT^T @ V[chunk]        # TensorE, PSUM accumulation
        l = alpha * l + sum_c rs[c];  o = alpha * o + pv
    out[q0:q0 + qr] = o / l

Constraints: D <= 128; q, k, v share one dtype (float32 or bfloat16; matmuls run in that dtype, softmax
statistics in float32); K^T and V resident in SBUF: S * D * itemsize / 64 bytes per partition (S <= 32768
for bf16 D = 128).
"""

from __future__ import annotations

import math

import numpy as np

from kernels_nki._nki import nisa, nki, nl, simulate
from neuron_opt.errors import KernelArgumentError

Q_TILE = 128  # query rows per tile: the partition count of the score tile
K_TILE = 512  # keys per score matmul: one PSUM bank of fp32
K_BLOCK = 2048  # keys per online-softmax step (4 PSUM banks of scores)
NEG = -1.0e30  # masked score; exp(scale * NEG - m) underflows to exactly 0
SBUF_KV_BUDGET = 128 * 1024  # bytes per partition we allow for resident K^T and V


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

    # Resident operands: all queries and keys transposed [D, S], values as 128-row chunks side by side.
    q_sb = nl.load(q_t[b, h])  # [D, S]
    k_sb = nl.load(k_t[b, kvh])  # [D, S]
    v_sb = nl.ndarray((Q_TILE, n_chunks * d), dtype=mm_dtype, buffer=nl.sbuf)  # chunk t: keys t*128 + p
    for t in nl.static_range(n_chunks):
        rows = min(Q_TILE, s - t * Q_TILE)
        v_sb[0:rows, t * d:(t + 1) * d] = nl.load(v[b, kvh, t * Q_TILE:t * Q_TILE + rows, :])

    for qi in nl.static_range(n_chunks):
        q0 = qi * Q_TILE
        qr = min(Q_TILE, s - q0)
        kend = min(s, q0 + qr) if causal else s
        q_tile = q_sb[:, q0:q0 + qr]  # [D, qr] stationary
        # Online-softmax state of this query tile, updated in place block after block.
        m = nl.ndarray((qr, 1), dtype=nl.float32, buffer=nl.sbuf)
        l_sum = nl.ndarray((qr, 1), dtype=nl.float32, buffer=nl.sbuf)
        o = nl.ndarray((qr, d), dtype=nl.float32, buffer=nl.sbuf)
        for blk in nl.static_range((kend + K_BLOCK - 1) // K_BLOCK):
            kb = blk * K_BLOCK
            widths = [min(K_TILE, kend - k0) for k0 in range(kb, min(kend, kb + K_BLOCK), K_TILE)]
            _block(q_tile, k_sb, v_sb, m, l_sum, o, q0, qr, kb, widths, d, causal, softmax_scale, mm_dtype,
                   first=blk == 0)
        inv_l = nisa.reciprocal(l_sum)
        o_out = nl.multiply(o, inv_l, dtype=out.dtype)
        nl.store(out[b, h, q0:q0 + qr, :], value=o_out)
    return out


def _block(q_tile, k_sb, v_sb, m, l_sum, o, q0, qr, kb, widths, d, causal, scale, mm_dtype, first):
    """One online-softmax step of a query tile over the keys [kb, kb + sum(widths)); updates m, l_sum, o."""
    n_sub = len(widths)
    # A sub-tile needs the causal mask when its last key is after the tile's first query.
    masked = [causal and kb + c * K_TILE + widths[c] - 1 > q0 for c in range(n_sub)]
    s_ps = nl.ndarray((n_sub, nl.par_dim(qr), K_TILE), dtype=nl.float32, buffer=nl.psum)
    if any(masked):
        s_sb = nl.ndarray((n_sub, nl.par_dim(qr), K_TILE), dtype=nl.float32, buffer=nl.sbuf)
    scores = []  # per sub-tile: the PSUM tile, or its masked SBUF copy on the diagonal
    mx = nl.ndarray((qr, n_sub), dtype=nl.float32, buffer=nl.sbuf)
    for c in nl.static_range(n_sub):
        k0, w = kb + c * K_TILE, widths[c]
        s_ps[c, :, 0:w] = nisa.nc_matmul(q_tile, k_sb[:, k0:k0 + w])  # [qr, w] = q^T k
        sc = s_ps[c, :, 0:w]
        if masked[c]:
            i_p = nl.arange(qr)[:, None]
            i_f = nl.arange(w)[None, :]
            s_sb[c, :, 0:w] = nl.copy(sc)  # GpSimd cannot read PSUM
            s_sb[c, :, 0:w] = nisa.affine_select(q0 + i_p >= k0 + i_f, s_sb[c, :, 0:w], NEG)
            sc = s_sb[c, :, 0:w]
        scores.append(sc)
        mx[:, c:c + 1] = nisa.tensor_reduce(nl.maximum, sc, axis=(1,), keepdims=True)
    m_blk = nisa.tensor_reduce(nl.maximum, mx, axis=(1,), keepdims=True) if n_sub > 1 else mx
    alpha = nl.ndarray((qr, 1), dtype=nl.float32, buffer=nl.sbuf)
    if first:
        m[...] = nl.copy(m_blk)
    else:
        m_new = nl.maximum(m, m_blk)
        alpha[...] = nisa.activation(nl.exp, m, bias=nl.multiply(m_new, -scale), scale=scale)
        m[...] = nl.copy(m_new)
    nbias = nl.multiply(m, -scale)  # exp(scale * s - scale * m)

    rs = nl.ndarray((qr, n_sub), dtype=nl.float32, buffer=nl.sbuf)
    pv_ps = nl.zeros((qr, d), dtype=nl.float32, buffer=nl.psum)
    for c in nl.static_range(n_sub):
        w = widths[c]
        p = nisa.activation_reduce(nl.exp, scores[c], reduce_op=nl.add, reduce_res=rs[:, c:c + 1],
                                   bias=nbias, scale=scale, dtype=mm_dtype)  # [qr, w]
        pt_ps = nl.ndarray((nl.par_dim(Q_TILE), K_TILE), dtype=nl.float32, buffer=nl.psum)
        for j in nl.static_range((w + Q_TILE - 1) // Q_TILE):
            cw = min(Q_TILE, w - j * Q_TILE)
            pt_ps[0:cw, j * Q_TILE:j * Q_TILE + qr] = nisa.nc_transpose(p[:, j * Q_TILE:j * Q_TILE + cw])
        for j in nl.static_range((w + Q_TILE - 1) // Q_TILE):
            cw = min(Q_TILE, w - j * Q_TILE)
            kt = (kb + c * K_TILE) // Q_TILE + j
            src = pt_ps[0:cw, j * Q_TILE:j * Q_TILE + qr]  # [cw keys, qr]
            if (c * 4 + j) % 8 in (0, 3, 6):  # 3/8 of the evictions on VectorE, 5/8 on ScalarE: balance
                pt = nisa.tensor_copy(src, dtype=mm_dtype, engine=nisa.vector_engine)
            else:
                pt = nisa.activation(nl.copy, src, dtype=mm_dtype)
            pv_ps[...] += nisa.nc_matmul(pt, v_sb[0:cw, kt * d:(kt + 1) * d])  # [qr, D]

    rs_sum = nisa.tensor_reduce(nl.add, rs, axis=(1,), keepdims=True) if n_sub > 1 else rs
    if first:
        l_sum[...] = nl.copy(rs_sum)
        o[...] = nl.copy(pv_ps)
    else:
        l_sum[...] = nisa.scalar_tensor_tensor(data=l_sum, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                               operand1=rs_sum)
        o[...] = nisa.scalar_tensor_tensor(data=o, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=pv_ps)


def _check(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise KernelArgumentError(f"flash_attention: want q [B, n_heads, S, D] and k, v [B, n_kv_heads, S, D]; "
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
    resident = 2 * s * d * q.dtype.itemsize // 128
    if resident > SBUF_KV_BUDGET:
        raise KernelArgumentError(f"flash_attention: K and V of S={s}, D={d} need {resident} SBUF bytes per "
                                  f"partition (limit {SBUF_KV_BUDGET}); shorten S")


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
        KernelArgumentError: Shapes or dtypes the kernel does not support.
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
