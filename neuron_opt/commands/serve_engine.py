"""The engine, API key and request limits `neuron-opt serve` runs with, built from its flags: shared by the
single-process server (neuron_opt.commands.serve) and `serve --data-parallel` (neuron_opt.commands.serve_cluster) and
its replicas."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from neuron_opt import envs
from neuron_opt.commands.generate import (
    add_async_scheduling_flag,
    add_speculative_flags,
    add_trusted_keys_flag,
    bundled_speculation,
    resolve_artifact_arg,
    speculative_from_args,
)
from neuron_opt.commands.hub_flags import MODEL_HELP, add_hub_flags
from neuron_opt.commands.lora_flags import parse_lora_modules
from neuron_opt.errors import ConfigError
from neuron_opt.hub import hub_id
from neuron_opt.server.limits import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    MAX_HEADER_BYTES,
    PROMPT_CHARS_PER_TOKEN,
    LoraRuntimeLoading,
    MediaLimits,
    ServerLimits,
)
from neuron_opt.server.reasoning import REASONING_PARSERS
from neuron_opt.server.tool_parsers import PARSERS


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the engine `build_engine` makes and of the replies' parsers: what `serve` and `run-batch` share."""
    p.add_argument("artifact", nargs="?", help="artifact directory produced by `neuron-opt compile`, or its s3:// URI")
    p.add_argument("--model", help="instead of an artifact, a checkpoint run eagerly (no compile): " + MODEL_HELP)
    add_hub_flags(p)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id requests must give (default: 'default', the Hub id as given, or the artifact/checkpoint "
        "name)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences decoded together (default: the artifact's batch size; 16 with --model)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="with --model: KV length per sequence (default: min(model limit, 2048)); an artifact's is fixed at "
        "compile time (given, it must equal the artifact's)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per engine step: every running decode first, then prompt chunks; lower bounds the "
        "inter-token latency of running streams while new prompts arrive",
    )
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="reuse the KV blocks of prompt prefixes computed before (default: on where the artifact has offset "
        "prefill buckets, i.e. unless compiled with --no-offset-prefill)",
    )
    p.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="split prompts into chunks that fit the step's token budget, and serve prompts longer than the "
        "largest prefill bucket (default: on where the artifact has offset prefill buckets)",
    )
    p.add_argument(
        "--tool-call-parser", default=None, choices=sorted(PARSERS),
        help="the tool-call format of the model's replies (default: the one its chat template writes; 'generic' "
        "for templates without tools: the tools go into the system prompt and the reply is a JSON object)",
    )
    p.add_argument(
        "--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
        help="split the model's thinking from its answer (message.reasoning): deepseek_r1, qwen3, openai_gptoss "
        "(harmony), granite (default: the one its chat template writes, when unambiguous; else none)",
    )
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"],
        help="with --model: compute dtype (default float32); an artifact's is fixed (given, it must match)"
    )
    add_speculative_flags(p)
    add_async_scheduling_flag(p)
    add_trusted_keys_flag(p)


# the ServerLimits fields set by flags of the same name (--max-body-bytes -> max_body_bytes), and their help
LIMIT_FLAGS = {
    "max_body_bytes": "bytes of a request body; past it 413, refused while reading (also chunked bodies)",
    "max_prompt_chars": f"characters of a prompt (chat: of all messages), checked before tokenizing; also token ids "
    f"of a prompt given as ids (default: {PROMPT_CHARS_PER_TOKEN} x max_model_len)",
    "max_stop_strings": "stop strings per request",
    "max_stop_chars": "characters per stop string",
    "max_stop_token_ids": "stop_token_ids per request",
    "max_schema_bytes": "bytes, as JSON, of each of response_format, structured_outputs, guided_*, tools, "
                        "chat_template_kwargs",
    "max_messages": "chat messages per request",
    "max_embedding_inputs": "inputs per /v1/embeddings request",
    "max_grammar_repeat": "the cap on counts in a request's grammar (maxLength, maxItems, {m,n} in patterns, regexes "
    "and EBNF): larger upper bounds are lowered to it, larger lower bounds refused",
    "max_grammar_compiles": "grammars compiled at once, in a pool of their own (more wait; past 16x as many: 503)",
    "grammar_compile_timeout": "seconds a grammar may take to compile before its request is refused",
}


