"""How many torch intra-op threads `serve`'s graph calls get (the thread policy), and keeping the process's OpenMP
threads within its cores.

`serve` loads the model on the main thread and runs every step on the engine thread, while the HTTP event loop
(and, on a benchmark machine, the client) needs a core now and then. Policies (`NEURON_OPT_THREAD_POLICY`; a fixed
`NEURON_OPT_NUM_THREADS` overrides either):
- "all" (the default): every core for every graph call.
- "reserve": cores - 1 for every call, one core left to the event loop.

OpenMP threads must not outnumber the cores. torch's OpenMP runtime (GNU libgomp) keeps one pool of worker
threads per thread that has run a parallel region, and counts the workers of every pool. While that count exceeds
the cores, it cuts the spin-wait at the barriers between parallel regions from about 300,000 iterations to 100,
so workers sleep and must be woken for each region. A one-row decode step runs hundreds of short regions, and
paid for the wake-ups with about twice its time on 2 cores (docs/serving.md, "Threads"). The main thread's pool
from loading is such a pool: `hand_threads_to_engine` frees it once the model is loaded, and the runner sets the
count on the engine thread itself (`ModelRunner.num_threads`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_opt.errors import ConfigError

if TYPE_CHECKING:
    from neuron_opt.runtime.runner import ModelRunner

POLICIES = ("all", "reserve")
# OpenMP 5.0's omp_pause_soft: free the resources (threads) of the host device, keep the runtime usable
OMP_PAUSE_SOFT = 1
# the names of the OpenMP runtimes torch builds link (GNU, Intel, LLVM)
OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")


@dataclass(frozen=True)
class ThreadPolicy:
    name: str
    cores: int  # the cores this process may use (its affinity)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ConfigError(f"NEURON_OPT_THREAD_POLICY: must be one of {list(POLICIES)}, got {self.name!r}",
                              param="NEURON_OPT_THREAD_POLICY")
        if self.cores < 1:
            raise ConfigError(f"thread policy: cores must be >= 1, got {self.cores}")

    @property
    def threads(self) -> int:
        """The torch thread count of every graph call."""
        return self.cores if self.name == "all" else max(1, self.cores - 1)


def openmp_library() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's), or None where none is (a torch built without OpenMP,
    or a platform without /proc/self/maps)."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return None
    paths = sorted({line.split()[-1] for line in maps.read_text().splitlines()
                    if line.split()[-1].startswith("/") and Path(line.split()[-1]).name.startswith(OPENMP_LIBRARIES)})
    # torch's own copy first: other wheels (scikit-learn's) may map a private one that torch's code does not use
    paths.sort(key=lambda p: "/torch/" not in p)
    return ctypes.CDLL(paths[0]) if paths else None


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker threads (its pool; a later parallel region on this thread would start
    new ones). False where no OpenMP runtime is loaded."""
    lib = openmp_library()
    if lib is None:
        return False
    rc = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
    if rc != 0:  # the runtime refuses inside a parallel region: the callers never are in one
        raise RuntimeError(f"omp_pause_resource_all returned {rc}")
    return True


def hand_threads_to_engine(runners: Iterable[ModelRunner], threads: int) -> None:
    """Called on the thread that loaded the model, before the engine thread steps: the engine thread runs the graphs
    of `runners` (an engine's: `Engine.runners`) with `threads` torch threads where the model runs in this process
    (tp > 1 ranks set their own counts), and this thread frees its OpenMP workers and runs any later torch work (the
    HTTP side's) on one thread, so the process's OpenMP threads are the engine thread's team and no more."""
    import torch  # here: importing the policy (the CLI's parser does) must not import torch

    for runner in runners:
        if runner.executor.k_caches:
            runner.num_threads = threads
    torch.set_num_threads(1)
    release_openmp_workers()
