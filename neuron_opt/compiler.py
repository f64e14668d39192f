"""`compile`: checkpoint -> plan -> per-rank sharded model -> one graph per bucket (cached) -> artifact.

Steps
1. Open and validate the checkpoint (config, weight names, tokenizer) before any long work.
2. Build the bucket set and print the plan table (buckets, graph count, memory, estimated compile time).
3. For each rank: shard the canonical weights, build the rank's model, then for each bucket look the graph up
   in the content-addressed compile cache; compile only the misses (a progress bar per bucket).
4. Save each rank's weights once, the tokenizer, and the manifest; rename the directory into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import models.llama
from models.build import rank_model_factory
from neuron_opt import envs
from neuron_opt.artifact import ArtifactWriter, Manifest, check_out_dir, versions
from neuron_opt.backends import backend_class, get_backend
from neuron_opt.backends.base import Backend
from neuron_opt.buckets import Bucket, BucketConfig, encoder_sizes
from neuron_opt.checkpoint import native_quant, open_checkpoint, stored_tensors
from neuron_opt.compile_cache import CacheKey, CompileCache
from neuron_opt.config import (
    CacheConfig,
    KVCacheDtype,
    ModelConfig,
    ParallelConfig,
    QuantConfig,
    torch_dtype,
)
from neuron_opt.embeddings import describe as describe_task
from neuron_opt.embeddings import resolve_task
from neuron_opt.errors import ConfigError
from neuron_opt.hub import hub_source, resolve_model
from neuron_opt.lora.config import LoraConfig
from neuron_opt.multimodal.compiled import check_compilable, compile_encoders
from neuron_opt.multimodal.vision import (
    VisionLanguageCheckpoint,
    check_vision_parallel,
    is_multimodal,
    open_vision_language,
)
from neuron_opt.parallel import ParallelContext, head_layout
from neuron_opt.parallel.sharding import rank_shards
from neuron_opt.planner import format_plan_table
from neuron_opt.planner.memory import kv_window, resolve_flash_decoding, window_prompt_len
from neuron_opt.planner.vision import checkpoint_vision_plan, vision_lines
from neuron_opt.quant.kv import CALIBRATION_TEXT, calibrate, fold
from neuron_opt.quant.weights import QuantTensor
from neuron_opt.runtime.speculative import check_draft_tokenizer
from neuron_opt.signing import load_signing_key
from neuron_opt.weights import load_weights_streamed

# Seconds per distinct compiled graph of a 30-layer model: each backend's `est_seconds_per_graph` until this
# machine has measured its own. Every cold compile records this machine's figure (`record_compile_speed`); the
# plan table uses it from then on and says which it used.
TIMINGS = "compile_seconds.json"  # in the compile cache directory: seconds per graph per 30 layers, by target



def _graph_units(cfg: ModelConfig, buckets: BucketConfig, backend: str, tp: int) -> float:
    """Distinct graphs x ranks x model size (in 30-layer units): what compile time scales with."""
    return distinct_graphs(buckets, backend) * tp * max(0.3, cfg.num_hidden_layers / 30)


def measured_seconds_per_graph(timings_dir: Path, target: str) -> float | None:
    try:
        return float(json.loads((Path(timings_dir) / TIMINGS).read_text())[target])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_compile_speed(timings_dir: Path, target: str, seconds_per_unit: float) -> None:
    path = Path(timings_dir) / TIMINGS
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table[target] = round(seconds_per_unit, 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(path)


def distinct_graphs(buckets: BucketConfig, backend: str) -> int:
    """Graphs a backend actually compiles per rank (the cpu backend shares graphs between buckets)."""
    return backend_class(backend).distinct_graphs(buckets)


def code_fingerprint() -> str:
    """sha256 over the source of everything that shapes a compiled graph (model code, backends, parallel layers, the
    quantized linear).

    Part of every compile-cache key, so editing the model or a backend never reuses a graph compiled from the old
    code (the package version alone does not change between commits)."""
    here = Path(__file__).parent  # neuron_opt/
    roots = [Path(models.llama.__file__).parent, here / "backends", here / "parallel", here / "quant" / "weights.py"]
    h = hashlib.sha256()
    for root in roots:
        for f in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]) if root.is_dir() else [root]:
            h.update(str(f.relative_to(root.parent)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def default_dtype(backend: str) -> str:
    return backend_class(backend).default_dtype()


@dataclass(frozen=True)
class CompileRequest:
    model: str  # an HF directory, a .gguf file, "default", or a Hub id `org/name[:QUANT]` (neuron_opt.hub)
    out: Path
    revision: str | None = None  # a Hub id's branch, tag or commit (None: main)
    gguf_file: str | None = None  # the .gguf of a Hub GGUF repo to use (else the :QUANT tag, or its only one)
    backend: str = "cpu"
    dtype: str | None = None
    batch_size: int = 1
    max_prompt_len: int | None = None
    max_model_len: int | None = None
    prefill_buckets: tuple[int, ...] | None = None
    decode_buckets: tuple[int, ...] | None = None
    decode_batches: tuple[int, ...] | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    backend_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: Path | None = None  # None: envs.CACHE_DIR / "compile"; use_cache=False disables it
    use_cache: bool = True
    num_speculative_tokens: int = 0  # k > 0: verify graphs of k + 1 tokens (speculative decoding)
    block_size: int = 32  # KV cache block (positions)
    num_kv_blocks: int = 0  # 0: enough for batch_size sequences of max_model_len (CacheConfig)
    offset_prefill: bool | None = None  # offset prefill buckets (prefix caching, chunked prefill); None: auto
    prefill_batch: int = 1
    quantize: str | None = None  # int8 | int4 | fp8 | auto (a GGUF's own precision class); None: none
    quantization_type: str = ""  # QuantConfig.quantization_type; "" = the method's default
    group_size: int = 0  # int4 only; 0 = 32
    modules_to_not_convert: tuple[str, ...] = ()
    quantize_lm_head: bool | None = None  # None: as `quantize auto` finds it (a GGUF's quantized head), else off
    kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO  # auto: the compute dtype; fp8: e4m3, scales folded in
    speculative_model: str | None = None  # a draft model compiled alongside, into DRAFT_DIR (needs k > 0)
    force: bool = False  # replace `out` even when it is a non-empty directory that is not an artifact
    sign_key: Path | None = None  # an Ed25519 private key (neuron-opt keygen): the artifact is signed with it
    # generate | embed; None: embed for a sentence-transformers checkpoint or a bare decoder (neuron_opt.embeddings)
    task: str | None = None
    pooling: str | None = None  # embed: last | mean | cls, overriding the checkpoint's
    normalize: bool | None = None  # embed: L2-normalise the pooled vector; None: the checkpoint's (else on)
    matryoshka_dims: tuple[int, ...] | None = None  # embed: sizes a request may truncate to (`dimensions`)
    lora: LoraConfig | None = None  # compile --enable-lora: graphs that take LoRA adapters (neuron_opt.lora)
    # a vision-language model's encoder bucket sizes (tiles or patches: neuron_opt.multimodal.compiled); None: the
    # defaults up to the largest image its processor makes
    encoder_buckets: tuple[int, ...] | None = None


DRAFT_DIR = "draft"  # where a draft model's artifact lies inside its target's


def draft_request(req: CompileRequest, cache_cfg: CacheConfig, buckets: BucketConfig, out: Path) -> CompileRequest:
    """The draft model's compile: the target's backend, dtype, options and cache use; a KV slot for each sequence
    the target runs, its max_model_len and its prefill and decode buckets; one rank; no verify graphs, no
    quantization."""
    return CompileRequest(
        model=req.speculative_model or "", out=out, backend=req.backend, dtype=req.dtype,
        batch_size=cache_cfg.max_batch, max_prompt_len=buckets.prefill_lens[-1], max_model_len=cache_cfg.max_model_len,
        prefill_buckets=tuple(buckets.prefill_lens), decode_buckets=tuple(buckets.decode_kv_lens),
        decode_batches=tuple(buckets.decode_batches),
        backend_options=req.backend_options, cache_dir=req.cache_dir, use_cache=req.use_cache,
        block_size=req.block_size, offset_prefill=req.offset_prefill, prefill_batch=req.prefill_batch,
        sign_key=req.sign_key)  # signed on its own too: it is loaded as an artifact of its own


def check_draft_request(req: CompileRequest, tokenizer: Any) -> None:
    """Refuse a draft model the target (whose tokenizer is given) could not use, before any long work."""
    if not req.speculative_model:
        return
    if req.num_speculative_tokens < 1:
        raise ConfigError("--speculative-model: the target needs verify graphs for the draft's proposals; add "
                          "--num-speculative-tokens K", param="speculative_model")
    if backend_class(req.backend).spmd and req.parallel.tp > 1:
        raise ConfigError(f"--speculative-model: a draft beside a tp > 1 {req.backend} program is not supported yet "
                          "(one process runs one SPMD device set); compile the draft separately and run it eagerly, "
                          "or use --speculative-method ngram", param="speculative_model")
    check_draft_tokenizer(open_checkpoint(req.speculative_model).tokenizer(), tokenizer, req.speculative_model)


@dataclass
class CompileReport:
    manifest: Manifest
    hits: list[str]
    misses: dict[str, str]  # bucket key -> why it missed
    seconds: float


def check_embed_request(cfg: ModelConfig, req: CompileRequest) -> None:
    """Refuse what an embedding model's compile cannot hold: it runs prompts from position 0 and pools them, so
    it has no decode, verify or offset prefill graphs, no draft, no LM head and no KV cache beyond a prompt's."""
    if not cfg.is_embedding:
        return
    refused = {"decode_buckets": req.decode_buckets, "decode_batches": req.decode_batches,
               "num_speculative_tokens": req.num_speculative_tokens, "speculative_model": req.speculative_model,
               "offset_prefill": req.offset_prefill, "quantize_lm_head": req.quantize_lm_head,
               "kv_cache_dtype": KVCacheDtype.parse(req.kv_cache_dtype) is KVCacheDtype.FP8}
    for name, value in refused.items():
        if value:
            raise ConfigError(f"{name}: an embedding model (--task embed) compiles prefill graphs with a pooling "
                              "step only; drop the option", param=name)
    if req.max_model_len and req.max_prompt_len and req.max_model_len != req.max_prompt_len:
        raise ConfigError(f"max_model_len: an embedding model holds its input only, so max_model_len is the longest "
                          f"input; got --max-model-len {req.max_model_len} and --max-prompt-len "
                          f"{req.max_prompt_len}; give one", param="max_model_len")


