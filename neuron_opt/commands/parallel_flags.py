"""Tensor-parallel flags for `compile` and `generate`, and the ParallelConfig they build.

Flags: `--tp`, `--ep`, `--ep-decode`, `--instance`, `--sequence-parallel`, `--flash-decoding`, `--cp-degree`,
`--gqa-strategy`, `--no-vocab-parallel-sampling`. The config is validated, including the instance's allowed degrees.
"""

from __future__ import annotations

import argparse

from neuron_opt.config import ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.planner.hardware import check_tp


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (rank processes / NeuronCores)")
    g.add_argument("--ep", type=int, default=1,
                   help="mixture-of-experts models: expert-parallel groups; each of EP groups of tp/EP ranks holds "
                        "num_experts/EP whole experts, each split over its group's ranks (NxDI's moe_ep_degree; "
                        "default 1: every expert split over all tp ranks). Attention stays split over all tp ranks")
    g.add_argument("--ep-decode", type=int, default=None, metavar="EP",
                   help="mixture-of-experts models: the expert-parallel degree of decode and verify graphs when it "
                        "should differ from --ep's, which prefill keeps (NxDI's hybrid_sharding_config); each rank "
                        "then holds its experts twice, once per layout (`plan` shows the trade)")
    g.add_argument(
        "--instance",
        default=None,
        help="target instance (e.g. inf2.48xlarge, trn1.32xlarge, trn2.48xlarge, cpu): --tp must be "
        "one of its allowed degrees",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="prefill activations sharded along the sequence between layers",
    )
    g.add_argument(
        "--flash-decoding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="when n_kv_heads < tp: shard each KV head's cache along the sequence within its group (default: "
        "compile turns it on where the plan's weights + KV per rank are smaller with it)",
    )
    g.add_argument(
        "--cp-degree",
        type=int,
        default=1,
        metavar="N",
        help="context-parallel prefill (NxDI's cp_degree): the N ranks that share a KV head split each prefill's "
        "tokens; implies --flash-decoding, whose KV groups have N = tp / num_key_value_heads ranks (default 1: off)",
    )
    g.add_argument(
        "--gqa-strategy",
        default="auto",
        choices=["auto", "replicate-kv", "mha"],
        help="how KV heads are laid out when tp does not divide them (auto: replicate-kv when "
        "possible, else MHA)",
    )
    g.add_argument(
        "--no-vocab-parallel-sampling",
        dest="vocab_parallel_sampling",
        action="store_false",
        help="always gather full [B, V] logits instead of per-rank top-k candidates",
    )


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """Build and validate the ParallelConfig (instance degree check included)."""
    par = ParallelConfig(
        tp=args.tp,
        ep=args.ep,
        ep_decode=args.ep_decode,
        sequence_parallel=args.sequence_parallel,
        flash_decoding=args.flash_decoding,
        cp_degree=args.cp_degree,
        vocab_parallel_sampling=args.vocab_parallel_sampling,
        gqa_strategy=args.gqa_strategy,
        instance=args.instance,
    )
    check_instance(par)
    return par


def check_instance(par: ParallelConfig) -> None:
    """Raise ConfigError listing the allowed degrees if `par.tp` is not offered by `par.instance`."""
    if par.instance is None:
        return
    try:
        check_tp(par.instance, par.tp)
    except ConfigError as e:
        raise ConfigError(f"--tp/--instance: {e}") from None
