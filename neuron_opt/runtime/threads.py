"""How many torch intra-op threads each graph call of `serve` gets: the thread policy.

`serve` runs the model on the engine thread while the HTTP event loop (and, on a benchmark machine, the client)
needs a core now and then. Policies (`NEURON_OPT_THREAD_POLICY`; a fixed `NEURON_OPT_NUM_THREADS` overrides any):
- "reserve": cores - 1 for every call, one core left to the event loop (docs/serving.md, "Threads").
- "all": every core for every call.
- "adaptive" (the default): every core for prefills (compute-bound: they gain the most from a core and lose the
  least when the event loop preempts a worker for a moment) and for generation calls of at least
  `ADAPTIVE_MIN_ROWS` rows; cores - 1 for one-row decode steps, the latency-bound case where one core for the
  event loop paid off.

The count is set on the thread that runs the step, just before a call whose count differs from the last:
`torch.set_num_threads` sets the calling thread's OpenMP thread count, and each thread's parallel regions (aten,
oneDNN, the cpu backend's AOTInductor kernels) follow its own. AOTInductor's C++ GEMM template splits its work
for the thread count the graph was compiled with (torch's at compile time) and runs those parts on the threads
it is given, so an artifact compiled with fewer threads than it is served with leaves cores idle in those GEMMs.
Processes whose model runs elsewhere (the tp > 1 driver: its ranks set their own counts) get no policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_opt.buckets import PREFILL, Bucket
from neuron_opt.errors import ConfigError

POLICIES = ("reserve", "all", "adaptive")
# "adaptive": generation calls of this many rows or more get every core (one-row decode steps keep one core free)
ADAPTIVE_MIN_ROWS = 2


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
    def base(self) -> int:
        """The count between calls, and of every call under "reserve" and "all"."""
        return self.cores if self.name == "all" else max(1, self.cores - 1)

    @property
    def varies(self) -> bool:
        """Whether the count depends on the call (else setting `base` once is the whole policy)."""
        return self.name == "adaptive" and self.cores > 1

    def threads_for(self, bucket: Bucket) -> int:
        if not self.varies:
            return self.base
        if bucket.phase == PREFILL or bucket.batch >= ADAPTIVE_MIN_ROWS:
            return self.cores
        return self.base

    def apply(self, bucket: Bucket) -> None:
        """Set the calling thread's torch thread count for a call of `bucket`, where it changes."""
        import torch  # here: importing the policy (the CLI's parser does) must not import torch

        n = self.threads_for(bucket)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