def api_key(args: argparse.Namespace) -> str | None:
    """The key `serve` requires: --api-key, else NEURON_OPT_API_KEY, else none."""
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key: must not be empty (leave it out to serve without a key)", param="api_key")
    return args.api_key or envs.API_KEY


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """`serve`'s flags on images in requests (vLLM's names where vLLM has the flag; server/media.py)."""
    g = p.add_argument_group("images in requests (models that take them; past a limit: 400 naming the field)")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help=f"most images per request, vLLM's form: '{{\"image\": N}}' (default "
                        f"{MediaLimits.max_images})")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="hosts whose http(s) image URLs the server fetches (exact names; redirects only to these); "
                        "default: none, only data: URLs")
    g.add_argument("--allowed-local-media-path", type=Path, default=None, metavar="DIR",
                   help="file:// image URLs are read from under DIR only (symlinks resolved); default: none")
    g.add_argument("--max-image-bytes", type=int, default=MediaLimits.max_image_bytes,
                   help=f"bytes of one encoded image (default {MediaLimits.max_image_bytes})")
    g.add_argument("--max-image-pixels", type=int, default=MediaLimits.max_image_pixels,
                   help="pixels (width x height) of one image, read from its header before it is decoded "
                        f"(default {MediaLimits.max_image_pixels})")
    g.add_argument("--media-fetch-timeout", type=float, default=MediaLimits.media_fetch_timeout, metavar="S",
                   help=f"seconds a remote image may take to download (default {MediaLimits.media_fetch_timeout:g})")


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The image limits `add_media_flags`' flags set (ConfigError naming the flag)."""
    max_images = (MediaLimits.max_images if args.limit_mm_per_prompt is None
                  else MediaLimits.parse_limit_mm_per_prompt(args.limit_mm_per_prompt))
    domains = tuple(dict.fromkeys(h.lower().rstrip(".") for h in args.allowed_media_domains or ()))
    try:
        return MediaLimits(max_images, args.max_image_bytes, args.max_image_pixels, domains,
                           args.allowed_local_media_path, args.media_fetch_timeout)
    except ConfigError as e:
        flag = "--" + (e.param or "").replace("_", "-").replace("max-images", "limit-mm-per-prompt")
        raise ConfigError(f"{flag}{str(e).removeprefix(e.param or '')}", param=e.param) from None


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The request limits the flags set."""
    return ServerLimits(**{name: getattr(args, name) for name in LIMIT_FLAGS}, media=media_limits(args))


def lora_runtime_loading(args: argparse.Namespace) -> LoraRuntimeLoading | None:
    """What /v1/load_lora_adapter may load: None unless --enable-lora-runtime-loading (or vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING), which needs --lora-runtime-root."""
    if not (args.enable_lora_runtime_loading or envs.ALLOW_RUNTIME_LORA_UPDATING):
        for flag, value in (("--lora-runtime-root", args.lora_runtime_root), ("--max-cpu-loras", args.max_cpu_loras)):
            if value is not None:
                raise ConfigError(f"{flag}: needs --enable-lora-runtime-loading", param=flag[2:].replace("-", "_"))
        return None
    if args.lora_runtime_root is None:
        raise ConfigError("--enable-lora-runtime-loading: give --lora-runtime-root DIR, the only directory adapters "
                          "load from", param="lora_runtime_root")
    if args.max_cpu_loras is None:
        return LoraRuntimeLoading(Path(args.lora_runtime_root))
    return LoraRuntimeLoading(Path(args.lora_runtime_root), args.max_cpu_loras)


def uvicorn_limits(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's connection limits from `serve`'s flags: connections at once (past them 503), the idle keep-alive
    timeout, and the bytes of a request's head (h11's incomplete event; past them 400)."""
    connections = DEFAULT_MAX_CONNECTIONS if args.max_connections is None else args.max_connections
    keep_alive = DEFAULT_TIMEOUT_KEEP_ALIVE_S if args.timeout_keep_alive is None else args.timeout_keep_alive
    if connections < 1:
        raise ConfigError(f"--max-connections: must be >= 1, got {connections}", param="max_connections")
    if keep_alive < 1:
        raise ConfigError(f"--timeout-keep-alive: must be >= 1, got {keep_alive}", param="timeout_keep_alive")
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout: must be >= 0, got {args.shutdown_timeout}", param="shutdown_timeout")
    return {"limit_concurrency": connections, "timeout_keep_alive": keep_alive, "http": "h11",
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES}


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    src = getattr(args, "artifact_source", None) or args.artifact or args.model
    if src == "default" or hub_id(src) is not None:  # a Hub id as given (vLLM's default)
        return src
    return Path(src.rstrip("/")).name.removesuffix(".gguf")


