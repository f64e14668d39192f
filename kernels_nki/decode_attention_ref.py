"""Reference for `decode_attention.py`: one query token per sequence against a KV cache, float64 numpy."""

from __future__ import annotations

import numpy as np


def decode_attention_ref(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray, *,
                         softmax_scale: float | None = None, softcap: float | None = None) -> np.ndarray:
    """Attention of each sequence's new token over the first `lengths[b]` cache positions.

    Args:
        q: `[B, n_heads, D]`.
        k_cache: `[B, n_kv_heads, S_max, D]`.
        v_cache: `[B, n_kv_heads, S_max, D]`.
        lengths: `[B]` valid positions per sequence, 1 <= lengths[b] <= S_max.
        softmax_scale: Defaults to `1 / sqrt(D)`.
        softcap: Scaled scores x -> softcap * tanh(x / softcap) before the softmax (Gemma 2); None: as they are.

    Returns:
        `[B, n_heads, D]` float64.
    """
    b, n_heads, d = q.shape
    group = n_heads // k_cache.shape[1]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    out = np.empty((b, n_heads, d), dtype=np.float64)
    for i in range(b):
        n = int(lengths[i])
        k = np.repeat(k_cache[i, :, :n].astype(np.float64), group, axis=0)  # [n_heads, n, D]
        v = np.repeat(v_cache[i, :, :n].astype(np.float64), group, axis=0)  # [n_heads, n, D]
        scores = scale * np.einsum("hd,hkd->hk", q[i].astype(np.float64), k)  # [n_heads, n]
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[i] = np.einsum("hk,hkd->hd", p / p.sum(axis=-1, keepdims=True), v)
    return out


def paged_decode_attention_ref(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                               lengths: np.ndarray, *, softmax_scale: float | None = None,
                               softcap: float | None = None) -> np.ndarray:
    """`decode_attention_ref` over a block cache: sequence b's positions [i * block_len, (i + 1) * block_len) are
    block `block_tables[b, i]` of `k_cache` / `v_cache` `[num_blocks, n_kv_heads, block_len, D]`.

    Returns:
        `[B, n_heads, D]` float64.
    """
    n_kv, block_len, d = k_cache.shape[1:]
    b, max_blocks = block_tables.shape

    def contiguous(cache: np.ndarray) -> np.ndarray:  # [B, max_blocks, n_kv, bl, D] -> [B, n_kv, S, D]
        return cache[block_tables].transpose(0, 2, 1, 3, 4).reshape(b, n_kv, max_blocks * block_len, d)

    return decode_attention_ref(q, contiguous(k_cache), contiguous(v_cache), lengths, softmax_scale=softmax_scale,
                                softcap=softcap)
