"""llama.cpp's own server beside ours on the same weights (`--scenario peer`): one pair of servers per `--pair`
width, the same prompts through the same client, rounds interleaved (neuron_opt.bench.llamacpp_server builds and
configures the peer)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from neuron_opt.bench import RunRecord
from neuron_opt.bench.serve.client import (
    ROOT,
    free_port,
    make_prompts,
    run_load,
    start_server,
    stop_server,
    summarize,
    wait_healthy,
)


def start_llama_server(cmd: list[str], log: Path) -> subprocess.Popen:
    """llama-server from `cmd`, its output appended to `log`, with libgomp's default wait policy (the variables
    that change it removed from its environment, as for the decode benchmark's llama.cpp)."""
    from neuron_opt.bench.decode import LLAMACPP_UNSET_ENV

    print("+", shlex.join(cmd), file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k not in LLAMACPP_UNSET_ENV}
    with log.open("a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def _serve_loads(proc: subprocess.Popen, url: str, args: argparse.Namespace, warm: list[list[int]],
                 loads: list[tuple[int, int, list[list[int]]]], who: str) -> list[dict[str, object]]:
    """On the server `proc` (stopped at the end): a warm-up (every stream at once, a short answer), then every load
    (prompt length, streams, prompts) in turn; summarize() of each."""
    try:
        wait_healthy(url, proc)
        warmed, _ = asyncio.run(run_load(url, warm, 4, len(warm), float("inf"), args.seed))
        bad = [r.error for r in warmed if not r.ok]
        if bad:
            raise SystemExit(f"{who}: the warm-up failed ({len(bad)} of {len(warm)} requests): {bad[0]}")
        out = []
        for plen, c, prompts in loads:
            results, dur = asyncio.run(run_load(url, prompts, args.output_len, c, args.request_rate, args.seed))
            s = summarize(results, dur, plen) | {"prompt_len": plen, "concurrency": c,
                                                 "errors": [r.error for r in results if r.error][:5]}
            out.append(s)
            print(f"{who} in {plen} c={c}: {s['output_throughput']:.1f} out tok/s, TTFT p50 "
                  f"{s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms, "
                  f"{s['completed']}/{len(results)} ok", file=sys.stderr)
        return out
    finally:
        stop_server(proc)


def _port_free(cmd: list[str]) -> str:
    """A command line with its port (a fresh one per start) as PORT."""
    return shlex.join(["PORT" if i and cmd[i - 1] == "--port" else a for i, a in enumerate(cmd)])


def _peer_turn(args: argparse.Namespace, who: str, artifact: Path, llama_cmd: Callable[[int], list[str]],
               log: Path, warm: list[list[int]], loads: list[tuple[int, int, list[list[int]]]], label: str,
               record: RunRecord) -> tuple[str, list]:
    """One server's turn in a round: started (ours on `artifact`, or llama-server from `llama_cmd(port)` logging
    to `log`), warmed up, every load run, stopped; the other processes' CPU use watched over it. Returns its
    command line (port as PORT) and the loads' summaries."""
    from neuron_opt.bench import CpuWatch

    port = free_port()
    watch = CpuWatch()
    if who == "ours":
        proc = start_server(args, port, (args.budget_flag, str(args.max_num_batched_tokens)), model=str(artifact))
    else:
        proc = start_llama_server(llama_cmd(port), log)
    res = _serve_loads(proc, f"http://127.0.0.1:{port}", args, warm, loads, label)
    rec = {"turn": label, **watch.stop()}
    record.idle.setdefault("rounds", []).append(rec)
    record.check(rec, f"during {label}")
    return _port_free(list(proc.args)), res


