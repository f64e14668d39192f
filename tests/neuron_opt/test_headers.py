"""Crafted checkpoint files fail fast: GGUF and safetensors headers that declare more than the file holds are refused
with a CheckpointError naming the field, in bounded time and memory; oversized or deeply nested config.json too.

The GGUF and safetensors cases run in one child process (`open_checkpoint`, the public entry), under an address-space
limit of its size after imports + 1 GiB, so a regression cannot take the machine's memory; the child reports each
case's error, seconds and peak RSS growth (ru_maxrss).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_opt.checkpoint import default_model_path, open_checkpoint
from neuron_opt.errors import CheckpointError, ConfigError
from neuron_opt.headers import check_gguf

ROOT = Path(__file__).resolve().parents[2]

# GGUF metadata value types
UINT8, UINT32, STRING, ARRAY = 0, 4, 8, 9


def _s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def gguf_bytes(n_tensors: int, n_kv: int, body: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


def crafted_gguf() -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, the error it must raise)."""
    arch = _s("general.architecture") + struct.pack("<I", STRING) + _s("llama")
    tensor = _s("token_embd.weight") + struct.pack("<IQQIQ", 2, 4, 4, 0, 1 << 40)  # F32 [4, 4] at 1 TiB
    return {
        "array of 2^62 elements": (
            gguf_bytes(0, 1, _s("tokenizer.ggml.scores") + struct.pack("<IIQ", ARRAY, UINT8, 1 << 62) + b"\0" * 8),
            r"'tokenizer\.ggml\.scores': array declares 4611686018427387904 elements"),
        "array of 2^61 strings": (
            gguf_bytes(0, 1, _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 1 << 61)),
            r"'tokenizer\.ggml\.tokens': array declares 2305843009213693952 elements"),
        "string of 2^60 bytes": (
            gguf_bytes(0, 1, struct.pack("<Q", 1 << 60) + b"general.name" + b"\0" * 16),
            r"metadata key #0 \(1152921504606846976 bytes\) needs"),
        "2^60 tensors": (gguf_bytes(1 << 60, 0, b"\0" * 64), r"tensor count 1152921504606846976 needs"),
        "2^60 metadata keys": (gguf_bytes(0, 1 << 60, b"\0" * 64), r"metadata count 1152921504606846976 needs"),
        "tensor beyond the file": (gguf_bytes(1, 1, arch + tensor) + b"\0" * 64,
                                   r"tensor 'token_embd\.weight': bytes \[1099511627776, 1099511627840\) lie "
                                   r"beyond the data section"),
    }


def crafted_safetensors() -> dict[str, tuple[bytes, str]]:
    def st(header: dict) -> bytes:
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + b"\0" * 16

    return {
        "header length 2^63": (struct.pack("<Q", 1 << 63) + b"{}", r"header length 9223372036854775808 exceeds "
                                                                     r"the file"),
        "offsets beyond the file": (st({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}),
                                    r"tensor 'w': data_offsets \[0, 1099511627776\] are not within the data "
                                    r"section \(16 bytes\)"),
        "shape larger than its bytes": (st({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 16]}}),
                                        r"tensor 'w': F32 \[1099511627776\] needs 4\.39805e\+12 bytes, "
                                        r"data_offsets \[0, 16\] give 16"),
        "unknown dtype": (st({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}),
                          r"tensor 'w': unknown dtype 'Q9'"),
    }


CHILD = r"""
import json, resource, sys, time
from neuron_opt.checkpoint import open_checkpoint
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
paths = json.loads(sys.argv[1])
open_checkpoint(paths.pop("valid"))  # imports (transformers' config classes) before anything is timed
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for name, path in paths.items():
    t0 = time.perf_counter()
    try:
        open_checkpoint(path)
        err = ("none", "")
    except BaseException as e:
        err = (type(e).__name__, str(e))
    out[name] = {"error": err, "seconds": time.perf_counter() - t0,
                 "rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def outcomes(tiny_dir, tmp_path_factory):
    """Every crafted file opened in one child process: name -> {error, seconds, rss_growth_mb}."""
    tmp = tmp_path_factory.mktemp("crafted")
    paths = {"valid": tiny_dir("llama-gqa2")}
    for i, (name, (data, _)) in enumerate(crafted_gguf().items()):
        paths[name] = tmp / f"g{i}.gguf"
        paths[name].write_bytes(data)
    for i, (name, (data, _)) in enumerate(crafted_safetensors().items()):
        d = tmp / f"st{i}"
        d.mkdir()
        shutil.copy(tiny_dir("llama-gqa2") / "config.json", d)
        (d / "model.safetensors").write_bytes(data)
        paths[name] = d
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps({k: str(v) for k, v in paths.items()})], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize("name", [*crafted_gguf(), *crafted_safetensors()])
def test_crafted_header_fails_fast_naming_the_field(name, outcomes):
    import re

    want = {**crafted_gguf(), **crafted_safetensors()}[name][1]
    got = outcomes[name]
    kind, message = got["error"]
    assert kind == "CheckpointError" and re.search(want, message), (kind, message)
    assert got["seconds"] < 1.0, got
    assert got["rss_growth_mb"] < 64, got


def test_safetensors_header_over_the_cap_is_refused_unread(tiny_dir, tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    shutil.copy(tiny_dir("llama-gqa2") / "config.json", d)
    with open(d / "model.safetensors", "wb") as f:  # sparse: 17 MiB on paper, nothing written
        f.write(struct.pack("<Q", 17 << 20))
        f.truncate(18 << 20)
    with pytest.raises(CheckpointError, match=r"header length 17825792 exceeds the 16 MiB cap"):
        open_checkpoint(d)


def test_real_gguf_files_pass_the_walk():
    check_gguf(default_model_path())  # 100k tokenizer strings, Q4_1 and Q8_0 tensors


@pytest.mark.parametrize("content, needle", [
    (b"[" * 200_000 + b"]" * 200_000, "is not valid JSON"),  # nesting the json module recurses into
    (b'{"model_type": "llama", "pad": "' + b"x" * (5 << 20) + b'"}', "more than the 4 MiB"),
])
def test_oversized_or_deeply_nested_config_json_is_a_config_error(content, needle, tiny_dir, tmp_path):
    d = tmp_path / "cfg"
    shutil.copytree(tiny_dir("llama-gqa2"), d)
    (d / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=needle):
        open_checkpoint(d)


def test_index_naming_a_shard_outside_the_directory_is_refused(tiny_dir, tmp_path):
    d = tmp_path / "idx"
    d.mkdir()
    shutil.copy(tiny_dir("llama-gqa2") / "config.json", d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside its directory"):
        open_checkpoint(d)