def plan_buckets(cfg: ModelConfig, req: CompileRequest) -> tuple[CacheConfig, BucketConfig]:
    if cfg.is_embedding:  # prefill graphs only, the KV cache one input long (check_embed_request)
        length = req.max_prompt_len or req.max_model_len or min(cfg.max_position_embeddings, 2048)
        req = dataclasses.replace(req, max_prompt_len=length, max_model_len=length, offset_prefill=False)
    # the largest decode bucket is the sequence length when only the buckets are given
    max_model_len = req.max_model_len or (max(req.decode_buckets) if req.decode_buckets
                                          else min(cfg.max_position_embeddings, 2048))
    max_prompt_len = req.max_prompt_len or max_model_len
    if max_model_len > cfg.max_model_len_limit:
        raise ConfigError(f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings="
                          f"{cfg.max_position_embeddings}" + (f" x its dynamic rope factor ({cfg.max_model_len_limit})"
                                                              if cfg.max_model_len_limit != cfg.max_position_embeddings
                                                              else ""))
    backend = backend_class(req.backend)
    offset_prefill = backend.resolve_offset_prefill(req.backend_options, req.offset_prefill)
    if not (req.max_prompt_len or req.prefill_buckets) and backend.window_kv and offset_prefill:
        # sliding-window layers: prefill chunks of the window by default, so those layers hold window-sized KV
        # (planner.memory.window_prompt_len: the rule and its reason); an explicit prompt length or bucket list wins
        max_prompt_len = window_prompt_len(cfg, max_model_len, req.block_size, req.num_speculative_tokens + 1
                                           if req.num_speculative_tokens else 0) or max_prompt_len
    kv_cache_dtype = KVCacheDtype.parse(req.kv_cache_dtype)
    backend.check_kv_cache_dtype(req.backend_options, kv_cache_dtype)
    if kv_cache_dtype is KVCacheDtype.FP8 and cfg.qk_norm:
        raise ConfigError(f"kv_cache_dtype: fp8 scales are folded into q_proj/k_proj, and {cfg.architecture}'s "
                          "q/k RMSNorm after them would undo the fold (K would reach the cache unscaled); compile "
                          "without --kv-cache-dtype fp8")
    buckets = BucketConfig.build(max_prompt_len=max_prompt_len, max_model_len=max_model_len,
                                 max_batch=req.batch_size, prefill_lens=req.prefill_buckets,
                                 decode_kv_lens=req.decode_buckets, decode_batches=req.decode_batches,
                                 num_speculative_tokens=req.num_speculative_tokens,
                                 offset_prefill=offset_prefill, prefill_batch=req.prefill_batch,
                                 prefill_only=cfg.is_embedding)
    # window-sized KV where the backend holds it (planner.memory.kv_window says where it applies)
    window = kv_window(cfg, buckets, req.block_size, max_model_len) if backend.window_kv else (0, 0)
    cache = CacheConfig(max_batch=req.batch_size, max_model_len=max_model_len,
                        dtype=kv_cache_dtype.storage(req.dtype or "float32"),
                        block_size=req.block_size, num_blocks=req.num_kv_blocks, sliding_window=window[0],
                        window_blocks_per_sequence=window[1])
    return cache, buckets


