"""`neuron-opt generate`: one prompt, from an artifact directory or straight from a checkpoint (eager)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from neuron_opt.commands.hub_flags import MODEL_HELP, add_hub_flags
from neuron_opt.commands.parallel_flags import add_parallel_flags, parallel_config_from_args
from neuron_opt.errors import ConfigError
from neuron_opt.lora.adapter import capacity_for
from neuron_opt.lora.registry import LoRARequest
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.speculative import SpeculativeConfig


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: greedy)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    sampling = any(v is not None for v in (args.temperature, args.top_k, args.top_p, args.seed))
    return SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=(args.temperature if args.temperature is not None else 1.0) if sampling else 0.0,
        top_k=args.top_k or 0, top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed,
        stop=tuple(args.stop))


def _paths(text: str) -> tuple[Path, ...]:
    """`--trusted-keys`: one key file at least (an empty set would check nothing while looking like a check)."""
    paths = tuple(Path(t.strip()) for t in text.split(",") if t.strip())
    if not paths:
        raise argparse.ArgumentTypeError("an empty set of keys would accept any artifact; give at least one "
                                         "public-key file, or leave --trusted-keys out to load unsigned artifacts")
    return paths


def add_trusted_keys_flag(p: argparse.ArgumentParser) -> None:
    """The flags of loading an artifact (serve, generate, inspect): `--trusted-keys`, the public keys it must be
    signed by, and `--s3-endpoint-url`, the store an s3:// artifact is pulled from."""
    p.add_argument("--trusted-keys", type=_paths, default=None, metavar="PUB[,PUB...]",
                   help="public-key files (`neuron-opt keygen`); an artifact then loads only if signed by one of "
                        "them, unedited since (default: NEURON_OPT_TRUSTED_KEYS; unset: no signature required)")
    add_s3_endpoint_flag(p)


def add_s3_endpoint_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--s3-endpoint-url", default=None, metavar="URL",
                   help="for s3:// artifacts: an S3-compatible store's endpoint (default: AWS_ENDPOINT_URL, else "
                        "AWS S3); credentials come from boto3's usual chain")


def resolve_artifact_arg(args: argparse.Namespace) -> None:
    """An s3:// `args.artifact` pulled into the local artifact cache (once; neuron_opt.object_store) and replaced
    by the local copy's path; the URI stays in `args.artifact_source`. Called again in another process (a Ray
    replica on another node), it pulls there too."""
    from neuron_opt.object_store import is_remote, resolve  # here: the CLI parses without cryptography

    source = getattr(args, "artifact_source", None) or args.artifact
    if not source or not is_remote(source):
        return
    if args.artifact and not is_remote(args.artifact) and Path(args.artifact).is_dir():
        return
    args.artifact_source = source
    args.artifact = str(resolve(source, endpoint_url=args.s3_endpoint_url, trusted_keys=args.trusted_keys))


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's speculative_config fields, as flags (serve and generate)."""
    p.add_argument("--speculative-method", choices=["ngram", "draft_model", "eagle3"], default=None,
                   help="speculative decoding: 'ngram' proposes the tokens that followed the last n tokens' most "
                        "recent earlier occurrence in the prompt or output (prompt lookup); 'draft_model' (implied "
                        "by --speculative-model) a smaller model's greedy continuation; 'eagle3' an EAGLE-3 head's "
                        "(--speculative-model: its directory or Hub id; the model run eagerly with --model). All "
                        "need verify graphs (an artifact compiled with --num-speculative-tokens K)")
    p.add_argument("--speculative-model", default=None, metavar="PATH|ARTIFACT",
                   help="the draft model: an artifact (its batch size and max-model-len must cover the server's) "
                        "or a checkpoint (HF directory, GGUF, 'default', a Hub id at its main revision; run "
                        "eagerly), with the target's tokenizer; with --speculative-method eagle3, the EAGLE-3 head "
                        "(EAGLE/SpecForge or speculators layout)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="tokens proposed per step (default: the artifact's; with --model: 4)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram matched (default 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram matched (default 1)")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="speculate only in steps where the measured acceptance and verify cost say it pays "
                        "(default on; docs/speculative.md)")


def add_async_scheduling_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and prepare each engine step, and process the last step's outputs (detokenizing, "
                        "stop checks, streaming), while the step before runs (default: the backend's, on where it "
                        "pays: docs/serving.md, \"Async scheduling\"; off with speculative decoding, which refuses "
                        "it)")


