"""The replicas' Prometheus metrics merged into the router's `/metrics`, each sample labelled with its `replica`,
and the router's routing metrics (`cluster_routed`, `cluster_prefix_cache_hit_rate`)."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from neuron_opt.server.cluster.routing import ROUTING
from neuron_opt.server.metrics import PREFIX, VLLM


class Merged:
    """A collector yielding parsed metric families (prometheus_client's registry renders them)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Any:
        yield from self.families


def merge_metrics(texts: dict[str, str]) -> list[Any]:
    """Each replica's Prometheus families, merged by name, every sample labelled with its `replica`."""
    merged: dict[str, Any] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = type(fam)(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                            for s in fam.samples]
    return list(merged.values())


def routing_families(replica_families: list[Any]) -> list[Any]:
    """The router's own: requests routed per replica and why (`prefix`: to the replica holding the prompt's
    prefix; `balance`: away from it, past the balance threshold; `full`: it had no room; `load`: no prefix
    remembered, or `--routing load`), and the cluster's prefix-cache hit rate (the replicas' hits / queries)."""
    routed = CounterMetricFamily(PREFIX + "cluster_routed", "Requests the router sent to each replica, by reason.",
                                 labels=["replica", "reason"])
    for (replica, reason), n in sorted(ROUTING.routed.items()):
        routed.add_metric([replica, reason], n)
    totals = {name: sum(s.value for f in replica_families if f.name == VLLM + name for s in f.samples
                        if s.name.endswith("_total"))
              for name in ("prefix_cache_hits", "prefix_cache_queries")}
    rate = GaugeMetricFamily(PREFIX + "cluster_prefix_cache_hit_rate", "Prefix-cache hits / queries summed over "
                             "the live replicas (0-1).")
    rate.add_metric([], totals["prefix_cache_hits"] / totals["prefix_cache_queries"]
                    if totals["prefix_cache_queries"] else 0.0)
    return [routed, rate]
