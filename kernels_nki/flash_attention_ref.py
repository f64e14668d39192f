"""Reference for `flash_attention.py`: plain softmax attention in float64 numpy, independent of the kernel."""

from __future__ import annotations

import numpy as np


def flash_attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool = True,
                        softmax_scale: float | None = None, query_rows: np.ndarray | None = None,
                        softcap: float | None = None) -> np.ndarray:
    """softmax(cap(scale * q @ k^T) [+ causal mask]) @ v, with grouped KV heads.

    Args:
        q: `[B, n_heads, S, D]`.
        k: `[B, n_kv_heads, S, D]`, `n_heads % n_kv_heads == 0`.
        v: `[B, n_kv_heads, S, D]`.
        causal: Query i attends to keys 0..i only.
        softmax_scale: Defaults to `1 / sqrt(D)`.
        query_rows: Only these query positions (sorted or not), for sequences whose full score matrix would
            not fit in memory.
        softcap: cap(x) = softcap * tanh(x / softcap) (Gemma 2's soft-capping); None: cap(x) = x.

    Returns:
        `[B, n_heads, S, D]` float64, or `[B, n_heads, len(query_rows), D]`.
    """
    b, n_heads, s, d = q.shape
    group = n_heads // k.shape[1]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    rows = np.arange(s) if query_rows is None else np.asarray(query_rows)
    qf = q[:, :, rows].astype(np.float64)
    kf = np.repeat(k.astype(np.float64), group, axis=1)  # [B, n_heads, S, D]
    vf = np.repeat(v.astype(np.float64), group, axis=1)  # [B, n_heads, S, D]
    scores = scale * np.einsum("bhqd,bhkd->bhqk", qf, kf)  # [B, n_heads, rows, S]
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if causal:
        future = np.arange(s)[None, :] > rows[:, None]
        scores = np.where(future, -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, vf)  # [B, n_heads, S, D]
