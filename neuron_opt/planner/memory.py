"""Memory per NeuronCore (rank): weights, KV cache, scratch, runtime reserve; host RAM to shard the
checkpoint.

Design decisions:
- Weights are counted from the per-rank `HeadLayout` (neuron_opt.parallel.sharding), so head padding, KV-head
  replication (replicate-kv / mha) and vocabulary padding cost exactly what the sharded checkpoint stores.
  At tp=1 with no padding the count equals `ModelConfig.num_parameters()` (tested).
- Quantized weights are weight-only, counted exactly as `compile --quantize` stores them (neuron_opt.quant.weights):
  `int8` and `fp8` hold the seven decoder linears in 1 byte per element plus one float32 scale per output
  channel; `int4` in half a byte per element plus a float32 scale and offset per group of INT4_GROUP input
  features (compile's default group size). Embeddings, LM head, norms and biases stay bfloat16.
- Tied embeddings share one tensor on device: counted once.
- The KV cache is a block pool sized for `batch` sequences of `max_model_len` (CacheConfig.num_blocks, plus one
  null block that padded tokens write; counted as part of the batch's blocks here), [num_blocks, n_kv_local,
  block_size, D] for K and V in every layer. With window-sized KV (`window_kv`: the backend holds it, compiler.
  kv_window; CacheConfig.sliding_window) the sliding-window layers hold a pool of `kv_window`'s blocks per
  sequence instead (`window_kv_bytes`), and that is the figure planned on; either way the figure is what the
  runtime allocates. Without it, `kv_cache_window` says beside it what window-sized pools would hold.
- Scratch is the live activation set of the largest graph (one graph runs at a time and the compiler reuses
  buffers layer to layer). Attention scores are counted as materialised in float32 because our graphs do not
  use a flash-attention kernel; this is an upper bound when one is used.
- LoRA adapter stacks (`lora`: compile --enable-lora's capacity) are counted as the executor allocates them
  (neuron_opt.planner.lora).
- RUNTIME_RESERVE is held back per core for what the model does not allocate: the Neuron runtime's own
  buffers, instruction streams of every loaded graph, DMA descriptor rings and collective buffers.
  docs/planner.md justifies 1 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from neuron_opt.buckets import BucketConfig
from neuron_opt.config import ModelConfig, ParallelConfig, norm_roles, window_blocks
from neuron_opt.errors import ConfigError
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel.sharding import HeadLayout, head_layout
from neuron_opt.planner.hardware import GiB, Instance
from neuron_opt.planner.lora import adapter_bytes
from neuron_opt.planner.moe import expert_elements

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}  # int4: see below
WEIGHT_DTYPES = ("bfloat16", "float16", "float32", "fp8", "int8", "int4")
KV_DTYPES = ("bfloat16", "float16", "float32", "fp8")
QUANTIZED = ("fp8", "int8", "int4")
INT4_GROUP = 32  # compile's default int4 group size (QuantConfig)
RUNTIME_RESERVE = 1 * GiB  # per NeuronCore; see docs/planner.md "Runtime reserve"
CPU_RESERVE = 2 * GiB  # operating system + Python + torch on the cpu pseudo-instance
HOST_BASELINE = 2 * GiB  # Python + torch + tokenizer in the compile process
PLAN_BLOCK_SIZE = 32  # the KV block size plans assume (CacheConfig's default)


def dtype_bytes(dtype: str, what: str = "dtype") -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"{what}: unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True)
class WeightCount:
    """Elements held by one rank, split by how they are stored."""

    linear: int  # the seven decoder projections (quantizable); MoE: attention and the shared expert
    linear_out_channels: int  # output channels of those projections (one scale each when quantized)
    other: int  # embeddings, LM head, norms, biases, MoE routers
    experts: int = 0  # MoE: the stacked experts (not quantizable: compile refuses --quantize for MoE)

    @property
    def total(self) -> int:
        return self.linear + self.other + self.experts


def weight_count(cfg: ModelConfig, lay: HeadLayout) -> WeightCount:
    """Parameters one rank stores under `lay` (padding and replication included)."""
    H, D, L = cfg.hidden_size, lay.head_dim, cfg.num_hidden_layers
    q, kv, inter = lay.n_heads_local * D, lay.n_kv_local * D, lay.intermediate_local
    experts = 0
    if cfg.is_moe:  # the dense MLP is replaced: experts (planner.moe), a shared expert, the router
        inter, experts = lay.shared_intermediate_local, expert_elements(cfg, lay)
        if lay.hybrid:  # token-generation graphs' own copy of the experts
            experts += expert_elements(cfg, lay.decode_layout())
    linear = H * q + 2 * H * kv + q * H + 3 * H * inter  # q, k, v, o, gate, up, down
    out_ch = q + 2 * kv + H + 2 * inter + H
    other = H * len(norm_roles(cfg.norm_layout))  # the layer's RMSNorms (2; Gemma's sandwich: 4)
    if cfg.is_moe:
        other += cfg.num_experts * H + (H if cfg.shared_expert_intermediate_size else 0)  # router, shared gate
        other += cfg.num_experts if cfg.router_bias else 0
    if cfg.attention_sinks:
        other += lay.n_heads_local  # one logit per local query head (GPT-OSS)
    if cfg.qk_norm:
        other += q + kv if cfg.qk_norm_full else 2 * D  # OLMo 2: over this rank's heads; else one head's D
    if cfg.attention_bias:
        other += q + 2 * kv  # column-parallel biases are split
    if cfg.o_bias:
        other += H  # row-parallel bias is replicated
    if cfg.mlp_bias:
        other += 2 * inter + H
    embed = lay.vocab_local * H  # vocab-parallel, padded vocabulary
    head = 0 if cfg.tie_word_embeddings else lay.vocab_local * H
    return WeightCount(linear=L * linear, linear_out_channels=L * out_ch, other=L * other + embed + head + H,
                       experts=experts)


def weight_bytes(cfg: ModelConfig, lay: HeadLayout, dtype: str) -> int:
    """Bytes of one rank's weights in `dtype` (quantized: the stored format of the linears, the rest bfloat16)."""
    n = weight_count(cfg, lay)
    if n.experts and dtype in QUANTIZED:
        raise ConfigError(f"dtype: {dtype} weights are not built for mixture-of-experts models (compile refuses "
                          "--quantize for them); plan them in bfloat16 or float32")
    if dtype == "int4":
        return n.linear // 2 + 8 * (n.linear // INT4_GROUP) + 2 * n.other
    b = dtype_bytes(dtype, "dtype")
    if dtype in QUANTIZED:
        return n.linear + 4 * n.linear_out_channels + 2 * n.other
    return b * n.total


