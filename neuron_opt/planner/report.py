"""Human and JSON renderings of plans: the `plan` command's output and the table `compile` prints first."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from neuron_opt.buckets import PREFILL, VERIFY, BucketConfig
from neuron_opt.config import CacheConfig, KVCacheDtype, ModelConfig, ParallelConfig
from neuron_opt.parallel.sharding import HeadLayout, head_layout
from neuron_opt.planner.collectives import cp_heads_break_even
from neuron_opt.planner.hardware import GB, GiB, Instance, get_instance
from neuron_opt.planner.latency import host_sampling_time
from neuron_opt.planner.memory import (
    checkpoint_bytes,
    kv_bytes_per_token,
    kv_window,
    layout_overhead,
    weight_bytes,
)
from neuron_opt.planner.moe import ep_choices, gather_until, moe_line
from neuron_opt.planner.queueing import QueueEstimate
from neuron_opt.planner.recommend import Deployment, Plan, Traffic, evaluate
from neuron_opt.planner.scale_out import TARGETS, Split, recommend_split
from neuron_opt.planner.speculative import SpecPrediction
from neuron_opt.planner.validation import error_band


def _gib(n: int) -> str:
    return f"{n / GiB:8.2f}"


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1e3 * v, 3)


def plan_lines(cfg: ModelConfig, plan: Plan) -> list[str]:
    """The detailed view of one plan."""
    d, m, lay, inst = plan.deployment, plan.memory, plan.layout, plan.instance
    where = "per rank (host RAM shared by all ranks)" if inst.shared_memory else "per NeuronCore"
    b = plan.buckets
    graphs = b.buckets()
    verify = (f"; verify ({b.verify_len} tokens per row, speculative decoding) for each decode bucket",
              f", {sum(g.phase == VERIFY for g in graphs)} of them verify") if b.verify_len else ("", "")
    n_offset = sum(g.phase == PREFILL and g.tokens != g.kv_len for g in graphs)
    if n_offset:
        verify = (verify[0] + "; offset prefill (each prefill length over each longer decode length: prefix "
                  "caching, chunked prefill)", verify[1] + f", {n_offset} of them offset prefill")
    lines = [
        f"plan: {cfg.architecture} ({cfg.num_parameters() / 1e9:.2f} B params) on {inst.name}, tp {d.tp} "
        f"(heads {cfg.num_attention_heads}->{lay.n_heads}, "
        f"kv heads {cfg.num_key_value_heads}->{lay.n_kv_heads}: "
        f"{lay.strategy}), weights {d.dtype}, KV {d.kv_dtype}",
        f"  {'memory ' + where:<40}{'GiB':>8}",
        f"    {'weights':<38}{_gib(m.weights)}",
        f"    {f'KV cache ({d.batch} x {d.max_model_len} positions)':<38}{_gib(m.kv_cache)}",
        f"    {'scratch (largest graph)':<38}{_gib(m.scratch)}",
        *([f"    {f'LoRA stacks ({d.lora.max_loras} x rank {d.lora.max_lora_rank})':<38}{_gib(m.lora)}"]
          if d.lora is not None else []),
        *([f"    {'vision encoder (weights, activations)':<38}{_gib(m.vision)}"] if m.vision else []),
        f"    {'runtime reserve':<38}{_gib(m.reserve)}",
        f"    {'total / capacity':<38}{_gib(m.total)} / {m.capacity / GiB:.2f}  -> "
        + ("fits" if m.fits else "DOES NOT FIT"),
        f"  host RAM to compile (rank weights + one tensor in flight): {m.host_needed / GiB:.1f} GiB "
        f"of {m.host_capacity / GiB:.0f} GiB" + ("" if m.host_fits else "  -> NOT ENOUGH HOST RAM"),
        f"  KV per token: {kv_per_token(cfg, plan)}",
        *([f"  context-parallel prefill: cp_degree {lay.kv_seq_shards}, each KV group's {lay.kv_seq_shards} ranks "
           f"split a prefill's q/k/v projections and rope (3 more group all-gathers per layer: q, k, v) and hold "
           f"1/{lay.kv_seq_shards} of its KV along the sequence"] if lay.cp and not lay.cp_heads else []),
        *(cp_heads_lines(cfg, lay) if lay.cp_heads else []),
        f"  largest batch at max_model_len {d.max_model_len}: {plan.largest_batch}; "
        f"largest max_model_len at batch {d.batch}: {plan.largest_length}",
        f"  buckets: prefill {list(b.prefill_lens)}" + (f" x batch {b.prefill_batch}" if b.prefill_batch > 1 else "")
        + f"; decode batches {list(b.decode_batches)}"
        f" x lengths {list(b.decode_kv_lens)}{verify[0]} ({len(graphs)} graphs{verify[1]})",
    ]
    windows = [w for w in (cfg.layer_window(i) for i in range(cfg.num_hidden_layers)) if w is not None]
    sliding = len(windows)
    per_seq = kv_window(cfg, b, d.block_size, d.max_model_len)[1] if sliding else 0
    chunk = b.prefill_lens[-1]
    if per_seq and d.window_kv:
        lines.insert(4, f"    {'  (window-sized KV)':<38}{'':>8}  ({sliding} of {cfg.num_hidden_layers} layers slide "
                        f"over {max(windows)} positions and hold only the blocks their window sees: {per_seq} of "
                        f"{-(-d.max_model_len // d.block_size)} blocks a sequence, the window and a prefill chunk "
                        f"of up to {chunk} tokens (compile's default chunk for sliding windows: the window, at least "
                        "128); longer prompts run in chunks)")
    elif sliding and d.window_kv:
        why = ("without offset prefill a sequence holds its whole length" if not b.offset_prefill else
               f"a prefill chunk of up to {chunk} tokens and the {max(windows)} before it span a whole sequence")
        lines.insert(4, f"    {'  (sliding layers at full length)':<38}{'':>8}  ({sliding} of {cfg.num_hidden_layers} "
                        f"layers slide, but {why})")
    elif sliding and m.kv_cache_window < m.kv_cache:
        lines.insert(4, f"    {'  (KV if sliding layers held windows)':<38}{_gib(m.kv_cache_window)}  ({sliding} of "
                        f"{cfg.num_hidden_layers} layers slide over {cfg.sliding_window} positions; not built: this "
                        "backend allocates every position in every layer, as planned)")
    over = layout_overhead(cfg, lay, d.dtype)
    if over.padded:
        lines.insert(1, f"  {over.line()}")
    if cfg.is_moe:
        lines.insert(1, f"  {moe_line(cfg, lay, cpu=inst.family == 'cpu')}")
    if cfg.experts_mxfp4:
        lines.insert(1, f"  checkpoint: {checkpoint_bytes(cfg) / 1e9:.2f} GB as stored (MXFP4 experts), "
                        f"dequantized to {d.dtype} at load")
    if plan.ttft is not None and plan.tpot is not None and plan.prefill_bucket and plan.decode_bucket:
        band = error_band(inst.family)
        ttft_pm = "" if band is None else f" +-{band.ttft_pct:.0f}%"
        tpot_pm = "" if band is None else f" +-{band.tpot_pct:.0f}%"
        lines.append(
            f"  TTFT {1e3 * plan.ttft.total:.1f} ms{ttft_pm} (prefill bucket {plan.prefill_bucket.kv_len}, "
            f"{plan.ttft.bound}-bound); TPOT {1e3 * plan.tpot.total:.2f} ms{tpot_pm} (decode bucket "
            f"{plan.decode_bucket.batch}x{plan.decode_bucket.kv_len}, {plan.tpot.bound}-bound)"
        )
        b = plan.decode_bucket.batch
        lines.append(f"  sampling in the graph: a step moves {4 * b} B of token ids out, where host sampling would "
                     f"move {4 * b * cfg.vocab_size / 1e6:.2f} MB of logits and add "
                     f"{1e3 * host_sampling_time(cfg, b):.1f} ms (XLA-tier rates, docs/planner.md)")
        if band is not None:
            lines.append(f"  {band.line()}")
        if plan.queue is not None:
            lines.append(f"  {queue_line(plan.queue)}")
    elif inst.family == "cpu":
        lines.append("  latency: not modelled on cpu (measure with `neuron-opt bench`)")
    return lines


KIB = 1024


def cp_heads_lines(cfg: ModelConfig, lay: HeadLayout) -> list[str]:
    """Context-parallel prefill with whole KV heads per rank: what it does, and from which prompt length its
    collectives move fewer bytes than the all-reduce they replace."""
    def length(spmd: bool) -> str:
        n = cp_heads_break_even(cfg, lay, spmd)
        return "never" if n is None else f"from {n:,} tokens"

    return [f"  context-parallel prefill: cp_degree {lay.cp_degree}, each rank runs a prefill step's attention "
            f"for 1/{lay.cp_degree} of its tokens over every head (steps whose token count {lay.cp_degree} "
            f"divides; float q/o weights, no LoRA); per layer, all-gathers of K, V, the q/o weights and the output "
            f"replace the attention's all-reduce",
            f"    fewer bytes on the wire than that all-reduce (a prompt from position 0): {length(False)} with "
            f"true all-gathers; {length(True)} on the neuron backend (torch-xla 2.9: an all-gather is an "
            f"all-reduce of tp times the bytes)"]


def kv_per_token(cfg: ModelConfig, plan: Plan) -> str:
    """The KV bytes one token of a sequence holds: the model's (K and V, every layer), and one rank's at the plan's
    tp where that differs (KV heads split, or replicated where they are fewer than tp)."""
    d = plan.deployment
    model = kv_bytes_per_token(cfg, head_layout(cfg, ParallelConfig(tp=1)), d.kv_dtype)
    rank = kv_bytes_per_token(cfg, plan.layout, d.kv_dtype)
    where = "" if d.tp == 1 else f"; {rank / KIB:.1f} KiB per rank at tp {d.tp}"
    return (f"{model / KIB:.1f} KiB ({cfg.num_hidden_layers} layers x K,V x {cfg.num_key_value_heads} kv heads x "
            f"{cfg.head_dim} x {d.kv_dtype}){where}; {d.max_model_len} tokens: {model * d.max_model_len / GiB:.2f} GiB")


def context_lines(fits: list[tuple[Instance, int | None]], dep: Deployment) -> list[str]:
    """Where `dep`'s context fits (recommend.context_fits): each instance with the smallest tp, or "no"."""
    head = f"context {dep.max_model_len} tokens x batch {dep.batch} ({dep.dtype}, KV {dep.kv_dtype}) fits:"
    return [head] + [f"  {inst.name:<16}" + (f"tp {tp}" if tp is not None else
                                              f"no (not at tp {max(inst.tp_degrees)})") for inst, tp in fits]


