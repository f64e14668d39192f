"""Decode attention (one new token per sequence) against a KV cache, flash-decoding split, legacy NKI API.

Dimensions:
    B batch, n_heads query heads, n_kv_heads KV heads, G = n_heads // n_kv_heads query heads per KV head,
    S_max cache capacity, D head dim <= 128, lengths[b] in [1, S_max] valid positions of sequence b.

Kernel layouts (HBM):
    q_t      `[B, n_kv_heads, D, G]`      the G query heads of one KV group, transposed (D on partitions)
    k_t      `[B, n_kv_heads, D, S_max]`  K cache stored transposed, so score tiles need no transpose
    v        `[B, n_kv_heads, S_max, D]`  V cache, natural
    lengths  `[B, 1]` int32
    out      `[B, n_kv_heads, G, D]`
    `run(...)` takes `[B, n_heads, D]` queries and `[B, n_kv_heads, S_max, D]` caches and converts.

Launch: SPMD grid `[B, n_kv_heads]`. All G query heads of a KV group are processed together: they are the
free dim of the stationary operand (`[D, G]`), so each K/V tile is read from HBM once per group.

Flash-decoding: the cache is cut into splits of `split_size` positions. Each split computes, independently
of the others, its partial row max m_s, partial sum l_s = sum exp(scale*(x - m_s)) and unnormalised output
o_s = sum exp(scale*(x - m_s)) v; the splits are merged at the end:
    M = max_s m_s,  w_s = exp(scale*(m_s - M)),  out = sum_s w_s o_s / sum_s w_s l_s.
Independent splits carry no loop dependency (unlike a running online softmax), so the compiler may overlap
them; the same partials are what a sequence-sharded (multi-core) decode would exchange.

Length mask: positions >= lengths[b] get at most -1e30 added to their scores. On one partition,
past = relu(pos - len + 1) (GpSimd iota, one ScalarE activation) is 0 for valid positions and >= 1 past the
length; a second matmul accumulating into the score PSUM tile adds NEG * past to each of the G rows
(stationary = a [1, G] row of NEG), the TensorE partition-broadcast idiom. Scores stay in PSUM: VectorE
takes the row max and ScalarE the exp straight from there. A split entirely past the length gets
m_s <= -1e30 and merge weight exactly 0.

Pseudocode (per program = (b, kv head)):
    for split s: for tile [k0, k0 + w) (w <= 512):
            sc[:, tile] = q^T K^T[:, tile] + NEG^T relu(k0 + iota - len + 1)  # PSUM [G, w]
        m_s = rowmax(sc);  p = exp(scale*sc - scale*m_s) (rowsum -> l_s)
        V[tile] in one DMA as [128, w / 128, D];  for 128-position chunk: o_s += transpose(p[:, chunk])^T @ V[chunk]
    merge as above; store [G, D].

Constraints: D <= 128, G <= 128, split_size a multiple of 128 and, above 512, of 512, at most 3584 (a split's
scores take split_size / 512 PSUM banks, the P @ V accumulator one more, of 8); q and caches share float32 or
bfloat16; lengths[b] >= 1. All splits up to S_max are computed (lengths are runtime data). Every split's fp32
partial output and statistics stay in SBUF until the merge: about n_splits * (D + 4) * 4 bytes per partition
plus the working set (`sbuf_bytes`), so S_max <= 41600 for D = 128 and split_size = 128 on trn1
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
# SBUF bytes per partition for the tiles of one split (K tile, positions, P, P^T, V tile, row maxes and sums,
# the [D, G] queries); the simulator counts at most 7208 (fp32, G = 128), the rest is margin.
SBUF_WORKING_SET = 8 * 1024


@nki.jit
def decode_attention_kernel(q_t, k_t, v, lengths, softmax_scale=1.0, split_size=512):
    """Launch as `decode_attention_kernel[B, n_kv_heads](q_t, k_t, v, lengths, softmax_scale=..., ...)`."""
    n_b, n_kv, d, g = q_t.shape
    s_max = k_t.shape[3]
    out = nl.ndarray((n_b, n_kv, g, d), dtype=q_t.dtype, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    kvh = nl.program_id(1)
    mm_dtype = q_t.dtype
    tile = min(K_TILE, split_size)
    n_splits = (s_max + split_size - 1) // split_size

    q_sb = nl.load(q_t[b, kvh])  # [D, G] stationary
    len_f = nisa.tensor_copy(nl.load(lengths[nl.ds(b, 1), :]), dtype=nl.float32)  # [1, 1]
    one_minus_len = nl.multiply(nl.add(len_f, -1.0), -1.0)  # [1, 1]: 1 - len
    neg_row = nl.full((1, g), NEG, dtype=mm_dtype, buffer=nl.sbuf)

    m_all = nl.ndarray((g, n_splits), dtype=nl.float32, buffer=nl.sbuf)
    l_all = nl.ndarray((g, n_splits), dtype=nl.float32, buffer=nl.sbuf)
    o_all = nl.ndarray((g, n_splits * d), dtype=nl.float32, buffer=nl.sbuf)
    for sp in nl.static_range(n_splits):
        s0 = sp * split_size
        sw = min(split_size, s_max - s0)
        n_t = (sw + tile - 1) // tile
        s_ps = nl.ndarray((n_t, nl.par_dim(g), tile), dtype=nl.float32, buffer=nl.psum)  # scores stay in PSUM
        mx = nl.ndarray((g, n_t), dtype=nl.float32, buffer=nl.sbuf)
        for t in nl.static_range(n_t):
            k0 = s0 + t * tile
            w = min(tile, s_max - k0)
            k_sb = nl.load(k_t[b, kvh, :, k0:k0 + w])  # [D, w]
            pos = nisa.iota(k0 + nl.arange(w)[None, :], dtype=nl.float32)  # [1, w] positions
            # relu(pos - len + 1): 0 where pos < len, >= 1 past it (ScalarE); times the NEG row below.
            past = nisa.activation(nl.relu, pos, bias=one_minus_len, scale=1.0, dtype=mm_dtype)
            s_ps[t, :, 0:w] = nisa.nc_matmul(q_sb, k_sb)  # [G, w]
            s_ps[t, :, 0:w] += nisa.nc_matmul(neg_row, past)  # + NEG * past, broadcast to the G rows
            mx[:, t:t + 1] = nisa.tensor_reduce(nl.maximum, s_ps[t, :, 0:w], axis=(1,), keepdims=True)
        m_s = m_all[:, sp:sp + 1]
        m_s[...] = nisa.tensor_reduce(nl.maximum, mx, axis=(1,), keepdims=True) if n_t > 1 else mx
        nbias = nisa.activation(nl.copy, m_s, scale=-softmax_scale)  # -scale * m_s
        ls = nl.ndarray((g, n_t), dtype=nl.float32, buffer=nl.sbuf)
        o_ps = nl.ndarray((g, d), dtype=nl.float32, buffer=nl.psum)
        for t in nl.static_range(n_t):
            w = min(tile, s_max - s0 - t * tile)
            p = nisa.activation_reduce(nl.exp, s_ps[t, :, 0:w], reduce_op=nl.add, reduce_res=ls[:, t:t + 1],
                                       bias=nbias, scale=softmax_scale, dtype=mm_dtype)  # [G, w]
            v_sb = _load_v(v, b, kvh, s0 + t * tile, w)  # [128, ceil(w / 128), D]: chunk j = positions j*128 + p
            for j in nl.static_range((w + P_CHUNK - 1) // P_CHUNK):
                c0 = j * P_CHUNK
                cw = min(P_CHUNK, w - c0)
                pt_ps = nisa.nc_transpose(p[:, c0:c0 + cw])  # [cw, G] in PSUM
                # PSUM -> SBUF copy alternating VectorE (row maxes, the busiest engine) and ScalarE (the exp).
                if j % 2:
                    pt = nisa.activation(nl.copy, pt_ps, dtype=mm_dtype)
                else:
                    pt = nisa.tensor_copy(pt_ps, dtype=mm_dtype, engine=nisa.vector_engine)
                if t == 0 and j == 0:
                    o_ps[...] = nisa.nc_matmul(pt, v_sb[0:cw, j, :])  # [G, D]
                else:
                    o_ps[...] += nisa.nc_matmul(pt, v_sb[0:cw, j, :])
        l_all[:, sp:sp + 1] = nisa.tensor_reduce(nl.add, ls, axis=(1,), keepdims=True) if n_t > 1 else ls
        o_all[:, sp * d:(sp + 1) * d] = nl.copy(o_ps)

    # Merge the splits' partial softmax results.
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
    return out


def _load_v(v, b, kvh, k0, w):
    """V rows [k0, k0 + w) as `[128, ceil(w / 128), D]` in one DMA for the full chunks (one more for a tail)."""
    d = v.shape[3]
    n_ch = (w + P_CHUNK - 1) // P_CHUNK
    full = w // P_CHUNK
    v_sb = nl.ndarray((P_CHUNK, n_ch, d), dtype=v.dtype, buffer=nl.sbuf)
    if full:
        i_p, i_c, i_d = nl.mgrid[0:P_CHUNK, 0:full, 0:d]
        v_sb[:, 0:full, :] = nl.load(v[b, kvh, k0 + i_c * P_CHUNK + i_p, i_d])
    if w % P_CHUNK:
        v_sb[0:w % P_CHUNK, full, :] = nl.load(v[b, kvh, k0 + full * P_CHUNK:k0 + w, :])
    return v_sb


def _check(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray,
           split_size: int) -> None:
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise KernelArgumentError(f"decode_attention: want q [B, n_heads, D], caches "
                                  f"[B, n_kv_heads, S_max, D]; "
                                  f"got q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    b, n_heads, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or n_heads % k_cache.shape[1]:
        raise KernelArgumentError(f"decode_attention: caches {k_cache.shape} do not match q {q.shape}")
    if d > 128 or n_heads // k_cache.shape[1] > 128:
        raise KernelArgumentError(f"decode_attention: need D <= 128 and <= 128 query heads per KV head; "
                                  f"got D={d}, G={n_heads // k_cache.shape[1]}")
    if not q.dtype == k_cache.dtype == v_cache.dtype or q.dtype.name not in ("float32", "bfloat16"):
        raise KernelArgumentError(f"decode_attention: q and caches must share float32 or bfloat16; got "
                                  f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if lengths.shape != (b,) or lengths.min() < 1 or lengths.max() > k_cache.shape[2]:
        raise KernelArgumentError(f"decode_attention: lengths must be [B]={b} values in [1, S_max="
                                  f"{k_cache.shape[2]}]; got {lengths.tolist()}")
    max_split = (get_target(DEFAULT_TARGET).psum_banks - 1) * K_TILE
    if split_size % P_CHUNK or (split_size > K_TILE and split_size % K_TILE) or split_size > max_split:
        raise KernelArgumentError(f"decode_attention: split_size {split_size} must be a multiple of 128 "
                                  f"(and of 512 above 512), at most {max_split} (its scores stay in PSUM)")
    _check_sbuf(k_cache.shape[2], d, split_size, DEFAULT_TARGET)


def sbuf_bytes(s_max: int, d: int, split_size: int) -> int:
    """SBUF bytes per partition one program holds at its peak, counted as the simulator's allocator does.

    The allocator charges a tile the bytes of its free dims in every partition: the per-split maxes and sums
    `[G, n_splits]` and outputs `[G, n_splits * D]`, all fp32, plus the merge's weights and weighted sums (two
    more `[G, n_splits]`) cost n_splits * (D + 4) * 4; then `SBUF_WORKING_SET`.
    """
    n_splits = (s_max + split_size - 1) // split_size
    return n_splits * (d + 4) * 4 + SBUF_WORKING_SET


def max_cache_len(d: int, split_size: int, target: str = DEFAULT_TARGET) -> int:
    """Longest S_max whose `sbuf_bytes` fit the SBUF a kernel may use on `target`."""
    return (sbuf_capacity(target) - SBUF_WORKING_SET) // ((d + 4) * 4) * split_size


def _check_sbuf(s_max: int, d: int, split_size: int, target: str) -> None:
    need, cap = sbuf_bytes(s_max, d, split_size), sbuf_capacity(target)
    if need > cap:
        raise KernelArgumentError(f"decode_attention: S_max={s_max} with split_size={split_size} and D={d} needs "
                                  f"{need} SBUF bytes per partition (each split's fp32 output and statistics "
                                  f"stay resident until the merge), more than the {cap} a kernel may use on "
                                  f"{target}; S_max <= {max_cache_len(d, split_size, target)} fits, or raise "
                                  f"split_size")


def run(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray, *,
        softmax_scale: float | None = None, split_size: int = 512) -> np.ndarray:
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
    q_g = q.reshape(b, n_kv, n_heads // n_kv, d)  # [B, n_kv_heads, G, D]
    q_t = np.ascontiguousarray(q_g.transpose(0, 1, 3, 2))  # [B, n_kv_heads, D, G]
    k_t = np.ascontiguousarray(k_cache.transpose(0, 1, 3, 2))  # [B, n_kv_heads, D, S_max]
    lens = lengths.astype(np.int32).reshape(b, 1)  # [B, 1]
    out = simulate(decode_attention_kernel[b, n_kv], q_t, k_t, np.ascontiguousarray(v_cache), lens,
                   softmax_scale=scale, split_size=split_size)
    return np.asarray(out).reshape(b, n_heads, d)  # [B, n_kv, G, D] -> [B, n_heads, D]


def estimate(b: int, n_heads: int, n_kv_heads: int, s_max: int, d: int, *, split_size: int = 512,
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
                                     nki_sim.ShapeDtype((b, n_kv_heads, d, g), dt),
                                     nki_sim.ShapeDtype((b, n_kv_heads, d, s_max), dt),
                                     nki_sim.ShapeDtype((b, n_kv_heads, s_max, d), dt),
                                     nki_sim.ShapeDtype((b, 1), nl.int32), target=target, count_only=True,
                                     report=True, softmax_scale=1.0 / math.sqrt(d), split_size=split_size)
    return rep
