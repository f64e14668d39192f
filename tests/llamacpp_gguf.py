"""GGUF files written by llama.cpp's own tools, for the GGUF tests: its converter (`convert_hf_to_gguf.py`, with the
gguf-py it pins) from the llama-cpp-python sdist, unpacked once into the cache directory outside the repository
(neuron_opt.bench.llamacpp_server.ensure_sources), and its `llama-quantize` (built once there: ensure_built)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from neuron_opt import envs
from neuron_opt.bench import llamacpp_server as peer

LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python whose vendored llama.cpp writes the test files
CACHE = envs.CACHE_DIR  # read once: tests that point envs.CACHE_DIR at a private directory still share this one


# one process converts every file: the converter's imports (torch, transformers) cost more than a tiny model
_DRIVER = """
import os, runpy, sys
script, jobs = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(script))
for i in range(0, len(jobs), 3):
    sys.argv = [script, "--outtype", jobs[i + 2], "--outfile", jobs[i + 1], jobs[i]]
    runpy.run_path(script, run_name="__main__")
"""


def convert(jobs: list[tuple[Path, Path, str]]) -> None:
    """Each (HF directory, out file, outtype: f32, f16, bf16 or q8_0) converted by llama.cpp's converter."""
    script = peer.ensure_sources(CACHE, LLAMACPP_VERSION) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converter's own gguf-py
    args = [str(x) for job in jobs for x in job]
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(script), *args], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, f"convert_hf_to_gguf.py failed:\n{r.stderr[-3000:]}"


def quantize(src: Path, out: Path, kind: str) -> Path:
    """`src` requantized by llama.cpp's `llama-quantize` to `kind` (a llama-quantize type name: Q4_K_M, Q6_K, ...),
    every tensor in `kind` where its row length allows (`--pure`) unless `kind` is a mix (Q4_K_M, Q5_K_M)."""
    build = peer.ensure_built(CACHE, LLAMACPP_VERSION, peer.default_cmake_args())
    pure = [] if kind.endswith(("_M", "_S", "_L")) else ["--pure"]
    r = subprocess.run([str(build.quantize), "--allow-requantize", *pure, str(src), str(out), kind],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"llama-quantize {kind} failed:\n{(r.stdout + r.stderr)[-3000:]}"
    return out
