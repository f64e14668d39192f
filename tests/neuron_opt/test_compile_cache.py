"""The compile cache: content-addressed entries, atomic store, and misses explained by the key fields that changed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from neuron_opt.compile_cache import CacheKey, CompileCache
from neuron_opt.errors import ConfigError

BASE = {"weights": "abc", "bucket": "decode_b1_s128", "dtype": "float32", "backend_options": {}, "rank": 0}


def _store(cache: CompileCache, fields: dict, tmp_path, content: bytes = b"graph") -> None:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "g.so").write_bytes(content)
    cache.store(CacheKey(fields), src, [Path("g.so")])


def test_hit_returns_the_stored_files(tmp_path):
    cache = CompileCache(tmp_path / "c")
    _store(cache, BASE, tmp_path)
    files = cache.lookup(CacheKey(dict(BASE)))
    assert files is not None and (cache.files_dir(CacheKey(BASE)) / files[0]).read_bytes() == b"graph"
    assert not list((tmp_path / "c").glob(".tmp-*"))



def test_an_entry_stored_by_a_concurrent_compile_meanwhile_is_kept(tmp_path, monkeypatch):
    """Two compiles of one graph (two processes, e.g. `make test`'s workers) both miss and both store: the second
    finds the first's entry only at its rename, after its own check, and keeps that entry instead of failing."""
    cache = CompileCache(tmp_path / "c")
    final, real, raced = cache.entry_dir(CacheKey(BASE)), os.replace, []

    def other_compile_first(src, dst):
        if Path(dst) == final and not raced:
            raced.append(dst)
            _store(cache, BASE, tmp_path / "other", b"first")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", other_compile_first)
    (tmp_path / "other").mkdir()
    _store(cache, BASE, tmp_path, b"second")
    assert raced and (cache.files_dir(CacheKey(BASE)) / "g.so").read_bytes() == b"first"
    assert cache.fetch(CacheKey(BASE), tmp_path / "dest") == [Path("g.so")]
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


def test_fetch_copies_a_verified_hit(tmp_path):
    cache = CompileCache(tmp_path / "c")
    _store(cache, BASE, tmp_path)
    dest = tmp_path / "out"
    assert cache.fetch(CacheKey(BASE), dest) == [Path("g.so")]
    assert (dest / "g.so").read_bytes() == b"graph"


@pytest.mark.parametrize("already_in_dest", [False, True])
def test_poisoned_entry_is_a_miss_removed_with_a_warning_then_rewritten(already_in_dest, tmp_path, caplog):
    """An entry whose file no longer matches the sha256 recorded when it was stored is never used: the copy is
    undone, a warning names the entry, the miss says why, and the recompile's store writes the entry again. Also
    when the file is already in the destination (shared with a bucket fetched before)."""
    cache = CompileCache(tmp_path / "c")
    _store(cache, BASE, tmp_path)
    entry = cache.entry_dir(CacheKey(BASE))
    (entry / "files" / "g.so").write_bytes(b"evil")
    dest = tmp_path / "out"
    if already_in_dest:
        dest.mkdir()
        (dest / "g.so").write_bytes(b"graph")
    with caplog.at_level("WARNING", logger="neuron_opt.compile_cache"):
        assert cache.fetch(CacheKey(BASE), dest) is None
    assert f"cache entry {entry} failed its sha256 check (g.so" in caplog.text
    assert cache.explain_miss(CacheKey(BASE)).startswith(f"cache entry {entry} failed its sha256 check")
    assert not entry.exists() and (dest / "g.so").exists() == already_in_dest
    _store(cache, BASE, tmp_path, b"graph")  # the recompile's store
    assert cache.fetch(CacheKey(BASE), dest) == [Path("g.so")] and (dest / "g.so").read_bytes() == b"graph"


def test_entry_without_recorded_hashes_is_a_miss_and_rewritten(tmp_path):
    cache = CompileCache(tmp_path / "c")
    _store(cache, BASE, tmp_path)
    meta = cache.entry_dir(CacheKey(BASE)) / "key.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "sha256"}))
    assert cache.fetch(CacheKey(BASE), tmp_path / "out") is None and not meta.exists()
    _store(cache, BASE, tmp_path)
    assert cache.fetch(CacheKey(BASE), tmp_path / "out") is not None


def test_cache_directory_is_private(tmp_path):
    CompileCache(tmp_path / "new" / "c")
    assert stat.S_IMODE((tmp_path / "new" / "c").stat().st_mode) == 0o700
    (tmp_path / "old").mkdir(mode=0o777)
    os.chmod(tmp_path / "old", 0o777)
    CompileCache(tmp_path / "old")
    assert stat.S_IMODE((tmp_path / "old").stat().st_mode) == 0o700


def test_cache_directory_of_another_user_is_refused(tmp_path):
    if os.getuid() == 0:
        other = tmp_path / "theirs"
        other.mkdir()
        os.chown(other, 65534, 65534)  # nobody
    else:
        other = Path("/")  # root's
    with pytest.raises(ConfigError, match=r"compile cache: .* is owned by uid \d+, not by this user.*"
                                          r"NEURON_OPT_CACHE_DIR"):
        CompileCache(other)


@pytest.mark.slow  # a cold cpu compile of its own (~45 s on 2 cores; make test-slow)
def test_poisoned_cpu_graph_in_the_cache_is_recompiled_not_copied(tiny_dir, tmp_path, caplog):
    """compile end to end: a cached cpu graph edited after it was stored is not copied into the next artifact; the
    bucket is recompiled (the miss names the entry), the entry rewritten, and the artifact runs like the first."""
    from helpers import eager_runner
    from tiny import make_tiny

    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.executors import load_model

    ckpt = make_tiny("llama-gqa2", tmp_path / "ckpt", tokenizer=True)

    def compile_to(out: str):
        req = CompileRequest(model=str(ckpt), out=tmp_path / out, backend="cpu", dtype="float32", max_model_len=32,
                             prefill_buckets=(16,), decode_buckets=(32,), cache_dir=tmp_path / "c")
        return compile_artifact(req, log=lambda s: None, progress=False)

    compile_to("a")
    entries = sorted((tmp_path / "c").glob("*/key.json"))
    poisoned = next(e.parent for e in entries if "decode" in json.loads(e.read_text())["fields"]["bucket"])
    so = next((poisoned / "files").rglob("layer_decode_b1.so"))
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="neuron_opt.compile_cache"):
        report = compile_to("b")
    assert list(report.misses) == ["decode_b1_s32/rank0"] and str(poisoned) in report.misses["decode_b1_s32/rank0"]
    assert f"cache entry {poisoned} failed its sha256 check" in caplog.text
    assert json.loads((poisoned / "key.json").read_text())["sha256"]  # rewritten
    from neuron_opt.runtime.generate import generate_ids
    from neuron_opt.runtime.sampling import SamplingParams

    loaded, params = load_model(tmp_path / "b"), SamplingParams(max_tokens=8, ignore_eos=True)
    ref = eager_runner(ckpt, max_model_len=32, prefill_lens=[16], decode_kv_lens=[32])
    prompt = list(range(3, 15))
    assert (generate_ids(loaded.runner, loaded.tokenizer, prompt, params, ()).token_ids
            == generate_ids(ref, loaded.tokenizer, prompt, params, ()).token_ids)


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


