"""The compile cache: content-addressed entries, atomic store, and misses explained by the key fields that changed."""

from __future__ import annotations

import pytest

from neuron_opt.compile_cache import CacheKey, CompileCache

BASE = {"weights": "abc", "bucket": "decode_b1_s128", "dtype": "float32", "backend_options": {}, "rank": 0}


def _store(cache: CompileCache, fields: dict, tmp_path, content: bytes = b"graph") -> None:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "g.so").write_bytes(content)
    cache.store(CacheKey(fields), src, [__import__("pathlib").Path("g.so")])


def test_hit_returns_the_stored_files(tmp_path):
    cache = CompileCache(tmp_path / "c")
    _store(cache, BASE, tmp_path)
    files = cache.lookup(CacheKey(dict(BASE)))
    assert files is not None and (cache.files_dir(CacheKey(BASE)) / files[0]).read_bytes() == b"graph"
    assert not list((tmp_path / "c").glob(".tmp-*"))


def test_key_is_independent_of_field_order():
    assert CacheKey(dict(BASE)).digest == CacheKey(dict(reversed(list(BASE.items())))).digest


def test_miss_names_the_changed_fields(tmp_path):
    cache = CompileCache(tmp_path / "c")
    _store(cache, BASE, tmp_path)
    changed = {**BASE, "dtype": "bfloat16", "backend_options": {"gemm": "onednn"}}
    assert cache.lookup(CacheKey(changed)) is None
    assert cache.explain_miss(CacheKey(changed)) == "changed: backend_options, dtype"
    assert cache.explain_miss(CacheKey({**BASE, "weights": "new"})) == "changed: weights"


def test_miss_for_a_bucket_never_compiled(tmp_path):
    cache = CompileCache(tmp_path / "c")
    _store(cache, BASE, tmp_path)
    assert cache.explain_miss(CacheKey({**BASE, "bucket": "decode_b1_s256"})).startswith("new bucket")


def test_entry_with_a_missing_file_is_a_miss(tmp_path):
    cache = CompileCache(tmp_path / "c")
    _store(cache, BASE, tmp_path)
    (cache.files_dir(CacheKey(BASE)) / "g.so").unlink()
    assert cache.lookup(CacheKey(BASE)) is None


@pytest.mark.slow  # a cold compile of its own (~1 min; make test-slow)
def test_compile_time_estimate_comes_from_this_machines_last_cold_compile(tiny_dir, tmp_path):
    """Before any compile the plan says it has no measurement; a cold compile records this machine's seconds per
    graph; the next plan's estimate is that figure times the graph count, and says so."""
    import json
    import re

    from neuron_opt.compiler import TIMINGS, CompileRequest, compile_artifact

    logs: list[str] = []

    def req(out: str) -> CompileRequest:
        return CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / out, backend="cpu",
                              dtype="float32", max_model_len=32, prefill_buckets=(16,), decode_buckets=(32,),
                              cache_dir=tmp_path / "cache")

    compile_artifact(req("a"), log=logs.append, progress=False)
    assert "not yet measured on this machine" in logs[0]
    seconds = json.loads((tmp_path / "cache" / TIMINGS).read_text())["cpu"]
    assert seconds > 0
    logs.clear()
    report = compile_artifact(req("b"), log=logs.append, progress=False)  # all hits: nothing new recorded
    assert not report.misses
    assert json.loads((tmp_path / "cache" / TIMINGS).read_text())["cpu"] == seconds
    shown = re.search(r"estimated compile time with a cold cache: ([\d.]+) min \(measured on this machine: "
                      r"([\d.]+) s per 30-layer graph\)", logs[0])
    assert shown and float(shown.group(2)) == pytest.approx(seconds, abs=0.05)
    units = 3 * max(0.3, 2 / 30)  # prefill + decode layer graphs + one head graph, 1 rank, 2 layers
    assert float(shown.group(1)) == pytest.approx(seconds * units / 60, abs=0.051)


def test_other_weights_of_the_same_architecture_reuse_every_graph(tmp_path):
    """A fine-tuned checkpoint (same config, other weights) hits the cache for every graph, and its artifact
    computes with its own weights: logits equal the eager model of that checkpoint."""
    import torch
    from helpers import eager_runner
    from tiny import make_tiny

    from neuron_opt.artifact import load_artifact
    from neuron_opt.compiler import CompileRequest, compile_artifact

    def compile_seed(seed: int):
        ckpt = make_tiny("llama-gqa2", tmp_path / f"ckpt{seed}", seed=seed, tokenizer=True)
        req = CompileRequest(model=str(ckpt), out=tmp_path / f"art{seed}", backend="cpu", dtype="float32",
                             max_model_len=32, prefill_buckets=(16,), decode_buckets=(32,), cache_dir=tmp_path / "c")
        return ckpt, compile_artifact(req, log=lambda s: None, progress=False)

    compile_seed(0)
    ckpt, report = compile_seed(1)
    assert report.hits and not report.misses
    assert report.manifest.source["weights_sha256"] != load_artifact(tmp_path / "art0").manifest.source[
        "weights_sha256"]
    prompt = list(range(3, 15))
    got = load_artifact(tmp_path / "art1").runner.prefill(0, prompt)
    want = eager_runner(ckpt, max_model_len=32, prefill_lens=[16], decode_kv_lens=[32]).prefill(0, prompt)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