def format_plan(cfg: ModelConfig, par: ParallelConfig, cache: CacheConfig, buckets: BucketConfig,
                backend: str, dtype: str, timings_dir: Path | None = None) -> str:
    """The planner's table (memory per rank, fit, buckets) plus the graph count and compile-time estimate."""
    cls = backend_class(backend)
    graphs = buckets.buckets()
    n = cls.distinct_graphs(buckets)
    target = cls.compile_target()
    measured = measured_seconds_per_graph(timings_dir, target) if timings_dir is not None else None
    per_unit = measured if measured is not None else cls.est_seconds_per_graph
    est = per_unit * _graph_units(cfg, buckets, backend, par.tp)
    source = (f"measured on this machine: {per_unit:.1f} s per 30-layer graph" if measured is not None else
              "not yet measured on this machine (the first cold compile measures it)")
    return "\n".join([
        format_plan_table(cfg, par, cache, buckets, instance=cls.plan_instance(par), dtype=dtype,
                          compile_ranks_held=len(cls.compile_units(par.tp)[0].ranks)),
        f"  backend {backend}: {len(graphs)} bucket(s), {n} distinct graph(s) per rank x {par.tp} rank(s); "
        f"estimated compile time with a cold cache: {est / 60:.1f} min ({source})",
    ])


