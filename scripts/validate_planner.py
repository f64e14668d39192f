"""Predicted vs published TTFT/TPOT for the planner's latency model (docs/planner.md, "Validation").

Published rows are AWS's and Hugging Face's public measurements as collected in the project's peer survey
(§8 of shared/reference/peers.md; each row below names its source page). Every row is predicted with the same
constants (`neuron_opt.planner.latency.DEFAULT_EFFICIENCY`); nothing here is tuned per row.

  python scripts/validate_planner.py            # markdown table (pasted into docs/planner.md)
  python scripts/validate_planner.py --json     # machine-readable rows
  python scripts/validate_planner.py --fit      # re-derive the calibrated constants from the inf2 rows only

Layouts: the published runs used transformers-neuronx / NxDI / optimum-neuron, which pad the MLP's
intermediate dimension to a multiple of tp (14336 / 24 is not an integer) and pad query heads (32 -> 48 at
tp 24). Our own sharding pads the same way (neuron_opt.parallel.sharding), so every row is predicted with the
layout `neuron-opt plan` and `compile` use.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
from dataclasses import dataclass

from neuron_opt.buckets import powers_of_two, smallest_fitting
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner.hardware import get_instance
from neuron_opt.planner.latency import DEFAULT_EFFICIENCY, Efficiency, decode_time, prefill_time


def _llama(
    h: int,
    i: int,
    layers: int,
    heads: int,
    kv: int,
    vocab: int = 128256,
    max_pos: int = 8192,
    theta: float = 500000.0,
) -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": h,
            "intermediate_size": i,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "vocab_size": vocab,
            "max_position_embeddings": max_pos,
            "rope_theta": theta,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        }
    )


# public config.json values (meta-llama/*)
MODELS = {
    "Llama-3-8B": _llama(4096, 14336, 32, 32, 8),
    "Llama-3.1-8B": _llama(4096, 14336, 32, 32, 8, max_pos=131072),
    "Llama-3-70B": _llama(8192, 28672, 80, 64, 8),
    "Llama-3.3-70B": _llama(8192, 28672, 80, 64, 8, max_pos=131072),
    "Llama-3.1-405B": _llama(16384, 53248, 126, 128, 8, max_pos=131072),
    "Llama-2-7b": _llama(4096, 11008, 32, 32, 32, vocab=32000, max_pos=4096, theta=10000.0),
}

TNX_INF2 = "AWS inf2 benchmark page (Neuron 2.18, transformers-neuronx)"
TNX_TRN1 = "AWS trn1 benchmark page (Neuron 2.18, transformers-neuronx)"
NXDI_TRN2 = "NxDI trn2 tutorial (vLLM + LLMPerf)"
ON_TRN2 = "optimum-neuron vLLM benchmark, 1 user (sync)"
VN_TRN2 = "vLLM Neuron plugin EAGLE3 tutorial, baseline"


@dataclass(frozen=True)
class Row:
    """One published measurement and the deployment it was taken with."""

    model: str
    instance: str
    tp: int
    batch: int
    seq: int  # compiled max length
    input_len: int
    output_len: int
    ttft_ms: float | None
    tpot_ms: float
    dtype: str
    source: str
    prefill_batch: int  # rows prefilled together (TNX prefills the whole batch at once)
    bucketed: bool = True  # False: graphs compiled at the full length only (optimum-neuron)


ROWS = [
    Row("Llama-3-8B", "inf2.48xlarge", 24, 1, 8192, 128, 8064, 29.47, 7.41, "int8", TNX_INF2, 1),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 1, 8192, 4096, 4096, 209.37, 7.47, "int8", TNX_INF2, 1),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 1, 4096, 128, 3968, 25.00, 6.42, "int8", TNX_INF2, 1),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 1, 4096, 2048, 2048, 101.81, 6.50, "int8", TNX_INF2, 1),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 8, 8192, 128, 8064, 68.95, 15.22, "int8", TNX_INF2, 8),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 8, 4096, 128, 3968, 66.02, 10.45, "int8", TNX_INF2, 8),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 8, 4096, 2048, 2048, 823.53, 10.50, "int8", TNX_INF2, 8),
    Row("Llama-3-70B", "inf2.48xlarge", 24, 1, 4096, 2048, 2048, 745.49, 34.67, "bfloat16", TNX_INF2, 1),
    Row("Llama-3-70B", "inf2.48xlarge", 24, 1, 256, 128, 128, 77.81, 32.20, "bfloat16", TNX_INF2, 1),
    Row("Llama-2-7b", "inf2.48xlarge", 24, 1, 4096, 128, 3968, 27.64, 6.47, "bfloat16", TNX_INF2, 1),
    Row("Llama-2-7b", "inf2.48xlarge", 24, 8, 4096, 128, 3968, 77.36, 12.11, "bfloat16", TNX_INF2, 8),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 1, 4096, 128, 3968, 14.75, 5.86, "int8", TNX_TRN1, 1),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 1, 8192, 4096, 4096, 153.02, 7.04, "int8", TNX_TRN1, 1),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 8, 4096, 128, 3968, 49.05, 7.65, "int8", TNX_TRN1, 8),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 8, 8192, 4096, 4096, 1265.95, 10.04, "int8", TNX_TRN1, 8),
    Row("Llama-3-70B", "trn1.32xlarge", 32, 1, 1152, 128, 1024, 53.2, 24.48, "bfloat16", TNX_TRN1, 1),
    Row("Llama-3-70B", "trn1.32xlarge", 32, 1, 4096, 2048, 2048, 547.0, 26.20, "bfloat16", TNX_TRN1, 1),
    Row("Llama-2-7b", "trn1.32xlarge", 32, 1, 8192, 128, 8064, 13.32, 6.70, "bfloat16", TNX_TRN1, 1),
    Row("Llama-2-7b", "trn1.32xlarge", 32, 8, 8192, 128, 8064, 66.40, 10.10, "bfloat16", TNX_TRN1, 8),
    Row("Llama-3.3-70B", "trn2.48xlarge", 64, 1, 12800, 10000, 1500, 814.2, 19.6, "bfloat16", NXDI_TRN2, 1),
    Row("Llama-3.1-405B", "trn2.48xlarge", 64, 1, 12800, 10000, 1500, 2442.0, 37.9, "bfloat16", NXDI_TRN2, 1),
    Row("Llama-3.1-8B", "trn2.48xlarge", 4, 32, 4096, 1500, 250, 197.2, 22.14, "bfloat16", ON_TRN2, 1, False),
    Row(
        "Llama-3.1-8B",
        "inf2.48xlarge",
        8,
        32,
        4096,
        1500,
        250,
        None,
        24.5,
        "bfloat16",
        "optimum-neuron chunked-prefill study, standard prefill + on-device sampling, sync",
        1,
        False,
    ),
    Row("Llama-3.1-8B", "trn2.48xlarge", 8, 2, 1024, 512, 128, 51.07, 10.52, "bfloat16", VN_TRN2, 1),
]


def is_fit_row(row: Row) -> bool:
    """The calibration set: AWS's transformers-neuronx rows on inf2.48xlarge fit the constants (`--fit`);
    every other row (trn1, trn2, other stacks) is held out and never seen by the fit."""
    return row.instance == "inf2.48xlarge" and row.source == TNX_INF2


FIT_ROWS = [r for r in ROWS if is_fit_row(r)]
HELD_OUT_ROWS = [r for r in ROWS if not is_fit_row(r)]


def predict(row: Row, eff: Efficiency = DEFAULT_EFFICIENCY) -> tuple[float, float]:
    """(TTFT ms, TPOT ms) for a row. TPOT is taken at the median output token (p50 of per-token latency)."""
    cfg, inst = MODELS[row.model], get_instance(row.instance)
    lay = head_layout(cfg, ParallelConfig(tp=row.tp))
    if row.bucketed:
        prefill_seq = smallest_fitting(row.input_len, powers_of_two(128, row.seq))
        kv_len = smallest_fitting(row.input_len + row.output_len // 2 + 1, powers_of_two(128, row.seq))
    else:
        prefill_seq = kv_len = row.seq
    assert prefill_seq is not None and kv_len is not None
    ttft = prefill_time(cfg, lay, inst, batch=row.prefill_batch, seq=prefill_seq, dtype=row.dtype, eff=eff)
    tpot = decode_time(
        cfg, lay, inst, batch=row.batch, kv_len=kv_len, dtype=row.dtype, kv_dtype="bfloat16", eff=eff
    )
    return 1e3 * ttft.total, 1e3 * tpot.total


def _err(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas


def fit(rows: list[Row]) -> Efficiency:
    """Grid search of the four calibrated constants minimising the summed absolute log error of TTFT and
    TPOT.

    Absolute (not squared) error so that the few rows no setting explains (short-prompt TTFT on inf2, see
    docs/planner.md) do not drag every other row off.
    """
    best, best_loss = DEFAULT_EFFICIENCY, math.inf
    tensors = [0.05 * k for k in range(2, 13)]
    latencies = [5e-6 * k for k in range(0, 31)]
    overheads = [0.25e-3 * k for k in range(0, 17)]
    hops = [2e-6 * k for k in range(0, 16)]
    for t, a, o, h in itertools.product(tensors, latencies, overheads, hops):
        eff = dataclasses.replace(
            DEFAULT_EFFICIENCY, tensor=t, collective_latency_s=a, step_overhead_s=o, prefill_hop_latency_s=h
        )
        loss = 0.0
        for r in rows:
            ttft, tpot = predict(r, eff)
            loss += abs(math.log(tpot / r.tpot_ms)) + (abs(math.log(ttft / r.ttft_ms)) if r.ttft_ms else 0.0)
        if loss < best_loss:
            best, best_loss = eff, loss
    return best


def table(rows: list[Row]) -> list[dict]:
    """One dict per row: the published figures, the predictions and the errors (rounded for display)."""
    out = []
    for r in rows:
        ttft, tpot = predict(r)
        out.append(
            {
                **dataclasses.asdict(r),
                "pred_ttft_ms": round(ttft, 2),
                "pred_tpot_ms": round(tpot, 2),
                "ttft_err_pct": None if r.ttft_ms is None else round(_err(ttft, r.ttft_ms), 1),
                "tpot_err_pct": round(_err(tpot, r.tpot_ms), 1),
                "held_out": not is_fit_row(r),
            }
        )
    return out


def markdown(rows: list[Row]) -> str:
    """The validation table of docs/planner.md, then the per-set summary lines."""
    lines = [
        "| Model | Instance | tp | BS | Seq | In/Out | Weights | TTFT pub | TTFT pred | err | TPOT pub | "
        "TPOT pred | err | Set | Source |",
        "|" + "---|" * 15,
    ]
    for d in table(rows):
        ttft_pub = "—" if d["ttft_ms"] is None else f"{d['ttft_ms']:.1f}"
        ttft_err = "—" if d["ttft_err_pct"] is None else f"{d['ttft_err_pct']:+.0f}%"
        lines.append(
            f"| {d['model']} | {d['instance']} | {d['tp']} | {d['batch']} | {d['seq']} | "
            f"{d['input_len']}/{d['output_len']} | {d['dtype']} | {ttft_pub} | {d['pred_ttft_ms']:.1f} | "
            f"{ttft_err} | {d['tpot_ms']:.2f} | {d['pred_tpot_ms']:.2f} | {d['tpot_err_pct']:+.0f}% | "
            f"{'held out' if d['held_out'] else 'fit'} | {d['source']} |"
        )
    lines += ["", *summary(rows)]
    return "\n".join(lines)


def _within(errs: list[float], limit: float) -> str:
    """`n/m within limit% (median, max |err|)` of a list of percent errors."""
    a = sorted(abs(e) for e in errs)
    ok = sum(e <= limit for e in a)
    return f"within {limit:.0f}% on {ok}/{len(a)} (median |err| {statistics.median(a):.0f}%, max {a[-1]:.0f}%)"


def summary(rows: list[Row]) -> list[str]:
    """One line per set, fitted rows (the constants were fitted on them) apart from held-out rows; thresholds
    are applied to unrounded errors."""
    out = []
    for label, held_out in (("fitted rows", False), ("held-out rows", True)):
        tpot, ttft = [], []
        for r in rows:
            if is_fit_row(r) == held_out:
                continue
            pred_ttft, pred_tpot = predict(r)
            tpot.append(_err(pred_tpot, r.tpot_ms))
            if r.ttft_ms is not None:
                ttft.append(_err(pred_ttft, r.ttft_ms))
        out.append(f"- {label}: TPOT {_within(tpot, 25)}; TTFT {_within(ttft, 35)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fit", action="store_true", help="re-derive the calibrated constants from the fit rows")
    args = ap.parse_args()
    if args.fit:
        print(fit(FIT_ROWS))
        return
    print(json.dumps(table(ROWS), indent=1) if args.json else markdown(ROWS))


if __name__ == "__main__":
    main()
