"""`neuron-opt serve ... --data-parallel N [--ray-address ADDR]`: the Ray Serve application of
neuron_opt.server.cluster, started and stopped by this command (docs/scale_out.md)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from neuron_opt.commands.lora_flags import parse_lora_modules
from neuron_opt.commands.serve_engine import (
    api_key,
    build_engine,
    check_args,
    lora_runtime_loading,
    served_name,
    server_limits,
)
from neuron_opt.config import CacheConfig
from neuron_opt.errors import ConfigError
from neuron_opt.hub import hub_id, resolve_model
from neuron_opt.lora.adapter import read_adapter
from neuron_opt.server.limits import DEFAULT_SHUTDOWN_TIMEOUT_S

RAY_NAMESPACE = "neuron_opt"


def replica_resources(backend: str, tp: int, replicas: int, replica_cpus: float | None) -> tuple[dict[str, Any],
                                                                                              int | None]:
    """(Ray actor options of one replica, its torch threads or None for the default).

    neuron: `neuron_cores` = tp (Ray then sets NEURON_RT_VISIBLE_CORES to the cores it gives the replica) and
    `--replica-cpus` CPUs (default 1) for the host side. cpu / eager: `--replica-cpus` CPUs, default this
    machine's usable cores / N, and as many torch threads (tp rank processes share them)."""
    if replica_cpus is not None and replica_cpus <= 0:
        raise ConfigError(f"--replica-cpus: must be > 0, got {replica_cpus}", param="replica_cpus")
    if backend == "neuron":
        return {"num_cpus": replica_cpus or 1, "resources": {"neuron_cores": tp}}, None
    cpus = replica_cpus or max(1, len(os.sched_getaffinity(0)) // replicas)
    return {"num_cpus": cpus}, max(1, int(cpus))


def lora_modules(args: argparse.Namespace, manifest: Any) -> dict[str, str]:
    """`--lora-modules` checked here, not in N replicas: the model takes adapters and each one reads; their paths
    made absolute in `args` (a Ray worker's working directory is not ours). Returns {name: absolute path}."""
    modules = parse_lora_modules(getattr(args, "lora_modules", None))
    if not modules:
        return {}
    if manifest is None or manifest.lora is None:
        raise ConfigError("--lora-modules: this model takes no adapters (compile it with --enable-lora)",
                          param="lora_modules")
    modules = {name: path if hub_id(path) is not None else str(Path(path).resolve())
               for name, path in modules.items()}
    for path in modules.values():
        read_adapter(path, manifest.model, manifest.lora)
    args.lora_modules = [f"{name}={path}" for name, path in modules.items()]
    return modules


def drain(ingress: Any, timeout_s: float) -> None:
    """The first SIGTERM/SIGINT: the router refuses new requests (503) while those in flight finish, for up to
    `timeout_s` (server/cluster/router.py, "Drain"); a second signal stops waiting."""
    def again(*_: Any) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, again)
    print(f"Draining: new requests get 503; waiting up to {timeout_s:g} s for those in flight...", flush=True)
    try:
        left = ingress.begin_drain.remote(timeout_s).result(timeout_s=timeout_s + 30)
    except KeyboardInterrupt:
        return
    except Exception as e:  # noqa: BLE001 -- the router gone, say: nothing left to wait for, stop now
        print(f"drain: {type(e).__name__}: {e}; stopping now", flush=True)
        return
    finally:  # the cleanup that follows runs to its end
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    if left:
        print(f"--shutdown-timeout: {left} request(s) still in flight are cut off", flush=True)


