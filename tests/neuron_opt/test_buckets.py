"""Bucket logic, tested exhaustively over small ranges and with hypothesis over large ones."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neuron_opt.buckets import (
    DECODE,
    PREFILL,
    Bucket,
    BucketConfig,
    pick_decode,
    pick_prefill,
    powers_of_two,
)
from neuron_opt.errors import BucketOverflowError, ConfigError


def test_default_prefill_buckets_are_powers_of_two_plus_max():
    cfg = BucketConfig.build(max_prompt_len=3000, max_model_len=4096, max_batch=8)
    assert cfg.prefill_lens == (128, 256, 512, 1024, 2048, 3000)
    assert cfg.decode_kv_lens == (128, 256, 512, 1024, 2048, 4096)
    assert cfg.decode_batches == (1, 2, 4, 8)


def test_exact_fit_uses_that_bucket_not_the_next():
    cfg = BucketConfig.build(max_prompt_len=2048, max_model_len=2048, max_batch=1)
    assert pick_prefill(256, cfg) == Bucket(PREFILL, 1, 256)  # NxDI would pad to 512
    assert pick_prefill(257, cfg) == Bucket(PREFILL, 1, 512)
    assert pick_prefill(255, cfg) == Bucket(PREFILL, 1, 256)
    assert pick_prefill(1, cfg) == Bucket(PREFILL, 1, 128)


def test_decode_needs_kv_len_past_the_new_position():
    cfg = BucketConfig.build(max_prompt_len=512, max_model_len=512, max_batch=4)
    assert pick_decode(1, 127, cfg) == Bucket(DECODE, 1, 128)  # writes position 127, reads 0..127
    assert pick_decode(1, 128, cfg) == Bucket(DECODE, 1, 256)
    assert pick_decode(3, 0, cfg) == Bucket(DECODE, 4, 128)


def test_overflow_errors_name_largest_bucket_and_flag():
    cfg = BucketConfig.build(max_prompt_len=512, max_model_len=1024, max_batch=2)
    with pytest.raises(BucketOverflowError, match=r"largest prefill bucket \(512\).*--max-prompt-len"):
        pick_prefill(513, cfg)
    with pytest.raises(BucketOverflowError, match=r"largest decode bucket \(1024\).*--max-model-len"):
        pick_decode(1, 1024, cfg)
    with pytest.raises(BucketOverflowError, match=r"--batch-size"):
        pick_decode(3, 5, cfg)


def test_invalid_configs_are_refused():
    with pytest.raises(ConfigError, match="max_prompt_len"):
        BucketConfig.build(max_prompt_len=4096, max_model_len=2048, max_batch=1)
    with pytest.raises(ConfigError, match="prefill_buckets"):
        BucketConfig.build(max_prompt_len=512, max_model_len=512, max_batch=1, prefill_lens=[128, 1024])
    with pytest.raises(ConfigError, match="bucket.phase"):
        Bucket("warmup", 1, 1)


def test_bucket_key_round_trip():
    for b in BucketConfig.build(max_prompt_len=300, max_model_len=700, max_batch=3).buckets():
        assert Bucket.from_key(b.key) == b


@pytest.mark.parametrize("lo,hi", [(lo, hi) for lo in range(1, 40) for hi in range(1, 300, 7)])
def test_powers_of_two_exhaustive(lo, hi):
    out = powers_of_two(lo, hi)
    assert out[-1] == hi and out == sorted(set(out))
    assert all(v & (v - 1) == 0 for v in out[:-1])
    assert all(v >= lo or v == hi for v in out)


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=8, unique=True), st.integers(1, 6000))
def test_pick_prefill_is_smallest_fitting(seqs, n):
    seqs = sorted(seqs)
    cfg = BucketConfig(tuple(seqs), (1,), (max(seqs),))
    if n > seqs[-1]:
        with pytest.raises(BucketOverflowError):
            pick_prefill(n, cfg)
    else:
        b = pick_prefill(n, cfg)
        assert b.kv_len >= n and all(s < n for s in seqs if s < b.kv_len)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=6, unique=True),
       st.lists(st.integers(1, 4096), min_size=1, max_size=6, unique=True), st.integers(1, 70), st.integers(0, 5000))
def test_pick_decode_is_smallest_fitting(batches, seqs, batch, pos):
    cfg = BucketConfig((16,), tuple(sorted(batches)), tuple(sorted(seqs)))
    if batch > max(batches) or pos + 1 > max(seqs):
        with pytest.raises(BucketOverflowError):
            pick_decode(batch, pos, cfg)
        return
    b = pick_decode(batch, pos, cfg)
    assert b.batch >= batch and b.kv_len > pos
    assert not [x for x in batches if batch <= x < b.batch]
    assert not [s for s in seqs if pos < s < b.kv_len]


def test_max_model_len_is_the_largest_decode_bucket():
    """One number for 'most tokens a sequence holds': explicit decode buckets must reach max_model_len."""
    with pytest.raises(ConfigError, match=r"the largest \(32\) must be max_model_len \(64\)"):
        BucketConfig.build(max_prompt_len=16, max_model_len=64, max_batch=1, decode_kv_lens=[16, 32])
    assert BucketConfig.build(max_prompt_len=16, max_model_len=32, max_batch=1,
                              decode_kv_lens=[16, 32]).decode_kv_lens[-1] == 32


def test_retired_names_do_not_come_back():
    """The names that docs/structure.md's "Names" replaced appear nowhere in the code, except as the
    CLI's accepted old spellings (and pydantic's own `Field(max_length=)`, a string bound, and the quoted
    `"max_length"` keyword of HF's tokenizers and `apply_chat_template`, which requests and checkpoints name)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    retired = re.compile(r"\b(max_length|max_total_len|max_context|prefill_seqs|decode_seqs)\b|bucket\.seq\b")
    hits = [f"{p.relative_to(root)}:{i}: {line.strip()}"
            for pkg in ("neuron_opt", "models", "kernels_nki", "scripts")
            for p in sorted((root / pkg).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if retired.search(re.sub(r"Field\([^)]*\)|\"max_length\"", "", line))]
    assert hits == []


@given(st.lists(st.integers(1, 512), min_size=1, max_size=5, unique=True),
       st.lists(st.integers(1, 2048), min_size=1, max_size=5, unique=True), st.integers(1, 600), st.integers(1, 2048))
def test_offset_prefill_buckets_cover_every_prefill_after_cached_tokens(pf, dc, n, start):
    """A prefill of n tokens from position `start` runs in a compiled bucket (offset or plain) whose tokens hold n
    and whose KV length reaches start + n, the smallest such; without offset buckets it is refused."""
    pf, dc = sorted(pf), sorted(dc)
    cfg = BucketConfig(tuple(pf), (1,), tuple(dc))
    compiled = set(cfg.buckets())
    assert sum(b.phase == PREFILL and b.tokens != b.kv_len for b in compiled) == sum(k > s for s in pf for k in dc)
    if n > pf[-1] or start + n > dc[-1] or max(n, min(s for s in pf if s >= n)) > dc[-1]:
        with pytest.raises(BucketOverflowError):
            pick_prefill(n, cfg, start)
        return
    b = pick_prefill(n, cfg, start)
    assert b in compiled or (b.tokens == b.kv_len and b.kv_len in pf)
    assert b.tokens >= n and b.kv_len >= start + n and b.kv_len >= b.tokens
    assert not [s for s in pf if n <= s < b.tokens] and not [k for k in dc if max(b.tokens, start + n) <= k < b.kv_len]
    with pytest.raises(BucketOverflowError, match="no offset prefill buckets"):
        pick_prefill(n, BucketConfig(tuple(pf), (1,), tuple(dc), offset_prefill=False), start)
    assert Bucket.from_key(b.key) == b


def test_granular_prefill_pads_to_the_granularity_not_the_bucket():
    cfg = BucketConfig.build(max_prompt_len=512, max_model_len=512, max_batch=1)
    assert pick_prefill(155, cfg, granularity=16) == Bucket(PREFILL, 1, 160)  # 256 without
    assert pick_prefill(160, cfg, granularity=16) == Bucket(PREFILL, 1, 160)
    assert pick_prefill(1, cfg, granularity=16) == Bucket(PREFILL, 1, 16)
    assert pick_prefill(1, cfg, granularity=1) == Bucket(PREFILL, 1, 2)  # the dynamic graphs' least token count
    assert pick_prefill(150, cfg, start=100, granularity=16) == Bucket(PREFILL, 1, 256, 160)
    with pytest.raises(ValueError, match="granularity"):
        pick_prefill(5, cfg, granularity=-1)
    with pytest.raises(BucketOverflowError, match="largest prefill bucket"):
        pick_prefill(513, cfg, granularity=16)


@given(st.lists(st.integers(1, 600), min_size=1, max_size=5, unique=True),
       st.lists(st.integers(1, 2048), min_size=1, max_size=5, unique=True), st.integers(1, 600), st.integers(0, 2048),
       st.sampled_from([1, 8, 16, 32]))
def test_granular_prefill_holds_the_tokens_within_the_compiled_bucket(pf, dc, n, start, g):
    """With a granularity g the prefill length is n rounded up to a multiple of g (at least 2), capped by the compiled
    bucket that fits n; its KV length is the smallest decode length reaching it (or the prefill length from 0)."""
    pf, dc = sorted(pf), sorted(dc)
    cfg = BucketConfig(tuple(pf), (1,), tuple(dc))
    fits = [p for p in pf if p >= n]
    want = min(fits[0], max(2, -(-n // g) * g)) if fits else None
    reach = [k for k in dc if want is not None and k >= max(want, start + n)]
    if want is None or (start and not reach):
        with pytest.raises(BucketOverflowError):
            pick_prefill(n, cfg, start, g)
        return
    b = pick_prefill(n, cfg, start, g)
    assert b.tokens == want and b.batch == 1 and n <= b.tokens <= fits[0]
    assert b.kv_len == (want if start == 0 else reach[0])