def check_args(args: argparse.Namespace, verify_hashes: bool = True) -> tuple[Any, Any, int | None]:
    """(the artifact's VerifiedManifest or None, SpeculativeConfig or None, verify k or None): the flags checked
    against the artifact before anything loads (`serve --data-parallel` checks them once, before starting N
    replicas, without hashing the files: `verify_hashes=False`). The manifest is read once, here; the loader
    takes it as read."""
    resolve_artifact_arg(args)  # an s3:// artifact pulled here, in the process that loads it
    if not args.artifact:
        return (None, *speculative_from_args(args, None))
    from neuron_opt.artifact import read_verified  # here: the CLI parses without the artifact readers (cryptography)

    verified = read_verified(Path(args.artifact), verify_hashes=verify_hashes, trusted_keys=args.trusted_keys)
    manifest = verified.manifest
    largest = manifest.buckets.decode_batches[-1]
    if args.max_num_seqs and args.max_num_seqs > largest:
        raise ConfigError(f"--max-num-seqs: {args.max_num_seqs} exceeds the artifact's largest decode batch "
                          f"({largest}); compile it with --batch-size {args.max_num_seqs}", param="max_num_seqs")
    return (verified, *speculative_from_args(args, *bundled_speculation(args.artifact, manifest)))


def check_kv_offloading(args: argparse.Namespace) -> None:
    """The KV tier's flags, before the model loads: sizes > 0, the disk level's directory and size together, and
    only under a host-memory tier."""
    for flag in ("kv_offloading_size", "kv_offloading_disk_size"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{flag.replace('_', '-')}: must be > 0 GiB (a finite number), got {value}",
                              param=flag)
    if (args.kv_offloading_disk_dir is None) != (args.kv_offloading_disk_size is None):
        raise ConfigError("--kv-offloading-disk-dir and --kv-offloading-disk-size go together",
                          param="kv_offloading_disk_dir")
    if args.kv_offloading_disk_dir is not None and args.kv_offloading_size is None:
        raise ConfigError("--kv-offloading-disk-dir: the disk level sits below the host-memory tier; give "
                          "--kv-offloading-size too", param="kv_offloading_disk_dir")
    if args.kv_offloading_disk_dir is not None and not Path(args.kv_offloading_disk_dir).is_dir():
        raise ConfigError(f"--kv-offloading-disk-dir: {args.kv_offloading_disk_dir} is not an existing local "
                          "directory", param="kv_offloading_disk_dir")


def build_engine(args: argparse.Namespace) -> Any:
    """The (not yet started) `Engine` that `serve` runs, from its flags: the model loaded (`api.load_model`), the
    engine built over its runner; `serve --data-parallel` calls it in every replica process."""
    # here, not at the top: the CLI parses without loading the model path (executors, engine, transformers)
    from neuron_opt.api import load_draft, load_eagle3, load_model
    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.kv_tier import GIB, KVTier, tier_pools
    from neuron_opt.runtime.output import model_eos_token_ids

    check_kv_offloading(args)
    verified, spec, k = check_args(args)
    if args.artifact:
        model = load_model(args.artifact, dtype=args.dtype, max_model_len=args.max_model_len,
                           num_speculative_tokens=k, trusted_keys=args.trusted_keys, verified=verified,
                           revision=args.revision, gguf_file=args.gguf_file)  # given, refused: not a Hub id
    else:
        model = load_model(args.model, dtype=args.dtype, batch_size=args.max_num_seqs or 16,
                           max_model_len=args.max_model_len, num_speculative_tokens=k, revision=args.revision,
                           gguf_file=args.gguf_file)
    draft: Any = None
    if spec is not None and spec.method == "eagle3":
        draft = load_eagle3(spec.model, model)
    elif spec is not None and spec.model is not None:  # a KV slot in the draft for every sequence the engine runs
        largest = model.runner.buckets.decode_batches[-1]
        draft = load_draft(spec.model, model, min(args.max_num_seqs or largest, largest), args.trusted_keys).runner
    kv_tier = None
    if args.kv_offloading_size is not None:
        disk = args.kv_offloading_disk_dir
        pools, window = tier_pools(model.runner.executor, model.model_config, model.runner.cache)
        kv_tier = KVTier(pools, int(args.kv_offloading_size * GIB), disk,
                         int(args.kv_offloading_disk_size * GIB) if disk is not None else 0, window_pools=window)
    engine = Engine(
        model.runner,
        model.tokenizer,
        model_eos_token_ids(model.model_config.eos_token_ids, model.tokenizer),
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        speculative=spec,
        draft=draft,
        kv_tier=kv_tier,
        async_scheduling=args.async_scheduling,
    )
    modules = parse_lora_modules(getattr(args, "lora_modules", None))
    if modules and engine.loras is None:
        raise ConfigError("--lora-modules: this model takes no adapters (compile it with --enable-lora)",
                          param="lora_modules")
    for name, path in modules.items():
        engine.loras.register(name, path)
    return engine
