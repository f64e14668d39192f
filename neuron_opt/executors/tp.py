"""The TP executor: the runner's `Executor`, driving `tp` rank processes.

Design decisions
- Driver + tp workers over pipes (see launcher.py for why the driver is not rank 0). Each step the driver
  sends the same StepInputs (five small int64 arrays) to every rank; the ranks run the same eager graph with
  gloo collectives between ops; rank 0 replies with the finished logits, the others with an acknowledgement,
  so every step is lock-stepped and a failure anywhere surfaces on the step that hit it.
- Watchdog: while waiting, the driver polls the pipes with a short timeout and checks every process's
  liveness. A dead rank (or one that reports an exception, e.g. a collective timing out after its peer
  died) shuts all ranks down and raises RankFailedError naming the rank and its exit code. Never a hang.
- Graphs: the ranks run the model eagerly with gloo collectives between ops. Collectives inside compiled
  graphs are the neuron backend's (one SPMD program, neuron_opt/backends/neuron/backend.py).
- KV caches live in the rank processes; `k_caches`/`v_caches` are empty on the driver.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.multiprocessing as mp

from neuron_opt.backends.base import StepInputs
from neuron_opt.buckets import Bucket
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.errors import RankFailedError
from neuron_opt.executors.launcher import RankSpec, default_threads, free_port, write_rank_weights
from neuron_opt.executors.worker import image_arrays, rank_main, step_arrays
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel.collectives import CollectiveCall
from neuron_opt.parallel.vocab import scatter_candidates


class TPExecutor:
    """Runs each bucket's graph on `spec.parallel.tp` rank processes.

    Args:
        spec: what every rank builds (model, parallel and cache configs, weights directory).
        start_timeout_s: how long rank start-up (imports, rendezvous, weight loading) may take.
        step_timeout_s: how long one step may take before the ranks are declared hung.
    """

    k_caches: list[torch.Tensor] = []
    v_caches: list[torch.Tensor] = []
    # the rank processes run on the host's own cores: async scheduling's host work would take them from the ranks
    # (docs/serving.md, "Async scheduling")
    async_scheduling = False
    # image embeddings and M-RoPE positions go to every rank with the step (worker.image_arrays): the ranks merge
    # them after their vocab-parallel embedding (a vision-language model's encoder runs whole in this process)
    takes_embeddings = True
    takes_last_keys = True  # so do bidirectional image blocks' last keys (Gemma 3): each rank's mask takes them

    @property
    def gathers_candidates(self) -> bool:
        """The runner passes `candidates=K` when the layout samples on the ranks (vocab-parallel LM head)."""
        return self.spec.parallel.vocab_parallel_sampling

    def __init__(self, spec: RankSpec, start_timeout_s: float = 180.0, step_timeout_s: float = 300.0) -> None:
        self.spec, self.tp, self.step_timeout_s = spec, spec.parallel.tp, step_timeout_s
        self.layout = spec.layout
        self.aux_layers: tuple[int, ...] = ()  # capture_aux_hidden
        self.aux_hidden: torch.Tensor | None = None
        ctx = mp.get_context("spawn")
        port = free_port()
        self.procs: list[Any] = []
        self.conns: list[mpc.Connection] = []
        for rank in range(self.tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=rank_main, args=(rank, port, spec, child), daemon=True, name=f"neuron-opt-rank{rank}"
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._collect(start_timeout_s, "start-up")

    def run(self, bucket: Bucket, inputs: StepInputs, candidates: int | None = None) -> torch.Tensor:
        """fp32 logits [B, V] of the rows' `last_index` tokens ([B, q, V] for a [B, q] index: a verify step, or a
        prefill's every position).

        Args:
            candidates: None gathers the full logits. K gathers only each rank's top-K and returns -inf
                everywhere else (exact for greedy and top-k <= K sampling; see neuron_opt.parallel.vocab).
        """
        slots = None if inputs.lora_slots is None else inputs.lora_slots.contiguous().numpy()
        msg = ("run", bucket, step_arrays(inputs), candidates, slots, image_arrays(inputs))
        out = self._call(msg, f"step {bucket.key}")
        if self.aux_layers:
            out, aux = out
            self.aux_hidden = torch.from_numpy(aux)
        if candidates is None:
            logits = torch.from_numpy(out)
        else:
            vals, ids = out
            logits = scatter_candidates(
                torch.from_numpy(vals),
                torch.from_numpy(ids),
                self.layout.vocab_padded,
                self.spec.model.vocab_size,
            )
        # a [B, q] index (verify, or a prefill's every position): the ranks send B * q rows
        return logits.view(*inputs.last_index.shape, -1)

    def capture_aux_hidden(self, layer_ids: tuple[int, ...]) -> None:
        """From now on each step also returns (from rank 0) the residual stream entering these layers at every
        position (`aux_hidden`, fp32 [B, S, len(layer_ids) * H]), for an EAGLE-3 head."""
        self._call(("aux", tuple(layer_ids)), "aux hidden states")
        self.aux_layers = tuple(layer_ids)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embedding rows of `ids` (fp32, unscaled), gathered over the ranks' vocabulary shards."""
        return torch.from_numpy(self._call(("embed", ids.contiguous().numpy()), "embedding"))

    @property
    def lora_config(self) -> Any:
        """The ranks' LoRA capacity (neuron_opt.lora.LoraConfig), None when they take no adapters."""
        return self.spec.lora

    def load_lora(self, slot: int, adapter: Any) -> None:
        """Every rank writes its shard of `adapter` (neuron_opt.lora.adapter.LoraAdapter) into `slot`."""
        self._call(("lora", slot, adapter), f"lora slot {slot}")

    def clear_lora(self, slot: int) -> None:
        self._call(("lora", slot, None), f"lora slot {slot}")

    def collective_calls(self) -> list[CollectiveCall]:
        """Collective calls rank 0 made since the last reset (every rank makes the same ones)."""
        return self._call(("calls",), "collective count")

    def reset_collective_calls(self) -> None:
        self._call(("reset",), "collective reset")

    def close(self) -> None:
        """Stop every rank (politely, then by force); idempotent."""
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def __enter__(self) -> TPExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, msg: tuple[Any, ...], what: str) -> Any:
        if not self.procs:
            raise RankFailedError(f"{what}: the TP executor is closed")
        for r, c in enumerate(self.conns):
            try:
                c.send(msg)
            except (OSError, BrokenPipeError):
                self._fail(f"{what}: rank {r} is gone (exit code {self.procs[r].exitcode})")
        return self._collect(self.step_timeout_s, what)

    def _collect(self, timeout_s: float, what: str) -> Any:
        """One reply from every rank; rank 0's payload is returned. Watches liveness while waiting."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.tp:
            pending = [c for r, c in enumerate(self.conns) if r not in replies]
            for ready in mpc.wait(pending, timeout=0.2):
                c = cast(mpc.Connection, ready)
                r = self.conns.index(c)
                try:
                    status, payload = c.recv()
                except EOFError:
                    self._fail(f"{what}: rank {r} exited (code {self.procs[r].exitcode}) without replying")
                if status == "error":
                    self._fail(f"{what}: {payload.strip().splitlines()[-1]}\n{payload}")
                replies[r] = payload
            for r, p in enumerate(self.procs):
                if r not in replies and not p.is_alive():
                    self._fail(f"{what}: rank {r} died (exit code {p.exitcode}); stopped the other ranks")
            if time.monotonic() > deadline:
                self._fail(
                    f"{what}: no reply within {timeout_s:.0f} s from ranks "
                    f"{sorted(set(range(self.tp)) - set(replies))}; stopped all ranks"
                )
        return replies[0]

    def _fail(self, message: str) -> NoReturn:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5.0)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        raise RankFailedError(message)


def tp_executor_from_state_dict(
    cfg: ModelConfig,
    sd: dict[str, torch.Tensor],
    par: ParallelConfig,
    cache: CacheConfig,
    weights_dir: Path | None = None,
    dtype: str = "float32",
    collective_timeout_s: float = 60.0,
    lora: LoraConfig | None = None,
) -> TPExecutor:
    """Shard a canonical state dict to weights_dir/rank{r}.safetensors and start the ranks.

    With weights_dir None the shards go to a temporary directory that is removed once every rank has loaded
    its shard (ranks read weights only at start-up)."""
    if weights_dir is not None:
        write_rank_weights(sd, cfg, par, weights_dir)
        spec = RankSpec(cfg, par, cache, str(weights_dir), dtype, collective_timeout_s, default_threads(par.tp),
                        lora=lora)
        return TPExecutor(spec)
    with tempfile.TemporaryDirectory(prefix="neuron-opt-tp-") as tmp:
        return tp_executor_from_state_dict(cfg, sd, par, cache, Path(tmp), dtype, collective_timeout_s, lora)


def launch_tp_executor(root: Path, manifest: Any) -> TPExecutor:
    """Start the ranks of an artifact (`root/weights/rank{r}.safetensors`, written at compile time); they run
    the model eagerly with gloo collectives."""
    m = manifest
    spec = RankSpec(m.model, m.parallel, m.cache, str(Path(root) / "weights"), m.dtype,
                    threads_per_rank=default_threads(m.parallel.tp), quant=m.quant, lora=m.lora)
    return TPExecutor(spec)