def speculative_lines(plan: Plan, preds: list[tuple[str, SpecPrediction]]) -> list[str]:
    """The speculative step against the plain decode step (planner.speculative), one row per acceptance length
    (`preds`: (where the length comes from, the prediction))."""
    first = preds[0][1]
    p, dep, dec = first.proposer, plan.deployment, plan.decode_bucket
    assert dec is not None
    draft = {"ngram": "prompt lookup on the host", "draft_model": f"{p.k} decode steps of the draft model",
             "eagle3": f"{p.k} calls of the head (not fused)"}[p.method]
    extra = p.weight_bytes(dep.dtype, dep.tp) + p.kv_bytes(dep.kv_dtype, dep.tp, dep.batch, dep.max_model_len)
    total = plan.memory.total + extra
    lines = [
        f"speculative decoding: {p.method}, k {p.k}, at the decode bucket (batch {dec.batch}, {dec.kv_len} positions)",
        f"  {'plain decode step':<40}{1e3 * first.decode.total:9.2f} ms",
        f"  {f'verify step ({p.k + 1} tokens a row)':<40}{1e3 * first.verify.total:9.2f} ms",
        f"  {f'draft: {draft}':<40}{1e3 * first.draft_s:9.2f} ms",
        f"  {'proposer weights + KV per rank':<40}{extra / GiB:9.2f} GiB  (total {total / GiB:.2f} of "
        f"{plan.memory.capacity / GiB:.2f} GiB -> " + ("fits)" if total <= plan.memory.capacity else "DOES NOT FIT)"),
        f"  {'acceptance length':<28}{'TPOT ms':>12}{'speedup':>10}",
    ]
    lines += [f"    {f'{s.acceptance_length:.2f} ({where})':<26}{1e3 * s.tpot_s:12.2f}{s.speedup:9.2f}x"
              for where, s in preds]
    lines.append(f"  break-even acceptance length: {first.break_even:.2f} (below it speculation is slower than "
                 "plain decoding)")
    if (fused := first.fused()) is not None:
        lines.append(f"  with the draft chain fused into one graph: draft {1e3 * fused.draft_s:.2f} ms, break-even "
                     f"{fused.break_even:.2f}, " + ", ".join(f"{f.speedup:.2f}x at {f.acceptance_length:.2f}"
                                                             for f in (s.fused() for _, s in preds) if f))
    return lines


