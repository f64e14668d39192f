"""Chaos run of `neuron-opt serve`: a soak of greedy completions with faults injected on a schedule, and what became
of every request.

1. Store: an S3 API (moto's server mode, in this process) behind a fault proxy of ours on loopback; `--artifact` is
   pushed to it directly. Every pull below goes through the proxy, which answers a schedule of GETs with a 503
   SlowDown, resets the connection before an answer (TCP RST), or sends the headers and half the body then closes
   (a short read): `serve s3://...` must come up all the same, each file hashed once it has landed.
2. Fleet: `serve s3://... --data-parallel 2` (local Ray Serve), pulled into an empty cache through the proxy. A
   closed loop of `--clients` clients (half of them streaming) sends completions of a few fixed prompts (token
   ids, greedy, `--tokens` tokens, no EOS) for `--baseline-s` seconds without faults, then for `--fault-s` seconds
   while a replica's process is killed (SIGKILL, as the OOM killer does) every `--kill-every` seconds, each once
   the fleet has two replicas again.
3. Drain: a single-process `serve s3://...` (another empty cache, through the proxy) under the same load gets
   SIGTERM after `--drain-after-s`: the requests in flight must finish, later ones get 503 with Retry-After (a
   client stops sending once it has seen one, as a load balancer takes the instance out), and the process must
   exit 0.
4. A truncated object (another prefix, the weights cut to a third): `serve s3://...` must exit non-zero naming the
   hash mismatch and leave no artifact in its cache.

Each request ends one way: completed (HTTP 200, the whole answer: `--tokens` tokens, finish "length"), failed
cleanly (an HTTP error with an OpenAI error body, a stream that ends with an error event and [DONE] and reported
no finish before it, or a connection refused: nothing was accepted), hung (no end within `--bound-s` seconds), or
lost (anything else: a dropped connection, a stream cut without an error event, a finish other than "length").
Lost and hung must be 0. A completed answer's text is compared with the first completed answer of the same prompt
(`mismatched`: greedy answers that differ). Latency (p50/p99) is reported per phase over the completed requests,
streaming and not.

    python scripts/bench_chaos.py --artifact artifacts/chaos --out docs/bench/chaos.json

where artifacts/chaos comes from `neuron-opt compile --model default --backend eager --dtype bfloat16
--batch-size 4 --max-model-len 256 --out artifacts/chaos`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuron_opt.bench import RunRecord  # noqa: E402 (after the sys.path line)
from neuron_opt.bench.cluster import stop_process_group  # noqa: E402
from neuron_opt.bench.s3 import start_moto_server  # noqa: E402
from neuron_opt.executors.launcher import free_port  # noqa: E402

BUCKET = "chaos"
MODEL = "chaos"
PROMPTS = [[5 + i, 40 + 3 * i, 7, 99 + i, 12, 300 + 17 * i] for i in range(8)]  # token ids: no tokenizer subtleties
# the proxy's answers to successive GETs of one pull (None: passed through); then it passes everything through
PULL_FAULTS = ("throttle", "throttle", None, "reset", None, "short", None, "throttle", "short", None, "reset")
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
             b"request rate.</Message></Error>")
OUTCOMES = ("completed", "failed_cleanly", "lost", "hung")


# ---- the store and its faults ----------------------------------------------------------------------------------


class FaultProxy(ThreadingHTTPServer):
    """An HTTP proxy on loopback in front of the S3 API at `upstream` (host, port) that answers the GETs of a pull
    from `faults` in turn (`arm`), then passes everything through; `injected` counts what it did."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream
        self.lock = threading.Lock()
        self.faults: list[str | None] = []
        self.injected = {"throttle": 0, "reset": 0, "short": 0, "passed": 0}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def arm(self, faults: tuple[str | None, ...]) -> None:
        with self.lock:
            self.faults = list(faults)

    def next_fault(self, method: str) -> str | None:
        with self.lock:
            fault = self.faults.pop(0) if method == "GET" and self.faults else None
            self.injected[fault or "passed"] += 1
            return fault


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as boto3's connection pool expects
    server: FaultProxy

    def log_message(self, *_: Any) -> None:  # no line per request
        pass

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fault = self.server.next_fault(self.command)
        if fault == "reset":  # no answer: the connection is reset (RST) as a dropped network path does
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault == "throttle":
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOW_DOWN)))
            self.end_headers()
            self.wfile.write(SLOW_DOWN)
            return
        up = http.client.HTTPConnection(*self.server.upstream, timeout=120)
        try:
            up.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
            resp = up.getresponse()
            data = resp.read()
        finally:
            up.close()
        self.send_response(resp.status)
        for name, value in resp.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "short" and len(data) > 1:  # the headers promise all of it; half arrives, then the connection ends
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


