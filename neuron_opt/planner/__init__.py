"""Will it fit, how fast will it be, which tp and buckets: the planner behind `neuron-opt plan` and `compile`.

- hardware.py: sourced instance table, tp validation (`check_tp`, `get_instance`).
- memory.py: bytes per NeuronCore (weights, KV, scratch, reserve) and host RAM.
- latency.py: TTFT / TPOT from FLOPs, bytes, collectives and fixed overheads.
- queueing.py: TTFT / TPOT percentiles under load: the scheduler's policy replayed over arrivals.
- recommend.py: evaluate one deployment, rank the alternatives for a traffic shape.
- report.py: text and JSON renderings; `format_plan_table` for `compile`.
"""

from __future__ import annotations

from neuron_opt.planner.hardware import INSTANCES, Instance, check_tp, get_instance, known_instances
from neuron_opt.planner.recommend import Deployment, Plan, Traffic, candidates, evaluate, rank
from neuron_opt.planner.report import format_plan_table, plan_json

__all__ = [
    "INSTANCES",
    "Deployment",
    "Instance",
    "Plan",
    "Traffic",
    "candidates",
    "check_tp",
    "evaluate",
    "format_plan_table",
    "get_instance",
    "known_instances",
    "plan_json",
    "rank",
]