def compile_artifact(req: CompileRequest, log: Callable[[str], None] = print, progress: bool = True) -> CompileReport:
    t0 = time.perf_counter()
    check_out_dir(req.out, req.force)  # before any long work
    signing_key = load_signing_key(req.sign_key) if req.sign_key is not None else None
    backend_cls = backend_class(req.backend)
    backend_cls.check_parallel(req.parallel)  # flash decoding is checked once the head layout is known
    if Path(req.model).is_dir():  # a local vision-language checkpoint is checked before a device runtime starts
        check_vision_request(req, is_multimodal(req.model))
    backend_cls.prepare(req.parallel.tp, for_compile=True)  # before anything (transformers too) loads a runtime
    hub = resolve_request(req)
    req = dataclasses.replace(req, model=hub.model, speculative_model=hub.speculative_model, revision=None,
                              gguf_file=None)
    # a vision-language checkpoint: its text decoder compiles as any decoder, its encoder per image-size bucket
    ckpt = open_vision_language(Path(req.model)) if is_multimodal(req.model) else open_checkpoint(req.model)
    vlm = isinstance(ckpt, VisionLanguageCheckpoint)
    check_vision_request(req, vlm)
    if vlm:
        check_compilable(ckpt.mm.vision)
        if ckpt.mm.vision.bidirectional and not backend_cls.bidirectional_blocks:
            raise ConfigError(f"backend: {ckpt.mm.vision.architecture}'s decoder attends bidirectionally within each "
                              f"image, which the {req.backend} backend's graphs do not take yet; compile it with "
                              "--backend eager", param="backend")
    cfg = resolve_task(ckpt.config, req.task, req.pooling, req.normalize, req.matryoshka_dims)
    ckpt = dataclasses.replace(ckpt, config=cfg)  # its weight names follow the task (an embedding model: no head)
    check_embed_request(cfg, req)
    tokenizer = ckpt.tokenizer()
    check_draft_request(req, tokenizer)
    dtype_name = req.dtype or default_dtype(req.backend)
    req = CompileRequest(**{**asdict(req), "dtype": dtype_name, "parallel": req.parallel, "lora": req.lora})
    cache_cfg, buckets = plan_buckets(cfg, req)
    par = req.parallel
    timings_dir = req.cache_dir or envs.CACHE_DIR / "compile"
    qc, stored = resolve_quant(req, ckpt)
    if cfg.is_embedding and qc.lm_head:  # `--quantize auto` of a GGUF whose head is quantized: no head here
        qc = dataclasses.replace(qc, lm_head=False)
    check_lora_request(req, cfg)
    # GGUF blocks as stored take at most about a byte a weight (Q8_0: 34 per 32): the plan counts them as int8
    plan_dtype = "int8" if qc.method == "gguf" else qc.method or dtype_name
    kv_dtype = cache_cfg.kv_cache_dtype.value if cache_cfg.kv_cache_dtype is KVCacheDtype.FP8 else cache_cfg.dtype
    par, flash_why = resolve_flash_decoding(cfg, par, cache_cfg.num_blocks, cache_cfg.block_size, plan_dtype,
                                            kv_dtype, lora=req.lora is not None)
    req = dataclasses.replace(req, parallel=par)
    log(format_plan(cfg, par, cache_cfg, buckets, req.backend, plan_dtype, timings_dir))
    encoder_sizes_: tuple[int, ...] = ()
    if vlm:
        vp = checkpoint_vision_plan(ckpt.source, plan_dtype)
        encoder_sizes_ = encoder_sizes(vp.max_units, vp.unit_step, req.encoder_buckets)
        log("\n".join(vision_lines(vp, encoder_sizes_)))
    if flash_why:
        log(f"  {flash_why}")
    if cfg.is_embedding:
        log(f"  {describe_task(cfg)}")
    dtype = torch_dtype(dtype_name)
    lay = head_layout(cfg, par)
    backend_cls.check_parallel(par, lay.kv_seq_shards)  # before any device model: a layout error is a config error
    check_cp_heads(cfg, lay, qc, req.lora is not None)
    backend = get_backend(req.backend, dtype, req.backend_options, for_compile=True, tp=par.tp)
    cache = CompileCache(req.cache_dir or envs.CACHE_DIR / "compile") if req.use_cache else None
    fingerprint = ckpt.weights_fingerprint()
    code = code_fingerprint()
    writer = ArtifactWriter(req.out, req.force, signing_key)
    hits: list[str] = []
    misses: dict[str, str] = {}
    graphs: dict[str, list[str]] = {}
    compile_seconds: list[float] = []

    def key_for(bucket: Bucket, rank: int | str) -> CacheKey:
        return CacheKey({
            # no weights: no backend's graphs hold them (cpu binds them at load, neuron passes them as
            # parameters), so a fine-tuned checkpoint of the same architecture reuses every graph. The weights'
            # hash is in the manifest (`source.weights_sha256`).
            "model": cfg.to_dict(), "parallel": asdict(par),
            "cache": asdict(cache_cfg), "bucket": bucket.key, "rank": rank, "backend": req.backend,
            "backend_options": req.backend_options, "dtype": dtype_name, "versions": versions(),
            "code": code, "quant": asdict(qc),
            **({"lora": req.lora.to_dict()} if req.lora is not None else {}),
        })

    def canonical() -> Any:
        """The checkpoint's tensors one at a time: GGUF int4 linears as stored when kept, else floats."""
        if stored:
            return stored_tensors(ckpt, dtype, qc)
        return ckpt.tensors(dtype)

    kv_scales = None
    if cache_cfg.kv_cache_dtype is KVCacheDtype.FP8:
        kv_scales = _calibrate_kv(cfg, cache_cfg, dtype, qc, canonical(), tokenizer, ckpt.source)
        log(f"  fp8 KV cache: per-layer scales calibrated on {len(tokenizer.encode(CALIBRATION_TEXT))} tokens "
            f"(K {min(kv_scales[0]):.3g}..{max(kv_scales[0]):.3g}, V {min(kv_scales[1]):.3g}.."
            f"{max(kv_scales[1]):.3g}), folded into q/k/v/o")

    def build_rank(rank: int, comm: Any) -> torch.nn.Module:
        """The rank's model in `dtype`, its weights streamed from the checkpoint one tensor at a time (host RAM:
        this rank's weights plus one tensor in flight, never the checkpoint; planner.memory.plan_memory).
        Quantized layers quantize each tensor as it arrives; fp8 KV scales are folded in first (quant.kv)."""
        pctx = None if comm is None else ParallelContext(par.tp, rank, comm, par.sequence_parallel)
        model = rank_model_factory(cfg, par, cache_cfg, rank, dtype, pctx, quant=qc, lora=req.lora)()
        tensors = canonical() if kv_scales is None else fold(canonical(), *kv_scales)
        shards = (pair for name, t in tensors  # GGUF blocks kept as stored: tp 1 only (resolve_quant)
                  for pair in ([(name, t)] if isinstance(t, QuantTensor) else rank_shards(name, t, cfg, lay, rank)))
        load_weights_streamed(model, shards, f"{ckpt.source} (rank {rank} shard)")
        backend.check_model(model)
        return model

    # a backend whose graphs hold the collectives builds every rank into one SPMD program (one unit, the ranks
    # built with its collectives); the others compile rank by rank (one rank's graphs may share files)
    units = backend.compile_units(par.tp)
    comm = backend.rank_collectives(par.tp, lay.kv_seq_shards)
    try:
        for unit in units:
            models = [build_rank(r, comm) for r in unit.ranks]
            for r, model in zip(unit.ranks, models, strict=True):  # saved first: a device program takes host weights
                backend.save_weights(model, writer.path(f"weights/rank{r}.safetensors"))
            desc = f"compile tp={par.tp} (SPMD)" if len(unit.ranks) > 1 else f"compile rank {unit.key}"
            bar = tqdm(buckets.buckets(), desc=desc, unit="graph", disable=not progress)
            for bucket in bar:
                bar.set_postfix_str(bucket.key)
                files = _compile_one(backend, models, bucket, cache_cfg, key_for(bucket, unit.key), cache,
                                     writer.path(unit.graph_dir), hits, misses, compile_seconds)
                graphs.setdefault(bucket.key, []).extend(f"{unit.graph_dir}/{f}" for f in files)
            del models, model  # before the next unit builds its models
        vision = None
        if vlm:  # replicated: one set of encoder graphs whatever the tp (neuron_opt.multimodal.compiled)
            key_fields = {"backend": req.backend, "backend_options": req.backend_options, "dtype": dtype_name,
                          "versions": versions(), "code": code}
            vision = compile_encoders(ckpt.mm.vision, ckpt.source, encoder_sizes_, backend, dtype, writer.path(""),
                                      cache, key_fields, hits, misses, progress)
        backend.finish_compile()
        if not hits and misses and backend.compiles_graphs:  # a cold compile: this machine's speed, for the plan
            record_compile_speed(timings_dir, backend_cls.compile_target(),
                                 sum(compile_seconds) / _graph_units(cfg, buckets, req.backend, par.tp))
        tokenizer.save_pretrained(writer.path("tokenizer"))
        if req.speculative_model:  # inside this artifact before it commits: both land, or neither
            log(f"draft model {req.speculative_model} -> {DRAFT_DIR}/")
            sub = compile_artifact(draft_request(req, cache_cfg, buckets, writer.path(DRAFT_DIR)), log, progress)
            hits += [f"{DRAFT_DIR}/{h}" for h in sub.hits]
            misses.update({f"{DRAFT_DIR}/{k}": v for k, v in sub.misses.items()})
        manifest = writer.commit(dict(
            model=cfg, parallel=par, cache=cache_cfg, buckets=buckets, backend=req.backend, dtype=dtype_name,
            backend_options=req.backend_options, graphs=graphs, quant=qc,
            source={"model": str(ckpt.source), "format": ckpt.format, "weights_sha256": fingerprint,
                    **({"hub": hub.source} if hub.source is not None else {})},
            draft=DRAFT_DIR if req.speculative_model else None, lora=req.lora, vision=vision))
    except BaseException:
        writer.abort()
        raise
    return CompileReport(manifest, hits, misses, time.perf_counter() - t0)