def scenario_peer(args: argparse.Namespace, vocab: int, record: RunRecord) -> dict[str, object]:
    """Ours against llama.cpp's llama-server on the same weights, per --pair: every --prompt-lens x --concurrency
    load on our server, then the same loads on llama-server (the order alternating by round), one server alive at
    a time, --rounds times; medians with min-max and per-round ratios (neuron_opt.bench.llamacpp_server)."""
    import neuron_opt
    from neuron_opt import envs
    from neuron_opt.bench import llamacpp_server as peer
    from neuron_opt.bench.llamacpp import storage_gguf
    from neuron_opt.checkpoint import open_checkpoint

    pairs, levels, lens = args.peer_pairs, args.peer_levels, args.peer_lens
    build = peer.ensure_built(envs.CACHE_DIR, args.llamacpp_version, args.peer_cmake_args)
    ckpt = open_checkpoint("default")
    ggufs = {w: storage_gguf(ckpt.source, ckpt.weights_fingerprint(), peer.PAIRS[w][0], envs.CACHE_DIR,
                             peer.quantizer(build.quantize)) for w in pairs}
    cores = len(os.sched_getaffinity(0))
    threads, bthreads = args.llamacpp_threads or cores, args.llamacpp_batch_threads or cores
    slots, ctx = args.llamacpp_slots or max(levels), peer.context_per_slot(lens, args.output_len)
    extra = tuple(shlex.split(args.llamacpp_extra))
    loads = [(n, c, make_prompts(peer.requests_per_load(args.num_prompts, c), n, vocab, args.seed + 1009 * n + c))
             for n in lens for c in levels]  # distinct prompts per load: no prefix cache hits on either server
    warm = (make_prompts(max(levels), min(lens), vocab, args.seed + 1)
            + make_prompts(1, max(lens), vocab, args.seed + 2))
    runs: dict[str, dict[str, list]] = {w: {"ours": [], "llamacpp": []} for w in pairs}
    commands: dict[str, dict[str, str]] = {w: {} for w in pairs}
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-peer-"))
    t_run = time.monotonic()
    for rnd in range(1, args.rounds + 1):
        t_round = time.monotonic()
        for w, artifact in pairs.items():
            for who in ("ours", "llamacpp") if rnd % 2 else ("llamacpp", "ours"):
                def llama_cmd(port: int, gguf: Path = ggufs[w]) -> list[str]:
                    return peer.server_command(build.server, gguf, port, threads, bthreads, slots, ctx, extra)

                commands[w][who], res = _peer_turn(args, who, artifact, llama_cmd,
                                                   logs / f"llama-server-{w}.log", warm, loads,
                                                   f"round {rnd} {w} {who}", record)
                runs[w][who].append([s | {"round": rnd} for s in res])
        if rnd == 1:
            took = time.monotonic() - t_round
            print(f"round 1 took {took / 60:.1f} min: the run about {took * args.rounds / 60:.0f} min",
                  file=sys.stderr, flush=True)
    results = {w: [peer.compare([r[i] for r in runs[w]["ours"]], [r[i] for r in runs[w]["llamacpp"]])
                   | {"prompt_len": n, "concurrency": c} for i, (n, c, _) in enumerate(loads)] for w in pairs}
    info = {w: peer.system_info(p.read_text()) for w in pairs if (p := logs / f"llama-server-{w}.log").is_file()}
    shutil.rmtree(logs, ignore_errors=True)
    print(peer.table(results), file=sys.stderr if args.json else sys.stdout, flush=True)
    return {
        "scenario": "peer", "rounds": args.rounds, "duration_s": time.monotonic() - t_run,
        "prompt_lens": lens, "concurrency": levels, "output_len": args.output_len,
        "requests_per_load": {c: peer.requests_per_load(args.num_prompts, c) for c in levels},
        "config": {k: str(v) for k, v in vars(args).items()},
        "ours": {"neuron_opt": neuron_opt.__version__, "git": peer.git_revision(ROOT),
                 "artifacts": {w: str(a) for w, a in pairs.items()},
                 "commands": {w: c["ours"] for w, c in commands.items()},
                 "threads_env": {k: os.environ.get(k) for k in ("NEURON_OPT_NUM_THREADS", "OMP_NUM_THREADS")}},
        "llamacpp": build.to_json() | {
            "threads": threads, "batch_threads": bthreads, "slots": slots, "ctx_per_slot": ctx,
            "ggufs": {w: str(g) for w, g in ggufs.items()}, "commands": {w: c["llamacpp"] for w, c in commands.items()},
            "system_info": info, "omp_wait_policy": "unset (libgomp's default)"},
        "runs": runs, "results": results,
    }


