"""llama.cpp as a decode-benchmark peer (neuron_opt.bench.llamacpp): requantization, loading, greedy agreement with
HF transformers fp32 on the default model, and the errors when a llama.cpp system cannot run. The tests needing
llama-cpp-python (the optional `llamacpp` extra) skip without it; the error tests run everywhere.

Agreement is teacher-forced (llama.cpp fed HF's greedy tokens, its argmax compared at each position): llama.cpp
quantizes activations to 8 bits for its quantized matmuls and keeps an f16 KV cache, so a near-tie may flip, and
one flip would derail a free-running comparison. Timings are not asserted here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from neuron_opt.bench.decode import main


def test_missing_llama_cpp_is_a_usage_error_naming_the_install(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["--systems", "hf,llamacpp-q8_0", "--batches", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "llamacpp-q8_0" in err
    assert "CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install --no-binary llama-cpp-python 'neuron-opt[llamacpp]'" in err


def test_unknown_llamacpp_format_lists_the_systems(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--systems", "llamacpp-q4_k"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "llamacpp-q4_k" in err and "llamacpp-q8_0" in err and "llamacpp-q4_1" in err


@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("llama_cpp")
    from neuron_opt.bench.llamacpp import requantize
    from neuron_opt.checkpoint import default_model_path

    dst = tmp_path_factory.mktemp("llamacpp") / "default-q8_0.gguf"
    requantize(default_model_path(), dst, "q8_0")
    return dst


def test_requantize_to_q8_0_writes_a_loadable_file(q8_0_gguf: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFReader

    from neuron_opt.bench.llamacpp import bench_llamacpp, load

    kinds = {t.name: t.tensor_type for t in GGUFReader(q8_0_gguf).tensors}
    matrices = [n for n in kinds if not n.endswith("norm.weight")]
    assert matrices and all(kinds[n] == GGMLQuantizationType.Q8_0 for n in matrices)
    assert not list(q8_0_gguf.parent.glob("*.tmp"))  # the atomic write left no temp file behind
    llm = load(q8_0_gguf, n_ctx=64, threads=1)
    assert bench_llamacpp(llm, list(range(100, 132)), steps=4) > 0


@pytest.fixture(scope="module")
def hf_reference_16() -> tuple[list[int], list[int]]:
    """HF transformers fp32 greedy: (chat prompt ids, the next 16 tokens), the benchmark's own reference."""
    import transformers

    from neuron_opt.bench.decode import hf_reference
    from neuron_opt.checkpoint import default_model_path, open_checkpoint

    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    return hf_reference(hf, open_checkpoint("default").tokenizer(), 16)


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["q8_0", "q4_1"])
def test_llamacpp_greedy_agrees_with_hf_fp32(storage: str, q8_0_gguf: Path,
                                             hf_reference_16: tuple[list[int], list[int]]) -> None:
    from neuron_opt.bench.llamacpp import load, teacher_forced_agreement
    from neuron_opt.checkpoint import default_model_path

    path = q8_0_gguf if storage == "q8_0" else default_model_path()  # q4_1: the file as shipped
    prompt, ref = hf_reference_16
    llm = load(path, n_ctx=len(prompt) + len(ref), threads=1)
    assert teacher_forced_agreement(llm, prompt, ref) >= 14 / 16


def test_a_system_whose_process_crashes_is_reported_not_fatal() -> None:
    """llama.cpp's AMX matmul segfaults on some AMX CPUs (ggml-org/llama.cpp#20824; seen here with Q8_0 and Q4_1):
    the benchmark runs each system in a fresh process, and a real crash there (a read of address 0) comes back as
    a reason, so the other systems' results are kept."""
    import ctypes

    from neuron_opt.bench.decode import _survive

    assert _survive(len, [1, 2, 3]) == (3, None)
    out, why = _survive(ctypes.string_at, 0)
    assert out is None and "process died" in why