# ---- servers --------------------------------------------------------------------------------------------------


def start_serve(source: str, endpoint: str, cache: Path, log: Path, *extra: str,
                threads: int | None = None) -> tuple[subprocess.Popen, str]:
    """`serve source` on a free port (`threads`: NEURON_OPT_NUM_THREADS; a replica's are its CPUs, 1 here)."""
    port = free_port()
    cmd = [sys.executable, "-m", "neuron_opt.cli", "serve", source, "--port", str(port), "--served-model-name", MODEL,
           "--s3-endpoint-url", endpoint, "--max-num-seqs", "4", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NEURON_OPT_CACHE_DIR": str(cache),
           **({"NEURON_OPT_NUM_THREADS": str(threads)} if threads else {})}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def replica_pids(serve: subprocess.Popen) -> list[int]:
    """The Serve replica processes of this `serve` command (its Ray instance's workers are its descendants)."""
    import psutil

    out = []
    for p in psutil.Process(serve.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("ServeReplica:neuron_opt:EngineReplica" in a for a in p.cmdline()):
                out.append(p.pid)
    return out


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float, replicas: int = 0) -> float:
    """Seconds until `url` answers a completion (and, for a fleet, the router counts `replicas` replicas)."""
    import httpx

    from neuron_opt.bench.cluster import router_metrics

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with status {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if replicas and sum(1 for (n, r) in router_metrics(url)
                                if n == "vllm:num_requests_running" and r) < replicas:
                raise httpx.TransportError("replicas not up")
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1},
                           timeout=30)
            if r.status_code == 200:
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"serve: not ready after {timeout:g} s:\n{log.read_text()[-3000:]}")


# ---- the load -------------------------------------------------------------------------------------------------


async def one_request(client: Any, url: str, i: int, stream: bool, tokens: int, bound: float) -> dict[str, Any]:
    """One completion; its outcome (module docstring), latency and text."""
    body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    rec: dict[str, Any] = {"prompt": i % len(PROMPTS), "stream": stream, "start": time.monotonic()}
    import httpx

    try:
        rec.update(await asyncio.wait_for(_send(client, url, body, tokens), bound))
    except httpx.ConnectError as e:  # not accepted at all (the server has exited): the client knows, nothing ran
        rec.update(outcome="failed_cleanly", why=f"connection refused: {e}")
    except asyncio.TimeoutError:
        rec.update(outcome="hung", why=f"no end within {bound:g} s")
    except Exception as e:  # noqa: BLE001 -- a dropped connection, a cut stream: the request is lost
        rec.update(outcome="lost", why=f"{type(e).__name__}: {e}")
    rec["latency_s"] = time.monotonic() - rec["start"]
    rec.setdefault("why", "")
    return rec


def _error_body(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]


