"""Shape buckets: one compiled graph per bucket. Pure: no torch, no I/O.

- Prefill buckets cover prompt length: powers of two from a minimum (default 128) up to the max context, plus the
  max context itself, or an explicit list. A prompt of n tokens runs in the smallest bucket with seq >= n
  (a 256-token prompt runs in the 256 bucket).
- Decode buckets are 2-D: batch x KV length. A decode graph attends only over its bucket's KV positions, so the
  attention work and KV bytes read scale with the bucket, not with the cache's max length. A step whose rows
  reach position p needs kv_len >= p + 1 (the new token's own K/V are written at p and read back).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from neuron_opt.errors import BucketOverflowError, ConfigError

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, order=True)
class Bucket:
    """A compiled graph's static shape. prefill: [batch, seq] tokens, kv_len = seq. decode: [batch, 1], kv_len = seq."""

    phase: str
    batch: int
    seq: int

    def __post_init__(self) -> None:
        if self.phase not in (PREFILL, DECODE):
            raise ConfigError(f"bucket.phase: must be {PREFILL!r} or {DECODE!r}, got {self.phase!r}")
        if self.batch < 1 or self.seq < 1:
            raise ConfigError(f"bucket: batch and seq must be >= 1, got {self.batch}x{self.seq}")

    @property
    def kv_len(self) -> int:
        return self.seq

    @property
    def num_tokens(self) -> int:
        return self.batch * (self.seq if self.phase == PREFILL else 1)

    @property
    def key(self) -> str:
        """Stable name used for graph files and cache entries, e.g. 'decode_b4_s512'."""
        return f"{self.phase}_b{self.batch}_s{self.seq}"

    @classmethod
    def from_key(cls, key: str) -> Bucket:
        phase, b, s = key.split("_")
        return cls(phase, int(b[1:]), int(s[1:]))


def powers_of_two(lo: int, hi: int) -> list[int]:
    """Powers of two in [lo, hi], plus hi itself; lo is rounded up to a power of two. Sorted, unique."""
    if lo < 1 or hi < 1:
        raise ConfigError(f"bucket range: bounds must be >= 1, got {lo}..{hi}")
    out, p = [], 1
    while p < lo:
        p *= 2
    while p < hi:
        out.append(p)
        p *= 2
    out.append(hi)
    return out


@dataclass(frozen=True)
class BucketConfig:
    """The set of graphs to compile."""

    prefill_seqs: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_seqs: tuple[int, ...]
    prefill_batch: int = 1

    def __post_init__(self) -> None:
        for name in ("prefill_seqs", "decode_batches", "decode_seqs"):
            vals = getattr(self, name)
            if not vals or any(int(v) < 1 for v in vals):
                raise ConfigError(f"{name}: must be a non-empty list of positive integers, got {list(vals)}")
            if list(vals) != sorted(set(vals)):
                raise ConfigError(f"{name}: must be sorted and unique, got {list(vals)}")

    @classmethod
    def build(cls, *, max_context: int, max_length: int, max_batch: int, min_prefill: int = 128,
              min_decode: int = 128, prefill_seqs: Sequence[int] | None = None,
              decode_seqs: Sequence[int] | None = None, decode_batches: Sequence[int] | None = None) -> BucketConfig:
        """Default bucket set, or explicit lists (validated against the limits)."""
        if max_context > max_length:
            raise ConfigError(f"max_context: {max_context} exceeds max_length={max_length} (the KV cache length)")
        pf = sorted(set(prefill_seqs)) if prefill_seqs else powers_of_two(min(min_prefill, max_context), max_context)
        dc = sorted(set(decode_seqs)) if decode_seqs else powers_of_two(min(min_decode, max_length), max_length)
        bb = sorted(set(decode_batches)) if decode_batches else powers_of_two(1, max_batch)
        if pf[-1] > max_length:
            raise ConfigError(f"prefill_buckets: {pf[-1]} exceeds max_length={max_length}")
        if dc[-1] > max_length:
            raise ConfigError(f"decode_buckets: {dc[-1]} exceeds max_length={max_length}")
        if bb[-1] > max_batch:
            raise ConfigError(f"decode batch buckets: {bb[-1]} exceeds batch size {max_batch}")
        return cls(tuple(pf), tuple(bb), tuple(dc))

    def buckets(self) -> list[Bucket]:
        pre = [Bucket(PREFILL, self.prefill_batch, s) for s in self.prefill_seqs]
        dec = [Bucket(DECODE, b, s) for b in self.decode_batches for s in self.decode_seqs]
        return pre + dec

    def to_dict(self) -> dict[str, list[int] | int]:
        return {"prefill_seqs": list(self.prefill_seqs), "decode_batches": list(self.decode_batches),
                "decode_seqs": list(self.decode_seqs), "prefill_batch": self.prefill_batch}

    @classmethod
    def from_dict(cls, d: dict) -> BucketConfig:
        return cls(tuple(d["prefill_seqs"]), tuple(d["decode_batches"]), tuple(d["decode_seqs"]),
                   int(d.get("prefill_batch", 1)))


def smallest_fitting(n: int, sizes: Iterable[int]) -> int | None:
    """The smallest size >= n, or None when none fits."""
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else None


def pick_prefill(num_tokens: int, cfg: BucketConfig) -> Bucket:
    if num_tokens < 1:
        raise ValueError("a prompt needs at least one token")
    s = smallest_fitting(num_tokens, cfg.prefill_seqs)
    if s is None:
        raise BucketOverflowError(
            f"prompt of {num_tokens} tokens exceeds the largest prefill bucket ({cfg.prefill_seqs[-1]}); "
            "recompile with a larger --max-context or --prefill-buckets")
    return Bucket(PREFILL, cfg.prefill_batch, s)


def pick_decode(batch: int, max_position: int, cfg: BucketConfig) -> Bucket:
    """Bucket for `batch` rows whose furthest new token sits at `max_position` (needs kv_len > max_position)."""
    b = smallest_fitting(batch, cfg.decode_batches)
    if b is None:
        raise BucketOverflowError(
            f"decode batch of {batch} exceeds the largest decode batch bucket ({cfg.decode_batches[-1]}); "
            "recompile with a larger --batch-size")
    s = smallest_fitting(max_position + 1, cfg.decode_seqs)
    if s is None:
        raise BucketOverflowError(
            f"position {max_position} needs a KV length of {max_position + 1}, beyond the largest decode bucket "
            f"({cfg.decode_seqs[-1]}); recompile with a larger --max-length or --decode-buckets")
    return Bucket(DECODE, b, s)
