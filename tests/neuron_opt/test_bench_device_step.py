"""scripts/bench_device_step.py --quick end to end on a tiny checkpoint with the default model's vocabulary (the
eager backend): the JSON's parts and what they must hold. Timings are not asserted: speed is measured by running
the benchmark, not by tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_opt.planner.latency import host_sampling_time
from neuron_opt.planner.validation import models

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # compiles and runs a cpu artifact end to end (the default suite's budget)
def test_bench_device_step_quick(tiny_dir, tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_device_step.py"), "--quick", "--cpu-model",
                    str(tiny_dir("smollm-tok")), "--out", str(out)], check=True, cwd=ROOT, timeout=300)
    doc = json.loads(out.read_text())
    assert doc["quick"] and doc["machine"]["cpu_model"] and len(doc["machine"]["load_average"]) == 3
    assert set(doc["idle"]) == {"start", "run"}
    cpu = doc["step"]["cpu"]
    assert cpu["vocab"] == 49152 and not cpu["samples_in_graph"] and list(cpu["batches"]) == ["1"]
    for kind in ("greedy", "top_p"):
        ways = cpu["batches"]["1"][kind]
        assert list(ways) == ["host"]  # the eager backend's graphs return logits
        host = ways["host"]
        assert host["out_bytes"] == 4 * 49152 and host["d2h_bytes"] == 0  # fp32 logits [1, V], all on the host
        assert 0 < host["graph_ms"] < host["step_ms"] and host["sample_ms"] > 0
        assert host["host_ms"] == pytest.approx(host["step_ms"] - host["graph_ms"], abs=1e-3)
        assert host["step_cpu_ms"] > 0 and host["sample_cpu_ms"] > 0
    assert cpu["batches"]["1"]["argmax_cpu_ms"] >= 0
    serve = doc["serve"]["1"]
    for mode in ("sync", "async"):
        assert serve[mode]["tpot_p50_ms"]["rounds"] == 1 and serve[mode]["tpot_p50_ms"]["median"] > 0
    assert serve["tpot_change"] == pytest.approx(
        serve["async"]["tpot_p50_ms"]["median"] / serve["sync"]["tpot_p50_ms"]["median"] - 1)
    assert [len(doc["serve_runs"][k]) for k in ("sync/1", "async/1")] == [1, 1]
    cfg = models()["Llama-3.1-8B"]
    rows = {r["instance"]: r for r in doc["planner"]}
    assert sorted(rows) == ["inf2.48xlarge", "trn1.32xlarge"]
    for r in rows.values():  # one stream: a batch-1 decode bucket
        assert r["decode_batch"] == 1 and r["ids_bytes"] == 4 and r["logits_bytes"] == 4 * cfg.vocab_size
        assert r["host_sampling_ms"] == pytest.approx(1e3 * host_sampling_time(cfg, 1), abs=1e-3)
        assert r["tpot_host_sampling_ms"] == pytest.approx(r["tpot_graph_sampling_ms"] + r["host_sampling_ms"],
                                                           abs=2e-3)
        assert -1 < r["tpot_change"] < 0


def test_bench_device_step_refuses_what_it_cannot_run() -> None:
    script = str(ROOT / "scripts" / "bench_device_step.py")
    for argv, msg in ((["--steps", "3"], "give --cpu-model"),
                      (["--xla-model", "x"], "--xla-model and --xla-python go together"),
                      (["--quick", "--cpu-model", "x", "--require-idle"], "not a record")):
        r = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 2 and msg in r.stderr
