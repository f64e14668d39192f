"""The one narrow interface every backend implements (`Backend`), and what its executors run (`Executor`).

A backend turns a compile unit's model (one rank's shard, or every rank of one SPMD program) into per-bucket
graphs on disk at compile time, and at load time into an `Executor` that runs a bucket's graph on named inputs.
The executor owns the KV caches; every bucket's graph reads and writes the same cache buffers. `Backend` states
every capability the compiler and the executor factory use, so neither branches on a backend's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from neuron_opt.buckets import Bucket
from neuron_opt.config import CacheConfig, KVCacheDtype, torch_dtype
from neuron_opt.errors import ConfigError


@dataclass(frozen=True)
class StepInputs:
    """Graph inputs of one step, exactly the bucket's shape (int64)."""

    input_ids: torch.Tensor  # [B, S] token ids; pads are 0
    positions: torch.Tensor  # [B, S] absolute position of each token (pads: any position < max_model_len)
    slot_mapping: torch.Tensor  # [B, S] where each token's K/V go: block * block_size + offset; pads: 0 (null)
    block_tables: torch.Tensor  # [B, nb] each row's blocks in logical order, padded with the null block 0
    last_index: torch.Tensor  # [B] index along S whose logits are returned; verify steps: [B, S], every index
    # [B] each row's LoRA adapter slot (0: the base model; padding rows 0), for models compiled with a LoRA
    # capacity (neuron_opt.lora); None otherwise. Not one of `arrays()`: only LoRA graphs take it
    lora_slots: torch.Tensor | None = None
    # window-sized KV (CacheConfig.sliding_window): the sliding layers' slot mapping [B, S] and block tables [B, nb]
    # in their own pool (runtime/runner.py); None otherwise. Not among `arrays()` either: `window_kv()`
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None
    # image embeddings merged at their placeholder positions (neuron_opt.multimodal): mask [B, S] bool and rows
    # [B, S, H] (read where the mask is set), for executors that say `takes_embeddings`; None: tokens only
    mm_mask: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    # [3, B, S] M-RoPE positions (ModelConfig.mrope_section), for the same executors; None: `positions`
    rope_positions: torch.Tensor | None = None
    # [B, S] the last key position each query attends to (bidirectional image blocks: Gemma 3), for executors that
    # say `takes_last_keys`; None: its own position (causal)
    last_keys: torch.Tensor | None = None

    def multimodal(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mask, rows) of the step's image embeddings, None without any."""
        if self.mm_mask is None or self.mm_embeds is None:
            return None
        return self.mm_mask, self.mm_embeds

    def window_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sliding layers' (slot mapping, block tables), None without window-sized KV."""
        if self.window_slot_mapping is None or self.window_block_tables is None:
            return None
        return self.window_slot_mapping, self.window_block_tables

    def arrays(self) -> tuple[torch.Tensor, ...]:
        """The five inputs in the order every graph takes them."""
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.last_index)