@dataclass(frozen=True)
class ResolvedModels:
    model: str  # the local path of the model
    speculative_model: str | None  # the draft's, or None
    source: dict[str, str] | None  # the Hub id, revision and commit the model came from (None: a local path)


def resolve_request(req: CompileRequest) -> ResolvedModels:
    """The request's model and draft as local paths: Hub ids fetched into the Hub cache (neuron_opt.hub; the draft
    from its repo's main revision), local paths as given."""
    model = resolve_model(req.model, revision=req.revision, gguf_file=req.gguf_file)
    draft = (resolve_model(req.speculative_model, param="speculative_model") if req.speculative_model else
             req.speculative_model)
    return ResolvedModels(model, draft, hub_source(req.model, req.revision, model))


def check_cp_heads(cfg: Any, lay: Any, qc: QuantConfig, lora: bool) -> None:
    """Context-parallel prefill with whole KV heads per rank gathers the float q and o weights in its graphs
    (models/llama.py, Attention): refused with LoRA capacity or quantized attention weights (ConfigError)."""
    if not lay.cp_heads:
        return
    quantized = qc.enabled and any(qc.converts(f"model.layers.{i}.self_attn.{p}") for i in
                                   range(cfg.num_hidden_layers) for p in ("q_proj", "o_proj"))
    if lora or quantized:
        raise ConfigError(f"cp_degree: context-parallel prefill with whole KV heads per rank gathers the float q "
                          f"and o weights of every rank in its graphs; it takes "
                          f"{'no LoRA adapters (--enable-lora)' if lora else 'no quantized q/o weights'}: "
                          f"use --cp-degree 1", param="cp_degree")


