"""The executor layer: one factory picks how a model runs from the backend's capabilities (never its name), the
compile units it loads are the ones compile wrote, the loader reads an artifact's manifest once, and the names of
the compiled offset-prefill capability (old spellings still accepted) and of the KV cache dtype."""

from __future__ import annotations

import pytest
import torch

from neuron_opt import artifact as artifact_mod
from neuron_opt.backends import backend_class
from neuron_opt.backends.base import CompileUnit, kv_dtype
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig, pick_prefill
from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.cli import build_parser
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.config import CacheConfig, KVCacheDtype
from neuron_opt.errors import ConfigError
from neuron_opt.executors import (
    RANKS,
    SINGLE,
    SPMD,
    ArtifactSpec,
    CheckpointSpec,
    create_executor,
    executor_kind,
    load_model,
)
from neuron_opt.executors import loader as loader_mod
from neuron_opt.runtime.runner import ModelRunner


@pytest.fixture(scope="module")
def artifact(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exec") / "tiny"
    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=out, backend="eager", max_model_len=64,
                         prefill_buckets=(16,), decode_buckets=(32, 64), use_cache=False)
    compile_artifact(req, log=lambda s: None, progress=False)
    return out


@pytest.mark.parametrize("name, tp, kind", [
    ("eager", 1, SINGLE), ("cpu", 1, SINGLE), ("neuron", 1, SINGLE),
    ("eager", 2, RANKS), ("neuron", 2, SPMD),
])
def test_the_kind_follows_whether_the_graphs_hold_the_collectives(name, tp, kind):
    assert executor_kind(backend_class(name), tp) == kind


def test_compile_units_are_the_graph_directories():
    assert backend_class("neuron").compile_units(2) == [CompileUnit("spmd", (0, 1), "graphs/spmd")]
    assert backend_class("neuron").compile_units(1) == [CompileUnit(0, (0,), "graphs/rank0")]
    assert backend_class("eager").compile_units(2) == [CompileUnit(0, (0,), "graphs/rank0"),
                                                       CompileUnit(1, (1,), "graphs/rank1")]


def test_an_artifact_and_its_checkpoint_run_the_same_step(artifact, tiny_dir):
    m = artifact_mod.read_manifest(artifact)
    from_artifact = create_executor(ArtifactSpec(artifact, m))
    sd = open_checkpoint(tiny_dir("smollm-tok")).state_dict()
    from_checkpoint = create_executor(CheckpointSpec(m.model, sd, m.parallel, m.cache, m.dtype))
    assert isinstance(from_artifact, EagerExecutor) and isinstance(from_checkpoint, EagerExecutor)
    prompt = [1, 5, 9, 2, 7]
    a, b = (ModelRunner(ex, m.buckets, m.cache, m.model.vocab_size).prefill(0, prompt)
            for ex in (from_artifact, from_checkpoint))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_manifest_is_read_once(artifact, monkeypatch):
    reads = []
    real = artifact_mod.read_verified

    def counting(*args, **kwargs):
        reads.append(kwargs.get("verify_hashes", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(loader_mod, "read_verified", counting)
    loaded = load_model(artifact)
    assert reads == [True] and loaded.manifest is not None and loaded.dtype == loaded.manifest.dtype
    verified = real(artifact)  # what serve and generate read to check their flags
    load_model(artifact, verified=verified)
    assert reads == [True]  # taken as read
    load_model(artifact, verified=real(artifact, verify_hashes=False))
    assert reads == [True, True]  # its files were not hashed: read again, with every check


def test_offset_prefill_keeps_the_old_manifest_key_and_flag():
    old = {"prefill_lens": [16], "decode_batches": [1], "decode_kv_lens": [32], "chunked_prefill": True}
    cfg = BucketConfig.from_dict(old)
    assert cfg.offset_prefill and pick_prefill(4, cfg, start=20).kv_len == 32
    assert not BucketConfig.from_dict({**old, "chunked_prefill": False}).offset_prefill
    assert "offset_prefill" in cfg.to_dict() and "chunked_prefill" not in cfg.to_dict()
    parser = build_parser()
    base = ["compile", "--model", "default", "--out", "x"]
    for flag, want in (("--offset-prefill", True), ("--no-offset-prefill", False), ("--chunked-prefill", True),
                       ("--no-chunked-prefill", False)):
        assert parser.parse_args([*base, flag]).offset_prefill is want
    assert parser.parse_args(base).offset_prefill is None


def test_the_kv_cache_dtype_is_one_enum_from_the_flag_to_the_pools():
    assert build_parser().parse_args(["compile", "--model", "default", "--out", "x", "--kv-cache-dtype", "fp8"]
                                     ).kv_cache_dtype == KVCacheDtype.FP8
    assert KVCacheDtype.parse("fp8") is KVCacheDtype.FP8 and KVCacheDtype.parse(KVCacheDtype.AUTO) is KVCacheDtype.AUTO
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be auto or fp8, got 'int8'"):
        KVCacheDtype.parse("int8")
    fp8 = CacheConfig(dtype=KVCacheDtype.FP8.storage("bfloat16"))
    assert fp8.dtype == "float8_e4m3fn" and fp8.kv_cache_dtype is KVCacheDtype.FP8
    assert kv_dtype(fp8, torch.bfloat16) == torch.float8_e4m3fn
    auto = CacheConfig(dtype=KVCacheDtype.AUTO.storage("bfloat16"))
    assert auto.dtype == "bfloat16" and auto.kv_cache_dtype is KVCacheDtype.AUTO
    assert kv_dtype(auto, torch.bfloat16) == torch.bfloat16