def checkpoint_bytes(cfg: ModelConfig) -> int:
    """Bytes of the tensors a published checkpoint of `cfg` stores: bfloat16, except MXFP4 expert weights
    (ModelConfig.experts_mxfp4: half a byte per weight plus a one-byte scale per 32). What the checkpoint's files
    hold; compile dequantizes MXFP4 to the weight dtype (`weight_bytes` counts that)."""
    n = cfg.num_parameters()
    if not cfg.experts_mxfp4:
        return 2 * n
    w = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return 2 * (n - w) + w // 2 + w // 32


@dataclass(frozen=True)
class LayoutOverhead:
    """What a tp layout costs one rank beyond an even 1/tp split of the unpadded model."""

    padded: tuple[str, ...]  # e.g. "MLP 14336 -> 14352", one entry per padded or replicated width
    extra_weight_bytes: int  # per rank, in the weight dtype
    extra_linear_flops: float  # fraction: this rank's linear FLOPs per token / (the unpadded model's / tp) - 1

    def line(self) -> str:
        return (
            f"padding for tp: {', '.join(self.padded)}: weights +{self.extra_weight_bytes / GiB:.2f} GiB per "
            f"core, linear FLOPs +{100 * self.extra_linear_flops:.1f}% (zero rows/columns: exact, but computed)"
        )