class Executor(Protocol):
    """Runs a bucket's graph on named inputs; owns the KV caches (empty lists where they live in other processes).

    An executor whose ranks can sample on their vocabulary shards says so with `gathers_candidates = True`; its
    `run` then also takes `candidates=K` (the runner passes it only then: neuron_opt.parallel.vocab). An executor
    whose prefill graphs take any token count says so with `prefill_granularity = g` (g > 0): the runner then pads a
    prefill to a multiple of g rather than to a compiled prefill length (buckets.pick_prefill), and `run` gets
    prefill buckets of those lengths. An executor whose graphs merge image embeddings at their placeholder
    positions (StepInputs.multimodal) says so with `takes_embeddings = True`. An executor whose graph calls run on
    the host's own cores says `async_scheduling = False`: the engine's default is then the synchronous loop
    (runtime/engine.py, docs/serving.md "Async scheduling"); a device's executor leaves it unset (on). An executor
    whose graphs sample says `samples_on_device = True`: its `run` also takes `sampling=` (a
    neuron_opt.sample_ops.SamplingInputs) and returns token ids, and `warm(bucket, sampling)` compiles a sampling
    graph before a request needs it (runtime/runner.py)."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    # Executors of a model compiled with a LoRA capacity also have `lora_config` (neuron_opt.lora.LoraConfig),
    # `load_lora(slot, adapter)` and `clear_lora(slot)`: they write every rank's shard of the adapter's slot

    def run(self, bucket: Bucket, inputs: StepInputs) -> torch.Tensor:
        """fp32 logits [B, V_local] of the rows' `last_index` tokens; [B, S, V_local] for a [B, S] `last_index`: a
        verify step, or a prefill asked for every position's logits (prompt logprobs), which every executor runs
        (eager and gloo ranks: the model's head at each index; cpu: its head graphs outside the layer graphs;
        neuron: the bucket's every-position graph)."""
        ...


ModelFactory = Callable[[], torch.nn.Module]


@dataclass(frozen=True)
class CompileUnit:
    """What one compile (and, at load, one executor) holds: one rank, or every rank as one SPMD program.

    key: the compile-cache key's rank (the rank, or "spmd"); ranks: the ranks it holds, in order; graph_dir: its
    graphs' directory in the artifact."""

    key: int | str
    ranks: tuple[int, ...]
    graph_dir: str


class Backend:
    """What every backend provides to the compiler and to the executor factory (neuron_opt.executors).

    Class-level capabilities are known before a backend is built (building the neuron backend starts the device
    runtime): the compile-time checks, the plan's estimates and how ranks map to compile units. The defaults are
    those of a backend that compiles one graph per bucket and rank, with no collectives inside its graphs.

    Attributes:
        name: the `--backend` name, also the manifest's.
        spmd: the graphs hold the collectives, so every rank is compiled and run as one program (one compile
            unit, one executor in this process); otherwise each rank compiles alone and tp > 1 runs as rank
            processes with gloo collectives between the ops of the eager model.
        compiles_graphs: whether `compile_bucket` compiles anything (the compile speed is measured only then).
        est_seconds_per_graph: the plan's compile-time estimate per 30-layer graph until this machine measured
            its own (compiler.record_compile_speed).
        supports_lora: its graphs take LoRA adapter stacks and slots as inputs (`compile --enable-lora`).
        targets_instance: the plan sizes the memory of `--instance` (else of this CPU host).
        window_kv: its executors hold window-sized KV for sliding-window layers (CacheConfig.sliding_window: a
            pool and tables of their own); otherwise every layer holds the full-length pool.
        gguf_blocks: it runs GGUF K-quant blocks as stored (QuantConfig method gguf, from `--quantize auto`);
            otherwise `auto` converts such a file's linears to int8 per channel.
        compiles_encoders: it builds a vision-language model's encoder buckets (`compile_encoder`, `load_encoder`;
            neuron_opt.multimodal.compiled), and its executors take image embeddings.
        bidirectional_blocks: its executors take the last key each query sees (StepInputs.last_keys: Gemma 3's
            bidirectional image blocks); otherwise such a model's images are refused at compile.
    """

    name: ClassVar[str] = ""
    spmd: ClassVar[bool] = False
    compiles_graphs: ClassVar[bool] = True
    est_seconds_per_graph: ClassVar[float] = 60.0
    targets_instance: ClassVar[bool] = False
    supports_lora: ClassVar[bool] = False
    window_kv: ClassVar[bool] = False
    gguf_blocks: ClassVar[bool] = False
    compiles_encoders: ClassVar[bool] = False
    bidirectional_blocks: ClassVar[bool] = False

    # -- class-level: before the backend is built --------------------------------------------------------------

    @classmethod
    def create(cls, dtype: torch.dtype, options: dict[str, Any] | None, for_compile: bool, tp: int) -> Backend:
        """The backend for one compile unit of `tp` ranks (`for_compile`: to compile, not only to load). A backend
        that is not `spmd` holds one rank whatever the tp: each rank has its own."""
        return cls(dtype, options)  # type: ignore[call-arg]

    @classmethod
    def default_dtype(cls) -> str:
        """The compute dtype when `--dtype` is not given."""
        return "float32"

    @classmethod
    def check_parallel(cls, par: Any, kv_seq_shards: int = 1) -> None:
        """ConfigError for a parallel layout this backend does not build (`kv_seq_shards`: flash decoding's
        KV sequence shards, once the head layout is known)."""

    @classmethod
    def prepare(cls, tp: int, for_compile: bool) -> None:
        """Whatever must happen before anything else in the process imports the device runtime."""

    @classmethod
    def resolve_offset_prefill(cls, options: dict[str, Any], asked: bool | None) -> bool:
        """Whether offset prefill buckets are compiled: `asked`, or the default (on) when None."""
        return True if asked is None else asked

    @classmethod
    def check_kv_cache_dtype(cls, options: dict[str, Any], kv_cache_dtype: KVCacheDtype) -> None:
        """ConfigError for a KV cache dtype these options cannot run."""

    @classmethod
    def check_quant(cls, quant: Any) -> None:
        """ConfigError for a weight quantization (QuantConfig) this backend has no kernel for."""

    @classmethod
    def compile_target(cls) -> str:
        """What compile speed depends on besides the model (the key of the measured speeds)."""
        return cls.name

    @classmethod
    def distinct_graphs(cls, buckets: Any) -> int:
        """Graphs compiled per rank for a BucketConfig (one per bucket unless buckets share graphs)."""
        return len(buckets.buckets())

    @classmethod
    def plan_instance(cls, par: Any) -> str:
        """The instance whose memory the plan table checks."""
        return par.instance if (cls.targets_instance and par.instance) else "cpu"

    @classmethod
    def compile_units(cls, tp: int) -> list[CompileUnit]:
        """How `tp` ranks are compiled and loaded: one SPMD unit, or one unit per rank."""
        if cls.spmd and tp > 1:
            return [CompileUnit("spmd", tuple(range(tp)), "graphs/spmd")]
        return [CompileUnit(r, (r,), f"graphs/rank{r}") for r in range(tp)]

    # -- a built backend ---------------------------------------------------------------------------------------

    def rank_collectives(self, tp: int, kv_group_size: int) -> Any:
        """The collectives every rank model of one unit is built with; None where each rank compiles alone."""
        return None

    def check_model(self, model: torch.nn.Module) -> None:
        """ConfigError for a built rank model these graphs cannot hold (called once its weights are in)."""

    def compile_bucket(self, model: torch.nn.Module, bucket: Bucket, cache: CacheConfig, out_dir: Path) -> list[Path]:
        """One rank's graph(s) for `bucket`, written under `out_dir`; their paths relative to it."""
        raise NotImplementedError

    def compile_unit(self, models: list[torch.nn.Module], bucket: Bucket, cache: CacheConfig,
                     out_dir: Path) -> list[Path]:
        """A compile unit's graph(s) for `bucket` (its rank models in rank order)."""
        (model,) = _one_rank(models, self.name)
        return self.compile_bucket(model, bucket, cache, out_dir)

    def finish_compile(self) -> None:
        """Release what compiling held (device models) once every unit is compiled."""

    def save_weights(self, model: torch.nn.Module, path: Path) -> None:
        raise NotImplementedError

    # -- a vision encoder (neuron_opt.multimodal.compiled): one graph per image-size bucket, replicated ----------

    def compile_encoder(self, graph: torch.nn.Module, args: tuple[torch.Tensor, ...], key: str,
                        out_dir: Path) -> list[Path]:
        """A vision encoder's graph (`graph`, its weights in) for one bucket, `args` its example inputs, written
        under `out_dir`; the paths relative to it. ConfigError where the backend compiles no encoders."""
        raise ConfigError(f"backend: the {self.name} backend does not compile vision encoders yet; vision-language "
                          "models compile with --backend cpu or eager", param="backend")

    def load_encoder(self, graph: torch.nn.Module, files: list[Path]) -> Callable[[tuple[torch.Tensor, ...]],
                                                                                  torch.Tensor]:
        """A compiled encoder bucket as a function of its inputs (`graph`: the module with its weights in)."""
        raise ConfigError(f"backend: the {self.name} backend does not run compiled vision encoders yet",
                          param="backend")

    def load(self, graph_files: dict[Bucket, list[Path]], weights_path: Path, model_factory: ModelFactory,
             cache: CacheConfig) -> Executor:
        """One rank's executor: its model built by `model_factory`, weights from `weights_path`."""
        raise NotImplementedError

    def load_unit(self, graph_files: dict[Bucket, list[Path]], weights_paths: list[Path],
                  model_factories: list[ModelFactory], cache: CacheConfig) -> Executor:
        """A compile unit's executor (its ranks' weights and model factories in rank order)."""
        (path,), (factory,) = _one_rank(weights_paths, self.name), _one_rank(model_factories, self.name)
        return self.load(graph_files, path, factory, cache)


def _one_rank(items: list[Any], backend: str) -> list[Any]:
    if len(items) != 1:
        raise ConfigError(f"backend: the {backend} backend compiles and loads one rank at a time, got {len(items)}")
    return items


def kv_dtype(cache: CacheConfig, compute: torch.dtype) -> torch.dtype:
    """The KV pools' dtype: fp8 e4m3 under `--kv-cache-dtype fp8` (KVCacheDtype.FP8), else the compute dtype."""
    return torch_dtype(cache.dtype) if cache.kv_cache_dtype is KVCacheDtype.FP8 else compute


def pool_shapes(model: torch.nn.Module, cache: CacheConfig) -> list[tuple[int, ...]]:
    """Each layer's K (or V) block pool on one rank, [blocks, n_kv_local, block_size (/ g), D]: with window-sized KV
    the sliding layers' pools have the window pool's blocks (CacheConfig.pool_blocks), the others the full pool's."""
    return [model.kv_shape(cache.pool_blocks(model.cfg.layer_window(i)), cache.block_size)
            for i in range(len(model.model.layers))]


def allocate_kv(model: torch.nn.Module, cache: CacheConfig,
                dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V block pools (`pool_shapes`), zero-filled, in `dtype` (the compute dtype) or in fp8 e4m3
    when the cache config says so."""
    dtype = kv_dtype(cache, dtype)
    shapes = pool_shapes(model, cache)
    return [torch.zeros(s, dtype=dtype) for s in shapes], [torch.zeros(s, dtype=dtype) for s in shapes]
