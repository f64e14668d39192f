"""CPU backend: AOTInductor graphs with the C++ GEMM template, weights stored and held once.

How it fits together (measurements and rejected alternatives: docs/cpu_backend.md)
- compile: per bucket, one decoder-layer graph (shared by every bucket of the same phase and batch: the KV
  length is dynamic) and one LM-head graph per batch, each a weight-free .so plus a JSON recipe saying how to
  build every graph constant from the checkpoint (cpu_constants.py). Graphs shared between buckets are
  compiled once per backend instance and listed under each bucket that uses them.
- load: read the weights once, pack each GEMM weight once into the C++ template's blocked layout, and bind the
  same tensors into every graph (30 containers per layer graph, one per layer). The eager model is dropped
  afterwards, so the process holds the packed weights, norms and the embedding table, once.
- run: embedding lookup and rope gather in eager torch (a few small ops), then the 30 layer containers, then
  the head. The executor owns the KV block pools; every graph writes them in place (tested step by step against
  eager, cf. pytorch#165444).
Reference path: the eager backend (same model code); tests compare the two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from models.llama import (
    deepstack_rows,
    layer_rope_inputs,
    merge_embeddings,
    model_rope_tables,
    mrope_rows,
    window_input,
)
from models.moe import Experts
from neuron_opt.backends.base import Backend, ModelFactory, StepInputs, allocate_kv
from neuron_opt.backends.cpu import encoder as cpu_encoder
from neuron_opt.backends.cpu import ops as cpu_ops
from neuron_opt.backends.cpu.constants import ConstantRecipe, build_constant
from neuron_opt.backends.cpu.graphs import (
    PREFILL_SPLIT_STEP,
    HeadGraph,
    LayerGraph,
    PoolGraph,
    compile_graph,
    graph_keys,
    has_capped_score_gemm,
    has_moe_block,
    head_rows,
    layer_example,
    op_calls_file,
    pool_example,
    static_tokens,
    use_cpu_layout,
)
from neuron_opt.backends.cpu.weights import check_uniform_layers
from neuron_opt.buckets import DECODE, PREFILL, VERIFY, Bucket
from neuron_opt.config import CacheConfig
from neuron_opt.errors import ArtifactError, BackendCompileError, BucketOverflowError, ConfigError
from neuron_opt.lora.adapter import load_into_slot
from neuron_opt.lora.ops import stacks_for
from neuron_opt.quant.weights import quantized_modules
from neuron_opt.weights import load_model_weights, model_state_for_save

# 2: recipes name several sources (fused projections), heads may take their weight as an input; 3: max_model_len;
# 4: block KV cache (slot mapping and block tables); 6: no head takes its weight as an input (bf16 heads are C++
# template GEMMs with fp32 logits), tied embeddings may read a VNNI-packed head; 7: a graph's metadata is
# `<key>.meta.json`, and `<key>.json` lists its calls to our C++ operators (AOTInductor's proxy executor reads it)
FORMAT = 7
META_SUFFIX = ".meta.json"
GEMM_CHOICES = ("cpp", "onednn", "aten")
PRECISION_CHOICES = ("fp32", "dtype")
DECODE_ATTENTION_CHOICES = ("kernel", "fused", "sdpa")
PREFILL_ATTENTION_PARTS = 4  # PrefillAttention's parts: 4 and 8 measured even at 1,504 tokens, 2 slower
ONEDNN_SHARED_BATCH = 1  # the M hint of every oneDNN-packed weight (see _WeightStore)
SUBDIR = "cpu"


def _parse_options(options: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
    """Known options, defaults: the fastest measured for the dtype.

    gemm: see cpu_graphs.inductor_options. attention: "fp32" (fp32 rope tables: rope and attention in fp32)
    or "dtype" (the model's dtype, the reference). residual: "fp32" (the residual stream between layers and the
    norms on it) or "dtype". logits: "fp32" (heads compute fp32 logits from the weights in `dtype` on the C++
    GEMM template, cpu_graphs.HeadGraph) or "dtype" (the `gemm` kernel's output, rounded to `dtype`). These three
    only matter for dtypes below fp32.
    decode_attention: "kernel" (torch.ops.neuron_opt.paged_attention, C++ built at first use: cpu_ops; the default
    where it builds, with a warning and "fused" where it does not), "fused" (cpu_graphs.DecodeAttention's Inductor
    loop nest) or "sdpa" (aten's flash attention, as prefill). Against "fused" (docs/cpu_backend.md, "Paged
    attention kernel"): verify steps and batched decode faster; batch-1 decode about even, slightly slower only
    at short contexts in fp32 and MoE graphs.
    int8_linear: "kernel" (int8 weight-only products of up to weights.INT8_KERNEL_MAX_ROWS rows on
    torch.ops.neuron_opt.int8_linear, cpu_ops; the default where it builds, else "inductor") or "inductor" (one
    row: a dot-product loop Inductor fuses into the layer; more rows: aten._weight_int8pack_mm). Measured in place
    (docs/quantization.md): see there.
    int8_gemm: int8 weight-only products of more rows than `int8_linear`'s (prefills): "widened"
    (torch.ops.neuron_opt.int8_linear_widened, cpu_ops: the weight widened to bf16 once per call, one bf16 GEMM
    over every row; the default where the operators build and the CPU has native bf16) or "aten"
    (aten._weight_int8pack_mm, which widens the weight for each row: 2-3x slower at 160 to 1,500 rows on an
    AVX-512 bf16 CPU, docs/quantization.md; the default elsewhere, where a bf16 GEMM is emulated).
    moe_gather: "kernel" (a sparse MoE block's selected experts, in graphs with a static token count, on
    torch.ops.neuron_opt.moe_gather, cpu_ops; the default where it builds, else "inductor") or "inductor" (the
    broadcast-and-sum loop of models.moe.Experts.gather, fused by Inductor). Measured in docs/moe.md.
    fuse_projections: "on" (q/k/v and gate/up as one GEMM each, see cpu_graphs.inductor_options) or "off".
    one_row_gemm: the gemm of layer graphs whose GEMMs have one row (batch-1 decode, one-token prefill); "same"
    (as `gemm`; the default below bf16's and where the operators do not build), "kernel" (bf16 only: those GEMMs
    on torch.ops.neuron_opt.bf16_linear, cpu_ops, the weights as held; bf16's default where the operators build)
    or a gemm choice (the executor then holds the layer weights in two packings; docs/cpu_backend.md).
    head_gemm: the GEMM of heads with fp32 logits below fp32 (`logits` "fp32"): "cpp" (Inductor's C++ template)
    or "kernel" (bf16 only: torch.ops.neuron_opt.bf16_linear on the head weight as held; bf16's default where the
    operators build and `logits` is "fp32").
    gguf_linear: products of up to weights.INT8_KERNEL_MAX_ROWS rows on GGUF blocks as stored: "q8" (x rounded to
    llama.cpp's 8-bit activation blocks, integer dot products: torch.ops.neuron_opt.gguf_linear, llama.cpp's
    arithmetic) or "exact" (x fp32: gguf_linear_exact, the reference; docs/quantization.md).
    prefill_attention: attention of prefill layer graphs (any batch): "split" (graphs.PrefillAttention: each
    row's queries in PREFILL_ATTENTION_PARTS parts, each over the keys its last query sees, so most of the masked
    causal half is not computed) or "whole" (one SDPA over every key, the reference).
    exact_verify: "on" (verify graphs compute each row as the decode graph of their batch does: its GEMM choice,
    DecodeAttention per query; the fp32-logits head either way; verify logits are then bitwise the decode step's)
    or "off" (SDPA over the queries, `gemm`: cheaper, close but not equal below fp32). With
    decode_attention "sdpa" both graphs attend with SDPA, whose CPU kernel is not shown to be the same at 1 and
    k + 1 queries; the GEMMs and the head still follow the decode step's.
    """
    opts = {"gemm": "onednn" if dtype == torch.bfloat16 else "cpp", "attention": "fp32", "residual": "fp32",
            "decode_attention": "fused", "logits": "fp32", "fuse_projections": "on",
            "one_row_gemm": "same", "head_gemm": "cpp", "exact_verify": "on", "prefill_attention": "split",
            "gguf_linear": "q8"}
    choices = {"gemm": GEMM_CHOICES, "attention": PRECISION_CHOICES, "residual": PRECISION_CHOICES,
               "decode_attention": DECODE_ATTENTION_CHOICES, "logits": PRECISION_CHOICES,
               "fuse_projections": ("on", "off"), "one_row_gemm": ("same", "kernel", *GEMM_CHOICES),
               "head_gemm": ("cpp", "kernel"),
               "exact_verify": ("on", "off"), "int8_linear": ("kernel", "inductor"), "int8_gemm": ("widened", "aten"),
               "moe_gather": ("kernel", "inductor"), "prefill_attention": ("split", "whole"),
               "gguf_linear": ("q8", "exact")}
    for name, fallback in (("decode_attention", "fused"), ("int8_linear", "inductor"), ("moe_gather", "inductor")):
        if name not in (options or {}):
            opts[name] = "kernel" if cpu_ops.load() is None else fallback
    if "int8_gemm" not in (options or {}):
        opts["int8_gemm"] = "widened" if cpu_ops.load() is None and cpu_has_native_bf16() else "aten"
    if dtype == torch.bfloat16 and cpu_ops.load() is None:  # bf16_linear where it builds (docs/cpu_backend.md)
        if "one_row_gemm" not in (options or {}):
            opts["one_row_gemm"] = "kernel"
        if "head_gemm" not in (options or {}) and (options or {}).get("logits", "fp32") == "fp32":
            opts["head_gemm"] = "kernel"
    for k, v in (options or {}).items():
        if k not in choices:
            raise ConfigError(f"backend options: unknown cpu option {k!r}; known: {sorted(choices)}")
        if v not in choices[k]:
            raise ConfigError(f"backend options: {k} must be one of {choices[k]}, got {v!r}")
        opts[k] = v
    if opts["one_row_gemm"] == "kernel" and dtype != torch.bfloat16:
        raise ConfigError(f"backend options: one_row_gemm=kernel computes bf16 weights only (the C++ operator "
                          f"bf16_linear); this artifact's dtype is {str(dtype).removeprefix('torch.')}: use "
                          "one_row_gemm=same or a gemm choice")
    if opts["head_gemm"] == "kernel" and dtype != torch.bfloat16:
        raise ConfigError(f"backend options: head_gemm=kernel computes bf16 weights only (the C++ operator "
                          f"bf16_linear); this artifact's dtype is {str(dtype).removeprefix('torch.')}: use "
                          "head_gemm=cpp")
    if opts["head_gemm"] == "kernel" and opts["logits"] != "fp32":
        raise ConfigError("backend options: head_gemm=kernel computes fp32 logits; logits=dtype takes the `gemm` "
                          "kernel's rounded logits instead: drop one of the two")
    return opts


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU (avx512bw/vl/dq, or avx_ne_convert): torch's own check, the one
    Inductor uses to pick its bf16 lowering. Without it the bf16 weights cannot be packed for oneDNN at all
    ('mkldnn_reorder_linear_weight: bf16 path needs ...') and Inductor folds them into per-graph constants."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_dtype_supported(dtype: torch.dtype) -> None:
    """The cpu backend's bf16 graphs need oneDNN bf16; refuse them clearly on CPUs without it (AVX2-only)."""
    if dtype == torch.bfloat16 and not onednn_bf16_supported():
        raise ConfigError(
            "dtype: bfloat16 on the cpu backend needs a CPU on which oneDNN runs bf16 (AVX-512 BW/VL/DQ or "
            "AVX-NE-CONVERT); this CPU has neither, so its bf16 graphs could not share packed weights. Use "
            "--dtype float32 (the default on this CPU), or --backend eager for bf16 without compiled graphs")


def check_tp(tp: int) -> None:
    """cpu graphs are single-rank (tp > 1 runs as gloo ranks: eager)."""
    if tp != 1:
        raise ConfigError(f"backend: the cpu backend compiles tp=1 only, got --tp {tp}; use --backend eager (gloo "
                          "rank processes) or --backend neuron (one SPMD program) for tp > 1")


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def has_int8(module: torch.nn.Module) -> bool:
    return any(m.method == "int8" for m in quantized_modules(module).values())


def has_gguf(module: torch.nn.Module) -> bool:
    """Whether `module` holds GGUF blocks as stored (its graphs call cpu_ops' gguf_linear operators)."""
    return any(m.method == "gguf" for m in quantized_modules(module).values())


class CpuBackend(Backend):
    name = "cpu"
    # measured on a 2-core AVX-512 machine (SmolLM2-135M, docs/cpu_backend.md)
    est_seconds_per_graph = 15.0
    supports_lora = True
    window_kv = True
    gguf_blocks = True  # on cpu_ops' gguf_linear operators
    compiles_encoders = True  # vision encoder buckets (neuron_opt.multimodal.compiled)

    @classmethod
    def default_dtype(cls) -> str:
        return "bfloat16" if cpu_has_native_bf16() else "float32"

    @classmethod
    def check_parallel(cls, par: Any, kv_seq_shards: int = 1) -> None:
        check_tp(par.tp)

    @classmethod
    def check_quant(cls, quant: Any) -> None:
        if quant.method == "fp8":
            raise ConfigError("quantize: fp8 weights have no CPU kernel; use --quantize int8 or int4 on the cpu "
                              "backend (fp8 is a device format: --backend neuron, or eager for a reference)")

    @classmethod
    def distinct_graphs(cls, buckets: Any) -> int:
        """One dynamic-KV layer graph per (phase, batch, q_len) and one LM-head graph per row count (verify
        buckets a head of their own)."""
        return len({k for b in buckets.buckets() for k in graph_keys(b)})

    def check_model(self, model: torch.nn.Module) -> None:
        check_uniform_layers(model)

    def __init__(self, dtype: torch.dtype, options: dict[str, Any] | None = None) -> None:
        check_dtype_supported(dtype)
        self.dtype = dtype
        self.options = _parse_options(options, dtype)
        self._done: dict[tuple[int, Path, str], list[Path]] = {}  # graphs compiled by this instance
        self.residual_dtype = torch.float32 if self.options["residual"] == "fp32" else dtype
        self.rope_dtype = torch.float32 if self.options["attention"] == "fp32" else dtype

    def compile_bucket(self, model: torch.nn.Module, bucket: Bucket, cache: CacheConfig, out_dir: Path) -> list[Path]:
        """Write (or reuse) the bucket's layer graph and head graph; returns their paths relative to out_dir."""
        check_tp(model.pctx.tp)
        layer_key, head_key = graph_keys(bucket, model.cfg.is_embedding)
        files = self._graph(model, out_dir, layer_key, lambda so: self._compile_layer(model, bucket, cache, so))
        if model.cfg.is_embedding:  # the pooling step where the LM head would be
            pool = self._graph(model, out_dir, head_key, lambda so: self._compile_pool(model, bucket, cache, so))
            return files + pool
        files += self._graph(model, out_dir, head_key, lambda so: self._compile_head(model, bucket, so))
        return files

    def _graph(self, model: torch.nn.Module, out_dir: Path, key: str, compile_fn: Any) -> list[Path]:
        memo = (id(model), Path(out_dir), key)
        if memo not in self._done:
            rel_so, rel_json = Path(SUBDIR) / f"{key}.so", Path(SUBDIR) / f"{key}{META_SUFFIX}"
            meta = compile_fn(Path(out_dir) / rel_so)
            extern = op_calls_file(rel_so)  # the graph's calls to our C++ operators, if it makes any
            meta.update(format=FORMAT, key=key, so=rel_so.name, dtype=str(self.dtype).removeprefix("torch."),
                        torch=torch.__version__, options=self.options, max_model_len=model.max_model_len,
                        extern_ops=(Path(out_dir) / extern).is_file())
            (Path(out_dir) / rel_json).write_text(json.dumps(meta, indent=1, sort_keys=True))
            self._done[memo] = [rel_so, rel_json] + ([extern] if meta["extern_ops"] else [])
        return list(self._done[memo])

    def _compile_layer(self, model: torch.nn.Module, bucket: Bucket, cache: CacheConfig, so: Path) -> dict[str, Any]:
        # prefills attend in parts over the keys each part sees (PrefillAttention, each row on its own); the
        # executor keeps its contract (CpuExecutor.run)
        split = (bucket.phase == PREFILL and not static_tokens(bucket)
                 and cache.max_model_len > PREFILL_SPLIT_STEP and self.options["prefill_attention"] == "split")
        parts = PREFILL_ATTENTION_PARTS if split else 0
        args, dyn = layer_example(model, bucket, cache, self.dtype, self.residual_dtype, self.rope_dtype, split)
        exact = bucket.phase == VERIFY and self.options["exact_verify"] == "on"
        decode_attention = (bucket.phase == DECODE or exact) and self.options["decode_attention"] != "sdpa"
        torch_ops = torch_op_reasons(model, self.options, decode_attention)  # C++ operators a feature rules out
        kernel = decode_attention and self.options["decode_attention"] == "kernel" and \
            "decode_attention" not in torch_ops
        int8_kernel = self._int8_kernel(model.model.layers[0])
        int8_widened = self.options["int8_gemm"] == "widened" and has_int8(model.model.layers[0])
        moe_kernel = self.options["moe_gather"] == "kernel" and has_moe_block(model.model.layers[0]) and \
            "moe_gather" not in torch_ops
        if kernel or int8_kernel or int8_widened or moe_kernel or has_gguf(model.model.layers[0]):
            cpu_ops.ensure(f"cpu layer graph for {bucket.key}", BackendCompileError)
        lora = model.lora_config
        gemm = self.options["gemm"]
        if (bucket.num_tokens == 1 or (exact and bucket.batch == 1)) and self.options["one_row_gemm"] != "same":
            gemm = self.options["one_row_gemm"]
        linear_kernel = gemm == "kernel"
        if linear_kernel:  # the operator takes the weights as held: the graph is compiled without freezing
            cpu_ops.ensure(f"cpu layer graph for {bucket.key}", BackendCompileError)
            gemm = "aten"
        layer = LayerGraph(model.model.layers[0], self.dtype, decode_attention, bucket.generates, exact, kernel,
                           int8_kernel, moe_kernel, window_input=model.cfg.mixed_windows or lora is not None,
                           linear_kernel=linear_kernel, lora_targets=lora.target_modules if lora is not None else (),
                           int8_widened=int8_widened, prefill_parts=parts,
                           gguf_exact=self.options["gguf_linear"] == "exact")
        # with every expert product on the operator (static token counts) no batched GEMM is left in the graph
        gathered = moe_kernel and static_tokens(bucket)
        recipes = compile_graph(layer, args, dyn, layer_gemm(layer, gemm, gathered), so,
                                f"cpu layer graph for {bucket.key}", self.options["fuse_projections"] == "on")
        return {"kind": "layer", "phase": bucket.phase, "batch": bucket.batch, "num_blocks": cache.num_blocks,
                "block_size": cache.block_size, "constants": {k: r.to_dict() for k, r in recipes.items()},
                "lora": lora.to_dict() if lora is not None else None, "torch_ops": torch_ops,
                "prefill_parts": parts}

    def _int8_kernel(self, module: torch.nn.Module) -> bool:
        """Whether `module`'s graph computes its int8 products on cpu_ops' int8_linear."""
        return self.options["int8_linear"] == "kernel" and has_int8(module)

    def _compile_head(self, model: torch.nn.Module, bucket: Bucket, so: Path) -> dict[str, Any]:
        rows = head_rows(bucket)
        # fp32 logits: Inductor's C++ GEMM template accumulates in fp32 and, with the head's `.float()` fused into
        # its epilogue, stores the accumulator as is (no bf16 rounding). A row's logits came out bitwise the same at
        # 1 and k + 1 rows, so a batch-1 verify head scores each row as the decode head does (test_speculative
        # checks it on the CPU it runs on). Every head takes it: up to a few tens of rows it also ran faster than
        # oneDNN, at 144 (16 x 9) slower (docs/cpu_backend.md)
        fp32_logits = (self.options["logits"] == "fp32" and self.dtype != torch.float32
                       and "quant" not in model.lm_head._modules)
        int8_kernel = self._int8_kernel(model.lm_head)
        if int8_kernel or has_gguf(model.lm_head):
            cpu_ops.ensure(f"cpu head graph for {rows} rows", BackendCompileError)
        # head_gemm "kernel": the fp32 logits on cpu_ops' bf16_linear, fp32 sums unrounded like the template's, at
        # any row count (a row's logits do not depend on the rows beside it: exact verify holds at every batch)
        linear_kernel = fp32_logits and self.options["head_gemm"] == "kernel"
        if linear_kernel:
            cpu_ops.ensure(f"cpu head graph for {rows} rows", BackendCompileError)
        head = HeadGraph(model.model.norm, model.lm_head, self.dtype, int8_kernel, model.cfg, linear_kernel,
                         gguf_exact=self.options["gguf_linear"] == "exact")
        args = (torch.randn(rows, model.cfg.hidden_size).to(self.residual_dtype),)
        gemm = "aten" if linear_kernel else "cpp" if fp32_logits else self.options["gemm"]
        recipes = compile_graph(head, args, None, layer_gemm(head, gemm), so, f"cpu head graph for {rows} rows")
        return {"kind": "head", "batch": rows, "constants": {k: r.to_dict() for k, r in recipes.items()}}

    def _compile_pool(self, model: torch.nn.Module, bucket: Bucket, cache: CacheConfig, so: Path) -> dict[str, Any]:
        """An embedding model's pool graph (cpu_graphs.PoolGraph) for a prefill bucket's batch and token kind."""
        graph = PoolGraph(model.model.norm, self.dtype, model.cfg)
        args, dyn = pool_example(model.cfg, bucket, cache, self.residual_dtype)
        recipes = compile_graph(graph, args, dyn, layer_gemm(graph, self.options["gemm"]), so,
                                f"cpu pool graph for {bucket.key}")
        return {"kind": "pool", "batch": bucket.batch, "constants": {k: r.to_dict() for k, r in recipes.items()}}

    def save_weights(self, model: torch.nn.Module, path: Path) -> None:
        # quantized weights keep their stored dtypes (fp8 values, fp32 scales)
        save_file({k: v.to(self.dtype) if v.is_floating_point() and ".quant." not in k else v
                   for k, v in model_state_for_save(model).items()}, str(path))

    def compile_encoder(self, graph: torch.nn.Module, args: tuple[torch.Tensor, ...], key: str,
                        out_dir: Path) -> list[Path]:
        return cpu_encoder.compile_encoder(graph, args, key, out_dir, self.dtype)

    def load_encoder(self, graph: torch.nn.Module, files: list[Path]) -> Any:
        return cpu_encoder.load_encoder(graph, files, self.dtype, _runner)

    def load(self, graph_files: dict[Bucket, list[Path]], weights_path: Path, model_factory: ModelFactory,
             cache: CacheConfig) -> CpuExecutor:
        """graph_files: absolute paths (or paths relative to the working directory) of each bucket's files."""
        model = model_factory()
        load_model_weights(model, weights_path)
        use_cpu_layout(model)  # the layouts the graphs were compiled on (LayerGraph does the same)
        return CpuExecutor(model.to(self.dtype).eval(), graph_files, cache, self.dtype, self.residual_dtype,
                           self.rope_dtype)


# why a decode graph of a model with attention sinks attends in DecodeAttention's loop nest, not the C++ kernel
SINKS_NOT_ON_KERNEL = "attention sinks (GPT-OSS): the C++ paged attention kernel has no sink logit"


def torch_op_reasons(model: torch.nn.Module, options: dict[str, Any], decode_attention: bool) -> dict[str, str]:
    """The C++ operators (by option name) that the options ask for but a feature of `model` rules out, each with the
    reason; those call sites take the torch form instead (DecodeAttention's loop nest, Experts.gather's broadcast
    loop). Recorded in each layer graph's metadata (`torch_ops`)."""
    out = {}
    if decode_attention and options["decode_attention"] == "kernel" and model.cfg.attention_sinks:
        out["decode_attention"] = SINKS_NOT_ON_KERNEL
    layer = model.model.layers[0]
    if options["moe_gather"] == "kernel" and has_moe_block(layer):
        limit = next(m.kernel_limit for m in layer.modules() if isinstance(m, Experts))
        if limit is not None:
            out["moe_gather"] = limit
    return out


def layer_gemm(layer: torch.nn.Module, gemm: str, moe_gathered: bool = False) -> str:
    """Quantized graphs (layers or heads) compile with gemm "aten", i.e. without freezing:
    - int4: torch's int4 CPU kernel is an extern call either way, and Inductor's freezing path fails on its
      constants' module paths (torch 2.13: "no attribute 'layer.self_attn...'");
    - int8: one-row GEMMs are a fused dot-product loop over the int8 weight (cpu.weights), and freezing would
      constant-fold its int8 -> fp32 widening into an fp32 copy of the weight (4x the bytes read).
    MoE layers too: the C++ GEMM template has no batched GEMM, which the dense expert path is (Inductor: "No
    choices to select"; adding ATEN to the autotuner would make the choice timing-based), and freezing hands the
    batched GEMMs their stacked weights permuted and reshaped, which no recipe rebuilds from the parameter. Not
    when `moe_gathered` (every expert product of the graph on cpu_ops' moe_gather, which takes the stacked weights
    as they are): those graphs keep `gemm`."""
    if quantized_modules(layer):
        return "aten"
    if has_moe_block(layer) and not moe_gathered:
        return "aten"
    if has_capped_score_gemm(layer):  # soft-capped scores as batched GEMMs (Gemma 2 prefill): no template for them
        return "aten"
    return gemm


class _WeightStore:
    """Each (tensor, packing) built once and shared by every graph that needs it.

    oneDNN weights are packed once, for M = 1, whatever M hint the graph was compiled with: oneDNN chooses a
    layout per M, so prefill, decode and each batch size would each hold a copy, yet the M=1 layout runs every
    M as fast as the graph's own (bf16, SmolLM2 shapes, M 1..512, docs/cpu_backend.md) and a
    layout oneDNN did not expect would only cost a reorder, never a wrong result.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.built: dict[tuple[tuple[str, ...], ConstantRecipe], torch.Tensor] = {}

    def get(self, fqns: tuple[str, ...], r: ConstantRecipe) -> torch.Tensor:
        if r.op == "onednn":
            r = ConstantRecipe(r.sources, r.op, batch=ONEDNN_SHARED_BATCH)
        key = (fqns, ConstantRecipe((), r.op, r.block_n, r.vnni, r.batch, r.literal))
        if key not in self.built:
            missing = [f for f in fqns if f not in self.tensors]
            if missing:
                raise ArtifactError(f"cpu graph needs weights {missing}, which the model does not have")
            self.built[key] = build_constant([self.tensors[f] for f in fqns], r)
        return self.built[key]


def _runner(so: Path, constants: dict[str, torch.Tensor]) -> Any:
    try:
        r = torch._C._aoti.AOTIModelContainerRunnerCpu(str(so), 1)
    except RuntimeError as e:  # dlopen/dlsym: a corrupt file, another CPU architecture, not an AOTInductor graph
        raise ArtifactError(f"{so}: cannot be loaded as a compiled graph ({str(e).strip()[:300]}); the file is "
                            "corrupt or was compiled for another machine: recompile the artifact here") from None
    # use_inactive=False, validate_full_update=True, user_managed=True: keep our tensors, no copy
    r.update_constant_buffer(constants, False, True, True)
    return r


def bind_graph(so: Path, recipes: dict[str, ConstantRecipe], tensors: dict[str, torch.Tensor]
               ) -> tuple[Any, list[torch.Tensor]]:
    """A compiled graph's container with its constants built from `tensors` (named as the compiled module names
    them) by its recipes, and those constants: the container holds raw pointers, the caller keeps them alive."""
    store = _WeightStore(tensors)
    constants = {c: store.get(tuple(r.sources), r) for c, r in recipes.items()}
    return _runner(so, constants), list(constants.values())


class _HeadCall:
    """A head container as a function of the rows' hidden states (a pool graph's: and their last indices)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.runner.run(list(inputs))[0]


class _ModelShape:
    """What sharding an adapter needs of a rank model (neuron_opt.lora.adapter.load_into_slot), without its
    weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.cfg, self.layout, self.lora_config, self.pctx = model.cfg, model.layout, model.lora_config, model.pctx


class CpuExecutor:
    """Runs a bucket: eager embedding -> layer containers -> head container. Owns the KV block pools (and, with a
    LoRA capacity, the adapter stacks: `load_lora`, `clear_lora`).

    Any bucket whose graphs the artifact has runs, compiled for it or not: a prefill of any token count from 2 up
    runs on its batch's dynamic prefill graph (`graph_keys`). The runner therefore pads prefills to a multiple of
    `prefill_granularity` tokens instead of a compiled prefill length: a 150-token prompt runs as 160 tokens, not
    256 (docs/cpu_backend.md, "Prefill at the prompt's length"). 16 rather than 1 keeps the GEMMs' row counts to
    a few shapes (oneDNN builds and caches a kernel per shape) at a waste of under 16 tokens a prefill."""

    gathers_candidates = False
    takes_embeddings = True  # image rows merged after the eager embedding lookup; M-RoPE rows gathered there too
    prefill_granularity = 16
    # its graph calls use every core the thread policy gives them, with the GIL held between ops (layers): the
    # host work of async scheduling has nowhere to overlap (docs/serving.md, "Async scheduling")
    async_scheduling = False

    def __init__(self, model: torch.nn.Module, graph_files: dict[Bucket, list[Path]], cache: CacheConfig,
                 dtype: torch.dtype, residual_dtype: torch.dtype, rope_dtype: torch.dtype) -> None:
        self.dtype, self.residual_dtype, self.rope_dtype = dtype, residual_dtype, rope_dtype
        n_layers = len(model.model.layers)
        tensors = {**dict(model.state_dict()), **dict(model.named_buffers())}
        store = _WeightStore(tensors)
        self.pooled = model.cfg.is_embedding  # an embedding model: pool graphs return [B, H] embeddings
        lora = model.lora_config
        metas = self._read_metas(graph_files, cache, dtype, model.max_model_len, self.pooled, lora)
        if any(m["extern_ops"] for m in metas.values()):  # the graphs call our C++ operators: load them first
            cpu_ops.ensure("this artifact's cpu graphs", ArtifactError)
        runners: dict[str, list[Any]] = {}
        # layer graphs that attend in parts (PrefillAttention): run() keeps their contract
        self._split = {m["key"] for m in metas.values() if m.get("prefill_parts")}
        for path, meta in metas.items():
            so = path.with_name(meta["so"])
            recipes = {c: ConstantRecipe.from_dict(d) for c, d in meta["constants"].items()}
            if meta["kind"] == "layer":
                runners[meta["key"]] = [
                    _runner(so, {c: store.get(tuple(f"model.layers.{i}.{s.removeprefix('layer.')}" for s in r.sources),
                                              r) for c, r in recipes.items()}) for i in range(n_layers)]
            else:
                head = _runner(so, {c: store.get(tuple(("model." if s.startswith("norm.") else "") + s
                                                       for s in r.sources), r) for c, r in recipes.items()})
                runners[meta["key"]] = [_HeadCall(head)]
        # by graph keys, not buckets: buckets that share graphs share routes, and a prefill length between the
        # compiled ones finds its batch's dynamic graph
        keys = {b: graph_keys(b, self.pooled) for b in graph_files}
        self._routes = {k: (runners[k[0]], runners[k[1]][0]) for k in keys.values()}
        self._embed = self._embedding(model, store)
        # from the config, in fp32: the model's buffers went to `dtype` with it
        self.cfg = model.cfg
        self.rope = model_rope_tables(model.cfg, model.max_model_len)  # kind -> [max_model_len, R] each
        self.max_model_len = model.max_model_len
        # a model whose layers mix windows passes each layer's window to the shared layer graph (LayerGraph)
        self.windows = [window_input(model.cfg, i, model.max_model_len) for i in range(n_layers)] \
            if model.cfg.mixed_windows or lora is not None else None
        self.k_caches, self.v_caches = allocate_kv(model, cache, dtype)
        # window-sized KV: the layers that take the window pool's slot mapping and tables (None: none)
        self.window_layers = {i for i in range(n_layers) if model.cfg.layer_window(i) is not None} \
            if cache.sliding_window else None
        # LoRA: the adapter stacks, graph inputs of every layer container (neuron_opt.lora.ops); the model is kept
        # only as the description `load_lora` shards adapters by (its weights are dropped below)
        self.lora_config = lora
        self.lora_stacks = stacks_for(model, dtype)
        self._lora_model = _ModelShape(model) if lora is not None else None
        # user_managed constants: the containers keep raw pointers, so we must keep the tensors alive. The model
        # and its unpacked GEMM weights are not referenced past this point and are freed with it.
        self.constants = store.built
        self.aux_layers: tuple[int, ...] = ()  # capture_aux_hidden
        self.aux_hidden: torch.Tensor | None = None
        self._chain: tuple[Any, Any] | None = None  # eagle3_chain's: (head, its compiled chain)

    @staticmethod
    def _read_metas(graph_files: dict[Bucket, list[Path]], cache: CacheConfig, dtype: torch.dtype,
                    max_model_len: int, pooled: bool = False, lora: Any = None) -> dict[Path, dict[str, Any]]:
        metas: dict[Path, dict[str, Any]] = {}
        for bucket, files in graph_files.items():
            keys = {Path(f).name.removesuffix(META_SUFFIX) for f in files if str(f).endswith(META_SUFFIX)}
            want = graph_keys(bucket, pooled)
            if set(want) - keys:
                raise ArtifactError(f"cpu graphs for {bucket.key}: expected {want}, found {sorted(keys)}")
            for f in files:
                f = Path(f)
                if not f.name.endswith(META_SUFFIX) or f in metas:
                    continue
                meta = json.loads(f.read_text())
                want = {"format": FORMAT, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
                        "max_model_len": max_model_len}
                if meta["kind"] == "layer":
                    want.update(num_blocks=cache.num_blocks, block_size=cache.block_size,
                                lora=lora.to_dict() if lora is not None else None)
                bad = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
                if bad:
                    raise ArtifactError(f"{f}: compiled for a different setup (artifact, here): {bad}; recompile")
                if not f.with_name(meta["so"]).is_file():
                    raise ArtifactError(f"{f}: its graph {meta['so']} is missing")
                calls = op_calls_file(f.with_name(meta["so"]))
                if meta["extern_ops"] and not calls.is_file():
                    raise ArtifactError(f"{f}: its graph's operator calls ({calls.name}) are missing")
                metas[f] = meta
        return metas

    def _embedding(self, model: torch.nn.Module, store: _WeightStore) -> Any:
        """Tied embeddings: read rows straight from a packed head weight (no second copy of the table). A C++
        GEMM template packing is [nb, K, bn], with VNNI-v its K rows interleaved in groups of v: [nb, K/v, bn, v]
        (cpu_constants.pack_weight)."""
        w = model.model.embed_tokens.weight
        packed = [(k, t) for k, t in store.built.items() if k[0] == ("lm_head.weight",) and k[1].op == "pack"]
        if model.cfg.tie_word_embeddings and packed:
            (_, r), table = min(packed, key=lambda p: p[0][1].vnni)  # the plain blocking when there is one
            bn, v, H = r.block_n, max(r.vnni, 1), w.shape[1]
            blocks = table.view(table.shape[0], H // v, bn, v)
            return lambda ids: blocks[ids // bn, :, ids % bn, :].reshape(*ids.shape, H)  # [B, S, H]
        return lambda ids: torch.nn.functional.embedding(ids, w)

    def capture_aux_hidden(self, layer_ids: tuple[int, ...]) -> None:
        """From now on each step also keeps the residual stream entering these layers at every position
        (`aux_hidden`: [B, S, len(layer_ids) * H] in the residual dtype; id = the number of layers: the last
        layer's output), for an EAGLE-3 head. The stream is what runs between the layer graphs: no graph changes."""
        self.aux_layers = tuple(layer_ids)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embedding rows of `ids`, unscaled (from the packed head weight when tied)."""
        return self._embed(ids)

    def eagle3_chain(self, head: Any, cache: CacheConfig, buckets: Any) -> Any:
        """An EAGLE-3 head's draft chain as compiled graphs, one per decode batch (cpu.eagle3.CpuEagle3Chain), its
        K/V in the target's block layout. Kept per head, so later engines over this model reuse its graphs; a new
        proposer trusts no head entry it did not write, so nothing of an earlier engine's KV is read."""
        from neuron_opt.backends.cpu.eagle3 import CpuEagle3Chain

        if self._chain is None or self._chain[0] is not head:
            self._chain = None  # one head's graphs at a time
            table = None if head.embed_tokens is not None else self._embed(torch.arange(self.cfg.vocab_size))
            self._chain = (head, CpuEagle3Chain(head, cache, buckets, table, bind_graph))
        return self._chain[1]

    def load_lora(self, slot: int, adapter: Any) -> None:
        load_into_slot(self.lora_stacks, slot, adapter, self._lora_model)  # type: ignore[arg-type]

    def clear_lora(self, slot: int) -> None:
        assert self.lora_stacks is not None
        self.lora_stacks.clear_slot(slot)

    def _split_inputs(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      tables: torch.Tensor, window: tuple[torch.Tensor, torch.Tensor] | None
                      ) -> tuple[Any, ...]:
        """A split prefill graph's inputs (cpu_graphs.PrefillAttention): the tokens padded to a multiple of
        PREFILL_SPLIT_STEP (the null slot, positions continuing, capped as the runner caps them), the block table
        padded with null blocks to cover the first position plus the tokens. The padded rows' outputs are never
        read (the head takes each row's last real token)."""
        S = ids.shape[1]
        pad = -S % PREFILL_SPLIT_STEP
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad))
            slots = torch.nn.functional.pad(slots, (0, pad))
            more = (pos[:, -1:] + torch.arange(1, pad + 1)).clamp(max=self.max_model_len - 1)
            pos = torch.cat([pos, more], dim=1)
        bs = self.k_caches[0].shape[2]
        need = -(-(int(pos[:, 0].max()) + S + pad) // bs)
        if tables.shape[1] < need:
            tables = torch.nn.functional.pad(tables, (0, need - tables.shape[1]))  # null blocks: masked keys
        if window is not None:  # the window pool's slots and tables, padded alike
            w_slots, w_tables = window
            if pad:
                w_slots = torch.nn.functional.pad(w_slots, (0, pad))
            if w_tables.shape[1] < need:
                w_tables = torch.nn.functional.pad(w_tables, (0, need - w_tables.shape[1]))
            window = (w_slots, w_tables)
        return ids, pos, slots, tables, window

    @torch.no_grad()
    def run(self, bucket: Bucket, inputs: StepInputs) -> torch.Tensor:
        keys = graph_keys(bucket, self.pooled)
        route = self._routes.get(keys)
        if route is None:
            raise BucketOverflowError(f"bucket {bucket.key}: this artifact has no cpu graphs for it (graphs for: "
                                      f"{sorted({k for keys in self._routes for k in keys})})")
        layers, head = route
        pos, slots, tables = inputs.positions, inputs.slot_mapping, inputs.block_tables
        # the KV length is dynamic here: attend over the blocks the step's positions reach, not the bucket's (the
        # bucket bounds the shape; positions past them are masked anyway). At least 2: the graphs' block dimension
        # starts at 2, so a one-block table gets a null-block column (masked)
        reach = int(pos.max()) // self.k_caches[0].shape[2] + 1
        tables = self._fit_tables(tables, reach)
        window_kv = inputs.window_kv()  # window-sized KV: the sliding layers' slot mapping and tables
        if window_kv is not None:
            window_kv = (window_kv[0], self._fit_tables(window_kv[1], reach))
        ids = inputs.input_ids
        if keys[0] in self._split:  # PrefillAttention's contract
            ids, pos, slots, tables, window_kv = self._split_inputs(ids, pos, slots, tables, window_kv)
        x = self._embed(ids).to(self.residual_dtype)  # [B, S, H]
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        mm = inputs.multimodal()
        deepstack: list[torch.Tensor] = []  # Qwen3-VL: added to the output of layer i, for i < d
        if mm is not None:  # image rows at their placeholder positions (a split prefill's padding comes after)
            n, pad = mm[0].shape[1], x.shape[1] - mm[0].shape[1]
            x = torch.cat([merge_embeddings(x[:, :n], *mm), x[:, n:]], dim=1)  # [B, S, H]
            deepstack = [torch.nn.functional.pad(d.to(x.dtype), (0, 0, 0, pad))
                         for d in deepstack_rows(*mm, x.shape[-1])]  # [B, S, H] each
        ropes = layer_rope_inputs(self.cfg, self.rope, pos, self.rope_dtype,
                                  inputs.last_index)  # per layer, [B, S, 1, R] each
        if self.cfg.mrope_section and inputs.rope_positions is not None:  # M-RoPE: 3-D positions, padding 1-D
            rp = inputs.rope_positions
            rp = torch.cat([rp, pos[:, rp.shape[2]:].expand(3, -1, -1)], dim=2)  # [3, B, S]
            ropes = [mrope_rows(self.cfg.mrope_section, self.rope["global"], rp, self.rope_dtype,
                                self.cfg.mrope_interleaved)] * len(ropes)
        lora_slots = inputs.lora_slots if inputs.lora_slots is not None else torch.zeros(x.shape[0], dtype=torch.long)
        ks, vs = self.k_caches, self.v_caches
        aux = []
        for i, layer in enumerate(layers):
            if i in self.aux_layers:
                aux.append((i, x))
            cos, sin = ropes[i]
            window = [] if self.windows is None else [self.windows[i]]
            if self.lora_stacks is not None:
                window = [*window, lora_slots, *self.lora_stacks.layer_tensors(i)]
            own = window_kv if window_kv is not None and i in (self.window_layers or ()) else (slots, tables)
            x = layer.run([x, cos, sin, pos, *own, ks[i], vs[i], *window])[0]
            if i < len(deepstack):  # between the layer graphs: no graph changes
                x = x + deepstack[i]
        if self.aux_layers:  # the streams entering the layers an EAGLE-3 head reads (the last layer's output: L)
            seen = dict([*aux, (len(layers), x)])
            self.aux_hidden = torch.cat([seen[i] for i in self.aux_layers], dim=-1)[:, :inputs.input_ids.shape[1]]
        if self.pooled:  # the final norm and the pooling over every row: [B, S, H] -> [B, H]
            return head(x, inputs.last_index)
        rows = torch.arange(x.shape[0])
        if inputs.last_index.dim() == 2:  # verify: every position of every row, [B, q, H] -> [B, q, V]
            B, q = inputs.last_index.shape
            picked = x[rows[:, None], inputs.last_index].reshape(B * q, -1)  # [B * q, H]
            if bucket.phase == VERIFY:
                return head(picked).view(B, q, -1)
            return self._head_rows(picked).view(B, q, -1)  # a prefill's every position (prompt logprobs)
        return head(x[rows, inputs.last_index])  # [B, H] -> [B, V]

    @staticmethod
    def _fit_tables(tables: torch.Tensor, reach: int) -> torch.Tensor:
        """Block tables cut to the blocks the step's positions reach, at least 2 (the graphs' block dimension
        starts at 2: a one-block table gets a null-block column, masked)."""
        if tables.shape[1] > max(reach, 2):
            return tables[:, :max(reach, 2)].contiguous()  # AOTI containers read inputs with contiguous strides
        if tables.shape[1] == 1:
            return torch.cat([tables, torch.zeros_like(tables)], dim=1)
        return tables

    def _head_rows(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] of any number of hidden states [N, H], through the head graph of the most rows, in
        chunks of its row count (the last one zero-padded)."""
        n, key = max((int(k[1].removeprefix("head_b")), k[1]) for k in self._routes if k[1].startswith("head_b"))
        head = next(r[1] for k, r in self._routes.items() if k[1] == key)
        pad = -h.shape[0] % n
        h = torch.nn.functional.pad(h, (0, 0, 0, pad))  # [N + pad, H]
        return torch.cat([head(h[i:i + n]) for i in range(0, h.shape[0], n)])[: h.shape[0] - pad]
