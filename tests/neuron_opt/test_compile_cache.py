"""The compile cache: content-addressed entries, atomic store, and misses explained by the key fields that changed."""

from __future__ import annotations

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
