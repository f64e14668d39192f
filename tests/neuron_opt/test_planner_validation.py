"""The latency model against published TTFT/TPOT, with the rows its constants were fitted on kept apart from
the held-out rows (neuron_opt.planner.validation holds both; docs/planner.md prints its table).

The thresholds below are what the model achieves, stated per set (docs/planner.md, "Validation"): a change
that loses a row fails here, and one that gains a row should tighten the figure and regenerate the doc.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from neuron_opt.config import ParallelConfig
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner import get_instance
from neuron_opt.planner import validation as v
from neuron_opt.planner.latency import DEFAULT_EFFICIENCY, decode_time, prefill_time

ROOT = Path(__file__).resolve().parents[2]
# optimum-neuron's inf2 benchmark pages (84 held-out batch-4/8 rows), and all 113 held-out batched rows
ON_TTFT_35, ON_TPOT_25, HELD_BATCHED_TTFT_35 = 84, 76, 103


def _errors(rows: list) -> tuple[list[float], list[float]]:
    """Relative |error| of TTFT (rows that publish one) and TPOT."""
    ttft, tpot = v._errors(rows)
    return [abs(e) / 100 for e in ttft], [abs(e) / 100 for e in tpot]


def test_fit_is_split_by_instance_family_and_by_model():
    # Fitted: the Llama-3-8B / Llama-3-70B transformers-neuronx rows on inf2.48xlarge. Held out: the other models
    # on inf2, every trn1 row, every row from another stack.
    assert v.FIT_ROWS == [r for r in v.ROWS if r.instance == "inf2.48xlarge" and r.source == v.TNX_INF2
                          and r.model in ("Llama-3-8B", "Llama-3-70B")]
    assert v.HELD_OUT_ROWS == [r for r in v.ROWS if r not in v.FIT_ROWS]
    assert (len(v.FIT_ROWS), len(v.HELD_OUT_ROWS)) == (14, 69 + 84)
    # the optimum-neuron inf2 pages' rows (Llama-3-8B among them) are all held out
    on = [r for r in v.ROWS if r.source in (v.ON_TNX, v.ON_NXD)]
    assert len(on) == 84 and not any(v.is_fit_row(r) for r in on)
    assert {v.row_set(r) for r in on} == {"held out: optimum-neuron inf2 pages"}
    assert not {r.model for r in v.HELD_OUT_ROWS if r.instance == "inf2.48xlarge" and r.source == v.TNX_INF2} & {
        r.model for r in v.FIT_ROWS}
    # both sets hold batch > 1 and prompts >= 4k
    for rows in (v.FIT_ROWS, v.HELD_OUT_ROWS):
        assert any(r.batch > 1 for r in rows) and any(r.input_len >= 4096 for r in rows)
    assert [d["held_out"] for d in v.table(v.ROWS)] == [r in v.HELD_OUT_ROWS for r in v.ROWS]


def test_the_constants_are_the_fit():
    """DEFAULT_EFFICIENCY is what the fit finds on the fit rows (scripts/validate_planner.py --fit)."""
    assert v.fit(v.FIT_ROWS) == DEFAULT_EFFICIENCY


def test_no_held_out_row_influences_a_fitted_constant() -> None:
    """The fit sees the fit rows only: with every held-out row's published TTFT and TPOT tripled, the rows the
    split selects for the fit, and the fit's loss at the constants and one step away, are unchanged."""
    skewed = [r if v.is_fit_row(r) else dataclasses.replace(
        r, ttft_ms=None if r.ttft_ms is None else 3 * r.ttft_ms, tpot_ms=3 * r.tpot_ms) for r in v.ROWS]
    selected = [r for r in skewed if v.is_fit_row(r)]
    assert selected == v.FIT_ROWS
    assert {r.source for r in selected} == {v.TNX_INF2}
    for eff in (DEFAULT_EFFICIENCY, dataclasses.replace(DEFAULT_EFFICIENCY, tensor=0.35),
                dataclasses.replace(DEFAULT_EFFICIENCY, prefill_row_s=2.5e-3)):
        assert v.fit_loss(selected, eff) == v.fit_loss(v.FIT_ROWS, eff)


def test_fit_rows_within_the_stated_error():
    """In sample (14 inf2 rows): TPOT within 6% and TTFT within 26% on every row."""
    ttft, tpot = _errors(v.FIT_ROWS)
    assert len(ttft) == len(tpot) == 14
    assert max(tpot) <= 0.06, tpot
    assert max(ttft) <= 0.26, ttft