def check_peer_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--scenario peer's flags, checked before anything runs (a usage error naming the flag): the pairs and each
    artifact's width, the loads, the llama.cpp version to build. Parsed values go into args.peer_*."""
    from neuron_opt.artifact import read_manifest
    from neuron_opt.bench import llamacpp_server as peer
    from neuron_opt.checkpoint import open_checkpoint
    from neuron_opt.compiler import default_dtype
    from neuron_opt.errors import NeuronOptError

    try:
        args.peer_pairs = peer.parse_pairs(args.pair)
        args.peer_levels = peer.parse_int_list("--concurrency", args.concurrency)
        args.peer_lens = peer.parse_int_list("--prompt-lens", args.prompt_lens)
        source = open_checkpoint("default").weights_fingerprint()
        for width, artifact in args.peer_pairs.items():
            try:
                m = read_manifest(artifact, verify_hashes=False)
            except (OSError, NeuronOptError) as e:
                raise peer.PeerConfigError(f"--pair {width}={artifact}: not a readable artifact ({e})") from None
            peer.check_pair(width, m.dtype, m.quant.method, default_dtype("cpu"))
            if m.source.get("weights_sha256") != source:
                raise peer.PeerConfigError(f"--pair {width}={artifact}: compiled from {m.source.get('model')}, "
                                           "not the default GGUF that llama-server serves")
            if m.cache.max_model_len < max(args.peer_lens) + args.output_len:
                raise peer.PeerConfigError(f"--pair {width}={artifact}: max_model_len {m.cache.max_model_len} < "
                                           f"the longest prompt + --output-len ({max(args.peer_lens)} + "
                                           f"{args.output_len})")
    except peer.PeerConfigError as e:
        p.error(str(e))
    args.llamacpp_version = args.llamacpp_version or peer.installed_llama_cpp_python()
    if not args.llamacpp_version:
        p.error("--scenario peer: llama-cpp-python is not installed, so no llama.cpp version is pinned; install the "
                "`llamacpp` extra or give --llamacpp-version")
    args.peer_cmake_args = (tuple(shlex.split(args.llamacpp_cmake_args)) if args.llamacpp_cmake_args is not None
                            else peer.default_cmake_args())


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """--scenario peer's flags (llama.cpp's server against ours; neuron_opt.bench.llamacpp_server)."""
    g = p.add_argument_group("--scenario peer: llama.cpp's llama-server against ours on the same weights")
    g.add_argument("--pair", action="append", default=[], metavar="WIDTH=ARTIFACT",
                   help="one of our artifacts and the width it is compared at: bf16 (llama.cpp BF16), int8 (Q8_0), "
                        "int4 (Q4_1, the shipped file); repeat for several, e.g. --pair bf16=artifacts/peer-bf16 "
                        "--pair int8=artifacts/peer-int8")
    g.add_argument("--prompt-lens", default="150,1500",
                   help="prompt lengths in tokens (distinct random prompts); every length runs at every --concurrency "
                        "level with max(--num-prompts, 2 x level) requests")
    g.add_argument("--llamacpp-version", default=None,
                   help="the llama-cpp-python sdist whose vendored llama.cpp is built (default: the installed one)")
    g.add_argument("--llamacpp-cmake-args", default=None,
                   help="CMake flags of the build (default: -DGGML_NATIVE=ON, or this CPU's sets without AMX on an "
                        "AMX CPU; give it as --llamacpp-cmake-args=\"-D...\")")
    g.add_argument("--llamacpp-threads", type=int, default=None, help="llama-server -t (default: the usable cores)")
    g.add_argument("--llamacpp-batch-threads", type=int, default=None,
                   help="llama-server -tb (default: the usable cores)")
    g.add_argument("--llamacpp-slots", type=int, default=None,
                   help="llama-server -np (default: the largest --concurrency level)")
    g.add_argument("--llamacpp-extra", default="",
                   help="more llama-server flags, appended as given (e.g. \"--no-cont-batching\")")

