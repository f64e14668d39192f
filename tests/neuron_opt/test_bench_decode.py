"""scripts/bench_decode.py (neuron_opt.bench.decode) end to end on a tiny checkpoint: JSON shape, one fresh process
per system and round, medians of the rounds, and agreement against HF fp32 (exact for the fp32 systems on this
model). Timings are not asserted: speed is measured by running the benchmark, not by tests."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from neuron_opt.bench.decode import main


@pytest.mark.slow  # a cpu compile and a fresh process per system and round: ~2 min (make test-slow)
def test_bench_decode_json_on_a_tiny_model(tiny_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_OPT_CACHE_DIR", str(tmp_path / "cache"))  # children inherit it
    out = tmp_path / "decode.json"
    rc = main(["--model", str(tiny_dir("smollm-tok")), "--systems", "hf,eager,cpu-fp32", "--batches", "1",
               "--steps", "4", "--agreement-tokens", "8", "--repeats", "2", "--max-model-len", "128", "--json",
               "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["repeats"] == 2 and doc["mem_bw_gbs"] > 0
    rows = {(r["system"], r["dtype"], r["batch"]): r for r in doc["results"]}
    assert list(rows) == [("transformers-eager", "float32", 1), ("neuron_opt-eager", "float32", 1),
                          ("neuron_opt-cpu-compiled", "float32", 1)]
    for r in rows.values():
        assert len(r["runs_tok_s"]) == 2 and min(r["runs_tok_s"]) > 0
        assert r["tok_s"] == pytest.approx(statistics.median(r["runs_tok_s"]))
        assert r["mbu"] > 0
    hf = rows[("transformers-eager", "float32", 1)]
    assert hf["ratio_vs_hf"] == 1.0 and hf["agreement_vs_hf_fp32"] is None
    assert rows[("neuron_opt-eager", "float32", 1)]["agreement_vs_hf_fp32"] == 1.0
    assert rows[("neuron_opt-cpu-compiled", "float32", 1)]["agreement_vs_hf_fp32"] >= 7 / 8


def test_bench_decode_refuses_unknown_systems() -> None:
    with pytest.raises(SystemExit) as e:
        main(["--systems", "hf,llamacpp"])
    assert e.value.code == 2


def test_moe_bytes_per_step_count_the_selected_experts(tiny_dir) -> None:
    """Tiny Mixtral, 8 experts, top 2, untied: batch 1 reads the active parameters (the bound), batch 3 gathers 6
    experts per layer, batch 4 and up reads all 8; the embedding table is read one row per sequence."""
    import torch

    from neuron_opt.bench.decode import active_bytes, kv_bytes, step_bytes
    from neuron_opt.config import ModelConfig

    cfg = ModelConfig.from_hf(tiny_dir("mixtral"))
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 * cfg.num_hidden_layers  # one expert, every layer
    kv = kv_bytes(cfg, 4, 1, 40)
    assert step_bytes(cfg, torch.float32, 1, 40) == pytest.approx(active_bytes(cfg, torch.float32, 1, 40))
    base = step_bytes(cfg, torch.float32, 1, 40) - kv - 2 * expert - cfg.hidden_size * 4  # without experts and row
    for batch, experts in ((3, 6), (4, 8), (16, 8)):
        want = base + experts * expert + batch * cfg.hidden_size * 4 + batch * kv
        assert step_bytes(cfg, torch.float32, batch, 40) == pytest.approx(want)
    assert active_bytes(ModelConfig.from_hf(tiny_dir("llama-gqa2")), torch.float32, 1, 40) is None
