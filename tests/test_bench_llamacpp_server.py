"""llama.cpp's server as the serving benchmark's peer (neuron_opt.bench.llamacpp_server, `bench_serve.py --scenario
peer`): the pieces that run without building llama.cpp. The flags and their errors, the build's flags and cache
key, the llama-server command line, the quantizer's call, and the side-by-side summary of interleaved rounds.
Nothing here builds llama.cpp or starts a server; the scenario itself is run by `make bench-serve-llamacpp`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_opt.bench import llamacpp_server as peer

ROOT = Path(__file__).resolve().parents[1]


def test_pairs_parse_in_order_and_bad_ones_name_the_flag() -> None:
    assert peer.parse_pairs(["int8=a/i8", "bf16=a/b"]) == {"int8": Path("a/i8"), "bf16": Path("a/b")}
    for specs, words in ((["bf16"], "WIDTH=ARTIFACT"), (["fp8=x"], "unknown width 'fp8'"),
                         (["bf16=x", "bf16=y"], "given twice"), ([], "at least one")):
        with pytest.raises(peer.PeerConfigError, match="--pair") as e:
            peer.parse_pairs(specs)
        assert words in str(e.value)


def test_an_artifact_must_be_the_width_it_is_paired_as() -> None:
    peer.check_pair("bf16", "bfloat16", None, "float32")
    peer.check_pair("int8", "bfloat16", "int8", "bfloat16")  # int8 computes in the CPU's default dtype
    with pytest.raises(peer.PeerConfigError, match="--quantize int8 --quantize-lm-head"):
        peer.check_pair("int8", "bfloat16", None, "bfloat16")
    with pytest.raises(peer.PeerConfigError, match="--dtype bfloat16"):
        peer.check_pair("bf16", "float32", None, "float32")


def test_int_lists_and_requests_per_load() -> None:
    assert peer.parse_int_list("--concurrency", "1,4,8,16") == [1, 4, 8, 16]
    for bad in ("1,x", "0,4", ""):
        with pytest.raises(peer.PeerConfigError, match="--prompt-lens"):
            peer.parse_int_list("--prompt-lens", bad)
    assert [peer.requests_per_load(8, c) for c in (1, 4, 8, 16)] == [8, 8, 16, 32]


def test_cmake_flags_are_native_or_the_makefiles_set_without_amx() -> None:
    assert peer.default_cmake_args({"avx2", "avx512f"}) == ("-DGGML_NATIVE=ON",)
    no_amx = peer.default_cmake_args({"avx512f", "amx_tile", "amx_bf16"})
    assert "-DGGML_NATIVE=OFF" in no_amx and not any("AMX" in a for a in no_amx)
    make = (ROOT / "Makefile").read_text()
    m = re.search(r"^LLAMACPP_NO_AMX := (.*?)\n(?!\t)", make.replace("\\\n\t", ""), re.M | re.S)
    assert m and tuple(m.group(1).split()) == no_amx  # one rule, written twice: the Makefile's and ours agree
    assert peer.cpu_flags("processor : 0\nflags\t\t: fpu avx2 amx_tile\n") == {"fpu", "avx2", "amx_tile"}


def test_build_key_changes_with_version_and_flags() -> None:
    a = peer.build_key("0.3.36", ("-DGGML_NATIVE=ON",))
    assert a == peer.build_key("0.3.36", ("-DGGML_NATIVE=ON",)) and a.startswith("0.3.36-")
    assert a != peer.build_key("0.3.35", ("-DGGML_NATIVE=ON",)) != peer.build_key("0.3.36", peer.NO_AMX_ARGS)


def test_vendored_commit_is_read_from_the_versions_changelog_section() -> None:
    log = ("# Changelog\n\n## [Unreleased]\n\n## [0.3.36]\n\n- feat: Update llama.cpp to ggml-org/llama.cpp@"
           "4df29be4f4c3\n- fix: something\n\n## [0.3.35]\n\n- feat: Update llama.cpp to ggml-org/llama.cpp@abc1234\n")
    assert peer.vendored_commit(log, "0.3.36") == "4df29be4f4c3"
    assert peer.vendored_commit(log, "0.3.35") == "abc1234"
    assert peer.vendored_commit(log, "0.3.34") is None


def test_a_cached_build_is_reused_without_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ("-DGGML_NATIVE=ON",)
    root = tmp_path / "llamacpp-server" / peer.build_key("0.3.36", args)
    root.mkdir(parents=True)
    (root / "build.json").write_text(json.dumps({
        "server": str(root / "bin/llama-server"), "quantize": str(root / "bin/llama-quantize"),
        "llama_cpp_python": "0.3.36", "llama_cpp_commit": "4df29be", "cmake_args": list(args),
        "server_version": "version: 0 (unknown)"}))

    def no_build(*a: object, **k: object) -> None:
        raise AssertionError("built again")

    monkeypatch.setattr(subprocess, "Popen", no_build)
    monkeypatch.setattr(subprocess, "run", no_build)
    b = peer.ensure_built(tmp_path, "0.3.36", args)
    assert b.server == root / "bin/llama-server" and b.cmake_args == args and b.llama_cpp_commit == "4df29be"


def test_llama_server_command_line() -> None:
    ctx = peer.context_per_slot([150, 1500], 128)
    assert ctx == 1792  # 1,628 positions rounded up to 256
    cmd = peer.server_command(Path("/c/llama-server"), Path("/c/m-bf16.gguf"), 8123, 2, 2, 16, ctx,
                              ("--no-cont-batching",))
    assert cmd[0] == "/c/llama-server" and cmd[-1] == "--no-cont-batching"
    flags = dict(zip(cmd[1:-1:2], cmd[2:-1:2], strict=True))
    assert flags == {"-m": "/c/m-bf16.gguf", "--host": "127.0.0.1", "--port": "8123", "--alias": "bench",
                     "-t": "2", "-tb": "2", "-np": "16", "-c": str(16 * 1792)}
    log = "main: loading model\nsystem_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX512 = 1 |\n"
    assert peer.system_info(log) == "n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX512 = 1 |"
    assert peer.system_info("nothing") is None


def test_quantizer_calls_llama_quantize_and_writes_atomically(tmp_path: Path) -> None:
    fake = tmp_path / "llama-quantize"  # writes its arguments into the output file, fails on a "bad" source
    fake.write_text("#!/bin/sh\n[ \"$2\" = bad ] && { echo boom; exit 3; }\necho \"$@\" > \"$3\"\n")
    fake.chmod(0o755)
    dst = tmp_path / "out" / "m-q8_0.gguf"
    peer.quantizer(fake)(Path("src.gguf"), dst, "q8_0")
    assert dst.read_text().split() == ["--allow-requantize", "src.gguf", str(dst) + ".tmp", "Q8_0"]
    with pytest.raises(RuntimeError, match="boom"):
        peer.quantizer(fake)(Path("bad"), tmp_path / "out" / "x.gguf", "bf16")
    assert sorted(p.name for p in dst.parent.iterdir()) == ["m-q8_0.gguf"]  # no temp file left


def _round(tok_s: float, ttft: float, tpot: float, failed: int = 0) -> dict:
    pct = {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    return {"output_throughput": tok_s, "ttft_ms": pct | {"p50": ttft, "p99": 2 * ttft},
            "tpot_ms": pct | {"p50": tpot, "p99": 2 * tpot}, "completed": 8 - failed, "failed": failed}


def test_compare_gives_medians_with_min_max_and_per_round_ratios() -> None:
    ours = [_round(100, 200, 10), _round(120, 100, 8), _round(90, 300, 12, failed=1)]
    peer_rounds = [_round(50, 100, 10), _round(100, 100, 10), _round(90, 100, 6)]
    c = peer.compare(ours, peer_rounds)
    assert c["ours"]["output_throughput"] == {"median": 100, "min": 90, "max": 120, "rounds": 3}
    assert c["llamacpp"]["ttft_p99"]["median"] == 200
    assert c["ratio"]["output_throughput"] == {"median": 1.2, "rounds": [2.0, 1.2, 1.0]}
    assert c["ratio"]["ttft_p50"]["rounds"] == [2.0, 1.0, 3.0]
    assert c["ratio"]["tpot_p50"]["median"] == 1.0
    assert (c["ours"]["failed"], c["ours"]["completed"], c["llamacpp"]["failed"]) == (1, 23, 0)
    with pytest.raises(ValueError, match="3 rounds of ours against 2"):
        peer.compare(ours, peer_rounds[:2])
    row = peer.compare(ours, peer_rounds) | {"prompt_len": 150, "concurrency": 4}
    text = peer.table({"bf16": [row]})
    assert re.search(r"bf16\s+150\s+4 \|\s+100\.0 \(90\.0-120\.0\)\s+90\.0 \(50\.0-100\.0\)\s+1\.20x", text), text


def test_bench_serve_refuses_a_bad_pair_before_running() -> None:
    r = subprocess.run([sys.executable, "scripts/bench_serve.py", "--scenario", "peer", "--pair", "int3=x"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--pair 'int3=x': unknown width 'int3'" in r.stderr, r.stderr
