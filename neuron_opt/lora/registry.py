"""The adapters a model serves, by name, and the slots of its executor that hold them.

Design decisions
- More adapters may be registered than the artifact has slots (`max_loras`): registering reads and validates an
  adapter (host memory only); a slot is filled when a sequence that needs the adapter is admitted, and the
  least recently used resident adapter that no running sequence uses is evicted for it (vLLM's --max-cpu-loras
  behaviour). When every slot is in use the sequence waits, like one waiting for KV blocks.
- Only the engine thread writes slots (`acquire`, through the executor's `load_lora`): the HTTP threads register
  and unregister under a lock and never touch the executor. A slot whose adapter was unregistered keeps its
  values until it is reused; no row points at it.
- An adapter in use by a request in flight (queued or running) cannot be unregistered.
- Each adapter's prefix-cache salt is the sha256 of its weights file: K/V computed under one adapter is never
  reused for another adapter or the base model (runtime/block_manager.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_opt.errors import ConfigError
from neuron_opt.lora.adapter import LoraAdapter, read_adapter


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a generation call runs under (vLLM's name and fields, less the integer id): registered under
    `lora_name` from `lora_path` on first use."""

    lora_name: str
    lora_path: str


@dataclass
class LoraStats:
    loads: int = 0  # adapters written into a slot
    evictions: int = 0  # of those, into a slot another adapter held


class LoraManager:
    """Adapters by name and the executor slots 1..max_loras holding them (slot 0: the base model).

    Args:
        executor: the model's executor (`lora_config`, `load_lora(slot, adapter)`).
        model_config: the base model's ModelConfig, adapters are checked against.
    """

    def __init__(self, executor: Any, model_config: Any) -> None:
        self.executor, self.model_config = executor, model_config
        self.config = executor.lora_config
        if model_config is None:
            raise ConfigError("lora: the runner does not know its model's config, which adapters are checked "
                              "against (ModelRunner(model_config=))", param="lora")
        if self.config is None:
            raise ConfigError("lora: this model was compiled without --enable-lora; recompile with --enable-lora to "
                              "serve adapters", param="lora")
        self._lock = threading.Lock()
        self._adapters: dict[str, LoraAdapter] = {}
        self._inflight: dict[str, int] = {}  # requests queued or running per adapter
        self._slot_of: dict[str, int] = {}  # resident adapters
        self._users: dict[int, int] = {}  # slot -> running sequences on it
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self._holder: dict[int, str | None] = {s: None for s in range(1, self.config.max_loras + 1)}
        self._holder_digest: dict[int, str] = {}
        self.stats = LoraStats()

    # ---- registry (any thread) ---------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and validate the adapter at `path` under `name` (ConfigError naming the field; nothing is kept of
        an adapter that fails). A name already registered is refused."""
        if not isinstance(name, str) or not name:
            raise ConfigError("lora_name: must be a non-empty string", param="lora_name")
        with self._lock:
            if name in self._adapters:
                raise ConfigError(f"lora_name: an adapter named {name!r} is already loaded", param="lora_name")
        adapter = read_adapter(path, self.model_config, self.config)  # outside the lock: reads files
        with self._lock:
            if name in self._adapters:
                raise ConfigError(f"lora_name: an adapter named {name!r} is already loaded", param="lora_name")
            self._adapters[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters:
                raise KeyError(name)
            if self._inflight.get(name):
                raise ConfigError(f"lora_name: adapter {name!r} is in use by {self._inflight[name]} request(s); "
                                  "unload it once they finish", param="lora_name")
            del self._adapters[name]
            self._inflight.pop(name, None)
            slot = self._slot_of.pop(name, None)
            if slot is not None:  # free for reuse; its values stay until then (no row points at it)
                self._holder[slot] = None
                self._lru.pop(slot, None)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._adapters

    def in_use(self) -> list[str]:
        """The adapters that requests queued or running use (they cannot be unregistered now)."""
        with self._lock:
            return [name for name, n in self._inflight.items() if n > 0]

    def path_of(self, name: str) -> str:
        """The directory the adapter `name` was read from (KeyError when unknown)."""
        with self._lock:
            return self._adapters[name].path

    @property
    def num_resident(self) -> int:
        with self._lock:
            return len(self._slot_of)

    def begin_request(self, name: str) -> bytes:
        """A request under `name` is queued: it cannot be unregistered until `end_request`. Returns the adapter's
        prefix-cache salt. KeyError for an unknown name."""
        with self._lock:
            adapter = self._adapters[name]
            self._inflight[name] = self._inflight.get(name, 0) + 1
            return bytes.fromhex(adapter.digest)

    def end_request(self, name: str) -> None:
        with self._lock:
            if self._inflight.get(name, 0) > 0:
                self._inflight[name] -= 1

    # ---- slots (engine thread) ---------------------------------------------------------------------------

    def acquire(self, name: str) -> int | None:
        """The slot holding `name` for one more running sequence, loading it first if it is not resident (into a
        free slot, else the least recently used slot nobody runs on); None when every slot is in use."""
        with self._lock:
            adapter = self._adapters[name]
            slot = self._slot_of.get(name)
            if slot is None:
                slot = next((s for s, h in self._holder.items() if h is None and not self._users.get(s)), None)
                evicted = False
                if slot is None:
                    slot = next((s for s in self._lru if not self._users.get(s)), None)
                    if slot is None:
                        return None
                    self._slot_of.pop(self._holder[slot], None)  # type: ignore[arg-type]
                    evicted = True
                if self._holder_digest.get(slot) != adapter.digest:  # a slot may still hold these very weights
                    self.executor.load_lora(slot, adapter)
                    self._holder_digest[slot] = adapter.digest
                    self.stats.loads += 1
                    self.stats.evictions += evicted
                self._holder[slot], self._slot_of[name] = name, slot
            self._users[slot] = self._users.get(slot, 0) + 1
            self._lru[slot] = None
            self._lru.move_to_end(slot)
            return slot

    def release(self, slot: int) -> None:
        """One running sequence on `slot` stopped (finished, aborted or preempted)."""
        with self._lock:
            if self._users.get(slot, 0) > 0:
                self._users[slot] -= 1
