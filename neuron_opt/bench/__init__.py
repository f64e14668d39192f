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