def speculative_from_args(args: argparse.Namespace, compiled_k: int | None, bundled_draft: str | None = None):
    """(SpeculativeConfig or None, k the model needs verify graphs for or None). `compiled_k`: an artifact's k
    (0: none), None for a checkpoint; `bundled_draft`: the draft compiled into the artifact, the draft_model
    method's default."""
    method = args.speculative_method or ("draft_model" if args.speculative_model else None)
    draft = args.speculative_model or (bundled_draft if method == "draft_model" else None)
    if method is None:
        if args.num_speculative_tokens is not None:
            raise ConfigError("--num-speculative-tokens needs --speculative-method ngram or --speculative-model",
                              param="num_speculative_tokens")
        return None, None
    k = args.num_speculative_tokens or compiled_k or 4
    spec = SpeculativeConfig(k, method, args.prompt_lookup_max, args.prompt_lookup_min, args.speculative_adaptive,
                             draft)
    return spec, k


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("artifact", nargs="?", help="artifact directory produced by `neuron-opt compile`, or its s3:// URI")
    p.add_argument("--model", help="instead of an artifact, a checkpoint run eagerly: " + MODEL_HELP)
    add_hub_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="with --model: eager compute dtype (default float32); an artifact's is fixed at compile")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="run under this PEFT LoRA adapter, a directory or a Hub id (an artifact compiled with "
                        "--enable-lora, or --model)")
    add_sampling_flags(p)
    add_speculative_flags(p)
    add_async_scheduling_flag(p)
    add_trusted_keys_flag(p)
    add_parallel_flags(p)  # with --model: tp rank processes; an artifact's tp is fixed when it is compiled
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.artifact) == bool(args.model):
        raise ConfigError("generate: give either an artifact directory or --model PATH|default (not both)")
    resolve_artifact_arg(args)
    from neuron_opt.api import LLM  # here, not at the top: the CLI parses without loading the model path

    params = sampling_params_from_args(args)
    parallel = parallel_config_from_args(args)
    if args.artifact and parallel.tp != 1:
        raise ConfigError("generate: --tp applies to --model; an artifact runs at the tp it was compiled with")
    verified = None
    if args.artifact:  # read once, every check: the loader takes it as read
        from neuron_opt.artifact import read_verified  # here: the CLI parses without cryptography

        verified = read_verified(Path(args.artifact), trusted_keys=args.trusted_keys)
    spec, k = speculative_from_args(args, *(bundled_speculation(args.artifact, verified.manifest)
                                            if verified is not None else (None, None)))
    lora = None
    if args.lora is not None:
        lora = LoRARequest("adapter", args.lora)
    llm = LLM(args.artifact or args.model, revision=args.revision, gguf_file=args.gguf_file, dtype=args.dtype,
              parallel=None if args.artifact else parallel,
              num_speculative_tokens=k, trusted_keys=args.trusted_keys, verified=verified,
              lora=capacity_for(args.lora) if lora is not None and not args.artifact else None,
              async_scheduling=args.async_scheduling)
    ids = (llm.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
           else list(llm.tokenizer(args.prompt)["input_ids"]))
    stats = None
    if spec is None:
        out = llm.generate_ids(ids, params, lora)
    else:
        out, stats = llm.generate_ids_speculative(ids, params, spec, lora)
    if args.json:
        doc = {"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
               "finish_reason": out.finish_reason}
        if stats is not None:
            doc["speculative"] = {"draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
                                  "verify_steps": stats.verify_steps,
                                  "mean_accepted_length": round(stats.mean_accepted_length, 3)}
        json.dump(doc, sys.stdout)
        print()
    else:
        print(out.text)
    return 0


def bundled_speculation(artifact: str, manifest: Any) -> tuple[int, str | None]:
    """An artifact's verify k and the path of the draft compiled into it (None if none), from its manifest."""
    return manifest.buckets.num_speculative_tokens, str(Path(artifact) / manifest.draft) if manifest.draft else None
