"""The latency model against published measurements: the rows, which of them fit the constants, the errors.

Published rows are AWS's and Hugging Face's public measurements (each row names its source; the AWS benchmark
CSVs are in the aws-neuron-sdk repository, see shared/reference/peers.md §8; optimum-neuron's inf2 benchmark
pages are read from their charts' value labels, `ON_PAGES`). Every row is predicted with the same constants
(`neuron_opt.planner.latency.DEFAULT_EFFICIENCY`) and its stack's documented configuration (bucketing, rows per
prefill call, flash attention); nothing is tuned per row. scripts/
validate_planner.py prints the table of docs/planner.md and re-runs the fit; `neuron-opt plan` prints the
held-out error band (`error_band`) next to its TTFT and TPOT.

Layouts: the published runs used transformers-neuronx / NxDI / optimum-neuron, which pad the MLP's
intermediate dimension to a multiple of tp (14336 / 24 is not an integer) and pad query heads (32 -> 48 at
tp 24). Our own sharding pads the same way (neuron_opt.parallel.sharding), so every row is predicted with the
layout `neuron-opt plan` and `compile` use.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass

from neuron_opt.buckets import BucketConfig, powers_of_two, smallest_fitting
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner.hardware import get_instance
from neuron_opt.planner.latency import DEFAULT_EFFICIENCY, Efficiency, decode_time, prefill_time
from neuron_opt.planner.queueing import Arrival, Policy, QueueEstimate, bucket_clock, estimate


def _llama(
    h: int,
    i: int,
    layers: int,
    heads: int,
    kv: int,
    vocab: int = 128256,
    max_pos: int = 8192,
    theta: float = 500000.0,
) -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": h,
            "intermediate_size": i,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "vocab_size": vocab,
            "max_position_embeddings": max_pos,
            "rope_theta": theta,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        }
    )


@functools.cache
def models() -> dict[str, ModelConfig]:
    """The published rows' models, from their public config.json values (meta-llama/*, codellama/*, mistralai/*).
    Built on first use: ModelConfig.from_hf imports transformers, which `plan` and `compile` must not pay for (or
    let pull in torch_xla) just by importing the planner."""
    return {
        "Llama-3-8B": _llama(4096, 14336, 32, 32, 8),
        "Llama-3.1-8B": _llama(4096, 14336, 32, 32, 8, max_pos=131072),
        "Llama-3-70B": _llama(8192, 28672, 80, 64, 8),
        "Llama-3.3-70B": _llama(8192, 28672, 80, 64, 8, max_pos=131072),
        "Llama-3.1-405B": _llama(16384, 53248, 126, 128, 8, max_pos=131072),
        "Llama-2-7b": _llama(4096, 11008, 32, 32, 32, vocab=32000, max_pos=4096, theta=10000.0),
        "Llama-2-13b": _llama(5120, 13824, 40, 40, 40, vocab=32000, max_pos=4096, theta=10000.0),
        "Llama-2-70b": _llama(8192, 28672, 80, 64, 8, vocab=32000, max_pos=4096, theta=10000.0),
        # codellama/CodeLlama-13b-hf, mistralai/Mistral-7B-Instruct-v0.2 (no sliding window in v0.2)
        "CodeLlama-13b": _llama(5120, 13824, 40, 40, 40, vocab=32016, max_pos=16384, theta=1e6),
        "Mistral-7B-v0.2": _llama(4096, 14336, 32, 32, 8, vocab=32000, max_pos=32768, theta=1e6),

    }

# aws-neuron-sdk about-neuron/benchmarks/{inf2,trn1}/{latency,throughput}_data_decoder.csv (Neuron 2.18.0 and
# 2.18.1 rows; unchanged since 2024-04-30). Every row with a TTFT and a TPOT is below, duplicates removed.
TNX_INF2 = "AWS inf2 benchmark CSV (transformers-neuronx)"
TNX_TRN1 = "AWS trn1 benchmark CSV (transformers-neuronx)"
NXDI_TRN2 = "NxDI trn2 tutorial (vLLM + LLMPerf)"
ON_TRN2 = "optimum-neuron vLLM benchmark, 1 user (sync)"
VN_TRN2 = "vLLM Neuron plugin EAGLE3 tutorial, baseline"


@dataclass(frozen=True)
class Row:
    """One published measurement and the deployment it was taken with."""

    model: str
    instance: str
    tp: int
    batch: int
    seq: int  # compiled max length
    input_len: int
    output_len: int
    ttft_ms: float | None
    tpot_ms: float
    dtype: str
    source: str
    prefill_batch: int  # rows prefilled together (TNX prefills the whole batch at once)
    bucketed: bool = True  # False: graphs compiled at the full length only (optimum-neuron)
    neuron: str | None = None  # Neuron SDK release of the measurement, where the source states it
    flash_from: int | None = None  # prefill length from which the stack runs a flash-attention kernel
    # prompts that arrive at once and whose first tokens are measured (None: `batch`, a full batch submitted
    # together); 1 where one user sends one request at a time. TTFT waits for all of their prefill calls.
    together: int | None = None

    @property
    def prompts(self) -> int:
        """How many prompts arrive together (`together`, default the batch)."""
        return self.batch if self.together is None else self.together


BF16, V180, V181 = "bfloat16", "2.18.0", "2.18.1"
ROWS = [
    Row("Llama-3-8B", "inf2.48xlarge", 24, 1, 8192, 128, 8064, 29.47, 7.41, "int8", TNX_INF2, 1, neuron=V181),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 1, 8192, 4096, 4096, 209.37, 7.47, "int8", TNX_INF2, 1, neuron=V181),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 1, 4096, 128, 3968, 25.0, 6.42, "int8", TNX_INF2, 1, neuron=V181),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 1, 4096, 2048, 2048, 101.81, 6.5, "int8", TNX_INF2, 1, neuron=V181),
    Row("Llama-3-70B", "inf2.48xlarge", 24, 1, 4096, 2048, 2048, 745.49, 34.67, BF16, TNX_INF2, 1, neuron=V181),
    Row("Llama-3-70B", "inf2.48xlarge", 24, 1, 3072, 1024, 2048, 312.86, 33.81, BF16, TNX_INF2, 1, neuron=V181),
    Row("Llama-3-70B", "inf2.48xlarge", 24, 1, 2048, 1024, 1024, 310.18, 33.14, BF16, TNX_INF2, 1, neuron=V181),
    Row("Llama-3-70B", "inf2.48xlarge", 24, 1, 1152, 128, 1024, 80.0, 32.47, BF16, TNX_INF2, 1, neuron=V181),
    Row("Llama-3-70B", "inf2.48xlarge", 24, 1, 512, 256, 256, 99.37, 32.48, BF16, TNX_INF2, 1, neuron=V181),
    Row("Llama-3-70B", "inf2.48xlarge", 24, 1, 256, 128, 128, 77.81, 32.2, BF16, TNX_INF2, 1, neuron=V181),
    Row("Llama-2-7b", "inf2.48xlarge", 24, 1, 4096, 128, 3968, 27.64, 6.47, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-7b", "inf2.48xlarge", 24, 1, 8192, 128, 8064, 29.21, 7.34, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-13b", "inf2.48xlarge", 24, 1, 4096, 128, 3968, 25.85, 9.17, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-13b", "inf2.48xlarge", 24, 1, 8192, 4096, 4096, 333.78, 10.17, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-13b", "inf2.48xlarge", 24, 1, 16384, 8192, 8192, 994.18, 13.5, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-70b", "inf2.48xlarge", 24, 1, 256, 128, 128, 76.6, 32.9, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-70b", "inf2.48xlarge", 24, 1, 512, 256, 256, 96.44, 33.13, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-70b", "inf2.48xlarge", 24, 1, 1152, 128, 1024, 76.33, 33.15, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-70b", "inf2.48xlarge", 24, 1, 2048, 1024, 1024, 277.02, 33.73, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-70b", "inf2.48xlarge", 24, 1, 3072, 1024, 2048, 275.97, 34.82, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-2-70b", "inf2.48xlarge", 24, 1, 4096, 2048, 2048, 810.44, 34.9, BF16, TNX_INF2, 1, neuron=V180),
    Row("Mistral-7B-v0.2", "inf2.48xlarge", 24, 1, 4096, 128, 3968, 27.34, 6.86, BF16, TNX_INF2, 1, neuron=V180),
    Row("Mistral-7B-v0.2", "inf2.48xlarge", 24, 1, 8192, 4096, 4096, 557.96, 7.87, BF16, TNX_INF2, 1, neuron=V180),
    Row("Mistral-7B-v0.2", "inf2.48xlarge", 24, 1, 16384, 8192, 8192, 539.59, 10.33, BF16, TNX_INF2, 1, neuron=V180),
    Row("CodeLlama-13b", "inf2.48xlarge", 24, 1, 4096, 128, 3968, 27.02, 9.12, BF16, TNX_INF2, 1, neuron=V180),
    Row("CodeLlama-13b", "inf2.48xlarge", 24, 1, 8192, 4096, 4096, 338.67, 10.15, BF16, TNX_INF2, 1, neuron=V180),
    Row("CodeLlama-13b", "inf2.48xlarge", 24, 1, 16384, 8192, 8192, 989.5, 13.44, BF16, TNX_INF2, 1, neuron=V180),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 8, 8192, 128, 8064, 68.95, 15.22, "int8", TNX_INF2, 8, neuron=V181),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 8, 8192, 4096, 4096, 1992.59, 15.31, "int8", TNX_INF2, 8, neuron=V181),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 8, 4096, 128, 3968, 66.02, 10.45, "int8", TNX_INF2, 8, neuron=V181),
    Row("Llama-3-8B", "inf2.48xlarge", 24, 8, 4096, 2048, 2048, 823.53, 10.5, "int8", TNX_INF2, 8, neuron=V181),
    Row("Llama-2-7b", "inf2.48xlarge", 24, 8, 4096, 128, 3968, 77.36, 12.11, BF16, TNX_INF2, 8, neuron=V180),
    Row("Llama-2-7b", "inf2.48xlarge", 24, 8, 8192, 128, 8064, 80.12, 16.39, BF16, TNX_INF2, 8, neuron=V180),
    Row("Llama-2-13b", "inf2.48xlarge", 24, 8, 4096, 128, 3968, 108.81, 14.9, BF16, TNX_INF2, 8, neuron=V180),
    Row("Llama-2-13b", "inf2.48xlarge", 24, 8, 8192, 4096, 4096, 7083.73, 20.99, BF16, TNX_INF2, 8, neuron=V180),
    Row("Llama-2-13b", "inf2.48xlarge", 24, 4, 16384, 8192, 8192, 5141.32, 21.71, BF16, TNX_INF2, 4, neuron=V180),
    Row("Mistral-7B-v0.2", "inf2.48xlarge", 24, 8, 4096, 128, 3968, 77.62, 11.64, BF16, TNX_INF2, 8, neuron=V180),
    Row("Mistral-7B-v0.2", "inf2.48xlarge", 24, 8, 8192, 4096, 4096, 4740.12, 16.55, BF16, TNX_INF2, 8, neuron=V180),
    Row("Mistral-7B-v0.2", "inf2.48xlarge", 24, 8, 16384, 8192, 8192, 11085.12, 18.01, BF16, TNX_INF2, 8, neuron=V180),
    Row("CodeLlama-13b", "inf2.48xlarge", 24, 8, 4096, 128, 3968, 115.81, 15.87, BF16, TNX_INF2, 8, neuron=V180),
    Row("CodeLlama-13b", "inf2.48xlarge", 24, 8, 8192, 4096, 4096, 7115.98, 22.27, BF16, TNX_INF2, 8, neuron=V180),
    Row("CodeLlama-13b", "inf2.48xlarge", 24, 4, 16384, 8192, 8192, 5136.62, 21.67, BF16, TNX_INF2, 4, neuron=V180),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 1, 8192, 128, 8064, 17.09, 7.03, "int8", TNX_TRN1, 1, neuron=V181),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 1, 8192, 4096, 4096, 153.02, 7.04, "int8", TNX_TRN1, 1, neuron=V181),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 1, 4096, 128, 3968, 14.75, 5.86, "int8", TNX_TRN1, 1, neuron=V181),
    Row("Llama-3-70B", "trn1.32xlarge", 32, 1, 4096, 2048, 2048, 547.0, 26.2, BF16, TNX_TRN1, 1, neuron=V181),
    Row("Llama-3-70B", "trn1.32xlarge", 32, 1, 1152, 128, 1024, 53.2, 24.48, BF16, TNX_TRN1, 1, neuron=V181),
    Row("Llama-3-70B", "trn1.32xlarge", 32, 1, 256, 128, 128, 52.53, 26.48, BF16, TNX_TRN1, 1, neuron=V181),
    Row("Llama-2-7b", "trn1.32xlarge", 32, 1, 8192, 128, 8064, 13.32, 6.7, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-2-13b", "trn1.32xlarge", 32, 1, 8192, 4096, 4096, 864.14, 9.84, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-2-13b", "trn1.32xlarge", 32, 1, 16384, 8192, 8192, 2367.93, 13.41, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 1, 256, 128, 128, 53.91, 25.18, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 1, 512, 256, 256, 81.88, 25.27, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 1, 1152, 128, 1024, 57.75, 25.45, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 1, 2048, 1024, 1024, 232.48, 26.04, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 1, 3072, 1024, 2048, 236.78, 26.62, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 1, 4096, 2048, 2048, 690.96, 26.85, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Mistral-7B-v0.2", "trn1.32xlarge", 32, 1, 16384, 8192, 8192, 1322.87, 9.89, BF16, TNX_TRN1, 1, neuron=V180),
    Row("CodeLlama-13b", "trn1.32xlarge", 32, 1, 8192, 4096, 4096, 868.64, 9.86, BF16, TNX_TRN1, 1, neuron=V180),
    Row("CodeLlama-13b", "trn1.32xlarge", 32, 1, 16384, 8192, 8192, 2372.93, 13.4, BF16, TNX_TRN1, 1, neuron=V180),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 8, 8192, 128, 8064, 55.16, 9.95, "int8", TNX_TRN1, 8, neuron=V181),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 8, 8192, 4096, 4096, 1265.95, 10.04, "int8", TNX_TRN1, 8, neuron=V181),
    Row("Llama-3-8B", "trn1.32xlarge", 32, 8, 4096, 128, 3968, 49.05, 7.65, "int8", TNX_TRN1, 8, neuron=V181),
    Row("Llama-3-70B", "trn1.32xlarge", 32, 4, 4096, 2048, 2048, 1661.12, 32.33, BF16, TNX_TRN1, 4, neuron=V181),
    Row("Llama-3-70B", "trn1.32xlarge", 32, 4, 1152, 128, 1024, 129.86, 28.38, BF16, TNX_TRN1, 4, neuron=V181),
    Row("Llama-3-70B", "trn1.32xlarge", 32, 4, 256, 128, 128, 130.37, 28.08, BF16, TNX_TRN1, 4, neuron=V181),
    Row("Llama-2-7b", "trn1.32xlarge", 32, 8, 8192, 128, 8064, 66.4, 10.1, BF16, TNX_TRN1, 8, neuron=V180),
    Row("Llama-2-13b", "trn1.32xlarge", 32, 8, 8192, 4096, 4096, 6668.7, 19.86, BF16, TNX_TRN1, 8, neuron=V180),
    Row("Llama-2-13b", "trn1.32xlarge", 32, 4, 16384, 8192, 8192, 4628.45, 21.09, BF16, TNX_TRN1, 4, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 4, 256, 128, 128, 156.85, 26.72, BF16, TNX_TRN1, 4, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 4, 512, 256, 256, 270.16, 26.91, BF16, TNX_TRN1, 4, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 4, 1152, 128, 1024, 156.69, 27.21, BF16, TNX_TRN1, 4, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 4, 2048, 1024, 1024, 1478.64, 28.55, BF16, TNX_TRN1, 4, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 4, 3072, 1024, 2048, 1478.85, 31.67, BF16, TNX_TRN1, 4, neuron=V180),
    Row("Llama-2-70b", "trn1.32xlarge", 32, 4, 4096, 2048, 2048, 2722.03, 31.79, BF16, TNX_TRN1, 4, neuron=V180),
    Row("Mistral-7B-v0.2", "trn1.32xlarge", 32, 8, 16384, 8192, 8192, 8614.85, 15.44, BF16, TNX_TRN1, 8, neuron=V180),
    Row("CodeLlama-13b", "trn1.32xlarge", 32, 8, 8192, 4096, 4096, 6625.16, 19.92, BF16, TNX_TRN1, 8, neuron=V180),
    Row("CodeLlama-13b", "trn1.32xlarge", 32, 4, 16384, 8192, 8192, 4626.17, 21.1, BF16, TNX_TRN1, 4, neuron=V180),
    Row("Llama-3.3-70B", "trn2.48xlarge", 64, 1, 12800, 10000, 1500, 814.2, 19.6, BF16, NXDI_TRN2, 1, flash_from=512),
    Row("Llama-3.1-405B", "trn2.48xlarge", 64, 1, 12800, 10000, 1500, 2442.0, 37.9, BF16, NXDI_TRN2, 1, flash_from=512),
    # one user at a time (sync): a single prompt in flight, whatever the compiled batch
    Row("Llama-3.1-8B", "trn2.48xlarge", 4, 32, 4096, 1500, 250, 197.2, 22.14, BF16, ON_TRN2, 1, False, flash_from=512,
        together=1),
    Row(
        "Llama-3.1-8B",
        "inf2.48xlarge",
        8,
        32,
        4096,
        1500,
        250,
        None,
        24.5,
        "bfloat16",
        "optimum-neuron chunked-prefill study, standard prefill + on-device sampling, sync",
        1,
        False,
        together=1,
    ),
    # measured at max-concurrency 2 (docs/planner.md, "Where it misses"); predicted as one prompt alone
    Row("Llama-3.1-8B", "trn2.48xlarge", 8, 2, 1024, 512, 128, 51.07, 10.52, BF16, VN_TRN2, 1, flash_from=512,
        together=1),
]

# optimum-neuron's inf2 benchmark pages (huggingface.co/docs/optimum-neuron/benchmarks/inferentia-*; repository
# huggingface/optimum-neuron, docs/source/benchmarks/<page>.mdx with the charts docs/assets/benchmarks/<page>/
# ttft.png and latency.png). Each figure below is a bar label of those charts: TTFT in seconds rounded to 0.1 s,
# inter-token latency in ms rounded to 1 ms. The measurement (benchmark/text-generation/benchmark.py at the same
# commit): `batch` copies of one prompt of `input_len` tokens submitted together to `generate`; TTFT = the time of
# a generate call producing one token, inter-token latency = (the time of a 256-token generate - TTFT) / 256;
# input lengths 256, 512, ..., 1792 in that order, without a warm-up call, so the 256-token figure includes the
# first call's warm-up. SDK: optimum/neuron/version.py `__sdk_version__` at the commit. Configuration (optimum-
# neuron source at the commit): for batch > 1 the model is compiled for continuous batching, whose prefill graph
# takes ONE row (transformers-neuronx `context_batch_sizes = [1]`, looped over the rows by
# `_context_dynamic_batching`; NxD backend `ctx_batch_size = 1`, looped in the decoder wrapper's `forward`) at ONE
# length, the compiled sequence length (transformers-neuronx `context_length_estimate = [sequence_length]`; NxD
# backend `enable_bucketing=False`): every row is padded to 4096 tokens and prefilled alone. Flash attention:
# transformers-neuronx 2.19 runs its flash kernel for single-row context graphs of >= 4096 tokens (2.18 has
# none); the NxD backend enables it automatically from 4096 tokens on inf2.
ON_TNX = "optimum-neuron inf2 benchmark page (transformers-neuronx backend)"
ON_NXD = "optimum-neuron inf2 benchmark page (NxD backend)"
ON_INPUTS = (256, 512, 768, 1024, 1280, 1536, 1792)
ON_PAGES = {  # page: (model, tp, commit, SDK, backend source, flash_from, {batch: (TTFT s, inter-token ms)})
    "inferentia-llama2-13b": ("Llama-2-13b", 8, "707fff4f", "2.18.0", ON_TNX, None, {
        4: ((2.7, 2.7, 2.7, 2.7, 2.7, 2.7, 2.8), (34, 34, 34, 34, 34, 34, 34)),
        8: ((5.4, 5.4, 5.5, 5.5, 5.5, 5.5, 5.6), (40, 40, 40, 40, 40, 40, 40))}),
    "inferentia-mistral-v2": ("Mistral-7B-v0.2", 8, "707fff4f", "2.18.0", ON_TNX, None, {
        4: ((1.6, 1.6, 1.6, 1.6, 1.6, 1.7, 1.7), (12, 12, 12, 12, 12, 12, 12)),
        8: ((3.4, 3.3, 3.3, 3.3, 3.4, 3.4, 3.4), (14, 14, 14, 14, 15, 15, 15))}),
    "inferentia-llama2-7b": ("Llama-2-7b", 12, "278d76c1", "2.19.1", ON_TNX, 4096, {
        4: ((1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0), (14, 14, 14, 14, 14, 14, 14)),
        8: ((1.9, 1.9, 1.9, 1.9, 1.9, 1.9, 1.9), (18, 18, 18, 18, 18, 18, 18))}),
    "inferentia-llama3-8b": ("Llama-3-8B", 8, "278d76c1", "2.19.1", ON_TNX, 4096, {
        4: ((1.1, 1.1, 1.1, 1.1, 1.1, 1.1, 1.1), (13, 13, 13, 13, 13, 13, 13)),
        8: ((2.2, 2.2, 2.2, 2.2, 2.2, 2.2, 2.2), (15, 15, 15, 15, 15, 15, 15))}),
    "inferentia-llama3.1-8b": ("Llama-3.1-8B", 8, "9d371f56", "2.24.0", ON_NXD, 4096, {
        4: ((1.6, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2), (11, 12, 12, 12, 13, 13, 13)),
        8: ((2.7, 2.3, 2.3, 2.3, 2.3, 2.4, 2.4), (14, 16, 16, 16, 16, 16, 16))}),
    # checkpoint deepseek-ai/DeepSeek-R1-Distill-Llama-70B: the Llama-3.3-70B architecture
    "inferentia-llama3.3-70b": ("Llama-3.3-70B", 24, "2bb1c707", "2.24.0", ON_NXD, 4096, {
        4: ((4.7, 4.2, 4.2, 4.2, 4.3, 4.3, 4.3), (36, 37, 37, 37, 37, 30, 37)),
        8: ((8.8, 8.4, 8.5, 8.5, 8.5, 8.6, 8.6), (44, 44, 44, 44, 44, 44, 44))}),
}


def _on_rows() -> list[Row]:
    """The optimum-neuron pages' batch-4 and batch-8 figures as rows: 4096-token graphs (not bucketed), one row
    per prefill call, 256 generated tokens."""
    out = []
    for model, tp, _commit, sdk, source, flash_from, figures in ON_PAGES.values():
        for batch, (ttfts, itls) in figures.items():
            for n, ttft, itl in zip(ON_INPUTS, ttfts, itls, strict=True):
                out.append(Row(model, "inf2.48xlarge", tp, batch, 4096, n, 256, 1e3 * ttft, float(itl), BF16,
                               source, 1, False, neuron=sdk, flash_from=flash_from))
    return out


ROWS += _on_rows()


FIT_MODELS = ("Llama-3-8B", "Llama-3-70B")


def is_fit_row(row: Row) -> bool:
    """The calibration set, split by instance family and by model: AWS's transformers-neuronx rows of
    Llama-3-8B and Llama-3-70B on inf2.48xlarge fit the constants (`--fit`). Held out, never seen by the fit:
    every other model on inf2 (Llama-2-7b/13b/70b, Mistral-7B, CodeLlama-13b), every row on trn1 (another
    instance, a 4x4 torus instead of a 12-chip ring) and every row from other stacks (NxDI, optimum-neuron, the
    vLLM Neuron plugin; trn2 and inf2), the optimum-neuron inf2 benchmark pages' rows included."""
    return row.instance == "inf2.48xlarge" and row.source == TNX_INF2 and row.model in FIT_MODELS