def test_held_out_rows_within_the_stated_error():
    """The 69 held-out rows of AWS's CSVs and the other stacks: TPOT within 25% on 66 (the issue's 80% target:
    met); TTFT within 35% on 43 of 68 (63%; the 80% target is not met: the misses are transformers-neuronx 2.18.0
    rows run with its default, untuned configuration at long prompts or batched prefill, and other stacks'
    flash-attention prefill, docs/planner.md). The 84 rows of optimum-neuron's inf2 pages, apart: TTFT within 35%
    on all, TPOT within 25% on 76."""
    on_sources = (v.ON_TNX, v.ON_NXD)
    ttft, tpot = _errors([r for r in v.HELD_OUT_ROWS if r.source not in on_sources])
    assert (len(ttft), len(tpot)) == (68, 69)
    assert sum(e <= 0.25 for e in tpot) >= 66, tpot
    assert sum(e <= 0.35 for e in ttft) >= 43, ttft
    # optimum-neuron's inf2 pages (84 batch-4/8 rows): predicted with their documented configuration
    ttft, tpot = _errors([r for r in v.HELD_OUT_ROWS if r.source in on_sources])
    assert (len(ttft), len(tpot)) == (84, 84)
    assert sum(e <= 0.25 for e in tpot) >= ON_TPOT_25, tpot
    assert sum(e <= 0.35 for e in ttft) >= ON_TTFT_35, ttft


def test_held_out_rows_of_the_fitted_configuration_class_are_within_target():
    """Held-out rows measured with the same tuned transformers-neuronx configuration as the fit rows (Neuron
    2.18.1 Llama-3 samples: BSH layout, fused QKV), on another instance (trn1): 12 rows, TPOT within 25% on all,
    TTFT within 35% on 11; and every 2.18.0 batch-1 row with a prompt under 4k (18 rows) within 35%."""
    tuned = [r for r in v.HELD_OUT_ROWS if r.neuron == "2.18.1"]
    ttft, tpot = _errors(tuned)
    assert len(tuned) == 12 and all(r.instance == "trn1.32xlarge" for r in tuned)
    assert max(tpot) <= 0.25 and sum(e <= 0.35 for e in ttft) >= 11
    short = [r for r in v.HELD_OUT_ROWS if r.neuron == "2.18.0" and r.batch == 1 and r.input_len < 4096]
    ttft, _ = _errors(short)
    assert len(short) == 18 and max(ttft) <= 0.35, ttft


def test_docs_validation_table_is_the_scripts_output():
    """docs/planner.md carries the table and the per-set error lines exactly as the script prints them now."""
    doc = (ROOT / "docs" / "planner.md").read_text()
    assert v.markdown(v.ROWS) in doc


def test_error_band_covers_the_stated_share_of_held_out_rows():
    for family in ("inf2", "trn1", "trn2"):
        band = v.error_band(family)
        rows = [r for r in v.HELD_OUT_ROWS if get_instance(r.instance).family == family]
        ttft, tpot = _errors(rows)
        assert band is not None and band.rows == len(rows)
        for errs, pct in ((ttft, band.ttft_pct), (tpot, band.tpot_pct)):
            inside = sum(e <= pct / 100 + 1e-12 for e in errs)
            # the smallest band that covers: any narrower one covers less than 80% (rows of equal error, such as
            # one optimum-neuron deployment's prompt lengths, enter the band together)
            strictly_inside = sum(e < pct / 100 - 1e-12 for e in errs)
            assert inside >= 0.8 * len(errs) > strictly_inside
    assert v.error_band("cpu") is None


def test_score_term_grows_with_the_square_of_the_prompt_and_vanishes_under_flash():
    cfg, inst = v.models()["Llama-3-70B"], get_instance("inf2.48xlarge")
    lay = head_layout(cfg, ParallelConfig(tp=24))
    no_scores = dataclasses.replace(DEFAULT_EFFICIENCY, attention_score_s=0.0)

    def scores(seq: int, flash: bool = False) -> float:
        a = prefill_time(cfg, lay, inst, batch=1, seq=seq, dtype="bfloat16", flash=flash).compute
        return a - prefill_time(cfg, lay, inst, batch=1, seq=seq, dtype="bfloat16", eff=no_scores,
                                flash=flash).compute

    assert scores(2048) == pytest.approx(4 * scores(1024))
    assert scores(2048) == pytest.approx(DEFAULT_EFFICIENCY.attention_score_s * 80 * 3 * 2048 * 2048)
    assert scores(2048, flash=True) == 0.0
    # flash skips the causal upper triangle: half the attention FLOPs
    full = prefill_time(cfg, lay, inst, batch=1, seq=2048, dtype="bfloat16", eff=no_scores).compute
    flash = prefill_time(cfg, lay, inst, batch=1, seq=2048, dtype="bfloat16", eff=no_scores, flash=True).compute
    attn = 4.0 * 80 * 3 * 2048 * 2048 * 128 / (inst.bf16_flops_per_core * DEFAULT_EFFICIENCY.tensor)
    assert full - flash == pytest.approx(attn / 2)


