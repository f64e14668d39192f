"""Cost model: per-instruction formulas (nki.md 4.2), DMA accounting, overlap, targets, report."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from neuron_opt import nki_sim as nki
from neuron_opt.nki_sim import isa as nisa
from neuron_opt.nki_sim import language as nl
from neuron_opt.nki_sim.core.timeline import Timeline

BF16 = ml_dtypes.bfloat16


def _matmul_once(st_shape: tuple[int, int], mv_shape: tuple[int, int], dtype: Any) -> Any:
    @nki.jit
    def k(a: Any) -> Any:
        st = nl.zeros(st_shape, dtype=dtype)
        mv = nl.zeros(mv_shape, dtype=dtype)
        nisa.nc_matmul(st, mv)
        return a

    _, rep = nki.simulate_kernel(k, np.zeros((1, 1), np.float32), report=True)
    return rep


@pytest.mark.parametrize(
    "st,mv,dtype,cycles",
    [
        ((128, 128), (128, 512), nl.bfloat16, 512),  # moving-bound: N_moving
        ((128, 128), (128, 32), nl.bfloat16, 64),  # short moving: 64-cycle turnaround
        ((128, 16), (128, 32), nl.bfloat16, 32),  # min(64, N_stationary) = 16 < 32
        ((128, 128), (128, 512), nl.float32, 2048),  # fp32 is 4x
    ],
)
def test_matmul_cycles_follow_documented_formula(
    st: tuple[int, int], mv: tuple[int, int], dtype: Any, cycles: int
) -> None:
    rep = _matmul_once(st, mv, dtype)
    assert rep.engines["tensor"].instructions == 1
    assert rep.engines["tensor"].cycles == cycles
    assert rep.matmul_flops == 2 * st[0] * st[1] * mv[1]


def test_streaming_instructions_and_dma() -> None:
    @nki.jit
    def k(x: Any) -> Any:
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.load(x)  # 128 x 1000 fp32
        e = nl.exp(t)  # ScalarE: N = 1000 cycles
        s = nisa.tensor_reduce(nl.add, e, axis=1)  # VectorE: N = 1000
        nl.store(out[:, 0:1], value=s)  # 512 bytes stored
        small = nl.exp(t[:, 0:10])  # ScalarE: max(64, 10)
        nl.store(out[:, 1:11], value=small)
        return out

    x = np.ones((128, 1000), np.float32)
    _, rep = nki.simulate_kernel(k, x, report=True, target="trn1")
    assert rep.engines["scalar"].cycles == 1000 + 64
    assert rep.engines["vector"].cycles == 1000
    assert rep.dma_bytes == 128 * 1000 * 4 + 128 * 4 + 128 * 10 * 4
    assert rep.dma_descriptors == 3 * 128  # every row of each access is one contiguous HBM run
    t = nki.get_target("trn1")
    fixed, per_queue = t.dma_fixed_ns / 1e3, t.dma_gbps / t.dma_engines

    def dma(nbytes: int) -> float:  # 128 rows over 16 queues: 8 descriptors and nbytes / 16 per queue
        return (nbytes / 16 / per_queue + 8 * t.dma_descriptor_ns) / 1e3

    load_end = fixed + dma(128 * 4000)
    exp_end = load_end + 1000 / 1.4e3
    reduce_end = exp_end + 1000 / 1.12e3
    store1_end = reduce_end + fixed + dma(128 * 4)
    small_end = exp_end + 64 / 1.4e3  # ScalarE is free once the big exp is done; it needs only t
    store2_end = small_end + fixed + dma(128 * 40)  # fills the idle DMA time before store 1: ends first
    assert store2_end < store1_end
    assert rep.latency_us == pytest.approx(store1_end)
    assert rep.dma_busy_us == pytest.approx(dma(128 * 4000) + dma(128 * 4) + dma(128 * 40))
    assert rep.throughput_bound_us == pytest.approx(max(rep.dma_busy_us, 1064 / 1.4e3))
    assert rep.utilization["vector"] == pytest.approx(1000 / 1.12e3 / store1_end)
    assert rep.engines["scalar"].busy_us == pytest.approx(1064 / 1.4e3)


def test_targets_change_clocks() -> None:
    trn1 = _matmul_once((128, 128), (128, 512), nl.bfloat16)

    @nki.jit
    def k(a: Any) -> Any:
        nisa.nc_matmul(nl.zeros((128, 128), dtype=nl.bfloat16), nl.zeros((128, 512), dtype=nl.bfloat16))
        return a

    with nki.use_target("trn2"):
        _, trn2 = nki.simulate_kernel(k, np.zeros((1, 1), np.float32), report=True)
    assert trn2.target == "trn2" and trn1.target == "trn1"
    assert trn2.engines["tensor"].busy_us == pytest.approx(trn1.engines["tensor"].busy_us * 2.8 / 2.4)


def test_report_is_readable_and_serialisable() -> None:
    rep = _matmul_once((128, 128), (128, 512), nl.bfloat16)
    text = str(rep)
    for word in ("tensor", "vector", "scalar", "gpsimd", "dma", "latency", "utilisation"):
        assert word in text
    d = rep.to_dict()
    assert d["engines"]["tensor"]["cycles"] == 512 and d["ops"]["tensor.matmul"] == 1
    assert nki.last_report() is rep


def test_psum_accumulation_is_free_but_sbuf_accumulation_costs_vector_time() -> None:
    @nki.jit
    def k(a: Any) -> Any:
        ps = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
        acc = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        for _ in nl.affine_range(4):
            ps += nisa.nc_matmul(
                nl.zeros((128, 128), dtype=nl.bfloat16), nl.zeros((128, 512), dtype=nl.bfloat16)
            )
        acc[...] += ps
        return a

    _, rep = nki.simulate_kernel(k, np.zeros((1, 1), np.float32), report=True)
    assert rep.ops["tensor.matmul"] == 4
    assert rep.ops["vector.tensor_tensor"] == 1  # only the SBUF += PSUM, not the PSUM accumulation


@pytest.mark.parametrize("kind,n,expected", [("affine_range", 2, 3), ("affine_range", 6, 3),
                                             ("sequential_range", 6, 3), ("static_range", 2, 6),
                                             ("static_range", 6, 18)])
def test_static_instructions_count_a_rolled_body_once(kind: str, n: int, expected: int) -> None:
    # Body: load, add, store = 3 instructions; a rolled loop is one copy of them whatever its trip count.
    @nki.jit
    def k(a: Any) -> Any:
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        for i in getattr(nl, kind)(n):
            t = nl.load(a[i * 128:(i + 1) * 128, :])
            nl.store(out[i * 128:(i + 1) * 128, :], value=nl.add(t, 1.0))
        return out

    _, rep = nki.simulate_kernel(k, nki.ShapeDtype((n * 128, 64), np.float32), count_only=True, report=True)
    assert rep.static_instructions == expected
    assert sum(e.instructions for e in rep.engines.values()) + rep.dma_transfers == 3 * n


def _stream_kernel(dependent: bool) -> Any:
    @nki.jit
    def k(x: Any) -> Any:
        out = nl.ndarray((128, 1), dtype=x.dtype, buffer=nl.shared_hbm)
        acc = nl.zeros((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        for j in nl.sequential_range(x.shape[1] // 2048):
            blk = nl.load(x[:, j * 2048:(j + 1) * 2048])  # 1 MiB per block
            e = nl.exp(blk)  # ScalarE, 2048 cycles
            acc[...] = nl.add(acc, nisa.tensor_reduce(nl.add, e, axis=1))
            if dependent:  # the next block's load waits for this block's result
                nl.store(x[:, (j + 1) * 2048:(j + 1) * 2048 + 1], value=acc)
        nl.store(out, value=acc)
        return out

    return k


def test_loads_overlap_compute_unless_they_depend_on_it() -> None:
    """The DMA of block j+1 runs under the compute of block j (double buffering); a data dependency stops it."""
    x = nki.ShapeDtype((128, 8 * 2048 + 1), nl.float32)
    _, free = nki.simulate_kernel(_stream_kernel(False), x, count_only=True, report=True)
    _, dep = nki.simulate_kernel(_stream_kernel(True), x, count_only=True, report=True)
    per_block_dma = free.dma_busy_us / 8
    per_block_compute = (free.engines["scalar"].busy_us + free.engines["vector"].busy_us) / 8
    serial = 8 * (per_block_dma + per_block_compute)
    # overlapped: about the DMA time, far below the serial sum
    assert free.latency_us < 0.75 * serial
    assert free.latency_us >= free.throughput_bound_us
    # each load waits for the previous block's store: the chain is serial, fixed latencies included
    assert dep.latency_us > serial


def _dma_geometry(view_fn: Any) -> tuple[int, int]:
    @nki.jit
    def k(x: Any) -> Any:
        out = nl.ndarray((128, 1), dtype=x.dtype, buffer=nl.shared_hbm)
        view_fn(x)
        nl.store(out[0:1, 0:1], value=nl.zeros((1, 1), dtype=x.dtype, buffer=nl.sbuf))
        return out

    _, rep = nki.simulate_kernel(k, nki.ShapeDtype((256, 512), nl.float32), count_only=True, report=True)
    return rep.dma_descriptors - 1, rep.dma_transfers  # minus the 1-element store


def test_dma_descriptors_are_contiguous_runs_per_partition() -> None:
    i_p, i_f = nl.mgrid[0:128, 0:512]
    assert _dma_geometry(lambda x: nl.load(x[0:128, :]))[0] == 128  # whole rows: one run each
    assert _dma_geometry(lambda x: nl.load(x[0:128, 0:256]))[0] == 128  # half rows, still one run each
    assert _dma_geometry(lambda x: nl.load(x[i_p * 2, i_f]))[0] == 128  # every other row
    i_p4, i_c, i_f4 = nl.mgrid[0:128, 0:2, 0:128]
    assert _dma_geometry(lambda x: nl.load(x[i_c * 128 + i_p4, i_f4]))[0] == 256  # two runs per partition
    assert _dma_geometry(lambda x: nl.load(x[0:128, :], mask=i_f < 256))[0] == 128  # masked: shorter runs
    assert _dma_geometry(lambda x: nl.load(x[0:128, :], mask=i_p < 8))[0] == 8  # masked: 8 rows moved
    assert _dma_geometry(lambda x: nl.load_transpose2d(x[0:64, 0:128]))[0] == 128 * 64  # element-wise


def test_readers_wait_for_memset_and_where_operands() -> None:
    @nki.jit
    def k(x: Any) -> Any:
        out = nl.ndarray((128, 2048), dtype=x.dtype, buffer=nl.shared_hbm)
        z = nl.zeros((128, 2048), dtype=nl.float32, buffer=nl.sbuf)  # GpSimd memset
        e = nl.exp(z)  # ScalarE, must wait for the memset
        w = nl.where(nl.greater(e, 0.5), e, 0.0)  # VectorE, must wait for e (its x operand)
        nl.store(out, value=w)
        return out

    _, rep = nki.simulate_kernel(k, nki.ShapeDtype((128, 2048), nl.float32), count_only=True, report=True)
    chain = (rep.engines["gpsimd"].busy_us + rep.engines["scalar"].busy_us + rep.engines["vector"].busy_us)
    assert rep.latency_us >= chain


def test_indirect_load_descriptors_are_each_gathered_rows_runs() -> None:
    """A gathered row lands on its own partition from anywhere in HBM: rows x (runs of one row) descriptors."""

    def geometry(rest: Any) -> int:
        @nki.jit
        def k(x: Any) -> Any:
            out = nl.ndarray((1, 1), dtype=x.dtype, buffer=nl.shared_hbm)
            rows = nisa.iota(nl.arange(64)[:, None] * 3, dtype=nl.int32)  # [64, 1] on chip: no DMA
            nl.load(x[(rows, *rest)])
            nl.store(out, value=nl.zeros((1, 1), dtype=x.dtype, buffer=nl.sbuf))
            return out

        _, rep = nki.simulate_kernel(k, nki.ShapeDtype((256, 4, 128), nl.float32), count_only=True, report=True)
        return rep.dma_descriptors - 1  # minus the store

    assert geometry((slice(None), slice(None))) == 64  # a whole [4, 128] row: one run
    assert geometry((slice(0, 2), slice(None))) == 64  # its first half: still one run
    assert geometry((slice(None), slice(0, 64))) == 64 * 4  # half of each of 4 sub-rows: 4 runs



BOX = ((0, 128), (0, 512))


def _two_instructions(first: str, second: str, target: str) -> tuple[float, dict[str, float]]:
    """Latency and port times of two independent 1 us instructions, each given as `engine-memory` (the memory
    of the tile it reads and writes), both ready at time 0."""
    t = Timeline(nki.get_target(target))
    for serial, spec in enumerate((first, second)):
        eng, mem = spec.split("-")
        t.access(10 + serial, BOX, "read", mem)
        t.instruction(eng, 1.0)
        t.access(20 + serial, BOX, "write", mem)
    return t.finish(), t.port_busy_us


@pytest.mark.parametrize("first,second,port", [
    ("vector-psum", "scalar-psum", "psum_port"),  # VectorE and ScalarE cannot access PSUM in parallel
    ("scalar-psum", "vector-psum", "psum_port"),
    ("vector-sbuf", "gpsimd-sbuf", "sbuf_port"),  # VectorE and GpSimdE cannot access SBUF in parallel
    ("gpsimd-sbuf", "vector-sbuf", "sbuf_port"),
])
def test_shared_ports_serialize_v2_engines_but_not_v3(first: str, second: str, port: str) -> None:
    latency, ports = _two_instructions(first, second, "trn1")
    assert latency == pytest.approx(2.0)  # the second waits for the first (NeuronCore-v2)
    assert ports[port] == pytest.approx(2.0)
    latency, ports = _two_instructions(first, second, "trn2")
    assert latency == pytest.approx(1.0) and ports == {}  # lifted on NeuronCore-v3


@pytest.mark.parametrize("first,second", [
    ("vector-psum", "gpsimd-sbuf"),  # VectorE on PSUM only leaves the SBUF port to GpSimd
    ("scalar-psum", "gpsimd-sbuf"),  # ScalarE and GpSimd share no port
    ("scalar-sbuf", "vector-psum"),  # ScalarE on SBUF leaves the PSUM port to VectorE
    ("scalar-sbuf", "vector-sbuf"),
    ("tensor-sbuf", "vector-psum"),
])
def test_engines_that_share_no_port_overlap_on_v2(first: str, second: str) -> None:
    latency, _ = _two_instructions(first, second, "trn1")
    assert latency == pytest.approx(1.0)


def test_a_port_holder_backfills_a_gap_only_where_the_port_is_free_too() -> None:
    # VectorE waits 3 us for its operand; ScalarE then takes the PSUM port over [0, 2). A second, independent
    # VectorE PSUM instruction fits in VectorE's idle time only after ScalarE let go of the port.
    t = Timeline(nki.get_target("trn1"))
    t.access(1, BOX, "read", "sbuf")
    t.instruction("tensor", 3.0)
    t.access(2, BOX, "write", "psum")
    t.access(2, BOX, "read", "psum")
    t.instruction("vector", 1.0)  # [3, 4)
    t.access(3, BOX, "write", "sbuf")
    t.access(4, BOX, "read", "psum")
    t.instruction("scalar", 2.0)  # [0, 2): holds the PSUM port
    t.access(5, BOX, "write", "sbuf")
    t.access(6, BOX, "read", "psum")
    t.instruction("vector", 0.5)  # VectorE is idle over [0, 3) but the port is busy until 2: [2, 2.5)
    t.access(7, BOX, "write", "sbuf")
    assert t.finish() == pytest.approx(4.0)
    assert t.storages[7].writes[-1][1] == pytest.approx(2.5)
    assert t.port_busy_us["psum_port"] == pytest.approx(3.5)


def test_a_result_assigned_into_psum_counts_as_psum() -> None:
    # `ps[...] = tensor_reduce(...)`: the result never lives in a tile of its own, so VectorE reading and
    # writing PSUM leaves the SBUF port to GpSimd.
    @nki.jit
    def k(a: Any) -> Any:
        ps = nisa.nc_matmul(nl.zeros((128, 128), dtype=nl.bfloat16), nl.zeros((128, 512), dtype=nl.bfloat16))
        mx = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.psum)
        mx[...] = nisa.tensor_reduce(nl.maximum, ps, axis=(1,), keepdims=True)
        return a

    _, rep = nki.simulate_kernel(k, np.zeros((1, 1), np.float32), report=True, target="trn1")
    reduce_us = 512 / 1.12e3
    assert rep.port_busy_us["psum_port"] == pytest.approx(reduce_us)
    assert rep.port_busy_us.get("sbuf_port", 0.0) == pytest.approx(rep.engines["gpsimd"].busy_us)  # memsets only