async def _send(client: Any, url: str, body: dict[str, Any], tokens: int) -> dict[str, Any]:
    if not body["stream"]:
        r = await client.post(url + "/v1/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            if _error_body(data):
                return {"outcome": "failed_cleanly", "status": r.status_code, "retry_after": "retry-after" in r.headers,
                        "why": data["error"]["message"][:200]}
            return {"outcome": "lost", "why": f"HTTP {r.status_code} without an error body"}
        choice = data["choices"][0]
        if choice["finish_reason"] != "length" or data["usage"]["completion_tokens"] != tokens:
            return {"outcome": "lost", "why": f"finish {choice['finish_reason']!r} after "
                                              f"{data['usage']['completion_tokens']} tokens"}
        return {"outcome": "completed", "text": choice["text"]}
    events: list[str] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            data = json.loads(await r.aread())
            if _error_body(data):
                return {"outcome": "failed_cleanly", "status": r.status_code, "retry_after": "retry-after" in r.headers,
                        "why": data["error"]["message"][:200]}
            return {"outcome": "lost", "why": f"HTTP {r.status_code} without an error body"}
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    if not events or events[-1] != "[DONE]":
        return {"outcome": "lost", "why": "a stream that ended without [DONE]"}
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    if chunks and _error_body(chunks[-1]):
        if any(f is not None for f in finishes):
            return {"outcome": "lost", "why": "a finish before the error event"}
        return {"outcome": "failed_cleanly", "status": chunks[-1]["error"].get("code"), "mid_stream": True,
                "why": chunks[-1]["error"]["message"][:200]}
    if not finishes or finishes[-1] != "length":
        return {"outcome": "lost", "why": f"a stream that ended with finish {finishes[-1:]!r}"}
    return {"outcome": "completed", "text": "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))}


async def run_load(url: str, clients: int, tokens: int, bound: float, until: threading.Event,
                   stop_on_503: bool = False) -> list[dict[str, Any]]:
    """`clients` closed-loop clients (the even ones streaming) until `until` is set; every request's record."""
    import httpx

    records: list[dict[str, Any]] = []

    async def client_loop(c: int) -> None:
        async with httpx.AsyncClient(timeout=None) as http:
            n = 0
            while not until.is_set():
                rec = await one_request(http, url, c * 101 + n, c % 2 == 0, tokens, bound)
                records.append(rec)
                n += 1
                if stop_on_503 and (rec.get("status") == 503 or rec["why"].startswith("connection refused")):
                    return  # taken out of rotation: this instance is draining (or gone)

    await asyncio.gather(*(client_loop(c) for c in range(clients)))
    return records


def in_thread(coro_fn, *args) -> tuple[threading.Thread, list]:  # noqa: ANN001
    out: list = []
    t = threading.Thread(target=lambda: out.extend(asyncio.run(coro_fn(*args))), daemon=True)
    t.start()
    return t, out


# ---- phases ---------------------------------------------------------------------------------------------------


def fleet(args: argparse.Namespace, uri: str, proxy: FaultProxy, work: Path) -> dict[str, Any]:
    proxy.arm(PULL_FAULTS)
    log = work / "fleet.log"
    proc, url = start_serve(uri, proxy.url, work / "cache-fleet", log, "--data-parallel", "2",
                            "--shutdown-timeout", "60")
    try:
        ready = wait_ready(proc, url, log, args.start_timeout, replicas=2)
        pull = dict(proxy.injected)
        print(f"fleet up in {ready:.1f} s (pull through the proxy: {pull})", flush=True)
        stop = threading.Event()
        t, base = in_thread(run_load, url, args.clients, args.tokens, args.bound_s, stop)
        time.sleep(args.baseline_s)
        stop.set()
        t.join(args.bound_s + 30)
        print(f"baseline: {len(base)} requests", flush=True)
        stop = threading.Event()
        t, faulted = in_thread(run_load, url, args.clients, args.tokens, args.bound_s, stop)
        kills: list[dict[str, Any]] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.fault_s:
            time.sleep(min(args.kill_every, max(0.0, args.fault_s - (time.monotonic() - t0))))
            if time.monotonic() - t0 >= args.fault_s:
                break
            pids = replica_pids(proc)
            if len(pids) < 2:
                continue
            os.kill(pids[0], signal.SIGKILL)
            killed_at = time.monotonic()
            kill = {"at_s": round(killed_at - t0, 1), "pid": pids[0]}
            while time.monotonic() - killed_at < args.bound_s:  # replaced: two replicas again, the dead one gone
                now = replica_pids(proc)
                if len(now) == 2 and pids[0] not in now:
                    kill["replacement_started_after_s"] = round(time.monotonic() - killed_at, 1)
                    break
                time.sleep(0.25)
            kills.append(kill)
            print(f"kill: {kill}", flush=True)
        stop.set()
        t.join(args.bound_s + 30)
        print(f"faults: {len(faulted)} requests", flush=True)
        return {"ready_s": round(ready, 1), "pull_faults": pull, "baseline": base, "faults": faulted, "kills": kills,
                "replicas_after": len(replica_pids(proc))}
    finally:
        stop_process_group(proc, 90)


def drain(args: argparse.Namespace, uri: str, proxy: FaultProxy, work: Path) -> dict[str, Any]:
    import httpx

    before = dict(proxy.injected)
    proxy.arm(PULL_FAULTS)
    log = work / "single.log"
    proc, url = start_serve(uri, proxy.url, work / "cache-single", log, "--shutdown-timeout", "60",
                            threads=args.single_threads)
    try:
        ready = wait_ready(proc, url, log, args.start_timeout)
        pull = {k: v - before[k] for k, v in proxy.injected.items()}
        print(f"single server up in {ready:.1f} s (pull through the proxy: {pull})", flush=True)
        stop = threading.Event()
        t, records = in_thread(run_load, url, args.clients, args.tokens, args.bound_s, stop, True)
        time.sleep(args.drain_after_s)
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        health = None
        with contextlib.suppress(httpx.HTTPError):
            time.sleep(0.5)
            health = httpx.get(url + "/health", timeout=5).status_code
        code = proc.wait(args.bound_s)
        exited_after = time.monotonic() - sigterm_at
        stop.set()
        t.join(args.bound_s + 30)
    finally:
        if proc.poll() is None:
            stop_process_group(proc, 30)
    for r in records:
        r["after_sigterm"] = r["start"] >= sigterm_at
    in_flight = [r for r in records if r["start"] < sigterm_at <= r["start"] + r["latency_s"]]
    print(f"drain: exit {code} after {exited_after:.1f} s; {len(in_flight)} in flight at SIGTERM", flush=True)
    return {"ready_s": round(ready, 1), "pull_faults": pull, "records": records, "exit_code": code,
            "exited_after_sigterm_s": round(exited_after, 1), "health_while_draining": health,
            "in_flight_at_sigterm": len(in_flight),
            "in_flight_completed": sum(r["outcome"] == "completed" for r in in_flight),
            "refused_503_with_retry_after": sum(r.get("status") == 503 and r.get("retry_after", False)
                                                 for r in records if r["after_sigterm"])}


def truncated(args: argparse.Namespace, art: Path, endpoint: str, proxy: FaultProxy, work: Path) -> dict[str, Any]:
    from neuron_opt import object_store

    uri = f"s3://{BUCKET}/truncated"
    object_store.push(art, uri, endpoint_url=endpoint, progress=False)
    weights = next(p for p in art.rglob("*.safetensors"))
    data = weights.read_bytes()
    key = f"truncated/{weights.relative_to(art).as_posix()}"
    object_store.client(endpoint).put_object(Bucket=BUCKET, Key=key, Body=data[: len(data) // 3])
    cache = work / "cache-truncated"
    log = work / "truncated.log"
    proc, _ = start_serve(uri, proxy.url, cache, log)
    try:
        code = proc.wait(args.start_timeout)
    finally:
        if proc.poll() is None:
            stop_process_group(proc, 30)
    text = log.read_text()
    artifacts = cache / "artifacts"
    left = sorted(p.name for p in artifacts.iterdir()) if artifacts.is_dir() else []
    named = "sha256 does not match" in text
    print(f"truncated object: exit {code}, hash mismatch named: {named}, left in the cache: {left}", flush=True)
    return {"exit_code": code, "hash_mismatch_named": named, "left_in_cache": left,
            "message": next((line for line in text.splitlines() if "sha256" in line), "")[:300]}


# ---- the report -----------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


def summarize(records: list[dict[str, Any]], texts: dict[int, str]) -> dict[str, Any]:
    counts = {k: sum(r["outcome"] == k for r in records) for k in OUTCOMES}
    done = [r for r in records if r["outcome"] == "completed"]
    mismatched = 0
    for r in done:
        mismatched += texts.setdefault(r["prompt"], r["text"]) != r["text"]
    lat = [r["latency_s"] for r in done]
    plain = [r["latency_s"] for r in done if not r["stream"]]
    return {"sent": len(records), **counts, "mismatched": mismatched,
            "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
            "non_streaming_p50_s": percentile(plain, 0.5), "non_streaming_p99_s": percentile(plain, 0.99),
            "failures": sorted({r["why"] for r in records if r["outcome"] != "completed"})[:20]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, required=True, help="a local artifact (neuron-opt compile --out)")
    p.add_argument("--clients", type=int, default=6, help="concurrent closed-loop clients (the even ones stream)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--baseline-s", type=float, default=40.0, help="seconds of load without faults")
    p.add_argument("--fault-s", type=float, default=75.0, help="seconds of load with replica kills")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between replica kills")
    p.add_argument("--drain-after-s", type=float, default=15.0, help="seconds of load before SIGTERM (drain phase)")
    p.add_argument("--single-threads", type=int, default=1,
                   help="torch threads of the single server (a replica has 1 here); spinning thread pools collapse "
                        "on a machine shared with other work")
    p.add_argument("--bound-s", type=float, default=120.0, help="a request without an end after this is hung")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--require-idle", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "chaos.json")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)

    from neuron_opt import object_store

    record = RunRecord(args.require_idle)
    art = args.artifact.resolve()
    store, endpoint = start_moto_server("chaos")
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    port = int(endpoint.rsplit(":", 1)[1])
    proxy = FaultProxy(("127.0.0.1", port))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    t0 = time.monotonic()
    try:
        object_store.client(endpoint).create_bucket(Bucket=BUCKET)
        uri = f"s3://{BUCKET}/model"
        object_store.push(art, uri, endpoint_url=endpoint, progress=False)
        fl = fleet(args, uri, proxy, work)
        dr = drain(args, uri, proxy, work)
        tr = truncated(args, art, endpoint, proxy, work)
    finally:
        proxy.shutdown()
        store.stop()
        shutil.rmtree(work, ignore_errors=True)
    texts: dict[int, str] = {}
    phases = {"baseline": summarize(fl["baseline"], texts), "faults": summarize(fl["faults"], texts),
              "drain": summarize(dr["records"], texts)}
    total = {k: sum(ph[k] for ph in phases.values()) for k in ("sent", *OUTCOMES, "mismatched")}
    report = {
        "benchmark": "chaos", "artifact": str(args.artifact), "note": args.note,
        "load": {"clients": args.clients, "streaming_clients": (args.clients + 1) // 2, "tokens": args.tokens,
                 "prompts": len(PROMPTS), "bound_s": args.bound_s},
        "schedule": {"baseline_s": args.baseline_s, "fault_s": args.fault_s, "kill_every_s": args.kill_every,
                     "drain_after_s": args.drain_after_s, "pull_faults": list(PULL_FAULTS)},
        "total": total, "phases": phases,
        "fleet": {k: fl[k] for k in ("ready_s", "pull_faults", "kills", "replicas_after")},
        "drain": {k: v for k, v in dr.items() if k != "records"},
        "truncated_object": tr,
        "wall_s": round(time.monotonic() - t0, 1),
        **record.finish(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"total": total, **{k: {m: v[m] for m in ("sent", "completed", "failed_cleanly", "lost", "hung",
                                                              "latency_p50_s", "latency_p99_s")}
                                         for k, v in phases.items()}}, indent=1))
    print(f"wrote {args.out}")
    ok = (total["lost"] == 0 and total["hung"] == 0 and dr["exit_code"] == 0 and tr["exit_code"] != 0
          and not tr["left_in_cache"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
