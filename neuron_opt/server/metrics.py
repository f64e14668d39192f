"""Prometheus metrics, labelled with `model_name`: vLLM's names (`vllm:` prefix) for everything vLLM has, so its
Grafana dashboard and autoscaler examples (KEDA on `vllm:num_requests_waiting`) work unchanged, and the LoRA info
gauge (`vllm:lora_requests_info`) that LoRA-aware routers read; ours keep the `neuron_opt:` prefix (refusals, LoRA
counts, the prefix-cache hit rate, the speculative controller's steps, the KV tier's blocks and bytes; its hits are
vLLM's external prefix cache counters).

Latencies are measured in the server process with one monotonic clock: TTFT from the moment the HTTP request
was received to the first generated token, inter-token latency between consecutive tokens of a request, e2e
from receipt to the last token. A finished request's phases, as vLLM splits them: queue (receipt to its first
scheduling), prefill (first scheduling to first token), decode (first to last token), inference (first scheduling
to last token); the engine stamps the first scheduling and every token's time. Running/waiting gauges read the
engine at scrape time. Each app gets its own registry, so several servers (tests) can live in one process.

Requests refused before they run are counted by reason (`request_rejected_total{reason}`): bad_request (400),
unauthorized (401), not_found (404, an unknown model), body_too_large (413), queue_full (503).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# vLLM's bucket edges (seconds), trimmed at the top
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
PREFIX = "neuron_opt:"  # ours
VLLM = "vllm:"  # vLLM's names


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to `max_model_len`."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10
# vLLM's edges for tokens per engine step (iteration_tokens_total) and for a request's n
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


REJECTION_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 413: "body_too_large",
                     503: "queue_full"}


class _SpecCollector:
    """Speculative-decoding counters (vLLM's spec_decode_* names), read from the engine at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], Any]) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Any:
        st = self.stats()
        for name, doc, value in (
            (VLLM + "spec_decode_num_drafts", "Verify rows that carried proposed tokens.", st.drafts),
            (VLLM + "spec_decode_num_draft_tokens", "Proposed tokens scored.", st.draft_tokens),
            (VLLM + "spec_decode_num_accepted_tokens", "Proposed tokens accepted.", st.accepted_tokens),
            (PREFIX + "spec_decode_num_verify_steps", "Engine steps run as a verify call.", st.verify_steps),
            (PREFIX + "spec_decode_num_skipped_steps", "Steps with proposals the controller decoded instead.",
             st.skipped_steps),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        g = GaugeMetricFamily(PREFIX + "spec_decode_mean_accepted_length",
                              "Tokens emitted per draft (accepted proposals + the target's own token).",
                              labels=["model_name"])
        g.add_metric([self.model_name], st.mean_accepted_length)
        yield g


class _DeviceCollector:
    """The graph calls against the engine's steps (the runner's RunnerStats and the engine's summed step time),
    read at scrape time: the time the device is busy with graphs (as the host sees a call: inputs in, the graph,
    outputs out) against the steps' wall time, the bytes the graphs returned to the host, and where tokens were
    sampled (in the graph, or on the host for a row the graph cannot sample exactly)."""

    def __init__(self, model_name: str, stats: Callable[[], tuple[Any, float]]) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Any:
        runner, step_s = self.stats()
        for name, doc, value in (
            (PREFIX + "graph_busy_seconds_total", "Wall time inside the model's graph calls.", runner.graph_s),
            (PREFIX + "engine_step_seconds_total", "Wall time of the engine's steps.", step_s),
            (PREFIX + "device_to_host_bytes_total", "Bytes the graph calls moved device to host.",
             runner.d2h_bytes),
            (PREFIX + "device_sampled_tokens_total", "Tokens sampled inside the graphs.", runner.device_sampled),
            (PREFIX + "host_sampling_fallback_total", "Rows sampled on the host from logits by an executor that "
             "samples on the device (parameters the graph cannot sample exactly; speculative verification).",
             runner.host_fallback),
        ):
            c = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        g = GaugeMetricFamily(PREFIX + "graph_busy_fraction", "Graph call time over the engine's step time, "
                              "since start (0-1).", labels=["model_name"])
        g.add_metric([self.model_name], runner.graph_s / step_s if step_s else 0.0)
        yield g


class _StepCollector:
    """`vllm:iteration_tokens_total`: tokens scheduled per engine step, as a histogram built at scrape time from
    the engine's count of steps by token count."""

    def __init__(self, model_name: str, step_tokens: Callable[[], Any]) -> None:
        self.model_name, self.step_tokens = model_name, step_tokens

    def collect(self) -> Any:
        counts = sorted(dict(self.step_tokens()).items())
        h = HistogramMetricFamily(VLLM + "iteration_tokens_total", "Tokens scheduled per engine step.",
                                  labels=["model_name"])
        buckets = [(str(float(edge)), sum(c for v, c in counts if v <= edge)) for edge in STEP_TOKEN_BUCKETS]
        h.add_metric([self.model_name], [*buckets, ("+Inf", sum(c for _, c in counts))],
                     sum(v * c for v, c in counts))
        yield h


class _CacheCollector:
    """KV block pool counters (vLLM's prefix_cache_queries / prefix_cache_hits, in tokens, and preemptions), read
    from the engine at scrape time; the hit rate is hits / queries."""

    def __init__(self, model_name: str, prefix_stats: Callable[[], Any], preemptions: Callable[[], int]) -> None:
        self.model_name, self.prefix_stats, self.preemptions = model_name, prefix_stats, preemptions

    def collect(self) -> Any:
        st = self.prefix_stats()
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", st.queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).", st.hits),
            ("num_preemptions", "Sequences preempted (KV blocks taken back, recomputed later).", self.preemptions()),
        ):
            c = CounterMetricFamily(VLLM + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        g = GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate", "Prefix cache hits / queries since start (0-1).",
                              labels=["model_name"])
        g.add_metric([self.model_name], st.hit_rate)
        yield g


