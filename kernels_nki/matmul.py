"""Blocked bf16 matrix multiplication, legacy `neuronxcc.nki` API (the nki-samples "fully optimized" scheme).

Dimensions: M rows of the result, K contraction, N columns. Tiles: TILE_M = 128 (stationary free max),
TILE_K = 128 (partitions), TILE_N = 512 (moving free max = one PSUM bank of fp32). Blocks group tiles:
BLOCK_M = 128 * tiles_m, BLOCK_K = 128 * tiles_k, BLOCK_N = 512 * tiles_n.

Kernel layouts (HBM):
    lhsT    `[K, M]`  the left operand transposed, so K (the contraction) lands on partitions when loaded
    rhs     `[K, N]`
    result  `[M, N]`  dtype of lhsT

Constraints: M % BLOCK_M == 0, K % BLOCK_K == 0, N % BLOCK_N == 0 (the host wrapper `run` pads);
lhsT and rhs share a dtype that TensorE accepts (bf16 by default). SBUF per partition holds the result
block row ((M / 128) * tiles_n * 512 elements), one K-block of rhs (tiles_k * BLOCK_N) and of lhsT
(tiles_k * BLOCK_M), and transient tiles (`sbuf_bytes`); the defaults (16, 2, 8) use about 117 KiB of the
176 KiB a trn1 kernel may use for M = 4096, so M <= 6144 in bf16 with them.

Pseudocode:
    for n_block in range(N / BLOCK_N):                  # result columns resident in SBUF
        acc[M / 128 tiles, tiles_n, 128, 512] = 0       # SBUF, result dtype
        for k_block in range(K / BLOCK_K):              # each rhs K-block is loaded once per n_block
            rhs_blk = load rhs[k_block rows, n_block cols] as tiles_k tiles [128, BLOCK_N]
            for m_block in range(M / BLOCK_M):
                lhsT_blk = load lhsT[k_block rows, m_block cols] as tiles_k tiles [128, BLOCK_M]
                for bn, bm:                              # one PSUM bank per (bm, bn) result tile
                    ps[128, 512] = sum over bk of nc_matmul(lhsT_blk[bk][:, bm], rhs_blk[bk][:, bn])  # fp32
                    acc[m_block, bm, bn] += ps           # VectorE, PSUM + SBUF
        store acc to result[:, n_block cols], one [128, BLOCK_N] row of tiles per DMA

Partial sums cross K-blocks in the result dtype (as in the nki-samples kernel), so with bf16 the result is
rounded once per K-block: K / BLOCK_K roundings of bf16 (2^-8 relative each).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# `_nki` picks the real SDK when it imports, else neuron_opt.nki_sim (same names).
from kernels_nki._nki import HAVE_SDK, nisa, nki, nl, sbuf_capacity
from neuron_opt import nki_sim
from neuron_opt.errors import KernelArgumentError

DEFAULT_TILES = (16, 2, 8)  # (tiles_m, tiles_n, tiles_k): the nki-samples configuration measured on trn1


@nki.jit
def matmul_kernel(lhsT, rhs, tiles_m=16, tiles_n=2, tiles_k=8):
    """result[M, N] = lhsT[K, M].T @ rhs[K, N]; see the module docstring."""
    K, M = lhsT.shape
    K_rhs, N = rhs.shape
    assert K == K_rhs, "lhsT and rhs must share the contraction dimension K"
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)

    TILE_M = nl.tile_size.gemm_stationary_fmax  # 128
    TILE_K = nl.tile_size.pmax  # 128
    TILE_N = nl.tile_size.gemm_moving_fmax  # 512
    BLOCK_M, BLOCK_N, BLOCK_K = TILE_M * tiles_m, TILE_N * tiles_n, TILE_K * tiles_k
    assert M % BLOCK_M == 0 and N % BLOCK_N == 0 and K % BLOCK_K == 0, "shapes must be block multiples"
    n_blocks_m, n_blocks_n, n_blocks_k = M // BLOCK_M, N // BLOCK_N, K // BLOCK_K

    for n in nl.affine_range(n_blocks_n):
        # The whole result column block stays in SBUF across the K loop: no partial sums go back to HBM.
        acc = nl.zeros(
            (n_blocks_m, tiles_m, tiles_n, nl.par_dim(TILE_M), TILE_N), dtype=lhsT.dtype, buffer=nl.sbuf
        )
        for k in nl.sequential_range(n_blocks_k):
            # One DMA per [128, BLOCK_N] row of rhs tiles: large transfers keep DMA efficient.
            i_rhs = nl.mgrid[0:TILE_K, 0:BLOCK_N]
            rhs_blk = nl.ndarray((tiles_k, nl.par_dim(TILE_K), BLOCK_N), dtype=rhs.dtype, buffer=nl.sbuf)
            for bk in nl.affine_range(tiles_k):
                rhs_blk[bk, i_rhs.p, i_rhs.x] = nl.load(
                    rhs[(tiles_k * k + bk) * TILE_K + i_rhs.p, BLOCK_N * n + i_rhs.x]
                )

            for m in nl.affine_range(n_blocks_m):
                i_lhs = nl.mgrid[0:TILE_K, 0:BLOCK_M]
                lhs_blk = nl.ndarray((tiles_k, nl.par_dim(TILE_K), BLOCK_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                for bk in nl.affine_range(tiles_k):
                    lhs_blk[bk, i_lhs.p, i_lhs.x] = nl.load(
                        lhsT[(tiles_k * k + bk) * TILE_K + i_lhs.p, BLOCK_M * m + i_lhs.x]
                    )

                i_st = nl.mgrid[0:TILE_K, 0:TILE_M]
                i_mv = nl.mgrid[0:TILE_K, 0:TILE_N]
                i_out = nl.mgrid[0:TILE_M, 0:TILE_N]
                for bn in nl.affine_range(tiles_n):
                    for bm in nl.affine_range(tiles_m):
                        ps = nl.zeros((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                        for bk in nl.affine_range(tiles_k):
                            # stationary [128 K, 128 M], moving [128 K, 512 N] -> PSUM [128 M, 512 N], fp32
                            ps[...] += nisa.nc_matmul(
                                lhs_blk[bk, i_st.p, bm * TILE_M + i_st.x],
                                rhs_blk[bk, i_mv.p, bn * TILE_N + i_mv.x],
                            )
                        acc[m, bm, bn, i_out.p, i_out.x] += ps[i_out.p, i_out.x]

        for m in nl.affine_range(n_blocks_m):
            for bm in nl.affine_range(tiles_m):
                i_t = nl.mgrid[0:TILE_M, 0:TILE_N]
                i_row = nl.mgrid[0:TILE_M, 0:BLOCK_N]
                row = nl.ndarray((TILE_M, BLOCK_N), dtype=acc.dtype, buffer=nl.sbuf)
                for bn in nl.affine_range(tiles_n):
                    row[i_t.p, bn * TILE_N + i_t.x] = nl.copy(acc[m, bm, bn, i_t.p, i_t.x])
                nl.store(
                    result[(tiles_m * m + bm) * TILE_M + i_row.p, BLOCK_N * n + i_row.x],
                    value=row[i_row.p, i_row.x],
                )
    return result


def pick_tiles(m: int, k: int, n: int, tiles: tuple[int, int, int] = DEFAULT_TILES) -> tuple[int, int, int]:
    """Shrink the block configuration for small problems so padding stays below one block."""
    tm, tn, tk = tiles
    tm = max(1, min(tm, -(-m // 128)))
    tn = max(1, min(tn, -(-n // 512)))
    tk = max(1, min(tk, -(-k // 128)))
    return tm, tn, tk


def _round_up(x: int, mult: int) -> int:
    return -(-x // mult) * mult


def sbuf_bytes(m: int, tiles: tuple[int, int, int], dtype: Any) -> int:
    """SBUF bytes per partition of the kernel at its peak, counted as the simulator's allocator does.

    The allocator charges a tile the bytes of its free dims in every partition: the result block row
    (M / 128 * tiles_n tiles of 512), one K-block of rhs (tiles_k * BLOCK_N) and of lhsT (tiles_k * BLOCK_M),
    one loaded row of tiles on its way into a block (max(BLOCK_M, BLOCK_N)) and one [128, 512] partial sum.
    M is the padded row count.
    """
    tm, tn, tk = tiles
    block_m, block_n = 128 * tm, 512 * tn
    elems = m // 128 * tn * 512 + tk * (block_m + block_n) + max(block_m, block_n) + 512
    return elems * np.dtype(dtype).itemsize


def _check_sbuf(m: int, tiles: tuple[int, int, int], dtype: Any, target: str) -> None:
    need, cap = sbuf_bytes(m, tiles, dtype), sbuf_capacity(target)
    if need > cap:
        raise KernelArgumentError(f"matmul: M={m} with tiles={tiles}, {np.dtype(dtype).name} needs {need} SBUF bytes "
                                  f"per partition (the [M, BLOCK_N] result block stays resident), more than the "
                                  f"{cap} a kernel may use on {target}; use a smaller tiles_n or split M")


def run(
    a: np.ndarray, b: np.ndarray, *, target: str = "trn1", tiles: tuple[int, int, int] | None = None
) -> np.ndarray:
    """Host wrapper: `a[M, K] @ b[K, N]` with logical numpy operands (bf16 unless given fp16/fp32).

    Pads to block multiples (zeros do not change the product), passes `a` transposed (lhsT), runs the kernel
    on the simulator (or the SDK when present) and returns the unpadded `[M, N]` result in the input dtype.
    Raises KernelArgumentError when the padded problem's `sbuf_bytes` exceed the SBUF of `target`.
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise KernelArgumentError(f"matmul: need a[M, K] and b[K, N], got {a.shape} and {b.shape}")
    if a.dtype != b.dtype:
        raise KernelArgumentError(f"matmul: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    tm, tn, tk = tiles or pick_tiles(m, k, n)
    mp, kp, np_ = _round_up(m, 128 * tm), _round_up(k, 128 * tk), _round_up(n, 512 * tn)
    _check_sbuf(mp, (tm, tn, tk), a.dtype, target)
    lhs_t = np.zeros((kp, mp), dtype=a.dtype)
    lhs_t[:k, :m] = a.T  # [K, M]: contraction on partitions
    rhs = np.zeros((kp, np_), dtype=b.dtype)
    rhs[:k, :n] = b
    if HAVE_SDK:  # pragma: no cover - device path
        out = matmul_kernel(lhs_t, rhs, tiles_m=tm, tiles_n=tn, tiles_k=tk)
    else:
        out = nki.simulate_kernel(
            matmul_kernel, lhs_t, rhs, target=target, tiles_m=tm, tiles_n=tn, tiles_k=tk
        )
    return np.asarray(out)[:m, :n]


def estimate(
    m: int,
    k: int,
    n: int,
    *,
    target: str = "trn1",
    tiles: tuple[int, int, int] = DEFAULT_TILES,
    dtype: Any = None,
) -> Any:
    """Count-only cost report of the kernel for `[m, k] @ [k, n]` (shapes must be block multiples)."""
    dt = nl.bfloat16 if dtype is None else dtype
    _check_sbuf(m, tiles, dt, target)
    tm, tn, tk = tiles
    _, rep = nki_sim.simulate_kernel(
        matmul_kernel,
        nki_sim.ShapeDtype((k, m), dt),
        nki_sim.ShapeDtype((k, n), dt),
        target=target,
        count_only=True,
        report=True,
        tiles_m=tm,
        tiles_n=tn,
        tiles_k=tk,
    )
    return rep