def check_vision_request(req: CompileRequest, vlm: bool) -> None:
    """A vision-language model compiles for generation on backends that build encoder graphs; `--encoder-buckets`
    only for one (ConfigError otherwise, before any long work)."""
    if not vlm:
        if req.encoder_buckets:
            raise ConfigError("encoder_buckets: only a vision-language model has an encoder to compile",
                              param="encoder_buckets")
        return
    if not backend_class(req.backend).compiles_encoders:
        raise ConfigError(f"backend: vision-language models compile for the cpu and eager backends; the "
                          f"{req.backend} backend does not build vision encoder graphs yet", param="backend")
    check_vision_parallel(req.parallel)
    if req.task == "embed":
        raise ConfigError("task: vision-language models compile for generation; an embedding model's pooling over "
                          "image embeddings is not built", param="task")


def check_lora_request(req: CompileRequest, cfg: Any) -> None:
    """`--enable-lora` needs a backend whose graphs take adapters and a dense model (ConfigError otherwise)."""
    if req.lora is None:
        return
    if not backend_class(req.backend).supports_lora:
        raise ConfigError(f"enable_lora: the {req.backend} backend does not take LoRA adapters yet; use --backend "
                          "cpu or eager", param="enable_lora")
    if cfg.is_moe:
        raise ConfigError(f"enable_lora: LoRA adapters are served on dense models only, not on {cfg.architecture}",
                          param="enable_lora")