def layout_overhead(cfg: ModelConfig, lay: HeadLayout, dtype: str) -> LayoutOverhead:
    """Padding (MLP features, query heads, vocabulary) and KV-head replication of `lay`, with their cost."""
    even = head_layout(cfg, ParallelConfig(tp=1))
    padded = []
    if cfg.is_moe:
        if lay.moe_intermediate_local * lay.moe_tp != cfg.moe_intermediate_size:
            padded.append(f"experts {cfg.moe_intermediate_size} -> {lay.moe_intermediate_local * lay.moe_tp}")
        if lay.shared_intermediate_local * lay.tp != cfg.shared_expert_intermediate_size:
            padded.append(f"shared expert {cfg.shared_expert_intermediate_size} -> "
                          f"{lay.shared_intermediate_local * lay.tp}")
        if lay.hybrid:
            padded.append(f"experts held twice (ep {lay.ep} prefill, ep {lay.ep_decode} decode)")
    elif lay.intermediate_padded != cfg.intermediate_size:
        padded.append(f"MLP {cfg.intermediate_size} -> {lay.intermediate_padded}")
    if lay.n_heads * lay.kv_seq_shards != cfg.num_attention_heads:
        padded.append(f"q heads {cfg.num_attention_heads} -> {lay.n_heads * lay.kv_seq_shards}")
    if lay.n_kv_heads * lay.kv_seq_shards != cfg.num_key_value_heads and lay.kv_seq_shards == 1:
        padded.append(f"kv heads {cfg.num_key_value_heads} -> {lay.n_kv_heads} (replicated)")
    if lay.vocab_padded != cfg.vocab_size:
        padded.append(f"vocab {cfg.vocab_size} -> {lay.vocab_padded}")
    extra = weight_bytes(cfg, lay, dtype) - weight_bytes(cfg, even, dtype) / lay.tp
    linear = weight_count(cfg, lay).linear / (weight_count(cfg, even).linear / lay.tp) - 1
    return LayoutOverhead(tuple(padded), max(0, round(extra)), max(0.0, linear))