def speculative_json(plan: Plan, preds: list[tuple[str, SpecPrediction]]) -> dict[str, Any]:
    first = preds[0][1]
    p, dep = first.proposer, plan.deployment
    return {
        "method": p.method, "num_speculative_tokens": p.k,
        "decode_step_ms": _ms(first.decode.total), "verify_step_ms": _ms(first.verify.total),
        "draft_ms": _ms(first.draft_s), "break_even_acceptance_length": round(first.break_even, 3),
        "fused_draft_ms": None if first.fused_draft_s is None else _ms(first.fused_draft_s),
        "proposer_bytes_per_rank": p.weight_bytes(dep.dtype, dep.tp)
        + p.kv_bytes(dep.kv_dtype, dep.tp, dep.batch, dep.max_model_len),
        "predictions": [{"source": where, "acceptance_length": s.acceptance_length, "tpot_ms": _ms(s.tpot_s),
                         "speedup": round(s.speedup, 3)} for where, s in preds],
    }


def queue_line(q: QueueEstimate) -> str:
    """TTFT / TPOT percentiles under load, with the arrivals and the scheduler policy they assume."""
    arrivals = (f"{q.requests} requests together" if q.arrival.kind == "together"
                else f"{q.requests} Poisson arrivals at {q.arrival.rate:g}/s (seed {q.arrival.seed})")
    tpot = "" if q.tpot_p50 is None else f"; TPOT p50 {1e3 * q.tpot_p50:.2f} ms, p99 {1e3 * (q.tpot_p99 or 0):.2f} ms"
    p = q.policy
    return (f"under load ({arrivals}; {p.max_num_seqs} slots, {p.max_num_batched_tokens} tokens per step, prefill "
            f"batch {p.prefill_batch}, chunked prefill {'on' if p.chunked else 'off'}): TTFT p50 "
            f"{1e3 * q.ttft_p50:.1f} ms, p99 {1e3 * q.ttft_p99:.1f} ms{tpot}"
            + ("; SATURATED: requests arrive faster than this deployment serves them, the queue grows without "
               "bound (the percentiles grow with the number of requests simulated)" if q.saturated else ""))