def resolve_quant(req: CompileRequest, ckpt: Any) -> tuple[QuantConfig, bool]:
    """(the QuantConfig `req` asks for, whether a GGUF's int4 linears are kept as stored).

    `--quantize auto` takes the checkpoint's own precision class (neuron_opt.checkpoint.native_quant): a Q4_0/Q4_1
    GGUF keeps its blocks as they are, a Q8_0 one becomes per-channel int8, anything else stays unquantized. An
    explicit method quantizes the float weights at compile time; so does int4 with another group size or type
    than the file's. Stored blocks are per output channel, so any tp could shard them; compile keeps them only at
    tp=1 (at tp>1 the float weights are sharded and quantized per rank)."""
    if req.quantize is None:
        if req.modules_to_not_convert or req.quantization_type or req.group_size or req.quantize_lm_head:
            raise ConfigError("quantization_type/group_size/modules_to_not_convert/quantize_lm_head: need --quantize")
        return QuantConfig(), False
    if ckpt.config.is_moe and req.quantize != "auto":
        raise ConfigError(f"quantize: {req.quantize} is not built for mixture-of-experts models yet (the stacked "
                          f"experts have no quantized layout); compile {ckpt.config.architecture} without --quantize")
    native = native_quant(ckpt)
    if native.method == "gguf" and (req.parallel.tp > 1 or not backend_class(req.backend).gguf_blocks):
        # K-quant blocks run as stored on backends with their kernels at tp=1; elsewhere int8, as converted
        native = QuantConfig("int8", "per_channel_symmetric", 0, lm_head=native.lm_head)
    if req.quantize == "auto":
        if req.quantization_type or req.group_size:
            raise ConfigError("quantize auto: takes the checkpoint's own format; drop --quantization-type and "
                              "--group-size, or name a method")
        head = native.lm_head if req.quantize_lm_head is None else req.quantize_lm_head
        qc = dataclasses.replace(native, modules_to_not_convert=tuple(req.modules_to_not_convert), lm_head=head) \
            if native.enabled else native
        if req.modules_to_not_convert and not native.enabled:
            raise ConfigError(f"quantize auto: {ckpt.source} is not quantized; modules_to_not_convert needs a method")
    else:
        qc = QuantConfig(req.quantize, req.quantization_type, req.group_size, tuple(req.modules_to_not_convert),
                         lm_head=bool(req.quantize_lm_head))
    backend_class(req.backend).check_quant(qc)
    keep = (native.source == "gguf" and qc.method == native.method and qc.group_size == native.group_size
            and qc.quantization_type == native.quantization_type and req.parallel.tp == 1)
    return (dataclasses.replace(qc, source="gguf" if keep else ""), keep)