def test_prefill_hop_latency_is_paid_per_layer_all_reduce_per_ring_step() -> None:
    cfg, inst = v.models()["Llama-3-8B"], get_instance("inf2.48xlarge")
    lay = head_layout(cfg, ParallelConfig(tp=24))
    no_hops = dataclasses.replace(DEFAULT_EFFICIENCY, prefill_hop_latency_s=0.0)
    with_hops = prefill_time(cfg, lay, inst, batch=1, seq=128, dtype="int8").collective
    without = prefill_time(cfg, lay, inst, batch=1, seq=128, dtype="int8", eff=no_hops).collective
    assert with_hops - without == pytest.approx(2 * 32 * 22 * DEFAULT_EFFICIENCY.prefill_hop_latency_s)
    dec = decode_time(cfg, lay, inst, batch=1, kv_len=256, dtype="int8", kv_dtype="bfloat16")
    assert dec == decode_time(cfg, lay, inst, batch=1, kv_len=256, dtype="int8", kv_dtype="bfloat16", eff=no_hops)


def test_the_per_row_prefill_cost_is_paid_by_rows_beyond_the_first_and_fitted_after_the_step_constants() -> None:
    cfg, inst = v.models()["Llama-3-8B"], get_instance("inf2.48xlarge")
    lay = head_layout(cfg, ParallelConfig(tp=24))
    none = dataclasses.replace(DEFAULT_EFFICIENCY, prefill_row_s=0.0)
    assert DEFAULT_EFFICIENCY.prefill_row_s > 0
    for batch, seq in ((1, 128), (8, 128), (8, 2048)):
        with_rows = prefill_time(cfg, lay, inst, batch=batch, seq=seq, dtype="int8").total
        without = prefill_time(cfg, lay, inst, batch=batch, seq=seq, dtype="int8", eff=none).total
        assert with_rows - without == pytest.approx((batch - 1) * DEFAULT_EFFICIENCY.prefill_row_s)
    dec = decode_time(cfg, lay, inst, batch=8, kv_len=256, dtype="int8", kv_dtype="bfloat16")
    assert dec == decode_time(cfg, lay, inst, batch=8, kv_len=256, dtype="int8", kv_dtype="bfloat16", eff=none)
    # the first stage ignores the per-row cost it starts from: the step constants are the batch-1 model's
    assert v.fit(v.FIT_ROWS, dataclasses.replace(DEFAULT_EFFICIENCY, prefill_row_s=5e-3)) == DEFAULT_EFFICIENCY
    # batch-1 rows cannot see it: fitting them alone leaves it at the grid's first value
    assert v.fit([r for r in v.FIT_ROWS if r.batch == 1]).prefill_row_s == v.ROW_GRID[0]


def test_batched_rows_through_the_queue_model() -> None:
    """The published batched rows (batch 4/8, 128-8192 input tokens), held out apart from the fitted ones. Under
    transformers-neuronx's policy as AWS's benchmarks ran it the batch is prefilled in one call, so every prompt's
    TTFT is that call (p50 = p99 = the step model's TTFT); under optimum-neuron's continuous-batching graphs the
    rows are prefilled one per call at the compiled length, so every prompt waits for all of them (p50 = p99 =
    batch x one row's prefill). docs/planner.md carries the table as the script prints it."""
    rows = v.batched_rows(v.ROWS)
    aws = [r for r in rows if r.source in (v.TNX_INF2, v.TNX_TRN1)]
    on = [r for r in rows if r.source in (v.ON_TNX, v.ON_NXD)]
    assert len(aws) == 33 and sum(v.is_fit_row(r) for r in rows) == 4 and len(on) == 84
    assert len(rows) == len(aws) + len(on)
    for r in rows:
        q = v.predict_queue(r)
        assert 1e3 * q.ttft_p50 == pytest.approx(v.predict(r)[0]) and q.ttft_p99 == q.ttft_p50
    for r in on:  # one row per call, padded to the compiled length
        assert r.prefill_batch == 1 and not r.bucketed and r.prompts == r.batch
        one_row = dataclasses.replace(r, batch=1, together=None)
        assert v.predict(r)[0] == pytest.approx(r.batch * v.predict(one_row)[0])

    def within(sel: list) -> int:
        return sum(abs(1e3 * v.predict_queue(r).ttft_p50 - r.ttft_ms) / r.ttft_ms <= 0.35 for r in sel)

    held = [r for r in aws if not v.is_fit_row(r)]
    assert within(held) >= 14
    assert within(on) >= ON_TTFT_35
    assert within(held + on) >= HELD_BATCHED_TTFT_35
    assert v.queue_markdown(v.ROWS) in (ROOT / "docs" / "planner.md").read_text()