@pytest.mark.slow  # ~65 s: two full compiles
def test_other_weights_of_the_same_architecture_reuse_every_graph(tmp_path):
    """A fine-tuned checkpoint (same config, other weights) hits the cache for every graph, and its artifact
    computes with its own weights: logits equal the eager model of that checkpoint."""
    import torch
    from helpers import eager_runner
    from tiny import make_tiny

    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.executors import load_model

    def compile_seed(seed: int):
        ckpt = make_tiny("llama-gqa2", tmp_path / f"ckpt{seed}", seed=seed, tokenizer=True)
        req = CompileRequest(model=str(ckpt), out=tmp_path / f"art{seed}", backend="cpu", dtype="float32",
                             max_model_len=32, prefill_buckets=(16,), decode_buckets=(32,), cache_dir=tmp_path / "c")
        return ckpt, compile_artifact(req, log=lambda s: None, progress=False)

    compile_seed(0)
    ckpt, report = compile_seed(1)
    assert report.hits and not report.misses
    assert report.manifest.source["weights_sha256"] != load_model(tmp_path / "art0").manifest.source[
        "weights_sha256"]
    prompt = list(range(3, 15))
    got = load_model(tmp_path / "art1").runner.prefill(0, prompt)
    want = eager_runner(ckpt, max_model_len=32, prefill_lens=[16], decode_kv_lens=[32]).prefill(0, prompt)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