def row_set(row: Row) -> str:
    """Which set a row belongs to: the fit, or the held-out group it tests (another model on the fitted
    instance, another instance family with the same SDK, optimum-neuron's inf2 benchmark pages, another software
    stack)."""
    if is_fit_row(row):
        return "fit"
    if row.source == TNX_INF2:
        return "held out: other models, inf2"
    if row.source == TNX_TRN1:
        return "held out: trn1"
    if row.source in (ON_TNX, ON_NXD):
        return "held out: optimum-neuron inf2 pages"
    return "held out: other stacks"


FIT_ROWS = [r for r in ROWS if is_fit_row(r)]
HELD_OUT_ROWS = [r for r in ROWS if not is_fit_row(r)]


def predict(row: Row, eff: Efficiency = DEFAULT_EFFICIENCY) -> tuple[float, float]:
    """(TTFT ms, TPOT ms) for a row. TTFT: the row's prompts (`Row.prompts`) arrive together and are prefilled
    `prefill_batch` rows per call, one call after another, so each first token comes after all the calls (the
    closed form of `predict_queue`). TPOT is taken at the median output token (p50 of per-token latency)."""
    cfg, inst = models()[row.model], get_instance(row.instance)
    lay = head_layout(cfg, ParallelConfig(tp=row.tp))
    if row.bucketed:
        prefill_seq = smallest_fitting(row.input_len, powers_of_two(128, row.seq))
        kv_len = smallest_fitting(row.input_len + row.output_len // 2 + 1, powers_of_two(128, row.seq))
    else:
        prefill_seq = kv_len = row.seq
    assert prefill_seq is not None and kv_len is not None
    flash = row.flash_from is not None and prefill_seq >= row.flash_from
    ttft = prefill_time(
        cfg, lay, inst, batch=row.prefill_batch, seq=prefill_seq, dtype=row.dtype, eff=eff, flash=flash
    )
    calls = -(-row.prompts // row.prefill_batch)
    tpot = decode_time(
        cfg, lay, inst, batch=row.batch, kv_len=kv_len, dtype=row.dtype, kv_dtype="bfloat16", eff=eff
    )
    return 1e3 * calls * ttft.total, 1e3 * tpot.total


def _err(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas


# The values each calibrated constant may take in the fit (a grid: the fit is reproducible and its result is a
# round number that docs/planner.md can state).
FIT_GRID: dict[str, list[float]] = {
    "tensor": [0.05 * k for k in range(2, 17)],
    "collective_latency_s": [2.5e-6 * k for k in range(0, 41)],
    "step_overhead_s": [0.25e-3 * k for k in range(0, 25)],
    "prefill_hop_latency_s": [2e-6 * k for k in range(0, 21)],
    "attention_score_s": [0.0] + [1e-11 * k for k in range(1, 41)],
}
# The second stage's constant: the cost of each prompt row of a prefill call beyond the first.
ROW_GRID: list[float] = [0.25e-3 * k for k in range(0, 41)]


def fit_loss(rows: list[Row], eff: Efficiency) -> float:
    """Summed absolute log error of TTFT and TPOT: absolute, not squared, so that the few rows no setting
    explains do not drag every other row off."""
    loss = 0.0
    for r in rows:
        ttft, tpot = predict(r, eff)
        loss += abs(math.log(tpot / r.tpot_ms)) + (abs(math.log(ttft / r.ttft_ms)) if r.ttft_ms else 0.0)
    return loss


def fit(rows: list[Row], start: Efficiency = DEFAULT_EFFICIENCY) -> Efficiency:
    """The calibrated constants minimising `fit_loss` over `rows`, in two stages. First the step model's constants
    (FIT_GRID), with no per-row prefill cost: coordinate descent, each constant in turn taking its best grid value
    with the others held, until a full pass changes nothing. Then `prefill_row_s` (ROW_GRID) with those held: the
    residual the step model leaves on the batched rows (batch-1 rows do not depend on it), so no batch-1
    prediction moves when it is added."""
    best = dataclasses.replace(start, prefill_row_s=0.0)
    best_loss = fit_loss(rows, best)
    changed = True
    while changed:
        changed = False
        for name, values in FIT_GRID.items():
            for value in values:
                eff = dataclasses.replace(best, **{name: value})
                loss = fit_loss(rows, eff)
                if loss < best_loss - 1e-9:
                    best, best_loss, changed = eff, loss, True
    return min((dataclasses.replace(best, prefill_row_s=v) for v in ROW_GRID), key=lambda e: fit_loss(rows, e))


def table(rows: list[Row]) -> list[dict]:
    """One dict per row: the published figures, the predictions and the errors (rounded for display)."""
    out = []
    for r in rows:
        ttft, tpot = predict(r)
        out.append(
            {
                **dataclasses.asdict(r),
                "pred_ttft_ms": round(ttft, 2),
                "pred_tpot_ms": round(tpot, 2),
                "ttft_err_pct": None if r.ttft_ms is None else round(_err(ttft, r.ttft_ms), 1),
                "tpot_err_pct": round(_err(tpot, r.tpot_ms), 1),
                "held_out": not is_fit_row(r),
                "set": row_set(r),
            }
        )
    return out


def markdown(rows: list[Row]) -> str:
    """The validation table of docs/planner.md, then the per-set summary lines."""
    lines = [
        "| Model | Instance | tp | BS | Seq | In/Out | Weights | TTFT pub | TTFT pred | err | TPOT pub | "
        "TPOT pred | err | Set | Source |",
        "|" + "---|" * 15,
    ]
    for d in table(rows):
        ttft_pub = "—" if d["ttft_ms"] is None else f"{d['ttft_ms']:.1f}"
        ttft_err = "—" if d["ttft_err_pct"] is None else f"{d['ttft_err_pct']:+.0f}%"
        lines.append(
            f"| {d['model']} | {d['instance']} | {d['tp']} | {d['batch']} | {d['seq']} | "
            f"{d['input_len']}/{d['output_len']} | {d['dtype']} | {ttft_pub} | {d['pred_ttft_ms']:.1f} | "
            f"{ttft_err} | {d['tpot_ms']:.2f} | {d['pred_tpot_ms']:.2f} | {d['tpot_err_pct']:+.0f}% | "
            f"{d['set']} | {d['source']}{' ' + d['neuron'] if d['neuron'] else ''} |"
        )
    lines += ["", *summary(rows)]
    return "\n".join(lines)


def _within(errs: list[float], limit: float) -> str:
    """`n/m within limit% (median, max |err|)` of a list of percent errors."""
    a = sorted(abs(e) for e in errs)
    ok = sum(e <= limit for e in a)
    return f"within {limit:.0f}% on {ok}/{len(a)} (median |err| {statistics.median(a):.0f}%, max {a[-1]:.0f}%)"


def _errors(rows: list[Row]) -> tuple[list[float], list[float]]:
    """Percent errors (pred - pub) / pub of TTFT (rows that publish one) and TPOT."""
    ttft, tpot = [], []
    for r in rows:
        pred_ttft, pred_tpot = predict(r)
        tpot.append(_err(pred_tpot, r.tpot_ms))
        if r.ttft_ms is not None:
            ttft.append(_err(pred_ttft, r.ttft_ms))
    return ttft, tpot


def summary(rows: list[Row]) -> list[str]:
    """One line for the fitted rows (the constants were fitted on them), one for all held-out rows, then one
    per held-out group; thresholds are applied to unrounded errors."""
    groups = ["fit", "held out", *sorted({row_set(r) for r in rows} - {"fit"})]
    out = []
    for g in groups:
        sel = [r for r in rows if row_set(r) == g or (g == "held out" and not is_fit_row(r))]
        ttft, tpot = _errors(sel)
        label = {"fit": "fitted rows", "held out": "all held-out rows"}.get(g, g)
        out.append(f"- {label}: TPOT {_within(tpot, 25)}; TTFT {_within(ttft, 35)}")
    return out


@dataclass(frozen=True)
class ErrorBand:
    """How far off the model was on held-out published rows of one instance family: `coverage` of the rows
    fall within +-ttft_pct (TTFT) and +-tpot_pct (TPOT)."""

    family: str
    rows: int
    coverage: float
    ttft_pct: float
    tpot_pct: float

    def line(self) -> str:
        return (
            f"error band: {100 * self.coverage:.0f}% of {self.rows} held-out published {self.family} rows within "
            f"TTFT +-{self.ttft_pct:.0f}%, TPOT +-{self.tpot_pct:.0f}% (docs/planner.md, Validation)"
        )


@functools.cache
def error_band(family: str, coverage: float = 0.8) -> ErrorBand | None:
    """The held-out error on `family`'s rows (inf2, trn1, trn2), or None where no published row exists (cpu)."""
    rows = [r for r in HELD_OUT_ROWS if get_instance(r.instance).family == family]
    if not rows:
        return None
    ttft, tpot = _errors(rows)

    def quantile(errs: list[float]) -> float:
        a = sorted(abs(e) for e in errs)
        return a[min(len(a) - 1, math.ceil(coverage * len(a)) - 1)]

    return ErrorBand(family, len(rows), coverage, quantile(ttft), quantile(tpot))


BATCHED_SOURCES = (TNX_INF2, TNX_TRN1, ON_TNX, ON_NXD)


def batched_rows(rows: list[Row]) -> list[Row]:
    """The published batched rows (batch 4 or 8, 128-8192 input tokens, the batch's prompts submitted together):
    AWS's transformers-neuronx benchmark CSVs and optimum-neuron's inf2 benchmark pages. The prompts arrive
    together and wait for each other's prefill."""
    return [r for r in rows if r.batch in (4, 8) and r.source in BATCHED_SOURCES and r.prompts == r.batch
            and 128 <= r.input_len <= 8192 and r.ttft_ms is not None]


def batched_group(row: Row) -> str:
    """The source a batched row is reported under: AWS's CSVs (fitted and held-out rows apart) or the page's
    backend."""
    if row.source in (TNX_INF2, TNX_TRN1):
        return "fitted batched rows" if is_fit_row(row) else "held out, AWS benchmark CSVs (transformers-neuronx)"
    return f"held out, {row.source}"


def predict_queue(row: Row) -> QueueEstimate:
    """The row's TTFT / TPOT percentiles from the queue model (planner.queueing) under its stack's policy: the
    `row.prompts` prompts arrive together, are admitted whole (no chunking) and prefilled `row.prefill_batch` per
    graph call (transformers-neuronx as AWS's benchmarks ran it: the whole batch in one call; optimum-neuron's
    continuous-batching graphs: one row per call), on the row's graphs (bucketed, or the compiled length only)."""
    cfg, inst = models()[row.model], get_instance(row.instance)
    lay = head_layout(cfg, ParallelConfig(tp=row.tp))
    lens = powers_of_two(128, row.seq) if row.bucketed else [row.seq]
    buckets = BucketConfig.build(max_prompt_len=row.seq, max_model_len=row.seq, max_batch=row.batch,
                                 prefill_lens=lens, decode_kv_lens=lens, decode_batches=[row.batch],
                                 prefill_batch=row.prefill_batch, offset_prefill=False)
    clock = bucket_clock(cfg, lay, inst, buckets, dtype=row.dtype, flash_from=row.flash_from)
    policy = Policy(max_num_seqs=row.batch, max_prefill_len=row.seq, max_num_batched_tokens=row.batch * row.seq,
                    prefill_batch=row.prefill_batch, chunked=False)
    return estimate(policy, clock, Arrival(), row.prompts, row.input_len, row.output_len)


def queue_markdown(rows: list[Row]) -> str:
    """The batched-TTFT table of docs/planner.md (queue model, prompts arriving together), then the summary lines:
    every held-out row, each source's held-out rows apart, and the rows the constants were fitted on."""
    lines = ["| Model | Instance | tp | BS | Seq | In/Out | TTFT pub | TTFT p50 pred | TTFT p99 pred | err (p50) | "
             "TPOT pub | TPOT p50 pred | err | Set | Source |", "|" + "---|" * 15]
    errs: dict[str, tuple[list[float], list[float]]] = {"held-out batched rows, all sources": ([], [])}
    for r in batched_rows(rows):
        q = predict_queue(r)
        ttft, tpot = 1e3 * q.ttft_p50, 1e3 * (q.tpot_p50 or 0.0)
        assert r.ttft_ms is not None
        e_ttft, e_tpot = _err(ttft, r.ttft_ms), _err(tpot, r.tpot_ms)
        groups = [batched_group(r)] + ([] if is_fit_row(r) else ["held-out batched rows, all sources"])
        for g in groups:
            errs.setdefault(g, ([], []))
            errs[g][0].append(e_ttft)
            errs[g][1].append(e_tpot)
        lines.append(f"| {r.model} | {r.instance} | {r.tp} | {r.batch} | {r.seq} | {r.input_len}/{r.output_len} | "
                     f"{r.ttft_ms:.1f} | {ttft:.1f} | {1e3 * q.ttft_p99:.1f} | {e_ttft:+.0f}% | {r.tpot_ms:.2f} | "
                     f"{tpot:.2f} | {e_tpot:+.0f}% | {row_set(r)} | {r.source}{' ' + r.neuron if r.neuron else ''} |")
    lines.append("")
    order = ["held-out batched rows, all sources", "held out, AWS benchmark CSVs (transformers-neuronx)",
             f"held out, {ON_TNX}", f"held out, {ON_NXD}", "fitted batched rows"]
    for label in sorted(errs, key=order.index):
        ttft_e, tpot_e = errs[label]
        lines.append(f"- {label}: TTFT {_within(ttft_e, 35)}; TPOT {_within(tpot_e, 25)}")
    return "\n".join(lines)
