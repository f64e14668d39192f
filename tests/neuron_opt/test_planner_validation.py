"""The latency model against published TTFT/TPOT, with the rows its constants were fitted on kept apart from
the held-out rows (scripts/validate_planner.py holds both; docs/planner.md prints its table).

The thresholds below are what the model achieves, stated per set (docs/planner.md, "Validation"): a change
that loses a row fails here, and one that gains a row should tighten the figure and regenerate the doc.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from neuron_opt.config import ParallelConfig
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner import get_instance
from neuron_opt.planner.latency import DEFAULT_EFFICIENCY, decode_time, prefill_time

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def v() -> ModuleType:
    """scripts/ is not a package: load the reproducible validation table by path."""
    spec = importlib.util.spec_from_file_location("validate_planner", ROOT / "scripts" / "validate_planner.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _errors(v: ModuleType, rows: list) -> tuple[list[float], list[float]]:
    """Relative |error| of TTFT (rows that publish one) and TPOT."""
    ttft, tpot = [], []
    for r in rows:
        pred_ttft, pred_tpot = v.predict(r)
        tpot.append(abs(pred_tpot - r.tpot_ms) / r.tpot_ms)
        if r.ttft_ms is not None:
            ttft.append(abs(pred_ttft - r.ttft_ms) / r.ttft_ms)
    return ttft, tpot


def test_fit_rows_are_the_inf2_transformers_neuronx_rows_and_nothing_else(v: ModuleType) -> None:
    # The constants were fitted on AWS's inf2.48xlarge transformers-neuronx table only; every trn1 / trn2 row
    # and every row from another stack is held out.
    assert v.FIT_ROWS == [r for r in v.ROWS if r.instance == "inf2.48xlarge" and r.source == v.TNX_INF2]
    assert v.HELD_OUT_ROWS == [r for r in v.ROWS if r not in v.FIT_ROWS]
    assert (len(v.FIT_ROWS), len(v.HELD_OUT_ROWS)) == (11, 13)
    assert all(r.instance.startswith(("trn1", "trn2")) or r.source != v.TNX_INF2 for r in v.HELD_OUT_ROWS)
    assert [d["held_out"] for d in v.table(v.ROWS)] == [r in v.HELD_OUT_ROWS for r in v.ROWS]


def test_fit_rows_within_the_stated_error(v: ModuleType) -> None:
    """In sample (11 inf2 rows): TPOT within 13% and TTFT within 23% on every row (max 12.4% and 22.5%)."""
    ttft, tpot = _errors(v, v.FIT_ROWS)
    assert len(ttft) == len(tpot) == 11
    assert max(tpot) <= 0.13, tpot
    assert max(ttft) <= 0.23, ttft


def test_held_out_trn1_rows_within_the_stated_error(v: ModuleType) -> None:
    """Held out, same SDK (transformers-neuronx) on another instance (4x4 torus, not a 12-chip ring), 8 rows:
    TPOT within 17% on all (max 16.4%); TTFT within 23% on 7 of 8 and within 45% on all (the miss, -43%:
    Llama-2-7b batch 8, docs/planner.md)."""
    rows = [r for r in v.HELD_OUT_ROWS if r.source == v.TNX_TRN1]
    ttft, tpot = _errors(v, rows)
    assert len(ttft) == len(tpot) == 8
    assert max(tpot) <= 0.17, tpot
    assert sum(e <= 0.23 for e in ttft) >= 7, ttft
    assert max(ttft) <= 0.45, ttft


def test_held_out_rows_from_other_stacks_within_the_stated_error(v: ModuleType) -> None:
    """Held out, other stacks (NxDI, optimum-neuron, vLLM Neuron plugin; 4 trn2 rows, 1 inf2), 5 rows: TPOT
    within 17% on 4 of 5 and within 42% on all (the miss, -41%: Llama-3.3-70B at tp 64). TTFT is not bounded:
    these stacks run NKI flash-attention / matmul kernels our graphs do not, and the model over-predicts their
    long prompts by up to 2.5x (docs/planner.md); the test pins only that those misses are over-predictions,
    the conservative side."""
    rows = [r for r in v.HELD_OUT_ROWS if r.source != v.TNX_TRN1]
    assert len(rows) == 5
    _, tpot = _errors(v, rows)
    assert sum(e <= 0.17 for e in tpot) >= 4, tpot
    assert max(tpot) <= 0.42, tpot
    long_prompts = [r for r in rows if r.ttft_ms is not None and r.input_len >= 1500]
    assert len(long_prompts) == 3 and all(v.predict(r)[0] > r.ttft_ms for r in long_prompts)


def test_docs_validation_table_is_the_scripts_output(v: ModuleType) -> None:
    """docs/planner.md carries the table and the per-set error lines exactly as the script prints them now."""
    doc = (ROOT / "docs" / "planner.md").read_text()
    assert v.markdown(v.ROWS) in doc


def test_prefill_hop_latency_is_paid_per_layer_all_reduce_per_ring_step(v: ModuleType) -> None:
    cfg, inst = v.MODELS["Llama-3-8B"], get_instance("inf2.48xlarge")
    lay = head_layout(cfg, ParallelConfig(tp=24))
    no_hops = dataclasses.replace(DEFAULT_EFFICIENCY, prefill_hop_latency_s=0.0)
    with_hops = prefill_time(cfg, lay, inst, batch=1, seq=128, dtype="int8").collective
    without = prefill_time(cfg, lay, inst, batch=1, seq=128, dtype="int8", eff=no_hops).collective
    assert with_hops - without == pytest.approx(2 * 32 * 22 * DEFAULT_EFFICIENCY.prefill_hop_latency_s)
    dec = decode_time(cfg, lay, inst, batch=1, kv_len=256, dtype="int8", kv_dtype="bfloat16")
    assert dec == decode_time(cfg, lay, inst, batch=1, kv_len=256, dtype="int8", kv_dtype="bfloat16", eff=no_hops)
