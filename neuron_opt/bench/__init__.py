"""Benchmarks (side by side with the peer, JSON output). Thin wrappers live in scripts/bench_*.py."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def host() -> str:
    """The CPU model and logical core count, for a benchmark's JSON (platform.processor() says only "x86_64")."""
    try:
        name = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def machine() -> dict[str, object]:
    """What a benchmark's JSON records of the machine: CPU model, the ISA flags that change our kernels, usable
    cores, memory, the load average when the run started (a busy machine makes timings lie), torch's version."""
    import torch

    flags: set[str] = set()
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        flags = set(line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    return {"cpu": host(), "isa": [f for f in ISA_FLAGS if f in flags], "cores": len(os.sched_getaffinity(0)),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "load_average": os.getloadavg(), "torch": torch.__version__}
