"""The `nl`/`nisa` call surface accepts what the legacy compiler accepts and nothing more.

Unknown keywords raise TypeError naming the function and the keyword; the documented `nc_matmul` options
(`is_transpose`, `tile_position`/`tile_size`) are checked and simulated, its `mask` is refused, and
`nc_transpose` honours `mask` (legacy docstrings of `neuronxcc.nki.isa`, see docs/nki_simulator.md).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from neuron_opt import nki_sim as nki
from neuron_opt.nki_sim import isa as nisa
from neuron_opt.nki_sim import language as nl

RNG = np.random.default_rng(7)


def _entry_points() -> list[tuple[str, Callable[..., Any]]]:
    return [
        (f"{mod.__name__.rsplit('.', 1)[1]}.{name}", fn)
        for mod in (nl, nisa)
        for name, fn in sorted(vars(mod).items())
        if inspect.isfunction(fn) and not name.startswith("_")
    ]


@pytest.mark.parametrize("name,fn", _entry_points(), ids=[n for n, _ in _entry_points()])
def test_no_entry_point_swallows_unknown_keywords(name: str, fn: Callable[..., Any]) -> None:
    kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{name} accepts **kwargs"


@pytest.mark.parametrize(
    "fname,kw,call",
    [
        ("exp", "dtpye", lambda t: nl.exp(t, dtpye=nl.float32)),
        ("add", "msk", lambda t: nl.add(t, t, msk=None)),
        ("load", "dtyp", lambda t: nl.load(t, dtyp=nl.float32)),
        ("ndarray", "bufer", lambda t: nl.ndarray((128, 64), dtype=nl.float32, bufer=nl.sbuf)),
        ("affine_range", "unroll", lambda t: nl.affine_range(2, unroll=2)),
        ("nc_matmul", "tile_posiiton", lambda t: nisa.nc_matmul(t, t, tile_posiiton=(0, 0))),
        ("activation", "bais", lambda t: nisa.activation(nl.exp, t, bais=None)),
        ("tensor_reduce", "keep_dims", lambda t: nisa.tensor_reduce(nl.add, t, axis=(1,), keep_dims=True)),
    ],
)
def test_misspelled_keyword_raises_naming_function_and_keyword(
    fname: str, kw: str, call: Callable[..., Any]
) -> None:
    def k(a: Any) -> Any:
        call(a if fname == "load" else nl.load(a))
        return a

    with pytest.raises(TypeError, match=rf"\b{fname}\(\) got an unexpected keyword argument '{kw}'"):
        nki.simulate_kernel(k, RNG.standard_normal((128, 64)).astype(np.float32))


def _mm_kernel(m: int, n: int, **options: Any) -> Callable[..., Any]:
    def k(st: Any, mv: Any) -> Any:
        out = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nisa.nc_matmul(nl.load(st), nl.load(mv), **options))
        return out

    return k


def test_tile_position_and_size_run_pe_tiles_with_the_same_result() -> None:
    st = RNG.standard_normal((64, 64)).astype(np.float32)
    mv = RNG.standard_normal((64, 512)).astype(np.float32)
    got = nki.simulate_kernel(_mm_kernel(64, 512, tile_position=(64, 0), tile_size=(64, 128)), st, mv)
    np.testing.assert_allclose(got, st.T @ mv, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "options,msg",
    [
        ({"tile_position": (0, 0)}, "must be both set"),
        ({"tile_size": (64, 64)}, "must be both set"),
        ({"tile_position": (16, 0), "tile_size": (64, 64)}, "multiples of 32"),
        ({"tile_position": (0, 0), "tile_size": (32, 64)}, "smaller than the stationary tile"),
        ({"tile_position": (0, 0), "tile_size": (64, 32)}, "smaller than the stationary tile"),
        ({"tile_position": (96, 0), "tile_size": (64, 64)}, "past the 128x128 PE array"),
        ({"tile_position": (0, 0), "tile_size": (64,)}, "2-tuples"),
    ],
)
def test_bad_pe_tiling_is_refused(options: dict[str, Any], msg: str) -> None:
    st = np.zeros((64, 64), np.float32)
    mv = np.zeros((64, 512), np.float32)
    with pytest.raises(nki.ShapeError, match=re.escape(msg)):
        nki.simulate_kernel(_mm_kernel(64, 512, **options), st, mv)


def test_pe_tiles_of_32_by_32_only_from_neuroncore_v3() -> None:
    st = np.ones((32, 32), np.float32)
    mv = np.ones((32, 64), np.float32)
    kernel = _mm_kernel(32, 64, tile_position=(32, 32), tile_size=(32, 32))
    with pytest.raises(nki.ShapeError, match="NeuronCore-v2"):
        nki.simulate_kernel(kernel, st, mv, target="trn1")
    np.testing.assert_array_equal(nki.simulate_kernel(kernel, st, mv, target="trn2"), st.T @ mv)


def test_is_transpose_matmul_with_identity_transposes() -> None:
    x = RNG.standard_normal((96, 64)).astype(np.float32)
    got = nki.simulate_kernel(_mm_kernel(64, 96, is_transpose=True), x, np.eye(96, dtype=np.float32))
    np.testing.assert_array_equal(got, x.T)


@pytest.mark.parametrize("moving", [np.eye(96, 128, dtype=np.float32), 2 * np.eye(96, dtype=np.float32)])
def test_is_transpose_needs_an_identity_moving_operand(moving: np.ndarray) -> None:
    x = np.ones((96, 64), np.float32)
    with pytest.raises(nki.SimulatorError, match="is_transpose"):
        nki.simulate_kernel(_mm_kernel(64, moving.shape[1], is_transpose=True), x, moving)


@pytest.mark.parametrize("use_nl", [False, True])
def test_matmul_mask_is_refused(use_nl: bool) -> None:
    def k(st: Any, mv: Any) -> Any:
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        i_p = nl.arange(128)[:, None]
        s, m = nl.load(st), nl.load(mv)
        res = nl.matmul(s, m, transpose_x=True, mask=i_p < 64) if use_nl else nisa.nc_matmul(s, m, mask=i_p < 64)
        nl.store(out, value=res)
        return out

    with pytest.raises(nki.SimulatorError, match="mask"):
        nki.simulate_kernel(k, np.ones((128, 128), np.float32), np.ones((128, 512), np.float32))


@pytest.mark.parametrize("engine", [nisa.tensor_engine, nisa.vector_engine])
def test_nc_transpose_mask_selects_input_elements(engine: str) -> None:
    def k(a: Any) -> Any:  # a is [32, 24]; predicate on the input's (partition, free) indices
        out = nl.ndarray((24, 32), dtype=nl.float32, buffer=nl.shared_hbm)
        i_p, i_f = nl.mgrid[0:32, 0:24]
        dst = nl.zeros((24, 32), dtype=nl.float32, buffer=nl.sbuf if engine == nisa.vector_engine else nl.psum)
        dst[...] = nisa.nc_transpose(nl.load(a), mask=(i_p < 20) & (i_f < 10), engine=engine)
        nl.store(out, value=dst)
        return out

    x = RNG.standard_normal((32, 24)).astype(np.float32)
    want = np.zeros((24, 32), np.float32)
    want[:10, :20] = x[:20, :10].T
    np.testing.assert_array_equal(nki.simulate_kernel(k, x), want)


@pytest.mark.parametrize(
    "options,msg",
    [
        ({"oob_mode": nisa.oob_mode.skip}, "oob_mode"),
        ({"dge_mode": nisa.dge_mode.hwdge}, "NeuronCore-v3"),  # trn1 has no hardware DGE
        ({"dge_mode": "fast"}, "dge_mode"),
    ],
)
def test_dma_copy_modes_the_simulator_cannot_honour_are_refused(options: dict[str, Any], msg: str) -> None:
    def k(a: Any) -> Any:
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a, **options)
        return out

    with pytest.raises(nki.SimulatorError, match=msg):
        nki.simulate_kernel(k, np.ones((4, 8), np.float32), target="trn1")


@pytest.mark.parametrize(
    "dge,target", [(nisa.dge_mode.swdge, "trn1"), (nisa.dge_mode.none, "inf2"), (nisa.dge_mode.hwdge, "trn2")]
)
def test_dma_copy_descriptor_modes_are_accepted(dge: str, target: str) -> None:
    def k(a: Any) -> Any:
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a, oob_mode=nisa.oob_mode.error, dge_mode=dge)
        return out

    x = RNG.standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(nki.simulate_kernel(k, x, target=target), x)