class _LoraInfoCollector:
    """vLLM's `vllm:lora_requests_info` gauge: labels `running_lora_adapters` and `waiting_lora_adapters` (the
    adapters of the running and of the waiting requests, comma-joined names, "" for none) and `max_lora` (adapters
    one batch can hold); its value the current time, so a reader takes the newest series. vLLM sets a new series
    every engine iteration and keeps the old ones; built at scrape time from the engine's last step, only the
    current one is exported (the newest is the same, and the series do not pile up)."""

    def __init__(self, max_lora: int, adapters: Callable[[], tuple[dict[str, int], dict[str, int]]]) -> None:
        self.max_lora, self.adapters = max_lora, adapters

    def collect(self) -> Any:
        running, waiting = self.adapters()
        g = GaugeMetricFamily(VLLM + "lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        g.add_metric([str(self.max_lora), ",".join(waiting), ",".join(running)], time.time())
        yield g


class _TierCollector:
    """The second KV tier (runtime/kv_tier.py): vLLM's external prefix cache counters (tokens looked up in it and
    restored from it, as vLLM counts its KV connector's), and ours for its blocks and bytes."""

    def __init__(self, model_name: str, tier: Any) -> None:
        self.model_name, self.tier = model_name, tier

    def collect(self) -> Any:
        st = self.tier.stats
        for name, doc, value in (
            (VLLM + "external_prefix_cache_queries", "Prompt tokens looked up in the KV tier (past the pool's hits).",
             st.queries),
            (VLLM + "external_prefix_cache_hits", "Prompt tokens restored from the KV tier (not prefilled).", st.hits),
            (PREFIX + "kv_offload_stored_blocks", "Blocks copied into the KV tier as the pool evicted them.",
             st.stored),
            (PREFIX + "kv_offload_evicted_blocks", "Blocks the KV tier dropped for room (LRU).", st.evicted),
            (PREFIX + "kv_offload_corrupt_blocks", "KV tier entries whose bytes failed their digest (dropped, "
             "recomputed).", st.corrupt),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        restored = CounterMetricFamily(PREFIX + "kv_offload_restored_blocks", "Blocks copied back into the pool, by "
                                       "the KV tier's level.", labels=["model_name", "tier"])
        held = GaugeMetricFamily(PREFIX + "kv_offload_bytes", "Bytes held by the KV tier, by level.",
                                 labels=["model_name", "tier"])
        for level, blocks, size in (("ram", st.restored_ram, self.tier.num_bytes),
                                    ("disk", st.restored_disk, self.tier.disk_num_bytes)):
            restored.add_metric([self.model_name, level], blocks)
            held.add_metric([self.model_name, level], size)
        yield restored
        yield held


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        num_running: Callable[[], int],
        num_waiting: Callable[[], int],
        kv_usage: Callable[[], float],
        spec_stats: Callable[[], Any] | None = None,
        prefix_stats: Callable[[], Any] | None = None,
        preemptions: Callable[[], int] = lambda: 0,
        loras: Any = None,
        max_model_len: int = 8192,
        step_tokens: Callable[[], Any] | None = None,
        lora_adapters: Callable[[], tuple[dict[str, int], dict[str, int]]] | None = None,
        kv_tier: Any = None,
        device_stats: Callable[[], tuple[Any, float]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        if spec_stats is not None:  # only when the engine speculates
            self.registry.register(_SpecCollector(model_name, spec_stats))
        if prefix_stats is not None:
            self.registry.register(_CacheCollector(model_name, prefix_stats, preemptions))
        if step_tokens is not None:
            self.registry.register(_StepCollector(model_name, step_tokens))
        if loras is not None and lora_adapters is not None:
            self.registry.register(_LoraInfoCollector(loras.config.max_loras, lora_adapters))
        if kv_tier is not None:  # only with a second KV tier
            self.registry.register(_TierCollector(model_name, kv_tier))
        if device_stats is not None:
            self.registry.register(_DeviceCollector(model_name, device_stats))

        def labelled(kind: type, name: str, doc: str, **kw: Any) -> Any:  # one metric, this model's label
            return kind(name, doc, ["model_name"], registry=self.registry, **kw).labels(model_name)

        def phase(name: str, doc: str) -> Any:
            return labelled(Histogram, VLLM + name, doc, buckets=E2E_BUCKETS)

        self.ttft = labelled(Histogram, VLLM + "time_to_first_token_seconds", "Time to first token.",
                             buckets=TTFT_BUCKETS)
        self.itl = labelled(Histogram, VLLM + "inter_token_latency_seconds", "Time between consecutive output "
                            "tokens.", buckets=ITL_BUCKETS)
        self.e2e = labelled(Histogram, VLLM + "e2e_request_latency_seconds", "End-to-end request latency.",
                            buckets=E2E_BUCKETS)
        self.queue = phase("request_queue_time_seconds", "Time from receipt to the first scheduling.")
        self.prefill = phase("request_prefill_time_seconds", "Time from the first scheduling to the first token.")
        self.decode = phase("request_decode_time_seconds", "Time from the first to the last token.")
        self.inference = phase("request_inference_time_seconds", "Time from the first scheduling to the last token.")
        self.tpot = labelled(Histogram, VLLM + "request_time_per_output_token_seconds", "A request's decode time per "
                             "token after its first.", buckets=ITL_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt = labelled(Histogram, VLLM + "request_prompt_tokens", "Prompt tokens per finished "
                                       "request.", buckets=tokens)
        self.request_generation = labelled(Histogram, VLLM + "request_generation_tokens", "Generated tokens per "
                                           "finished request.", buckets=tokens)
        self.max_generation = labelled(Histogram, VLLM + "request_max_num_generation_tokens", "The most tokens "
                                       "one sample of a finished request generated.", buckets=tokens)
        self.params_n = labelled(Histogram, VLLM + "request_params_n", "A request's n (samples).", buckets=N_BUCKETS)
        self.params_max_tokens = labelled(Histogram, VLLM + "request_params_max_tokens", "A request's max_tokens.",
                                          buckets=tokens)
        self.prompt_tokens = labelled(Counter, VLLM + "prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = labelled(Counter, VLLM + "generation_tokens", "Generated tokens.")
        self._success = Counter(VLLM + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._rejected = Counter(PREFIX + "request_rejected", "Requests refused before running, by reason.",
                                 ["model_name", "reason"], registry=self.registry)
        for reason in REJECTION_REASONS.values():  # every reason shows, from 0
            self._rejected.labels(model_name, reason)
        labelled(Gauge, VLLM + "num_requests_running", "Requests holding KV blocks.").set_function(num_running)
        labelled(Gauge, VLLM + "num_requests_waiting", "Requests queued (or preempted) for KV blocks.").set_function(
            num_waiting)
        # LoRA (neuron_opt.lora): requests by adapter ("" = the base model), adapters registered and in slots
        self._lora_requests = Counter(PREFIX + "lora_requests", "Requests queued, by LoRA adapter (empty: the base "
                                      "model).", ["model_name", "lora_name"], registry=self.registry)
        if loras is not None:
            labelled(Gauge, PREFIX + "lora_adapters_loaded", "LoRA adapters registered (loaded by name).") \
                .set_function(lambda: len(loras.names()))
            labelled(Gauge, PREFIX + "lora_adapters_resident", "LoRA adapters held in the model's adapter slots.") \
                .set_function(lambda: loras.num_resident)
        labelled(Gauge, VLLM + "kv_cache_usage_perc", "Fraction of KV blocks held by sequences (0-1).").set_function(
            kv_usage)

    def request_finished(self, reason: str, prompt_tokens: int, generation_tokens: int, e2e_s: float) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(generation_tokens)
        self.e2e.observe(e2e_s)

    def request_phases(self, arrival: float, scheduled: float, first_token: float, last_token: float,
                       generation_tokens: int) -> None:
        """A finished request's queue, prefill, decode and inference times (monotonic clock stamps), and its time
        per output token (when it made more than one)."""
        self.queue.observe(max(0.0, scheduled - arrival))
        self.prefill.observe(max(0.0, first_token - scheduled))
        self.decode.observe(max(0.0, last_token - first_token))
        self.inference.observe(max(0.0, last_token - scheduled))
        if generation_tokens > 1:
            self.tpot.observe(max(0.0, last_token - first_token) / (generation_tokens - 1))

    def request_params(self, n: int, max_tokens: int) -> None:
        """A request admitted with `n` samples of at most `max_tokens` tokens each."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def lora_request(self, lora_name: str | None) -> None:
        """Count a queued request under its adapter (None: the base model)."""
        self._lora_requests.labels(self.model_name, lora_name or "").inc()

    def request_rejected(self, status: int) -> None:
        """Count a refusal answered with `status` (other statuses are not refusals: not counted)."""
        reason = REJECTION_REASONS.get(status)
        if reason is not None:
            self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
