"""Neuron backend adapter, run against a test double of the documented torch_neuronx API (tests/sdk_double).

The double traces with TorchScript on CPU and records every SDK call, so these tests check how the adapter
uses the SDK (one trace per bucket, shapes, dtypes, separated weights, one weight file) and that the bucket
graphs, KV windows and weight replacement reproduce the eager logits. They do not test neuronx-cc or a
NeuronCore. Without the SDK, the backend must fail with an actionable BackendUnavailableError.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import eager_runner
from safetensors.torch import load_file
from tiny import make_tiny

from models.llama import expected_weight_names
from neuron_opt.buckets import Bucket
from neuron_opt.errors import ArtifactError, BackendUnavailableError, ConfigError
from neuron_opt.runtime.runner import DecodeRow, ModelRunner

DOUBLE = Path(__file__).resolve().parents[1] / "sdk_double"
BUCKETS = dict(prefill_seqs=[16, 32], decode_seqs=[16, 64], decode_batches=[1, 2])


@pytest.fixture
def sdk(monkeypatch):
    """Puts the torch_neuronx test double on sys.path for one test; yields its module."""
    monkeypatch.syspath_prepend(str(DOUBLE))
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    import torch_neuronx

    torch_neuronx.CALLS.clear()
    yield torch_neuronx
    sys.modules.pop("torch_neuronx", None)


def compile_all(backend, model, runner, out: Path) -> dict[Bucket, list[Path]]:
    files = {}
    for b in runner.buckets.buckets():
        rel = backend.compile_bucket(model, b, runner.cache.num_slots, out / b.key)
        files[b] = [out / b.key / f for f in rel]
    return files


def test_importing_the_module_does_not_import_the_sdk():
    code = "import sys, neuron_opt.backends.neuron; assert 'torch_neuronx' not in sys.modules, 'SDK imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_sdk_a_clear_error_names_the_fix(monkeypatch):
    from neuron_opt.backends import get_backend

    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # import fails like an absent package
    with pytest.raises(BackendUnavailableError) as e:
        get_backend("neuron", torch.bfloat16)
    msg = str(e.value)
    for needle in (
        "Neuron SDK",
        "torch-neuronx",
        "neuronx-cc",
        "pip.repos.neuron.amazonaws.com",
        "--backend cpu",
    ):
        assert needle in msg, needle


def test_placeholder_pypi_package_is_recognised(monkeypatch):
    from neuron_opt.backends.neuron import NeuronBackend

    monkeypatch.syspath_prepend(str(DOUBLE / "placeholder"))
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    with pytest.raises(BackendUnavailableError, match="placeholder") as e:
        NeuronBackend(torch.bfloat16)
    assert "--backend cpu" in str(e.value)
    sys.modules.pop("torch_neuronx", None)


def test_compile_traces_each_bucket_once_with_its_shapes_and_separate_weights(sdk, tiny_dir, tmp_path):
    from neuron_opt.backends.neuron import DEFAULT_COMPILER_ARGS, NeuronBackend

    runner = eager_runner(tiny_dir("llama-gqa2"), max_length=64, max_batch=2, **BUCKETS)
    model = runner.executor.model
    backend = NeuronBackend(torch.float32)
    files = compile_all(backend, model, runner, tmp_path)
    traces = [c for c in sdk.CALLS if c["fn"] == "trace"]
    buckets = runner.buckets.buckets()
    assert len(traces) == len(buckets) == 6
    n_kv, D, L = 2, 16, 2  # llama-gqa2: 4 heads, 2 kv heads, hidden 64, 2 layers
    for b, call in zip(buckets, traces, strict=True):
        S = b.seq if b.phase == "prefill" else 1
        want = [((b.batch, S), torch.int32), ((b.batch, S), torch.int32), ((b.batch,), torch.int32)]
        want += [((b.batch, n_kv, b.kv_len, D), torch.float32)] * (2 * L)
        assert call["inputs"] == want, b
        assert call["inline_weights_to_neff"] is False
        assert call["compiler_args"] == list(DEFAULT_COMPILER_ARGS)
        assert call["cpu_backend"] is False
        assert [p.name for p in files[b]] == ["graph.pt"] and files[b][0].is_file()
    assert len({c["compiler_workdir"] for c in traces}) == len(
        buckets
    )  # no bucket clobbers another's workdir


def test_one_weight_file_holds_every_weight_once(sdk, tiny_dir, tmp_path):
    from neuron_opt.backends.neuron import NeuronBackend

    runner = eager_runner(tiny_dir("smollm-like-9-3"), max_length=64, max_batch=2, **BUCKETS)
    model = runner.executor.model
    NeuronBackend(torch.float32).save_weights(model, tmp_path / "rank0.safetensors")
    sd = load_file(str(tmp_path / "rank0.safetensors"))
    assert sorted(sd) == sorted(expected_weight_names(model.cfg))  # tied lm_head stored once, as embed_tokens
    assert list(tmp_path.iterdir()) == [tmp_path / "rank0.safetensors"]


@pytest.mark.parametrize("variant", ["smollm-like-9-3", pytest.param("llama-gqa2", marks=pytest.mark.slow)])
def test_loaded_graphs_match_eager_logits_with_the_weight_file_as_source(variant, sdk, tmp_path):
    """Graphs traced from model A, weights file from model B (another seed): logits must equal eager B's."""
    from neuron_opt.backends.neuron import NeuronBackend

    a = eager_runner(make_tiny(variant, tmp_path / "a", seed=0), max_length=64, max_batch=2, **BUCKETS)
    b = eager_runner(make_tiny(variant, tmp_path / "b", seed=1), max_length=64, max_batch=2, **BUCKETS)
    backend = NeuronBackend(torch.float32)
    files = compile_all(backend, a.executor.model, a, tmp_path / "graphs")
    backend.save_weights(b.executor.model, tmp_path / "rank0.safetensors")
    m = b.executor.model
    executor = backend.load(
        files,
        tmp_path / "rank0.safetensors",
        lambda: type(m)(m.cfg, m.layout, m.max_length),
        b.cache.num_slots,
    )
    assert {c["fn"] for c in sdk.CALLS} == {"trace", "replace_weights", "move_trace_to_device"}
    assert sum(c["fn"] == "replace_weights" for c in sdk.CALLS) == len(files)
    neuron = ModelRunner(executor, b.buckets, b.cache, b.vocab_size)

    g = torch.Generator().manual_seed(3)
    p0 = torch.randint(3, 250, (11,), generator=g).tolist()
    p1 = torch.randint(3, 250, (20,), generator=g).tolist()  # 20 tokens: the 32 prefill bucket
    for slot, prompt in ((0, p0), (1, p1)):
        torch.testing.assert_close(neuron.prefill(slot, prompt), b.prefill(slot, prompt), atol=1e-5, rtol=0)
    for step in range(4):  # two rows, then one row (batch bucket 1), crossing decode kv buckets 16 -> 64
        rows = [DecodeRow(0, 5 + step, len(p0) + step), DecodeRow(1, 9 + step, len(p1) + step)][
            : 2 - step // 2
        ]
        torch.testing.assert_close(neuron.decode(rows), b.decode(rows), atol=1e-5, rtol=0)
    for got, want in zip(executor.k_caches, b.executor.k_caches, strict=True):
        torch.testing.assert_close(
            got[:2], want[:2], atol=1e-5, rtol=0
        )  # real slots; scratch slot may differ


