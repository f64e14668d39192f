"""Cold start of `neuron-opt serve s3://...`: an empty local artifact cache against a warm one, and a local path.

1. Starts an S3 API server on loopback (moto's server mode, in this process), creates a bucket and pushes
   `--artifact` to it with `neuron_opt.object_store.push`.
2. One untimed `serve ARTIFACT` first (builds the backend's extension, warms the page cache). Then each round,
   in turn: `serve ARTIFACT` (the local directory: no S3 at all), `serve s3://...` with an empty
   artifact cache (`NEURON_OPT_CACHE_DIR` a fresh directory: download, hash, load), and `serve s3://...` with the
   cache the cold run filled (warm: the cached copy is verified and loaded, nothing downloaded). Each is timed
   from the process start to the first answered request (a one-token greedy completion), with the time to
   /health beside it.
3. The download and verification share, measured apart in this process on the same store in the same round:
   `object_store.pull` into an empty cache (download + sha256 of every file as it arrives + the manifest checks)
   and into the filled one (the cached copy's checks and hashes), and `read_verified` of the local artifact.

The report records the machine and whether it was idle (neuron_opt.bench.RunRecord), the artifact's size, every
round and the medians with min-max.

    python scripts/bench_cold_start.py --artifact artifacts/bench8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neuron_opt.bench import MachineBusyError, RunRecord, rounds_summary  # noqa: E402 (after the sys.path line)
from neuron_opt.bench.cluster import stop_process_group  # noqa: E402
from neuron_opt.bench.s3 import start_moto_server  # noqa: E402
from neuron_opt.executors.launcher import free_port  # noqa: E402

BUCKET = "bench"
MODES = ("local", "s3_cold", "s3_warm")


def first_answer(source: str, endpoint: str, cache_dir: Path, timeout: float) -> dict[str, float]:
    """`serve source` started; seconds from the start to /health and to the first answered request."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "neuron_opt.cli", "serve", source, "--port", str(port), "--served-model-name",
           "bench", "--s3-endpoint-url", endpoint]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NEURON_OPT_CACHE_DIR": str(cache_dir)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sys.stderr, env=env,
                            start_new_session=True)
    try:
        healthy = None
        while healthy is None:
            if proc.poll() is not None:
                raise SystemExit(f"serve {source} exited with status {proc.returncode}")
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"serve {source}: no answer after {timeout:g} s")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    healthy = time.perf_counter() - t0
            except httpx.TransportError:
                time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"model": "bench", "prompt": [100, 101, 102, 103],
                                                      "max_tokens": 1, "temperature": 0}, timeout=timeout)
        answered = time.perf_counter() - t0
        if r.status_code != 200:
            raise SystemExit(f"serve {source}: the first request got HTTP {r.status_code}: {r.text[:200]}")
        return {"health_s": healthy, "first_answer_s": answered}
    finally:
        stop_process_group(proc, 60)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_round(art: Path, uri: str, endpoint: str, timeout: float) -> dict[str, dict[str, float]]:
    from neuron_opt import artifact, object_store

    out: dict[str, dict[str, float]] = {}
    cache = Path(tempfile.mkdtemp(prefix="cold-start-"))
    try:
        out["local"] = first_answer(str(art), endpoint, cache, timeout)
        out["s3_cold"] = first_answer(uri, endpoint, cache, timeout)
        out["s3_warm"] = first_answer(uri, endpoint, cache, timeout)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    # the pull's own share, in this process (a fresh process state for each: the verified-files memo of
    # neuron_opt.artifact is per process, and these calls run in this one, so it is cleared before each)
    cache = Path(tempfile.mkdtemp(prefix="cold-pull-"))
    try:
        artifact._HASHED.clear()
        out["s3_cold"]["pull_s"] = timed(lambda: object_store.pull(uri, endpoint_url=endpoint, cache_dir=cache,
                                                                   progress=False))
        artifact._HASHED.clear()
        out["s3_warm"]["pull_s"] = timed(lambda: object_store.pull(uri, endpoint_url=endpoint, cache_dir=cache,
                                                                   progress=False))
        artifact._HASHED.clear()
        out["local"]["verify_s"] = timed(lambda: artifact.read_verified(art, trusted_keys=()))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    for mode in ("s3_cold", "s3_warm"):
        out[mode]["pull_share"] = out[mode]["pull_s"] / out[mode]["first_answer_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True, help="a local artifact (neuron-opt compile --out)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to its first answer")
    p.add_argument("--require-idle", action="store_true",
                   help="refuse to run, or to write the report, when the machine is not idle")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "cold_start_s3.json")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not (args.artifact / "manifest.json").is_file():
        p.error(f"--artifact: {args.artifact} is not an artifact (no manifest.json)")
    try:
        record = RunRecord(args.require_idle)
    except MachineBusyError as e:
        print(f"bench_cold_start: {e}", file=sys.stderr)
        return 3
    from neuron_opt import object_store

    server, endpoint = start_moto_server("bench")
    try:
        object_store.client(endpoint).create_bucket(Bucket=BUCKET)
        uri = f"s3://{BUCKET}/{args.artifact.resolve().name}"
        object_store.push(args.artifact, uri, endpoint_url=endpoint, progress=False)
        # untimed: the first start of a checkout builds the cpu backend's extension and reads the files into the
        # page cache; every mode of every round then starts from the same state
        cache = Path(tempfile.mkdtemp(prefix="cold-warmup-"))
        try:
            first_answer(str(args.artifact), endpoint, cache, args.timeout)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        rounds = []
        for i in range(args.rounds):
            rounds.append(one_round(args.artifact, uri, endpoint, args.timeout))
            print(f"round {i + 1}: " + ", ".join(f"{m} {rounds[-1][m]['first_answer_s']:.2f} s" for m in MODES),
                  file=sys.stderr)
    finally:
        server.stop()
    summary = {m: {k: rounds_summary([r[m][k] for r in rounds]) for k in rounds[0][m]} for m in MODES}
    files = json.loads((args.artifact / "manifest.json").read_text())["files"]
    report = {
        "scenario": "cold-start-s3", "artifact": str(args.artifact), "artifact_files": len(files),
        "artifact_bytes": sum((args.artifact / rel).stat().st_size for rel in files),
        "store": "moto server on loopback (this process)", "rounds": rounds, "summary": summary, "note": args.note,
    }
    try:
        report = record.finish() | report
    except MachineBusyError as e:
        print(f"bench_cold_start: {e}", file=sys.stderr)
        return 3
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for m in MODES:
        s = summary[m]
        extra = f", pull {s['pull_s']['median']:.2f} s" if "pull_s" in s else ""
        print(f"{m}: first answer {s['first_answer_s']['median']:.2f} s (min {s['first_answer_s']['min']:.2f}, max "
              f"{s['first_answer_s']['max']:.2f}){extra}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
