"""tp x data-parallel splits of one instance: how many replicas of which tp degree serve a traffic shape best.

`serve --data-parallel N` runs N replicas of one artifact, each on its own tp NeuronCores (docs/scale_out.md). An
inf2.48xlarge has 24 cores: one tp=24 replica, or 12 replicas at tp=2, or anything between. Fewer cores per
replica make each step slower (less bandwidth and compute per replica) but split the concurrent streams over more
replicas, so each replica runs a smaller batch.

Design decisions:
- A split is `replicas` identical replicas, each evaluated as the single-replica planner evaluates it
  (neuron_opt.planner.recommend.evaluate: memory per core, TTFT, TPOT at its decode bucket) with its share of the
  concurrency: ceil(concurrency / replicas) streams, which is also its KV slots unless `--batch-size` says more.
  Memory per core does not depend on the replica count: each replica holds its own copy on its own cores.
- Steady state is a closed loop: every stream sends its next request when the last one ends. A replica finishes
  its c streams' requests in one round of ceil(c / prefill batch) prefills (TTFT each; a prefill step stops the
  decode steps, as our engine runs them) and output_len decode steps at batch c. Request latency is that round;
  throughput is c * output_len / round per busy replica (a replica with no stream adds nothing). At c = 1 the
  round is the planner's e2e latency (TTFT + output_len * TPOT).
- Targets: `throughput` takes the split with the most output tokens/s; `latency` the one with the lowest request
  latency. Among the splits within RECOMMEND_SLACK of the winner on its target, the other metric decides (more
  throughput, or lower latency), so a near tie is settled by what the second metric buys. Only fitting splits
  that use no quantized dtype compete when a bfloat16 one fits (as `rank` does).
- Replicas fill the instance: cores // tp of them, unless the caller fixes the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_opt.config import ModelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.lora.config import LoraConfig
from neuron_opt.planner.hardware import Instance
from neuron_opt.planner.memory import QUANTIZED
from neuron_opt.planner.recommend import RECOMMEND_SLACK, Deployment, Plan, Traffic, evaluate

TARGETS = ("latency", "throughput")


@dataclass(frozen=True)
class Split:
    """`replicas` copies of one replica's plan, each serving `streams` of the concurrent streams."""

    plan: Plan
    replicas: int
    streams: int  # concurrent streams per replica (the busiest one)
    busy: int  # replicas with at least one stream

    @property
    def tp(self) -> int:
        return self.plan.deployment.tp

    @property
    def cores(self) -> int:
        return self.tp * self.replicas

    def round_s(self, output_len: int) -> float | None:
        """Seconds for a replica to finish one request of each of its streams (the request latency)."""
        p = self.plan
        if p.ttft is None or p.tpot is None or p.prefill_bucket is None:
            return None
        prefills = -(-self.streams // p.prefill_bucket.batch)
        return prefills * p.ttft.total + output_len * p.tpot.total

    def throughput(self, output_len: int) -> float | None:
        """Output tokens/s of all replicas together."""
        r = self.round_s(output_len)
        return None if r is None else self.busy * self.streams * output_len / r


def splits(
    cfg: ModelConfig,
    inst: Instance,
    traffic: Traffic,
    *,
    max_prompt_len: int,
    max_model_len: int,
    batch: int | None = None,
    replicas: int | None = None,
    dtypes: tuple[str, ...] = ("bfloat16",),
    kv_dtype: str = "bfloat16",
    lora: LoraConfig | None = None,
    window_kv: bool = False,
) -> list[Split]:
    """Every tp degree of the instance (with `replicas` fixed, those that leave room for them), each replicated
    over the cores, for each dtype.

    Args:
        cfg: the model.
        inst: a Neuron instance (no latency is modelled on cpu).
        traffic: prompt/output lengths and the concurrency of the whole service.
        max_prompt_len: largest prefill bucket.
        max_model_len: KV length per sequence.
        batch: KV slots per replica (default: its share of the concurrency).
        replicas: fix the replica count (default: as many as the cores hold).
        dtypes: weight dtypes to try.
        kv_dtype: KV cache dtype.
        lora: the LoRA adapter capacity each replica carries (None: none).
        window_kv: the backend holds window-sized KV for sliding-window layers (Deployment.window_kv).
    """
    if inst.family == "cpu":
        raise ConfigError("data-parallel splits: latency is not modelled on cpu; give a Neuron --instance")
    if replicas is not None and replicas < 1:
        raise ConfigError(f"--data-parallel: must be >= 1, got {replicas}", param="data_parallel")
    out = []
    for dtype in dtypes:
        for tp in inst.tp_degrees:
            n = inst.cores // tp if replicas is None else replicas
            if n < 1 or tp * n > inst.cores:
                continue
            streams = -(-traffic.concurrency // n)
            share = Traffic(traffic.input_len, traffic.output_len, streams)
            dep = Deployment(tp, max(batch or streams, streams), max_prompt_len, max_model_len, dtype, kv_dtype,
                             lora=lora, window_kv=window_kv)
            out.append(Split(evaluate(cfg, inst, dep, share), n, streams, min(n, traffic.concurrency)))
    if replicas is not None and not out:
        raise ConfigError(f"--data-parallel {replicas}: {inst.name} has {inst.cores} NeuronCores, fewer than "
                          f"{replicas} replicas of the smallest tp ({min(inst.tp_degrees)})", param="data_parallel")
    return out


def recommend_split(candidates: list[Split], output_len: int, target: str) -> Split | None:
    """The split for `target` (module docstring), or None when none fits."""
    if target not in TARGETS:
        raise ConfigError(f"--target: {target!r} is not one of {', '.join(TARGETS)}", param="target")
    fit = [s for s in candidates if s.plan.fits and s.round_s(output_len) is not None]
    if any(s.plan.deployment.dtype not in QUANTIZED for s in fit):
        fit = [s for s in fit if s.plan.deployment.dtype not in QUANTIZED]
    if not fit:
        return None

    def thr(s: Split) -> float:
        return s.throughput(output_len) or 0.0

    def lat(s: Split) -> float:
        return s.round_s(output_len) or float("inf")

    if target == "throughput":
        best = max(map(thr, fit))
        return min((s for s in fit if thr(s) >= best / (1 + RECOMMEND_SLACK)), key=lambda s: (lat(s), -thr(s)))
    best = min(map(lat, fit))
    return max((s for s in fit if lat(s) <= best * (1 + RECOMMEND_SLACK)), key=lambda s: (thr(s), -lat(s)))
