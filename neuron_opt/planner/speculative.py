"""What speculative decoding buys a deployment: the plan's decode step against a verify step plus the proposer.

With k proposals a step and an acceptance length tau (tokens a verify step emits: the accepted proposals and the
target's own token, between 1 and k + 1), a speculative step costs

    verify(k + 1 tokens a row) + draft(k proposals)

and emits tau tokens, so TPOT = (verify + draft) / tau against the plain decode step's, and the break-even
acceptance length is (verify + draft) / decode. The verify step is the decode graph's model with k + 1 tokens a row
(`latency.decode_time(tokens_per_row=)`: the weights and KV read once, compute and messages times k + 1). The
proposer:

- `ngram`: prompt lookup on the host, no device work (microseconds a step against milliseconds);
- `draft_model`: k decode steps of the draft model at the target's tp and bucket;
- `eagle3`: k calls of the head's graph (our runtime does not fuse the draft chain: each call pays a graph
  execution's fixed cost; the prediction also shows the chain fused into one graph), each reading the head's one
  decoder layer (q/k/v over [embed, hidden], 2H wide) and its draft-vocabulary LM head, the first also `fc` over
  the target's auxiliary states, and the head's own KV over the bucket's length, each split over the ranks as the
  target's layers are (with a layer's collectives).

Every step is a verify step here (vLLM's and our `always` mode); the adaptive controller, which skips speculation
where it would not pay, can only do better than this prediction. The acceptance length is the user's (measured
by our benchmarks, or the server's `vllm:spec_decode_*` counters): it depends on the text, never on the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner.hardware import Instance
from neuron_opt.planner.latency import DEFAULT_EFFICIENCY, Efficiency, StepTime, collectives_time, decode_time
from neuron_opt.planner.memory import dtype_bytes, kv_bytes_per_token, weight_bytes
from neuron_opt.planner.recommend import Plan

METHODS = ("ngram", "draft_model", "eagle3")


@dataclass(frozen=True)
class Proposer:
    """What proposes the k tokens of a step.

    Attributes:
        method: one of METHODS.
        k: proposals a step (--num-speculative-tokens).
        draft: draft_model: the draft's config; eagle3: the head's decoder layer as a one-layer config.
        draft_vocab_size: eagle3: the rows of the head's LM head.
        fc_inputs: eagle3: the width `fc` reads (the target's auxiliary states, concatenated).
    """

    method: str
    k: int
    draft: ModelConfig | None = None
    draft_vocab_size: int = 0
    fc_inputs: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_method: {self.method!r} is not one of {', '.join(METHODS)}",
                              param="speculative_method")
        if self.k < 1:
            raise ConfigError(f"num_speculative_tokens: must be >= 1, got {self.k}", param="num_speculative_tokens")
        if self.method != "ngram" and self.draft is None:
            raise ConfigError(f"speculative_method {self.method}: the draft's config is needed",
                              param="speculative_model")

    def weight_bytes(self, dtype: str, tp: int) -> int:
        """Bytes of the proposer's weights on one rank (ngram: none)."""
        if self.method == "ngram":
            return 0
        assert self.draft is not None
        if self.method == "draft_model":
            return weight_bytes(self.draft, head_layout(self.draft, ParallelConfig(tp=tp)), dtype)
        return _eagle3_params(self, first=True, tp=tp) * dtype_bytes(dtype)

    def kv_bytes(self, kv_dtype: str, tp: int, batch: int, max_model_len: int) -> int:
        """Bytes of the proposer's KV cache on one rank for `batch` sequences of `max_model_len` positions: the
        draft model's, the head's one layer (both sharded as the target's)."""
        if self.method == "ngram":
            return 0
        assert self.draft is not None
        if self.method == "draft_model":
            lay = head_layout(self.draft, ParallelConfig(tp=tp))
            return int(kv_bytes_per_token(self.draft, lay, kv_dtype) * batch * max_model_len)
        lay = head_layout(self.draft, ParallelConfig(tp=tp))
        return 2 * lay.n_kv_local * self.draft.head_dim * dtype_bytes(kv_dtype) * batch * max_model_len


def eagle3_like(target: ModelConfig, k: int) -> Proposer:
    """An EAGLE-3 head shaped like one of the target's layers over its whole vocabulary (what `train-eagle3` makes)."""
    return Proposer("eagle3", k, replace(target, num_hidden_layers=1), target.vocab_size, 3 * target.hidden_size)


def _eagle3_params(p: Proposer, first: bool, tp: int = 1) -> int:
    """Weight elements one head call reads on one of `tp` ranks: q/k/v over [embed, hidden] (2H), o, the MLP, the
    LM head (each split over the ranks as the target's are), `fc` on the first call of the chain."""
    c = p.draft
    assert c is not None
    lay = head_layout(c, ParallelConfig(tp=tp))
    h, d = c.hidden_size, c.head_dim
    attention = 2 * h * (lay.n_heads_local + 2 * lay.n_kv_local) * d + lay.n_heads_local * d * h
    mlp = 3 * h * lay.intermediate_local
    lm_head = -(-p.draft_vocab_size // tp) * h
    return attention + mlp + lm_head + (-(-p.fc_inputs // tp) * h if first else 0)


def _eagle3_call(p: Proposer, inst: Instance, *, tp: int, batch: int, kv_len: int, dtype: str, kv_dtype: str,
                 eff: Efficiency, first: bool) -> StepTime:
    c = p.draft
    assert c is not None
    lay = head_layout(c, ParallelConfig(tp=tp))
    params = _eagle3_params(p, first, tp)
    flops = 2.0 * batch * params + 4.0 * batch * lay.n_heads_local * kv_len * c.head_dim
    kv = 2 * batch * lay.n_kv_local * kv_len * c.head_dim * dtype_bytes(kv_dtype)
    return StepTime(compute=flops / (inst.bf16_flops_per_core * eff.tensor),
                    memory=(params * dtype_bytes(dtype) + kv) / (inst.hbm_bw_per_core * eff.hbm),
                    collective=collectives_time(c, lay, inst, batch, eff), overhead=eff.step_overhead_s)


def draft_time(p: Proposer, inst: Instance, *, tp: int, batch: int, kv_len: int, dtype: str, kv_dtype: str,
               eff: Efficiency = DEFAULT_EFFICIENCY, fused: bool = False) -> float:
    """Seconds the proposer takes for one step's k proposals; `fused` (eagle3): the chain as one graph."""
    if p.method == "ngram":
        return 0.0
    assert p.draft is not None
    if p.method == "draft_model":
        lay = head_layout(p.draft, ParallelConfig(tp=tp))
        return p.k * decode_time(p.draft, lay, inst, batch=batch, kv_len=kv_len, dtype=dtype, kv_dtype=kv_dtype,
                                 eff=eff).total
    calls = [_eagle3_call(p, inst, tp=tp, batch=batch, kv_len=kv_len, dtype=dtype, kv_dtype=kv_dtype, eff=eff,
                          first=i == 0) for i in range(p.k)]
    if fused:  # one graph execution for the whole chain: its fixed cost once
        return sum(c.total for c in calls) - (p.k - 1) * eff.step_overhead_s
    return sum(c.total for c in calls)


@dataclass(frozen=True)
class SpecPrediction:
    """The plain decode step against a speculative step, at one acceptance length."""

    proposer: Proposer
    acceptance_length: float
    decode: StepTime  # the plain decode step (the plan's TPOT)
    verify: StepTime  # k + 1 tokens a row
    draft_s: float
    fused_draft_s: float | None = None  # eagle3: the chain fused into one graph call

    def fused(self) -> SpecPrediction | None:
        """The same step with the draft chain fused (eagle3), None for the other methods."""
        return None if self.fused_draft_s is None else replace(self, draft_s=self.fused_draft_s, fused_draft_s=None)

    @property
    def step_s(self) -> float:
        return self.verify.total + self.draft_s

    @property
    def tpot_s(self) -> float:
        return self.step_s / self.acceptance_length

    @property
    def speedup(self) -> float:
        return self.decode.total / self.tpot_s

    @property
    def break_even(self) -> float:
        """The acceptance length at which speculation neither gains nor loses."""
        return self.step_s / self.decode.total


def check_acceptance(length: float, k: int) -> float:
    if not 1.0 <= length <= k + 1:
        raise ConfigError(f"acceptance_length: {length} is outside [1, k + 1] = [1, {k + 1}] (a verify step emits the "
                          "accepted proposals and one token of the target's own)", param="acceptance_length")
    return length


def predict(cfg: ModelConfig, plan: Plan, p: Proposer, acceptance_length: float) -> SpecPrediction:
    """The speculative step of `p` at the plan's decode bucket (its TPOT's), in the plan's layout."""
    dep, dec = plan.deployment, plan.decode_bucket
    if plan.tpot is None or dec is None:
        raise ConfigError(f"speculative decoding: latency is modelled on Neuron instances, not on {plan.instance.name}",
                          param="instance")
    kw = dict(batch=dec.batch, kv_len=dec.kv_len, dtype=dep.dtype, kv_dtype=dep.kv_dtype)
    verify = decode_time(cfg, plan.layout.decode_layout(), plan.instance, lora=dep.lora, tokens_per_row=p.k + 1,
                         **kw)  # type: ignore[arg-type]
    fused = draft_time(p, plan.instance, tp=dep.tp, fused=True, **kw) if p.method == "eagle3" else None  # type: ignore[arg-type]
    return SpecPrediction(p, check_acceptance(acceptance_length, p.k), decode=plan.tpot, verify=verify,
                          draft_s=draft_time(p, plan.instance, tp=dep.tp, **kw),  # type: ignore[arg-type]
                          fused_draft_s=fused)


# benchmark modes (scripts/bench_spec.py, bench_eagle3.py) that measure a method with every step speculating
_BENCH_MODES = {"ngram": ("spec-always", "ngram-always"), "draft_model": ("draft-always",),
                "eagle3": ("eagle3-always",)}


def acceptance_from_bench(data: Any, method: str, k: int, where: str) -> list[tuple[str, float]]:
    """(workload, mean accepted length) of each row of one of our speculative benchmarks' JSON measuring `method`
    with `k` proposals and every step speculating, as the prediction assumes."""
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ConfigError(f"acceptance_length: {where} is not a benchmark JSON of ours (no 'results' list)",
                          param="acceptance_length")
    modes = _BENCH_MODES[method]
    found = [(str(r.get("workload") or data.get("benchmark") or "measured"), float(r["mean_accepted_length"]))
             for r in rows if isinstance(r, dict) and r.get("mode") in modes and r.get("k") == k
             and isinstance(r.get("mean_accepted_length"), (int, float))]
    if not found:
        have = sorted({(r.get("mode"), r.get("k")) for r in rows if isinstance(r, dict)
                       and r.get("mean_accepted_length") is not None}, key=str)
        raise ConfigError(f"acceptance_length: {where} has no row of mode {' or '.join(modes)} at k {k} with a "
                          f"mean_accepted_length; it has (mode, k): {have}", param="acceptance_length")
    return found
