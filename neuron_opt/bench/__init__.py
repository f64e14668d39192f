"""Benchmarks (side by side with the peer, JSON output), and what a run of record records about its machine. Thin
wrappers live in scripts/bench_*.py.

Design decisions:
- A figure stands for its run only when the run says what it ran on: `machine()` (CPU model, the ISA flags our
  kernels and llama.cpp's pick paths by, usable cores, memory, a memory-bandwidth probe, torch) goes into every
  benchmark JSON.
- A busy machine makes timings lie, and spinning thread pools (llama.cpp's, OpenMP's) collapse when another
  process takes a core. So a run checks that the machine is idle before it starts (`idle_check`) and watches the
  other processes' CPU use over each round (`CpuWatch`); both go into the JSON, a busy verdict with a warning, and
  `--require-idle` turns the warning into a refusal (`enforce_idle`).
- "Other processes" means every process outside the benchmark's own process tree: its fresh worker processes and
  the server it starts are its own work. Per-process CPU time comes from /proc/PID/stat, so a busy process is
  named in the warning. A process that starts and ends between two samples is not seen; the 1-minute load
  average, recorded beside, catches what ran shortly before the start.
- Rounds are summarized by their median, with the min and max shown beside it (`rounds_summary`).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# The machine is busy when, over the sample, processes outside the benchmark's own tree used this many cores
# together, or when the 1-minute load average exceeds this share of the usable cores.
MAX_OTHER_CORES = 0.1
MAX_LOAD_PER_CORE = 0.25
BUSY_LISTED = 0.02  # a process is named in the record from this share of one core


class MachineBusyError(RuntimeError):
    """`--require-idle` and the machine is not idle (the message names what is busy)."""


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() says only "x86_64")."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def host() -> str:
    """The CPU model and logical core count, in one string."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a streaming read (a sum over a buffer far larger than the caches), best of `repeats`."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def llc_bytes(cpu_root: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """Bytes of the last-level cache the usable cores share: the highest cache level sysfs lists for them, each
    instance (a distinct shared_cpu_list) counted once. None where sysfs lists no caches."""
    found: dict[tuple[int, str], int] = {}  # (level, shared_cpu_list) -> bytes
    for cpu in sorted(os.sched_getaffinity(0)):
        for index in (cpu_root / f"cpu{cpu}" / "cache").glob("index*"):
            try:
                kind, level = (index / "type").read_text().strip(), int((index / "level").read_text())
                size, shared = (index / "size").read_text().strip(), (index / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            if kind == "Instruction" or not size:
                continue
            units = {"K": 2**10, "M": 2**20, "G": 2**30}
            nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
            found[(level, shared)] = nbytes
    if not found:
        return None
    top = max(level for level, _ in found)
    return sum(nbytes for (level, _), nbytes in found.items() if level == top)


def machine(bandwidth_gib: float | None = 1.0) -> dict[str, object]:
    """What a benchmark's JSON records of the machine: CPU model, the ISA flags that change our kernels (and
    llama.cpp's), usable cores, memory, the last-level cache (`llc_bytes`), the load average now, torch's version,
    and the read bandwidth probed over a `bandwidth_gib` buffer (None: no probe)."""
    flags: set[str] = set()
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        flags = set(line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    return {"cpu": host(), "cpu_model": cpu_model(), "isa": [f for f in ISA_FLAGS if f in flags],
            "cores": len(os.sched_getaffinity(0)), "logical_cpus": os.cpu_count(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "llc_bytes": llc_bytes(), "load_average": os.getloadavg(), "torch": torch.__version__,
            "mem_bw_gbs": None if bandwidth_gib is None else round(read_bandwidth_gbs(bandwidth_gib), 2)}


def rounds_summary(values: list[float]) -> dict[str, float]:
    """The median of a benchmark's rounds with the min and max beside it."""
    if not values:
        raise ValueError("rounds_summary: no rounds")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


# ---- is the machine idle? ------------------------------------------------------------------------------------


def parse_proc_stat(text: str) -> tuple[str, int, int, int]:
    """(command name, parent pid, user + system clock ticks, start time in ticks) from a /proc/PID/stat line. The
    name is in parentheses and may itself hold spaces and parentheses, so the fields are split after the last ')'."""
    head, _, rest = text.rpartition(")")
    name = head.split("(", 1)[1]
    f = rest.split()  # f[0] is field 3 (state)
    return name, int(f[1]), int(f[11]) + int(f[12]), int(f[19])


def process_table() -> dict[int, tuple[str, int, int, int]]:
    """Every process now: pid -> parse_proc_stat of its stat line (processes that exit meanwhile are skipped)."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                table[int(d)] = parse_proc_stat(Path(f"/proc/{d}/stat").read_text())
            except (OSError, IndexError, ValueError):
                continue
    return table


def own_tree(parents: dict[int, int], root: int) -> set[int]:
    """`root` and every process descended from it, given pid -> parent pid."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def other_use(before: dict[int, tuple[str, int, int, int]], after: dict[int, tuple[str, int, int, int]],
              own: set[int], seconds: float, hz: int) -> list[dict[str, object]]:
    """CPU used between two process tables by the processes outside `own`, busiest first: [{pid, name, cores}],
    cores = CPU seconds / wall seconds. A process absent from `before` (or a reused pid: another start time) counts
    from its start."""
    out = []
    for pid, (name, _, ticks, start) in after.items():
        if pid in own:
            continue
        prev = before.get(pid)
        used = ticks - (prev[2] if prev is not None and prev[3] == start else 0)
        if used > 0:
            out.append({"pid": pid, "name": name, "cores": round(used / hz / seconds, 3)})
    return sorted(out, key=lambda p: -p["cores"])


class CpuWatch:
    """The other processes' CPU use from construction to `stop()` (the benchmark's own process tree excluded)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._before = process_table()

    def stop(self) -> dict[str, object]:
        """{idle, reasons (busy_reasons), seconds, other_cores (summed), busy: the processes that used at least
        BUSY_LISTED of a core, busiest first}."""
        after = process_table()
        seconds = time.monotonic() - self._t0
        own = own_tree({pid: p[1] for pid, p in after.items()}, os.getpid())
        # CPU time comes in clock ticks (10 ms): over a window shorter than a second one tick would read as a
        # busy core, so shares are taken over at least one second
        use = other_use(self._before, after, own, max(seconds, 1.0), os.sysconf("SC_CLK_TCK"))
        rec = {"seconds": round(seconds, 2), "other_cores": round(sum(p["cores"] for p in use), 3),
               "busy": [p for p in use if p["cores"] >= BUSY_LISTED][:10]}
        reasons = busy_reasons(rec)
        return {"idle": not reasons, "reasons": reasons, **rec}


def busy_reasons(watch: dict[str, object], load1: float | None = None, cores: int | None = None) -> list[str]:
    """Why a CpuWatch record (and, at the start of a run, the 1-minute load average over `cores`) says the
    machine is not idle; empty when it is."""
    reasons = []
    if watch["other_cores"] >= MAX_OTHER_CORES:
        names = ", ".join(f"{p['name']} (pid {p['pid']}) {p['cores']:.2f}" for p in watch["busy"][:5])
        reasons.append(f"other processes used {watch['other_cores']:.2f} cores over {watch['seconds']} s"
                       + (f": {names}" if names else ""))
    if load1 is not None and cores and load1 > MAX_LOAD_PER_CORE * cores:
        reasons.append(f"1-minute load average {load1:.2f} on {cores} cores (idle: <= {MAX_LOAD_PER_CORE * cores:.2f})")
    return reasons


def idle_check(sample_s: float = 2.0, settle_s: float = 120.0) -> dict[str, object]:
    """Is the machine idle now? Watches the other processes for `sample_s` seconds and reads the load average:
    {idle, reasons, load_average, cores, watch, settled_s}.

    The load average trails by a minute: right after work that has ended (the compile a `make bench` step ran
    before this one) it still reads high while no process runs. When the other processes are idle and only the
    load average is over the bar, the check waits for it to fall, up to `settle_s` seconds (`settled_s`: how long
    it waited); other processes using the cores are a verdict at once."""
    waited = 0.0
    while True:
        watch = CpuWatch()
        time.sleep(sample_s)
        rec = watch.stop()
        load, cores = os.getloadavg(), len(os.sched_getaffinity(0))
        reasons = busy_reasons(rec, load[0], cores)
        if not reasons or busy_reasons(rec) or waited >= settle_s:
            break
        time.sleep(5.0)
        waited += 5.0 + sample_s
    return {"idle": not reasons, "reasons": reasons, "load_average": load, "cores": cores, "watch": rec,
            "settled_s": waited}


def enforce_idle(record: dict[str, object], require: bool, when: str) -> str | None:
    """The warning for a busy `record` (an idle_check, or a round's CpuWatch with its reasons), None when idle.

    Raises:
        MachineBusyError: the machine is busy and `require` (--require-idle) was given.
    """
    if record["idle"]:
        return None
    msg = (f"the machine was not idle {when}: {'; '.join(record['reasons'])}. Timings taken beside other work "
           f"are not comparable (spinning thread pools collapse under contention)")
    if require:
        raise MachineBusyError(msg + "; --require-idle refuses to go on")
    return msg


class RunRecord:
    """The machine and its idleness over one benchmark run, for the run's JSON: the idle check and the machine
    record (with its bandwidth probe) at construction, before the run; `check` for the verdict of a part of the
    run (a round's CpuWatch); `finish` at the end, with the other processes' CPU use over the whole run.

    Raises (at construction, `check` or `finish`):
        MachineBusyError: the machine is not idle and `require_idle` (--require-idle).
    """

    def __init__(self, require_idle: bool, bandwidth_gib: float | None = 1.0) -> None:
        self.require_idle = require_idle
        self.idle: dict[str, object] = {"start": idle_check(), "warnings": []}
        self.check(self.idle["start"], "at the start")
        self.machine = machine(bandwidth_gib)
        self._watch = CpuWatch()

    def check(self, record: dict[str, object], when: str) -> None:
        """Record the warning for a busy `record` (and say it on stderr); raise under require_idle."""
        warning = enforce_idle(record, self.require_idle, when)
        if warning:
            self.idle["warnings"].append(warning)
            print(f"warning: {warning}", file=sys.stderr, flush=True)

    def finish(self) -> dict[str, object]:
        """{"machine": ..., "idle": {start, run, warnings, ...}} with the whole run watched."""
        self.idle["run"] = self._watch.stop()
        self.check(self.idle["run"], "during the run")
        return {"machine": self.machine, "idle": self.idle}
