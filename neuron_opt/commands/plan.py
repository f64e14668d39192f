"""`neuron-opt plan`: will the model fit on an instance, how fast will it be, which tp, batch and buckets.

Without --tp, every tp degree the instance supports (and our sharding can express) is evaluated and the
best is recommended (neuron_opt.planner.recommend explains the rule); with --tp, that one deployment is
planned. On a Neuron instance it then prints the tp x data-parallel splits of the instance (`serve
--data-parallel N` replicas, neuron_opt.planner.scale_out) for the whole --concurrency and recommends one for
--target. Last, for every Neuron instance, the smallest tp at which the plan's context (--max-model-len at the
batch) fits. Exit code: 0 when the chosen plan fits, 1 when it does not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from neuron_opt.commands.hub_flags import add_hub_flags
from neuron_opt.config import ModelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.headers import read_json_capped
from neuron_opt.hub import resolve_model
from neuron_opt.lora.config import TARGET_MODULES, LoraConfig
from neuron_opt.planner.hardware import get_instance, known_instances
from neuron_opt.planner.memory import KV_DTYPES, WEIGHT_DTYPES
from neuron_opt.planner.queueing import ARRIVALS, POISSON_REQUESTS, Arrival
from neuron_opt.planner.recommend import Plan, Traffic, candidates, context_fits, rank, with_queue
from neuron_opt.planner.report import (
    alternatives_table,
    context_lines,
    ep_table,
    plan_json,
    plan_lines,
    speculative_json,
    speculative_lines,
    split_json,
    split_lines,
)
from neuron_opt.planner.scale_out import TARGETS, recommend_split, splits
from neuron_opt.planner.speculative import (
    METHODS,
    Proposer,
    acceptance_from_bench,
    check_acceptance,
    eagle3_like,
    predict,
)
from neuron_opt.planner.vision import VisionPlan, image_processor_settings, vision_lines, vision_plan

# every backend holds window-sized KV for sliding-window layers (Backend.window_kv: eager, cpu, neuron), so the plan
# sizes their pools as compile allocates them
WINDOW_KV = True


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="memory fit, latency and tp/batch/bucket recommendation", description=__doc__
    )
    p.add_argument(
        "--model",
        required=True,
        help="HF config.json, a directory holding one (no weights needed), a .gguf file, 'default', or a Hugging "
             "Face Hub id org/name[:QUANT] (only its config.json is fetched; a GGUF repo's .gguf in full)",
    )
    add_hub_flags(p)
    p.add_argument("--instance", required=True, help=f"one of: {', '.join(known_instances())}")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: recommend one)")
    p.add_argument("--ep", type=int, default=None,
                   help="mixture-of-experts models: expert-parallel degree (default: the fastest that divides tp "
                        "and num_experts; see docs/moe.md)")
    p.add_argument("--ep-decode", type=int, default=None, metavar="EP",
                   help="mixture-of-experts models: expert-parallel degree of the decode graphs (default: --ep's "
                        "when given, else chosen with it; a degree other than prefill's holds the experts twice)")
    p.add_argument("--cp-degree", type=int, default=1, metavar="N",
                   help="context-parallel prefill (compile --cp-degree): the N = tp / num_key_value_heads ranks of "
                        "a flash-decoding KV group split each prefill; needs --tp")
    p.add_argument(
        "--batch-size", type=int, default=None, help="KV slots / decode batch (default: --concurrency)"
    )
    p.add_argument("--concurrency", type=int, default=1, help="concurrent requests the traffic shape assumes")
    p.add_argument(
        "--arrival", choices=ARRIVALS, default=None,
        help="how requests arrive for the TTFT/TPOT percentiles: 'together' (the --concurrency prompts at once; "
             f"the default without --rate) or 'poisson' ({POISSON_REQUESTS} seeded arrivals at --rate, served by "
             "--batch-size slots; the default with --rate)",
    )
    p.add_argument("--rate", type=float, default=None, help="poisson arrivals: mean requests per second")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048,
        help="the scheduler's tokens per engine step the percentiles assume (serve's flag of the same name)",
    )
    p.add_argument(
        "--prefill-batch", type=int, default=1, metavar="N",
        help="prompts (or chunks) prefilled together in one graph call (compile's flag of the same name)",
    )
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens of a typical request")
    p.add_argument("--output-len", type=int, default=512, help="generated tokens of a typical request")
    p.add_argument(
        "--max-prompt-len", "--max-context", type=int, default=None,
        help="longest prompt: the largest prefill bucket (default: --input-len)"
    )
    p.add_argument(
        "--max-model-len", "--max-length", type=int, default=None,
        help="most tokens one sequence holds: the KV cache length (default: --input-len + --output-len)"
    )
    p.add_argument(
        "--dtype",
        choices=WEIGHT_DTYPES,
        default=None,
        help="weight dtype (default: bfloat16; a quantized dtype is proposed only if bfloat16 fits nowhere)",
    )
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bfloat16")
    p.add_argument(
        "--target", choices=TARGETS, default="latency",
        help="what the tp x data-parallel split is chosen for: lowest request latency, or most output tokens/s",
    )
    p.add_argument(
        "--data-parallel", type=int, default=None, metavar="N",
        help="replicas of the model on the instance (default: as many as fit, for each tp)",
    )
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="LoRA adapter slots (compile --enable-lora --max-loras; default 1 when another LoRA flag is "
                        "given): their stacks in the memory fit, the adapter product in the step time")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="largest LoRA rank (compile's flag; default 16 when another LoRA flag is given)")
    p.add_argument("--lora-target-modules", nargs="+", default=None, metavar="NAME",
                   help=f"linears with an adapter path (compile's flag; default all: {' '.join(TARGET_MODULES)})")
    p.add_argument("--speculative-method", choices=METHODS, default=None,
                   help="predict what speculative decoding buys at the plan's decode bucket (docs/planner.md): the "
                        "verify step and the proposer's cost against the plain decode step")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K", help="proposals a step")
    p.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="draft_model: the draft (as --model takes it); eagle3: the head's directory (default: a "
                        "head shaped like one of the model's layers, as train-eagle3 makes it)")
    p.add_argument("--acceptance-length", default=None, metavar="TAU|BENCH.json",
                   help="tokens a verify step emits (accepted proposals + 1, in [1, K + 1]), or a JSON of "
                        "scripts/bench_spec.py or bench_eagle3.py: its rows of this method at K measured with every "
                        "step speculating")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def lora_from_args(args: argparse.Namespace) -> LoraConfig | None:
    """The LoRA capacity planned for: None unless one of the LoRA flags is given."""
    if args.max_loras is None and args.max_lora_rank is None and args.lora_target_modules is None:
        return None
    return LoraConfig(1 if args.max_loras is None else args.max_loras,
                      16 if args.max_lora_rank is None else args.max_lora_rank,
                      tuple(args.lora_target_modules or TARGET_MODULES))


def load_model_config(model: str) -> ModelConfig:
    """config.json, or a directory with one, needs no weights; 'default' and .gguf go through the
    checkpoint. A vision-language config plans its text decoder (and `vision_memory` its image side)."""
    from neuron_opt.multimodal.vision import decoder_config, is_multimodal  # here: transformers for a VLM only

    path = Path(model)
    if model != "default" and (
        path.suffix == ".json" or (path.is_dir() and (path / "config.json").is_file())
    ):
        return decoder_config(path) if is_multimodal(path) else ModelConfig.from_hf(path)
    from neuron_opt.checkpoint import open_checkpoint  # here: the CLI parses without the checkpoint readers

    return open_checkpoint(model).config


def proposer_from_args(args: argparse.Namespace, cfg: ModelConfig) -> tuple[Proposer, list[tuple[str, float]]] | None:
    """The speculative decoding to predict and its acceptance lengths ((source, length)); None when not asked."""
    method, k = args.speculative_method, args.num_speculative_tokens
    if method is None:
        for flag in ("num_speculative_tokens", "speculative_model", "acceptance_length"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')}: needs --speculative-method", param=flag)
        return None
    if k is None or args.acceptance_length is None:
        raise ConfigError("--speculative-method: needs --num-speculative-tokens and --acceptance-length",
                          param="speculative_method")
    if method == "ngram" and args.speculative_model is not None:
        raise ConfigError("--speculative-model: prompt lookup (ngram) has no draft model", param="speculative_model")
    if method == "draft_model":
        if args.speculative_model is None:
            raise ConfigError("--speculative-method draft_model: needs --speculative-model", param="speculative_model")
        proposer = Proposer(method, k, load_model_config(resolve_model(args.speculative_model, config_only=True,
                                                                             param="speculative_model")))
    elif method == "eagle3" and args.speculative_model is not None:
        from neuron_opt.checkpoint.eagle3 import check_head, read_head_config  # the CLI parses without them

        head = read_head_config(Path(resolve_model(args.speculative_model, param="speculative_model")), load=False)[0]
        ids = check_head(head, cfg, args.speculative_model)
        proposer = Proposer(method, k, head.layer, head.draft_vocab_size, len(ids) * head.aux_hidden_size)
    elif method == "eagle3":
        proposer = eagle3_like(cfg, k)
    else:
        proposer = Proposer(method, k)
    source = args.acceptance_length
    try:
        lengths = [("given", float(source))]
    except ValueError:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"--acceptance-length: {source!r} is neither a number nor a benchmark JSON file",
                              param="acceptance_length") from None
        lengths = acceptance_from_bench(read_json_capped(path, ConfigError, "--acceptance-length"), method, k,
                                        str(path))
    for _, tau in lengths:
        check_acceptance(tau, k)
    return proposer, lengths
def vision_memory(model: str, plans: list[Plan]) -> tuple[list[Plan], VisionPlan | None]:
    """The plans with a vision-language model's encoder counted on every rank (planner.vision), and its plan in the
    best plan's dtype; the plans unchanged for a text model."""
    from neuron_opt.multimodal.vision import is_multimodal

    path = Path(model)
    if model == "default" or not is_multimodal(path):
        return plans, None
    root = path if path.is_dir() else path.parent
    pre_cfg = image_processor_settings(root)
    config = read_json_capped(root / "config.json" if path.is_dir() else path, ConfigError, "config")
    out = []
    for p in plans:
        vp = vision_plan(config, pre_cfg, p.deployment.dtype)
        out.append(replace(p, memory=replace(p.memory, vision=vp.weight_bytes + vp.activation_bytes)))
    return out, vision_plan(config, pre_cfg, plans[0].deployment.dtype)


