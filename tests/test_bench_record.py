"""What a benchmark run records about its machine (neuron_opt.bench): the machine record, the idle check and its
verdicts, the median / min-max summary of rounds, the per-round ratios of the decode benchmark, and the llama.cpp
processes' environment. Quick, and no timing is asserted: the process-table parts run on synthetic tables, and the
one real watch only checks who is counted, not how much."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import neuron_opt.bench as bench
from neuron_opt.bench import (
    ISA_FLAGS,
    MAX_LOAD_PER_CORE,
    CpuWatch,
    MachineBusyError,
    RunRecord,
    busy_reasons,
    enforce_idle,
    machine,
    other_use,
    own_tree,
    parse_proc_stat,
    rounds_summary,
)


def _stat(pid: int, name: str, ppid: int, utime: int, stime: int, start: int) -> str:
    """A /proc/PID/stat line: fields 3.. after the name; utime, stime are fields 14, 15, starttime field 22."""
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 6 + [str(start), "0", "0"]
    return f"{pid} ({name}) " + " ".join(fields)


def test_parse_proc_stat_splits_after_the_last_parenthesis() -> None:
    assert parse_proc_stat(_stat(42, "a (b) c", 7, 30, 12, 999)) == ("a (b) c", 7, 42, 999)
    assert parse_proc_stat(Path(f"/proc/{os.getpid()}/stat").read_text())[1] == os.getppid()


def test_own_tree_is_the_root_and_its_descendants() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert own_tree(parents, 10) == {10, 11, 12, 13}
    assert own_tree(parents, 21) == {21}


def test_other_use_counts_processes_outside_the_tree_from_their_start() -> None:
    before = {10: ("bench", 1, 100, 5), 20: ("pytest", 1, 1000, 5), 30: ("old", 1, 50, 5), 40: ("idle", 1, 7, 5)}
    after = {10: ("bench", 1, 300, 5), 11: ("worker", 10, 200, 9),  # ours: excluded whatever they used
             20: ("pytest", 1, 1150, 5),  # 150 ticks over 1 s at 100 Hz: 1.5 cores
             30: ("new", 1, 40, 8),  # pid reused (another start time): counted from its start, 40 ticks
             40: ("idle", 1, 7, 5),  # used nothing: not listed
             50: ("make", 1, 10, 9)}  # started after `before`: all its ticks
    use = other_use(before, after, own={10, 11}, seconds=1.0, hz=100)
    assert use == [{"pid": 20, "name": "pytest", "cores": 1.5}, {"pid": 30, "name": "new", "cores": 0.4},
                   {"pid": 50, "name": "make", "cores": 0.1}]


def test_busy_reasons_name_the_busy_processes_and_the_load() -> None:
    quiet = {"seconds": 2.0, "other_cores": 0.01, "busy": []}
    assert busy_reasons(quiet) == []
    assert busy_reasons(quiet, load1=0.1, cores=2) == []
    busy = {"seconds": 2.0, "other_cores": 0.9, "busy": [{"pid": 20, "name": "pytest", "cores": 0.9}]}
    (why,) = busy_reasons(busy)
    assert "0.90 cores" in why and "pytest (pid 20)" in why
    (why,) = busy_reasons(quiet, load1=MAX_LOAD_PER_CORE * 2 + 0.5, cores=2)
    assert "load average" in why


def test_enforce_idle_warns_or_refuses() -> None:
    assert enforce_idle({"idle": True, "reasons": []}, require=True, when="at the start") is None
    busy = {"idle": False, "reasons": ["other processes used 0.90 cores over 2.0 s: pytest (pid 20) 0.90"]}
    warning = enforce_idle(busy, require=False, when="at the start")
    assert "not idle at the start" in warning and "pytest (pid 20)" in warning
    with pytest.raises(MachineBusyError, match="--require-idle"):
        enforce_idle(busy, require=True, when="during batch 1, round 2")


def test_run_record_keeps_the_warning_or_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    busy = {"idle": False, "reasons": ["1-minute load average 3.00 on 2 cores (idle: <= 0.50)"],
            "load_average": (3.0, 2.0, 1.0), "cores": 2, "watch": {}}
    monkeypatch.setattr(bench, "idle_check", lambda: busy)
    rec = RunRecord(require_idle=False, bandwidth_gib=None)
    doc = rec.finish()
    assert doc["machine"]["mem_bw_gbs"] is None  # no probe asked for
    assert doc["idle"]["start"] is busy  # (the whole-run watch sees this real machine: it may warn as well)
    assert doc["idle"]["warnings"][0].startswith("the machine was not idle at the start: 1-minute load average")
    assert {"idle", "reasons", "seconds", "other_cores", "busy"} <= set(doc["idle"]["run"])
    with pytest.raises(MachineBusyError, match="load average 3.00"):
        RunRecord(require_idle=True, bandwidth_gib=None)


def test_machine_records_the_cpu_model_isa_and_a_bandwidth_probe() -> None:
    import torch

    m = machine(bandwidth_gib=1 / 16)
    cpuinfo = Path("/proc/cpuinfo").read_text()
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
    if names:
        assert m["cpu_model"] == names[0]
    flags = next((set(ln.split(":", 1)[1].split()) for ln in cpuinfo.splitlines() if ln.startswith("flags")), set())
    assert m["isa"] == [f for f in ISA_FLAGS if f in flags]
    assert m["cores"] == len(os.sched_getaffinity(0)) and m["memory_gb"] > 0 and len(m["load_average"]) == 3
    assert m["torch"] == torch.__version__ and m["mem_bw_gbs"] > 0


def test_cpu_watch_counts_others_not_its_own_children() -> None:
    """A spinning child of ours is the benchmark's own work; a spinning process outside our tree (its parent
    exited, so it was re-parented) is another's. Only who is listed is checked, not how much they used."""
    spin = [sys.executable, "-c", "import time; t = time.monotonic()\nwhile time.monotonic() - t < 20: pass"]
    ours = subprocess.Popen(spin)
    # the orphan's output goes nowhere, so the pipe it would inherit closes when its parent exits
    orphan_maker = subprocess.run([sys.executable, "-c", "import subprocess; print(subprocess.Popen("
                                   f"{spin!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                                  capture_output=True, text=True, check=True, timeout=60)
    other = int(orphan_maker.stdout)
    try:
        watch = CpuWatch()
        time.sleep(0.5)
        rec = watch.stop()
    finally:
        ours.kill()
        ours.wait()
        os.kill(other, 9)
    listed = {p["pid"] for p in rec["busy"]}
    assert other in listed and ours.pid not in listed and os.getpid() not in listed
    assert rec["other_cores"] > 0 and rec["idle"] == (not rec["reasons"])


def test_rounds_summary_is_the_median_with_min_and_max() -> None:
    assert rounds_summary([3.0, 1.0, 2.0, 10.0, 4.0]) == {"median": 3.0, "min": 1.0, "max": 10.0, "rounds": 5}
    assert rounds_summary([1.0, 2.0, 3.0, 4.0])["median"] == 2.5
    with pytest.raises(ValueError):
        rounds_summary([])


def test_decode_rows_are_medians_with_min_max_and_per_round_ratios() -> None:
    from neuron_opt.bench.decode import Result, _summarize

    def rounds(system: str, tok_s: list[float]) -> list[Result]:
        return [Result(system, "float32", 1, t, 8, 1e8, mem_bw_gbs=10.0) for t in tok_s]

    hf, ours = _summarize({"hf": rounds("transformers-eager", [20.0, 25.0, 30.0, 22.0, 21.0]),
                           "cpu-fp32": rounds("neuron_opt-cpu-compiled", [40.0, 100.0, 60.0, 44.0, 63.0])})
    assert (hf.tok_s, hf.tok_s_min, hf.tok_s_max) == (22.0, 20.0, 30.0)
    assert (ours.tok_s, ours.tok_s_min, ours.tok_s_max) == (60.0, 40.0, 100.0)
    assert ours.runs_tok_s == [40.0, 100.0, 60.0, 44.0, 63.0]
    assert ours.ratio_vs_hf == pytest.approx(60.0 / 22.0) and hf.ratio_vs_hf == 1.0
    assert ours.ratio_vs_hf_runs == pytest.approx([2.0, 4.0, 2.0, 2.0, 3.0])
    assert ours.mbu == pytest.approx(1e8 * 60.0 / 10e9)


def test_llamacpp_processes_run_without_omp_wait_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp runs with libgomp's default wait policy, as its users run it, whatever ours is set to."""
    from neuron_opt.bench.decode import LLAMACPP_UNSET_ENV, _in_fresh_process

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert _in_fresh_process(os.getenv, "OMP_WAIT_POLICY", unset_env=LLAMACPP_UNSET_ENV) is None
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # restored in this process
    assert _in_fresh_process(os.getenv, "OMP_WAIT_POLICY") == "PASSIVE"


def test_idle_check_waits_for_a_trailing_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the load average over the bar while no other process runs (work that just ended): the check waits for
    it to fall instead of calling the machine busy; a load that does not fall is a verdict after settle_s."""
    readings = iter([(1.2, 0.5, 0.2), (0.9, 0.5, 0.2), (0.3, 0.5, 0.2)])
    monkeypatch.setattr(bench.os, "getloadavg", lambda: next(readings))
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    monkeypatch.setattr(bench, "CpuWatch", lambda: type("W", (), {"stop": lambda self: {
        "seconds": 2.0, "other_cores": 0.0, "busy": []}})())
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1})
    rec = bench.idle_check(sample_s=0.01)
    assert rec["idle"] and rec["settled_s"] > 0 and rec["load_average"][0] == 0.3
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (1.2, 0.5, 0.2))
    rec = bench.idle_check(sample_s=0.01, settle_s=20.0)
    assert not rec["idle"] and "load average 1.20" in rec["reasons"][0] and rec["settled_s"] >= 20.0
