"""Neuron backend: one `torch_neuronx.trace` graph per bucket, weights kept out of the NEFF.

Design decisions
- Lazy SDK import. Importing this module never touches the Neuron SDK; constructing `NeuronBackend` does, and
  without it raises `BackendUnavailableError` saying what to install and that `--backend cpu` works here. The
  PyPI packages named `torch-neuronx` / `neuronx-cc` are placeholders that raise
  `ImportError("WRONG PACKAGE ...")`; we recognise them and say so.
- One weight layout for every bucket. Each bucket is traced with `inline_weights_to_neff=False`, so its NEFF
  holds no weights; at load time `torch_neuronx.replace_weights` fills every bucket graph from the same
  `weights/rank{r}.safetensors`, which is therefore the single source of truth (swap weights, keep graphs).
- A bucket graph is a tensors-only module (`BucketGraph`): `kv_len` and the batch/seq shape are baked in by
  tracing, ids are int32 (what the Neuron compiler handles best; NxDI casts the same way).
- KV caches. The executor owns full caches on the host, `[num_slots, n_kv, max_length, D]` per layer. A graph
  takes only its bucket's KV *window* of the rows' slots, `[B, n_kv, kv_len, D]` per layer, as inputs and
  returns the updated windows as outputs, which the executor writes back. So the graph never depends on
  `num_slots` or `max_length`, and the bytes moved per step scale with the bucket, like the attention reads.
  NxDI instead keeps the caches on the device as module state aliased input->output
  (`input_output_aliases={past_key_values[i]: 1 + i}`, shared by all bucket submodels of one NxD model);
  plain `torch_neuronx.trace` aliases only a module's own state, which separately traced bucket graphs
  cannot share, hence the windows. See docs/neuron_backend.md for the trade-off and the ModelBuilder route.
- Compiler flags are backend options (part of the compile-cache key): `compiler_args` (default: the
  ModelBuilderV2 defaults `--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1`),
  `target` (`inf2` / `trn1` / `trn2`: trace on a CPU host with `cpu_backend=True` and `--target`),
  `compiler_workdir` (keep neuronx-cc's intermediate files for debugging).
"""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save_file

from neuron_opt.backends.base import ModelFactory, StepInputs, allocate_kv
from neuron_opt.backends.eager import load_model_weights, model_state_for_save
from neuron_opt.buckets import Bucket
from neuron_opt.errors import ArtifactError, BackendUnavailableError, ConfigError

GRAPH_FILE = "graph.pt"  # one TorchScript file per bucket (and rank)
DEFAULT_COMPILER_ARGS = ("--enable-saturate-infinity", "--auto-cast=none", "--model-type=transformer", "-O1")
TARGETS = ("inf2", "trn1", "trn2")
NEURON_PIP_REPO = "https://pip.repos.neuron.amazonaws.com"


def import_sdk() -> ModuleType:
    """Imports `torch_neuronx`, or raises `BackendUnavailableError` with what to do about it."""
    try:
        import torch_neuronx
    except Exception as e:  # noqa: BLE001 - placeholders and half-installed SDKs raise more than ImportError
        raise BackendUnavailableError(unavailable_message(e)) from e
    return torch_neuronx


def unavailable_message(exc: BaseException) -> str:
    text = str(exc)
    if "WRONG PACKAGE" in text:
        why = (
            "the installed 'torch-neuronx'/'neuronx-cc' are the PyPI placeholder packages ('WRONG PACKAGE'); "
            "the real ones are published only in the Neuron pip repository"
        )
    else:
        why = f"importing torch_neuronx failed: {type(exc).__name__}: {text}"
    return (
        f"the neuron backend needs the AWS Neuron SDK (torch-neuronx with the neuronx-cc compiler): {why}. "
        f"On a Neuron instance (inf2/trn1/trn2, e.g. a Neuron DLAMI) install it with "
        f"`pip install torch-neuronx neuronx-cc --extra-index-url={NEURON_PIP_REPO}`. "
        f"On this machine use `--backend cpu` (compiled CPU graphs) or `--backend eager` instead."
    )