def run(args: argparse.Namespace) -> int:
    model_path = str(resolve_model(args.model, revision=args.revision, gguf_file=args.gguf_file, config_only=True))
    cfg = load_model_config(model_path)
    inst = get_instance(args.instance)
    spec = proposer_from_args(args, cfg)
    if spec is not None and inst.family == "cpu":
        raise ConfigError("--speculative-method: latency is modelled on Neuron instances, not on cpu", param="instance")
    traffic = Traffic(args.input_len, args.output_len, args.concurrency)
    arrival = Arrival(args.arrival or ("poisson" if args.rate is not None else "together"), args.rate)
    if args.max_num_batched_tokens < 1:
        raise ConfigError(f"--max-num-batched-tokens: must be >= 1, got {args.max_num_batched_tokens}",
                          param="max_num_batched_tokens")
    batch = args.batch_size or args.concurrency
    max_model_len = args.max_model_len or args.input_len + args.output_len
    max_prompt_len = args.max_prompt_len or min(args.input_len, max_model_len)
    lora = lora_from_args(args)
    plans = rank(
        candidates(
            cfg,
            inst,
            traffic,
            batch=batch,
            max_prompt_len=max_prompt_len,
            max_model_len=max_model_len,
            tp=args.tp,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            ep=args.ep,
            ep_decode=args.ep_decode,
            prefill_batch=args.prefill_batch,
            lora=lora,
            window_kv=WINDOW_KV,
            cp_degree=args.cp_degree,
        ),
        traffic,
    )
    plans = [with_queue(cfg, p, traffic, arrival, args.max_num_batched_tokens) for p in plans]
    plans, vision = vision_memory(model_path, plans)
    best = plans[0]
    scale = None
    if inst.family != "cpu":
        scale = splits(cfg, inst, traffic, max_prompt_len=max_prompt_len, max_model_len=max_model_len,
                       batch=args.batch_size, replicas=args.data_parallel,
                       dtypes=tuple(sorted({p.deployment.dtype for p in plans})), kv_dtype=args.kv_dtype,
                       lora=lora, window_kv=WINDOW_KV)
        if args.tp is not None:
            scale = [s for s in scale if s.tp == args.tp]
    elif args.data_parallel is not None:
        raise ConfigError("--data-parallel: the split of an instance's cores is planned for Neuron instances "
                          "(latency is not modelled on cpu)", param="data_parallel")
    fits = context_fits(cfg, best.deployment)  # where this context can be served at all, at the smallest tp
    preds = [] if spec is None else [(where, predict(cfg, best, spec[0], tau)) for where, tau in spec[1]]
    if args.json:
        out = plan_json(cfg, best, plans[1:])
        out["context_fits"] = {inst.name: tp for inst, tp in fits}
        if preds:
            out["speculative"] = speculative_json(best, preds)
        if vision is not None:
            out["vision"] = asdict(vision)
        if scale:
            pick = recommend_split(scale, traffic.output_len, args.target)
            out["data_parallel"] = {
                "target": args.target,
                "recommended": None if pick is None else split_json(pick, traffic.output_len),
                "splits": [split_json(s, traffic.output_len) for s in scale],
            }
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(plan_lines(cfg, best)))
        if vision is not None:
            print("\n".join(vision_lines(vision)))
        if len(plans) > 1:
            print(
                f"\nalternatives ({traffic.input_len} in / {traffic.output_len} out, "
                f"concurrency {traffic.concurrency}), recommended first:"
            )
            print("\n".join(alternatives_table(plans, traffic)))
        if preds:
            print()
            print("\n".join(speculative_lines(best, preds)))
        if cfg.is_moe and inst.family != "cpu":
            print()
            print("\n".join(ep_table(cfg, best, traffic)))
        if scale:
            print()
            print("\n".join(split_lines(scale, traffic, args.target)))
        print()
        print("\n".join(context_lines(fits, best.deployment)))
    return 0 if best.fits else 1