def test_options_are_validated_and_reach_trace(sdk, tiny_dir, tmp_path):
    from neuron_opt.backends.neuron import NeuronBackend

    with pytest.raises(ConfigError, match="unknown neuron option"):
        NeuronBackend(torch.bfloat16, {"O2": True})
    with pytest.raises(ConfigError, match="target"):
        NeuronBackend(torch.bfloat16, {"target": "inf1"})
    runner = eager_runner(tiny_dir("llama-gqa2"), max_length=16, prefill_seqs=[16], decode_seqs=[16])
    backend = NeuronBackend(
        torch.float32,
        {
            "compiler_args": "--auto-cast=matmult -O2 --lnc=2",
            "target": "trn2",
            "compiler_workdir": str(tmp_path / "work"),
        },
    )
    backend.compile_bucket(runner.executor.model, Bucket("decode", 1, 16), 2, tmp_path / "g")
    call = sdk.CALLS[-1]
    assert call["compiler_args"] == ["--auto-cast=matmult", "-O2", "--lnc=2", "--target", "trn2"]
    assert call["cpu_backend"] is True
    assert call["compiler_workdir"] == str(tmp_path / "work" / "decode_b1_s16")


def test_a_bucket_without_a_graph_is_an_artifact_error(sdk, tiny_dir, tmp_path):
    from neuron_opt.backends.neuron import NeuronBackend

    runner = eager_runner(tiny_dir("llama-gqa2"), max_length=16, prefill_seqs=[16], decode_seqs=[16])
    m = runner.executor.model
    backend = NeuronBackend(torch.float32)
    backend.save_weights(m, tmp_path / "w.safetensors")
    factory = lambda: type(m)(m.cfg, m.layout, m.max_length)  # noqa: E731
    with pytest.raises(ArtifactError, match="graph.pt"):
        backend.load(
            {Bucket("prefill", 1, 16): [tmp_path / "other.bin"]}, tmp_path / "w.safetensors", factory, 2
        )
    executor = backend.load({}, tmp_path / "w.safetensors", factory, 2)
    with pytest.raises(ArtifactError, match="decode_b1_s16"):
        runner2 = ModelRunner(executor, runner.buckets, runner.cache, runner.vocab_size)
        runner2.decode([DecodeRow(0, 5, 3)])