def run_cluster(args: argparse.Namespace) -> int:
    replicas = 1 if args.data_parallel is None else args.data_parallel
    if replicas < 1:
        raise ConfigError(f"--data-parallel: must be >= 1, got {replicas}", param="data_parallel")
    if args.routing_balance_threshold < 0:
        raise ConfigError(f"--routing-balance-threshold: must be >= 0, got {args.routing_balance_threshold}",
                          param="routing_balance_threshold")
    # fail here, not in N replica processes: paths absolute (a Ray worker's working directory is not ours), the
    # checkpoint or artifact readable
    for field in ("artifact", "model"):
        value = getattr(args, field)
        # s3://: pulled by check_args; a Hub id: fetched by each process that loads it, from its node's Hub cache
        if value and value != "default" and not value.startswith("s3://") and hub_id(value) is None:
            setattr(args, field, str(Path(value).resolve()))
    # the keys this command trusts, named explicitly for the replicas: they may not share our environment
    from neuron_opt.signing import trusted_key_paths  # here: the CLI parses without cryptography

    args.trusted_keys = tuple(p.resolve() for p in trusted_key_paths(args.trusted_keys))
    if args.model:
        from neuron_opt.checkpoint import open_checkpoint  # here: the CLI parses without the checkpoint readers

        open_checkpoint(resolve_model(args.model, revision=args.revision, gguf_file=args.gguf_file))
    verified = check_args(args, verify_hashes=False)[0]  # each replica verifies the files as it loads them
    manifest = None if verified is None else verified.manifest
    adapters = lora_modules(args, manifest)
    key = api_key(args)
    limits = server_limits(args)
    lora_runtime = lora_runtime_loading(args)
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout: must be >= 0, got {args.shutdown_timeout}", param="shutdown_timeout")
    shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT_S if args.shutdown_timeout is None else args.shutdown_timeout
    if args.enable_docs:
        raise ConfigError("--enable-docs: the data-parallel router serves no API docs; leave it out",
                          param="enable_docs")
    if args.enable_store:
        raise ConfigError("--enable-store: the data-parallel router serves no /v1/responses; leave it out",
                          param="enable_store")
    backend, tp = ("eager", 1) if manifest is None else (manifest.backend, manifest.parallel.tp)  # --model: eager
    actor_options, threads = replica_resources(backend, tp, replicas, args.replica_cpus)
    if not args.ray_address:
        # the command's own one-machine instance listens on loopback only, as the single-process server does:
        # Ray reads this switch (multi-node networking off: the node's address is 127.0.0.1) once, at import
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError("--data-parallel / --ray-address run on Ray Serve, which is not installed: "
                          "pip install 'neuron-opt[cluster]'") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.ray_address:
        try:
            ray.init(address=args.ray_address, namespace=RAY_NAMESPACE, log_to_driver=args.log_level == "debug")
        except (ConnectionError, ray.exceptions.AuthenticationError) as e:
            raise ConfigError(f"--ray-address {args.ray_address}: {e} (is `ray start --head` running there, and does "
                              "this shell have the cluster's RAY_AUTH_MODE / RAY_AUTH_TOKEN?)",
                              param="ray_address") from None
    else:
        ray.init(address="local", num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False,
                 namespace=RAY_NAMESPACE,
                 log_to_driver=args.log_level == "debug")
    need = {"CPU": actor_options["num_cpus"] * replicas, **{k: v * replicas for k, v in
                                                            actor_options.get("resources", {}).items()}}
    have = ray.cluster_resources()
    short = {k: (v, have.get(k, 0)) for k, v in need.items() if have.get(k, 0) < v}
    if short:
        ray.shutdown()
        raise ConfigError("--data-parallel: the Ray cluster lacks the resources for "
                          f"{replicas} replica(s): " + ", ".join(f"{k} needs {v:g}, has {h:g}" for k, (v, h)
                                                                 in short.items()), param="data_parallel")
    from ray.serve.config import RequestRouterConfig
    from ray.serve.schema import LoggingConfig

    # on Ray (the `cluster` extra), as the two above
    from neuron_opt.server.cluster.board import metrics_board
    from neuron_opt.server.cluster.replica import EngineReplica
    from neuron_opt.server.cluster.router import APP_NAME, ROUTER_SPARE_REQUESTS, Router
    from neuron_opt.server.cluster.routing import PrefixAffinityRouter

    name = served_name(args)
    params = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    # from here on SIGINT/SIGTERM end the command through the cleanup below, also while the replicas deploy (set
    # after ray.init, whose core worker installs a handler of its own that aborts the process)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        board = metrics_board()
        for adapter, path in adapters.items():  # the adapter set every replica serves (server/cluster/board.py)
            ray.get(board.set_adapter.remote(adapter, path))
        # a replica takes up to 2 x its batch: a free slot is refilled without waiting on the router, and the rest
        # queues at the router (up to --max-waiting), where it goes to whichever replica frees up first
        per_replica = 2 * (args.max_num_seqs or (manifest.buckets.decode_batches[-1] if manifest else 16))
        max_in_flight = replicas * per_replica + args.max_waiting
        params.max_waiting = per_replica  # a replica's engine admits all Serve sends it: the queue is the router's
        router_config = RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs={
            "tokenizer": ({"artifact": args.artifact} if args.artifact else
                          {"model": args.model, "revision": args.revision, "gguf_file": args.gguf_file}),
            "block_size": manifest.cache.block_size if manifest else CacheConfig.block_size,
            "tool_call_parser": args.tool_call_parser, "policy": args.routing,
            "balance_threshold": args.routing_balance_threshold})
        replica = EngineReplica.options(
            num_replicas=replicas, ray_actor_options=actor_options, max_ongoing_requests=per_replica,
            health_check_period_s=5.0, request_router_config=router_config,
        ).bind(functools.partial(build_engine, params), name, board, threads, args.tool_call_parser, limits,
               args.reasoning_parser)
        print(f"Starting {replicas} replica(s) of {name!r} on Ray ({actor_options}, "
              f"{threads or 'default'} torch thread(s) each)...", flush=True)
        router = Router.options(max_ongoing_requests=max_in_flight + ROUTER_SPARE_REQUESTS).bind(
            replica, board, name, key, limits, max_in_flight, lora_runtime, args.enable_tokenizer_info_endpoint)
        ingress = serve.run(router, name=APP_NAME, route_prefix="/",
                            logging_config=LoggingConfig(log_level=args.log_level.upper(), enable_access_log=False))
        url = f"http://{args.host}:{args.port}"
        print(f"Serving {name!r} on {url}: {replicas} replica(s) behind one endpoint (Ray Serve). Try:\n"
              f"  curl {url}/v1/completions -H 'Content-Type: application/json' -d "
              f'\'{{"model": "{name}", "prompt": "The capital of France is", "max_tokens": 16}}\'', flush=True)
        stop.wait()
        drain(ingress, shutdown_timeout)
    finally:
        try:
            serve.delete(APP_NAME)
            if not args.ray_address:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0