def _calibrate_kv(cfg: ModelConfig, cache_cfg: CacheConfig, dtype: torch.dtype, qc: QuantConfig, tensors: Any,
                  tokenizer: Any, source: Any) -> tuple[list[float], list[float]]:
    """Per-layer fp8 KV scales from the tp=1 model as it will run (quantized if asked), in `dtype`."""
    calib_cache = dataclasses.replace(cache_cfg, dtype=str(dtype).removeprefix("torch."), max_batch=1,
                                      num_blocks=0)
    model = rank_model_factory(cfg, ParallelConfig(), calib_cache, 0, dtype, quant=qc)()
    load_weights_streamed(model, tensors, f"{source} (fp8 KV calibration)")
    # modulo: only test checkpoints have a vocabulary smaller than their tokenizer's
    ids = [i % cfg.vocab_size for i in tokenizer.encode(CALIBRATION_TEXT)[: cache_cfg.max_model_len]]
    return calibrate(model, ids, cache_cfg.block_size)


def _compile_one(backend: Backend, models: list[torch.nn.Module], bucket: Bucket,
                 cache_cfg: CacheConfig, key: CacheKey, cache: CompileCache | None, out_dir: Path,
                 hits: list[str], misses: dict[str, str], seconds: list[float]) -> list[str]:
    label = f"{bucket.key}/rank{key.fields['rank']}" if key.fields["rank"] != "spmd" else f"{bucket.key}/spmd"
    cached = cache.fetch(key, out_dir) if cache is not None else None  # verified copies (sha256 at store)
    if cached is not None:
        hits.append(label)
        return [str(f) for f in cached]
    misses[label] = cache.explain_miss(key) if cache is not None else "cache disabled"
    t0 = time.perf_counter()
    files = [Path(f) for f in backend.compile_unit(models, bucket, cache_cfg, out_dir)]
    seconds.append(time.perf_counter() - t0)
    if cache is not None and files:
        cache.store(key, out_dir, files)
    return [str(f) for f in files]
