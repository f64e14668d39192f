"""The three less optimised matmul kernels of the NKI matrix-multiplication tutorial, for cost-model calibration.

The tutorial (aws-neuron-sdk `general/nki/tutorials/matrix_multiplication.rst`, nki.md 4.4) times four
kernels on [4096, 8192] @ [8192, 8192] bf16 on one trn1 NeuronCore: 51.80 ms (tiled), 42.96 ms (loads hoisted),
22.07 ms (free dimensions blocked) and 6.97 ms (all dimensions blocked, our `kernels_nki/matmul.py`). The four
differ only in how often each input tile is loaded and in which DMA shapes, so they pin down the DMA side of
the cost model; the loop structures below follow the tutorial's description (what is loaded where, tile sizes,
block sizes). Layouts as in matmul.py: lhsT `[K, M]`, rhs `[K, N]`, result `[M, N]` in the dtype of lhsT;
M % 128 == 0 (% 256 for the blocked one), K % 128 == 0, N % 512 == 0 (% 1024 blocked).
"""

from __future__ import annotations

from typing import Any

from kernels_nki._nki import nki, nl, simulate
from neuron_opt.errors import KernelArgumentError

TILE_M, TILE_K, TILE_N = 128, 128, 512
PUBLISHED_MS = {"tiled": 51.80, "hoisted": 42.96, "block_free": 22.07, "blocked": 6.97}  # trn1, nki.md 4.4


def _store(result, ps, m0, n0):
    res = nl.copy(ps, dtype=result.dtype)
    nl.store(result[m0:m0 + TILE_M, n0:n0 + TILE_N], value=res)


@nki.jit
def matmul_tiled_kernel(lhsT, rhs):
    """Every [128, 128] lhsT tile and [128, 512] rhs tile is loaded again for each matmul that uses it."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            ps = nl.zeros((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                a = nl.load(lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                b = nl.load(rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                ps += nl.matmul(a, b, transpose_x=True)
            _store(result, ps, m * TILE_M, n * TILE_N)
    return result


@nki.jit
def matmul_hoisted_kernel(lhsT, rhs):
    """The K column of lhsT tiles is loaded once per row tile m; the rhs column once per (m, n)."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    kt = K // TILE_K
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        a = nl.ndarray((kt, nl.par_dim(TILE_K), TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
        for k in nl.affine_range(kt):
            a[k] = nl.load(lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
        for n in nl.affine_range(N // TILE_N):
            b = nl.ndarray((kt, nl.par_dim(TILE_K), TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
            for k in nl.affine_range(kt):
                b[k] = nl.load(rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
            ps = nl.zeros((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(kt):
                ps += nl.matmul(a[k], b[k], transpose_x=True)
            _store(result, ps, m * TILE_M, n * TILE_N)
    return result


@nki.jit
def matmul_block_free_kernel(lhsT, rhs, tiles_m=2, tiles_n=2):
    """Blocks of tiles_m lhsT columns and tiles_n rhs columns (full K) are loaded once per block pair."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    kt = K // TILE_K
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // (TILE_M * tiles_m)):
        a = nl.ndarray((tiles_m, kt, nl.par_dim(TILE_K), TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
        _load_columns(lhsT, a, m * tiles_m, tiles_m, kt, TILE_M)
        for n in nl.affine_range(N // (TILE_N * tiles_n)):
            b = nl.ndarray((tiles_n, kt, nl.par_dim(TILE_K), TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
            _load_columns(rhs, b, n * tiles_n, tiles_n, kt, TILE_N)
            for bm in nl.affine_range(tiles_m):
                for bn in nl.affine_range(tiles_n):
                    ps = nl.zeros((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(kt):
                        ps += nl.matmul(a[bm, k], b[bn, k], transpose_x=True)
                    _store(result, ps, (m * tiles_m + bm) * TILE_M, (n * tiles_n + bn) * TILE_N)
    return result


def _load_columns(src, blk, t0, n_tiles, kt, width):
    """blk[i, k] = the k-th 128 rows of src's column tile t0 + i (`width` columns), for i < n_tiles."""
    for i in nl.affine_range(n_tiles):
        c0 = (t0 + i) * width
        for k in nl.affine_range(kt):
            blk[i, k] = nl.load(src[k * TILE_K:(k + 1) * TILE_K, c0:c0 + width])


KERNELS = {"tiled": matmul_tiled_kernel, "hoisted": matmul_hoisted_kernel, "block_free": matmul_block_free_kernel}


def run(name: str, lhsT: Any, rhs: Any, *, target: str = "trn1", count_only: bool = False) -> Any:
    """Simulate variant `name` (count-only takes `nki_sim.ShapeDtype` inputs); returns (result or None, Report)."""
    if name not in KERNELS:
        raise KernelArgumentError(f"matmul variant: unknown {name!r}; known: {sorted(KERNELS)}")
    return simulate(KERNELS[name], lhsT, rhs, target=target, count_only=count_only, report=True)
