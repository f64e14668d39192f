"""`neuron-opt serve`: OpenAI-compatible HTTP server (continuous batching) over an artifact or checkpoint."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from neuron_opt import envs
from neuron_opt.commands.serve_cluster import run_cluster
from neuron_opt.commands.serve_engine import (
    LIMIT_FLAGS,
    add_engine_flags,
    add_media_flags,
    api_key,
    build_engine,
    lora_runtime_loading,
    served_name,
    server_limits,
    uvicorn_limits,
)
from neuron_opt.errors import ConfigError
from neuron_opt.runtime.threads import ThreadPolicy, hand_threads_to_engine
from neuron_opt.server.limits import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CPU_LORAS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    ServerLimits,
)
from neuron_opt.server.reasoning import make_reasoning_parser
from neuron_opt.server.tools import make_parser


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, /v1/embeddings, "
        "/v1/models, /health and /metrics. Give a "
        "compiled artifact directory, or --model PATH|default to serve a checkpoint eagerly "
        "without compiling (slower, but starts at once).",
    )
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--kv-offloading-size", type=float, default=None, metavar="GIB",
        help="a second KV tier of this many GiB of host memory (vLLM's flag): prefix-cache blocks evicted from the "
        "KV pool are kept there and copied back on a later prefix hit instead of being recomputed "
        "(docs/long_context.md; the eager and cpu backends at tp 1, with prefix caching; default: none)",
    )
    p.add_argument("--kv-offloading-disk-dir", type=Path, default=None, metavar="DIR",
                   help="with --kv-offloading-size: a disk level below the host-memory tier, in a private directory "
                   "made inside DIR (and removed at exit); its size: --kv-offloading-disk-size")
    p.add_argument("--kv-offloading-disk-size", type=float, default=None, metavar="GIB",
                   help="the disk level's size in GiB (with --kv-offloading-disk-dir)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests queued beyond --max-num-seqs before answering 503 with Retry-After (with "
                   "--data-parallel: queued at the router)")
    p.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' on every /v1/* route and /tokenize, /detokenize (401 otherwise; "
        "/health and /metrics stay open). Default: $NEURON_OPT_API_KEY, else no key",
    )
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT LoRA adapters served by name (request `model`), for an artifact compiled with "
                        "--enable-lora; more load at run time: POST /v1/load_lora_adapter (docs/lora.md)")
    p.add_argument("--enable-lora-runtime-loading", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default, as in vLLM; "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true turns it on too); needs --lora-runtime-root")
    p.add_argument("--lora-runtime-root", default=None, metavar="DIR",
                   help="the only directory runtime-loaded adapters are read from (paths outside it are refused)")
    p.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help=f"most adapters registered at once with runtime loading, --lora-modules included (default "
                        f"{DEFAULT_MAX_CPU_LORAS})")
    p.add_argument("--shutdown-timeout", type=float, default=None, metavar="S",
                   help="on SIGTERM: answer new requests 503 and wait up to S seconds for those in flight, then exit 0 "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections (and requests) at once; past it uvicorn answers 503 (default "
                        f"{DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--timeout-keep-alive", type=int, default=None, metavar="S",
                   help=f"close an idle keep-alive connection after S seconds (default {DEFAULT_TIMEOUT_KEEP_ALIVE_S})")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info, the tokenizer's configuration with its chat template (vLLM's flag; "
                   "off by default, as there)")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (off by default: they describe the server to anyone)")
    p.add_argument("--enable-store", action="store_true",
                   help="keep /v1/responses results in memory (the latest 1024) for previous_response_id and "
                        "GET /v1/responses/{id} (vLLM: VLLM_ENABLE_RESPONSES_API_STORE=1)")
    lim = p.add_argument_group("request limits (past them: 400 naming the field; defaults: docs/serving.md)")
    for name, text in LIMIT_FLAGS.items():
        default = getattr(ServerLimits, name)
        lim.add_argument("--" + name.replace("_", "-"), type=type(default) if default is not None else int,
                         default=default,
                         help=text if default is None else f"{text} (default: {default})")
    add_media_flags(p)
    g = p.add_argument_group("scale-out (Ray Serve; pip install 'neuron-opt[cluster]')")
    g.add_argument(
        "--data-parallel", type=int, default=None, metavar="N",
        help="N replicas of the engine behind one endpoint, as a Ray Serve application: each replica loads the "
        "model once on its own cores (Ray resource neuron_cores = tp on Neuron, CPUs here), each request goes to the "
        "replica --routing picks, a replica that dies is restarted (docs/scale_out.md)",
    )
    g.add_argument(
        "--routing", choices=["prefix", "load"], default="prefix",
        help="how the router picks a replica: 'prefix' sends a request where its prompt's first blocks were sent "
        "before (their KV is cached there) unless that replica is --routing-balance-threshold requests busier than "
        "the least loaded; 'load' always takes the least loaded (default prefix)",
    )
    g.add_argument(
        "--routing-balance-threshold", type=int, default=4, metavar="N",
        help="with --routing prefix: ongoing requests a prefix's replica may have beyond the least loaded one "
        "before the request goes to the least loaded instead (default 4)",
    )
    g.add_argument(
        "--ray-address", default=None,
        help="join this Ray cluster (auto on one of its nodes, or HEAD_IP:6379) instead of starting a local Ray "
        "instance for the command's lifetime; implies --data-parallel 1 unless given",
    )
    g.add_argument(
        "--replica-cpus", type=float, default=None,
        help="CPUs each replica asks Ray for, and its torch threads (default: this machine's cores / N on the "
        "cpu and eager backends, 1 on neuron, where cores are asked as neuron_cores)",
    )
    p.set_defaults(func=run)


# flags of the single-process server's uvicorn, which `--data-parallel` does not take (Ray Serve's proxy serves HTTP)
SINGLE_PROCESS_FLAGS = ("--max-connections", "--timeout-keep-alive")


def thread_policy() -> ThreadPolicy:
    """`serve`'s torch threads when NEURON_OPT_NUM_THREADS is unset: the policy NEURON_OPT_THREAD_POLICY names, over
    the cores this process may use (runtime/threads.py; by default every core: docs/serving.md, "Threads")."""
    return ThreadPolicy(envs.THREAD_POLICY, len(os.sched_getaffinity(0)))


def threads_note(policy: ThreadPolicy) -> str:
    if envs.NUM_THREADS is not None:
        return f"{envs.NUM_THREADS} torch thread(s) from NEURON_OPT_NUM_THREADS"
    return (f"{policy.threads} torch thread(s), {policy.name!r} policy; NEURON_OPT_NUM_THREADS or "
            "NEURON_OPT_THREAD_POLICY override")


def run(args: argparse.Namespace) -> int:
    if bool(args.artifact) == bool(args.model):
        raise ConfigError("serve: give either an artifact directory or --model PATH|default (not both)")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs: must be >= 1, got {args.max_num_seqs}")
    if args.max_waiting < 0:
        raise ConfigError(f"--max-waiting: must be >= 0, got {args.max_waiting}", param="max_waiting")
    limits = server_limits(args)  # bad values fail before anything loads
    if args.data_parallel is not None or args.ray_address is not None:
        for flag in SINGLE_PROCESS_FLAGS:
            if getattr(args, flag.lstrip("-").replace("-", "_")) not in (None, False):
                raise ConfigError(f"{flag}: the single-process server's; not supported with --data-parallel",
                                  param="data_parallel")
        return run_cluster(args)
    lora_runtime = lora_runtime_loading(args)
    uvicorn_limits(args)
    # the `serve` extra (fastapi, uvicorn): imported once serving starts, so the CLI parses without them
    import uvicorn

    from neuron_opt.server.app import create_app
    from neuron_opt.server.drain import DrainingServer
    from neuron_opt.server.media import image_renderer

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    policy = thread_policy()  # a bad NEURON_OPT_THREAD_POLICY fails before the model loads
    threads = envs.NUM_THREADS or policy.threads
    torch.set_num_threads(threads)  # loading uses them too
    key = api_key(args)
    engine = build_engine(args)
    hand_threads_to_engine(engine.runners, threads)
    name = served_name(args)
    app = create_app(engine, engine.tokenizer, engine.encode_chat, name, engine.runner.max_model_len, api_key=key,
                     tool_parser=make_parser(args.tool_call_parser, engine.tokenizer), limits=limits,
                     reasoning_parser=make_reasoning_parser(args.reasoning_parser, engine.tokenizer),
                     enable_docs=args.enable_docs, enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
                     enable_store=args.enable_store, lora_runtime=lora_runtime,
                     encode_image_chat=image_renderer(engine))
    url = f"http://{args.host}:{args.port}"
    if key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without an API key: anyone who reaches this port can use the model "
              "(give --api-key, and put TLS in front: docs/scale_out.md)", flush=True)
    auth = "" if key is None else " -H 'Authorization: Bearer <key>'"
    route, body = (("embeddings", '"input": ["What is the capital of France?"]') if engine.embeds else
                   ("chat/completions", '"messages": [{"role": "user", "content": "What is the capital of France?"}]'
                    ', "max_tokens": 32, "temperature": 0'))
    print(
        f"Serving {name!r} on {url} ({engine.max_num_seqs} sequences at once, {threads_note(policy)}). Try:\n"
        f"  curl {url}/v1/{route}{auth} -H 'Content-Type: application/json' -d "
        f'\'{{"model": "{name}", {body}}}\'',
        flush=True,
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            **uvicorn_limits(args))
    shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT_S if args.shutdown_timeout is None else args.shutdown_timeout
    DrainingServer(config, app.state.drain, shutdown_timeout).run()
    return 0