@dataclass(frozen=True)
class NeuronOptions:
    """Backend options as stored in the artifact manifest (and hashed into the compile-cache key)."""

    compiler_args: tuple[str, ...] = DEFAULT_COMPILER_ARGS
    target: str | None = None
    compiler_workdir: str | None = None

    def __post_init__(self) -> None:
        if self.target is not None and self.target not in TARGETS:
            raise ConfigError(
                f"backend_options.target: must be one of {', '.join(TARGETS)}, got {self.target!r}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> NeuronOptions:
        d = dict(d or {})
        unknown = sorted(set(d) - {"compiler_args", "target", "compiler_workdir"})
        if unknown:
            raise ConfigError(
                f"backend_options: unknown neuron option(s) {unknown}; "
                "known: compiler_args, target, compiler_workdir"
            )
        args = d.get("compiler_args", DEFAULT_COMPILER_ARGS)
        args = tuple(shlex.split(args)) if isinstance(args, str) else tuple(str(a) for a in args)
        return cls(args, d.get("target"), d.get("compiler_workdir"))

    def trace_compiler_args(self) -> list[str]:
        return [*self.compiler_args, *(["--target", self.target] if self.target else [])]


class BucketGraph(torch.nn.Module):
    """One bucket's step as a tensors-only module: the function `torch_neuronx.trace` records.

    Inputs (int32 ids): input_ids [B, S], positions [B, S], last_index [B], then L key windows and L value
    windows [B, n_kv, kv_len, D] (row b's slot, positions [0, kv_len)). Returns (logits [B, V_local] fp32,
    *new key windows, *new value windows).
    """

    def __init__(self, model: torch.nn.Module, kv_len: int) -> None:
        super().__init__()
        self.model, self.kv_len = model, kv_len

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        last_index: torch.Tensor,
        *windows: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        L = len(windows) // 2
        # the model writes new K/V into its caches in place; give it copies so the graph's inputs stay
        # read-only and the updated windows are plain outputs
        k = [w.clone() for w in windows[:L]]
        v = [w.clone() for w in windows[L:]]
        rows = torch.arange(
            input_ids.shape[0], dtype=positions.dtype, device=input_ids.device
        )  # row b = slot b
        logits = self.model(input_ids, positions, rows, last_index, k, v, self.kv_len)
        return (logits, *k, *v)


def example_inputs(model: torch.nn.Module, bucket: Bucket, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Zero tensors with exactly the bucket graph's input shapes and dtypes."""
    B, S = bucket.batch, (bucket.seq if bucket.phase == "prefill" else 1)
    _, n_kv, _, D = model.kv_shape(1)
    L = len(model.model.layers)
    ids = torch.zeros(B, S, dtype=torch.int32)
    pos = torch.arange(S, dtype=torch.int32).expand(B, S).contiguous()  # [B, S]
    last = torch.zeros(B, dtype=torch.int32)
    windows = tuple(torch.zeros(B, n_kv, bucket.kv_len, D, dtype=dtype) for _ in range(2 * L))
    return (ids, pos, last, *windows)


class NeuronExecutor:
    """Runs bucket graphs; owns the host KV caches and moves each step's KV windows in and out."""

    def __init__(
        self, graphs: dict[Bucket, Any], model: torch.nn.Module, num_slots: int, dtype: torch.dtype
    ) -> None:
        self.graphs = graphs
        self.k_caches, self.v_caches = allocate_kv(model, num_slots, dtype)

    @torch.inference_mode()
    def run(self, bucket: Bucket, inputs: StepInputs) -> torch.Tensor:
        graph = self.graphs.get(bucket)
        if graph is None:
            raise ArtifactError(
                f"no compiled graph for bucket {bucket.key}; the artifact has "
                f"{sorted(b.key for b in self.graphs)}"
            )
        slots, kv = inputs.slot_ids, bucket.kv_len
        k_in = [c[slots, :, :kv] for c in self.k_caches]  # [B, n_kv, kv_len, D] each
        v_in = [c[slots, :, :kv] for c in self.v_caches]  # [B, n_kv, kv_len, D] each
        out = graph(
            inputs.input_ids.to(torch.int32),
            inputs.positions.to(torch.int32),
            inputs.last_index.to(torch.int32),
            *k_in,
            *v_in,
        )
        L = len(self.k_caches)
        for i in range(L):
            # padded decode rows all point at the scratch slot; whichever write lands there is never read
            self.k_caches[i][slots, :, :kv] = out[1 + i]
            self.v_caches[i][slots, :, :kv] = out[1 + L + i]
        return out[0].float()


class NeuronBackend:
    name = "neuron"

    def __init__(self, dtype: torch.dtype = torch.bfloat16, options: dict[str, Any] | None = None) -> None:
        self.opts = NeuronOptions.from_dict(options)  # validate before the SDK check: config errors first
        self.sdk = import_sdk()
        self.dtype = dtype
        self.options = dict(options or {})

    def compile_bucket(
        self, model: torch.nn.Module, bucket: Bucket, num_slots: int, out_dir: Path
    ) -> list[Path]:
        """Traces and compiles `bucket`'s graph into `out_dir/graph.pt`; returns its name relative to out_dir.

        `num_slots` does not shape the graph (it sees KV windows), so one graph serves any cache size.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        wrapper = BucketGraph(model.eval(), bucket.kv_len)
        ex = example_inputs(model, bucket, next(model.parameters()).dtype)
        with tempfile.TemporaryDirectory(prefix=f"neuronx-cc-{bucket.key}-") as tmp:
            workdir = (
                Path(self.opts.compiler_workdir) / bucket.key if self.opts.compiler_workdir else Path(tmp)
            )
            kwargs: dict[str, Any] = dict(
                compiler_workdir=str(workdir),
                compiler_args=self.opts.trace_compiler_args(),
                inline_weights_to_neff=False,
            )
            if self.opts.target:
                kwargs["cpu_backend"] = True  # cross-compile on a host without NeuronCores
            with torch.no_grad():
                traced = self.sdk.trace(wrapper, ex, **kwargs)
        torch.jit.save(traced, str(out_dir / GRAPH_FILE))
        return [Path(GRAPH_FILE)]

    def save_weights(self, model: torch.nn.Module, path: Path) -> None:
        save_file(model_state_for_save(model), str(path))

    def load(
        self,
        graph_files: dict[Bucket, list[Path]],
        weights_path: Path,
        model_factory: ModelFactory,
        num_slots: int,
    ) -> NeuronExecutor:
        model = model_factory()
        load_model_weights(model, Path(weights_path))
        model = model.to(self.dtype).eval()
        graphs: dict[Bucket, Any] = {}
        for bucket, files in graph_files.items():
            path = next((Path(f) for f in files if Path(f).name == GRAPH_FILE), None)
            if path is None:
                raise ArtifactError(f"bucket {bucket.key}: no {GRAPH_FILE} among {[str(f) for f in files]}")
            traced = torch.jit.load(str(path))
            # the graph was traced without its weights in the NEFF: give it this rank's weights, then put
            # them on the NeuronCore once (otherwise every call copies them from the host)
            self.sdk.replace_weights(traced, BucketGraph(model, bucket.kv_len).state_dict())
            self.sdk.move_trace_to_device(traced, 0)
            graphs[bucket] = traced
        return NeuronExecutor(graphs, model, num_slots, self.dtype)
