"""Numpy reference for kernels_nki/matmul.py: the product in fp32, rounded once to the input dtype."""

from __future__ import annotations

import numpy as np


def matmul_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`a[M, K] @ b[K, N]` computed in fp32, returned in a's dtype."""
    out = a.astype(np.float32) @ b.astype(np.float32)  # [M, N]
    return out.astype(a.dtype)