def kv_bytes(cfg: ModelConfig, lay: HeadLayout, num_blocks: int, block_size: int, kv_dtype: str) -> int:
    """One rank's KV block pool: K and V, every layer, [num_blocks, n_kv_local, positions per block, D].

    Positions per block: block_size, or block_size / g under kv-seq-shard flash decoding (each of the g ranks of a
    KV group holds every g-th position; rounded up where g does not divide the block, which compile refuses).
    """
    return (
        2
        * cfg.num_hidden_layers
        * num_blocks
        * -(-block_size // lay.kv_seq_shards)
        * lay.n_kv_local
        * lay.head_dim
        * dtype_bytes(kv_dtype, "kv_dtype")
    )


def kv_bytes_per_token(cfg: ModelConfig, lay: HeadLayout, kv_dtype: str) -> float:
    """One rank's KV bytes per position of a sequence (K and V, every layer): `kv_bytes` of one plan block over its
    positions; at tp 1, the model's KV per token (Llama-3-8B in bf16: 128 KiB)."""
    return kv_bytes(cfg, lay, 1, PLAN_BLOCK_SIZE, kv_dtype) / PLAN_BLOCK_SIZE


def kv_window(cfg: ModelConfig, buckets: BucketConfig, block_size: int, max_model_len: int) -> tuple[int, int]:
    """Window-sized KV's (sliding_window, window_blocks_per_sequence) for these buckets (CacheConfig), (0, 0)
    where it does not apply: a model without sliding-window layers, prefills that cannot start at an offset
    (the scheduler reserves whole sequences then), an embedding model, or no block saved. The window is the
    largest of the sliding layers'; a step is at most the longest prefill chunk or verify row
    (config.window_blocks)."""
    windows = [w for w in (cfg.layer_window(i) for i in range(cfg.num_hidden_layers)) if w is not None]
    if not windows or not buckets.offset_prefill or buckets.prefill_only:
        return 0, 0
    per_seq = window_blocks(max(windows), block_size, max(buckets.prefill_lens[-1], buckets.verify_len),
                            max_model_len)
    return (max(windows), per_seq) if per_seq < -(-max_model_len // block_size) else (0, 0)


WINDOW_PREFILL_MIN = 128  # the default prefill chunk cap's floor: the smallest default prefill bucket (BucketConfig)


def window_prompt_len(cfg: ModelConfig, max_model_len: int, block_size: int, verify_len: int = 0) -> int | None:
    """`compile`'s default largest prefill bucket (max_prompt_len) for a model with sliding-window layers: its
    largest window, at least WINDOW_PREFILL_MIN tokens, where window-sized KV then holds fewer blocks than a full
    sequence; None otherwise (no sliding layer, or a window too close to max_model_len), max_model_len being the
    default then. Why: a sliding layer holds per sequence the blocks one step can see, the window plus the longest
    prefill chunk (config.window_blocks), so a chunk of max_model_len (the default without windows) makes its pool
    full length; with chunks of the window it holds about twice the window. Longer prompts run in chunks (offset
    prefill buckets, which window-sized KV needs anyway: kv_window)."""
    windows = [w for w in (cfg.layer_window(i) for i in range(cfg.num_hidden_layers)) if w is not None]
    if not windows or cfg.is_embedding:
        return None
    cap = min(max(max(windows), WINDOW_PREFILL_MIN), max_model_len)
    held = window_blocks(max(windows), block_size, max(cap, verify_len), max_model_len)
    return cap if held < -(-max_model_len // block_size) else None


def window_kv_bytes(cfg: ModelConfig, lay: HeadLayout, buckets: BucketConfig, batch: int, max_model_len: int,
                    block_size: int, kv_dtype: str) -> int:
    """One rank's KV under window-sized KV, as the runtime allocates it: full-attention layers hold `batch`
    sequences of max_model_len (`kv_bytes`' pool), sliding-window layers `batch` times `kv_window`'s blocks
    per sequence (the blocks one step can see or write); each layer keeps the null block. Equal to the full pool
    where window-sized KV does not apply."""
    per_layer_block = kv_bytes(cfg, lay, 1, block_size, kv_dtype) // cfg.num_hidden_layers  # K and V, one block
    full = batch * -(-max_model_len // block_size) + 1
    window, per_seq = kv_window(cfg, buckets, block_size, max_model_len)
    sliding = sum(cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)) if window else 0
    return ((cfg.num_hidden_layers - sliding) * full + sliding * (batch * per_seq + 1)) * per_layer_block


def graph_scratch_bytes(
    cfg: ModelConfig, lay: HeadLayout, batch: int, q_len: int, kv_len: int, act_bytes: int
) -> int:
    """Live activations of one graph at its peak layer stage, per rank.

    Residual stream and its normed copy are live throughout; the attention stage (q/k/v, float32 scores
    [batch, n_heads_local, q_len, kv_len], attention output) and the MLP stage (gate, up, product) do not
    overlap; float32 logits are produced for the last position of each row only.
    """
    T, D = batch * q_len, lay.head_dim
    residual = 2 * T * cfg.hidden_size * act_bytes
    attn = (
        T * (lay.n_heads_local + 2 * lay.n_kv_local) * D * act_bytes
        + batch * lay.n_heads_local * q_len * kv_len * 4
        + T * lay.n_heads_local * D * act_bytes
    )
    mlp = 3 * T * lay.intermediate_local * act_bytes
    if cfg.is_moe:  # the dense expert path: every local expert's gate/up/product and output (activation dtype,
        # then its fp32 copy for the weighted sum) on every token
        mlp = 3 * T * lay.experts_local * lay.moe_intermediate_local * act_bytes + T * lay.experts_local * \
            cfg.hidden_size * (act_bytes + 4)
    logits = batch * lay.vocab_local * 4
    return residual + max(attn, mlp) + logits


def scratch_bytes(cfg: ModelConfig, lay: HeadLayout, buckets: BucketConfig, act_bytes: int) -> int:
    """The largest graph's scratch: all graphs share one scratchpad and run one at a time."""
    pre = [
        graph_scratch_bytes(cfg, lay, buckets.prefill_batch, s, s, act_bytes) for s in buckets.prefill_lens
    ]
    q = max(1, buckets.verify_len)  # verify graphs (speculative decoding) score q tokens per decode row
    dec = [
        graph_scratch_bytes(cfg, lay, b, q, s, act_bytes)
        for b in buckets.decode_batches
        for s in buckets.decode_kv_lens
    ]
    return max(pre + dec)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank, the capacity they must fit in, and host RAM needed to shard the checkpoint."""

    weights: int
    kv_cache: int
    scratch: int
    reserve: int
    capacity: int  # per rank
    host_needed: int
    host_capacity: int
    # KV under window-sized KV (window_kv_bytes; = kv_cache where it does not apply, or where it is planned on)
    kv_cache_window: int = 0
    lora: int = 0  # LoRA adapter stacks (compile --enable-lora)
    vision: int = 0  # a vision-language model's encoder: its weights and largest activations (planner.vision)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.scratch + self.reserve + self.lora + self.vision

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def host_fits(self) -> bool:
        return self.host_needed <= self.host_capacity


def plan_memory(
    cfg: ModelConfig,
    lay: HeadLayout,
    inst: Instance,
    buckets: BucketConfig,
    *,
    batch: int,
    max_model_len: int,
    dtype: str,
    kv_dtype: str,
    compile_ranks_held: int = 1,
    block_size: int = PLAN_BLOCK_SIZE,
    lora: LoraConfig | None = None,
    window_kv: bool = False,
) -> MemoryPlan:
    """Memory plan of one rank for a deployment (batch sequences of max_model_len in the KV block pool, plus the
    null block: CacheConfig's default pool).

    `compile_ranks_held`: rank models the compile process holds at once (1: rank by rank, the cpu/eager
    backends; tp: the neuron backend's one SPMD program). `lora`: the LoRA capacity whose adapter stacks each
    rank holds (None: none). `window_kv`: the backend holds window-sized KV (Backend.window_kv), so the KV
    planned on is `window_kv_bytes`."""
    w = weight_bytes(cfg, lay, dtype)
    act = 4 if dtype == "float32" else 2  # activations run in bfloat16 unless the whole model is float32
    adapters = 0
    if lora is not None:
        adapters = adapter_bytes(cfg, lay, lora, act)  # the stacks are in the compute dtype
    kv = kv_bytes(cfg, lay, batch * -(-max_model_len // block_size) + 1, block_size, kv_dtype)
    windowed = window_kv_bytes(cfg, lay, buckets, batch, max_model_len, block_size, kv_dtype)
    scratch = scratch_bytes(cfg, lay, buckets, act)
    if inst.shared_memory:
        capacity, reserve = inst.hbm_per_core // lay.tp, CPU_RESERVE // lay.tp
    else:
        capacity, reserve = inst.hbm_per_core, RUNTIME_RESERVE
    # compile streams the checkpoint into each rank's model one tensor at a time (compiler.build_rank): it holds
    # the rank models in the weight dtype plus one tensor in flight: read (fp32 at worst: a GGUF's dequantized
    # cache), cast and sliced, at most 3 fp32 copies of the largest tensor (the embedding or LM head). Measured
    # against this bound in tests/neuron_opt/test_compile_memory.py.
    largest = max(cfg.vocab_size, cfg.intermediate_size, cfg.moe_intermediate_size) * cfg.hidden_size
    host = compile_ranks_held * w + 3 * 4 * largest + HOST_BASELINE
    return MemoryPlan(
        weights=w,
        kv_cache=windowed if window_kv else kv,
        scratch=scratch,
        reserve=reserve,
        capacity=capacity,
        host_needed=host,
        host_capacity=inst.host_ram,
        kv_cache_window=windowed,
        lora=adapters,
    )


def resolve_flash_decoding(cfg: ModelConfig, par: ParallelConfig, num_blocks: int, block_size: int, dtype: str,
                           kv_dtype: str, lora: bool = False) -> tuple[ParallelConfig, str | None]:
    """`par` with flash decoding decided where it is auto (None): on where the model has fewer KV heads than tp
    (tp a multiple of them), the GQA strategy is auto, no LoRA capacity is compiled in, and one rank's weights +
    KV pool (`num_blocks` blocks) are smaller with it (it divides the KV per rank by g = tp / n_kv and holds the
    group's q/o weights g times); else off. Returns the config and, when auto decided, the reason for the plan."""
    if par.flash_decoding is not None:
        return par, None
    nkv, tp = cfg.num_key_value_heads, par.tp
    if (tp == 1 or nkv >= tp or tp % nkv or block_size % (tp // nkv) or par.gqa_strategy != "auto" or lora
            or par.cp_degree > 1):
        return replace(par, flash_decoding=False), None

    def per_rank(flash: bool) -> int:
        lay = head_layout(cfg, replace(par, flash_decoding=flash))
        return weight_bytes(cfg, lay, dtype) + kv_bytes(cfg, lay, num_blocks, block_size, kv_dtype)

    on, off = per_rank(True), per_rank(False)
    why = (f"flash decoding (auto): {'on' if on < off else 'off'}: weights + KV per rank {on / GiB:.3f} GiB with it, "
           f"{off / GiB:.3f} GiB without ({nkv} KV heads at tp {tp})")
    return replace(par, flash_decoding=on < off), why