def ep_table(cfg: ModelConfig, plan: Plan, traffic: Traffic) -> list[str]:
    """A MoE plan's tp at every expert-parallel degree (planner.moe): the trade the automatic choice made."""
    lay = plan.layout
    chosen = f"ep {lay.ep}"
    if lay.hybrid:
        twice = weight_bytes(cfg, lay, plan.deployment.dtype) - \
            weight_bytes(cfg, replace(lay, ep_decode=0), plan.deployment.dtype)
        chosen = (f"ep {lay.ep} for prefill, ep {lay.ep_decode} for decode (hybrid: the experts held twice, "
                  f"+{twice / GiB:.2f} GiB per core; e2e "
                  f"{_fmt(plan.e2e_s(traffic.output_len), 0, 2).strip()} s)")
    rows = [f"expert parallelism at tp {plan.deployment.tp} ({traffic.input_len} in / {traffic.output_len} out, "
            f"concurrency {traffic.concurrency}), chosen: {chosen}",
            "  ep  experts/rank  features/rank  gather below batch  TTFT ms  TPOT ms  e2e s"]
    for e in ep_choices(cfg, plan.deployment.tp):
        p = evaluate(cfg, plan.instance, replace(plan.deployment, ep=e, ep_decode=e), traffic)
        e2e = p.e2e_s(traffic.output_len)
        rows.append(f"  {e:>2}  {p.layout.experts_local:>12}  {p.layout.moe_intermediate_local:>13}  "
                    f"{gather_until(cfg, p.layout):>18}  {_fmt(p.ttft and 1e3 * p.ttft.total, 7, 1)}  "
                    f"{_fmt(p.tpot and 1e3 * p.tpot.total, 7, 2)}  {_fmt(e2e, 5, 2)}")
    return rows


