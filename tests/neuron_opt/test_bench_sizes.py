"""The decode benchmark at several model sizes (neuron_opt.bench.sizes, scripts/bench_decode.py --sizes): the sizes'
shapes against transformers' own parameter count, the last-level cache read from a sysfs tree, the rows' cache flag
and llama.cpp ratio, the GGUF byte count of a step, and `--quick` end to end on the two-layer random size (slow
tier: a llama.cpp conversion, a Q4_K_M file and a cpu compile). Timings are not asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from neuron_opt.bench import llc_bytes
from neuron_opt.bench.decode import Result, _summarize, estimate_minutes, gguf_step_bytes, main
from neuron_opt.bench.sizes import SIZES, parse_sizes


@pytest.mark.parametrize(("name", "billions"), [("1b", 1.07), ("3b", 2.97)])
def test_sizes_are_the_llama_3_2_shapes_with_the_default_vocabulary(name: str, billions: float) -> None:
    import transformers

    cfg = transformers.LlamaConfig(**SIZES[name].config, vocab_size=49152)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert model.config.tie_word_embeddings and SIZES["135m"].config is None


def test_parse_sizes_names_the_known_ones() -> None:
    assert [z.name for z in parse_sizes("135m,1b,3b")] == ["135m", "1b", "3b"]
    with pytest.raises(ValueError, match="7b.*choose from 135m, 1b, 3b, synthetic"):
        parse_sizes("135m,7b")


@pytest.mark.parametrize("argv", [["--sizes", "7b"], ["--sizes", "1b", "--model", "x.gguf"]])
def test_bench_decode_refuses_bad_sizes(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def _cache(root: Path, cpu: int, index: int, level: int, kind: str, size: str, shared: str) -> None:
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", str(level)), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(value + "\n")


def test_llc_is_the_top_level_counted_once_per_instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    for cpu in (0, 1, 2):
        _cache(tmp_path, cpu, 0, 1, "Data", "48K", str(cpu))
        _cache(tmp_path, cpu, 1, 1, "Instruction", "64K", str(cpu))
        _cache(tmp_path, cpu, 2, 2, "Unified", "2048K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")  # two L3 instances
    assert llc_bytes(tmp_path) == 2 * 32 * 2**20
    assert llc_bytes(tmp_path / "none") is None
    assert llc_bytes() is None or llc_bytes() > 0  # this machine's


def test_rows_flag_the_cache_and_pair_with_llama_cpp() -> None:
    def rounds(system: str, dtype: str, nbytes: float, tok_s: list[float]) -> list[Result]:
        return [Result(system, dtype, 1, t, 8, nbytes, mem_bw_gbs=10.0) for t in tok_s]

    ours, peer, other = _summarize({
        "cpu-int8": rounds("neuron_opt-cpu-compiled", "int8", 2e8, [30.0, 40.0, 50.0]),
        "llamacpp-q8_0": rounds("llama.cpp", "q8_0", 2e8, [20.0, 20.0, 25.0]),
        "cpu-fp32": rounds("neuron_opt-cpu-compiled", "float32", 8e8, [10.0, 10.0, 10.0])}, llc=5 * 10**8)
    assert ours.fits_llc and peer.fits_llc and not other.fits_llc
    assert ours.ratio_vs_llamacpp == pytest.approx(2.0) and peer.ratio_vs_llamacpp is None
    assert other.ratio_vs_llamacpp is None  # no F32 row in this run
    assert ours.mbu == pytest.approx(2e8 * 40.0 / 10e9) and other.mbu == pytest.approx(0.8)
    assert _summarize({"cpu-int8": rounds("neuron_opt-cpu-compiled", "int8", 2e8, [1.0])})[0].fits_llc is None


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_step_bytes_read_an_untied_embedding_one_row_per_sequence(tmp_path: Path, tied: bool) -> None:
    """A file of an F32 embedding (100 rows of 64), a Q8_0 matrix and, untied, an F32 output: a step reads every
    tensor as stored, but only `batch` rows of an untied embedding; `file_storage` reads general.file_type."""
    from types import SimpleNamespace

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    from neuron_opt.bench.llamacpp import file_storage

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    w.add_tensor("token_embd.weight", np.ones((100, 64), np.float32))
    q = quantize(np.ones((64, 64), np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=GGMLQuantizationType.Q8_0)
    if not tied:
        w.add_tensor("output.weight", np.ones((100, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    embed, matrix = 100 * 64 * 4, q.nbytes  # Q8_0: 34 bytes per block of 32
    assert matrix == 64 * 2 * 34 and file_storage(path) == "q8_0"
    cfg = SimpleNamespace(vocab_size=100)
    want = embed + matrix if tied else 8 * 64 * 4 + matrix + embed
    assert gguf_step_bytes(path, cfg, 8) == pytest.approx(want)


def test_estimate_scales_with_rounds_and_pairs() -> None:
    sizes = parse_sizes("135m,1b")
    record = ["cpu-fp32", "cpu-bf16", "cpu-int8", "cpu-int4", "cpu-q4_k_m", "llamacpp-f32", "llamacpp-bf16",
              "llamacpp-q8_0", "llamacpp-q4_1", "llamacpp-q4_k_m"]  # 10 at batch 1, 5 at batch 8: 15 pairs
    setup = sum(z.setup_minutes for z in sizes)
    per_round = sum(z.minutes_per_round for z in sizes)
    assert estimate_minutes(sizes, record, [1, 8], 5) == pytest.approx(setup + 5 * per_round)
    assert estimate_minutes(sizes, record[:5], [8], 1) == pytest.approx(setup + per_round / 3)


@pytest.mark.slow  # llama.cpp's converter, llama-quantize (built once) and a cpu compile: minutes on 2 cores
def test_quick_runs_the_synthetic_size_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "quick.json"
    assert main(["--quick", "--sizes", "synthetic", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (size,) = doc["sizes"]
    assert size["name"] == "synthetic" and size["layers"] == 2 and size["vocab"] == 49152
    rows = {(r["size"], r["system"], r["dtype"]): r for r in doc["results"]}
    ours = rows[("synthetic", "neuron_opt-cpu-compiled", "q4_k_m")]
    assert ours["tok_s"] > 0 and ours["mbu"] > 0 and ours["fits_llc"] in (True, False, None)
    assert Path(size["model"]).is_file() and "bench decode: sizes synthetic" in capsys.readouterr().out


def test_serving_rows_mbu_counts_the_artifacts_weights_and_the_streams_kv(tiny_dir, tmp_path: Path) -> None:
    """A serving row's step bytes: the artifact's stored weights plus each stream's KV at the mean context (K and V,
    every layer, the KV dtype); MBU = those bytes x steps/s (1 / TPOT) over the bandwidth."""
    from neuron_opt.bench.serve.client import serving_mbu, serving_step_bytes
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.config import ModelConfig

    src = tiny_dir("smollm-tok")
    out = tmp_path / "art"
    compile_artifact(CompileRequest(model=str(src), out=out, backend="eager", max_model_len=128, dtype="float32"),
                     log=lambda s: None, progress=False)
    cfg = ModelConfig.from_hf(src)
    weights = sum(f.stat().st_size for f in (out / "weights").glob("*.safetensors"))
    assert weights >= 4 * cfg.num_parameters()  # fp32 (plus the safetensors header)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert serving_step_bytes(out, 8, 100) == weights + 8 * 100 * kv
    assert serving_mbu(2e9, tpot_ms=50.0, bw_gbs=40.0) == pytest.approx(1.0)  # 2 GB x 20 steps/s = 40 GB/s
