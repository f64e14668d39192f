"""The `MetricsBoard` actor: what the router knows of the replicas without asking them.

- Metrics: every replica pushes its Prometheus text to the board each `PUSH_PERIOD_S`, with the facts the router
  needs (its model card's `max_model_len`, its process id, its LoRA state); the router's `/metrics` merges the
  live replicas' (so they are at most that stale). A replica silent for `STALE_AFTER_S` is left out (dead, or
  restarting).
- LoRA adapters (docs/lora.md): every replica serves the same adapters, the set the board holds (name -> path;
  `--lora-modules` seed it), with a version each change raises.
"""

from __future__ import annotations

import time
from typing import Any

import ray

PUSH_PERIOD_S = 1.0
STALE_AFTER_S = 5.0


class MetricsBoard:
    """Latest metrics text and model-card facts of each replica, by replica id, and the LoRA adapters every replica
    serves (name -> path, with a version that each change raises) (a Ray actor; `metrics_board()` starts it)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, dict[str, Any], str]] = {}
        self.adapters: dict[str, str] = {}
        self.adapters_version = 0

    def set_adapter(self, name: str, path: str) -> int:
        self.adapters[name] = path
        self.adapters_version += 1
        return self.adapters_version

    def drop_adapter(self, name: str) -> int:
        self.adapters.pop(name, None)
        self.adapters_version += 1
        return self.adapters_version

    def adapter_set(self) -> tuple[int, dict[str, str]]:
        return self.adapters_version, dict(self.adapters)

    def put(self, replica: str, info: dict[str, Any], text: str) -> None:
        self.entries[replica] = (time.monotonic(), info, text)

    def snapshot(self, max_age_s: float = STALE_AFTER_S) -> dict[str, tuple[dict[str, Any], str]]:
        now = time.monotonic()
        return {r: (info, text) for r, (t, info, text) in self.entries.items() if now - t <= max_age_s}


def metrics_board() -> Any:
    """A new MetricsBoard actor (no CPU), owned by the caller: it ends with the `serve` command."""
    return ray.remote(num_cpus=0)(MetricsBoard).remote()