def _fmt(v: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def alternatives_table(plans: list[Plan], traffic: Traffic, limit: int = 8) -> list[str]:
    rows = ["  tp  dtype     fits  GiB/core  max batch  TTFT ms  TPOT ms  e2e s   tok/s/core"]
    for p in plans[:limit]:
        e2e = p.e2e_s(traffic.output_len)
        tpot = p.tpot.total if p.tpot else None
        per_core = (p.decode_bucket.batch / tpot / p.deployment.tp) if (tpot and p.decode_bucket) else None
        rows.append(
            f"  {p.deployment.tp:>2}  {p.deployment.dtype:<9} {'yes' if p.fits else 'no ':<5}"
            f"{p.memory.total / GiB:8.2f}  {p.largest_batch:>9}  "
            f"{'-' if p.ttft is None else f'{1e3 * p.ttft.total:7.1f}':>7}  "
            f"{'-' if tpot is None else f'{1e3 * tpot:7.2f}':>7}  "
            f"{'-' if e2e is None else f'{e2e:6.2f}':>6}  "
            f"{'-' if per_core is None else f'{per_core:8.1f}':>8}"
        )
    return rows


def split_lines(splits: list[Split], traffic: Traffic, target: str) -> list[str]:
    """The tp x data-parallel table of one instance and the split recommended for `target` (and for the other)."""
    inst = splits[0].plan.instance
    out = traffic.output_len
    rows = [f"data-parallel splits of {inst.name} ({inst.cores} NeuronCores), {traffic.concurrency} concurrent "
            f"stream(s) ({traffic.input_len} in / {out} out), one request after another per stream:",
            "  tp  replicas  streams each  dtype     fits  TTFT ms  TPOT ms  request s  out tok/s"]
    for s in splits:
        p, rnd, thr = s.plan, s.round_s(out), s.throughput(out)
        rows.append(
            f"  {s.tp:>2}  {s.replicas:>8}  {s.streams:>12}  {p.deployment.dtype:<9} {'yes' if p.fits else 'no ':<5}"
            f"{'-' if p.ttft is None else f'{1e3 * p.ttft.total:7.1f}':>7}  "
            f"{'-' if p.tpot is None else f'{1e3 * p.tpot.total:7.2f}':>7}  "
            f"{'-' if rnd is None else f'{rnd:9.2f}':>9}  {'-' if thr is None else f'{thr:9.0f}':>9}"
        )
    for t in sorted(TARGETS, key=lambda t: t != target):
        pick = recommend_split(splits, out, t)
        head = f"recommended for {t}:" if t == target else f"for {t}:"
        if pick is None:
            rows.append(f"{head} no split fits")
            continue
        d, lay = pick.plan.deployment, pick.plan.layout
        experts = "" if lay.experts_local == 0 else f" --ep {lay.ep}" + (
            f" --ep-decode {lay.ep_decode}" if lay.hybrid else "")
        rows.append(f"{head} tp {pick.tp} x {pick.replicas} replica(s) ({pick.throughput(out):.0f} out tok/s, "
                    f"request {pick.round_s(out):.2f} s): compile --tp {pick.tp}{experts} --batch-size {d.batch}, then "
                    f"serve ARTIFACT --data-parallel {pick.replicas}")
    return rows


def split_json(split: Split, output_len: int) -> dict[str, Any]:
    return {"tp": split.tp, "replicas": split.replicas, "streams_per_replica": split.streams,
            "batch_size": split.plan.deployment.batch, "dtype": split.plan.deployment.dtype, "fits": split.plan.fits,
            "ttft_ms": _ms(split.plan.ttft.total if split.plan.ttft else None),
            "tpot_ms": _ms(split.plan.tpot.total if split.plan.tpot else None),
            "request_latency_s": split.round_s(output_len), "output_throughput": split.throughput(output_len)}


def _band_json(plan: Plan) -> dict[str, Any] | None:
    """The held-out error of the latency model on this instance family (None: no latency, or no rows)."""
    band = error_band(plan.instance.family) if plan.ttft is not None else None
    if band is None:
        return None
    return {
        "family": band.family,
        "held_out_rows": band.rows,
        "coverage": band.coverage,
        "ttft_pct": round(band.ttft_pct, 1),
        "tpot_pct": round(band.tpot_pct, 1),
    }


def _latency_json(cfg: ModelConfig, plan: Plan) -> dict[str, Any]:
    """TTFT / TPOT in ms: the p50 (and p99) under the plan's arrivals when it has a queue estimate, else one step
    on an idle instance (p99 then None), with the single-request step figures alongside."""
    q = plan.queue
    out: dict[str, Any] = {
        "ttft_ms": _ms(q.ttft_p50 if q else plan.ttft.total if plan.ttft else None),
        "tpot_ms": _ms(q.tpot_p50 if q and q.tpot_p50 is not None else plan.tpot.total if plan.tpot else None),
        "ttft_p99_ms": _ms(q.ttft_p99 if q else None),
        "tpot_p99_ms": _ms(q.tpot_p99 if q else None),
        "step_ttft_ms": _ms(plan.ttft.total if plan.ttft else None),
        "step_tpot_ms": _ms(plan.tpot.total if plan.tpot else None),
        "host_sampling_ms": _ms(host_sampling_time(cfg, plan.decode_bucket.batch)
                                if plan.tpot and plan.decode_bucket else None),
    }
    out["queue"] = None if q is None else {
        "arrival": q.arrival.kind, "rate": q.arrival.rate, "requests": q.requests,
        "seed": q.arrival.seed if q.arrival.kind == "poisson" else None,
        "max_num_seqs": q.policy.max_num_seqs, "max_num_batched_tokens": q.policy.max_num_batched_tokens,
        "prefill_batch": q.policy.prefill_batch, "chunked_prefill": q.policy.chunked, "saturated": q.saturated}
    return out


def _overhead_json(cfg: ModelConfig, plan: Plan) -> dict[str, Any]:
    over = layout_overhead(cfg, plan.layout, plan.deployment.dtype)
    return {
        "padded": list(over.padded),
        "extra_weight_bytes_per_core": over.extra_weight_bytes,
        "extra_linear_flops_fraction": round(over.extra_linear_flops, 4),
    }


def plan_json(cfg: ModelConfig, plan: Plan, alternatives: list[Plan] | None = None) -> dict[str, Any]:
    d, m = plan.deployment, plan.memory
    out: dict[str, Any] = {
        "fits": m.fits,
        "per_core_memory_gb": round(m.total / GB, 3),
        "per_core_capacity_gb": round(m.capacity / GB, 3),
        **_latency_json(cfg, plan),
        "error_band": _band_json(plan),
        "tp": d.tp,
        "batch_size": d.batch,
        "instance": plan.instance.name,
        "dtype": d.dtype,
        "kv_dtype": d.kv_dtype,
        "max_prompt_len": d.max_prompt_len,
        "max_model_len": d.max_model_len,
        "gqa_strategy": plan.layout.strategy,
        "cp_degree": plan.layout.cp_degree,
        "ep": plan.layout.ep,
        "ep_decode": plan.layout.decode_layout().ep,
        "moe": None if not cfg.is_moe else {
            "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "experts_per_rank":
            plan.layout.experts_local, "expert_features_per_rank": plan.layout.moe_intermediate_local,
            "gather_below_batch": gather_until(cfg, plan.layout.decode_layout()),
            "active_parameters": cfg.active_parameters()},
        "padding": _overhead_json(cfg, plan),
        "lora": None if d.lora is None else d.lora.to_dict(),
        "memory_bytes": {
            "weights": m.weights,
            "kv_cache": m.kv_cache,
            "kv_cache_window": m.kv_cache_window,
            "scratch": m.scratch,
            "lora": m.lora,
            "vision": m.vision,
            "reserve": m.reserve,
            "total": m.total,
            "capacity": m.capacity,
        },
        "host_memory_bytes": {"needed": m.host_needed, "capacity": m.host_capacity, "fits": m.host_fits},
        "kv_bytes_per_token": {"model": kv_bytes_per_token(cfg, head_layout(cfg, ParallelConfig(tp=1)), d.kv_dtype),
                               "rank": kv_bytes_per_token(cfg, plan.layout, d.kv_dtype)},
        "largest_batch": plan.largest_batch,
        "largest_max_length": plan.largest_length,
        "buckets": plan.buckets.to_dict(),
        "num_parameters": cfg.num_parameters(),
    }
    if alternatives is not None:
        out["alternatives"] = [plan_json(cfg, p) for p in alternatives]
    return out


def format_plan_table(
    cfg: ModelConfig,
    par: ParallelConfig,
    cache: CacheConfig,
    buckets: BucketConfig,
    instance: str = "cpu",
    dtype: str | None = None,
    compile_ranks_held: int | None = None,
) -> str:
    """The plan `compile` prints before compiling: memory per rank, fit, buckets (and latency on Neuron).

    Args:
        cfg: the model.
        par: tp degree and GQA strategy (the layout is derived with neuron_opt.parallel.sharding).
        cache: KV slots (max_batch), KV length and KV dtype.
        buckets: the buckets about to be compiled.
        instance: an instance name from the table, or "cpu" (capacity = this machine's RAM).
        dtype: weight dtype; defaults to the cache dtype.
        compile_ranks_held: rank models the compile process holds at once (None: tp, the neuron backend).
    """
    inst = get_instance(instance)
    dep = Deployment(
        par.tp, cache.max_batch, buckets.prefill_lens[-1], cache.max_model_len, dtype or cache.dtype,
        cache.kv_cache_dtype.value if cache.kv_cache_dtype is KVCacheDtype.FP8 else cache.dtype,
        compile_ranks_held, block_size=cache.block_size, window_kv=cache.sliding_window > 0,
    )
    return "\n".join(plan_lines(cfg, evaluate(cfg, inst, dep, par=par, buckets=buckets)))
