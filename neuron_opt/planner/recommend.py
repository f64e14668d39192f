"""Evaluate one deployment (tp, batch, lengths, dtypes) and rank the alternatives for a traffic shape.

Design decisions:
- A deployment is evaluated exactly as the runtime would run it: our own head layout (padding included), the
  default bucket set (neuron_opt.buckets), TTFT from the prefill bucket the prompt lands in, TPOT at the median
  output token's decode bucket (p50 of per-token latency).
- Ranking: plans that fit come first; bfloat16 weights are preferred and a quantized dtype is only proposed
  when no bfloat16 plan fits (we never quantize silently). Among the rest, the recommendation is the plan
  with the fewest NeuronCores whose end-to-end latency (TTFT + output_len * TPOT) is within RECOMMEND_SLACK
  of the fastest: beyond that, more cores buy little latency and could serve another replica instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from neuron_opt.buckets import Bucket, BucketConfig, pick_decode, pick_prefill
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.lora.config import LoraConfig
from neuron_opt.parallel.sharding import HeadLayout, head_layout
from neuron_opt.planner.hardware import INSTANCES, Instance, check_tp
from neuron_opt.planner.latency import StepTime, decode_time, prefill_time
from neuron_opt.planner.memory import KV_DTYPES, PLAN_BLOCK_SIZE, QUANTIZED, WEIGHT_DTYPES, MemoryPlan, plan_memory
from neuron_opt.planner.moe import ep_choices
from neuron_opt.planner.queueing import Arrival, Policy, QueueEstimate, bucket_clock, estimate

RECOMMEND_SLACK = 0.10
HYBRID_MIN_GAIN = 0.02  # a hybrid expert layout must cut end-to-end latency by this much (it holds experts twice)
MAX_BATCH_SEARCH = 4096


@dataclass(frozen=True)
class Deployment:
    """What gets compiled: tp degree, KV slots, lengths and dtypes."""

    tp: int
    batch: int  # KV cache slots = largest decode batch
    max_prompt_len: int  # largest prefill bucket
    max_model_len: int  # KV cache length
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    compile_ranks_held: int | None = None  # rank models one compile process holds; None: tp (neuron: SPMD)
    ep: int | None = None  # MoE expert-parallel degree; None: the fastest (chosen in `evaluate`), 1 if dense
    # MoE: token-generation graphs' degree (ParallelConfig.ep_decode); None: `ep`'s when ep is given, else chosen
    ep_decode: int | None = None
    prefill_batch: int = 1  # prompts (or chunks) per prefill graph call (compile --prefill-batch)
    lora: LoraConfig | None = None  # LoRA adapter capacity (compile --enable-lora); None: none
    block_size: int = PLAN_BLOCK_SIZE  # KV block size (compile --block-size)
    window_kv: bool = False  # the backend holds window-sized KV for sliding-window layers (Backend.window_kv)
    cp_degree: int = 1  # context-parallel prefill (ParallelConfig.cp_degree; implies flash decoding's layout)

    def __post_init__(self) -> None:
        for name in ("tp", "batch", "max_prompt_len", "max_model_len", "prefill_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_len > self.max_model_len:
            raise ConfigError(f"max_prompt_len: {self.max_prompt_len} exceeds max_model_len={self.max_model_len}")
        if self.dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
        if self.prefill_batch > self.batch:
            raise ConfigError(f"prefill_batch: {self.prefill_batch} exceeds the batch size ({self.batch})",
                              param="prefill_batch")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype: {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")

    def buckets(self) -> BucketConfig:
        return BucketConfig.build(
            max_prompt_len=self.max_prompt_len, max_model_len=self.max_model_len, max_batch=self.batch,
            prefill_batch=self.prefill_batch,
        )


@dataclass(frozen=True)
class Traffic:
    """The load the deployment is sized for."""

    input_len: int
    output_len: int
    concurrency: int = 1

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.concurrency < 1:
            raise ConfigError(f"traffic: input_len, output_len and concurrency must be >= 1, got {self}")


@dataclass(frozen=True)
class Plan:
    """One evaluated deployment."""

    instance: Instance
    deployment: Deployment
    layout: HeadLayout
    buckets: BucketConfig
    memory: MemoryPlan
    largest_batch: int  # at this max_model_len
    largest_length: int  # at this batch
    prefill_bucket: Bucket | None = None
    decode_bucket: Bucket | None = None
    ttft: StepTime | None = None  # None on cpu or without a traffic shape
    tpot: StepTime | None = None
    queue: QueueEstimate | None = None  # TTFT / TPOT percentiles under load (`with_queue`); None until asked

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def e2e_s(self, output_len: int) -> float | None:
        if self.ttft is None or self.tpot is None:
            return None
        return self.ttft.total + output_len * self.tpot.total


def _largest(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest n in [lo, hi] with pred(n), for pred true-then-false; lo - 1 when pred(lo) is false."""
    if not pred(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if pred(mid) else (lo, mid - 1)
    return lo


def _memory(
    cfg: ModelConfig, lay: HeadLayout, inst: Instance, dep: Deployment, buckets: BucketConfig | None
) -> MemoryPlan:
    return plan_memory(
        cfg,
        lay,
        inst,
        buckets or dep.buckets(),
        batch=dep.batch,
        max_model_len=dep.max_model_len,
        dtype=dep.dtype,
        kv_dtype=dep.kv_dtype,
        compile_ranks_held=dep.tp if dep.compile_ranks_held is None else dep.compile_ranks_held,
        block_size=dep.block_size,
        lora=dep.lora,
        window_kv=dep.window_kv,
    )


def evaluate(
    cfg: ModelConfig,
    inst: Instance,
    dep: Deployment,
    traffic: Traffic | None = None,
    par: ParallelConfig | None = None,
    buckets: BucketConfig | None = None,
    limits: bool = True,
) -> Plan:
    """Memory (and, with a traffic shape on a Neuron instance, latency) of one deployment.

    Args:
        cfg: the model.
        inst: where it runs.
        dep: tp, batch, lengths, dtypes.
        traffic: prompt/output lengths and concurrency; without it no latency is estimated.
        par: the parallel config (GQA strategy) when the caller has one; tp must equal dep.tp.
        buckets: the exact buckets to compile; default: the standard set for dep's limits.
        limits: search the largest batch and length that fit (False: both left 0, for candidates only compared).
    """
    if inst.family != "cpu":
        check_tp(inst, dep.tp)
    eps = ep_choices(cfg, dep.tp)
    if par is None and dep.ep is None and len(eps) > 1:
        return _choose_ep(cfg, inst, dep, eps, traffic, buckets)
    lay = head_layout(cfg, par or ParallelConfig(tp=dep.tp, instance=inst.name, ep=dep.ep or 1,
                                                 ep_decode=dep.ep_decode, cp_degree=dep.cp_degree))
    fixed = buckets
    buckets = buckets or dep.buckets()
    mem = _memory(cfg, lay, inst, dep, fixed)

    def fits_batch(b: int) -> bool:
        return _memory(
            cfg,
            lay,
            inst,
            Deployment(dep.tp, b, dep.max_prompt_len, dep.max_model_len, dep.dtype, dep.kv_dtype,
                       prefill_batch=min(dep.prefill_batch, b), lora=dep.lora, block_size=dep.block_size,
                       window_kv=dep.window_kv),
            fixed,
        ).fits

    def fits_length(n: int) -> bool:
        d = Deployment(dep.tp, dep.batch, min(dep.max_prompt_len, n), n, dep.dtype, dep.kv_dtype,
                       prefill_batch=dep.prefill_batch, lora=dep.lora, block_size=dep.block_size,
                       window_kv=dep.window_kv)
        return _memory(cfg, lay, inst, d, fixed).fits

    plan = Plan(
        instance=inst,
        deployment=dep,
        layout=lay,
        buckets=buckets,
        memory=mem,
        largest_batch=_largest(fits_batch, 1, MAX_BATCH_SEARCH) if limits else 0,
        largest_length=_largest(fits_length, 1, cfg.max_model_len_limit) if limits else 0,
    )
    if traffic is None:
        return plan
    if traffic.input_len + traffic.output_len > dep.max_model_len:
        raise ConfigError(
            f"max_model_len: input_len + output_len = {traffic.input_len + traffic.output_len} "
            f"exceeds --max-model-len {dep.max_model_len}"
        )
    pre = pick_prefill(traffic.input_len, buckets)
    dec = pick_decode(
        min(traffic.concurrency, dep.batch), traffic.input_len + traffic.output_len // 2, buckets
    )
    if inst.family == "cpu":
        return replace(plan, prefill_bucket=pre, decode_bucket=dec)
    ttft = prefill_time(cfg, lay, inst, batch=pre.batch, seq=pre.kv_len, dtype=dep.dtype, lora=dep.lora)
    tpot = decode_time(  # decode graphs apply the decode layout's experts (a hybrid layout's second copy)
        cfg, lay.decode_layout(), inst, batch=dec.batch, kv_len=dec.kv_len, dtype=dep.dtype, kv_dtype=dep.kv_dtype,
        lora=dep.lora,
    )
    return replace(plan, prefill_bucket=pre, decode_bucket=dec, ttft=ttft, tpot=tpot)


def _choose_ep(cfg: ModelConfig, inst: Instance, dep: Deployment, eps: list[int], traffic: Traffic | None,
               buckets: BucketConfig | None) -> Plan:
    """The deployment at its best expert layout: every prefill degree with every decode degree (or
    dep.ep_decode). The fastest end to end at the traffic shape that fits (without a latency model: the fewest
    bytes per core), then the smaller degrees. A hybrid layout (decode degree != prefill degree) holds the experts
    twice, memory that could hold KV blocks instead, so it is taken only when it is at least HYBRID_MIN_GAIN
    faster end to end than the best single layout."""
    decode = [dep.ep_decode] if dep.ep_decode is not None else eps
    plans = [evaluate(cfg, inst, replace(dep, ep=p, ep_decode=d), traffic, None, buckets, limits=False)
             for p in eps for d in decode]
    out_len = traffic.output_len if traffic is not None else 0
    timed = traffic is not None and plans[0].ttft is not None

    def key(p: Plan) -> tuple[bool, float, int, int]:
        cost = p.e2e_s(out_len) if timed else p.memory.total
        return (not p.fits, float(cost or 0.0), p.layout.ep, p.layout.decode_layout().ep)

    best = min(plans, key=key)
    if best.layout.hybrid and dep.ep_decode is None:
        uniform = min((p for p in plans if not p.layout.hybrid), key=key)
        if uniform.fits and (not timed or (best.e2e_s(out_len) or 0.0) > (1 - HYBRID_MIN_GAIN) *
                             (uniform.e2e_s(out_len) or 0.0)):
            best = uniform
    return evaluate(cfg, inst, best.deployment, traffic, None, buckets)  # the chosen one with its limits


def candidates(
    cfg: ModelConfig,
    inst: Instance,
    traffic: Traffic,
    *,
    batch: int,
    max_prompt_len: int,
    max_model_len: int,
    tp: int | None = None,
    dtype: str | None = None,
    kv_dtype: str = "bfloat16",
    ep: int | None = None,
    ep_decode: int | None = None,
    prefill_batch: int = 1,
    lora: LoraConfig | None = None,
    window_kv: bool = False,
    cp_degree: int = 1,
) -> list[Plan]:
    """Every (tp, dtype) on the instance, evaluated (any tp shards any model: widths tp does not divide are
    zero-padded, neuron_opt.parallel.sharding). MoE: each tp at its fastest expert layout (`_choose_ep`), or at
    `ep` / `ep_decode` (then only the degrees they divide). `lora`: the LoRA adapter capacity every candidate
    carries. `window_kv`: the backend holds window-sized KV (Deployment.window_kv)."""
    if tp is not None:
        check_tp(inst, tp)
    if cp_degree > 1 and tp is None:
        raise ConfigError("cp_degree: context-parallel prefill is planned at a given tp (cp_degree = tp / "
                          "num_key_value_heads, or tp itself with as many KV heads as tp or more); pass --tp too")
    degrees = (tp,) if tp is not None else inst.tp_degrees
    for fixed in (ep, ep_decode):
        if fixed is not None:  # none left: ParallelConfig names the error
            degrees = tuple(t for t in degrees if t % fixed == 0) or degrees
    quant = "fp8" if inst.family == "trn2" else "int8"
    dtypes = [dtype] if dtype else ["bfloat16"] if cfg.is_moe else ["bfloat16", quant]  # MoE: no quantized build
    out = []
    for d in dtypes:
        for t in degrees:
            out.append(evaluate(cfg, inst, Deployment(t, batch, max_prompt_len, max_model_len, d, kv_dtype, ep=ep,
                                                          ep_decode=ep_decode, prefill_batch=prefill_batch,
                                                          lora=lora, window_kv=window_kv, cp_degree=cp_degree),
                                traffic))
    if dtype is None and any(p.fits and p.deployment.dtype not in QUANTIZED for p in out):
        out = [p for p in out if p.deployment.dtype not in QUANTIZED]
    return out


def context_fits(cfg: ModelConfig, dep: Deployment) -> list[tuple[Instance, int | None]]:
    """Every Neuron instance with the smallest tp at which `dep`'s batch of `dep.max_model_len` sequences (its
    prompt length, dtypes, LoRA capacity) fits, None where no tp does: where a context can be served at all."""
    out = []
    for inst in INSTANCES.values():
        tp = next((t for t in inst.tp_degrees
                   if evaluate(cfg, inst, replace(dep, tp=t, ep=None, ep_decode=None, cp_degree=1),
                               limits=False).fits), None)
        out.append((inst, tp))
    return out


def rank(plans: list[Plan], traffic: Traffic) -> list[Plan]:
    """Best first: fitting, unquantized, then fewest cores within RECOMMEND_SLACK of the fastest."""

    def e2e(p: Plan) -> float:
        v = p.e2e_s(traffic.output_len)
        return float("inf") if v is None else v

    ordered = sorted(plans, key=lambda p: (not p.fits, p.deployment.dtype in QUANTIZED, e2e(p)))
    if not ordered or not ordered[0].fits:
        return ordered
    best = ordered[0]
    peers = [
        p
        for p in ordered
        if p.fits
        and p.deployment.dtype == best.deployment.dtype
        and e2e(p) <= e2e(best) * (1 + RECOMMEND_SLACK)
    ]
    pick = min(peers, key=lambda p: (p.deployment.tp, e2e(p)))
    return [pick] + [p for p in ordered if p is not pick]


def with_queue(cfg: ModelConfig, plan: Plan, traffic: Traffic, arrival: Arrival,
               max_num_batched_tokens: int = 2048) -> Plan:
    """The plan with its TTFT / TPOT percentiles under `arrival` (planner.queueing): `traffic.concurrency` requests
    together, or Poisson arrivals, served by our scheduler with `plan`'s decode slots, buckets and prefill batch
    and a token budget of `max_num_batched_tokens` per step. Unchanged where latency is not modelled (cpu)."""
    if plan.ttft is None:
        return plan
    b, d = plan.buckets, plan.deployment
    policy = Policy(max_num_seqs=b.decode_batches[-1], max_prefill_len=b.prefill_lens[-1],
                    max_num_batched_tokens=max_num_batched_tokens, prefill_batch=b.prefill_batch,
                    chunked=b.offset_prefill)
    clock = bucket_clock(cfg, plan.layout, plan.instance, b, dtype=d.dtype, kv_dtype=d.kv_dtype, lora=d.lora)
    q = estimate(policy, clock, arrival, traffic.concurrency, traffic.input_len, traffic.output_len)
    return replace(plan, queue=q)
