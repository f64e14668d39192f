"""Neuron backend: the device path, written once against torch-xla 2.9 (the framework layer of torch-neuronx 2.9).

The same code builds and runs the graphs on a NeuronCore (PJRT device NEURON, registered by torch-neuronx) and on
torch-xla's CPU device (PJRT_DEVICE=CPU), which is how CI runs it; only the PJRT plugin differs.

Design decisions (docs/neuron_backend.md has the sources and the alternatives weighed)
- Route: torch-xla lazy graphs, one per bucket, over one device-resident model per rank. Not
  `torch_neuronx.trace` (its graphs can alias only their own state, so buckets traced apart cannot share one
  KV cache) and not neuronx-distributed's ModelBuilder (not installable off a Neuron host, so nothing here
  could run it). What ModelBuilder gets right is kept: one model per rank holding every bucket, weights placed
  once, KV caches as device state updated in place and donated input -> output in every bucket's HLO.
- Weights: `model.to(device)` once per rank at load; every bucket graph takes the same device buffers as
  parameters. `weights/rank{r}.safetensors` is the only copy on disk; HLO files hold no weights.
- KV caches: block pools `[num_blocks, n_kv, block_size, D]` per layer (models/llama.py), allocated on the device
  once and shared by all buckets. The model writes new K/V at the step's slot mapping with an in-place
  index_put (a scatter in the HLO) and reads each row's blocks through its block table (a gather); torch-xla
  donates the cache buffers of every step (`buffer_donor` in the HLO module, InputOutputAliasCount in its
  metrics), so a step moves only ids/positions/slot mapping/block tables in and [B, V] logits out.
- Window-sized KV (CacheConfig.sliding_window; docs/design.md): the sliding layers' pools have the window pool's
  blocks, and every graph takes that pool's slot mapping and block tables as two more step inputs (static shapes
  like the others: the pool's size is fixed at compile, so it is one set of graphs, as before).
- Embedding models (`--task embed`, models/pooling.py): prefill buckets only, whose graph ends in the pooling step
  (final norm, masked sum, division, L2 norm) where the LM head was; the step's output is [B, H] fp32 vectors.
- Artifact: every bucket's HLO (text and HloModuleProto, exactly what XLA compiled, as XLA's dump writes it
  "before optimizations"): graphs/rank0/ at tp=1, one SPMD module per bucket in graphs/spmd/ at tp > 1. That
  is the input neuronx-cc compiles. On a NeuronCore the Neuron compile
  cache (NEFFs keyed by HLO hash) is pointed into the artifact at compile and at load, so `serve` does not run
  neuronx-cc. The XLA CPU client cannot deserialize executables ("Deserializing serialized executable not
  supported"), so on CPU each bucket compiles once at load, before the first request.
- TP: one SPMD program for every rank (neuronx-distributed's form: one HLO on every NeuronCore, the rank a
  sharded tensor), run in a manual-sharding region over `tp` devices, with the row-parallel all-reduces as HLO
  `all-reduce` ops over replica group {0..tp-1} (SpmdRanks, SpmdCollectives). On the XLA CPU device the tp
  devices are CPU_NUM_DEVICES, so tp=2 runs here. Explicit `xm.all_reduce` across processes or threads does
  not run on the CPU client (docs/neuron_backend.md).
- Steps replay each bucket's compiled graph by hash (tp=1, DeviceProgram), so the host does not re-record the
  model's ops every step; the traced path is the reference.
- Bucket graphs are named by their graph hash, so a graph compiled earlier in the process (under any caller)
  is found in the dump by name.
- Prompt logprobs (scoring): a prefill bucket's graph ends in the LM head at the last position only; a step asking
  for every position's logits ([B, S] last_index) runs the bucket's every-position variant, [B, S, V] out, which
  is compiled on demand the first time a scoring request lands in that bucket (the same graph with a [B, S]
  index, as a verify graph scores its q positions). Compiling it for every bucket at compile time would double
  the artifact's prefill graphs for a feature most deployments never call; on a NeuronCore the on-demand compile
  runs neuronx-cc once per bucket and its NEFF lands in the artifact's Neuron compile cache.
- EAGLE-3: an engine with a head switches the device model to graphs that also return the residual streams the
  head reads (`capture_aux_hidden`), every bucket's variant compiled when the engine starts rather than at compile
  (the head is chosen at serve time; the artifact stays what it was). The head runs as device graphs of its own
  (neuron_eagle3.py).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from neuron_opt.backends.base import Backend, ModelFactory, StepInputs, kv_dtype, pool_shapes
from neuron_opt.backends.neuron.lora import DeviceLora
from neuron_opt.buckets import PREFILL, VERIFY, Bucket
from neuron_opt.config import CacheConfig, KVCacheDtype
from neuron_opt.errors import ArtifactError, BackendCompileError, BackendUnavailableError, ConfigError
from neuron_opt.lora.ops import LoraInputs
from neuron_opt.parallel.collectives import CollectiveCounter
from neuron_opt.sample_ops import (
    NEG_INF,
    SamplingInputs,
    adjust_rows,
    bit_set,
    logprob_rows,
    sample_rows,
    verify_rows,
)
from neuron_opt.weights import load_model_weights, model_state_for_save

HLO_TEXT = "{key}.hlo.txt"  # per bucket, in graphs/rank{r}/
HLO_PROTO = "{key}.hlo.pb"
NEURON_CACHE = "neuron_cache"  # graphs/rank{r}/neuron_cache/: the Neuron compile cache (NEFFs), NeuronCore only
DEVICE_TYPES = ("CPU", "NEURON")
OPS = ("torch", "nki")
KERNELS = "{key}.kernels.json"  # ops=nki: what each call site of the bucket's graph runs (nki_device.KernelChoice)
NEURON_PIP_REPO = "https://pip.repos.neuron.amazonaws.com"
DEFAULT_GRAPH_NAME = "SyncTensorsGraph"  # torch-xla's name for a graph nobody named
_DUMP: dict[str, Path] = {}  # "dir": this process's XLA dump directory, when compile turned the dump on


def unavailable_message(exc: BaseException) -> str:
    return (
        f"the neuron backend runs on torch-xla 2.9 (the framework layer of torch-neuronx 2.9), which is not "
        f"importable here ({type(exc).__name__}: {exc}). On a Neuron instance install torch-neuronx 2.9 from "
        f"the Neuron repository (`pip install torch-neuronx neuronx-cc --extra-index-url={NEURON_PIP_REPO}`; "
        f"the PyPI packages of those names are 'WRONG PACKAGE' placeholders). On any other machine `make "
        f"setup-xla` creates .venv-xla (torch 2.9 + torch-xla 2.9) whose XLA CPU device (PJRT_DEVICE=CPU) "
        f"runs the same graphs: run `.venv-xla/bin/neuron-opt ...`. Or use `--backend cpu` (compiled CPU "
        f"graphs) or `--backend eager` instead."
    )


def import_xla(dump: bool = False, devices: int = 1) -> ModuleType:
    """Imports torch_xla (after torch_neuronx where installed: it registers the NEURON PJRT device).

    `dump=True` (compile) makes XLA write every compiled module's HLO to a process-wide temporary directory;
    XLA reads its flags once, so this must happen before anything else initialises torch_xla.
    `devices` > 1 (tp): SPMD mode over that many devices (CPU_NUM_DEVICES on the XLA CPU device).
    """
    fresh = "torch_xla" not in sys.modules
    if fresh and devices > 1 and os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
        os.environ.setdefault("CPU_NUM_DEVICES", str(devices))
    if dump and "torch_xla" not in sys.modules and "dir" not in _DUMP:
        d = Path(tempfile.mkdtemp(prefix="neuron-opt-hlo-"))
        atexit.register(shutil.rmtree, d, True)
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_dump_to={d} --xla_dump_hlo_as_text --xla_dump_hlo_as_proto "
                                   "--xla_dump_hlo_module_re=^neuron_opt_").strip()
        _DUMP["dir"] = d
    try:
        import torch_neuronx  # noqa: F401  - Neuron hosts only; sets PJRT_DEVICE=NEURON
    except Exception:  # noqa: BLE001 - absent, or the PyPI placeholder ('WRONG PACKAGE'): XLA CPU then
        pass
    try:
        import torch_xla
        import torch_xla.core.xla_model  # noqa: F401
        import torch_xla.debug.metrics  # noqa: F401
        import torch_xla.runtime
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailableError(unavailable_message(e)) from e
    if dump and "dir" not in _DUMP:
        raise ConfigError(
            "neuron backend: compiling needs XLA's HLO dump, which must be turned on before torch_xla is first "
            "imported; call neuron_opt.backends.neuron.import_xla(dump=True) before importing torch_xla "
            "(the CLI does this)")
    if devices > 1:
        have = torch_xla.runtime.global_runtime_device_count()
        if have != devices:
            raise ConfigError(
                f"neuron backend: tp={devices} runs as one SPMD program over {devices} XLA devices, but torch_xla "
                f"started in this process with {have} device(s); run it in a fresh process (the CLI does), or "
                f"call neuron_opt.backends.neuron.import_xla(devices={devices}) before anything imports torch_xla")
        if not torch_xla.runtime.is_spmd():
            try:
                torch_xla.runtime.use_spmd()
            except Exception as e:  # noqa: BLE001 - XLA refuses once a device tensor exists
                raise ConfigError(f"neuron backend: tp={devices} needs SPMD mode, which must be enabled before "
                                  f"the process puts anything on an XLA device ({e})") from e
    kind = torch_xla.runtime.device_type()
    if kind not in DEVICE_TYPES:
        raise ConfigError(f"neuron backend: PJRT device {kind!r} is not supported; set PJRT_DEVICE to one of "
                          f"{', '.join(DEVICE_TYPES)} (CPU runs the device path on torch-xla's CPU client)")
    return torch_xla


@dataclass(frozen=True)
class NeuronOptions:
    """Backend options as stored in the artifact manifest (and hashed into the compile-cache key).

    compiler_args: neuronx-cc flags (NEURON_CC_FLAGS on a NeuronCore; the CPU client has no such compiler).
    ops: attention/norm implementation inside the graphs: "torch" (the reference ops) or "nki" (our NKI kernels
        where a call fits one on a NeuronCore, else the torch op, with the reason; nki_device.py).
    replay: run each step by replaying its bucket's compiled graph (DeviceProgram.replay); false records the
        model's ops every step (the reference path, slower on the host). Default: true at tp=1, false at tp > 1
        (replaying an SPMD graph crashes torch-xla 2.9: reading a sharded tensor's device data segfaults).
    """

    compiler_args: tuple[str, ...] = ("--model-type=transformer", "--auto-cast=none", "-O1")
    ops: str = "torch"
    replay: bool | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> NeuronOptions:
        d = dict(d or {})
        if "target" in d:
            raise ConfigError(
                "backend_options.target: cross-compiling NEFFs on a host without NeuronCores is not supported; "
                "compile on the Neuron instance (its NEFFs go into the artifact's Neuron compile cache)")
        unknown = sorted(set(d) - {"compiler_args", "ops", "replay"})
        if unknown:
            raise ConfigError(f"backend_options: unknown neuron option(s) {unknown}; known: compiler_args, ops, "
                              "replay")
        replay = d.get("replay")
        if replay is not None and not isinstance(replay, bool):
            raise ConfigError(f"backend_options.replay: must be true or false, got {replay!r}")
        args = d.get("compiler_args", cls.compiler_args)
        args = tuple(shlex.split(args)) if isinstance(args, str) else tuple(str(a) for a in args)
        ops = d.get("ops", "torch")
        if ops not in OPS:
            raise ConfigError(f"backend_options.ops: must be one of {', '.join(OPS)}, got {ops!r}")
        return cls(args, ops, replay)


class SpmdCollectives:
    """Collectives of the one SPMD program that every rank runs (tp > 1): explicit cross-device XLA ops.

    The rank graph runs inside a manual-sharding region over a `tp`-device mesh, so each device executes the
    per-rank program and the collectives are HLO `all-reduce`s over replica group {0..tp-1} (channel_id,
    use_global_device_ids): neuronx-distributed's form, where one HLO is loaded on every NeuronCore. The rank
    is a device tensor (`rank_tensor`, this device's shard of arange(tp), as NxD's SPMDRank), set per step.
    Counted while tracing (a bucket's graph makes the same calls every step). torch-xla 2.9 has SPMD all-reduce
    and reduce-scatter but no SPMD all-gather: `all_gather` and `group_all_gather` (flash decoding's KV group,
    context-parallel prefill) are one all-reduce of a [tp, *x] buffer in which each rank fills its own row
    (torch.where, so x + 0 = x exactly, -inf included), tp times the bytes of a true all-gather. Sequence-parallel
    prefill stays refused (`check_spmd_layout`): its all-gathers of the activations would move more than the
    all-reduces it replaces.
    """

    def __init__(self, tp: int, kv_group_size: int = 1) -> None:
        self.tp, self.kv_group_size = tp, kv_group_size
        self.groups = [list(range(tp))]
        self.counter = CollectiveCounter()
        self.rank_tensor: torch.Tensor | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch_xla
        import torch_xla.core.xla_model as xm

        self.counter.record("all_reduce", x, self.tp)
        return torch_xla._XLAC._xla_spmd_all_reduce(xm.REDUCE_SUM, x, 1.0, self.groups)

    def _refuse(self, op: str) -> None:
        raise ConfigError(f"neuron backend: {op} inside an SPMD rank graph is not built (torch-xla 2.9 has no "
                          "SPMD form of it); build without sequence_parallel")

    def _gather(self, x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        """The `size` consecutive ranks' x (this rank's group of them) concatenated along `dim` in rank order."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        r = self.rank_tensor
        if r is None:
            raise RuntimeError("SpmdCollectives: an all-gather outside a traced SPMD step (no rank tensor)")
        mine = torch.arange(self.tp, dtype=r.dtype, device=r.device) == r  # [tp]: this rank's row
        placed = torch.where(mine.view(-1, *([1] * x.dim())), x[None], torch.zeros((), dtype=x.dtype,
                                                                                   device=x.device))
        self.counter.record("all_reduce", placed, self.tp)
        every = torch_xla._XLAC._xla_spmd_all_reduce(xm.REDUCE_SUM, placed, 1.0, self.groups)  # [tp, *x.shape]
        if size < self.tp:  # this rank's group: rows first .. first + size - 1
            first = (r.long() // size) * size
            every = every.index_select(0, first + torch.arange(size, device=r.device))
        shape = list(x.shape)
        shape[dim] *= size
        return every.movedim(0, dim).reshape(shape)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self._gather(x, dim, self.tp)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self._refuse("reduce_scatter")
        return x

    def group_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Over this rank's flash-decoding KV group (`kv_group_size` consecutive ranks)."""
        return self._gather(x, dim, self.kv_group_size)


def check_spmd_layout(par: Any, kv_seq_shards: int) -> None:
    """The tp > 1 layouts the neuron backend builds: Megatron TP with a vocab-parallel LM head, flash decoding
    (kv-seq-shard) and context-parallel prefill; not sequence-parallel prefill (SpmdCollectives)."""
    if par.sequence_parallel:
        raise ConfigError(
            "neuron backend: tp > 1 with sequence_parallel needs all-gathers of the activations, which torch-xla "
            "2.9 has no SPMD form of (an all-reduce in its place would move more than plain tensor parallelism); "
            "drop --sequence-parallel, or use --backend eager (gloo ranks keep every layout)")


# top logits each rank contributes to a vocab-parallel sampled step (tp > 1): a sampled row's top_k must not exceed
# it (others are sampled on the host: runtime.sampling.host_sampling_reason), and it bounds the top logprobs
SPMD_CANDIDATES = 64


def sample_on_device(logits: torch.Tensor, s: SamplingInputs, vocab: int) -> list[torch.Tensor]:
    """Records a step's sampling on its device logits [B, V_padded] (tp=1; a verify step's [B, q, V_padded] as B * q
    rows): the token ids [B] int32, then with
    `s.logprobs` the chosen tokens' logprobs [B] and (when > 0) the top logprobs and their ids [B, n]
    (neuron_opt.sample_ops: the host's own definition). A verify step with proposals (`s.draft`) is accepted in the
    graph (`sample_ops.verify_rows`): the ids are each position's token if its proposal is not taken, followed by
    the acceptances [B] int32, and with logprobs the proposals' logprobs [B] come last (`sample_ops.verify_outputs`)."""
    logits = logits.reshape(-1, logits.shape[-1])  # a verify step's [B, q, V]: one row per position
    x = adjust_rows(logits[:, :vocab].float(), s)
    if s.draft is None:
        ids, head = sample_rows(x, s), []
    else:
        draft = s.draft.long()
        ids, accept = verify_rows(x, s, torch.arange(vocab, device=x.device)[None] == draft[:, None])
        head = [accept.to(torch.int32)]
    if s.logprobs is None:
        return [ids.to(torch.int32), *head]
    lps = logprob_rows(x, ids, s.logprobs)
    tail = [] if s.draft is None else [x.log_softmax(-1).gather(1, draft.clamp(min=0)[:, None])[:, 0]]
    return [ids.to(torch.int32), *head, *lps[:2], *[t.to(torch.int32) for t in lps[2:]], *tail]


def spmd_sample(local: torch.Tensor, s: SamplingInputs, vocab: int, comm: SpmdCollectives) -> list[torch.Tensor]:
    """The vocab-parallel sampled step inside the SPMD region: rank r holds logits [B, V/tp] of vocabulary ids
    r * V/tp ..; only each rank's top SPMD_CANDIDATES (values and ids) and, with logprobs, its max and sum of
    exponentials cross ranks (all-reduces). Every rank then samples the same token from the candidates in
    vocabulary order, which is the full row's token for greedy rows and for sampled rows with top_k <=
    SPMD_CANDIDATES (every token outside the global top-k has probability 0); a verify step's proposals are tested
    against the same candidates (a proposal outside them has probability 0). Returns what `sample_on_device`
    does."""
    assert comm.rank_tensor is not None
    B, Vl = local.shape
    tp = comm.tp
    off = comm.rank_tensor.to(torch.long) * Vl  # [1]
    gid = torch.arange(Vl, device=local.device)[None] + off[:, None]  # [1, Vl] this rank's vocabulary ids
    x = local.float()
    for ids, vals in ((s.bias_ids, s.bias), (s.penalty_ids, -s.penalty)):  # the entries in this rank's shard
        li = ids.long() - off[:, None]
        ok = (li >= 0) & (li < Vl)
        x = x.scatter_add(1, torch.where(ok, li, torch.zeros_like(li)), torch.where(ok, vals, torch.zeros_like(vals)))
    keep = gid < vocab  # the padded vocabulary's rows are never tokens
    if s.mask is not None:
        words = s.mask.index_select(1, (gid[0] // 32).clamp(max=s.mask.shape[1] - 1))  # [B, Vl]
        keep = keep & bit_set(words, gid[0])
    x = x.masked_fill(~keep, NEG_INF)
    k = min(SPMD_CANDIDATES, Vl)
    vals, idx = x.topk(k)  # [B, k]
    idx, order = idx.sort(-1)  # by vocabulary id: the ranks' shards in rank order are then in vocabulary order
    vals = vals.gather(1, order)
    mine = (torch.arange(tp, device=local.device) == comm.rank_tensor.to(torch.long))[:, None, None]  # [tp, 1, 1]

    def gather(t: torch.Tensor) -> torch.Tensor:
        """[B, k] on each rank -> [B, tp * k] on every rank (an all-reduce of zero-padded slots: the SPMD region
        has no all-gather in torch-xla 2.9; adding zeros is exact)."""
        full = comm.all_reduce(torch.where(mine, t[None], torch.zeros_like(t)[None]))  # [tp, B, k]
        return full.permute(1, 0, 2).reshape(B, tp * t.shape[-1])

    cand = gather(vals)
    cid = gather((idx + off[:, None]).to(torch.int32))
    head: list[torch.Tensor] = []
    if s.draft is None:
        pick = sample_rows(cand, s)  # [B] index into the candidates
    else:
        pick, accept = verify_rows(cand, s, cid == s.draft.to(cid.dtype)[:, None])
        head = [accept.to(torch.int32)]
    ids = cid.gather(1, pick[:, None])[:, 0]
    if s.logprobs is None:
        return [ids, *head]
    m = gather(x.amax(-1, keepdim=True)).amax(-1, keepdim=True)  # [B, 1] the row's max
    lse = m[:, 0] + gather((x - m).exp().sum(-1, keepdim=True)).sum(-1).log()  # [B] the row's log-sum-exp
    out = [ids, *head, cand.gather(1, pick[:, None])[:, 0] - lse]
    if s.logprobs:
        top = cand.topk(s.logprobs)
        out += [top.values - lse[:, None], cid.gather(1, top.indices)]
    if s.draft is not None:  # the proposal's logit from the rank that holds it (zeros from the others: exact)
        li = s.draft.long()[:, None] - off[:, None]  # [B, 1]
        ok = (li >= 0) & (li < Vl)
        mine_d = torch.where(ok, x.gather(1, li.clamp(0, Vl - 1)), torch.zeros_like(li, dtype=x.dtype))
        out.append(comm.all_reduce(mine_d)[:, 0] - lse)
    return out


@dataclass
class Replay:
    """One bucket's compiled graph, replayed without retracing: XLA parameter i is the step input, KV cache or
    LoRA stack at `sources[i]` (an index into [*step inputs, *k_caches, *v_caches, *lora stacks],
    DeviceProgram.step_tensors and DeviceLora.tensors), or, where that is None, the fixed device tensor `fixed[i]`
    (a weight, a rope table, a scalar constant)."""

    graph_hash: Any
    name: str
    sources: list[int | None]
    fixed: list[Any]
    outputs: int = 1  # graph outputs before the KV caches: the logits, and (EAGLE-3) the auxiliary states


class DeviceProgram:
    """What DeviceRank (tp=1) and SpmdRanks (tp > 1) share: the KV caches and how a bucket's step runs.

    Two ways to run a step, with equal results (tested bit for bit):
    - traced (`run_traced`, the reference): torch-xla records the model's ops into IR, hashes the graph, finds
      the compiled executable and runs it. Recording costs host time every step (for the 30-layer default
      model, more than executing it on the XLA CPU device: docs/neuron_backend.md).
    - replayed (`replay`, after `prepare`): the graph is traced once per bucket and compiled with the KV caches as
      buffer donors; each step passes the new step inputs and the current caches to the cached executable by
      hash (`_run_cached_graph`, what torch-xla's dynamo bridge does), and the donated caches come back as
      outputs. No ops are recorded per step.
    """

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    xla: ModuleType
    device: Any
    lora: DeviceLora | None = None  # a model with a LoRA capacity: its adapter stacks (neuron_lora.py)
    window_kv: bool = False  # window-sized KV (CacheConfig.sliding_window): the sliding layers' pool and tables
    # EAGLE-3 (`capture_aux`): the graphs traced from now on also return the streams entering these layers, and
    # each step leaves them on the host in `aux_hidden` [B, S, n_aux * H]
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    def trace(self, bucket: Bucket, inputs: StepInputs) -> list[torch.Tensor]:
        """The step's graph outputs before the KV caches: [logits] or, capturing (`aux_layers`), [logits, aux]."""
        return self._outputs(self.trace_step(bucket, self.step_tensors(inputs)))

    @staticmethod
    def _outputs(out: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> list[torch.Tensor]:
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def capture_aux(self, layer_ids: tuple[int, ...]) -> None:
        """Every graph traced from now on returns, after the logits, the residual stream entering each layer of
        `layer_ids` at every position ([B, S, n_aux * H], models.llama `forward_with_aux`); each step keeps the
        host copy in `aux_hidden`. The graphs traced before (without it) are no longer used."""
        self.aux_layers = tuple(layer_ids)

    def host_aux(self, aux: torch.Tensor) -> torch.Tensor:
        return aux.cpu()

    def _finish(self, outs: list[torch.Tensor], aux: bool, sampling: SamplingInputs | None = None,
                replayed: bool = False) -> Any:
        """A step's outputs on the host: the logits, or with `sampling` the sampled outputs (a replayed step's graph
        returns logits: they are sampled on the device by a second graph, `sample_replayed`); `aux`: the last
        output is the auxiliary states, which go to `aux_hidden`."""
        if aux:
            self.aux_hidden = self.host_aux(outs[-1])
            outs = outs[:-1]
        if sampling is None:
            return self.host_logits(outs[0])
        return self.sample_replayed(outs[0], sampling) if replayed else self.host_samples(outs)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def step_tensors(self, inputs: StepInputs) -> list[torch.Tensor]:
        """The step's device inputs: StepInputs.arrays, then (window-sized KV) the window pool's slot mapping
        [B, S] and block tables [B, nb], then (LoRA) the rows' adapter slots [B] (0: base)."""
        arrays = list(inputs.arrays())
        if self.window_kv:
            window = inputs.window_kv()
            if window is None:
                raise ValueError("this model holds window-sized KV: a step needs the window pool's slot mapping "
                                 "and block tables (StepInputs.window_slot_mapping, window_block_tables)")
            arrays += window
        if self.lora is not None:
            B = inputs.input_ids.shape[0]
            arrays.append(inputs.lora_slots if inputs.lora_slots is not None else torch.zeros(B, dtype=torch.long))
        # int32 ids: what neuronx-cc handles best (NxDI converts int64 inputs the same way)
        return [t.to(torch.int32).to(self.device) for t in arrays]

    def lora_tensors(self) -> list[torch.Tensor]:
        return [] if self.lora is None else self.lora.tensors()

    def split_step(self, step: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """`step_tensors`' device inputs as the model takes them: the five arrays, and the keyword arguments of
        what follows them (`window_kv`: the window pool's slots and tables; the rows' LoRA slots as `lora_slots`,
        which the caller wraps with its adapter stacks)."""
        extra: dict[str, Any] = {}
        rest = step[5:]
        if self.window_kv:
            extra["window_kv"], rest = (rest[0], rest[1]), rest[2:]
        if self.lora is not None:
            extra["lora_slots"], rest = rest[0], rest[1:]
        assert not rest, f"{len(rest)} step input(s) beyond the model's"
        return step[:5], extra

    def trace_step(self, bucket: Bucket, step: list[torch.Tensor],
                   sampling: SamplingInputs | None = None) -> list[torch.Tensor]:
        raise NotImplementedError

    d2h_bytes = 0  # what the last step's outputs moved device -> host (every rank's copy at tp > 1)

    def to_host(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        host = [t.cpu() for t in outs]
        self.d2h_bytes = sum(t.numel() * t.element_size() for t in host)
        return host

    def host_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.to_host([logits])[0]

    def host_samples(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sampled outputs on the host: token ids [B] (and the logprobs asked for)."""
        return self.to_host(outs)

    def run_traced(self, bucket: Bucket, inputs: StepInputs, sampling: SamplingInputs | None = None) -> Any:
        """The step's fp32 logits on the host; with `sampling`, the sampled outputs instead, recorded into the
        same graph as the step (its logits never leave the device)."""
        outs = self._outputs(self.trace_step(bucket, self.step_tensors(inputs),
                                             None if sampling is None else sampling.to(self.device)))
        _sync(self.xla, [*outs, *self.k_caches, *self.v_caches])
        return self._finish(outs, bool(self.aux_layers), sampling)

    def sample_replayed(self, logits: torch.Tensor, sampling: SamplingInputs) -> list[torch.Tensor]:
        """Samples a replayed step's device logits [B, V_padded] on the device (a second, small graph, compiled
        the first time each shape is seen); the logits stay there."""
        outs = sample_on_device(logits, sampling.to(self.device), self.vocab_size)
        self.xla.sync()
        return self.host_samples(outs)

    def compile_for(self, bucket: Bucket, block_size: int, replay: bool,
                    every: bool = False) -> tuple[str, Replay | None]:
        """Compiles (on a NeuronCore: loads) `bucket`'s graph the way its steps will run: for replay (`prepare`,
        nothing runs) or traced (run once on the null block). Returns the graph's name, under which XLA's dump
        holds its HLO, and the replay handle (None when traced). `every`: a prefill bucket's every-position
        variant (logits at each of its positions: prompt logprobs)."""
        if replay:
            r = self.prepare(bucket, block_size, every)
            return r.name, r
        outs = self.trace(bucket, warm_up_inputs(bucket, block_size, every, self.window_kv))
        return _sync(self.xla, [*outs, *self.k_caches, *self.v_caches]), None

    def prepare(self, bucket: Bucket, block_size: int, every: bool = False) -> Replay:
        """Traces `bucket` once (on null-block inputs) and compiles it for replay; runs nothing.

        The caches are donated (aliased to their updated outputs), so a replayed step updates them in place.
        The trace's pending IR is dropped afterwards and the caches are restored to their device buffers.
        """
        from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

        X = self.xla._XLAC
        self.xla.sync()
        caches = [*self.k_caches, *self.v_caches]
        step = self.step_tensors(warm_up_inputs(bucket, block_size, every, self.window_kv))
        self.xla.sync()  # the step inputs become device data, like every later step's
        args = step + caches + self.lora_tensors()  # the LoRA stacks: parameters, read only (not donated)
        arg_ids = [X._xla_get_tensor_id(t) for t in args]
        saved = [X._get_tensors_xla_device_data_node([c])[1][0] for c in caches]  # their buffers, for after
        for t in caches:  # on the device data itself, before the trace replaces it with IR
            X._set_buffer_donation(t, True)
        heads = self._outputs(self.trace_step(bucket, step))
        outs = [*heads, *self.k_caches, *self.v_caches]
        ids, values = X._get_tensors_xla_device_data_node(outs)
        sources = [arg_ids.index(i) if i in arg_ids else None for i in ids]
        missing = set(range(len(args))) - set(s for s in sources if s is not None)
        if missing:
            raise BackendCompileError(f"bucket {bucket.key}: graph inputs {sorted(missing)} of the step are not "
                                      "parameters of its graph; cannot replay it")
        name = _graph_name(self.xla, outs)
        with alias_with_buffer_donor_config():
            graph_hash = X._get_graph_hash(outs)
            X._set_current_graph_name(name)
            try:
                X._xla_warm_up_cache(outs, [])
            finally:
                X._set_current_graph_name(DEFAULT_GRAPH_NAME)
        L = len(self.k_caches)
        self.k_caches[:], self.v_caches[:] = saved[:L], saved[L:]
        X._clear_pending_irs(str(self.device))
        fixed = [None if s is not None else v for s, v in zip(sources, values, strict=True)]
        return Replay(graph_hash, name, sources, fixed, len(heads))

    def replay(self, r: Replay, inputs: StepInputs, sampling: SamplingInputs | None = None) -> Any:
        X = self.xla._XLAC
        step = self.step_tensors(inputs)
        caches = [*self.k_caches, *self.v_caches]
        for t in caches:
            X._set_buffer_donation(t, True)
        args = [*step, *caches, *self.lora_tensors()]
        out = X._run_cached_graph(r.graph_hash, [args[s] if s is not None else v
                                                 for s, v in zip(r.sources, r.fixed, strict=True)])
        L, n = len(self.k_caches), r.outputs
        self.k_caches[:], self.v_caches[:] = out[n:n + L], out[n + L:]
        return self._finish(list(out[:n]), n > 1, sampling, replayed=True)


class SpmdRanks(DeviceProgram):
    """tp > 1: every rank's model as one SPMD program over `tp` XLA devices (one process).

    Each weight is stored stacked over ranks, [tp, *shard], sharded on dim 0, so device r holds rank r's shard
    once; the KV block pools likewise ([tp, num_blocks, n_kv_local, block positions, D], device-resident, donated
    every step).
    A step enters a manual-sharding region, runs the rank model (rank 0's module, called with each device's
    shards through torch.func.functional_call) and leaves it with the logits [tp, B, V/tp].
    """

    def __init__(self, models: list[torch.nn.Module], cache: CacheConfig, xla: ModuleType,
                 comm: SpmdCollectives) -> None:
        import torch_xla.distributed.spmd as xs

        tp = len(models)
        have = xla.runtime.global_runtime_device_count()
        if have != tp:
            raise ConfigError(f"neuron backend: tp={tp} needs {tp} XLA devices in this process, found {have} "
                              "(on the XLA CPU device set CPU_NUM_DEVICES before torch_xla starts; the CLI does)")
        self.xla, self.xs, self.comm, self.tp = xla, xs, comm, tp
        self.mesh = xs.Mesh(np.arange(tp), (tp,), ("tp",))
        self.device = xla.device()
        self.skeleton = models[0].eval()
        per_rank = [dict(m.named_parameters()) for m in models]  # named_parameters drops tied duplicates
        self.params = {n: self._shard(torch.stack([pr[n].detach() for pr in per_rank]).to(self.device))
                       for n in per_rank[0]}
        self.buffers = {n: b.to(self.device) for n, b in self.skeleton.named_buffers()}  # replicated
        self.rank_ids = self._shard(torch.arange(tp, dtype=torch.int32).to(self.device))
        dtype = kv_dtype(cache, models[0].model.embed_tokens.weight.dtype)
        shapes = [(tp, *s) for s in pool_shapes(models[0], cache)]
        self.k_caches = [self._shard(torch.zeros(s, dtype=dtype, device=self.device)) for s in shapes]
        self.v_caches = [self._shard(torch.zeros(s, dtype=dtype, device=self.device)) for s in shapes]
        self.window_kv = cache.sliding_window > 0
        if getattr(self.skeleton, "lora_config", None) is not None:  # every rank's shard of each stack, sharded
            self.lora = DeviceLora(models, models[0].model.embed_tokens.weight.dtype, xla, self.device, self._shard)
        for m in models:  # the host copies of the weights are no longer needed
            for p in m.parameters():
                p.data = torch.empty(0, dtype=p.dtype)
        xla.sync()

    def _spec(self, t: torch.Tensor, sharded: bool = True) -> tuple[str | None, ...]:
        return (("tp",) if sharded else (None,)) + (None,) * (t.dim() - 1)

    def _shard(self, t: torch.Tensor) -> torch.Tensor:
        self.xs.mark_sharding(t, self.mesh, self._spec(t))
        return t

    def _enter(self, t: torch.Tensor, sharded: bool = True) -> torch.Tensor:
        return self.xs.enable_manual_sharding(t, self._spec(t, sharded), mesh=self.mesh).global_tensor

    @property
    def vocab_size(self) -> int:
        return int(self.skeleton.cfg.vocab_size)

    def trace_step(self, bucket: Bucket, step: list[torch.Tensor],
                   sampling: SamplingInputs | None = None) -> list[torch.Tensor]:
        """Records one step; returns [the device logits [tp, B, (q,) V/tp] fp32 (rank r's vocabulary shard at r)],
        or with `sampling` the vocab-parallel sampled outputs (`spmd_sample`), each [tp, ...] the same on every rank;
        capturing (`aux_layers`), then the auxiliary states [tp, B, S, A]."""
        step = [self._enter(t, sharded=False) for t in step]  # replicated into the region
        params = {n: self._enter(p)[0] for n, p in self.params.items()}
        bufs = {n: self._enter(b, sharded=False) for n, b in self.buffers.items()}
        ks = [self._enter(c) for c in self.k_caches]  # [1, num_blocks, n_kv, per block, D]: this device's pool
        vs = [self._enter(c) for c in self.v_caches]
        self.comm.rank_tensor = self._enter(self.rank_ids)  # [1] int32: this device's rank
        local_s = None if sampling is None else sampling.map(lambda t: self._enter(t, sharded=False))
        step, kwargs = self.split_step(step)
        if self.lora is not None:  # this device's [N + 1, ...] shard of each stack, with the rows' slots
            kwargs["lora"] = LoraInputs(self.lora.view(lambda t: self._enter(t)[0]),  # type: ignore[arg-type]
                                        kwargs.pop("lora_slots"))
        caches = ([k[0] for k in ks], [v[0] for v in vs])
        module: torch.nn.Module = self.skeleton if not self.aux_layers else _WithAux(self.skeleton, self.aux_layers)
        prefix = "" if not self.aux_layers else "model."
        try:
            with torch.no_grad():
                outs = self._outputs(torch.func.functional_call(
                    module, {prefix + n: t for n, t in {**params, **bufs}.items()},
                    (*step, *caches, bucket.kv_len, bucket.generates), kwargs))
                logits = outs[0]
                sampled = None if local_s is None else spmd_sample(logits.reshape(-1, logits.shape[-1]), local_s,
                                                                   self.vocab_size, self.comm)
        finally:
            self.comm.rank_tensor = None
        for full, local in zip([*self.k_caches, *self.v_caches], [*ks, *vs], strict=True):
            out = self.xs.disable_manual_sharding(local, self._spec(full), full.shape, mesh=self.mesh)
            full.copy_(out.global_tensor)  # in place: the cache buffer is donated to this step
        # [tp, ...]: rank r's logits (its vocabulary shard) or the sampled outputs (the same on every rank), and
        # the auxiliary states (whole on every rank) at r
        heads = [outs[0]] if sampled is None else sampled
        return [self.xs.disable_manual_sharding(o[None], ("tp", *(None,) * o.dim()), (self.tp, *o.shape),
                                                mesh=self.mesh).global_tensor for o in [*heads, *outs[1:]]]

    def host_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """[tp, B, S, A] -> rank 0's [B, S, A]: the residual stream is whole on every rank (after each
        row-parallel all-reduce)."""
        return aux[0].cpu()

    def embedding_table(self) -> torch.Tensor:
        """The whole token embedding table [V_padded, H] on the host: the ranks' vocabulary shards in order."""
        stacked = self.params["model.embed_tokens.weight"].cpu()  # [tp, V/tp, H]
        return stacked.reshape(-1, stacked.shape[-1])

    def device_embedding_table(self) -> torch.Tensor:
        """The whole table [V_padded, H] on the device, replicated: a copy beside the ranks' shards."""
        table = self.embedding_table().to(self.device)
        self.xla.sync()
        return table

    def host_samples(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t[0] for t in self.to_host(outs)]  # the same on every rank: rank 0's

    def host_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V_padded] ([B, q, V_padded] for verify): the ranks' vocabulary shards side by side. An
        embedding model's output is its pooled vectors [B, H], whole on every rank (after the decoder's last
        all-reduce): rank 0's."""
        if self.skeleton.cfg.is_embedding:
            return self.to_host([logits])[0][0]  # [tp, B, H] -> [B, H]
        host = self.to_host([logits])[0]  # [tp, B, (q,) V/tp]
        return host.movedim(0, -2).reshape(*host.shape[1:-1], -1)


class _WithAux(torch.nn.Module):
    """The rank model whose forward is `forward_with_aux` (its logits and the streams entering `aux_layers`), for
    torch.func.functional_call, which calls a module's forward."""

    def __init__(self, model: torch.nn.Module, aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model, self.aux_layers = model, aux_layers

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        *step, k, v, kv_len, decode = args
        return self.model.forward_with_aux(*step, k, v, kv_len, self.aux_layers, decode, **kwargs)


def _graph_name(xla: ModuleType, outputs: list[torch.Tensor]) -> str:
    return "neuron_opt_" + bytes(xla._XLAC._get_graph_hash(outputs)).hex()[:24]


def _sync(xla: ModuleType, outputs: list[torch.Tensor]) -> str:
    """Executes the pending graph under a name derived from its hash (how compile finds its HLO in XLA's dump),
    then restores torch-xla's default name so no other graph of the process is dumped under ours."""
    name = _graph_name(xla, outputs)
    xla._XLAC._set_current_graph_name(name)
    try:
        xla.sync()
    finally:
        xla._XLAC._set_current_graph_name(DEFAULT_GRAPH_NAME)
    return name


class DeviceRank(DeviceProgram):
    """tp=1: the model on the XLA device, weights placed once, KV caches device-resident for every bucket."""

    def __init__(self, model: torch.nn.Module, cache: CacheConfig, xla: ModuleType) -> None:
        self.xla = xla
        self.device = xla.device()
        dtype = next(model.parameters()).dtype
        # .to(xla) unties: the LM head would be moved as a second copy (an embedding model has no head)
        if model.cfg.tie_word_embeddings and not model.cfg.is_embedding:
            model.lm_head.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.model = model.eval().to(self.device)  # the one host -> device copy of the weights
        self.model.tie_weights()
        dtype = kv_dtype(cache, dtype)
        shapes = pool_shapes(model, cache)
        self.k_caches = [torch.zeros(s, dtype=dtype, device=self.device) for s in shapes]
        self.v_caches = [torch.zeros(s, dtype=dtype, device=self.device) for s in shapes]
        self.window_kv = cache.sliding_window > 0
        xla.sync()  # materialise weights and caches now, not inside the first step's graph
        if getattr(model, "lora_config", None) is not None:
            self.lora = DeviceLora([model], model.model.embed_tokens.weight.dtype, xla, self.device)

    @property
    def vocab_size(self) -> int:
        return int(self.model.cfg.vocab_size)

    def trace_step(self, bucket: Bucket, step: list[torch.Tensor],
                   sampling: SamplingInputs | None = None) -> list[torch.Tensor]:
        """Records one step into the pending lazy graph; returns [the device logits [B, V] fp32] (an embedding
        model: its pooled vectors [B, H] fp32), or with `sampling` its sampled outputs (`sample_on_device`);
        capturing (`aux_layers`), then the auxiliary states [B, S, A]."""
        step, kwargs = self.split_step(step)
        if self.lora is not None:
            kwargs["lora"] = LoraInputs(self.lora.view(), kwargs.pop("lora_slots"))  # type: ignore[arg-type]
        with torch.no_grad():
            if self.aux_layers:
                logits, aux = self.model.forward_with_aux(*step, self.k_caches, self.v_caches, bucket.kv_len,
                                                          self.aux_layers, bucket.generates, **kwargs)
            else:
                logits = self.model(*step, self.k_caches, self.v_caches, bucket.kv_len, bucket.generates, **kwargs)
                aux = None
            outs = [logits] if sampling is None else sample_on_device(logits, sampling, self.vocab_size)
            return outs if aux is None else [*outs, aux]

    def embedding_table(self) -> torch.Tensor:
        """The token embedding table [V, H] on the host."""
        return self.model.model.embed_tokens.weight.cpu()

    def device_embedding_table(self) -> torch.Tensor:
        """The token embedding table [V, H] on the device: the model's own (no copy)."""
        return self.model.model.embed_tokens.weight


def warm_up_inputs(bucket: Bucket, block_size: int, every: bool = False, window_kv: bool = False) -> StepInputs:
    """A step shaped like `bucket` whose every row writes and reads only the null block (never given to a request).
    `every`: logits at every position (a prefill's every-position variant; a verify bucket's always are);
    `window_kv`: the window pool's slot mapping and tables too (its null block as well)."""
    B, S = bucket.batch, bucket.tokens
    start = bucket.kv_len - S
    pos = torch.arange(start, start + S, dtype=torch.long).expand(B, S).contiguous()
    last = (torch.arange(S, dtype=torch.long).expand(B, S).contiguous() if every or bucket.phase == VERIFY
            else torch.full((B,), S - 1, dtype=torch.long))
    nb = -(-bucket.kv_len // block_size)
    window = (torch.zeros(B, S, dtype=torch.long), torch.zeros(B, nb, dtype=torch.long)) if window_kv else ()
    return StepInputs(torch.zeros(B, S, dtype=torch.long), pos, torch.zeros(B, S, dtype=torch.long),
                      torch.zeros(B, nb, dtype=torch.long), last, None, *window)


# HLO ops that would move data between host and device inside a step, or call back into the host
HOST_OPS = ("infeed", "outfeed", "send", "recv", "send-done", "recv-done")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def hlo_summary(text: str) -> dict[str, Any]:
    """Facts of one bucket's HLO module (the artifact's `*.hlo.txt`) that the device design promises.

    donated: entry parameters XLA may alias to outputs (the KV caches); parameters: entry parameter count;
    collectives: count per kind; custom_calls: targets; host_ops: any op that talks to the host mid-graph;
    dynamic_shapes: bounded-dynamic dimensions (`<=N`), which the Neuron compiler needs none of.
    """
    header = text.split("\n", 1)[0]
    donor = re.search(r"buffer_donor=\{(.*?)\}, entry_computation_layout", header)
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->", header)
    params = re.findall(r"\w+\[[\d,<=]*\]\{?", layout.group(1)) if layout else []
    ops = re.findall(r"= \S+ ([a-z][\w-]*)\(", text)  # the op of every instruction: `%x = f32[..] op(`
    return {
        "donated": len(re.findall(r"\(\d+, \{\}\)", donor.group(1))) if donor else 0,
        "parameters": len(params),
        "collectives": {c: ops.count(c) for c in COLLECTIVES if ops.count(c)},
        "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
        "host_ops": sorted({o for o in ops if o in HOST_OPS}),
        "dynamic_shapes": "<=" in text,
    }


def hlo_files(out_dir: Path, key: str) -> tuple[Path, Path]:
    return out_dir / HLO_TEXT.format(key=key), out_dir / HLO_PROTO.format(key=key)


class DeviceBlocks:
    """The second KV tier's view of the device pools (runtime/kv_tier.py `PoolBlocks`): one block of the K and V pools
    of `layers` (None: every layer) copied to host memory and back. The block index is device data, so every block
    runs the same two small graphs (an index_select of each of those pools, and an in-place index_copy into each);
    one layer subset is one pair of graphs, so window-sized KV (kv_tier.group_blocks: the full layers' and the window
    layers' pools, whose block counts differ) compiles two pairs. At tp > 1 a block is every rank's slice of it
    ([tp, 1, ...], written back sharded like the pool)."""

    def __init__(self, program: DeviceRank | SpmdRanks, layers: Sequence[int] | None = None) -> None:
        self.program = program
        n = len(program.k_caches)
        self.layers = list(range(n)) if layers is None else list(layers)
        if not self.layers or len(set(self.layers)) != len(self.layers) or not all(0 <= i < n for i in self.layers):
            raise ValueError(f"DeviceBlocks: layers {self.layers} are not distinct layers of the model's {n}")
        self.dim = 1 if isinstance(program, SpmdRanks) else 0  # SPMD pools: [tp, num_blocks, ...]
        caches = self._caches()
        if len({c.dtype for c in caches}) != 1:
            raise ConfigError("kv_offloading_size: the KV tier copies pools of one dtype",
                              param="kv_offloading_size")
        self.dtype = caches[0].dtype
        self.shapes = [tuple(c.shape[:self.dim]) + (1,) + tuple(c.shape[self.dim + 1:]) for c in caches]
        self.numels = [math.prod(shape) for shape in self.shapes]
        self.block_bytes = sum(self.numels) * caches[0].element_size()

    def _caches(self) -> list[torch.Tensor]:
        """The pools copied, in entry order: the layers' K pools, then their V pools (read each time: a step
        replaces the program's pool tensors by its outputs)."""
        p = self.program
        return [p.k_caches[i] for i in self.layers] + [p.v_caches[i] for i in self.layers]

    def _index(self, block: int) -> torch.Tensor:
        return torch.tensor([block], dtype=torch.int64).to(self.program.device)

    def read(self, block: int) -> torch.Tensor:
        idx = self._index(block)
        flat = torch.cat([c.index_select(self.dim, idx).reshape(-1) for c in self._caches()])
        return flat.cpu().view(torch.uint8)

    def write(self, block: int, data: torch.Tensor) -> None:
        p = self.program
        idx = self._index(block)
        values = data.view(self.dtype)
        offset = 0
        for c, shape, n in zip(self._caches(), self.shapes, self.numels, strict=True):
            new = values[offset:offset + n].reshape(shape).to(p.device)
            if isinstance(p, SpmdRanks):
                new = p._shard(new)
            c.index_copy_(self.dim, idx, new)
            offset += n
        p.xla.sync()


class NeuronExecutor:
    """Runs every bucket's graph on the device model (DeviceRank, or SpmdRanks for tp > 1).

    A step moves the step inputs in and the logits out (with sampling inputs: the sampled token ids); weights and
    KV caches stay on the device.
    """

    gathers_candidates = False
    # async scheduling on by default (the engine's default; --no-async-scheduling turns it off): measured ahead of
    # the synchronous loop on the XLA tier (docs/serving.md, "Async scheduling"), and a NeuronCore runs the graph
    # while the host thread waits
    async_scheduling = True

    def __init__(self, ranks: DeviceRank | SpmdRanks, block_size: int, replay: bool) -> None:
        self.ranks, self.block_size, self.replay = ranks, block_size, replay
        # sampling on the device (`run(sampling=...)`): the candidates per rank of the vocab-parallel path (tp > 1;
        # None: every rank's row is whole at tp=1); a row it cannot sample exactly is sampled on the host
        self.samples_on_device = not (ranks.skeleton if isinstance(ranks, SpmdRanks) else ranks.model).cfg.is_embedding
        self.sample_candidates = SPMD_CANDIDATES if isinstance(ranks, SpmdRanks) else None
        self.d2h_bytes = 0  # bytes the last step moved device -> host
        self.buckets: dict[Bucket, Replay | None] = {}  # None: run traced
        self.every: dict[Bucket, Replay | None] = {}  # prefill buckets' every-position variants compiled so far
        self._host_embed: torch.Tensor | None = None  # `embed`'s table, read from the device on first use
        self._chain: tuple[Any, Any] | None = None  # eagle3_chain's: (head, its device chain)

    @property
    def lora_config(self) -> Any:
        """The LoRA capacity the graphs take adapters for (neuron_opt.lora.LoraConfig); None: no adapters."""
        return None if self.ranks.lora is None else self.ranks.lora.config

    def load_lora(self, slot: int, adapter: Any) -> None:
        """Writes every rank's shard of `adapter` (neuron_opt.lora.adapter.LoraAdapter) into `slot` on the device,
        in place; compiles nothing (neuron_lora.py)."""
        assert self.ranks.lora is not None
        self.ranks.lora.write(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        assert self.ranks.lora is not None
        self.ranks.lora.write(slot, None)

    @property
    def k_caches(self) -> list[torch.Tensor]:
        return self.ranks.k_caches

    def tier_blocks(self, layers: Sequence[int] | None = None) -> DeviceBlocks:
        """The pools of `layers` (None: every layer) as the second KV tier copies them (runtime/kv_tier.py)."""
        return DeviceBlocks(self.ranks, layers)

    @property
    def v_caches(self) -> list[torch.Tensor]:
        return self.ranks.v_caches

    def capture_aux_hidden(self, layer_ids: tuple[int, ...]) -> None:
        """From now on every step also returns the residual stream entering these layers at every position
        (`aux_hidden`: [B, S, n_aux * H], models.llama `forward_with_aux`), for an EAGLE-3 head. Each bucket's
        graph gets a variant with that output, compiled here for every bucket (so every graph is ready before
        the next request; on a NeuronCore neuronx-cc runs once per bucket and the NEFF lands in the artifact's
        Neuron compile cache); every-position prefill variants compile on demand as before, with it."""
        if self.ranks.aux_layers == tuple(layer_ids):
            return  # another engine over this model already switched it
        self.ranks.capture_aux(tuple(layer_ids))
        self.every.clear()
        for bucket in sorted(self.buckets, key=lambda b: b.key):
            _, self.buckets[bucket] = self.ranks.compile_for(bucket, self.block_size, self.replay)

    @property
    def aux_hidden(self) -> torch.Tensor | None:
        """The last step's auxiliary hidden states on the host (`capture_aux_hidden`)."""
        return self.ranks.aux_hidden

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embedding rows of `ids`, unscaled, from a host copy of the table read once from the device
        (an EAGLE-3 head without embeddings of its own, run on the host, shares them)."""
        if self._host_embed is None:
            self._host_embed = self.ranks.embedding_table()
        return torch.nn.functional.embedding(ids, self._host_embed)

    def eagle3_chain(self, head: Any, cache: Any, buckets: Any) -> Any:
        """The EAGLE-3 head as device graphs beside the model (neuron.eagle3.DeviceEagle3Chain): its weights and
        KV (in the target's block layout) on the device, the whole draft chain one graph call per step. Kept per
        head, so the engines of later calls (`LLM.generate_batch`) reuse its device copy and compiled graphs; a new
        proposer trusts no head entry it did not write, so nothing of an earlier engine's KV is read."""
        from neuron_opt.backends.neuron.eagle3 import DeviceEagle3Chain

        if self._chain is None or self._chain[0] is not head:
            self._chain = None  # one head's copy on the device at a time
            table = None if head.embed_tokens is not None else self.ranks.device_embedding_table()
            chain = DeviceEagle3Chain(head, cache, buckets, self.ranks.xla, self.ranks.device, table)
            self._chain = (head, chain)
        return self._chain[1]

    def warm(self, bucket: Bucket, sampling: SamplingInputs) -> None:
        """Runs `bucket` once on inputs that write and read only the null block, sampling with `sampling`, so its
        sampling graph (tp=1: the small graph after the replayed step; tp > 1: the traced step that records it) is
        compiled before a request needs it (`ModelRunner.warm_sampling`)."""
        self.run(bucket, warm_up_inputs(bucket, self.block_size, window_kv=self.ranks.window_kv), sampling)

    def run(self, bucket: Bucket, inputs: StepInputs, sampling: SamplingInputs | None = None) -> Any:
        """The step's fp32 logits on the host; with `sampling`, the rows' tokens sampled on the device instead:
        [ids [B] int32, (logprobs: chosen [B], top values [B, n], top ids [B, n])], a verify step's positions as
        B * q rows. `d2h_bytes` counts what came back."""
        if bucket not in self.buckets:
            raise ArtifactError(f"no compiled graph for bucket {bucket.key}; the artifact has "
                                f"{sorted(b.key for b in self.buckets)}")
        replay = self.buckets[bucket]
        if bucket.phase == PREFILL and inputs.last_index.dim() == 2:  # every position's logits: [B, S, V]
            if sampling is not None:
                raise ValueError("a prefill of every position's logits (prompt logprobs) samples on the host")
            if bucket not in self.every:
                _, self.every[bucket] = self.ranks.compile_for(bucket, self.block_size, self.replay, every=True)
            replay = self.every[bucket]
        if sampling is not None:  # a verify step: one row of sampling inputs per scored position (B * q)
            sampling = sampling.padded(bucket.batch * (bucket.tokens if bucket.phase == VERIFY else 1))
        out = (self.ranks.run_traced(bucket, inputs, sampling) if replay is None
               else self.ranks.replay(replay, inputs, sampling))
        self.d2h_bytes = self.ranks.d2h_bytes
        return out if sampling is not None else out.float()


class NeuronBackend(Backend):
    """The device path. `tp` > 1 builds every rank into one SPMD program over `tp` XLA devices."""

    name = "neuron"
    spmd = True
    supports_lora = True  # adapter stacks as device state, written in place (neuron_lora.py)
    window_kv = True  # sliding layers' pools of the window's blocks, their slots and tables step inputs
    est_seconds_per_graph = 300.0  # neuronx-cc's order of magnitude
    targets_instance = True

    @classmethod
    def create(cls, dtype: torch.dtype, options: dict[str, Any] | None, for_compile: bool, tp: int) -> NeuronBackend:
        return cls(dtype, options, dump=for_compile, tp=tp)

    @classmethod
    def default_dtype(cls) -> str:
        return "bfloat16"

    @classmethod
    def check_parallel(cls, par: Any, kv_seq_shards: int = 1) -> None:
        if par.tp > 1:
            check_spmd_layout(par, kv_seq_shards)

    @classmethod
    def prepare(cls, tp: int, for_compile: bool) -> None:
        """XLA's HLO dump (compile) and the SPMD devices must be set up before anything (transformers included)
        imports torch_xla."""
        import_xla(dump=for_compile, devices=tp)

    @classmethod
    def resolve_offset_prefill(cls, options: dict[str, Any], asked: bool | None) -> bool:
        # the NKI kernels pick causal flash attention for a prefill whose tokens equal its KV length, which an
        # offset prefill can also be: no offset buckets with ops=nki
        nki = options.get("ops") == "nki"
        if asked and nki:
            raise ConfigError("offset_prefill: the neuron backend's ops=nki runs prefill kernels that assume a "
                              "prompt from position 0; compile with --no-offset-prefill (prefix caching and chunked "
                              "prefill then stay off) or without ops=nki")
        return not nki if asked is None else asked

    @classmethod
    def check_kv_cache_dtype(cls, options: dict[str, Any], kv_cache_dtype: KVCacheDtype) -> None:
        if kv_cache_dtype is KVCacheDtype.FP8 and options.get("ops") == "nki":
            raise ConfigError("kv_cache_dtype: fp8 is not read by the NKI attention kernels yet; compile without "
                              "ops=nki")

    @classmethod
    def compile_target(cls) -> str:
        """The backend and the PJRT device (once torch_xla is imported)."""
        if "torch_xla" in sys.modules:
            return f"neuron/{sys.modules['torch_xla'].runtime.device_type()}"
        return cls.name

    def __init__(self, dtype: torch.dtype = torch.bfloat16, options: dict[str, Any] | None = None,
                 dump: bool = False, tp: int = 1) -> None:
        self.opts = NeuronOptions.from_dict(options)  # config errors before the runtime check
        self.tp = tp
        self.xla = import_xla(dump=dump, devices=tp)
        self.device_type = self.xla.runtime.device_type()
        self.dtype = dtype
        self.comm = SpmdCollectives(tp) if tp > 1 else None
        if self.opts.replay and tp > 1:
            raise ConfigError("backend_options.replay: graph replay is available at tp=1 only; torch-xla 2.9 "
                              "segfaults reading a sharded tensor's device data, which replaying an SPMD graph needs")
        self.replay = tp == 1 if self.opts.replay is None else self.opts.replay
        self._ranks: dict[int, DeviceRank | SpmdRanks] = {}  # the device model being compiled
        self.kernel_ops: Any = None  # ops=nki: the DeviceKernelOps of the device model

    def rank_collectives(self, tp: int, kv_group_size: int) -> SpmdCollectives | None:
        """The collectives every rank model is built with (None for tp=1: nothing to communicate)."""
        if tp != self.tp:
            raise ConfigError(f"neuron backend: built for tp={self.tp}, asked for tp={tp}")
        if self.comm is not None:
            self.comm.kv_group_size = kv_group_size
        return self.comm

    def _set_compiler_env(self, cache_dir: Path) -> None:
        if self.device_type == "NEURON":  # neuronx-cc's flags and its NEFF cache, read per compile
            os.environ["NEURON_CC_FLAGS"] = " ".join([*self.opts.compiler_args, f"--cache_dir={cache_dir}"])
            os.environ["NEURON_COMPILE_CACHE_URL"] = str(cache_dir)

    def _device_model(self, models: list[torch.nn.Module], cache: CacheConfig) -> DeviceRank | SpmdRanks:
        if self.opts.ops == "nki":  # after import_xla: the NKI kernels import the Neuron SDK where installed
            from neuron_opt.backends.neuron.nki_device import DeviceKernelOps, set_ops

            self.kernel_ops = DeviceKernelOps(self.device_type, models[0].cfg.sliding_window)
            for m in models:
                set_ops(m, self.kernel_ops)
        if len(models) != self.tp:
            raise ConfigError(f"neuron backend: built for tp={self.tp}, got {len(models)} rank model(s)")
        if self.tp == 1:
            return DeviceRank(models[0], cache, self.xla)
        check_spmd_layout(models[0].pctx, models[0].layout.kv_seq_shards)
        return SpmdRanks(models, cache, self.xla, self.comm)

    def compile_bucket(self, model: torch.nn.Module, bucket: Bucket, cache: CacheConfig, out_dir: Path) -> list[Path]:
        return self.compile_unit([model], bucket, cache, out_dir)

    def compile_unit(self, models: list[torch.nn.Module], bucket: Bucket, cache: CacheConfig,
                     out_dir: Path) -> list[Path]:
        """Compiles `bucket`'s step on the device model and writes the HLO XLA compiled for it.

        `models`: every rank's model, in rank order (tp > 1: one SPMD program). The
        graph is compiled exactly as `load` will compile it (for replay, or run once on the null block when
        traced), so errors surface here and, on a NeuronCore, its NEFF lands in the artifact's Neuron compile
        cache.
        """
        if "dir" not in _DUMP:
            raise ConfigError("neuron backend: construct it with dump=True to compile (XLA's HLO dump)")
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        key = id(models[0])
        self._set_compiler_env(out_dir / NEURON_CACHE)  # before the device model: its LoRA slot-write graph too
        if key not in self._ranks:
            self._ranks = {key: self._device_model(models, cache)}  # one device model at a time
        ranks = self._ranks[key]
        # the same compile `load` makes, so a NeuronCore's NEFF cache entry is the one used
        name, _ = ranks.compile_for(bucket, cache.block_size, self.replay)
        d = _DUMP["dir"]
        texts = sorted(d.glob(f"module_*.{name}.*before_optimizations.txt"))
        protos = sorted(d.glob(f"module_*.{name}.*before_optimizations.hlo.pb"))
        if not texts or not protos:
            raise BackendCompileError(f"bucket {bucket.key}: XLA wrote no HLO for graph {name} under {d}")
        dst_text, dst_proto = hlo_files(out_dir, bucket.key)
        shutil.copyfile(texts[-1], dst_text)
        shutil.copyfile(protos[-1], dst_proto)
        files = [dst_text.relative_to(out_dir), dst_proto.relative_to(out_dir)]
        if self.kernel_ops is not None:  # what each attention / norm call site of this graph runs, and why
            (out_dir / KERNELS.format(key=bucket.key)).write_text(
                json.dumps(self.kernel_ops.take_choices(), indent=1))
            files.append(Path(KERNELS.format(key=bucket.key)))
        neff_dir = out_dir / NEURON_CACHE
        if neff_dir.is_dir():
            files += [p.relative_to(out_dir) for p in sorted(neff_dir.rglob("*")) if p.is_file()]
        return files

    def save_weights(self, model: torch.nn.Module, path: Path) -> None:
        save_file({k: v.cpu() for k, v in model_state_for_save(model).items()}, str(path))

    def finish_compile(self) -> None:
        self._ranks.clear()

    def load(self, graph_files: dict[Bucket, list[Path]], weights_path: Path, model_factory: ModelFactory,
             cache: CacheConfig) -> NeuronExecutor:
        return self.load_unit(graph_files, [weights_path], [model_factory], cache)

    def load_unit(self, graph_files: dict[Bucket, list[Path]], weights_paths: list[Path],
                  model_factories: list[ModelFactory], cache: CacheConfig) -> NeuronExecutor:
        """Places the weights on the device once and compiles (NeuronCore: loads) every bucket's graph now.

        `weights_paths`, `model_factories`: every rank's, in rank order; at tp > 1 every rank's model must be
        built with `rank_collectives()`."""
        models = []
        for path, factory in zip(weights_paths, model_factories, strict=True):
            m = factory()
            load_model_weights(m, Path(path))
            models.append(m.to(self.dtype).eval())
        for bucket, files in graph_files.items():
            if not any(Path(f).name == HLO_TEXT.format(key=bucket.key) for f in files):
                raise ArtifactError(f"bucket {bucket.key}: no HLO among {[str(f) for f in files]}")
        if graph_files:
            self._set_compiler_env(Path(next(iter(graph_files.values()))[0]).parent / NEURON_CACHE)
        ranks = self._device_model(models, cache)
        executor = NeuronExecutor(ranks, cache.block_size, self.replay)
        for bucket in sorted(graph_files, key=lambda b: b.key):  # every graph ready before the first request
            _, executor.buckets[bucket] = ranks.compile_for(bucket, cache.block_size, self.replay)
        return executor
