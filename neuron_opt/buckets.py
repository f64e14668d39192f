"""Shape buckets: one compiled graph per bucket. Pure: no torch, no I/O.

- Prefill buckets cover prompt length: powers of two from a minimum (default 128) up to the max context, plus the
  max context itself, or an explicit list. A prompt of n tokens runs in the smallest bucket with seq >= n
  (a 256-token prompt runs in the 256 bucket).
- Backends whose prefill graphs take any token count (the cpu backend) run a prompt at its length rounded up to
  their granularity instead (`pick_prefill`'s `granularity`); the compiled lengths still bound it.
- Offset prefill buckets (`offset_prefill`, on by default): a prefill of S tokens that starts after tokens
  already in the cache (a cached prefix, or the earlier chunks of a long prompt) attends over more positions
  than it has tokens: one bucket per (S, kv_len) with S a prefill length and kv_len a decode length > S. On the
  cpu backend they share the prefill graph (dynamic shapes) and cost nothing; the neuron backend compiles each.
- Verify buckets (speculative decoding) are decode buckets with `q_len` = k + 1 tokens per row: the last accepted
  token and k proposed ones, at consecutive positions, scored in one graph call (logits at every position).
  Compiled only when the artifact is built with `--num-speculative-tokens k`; one per decode bucket.
- Decode buckets are 2-D: batch x KV length. A decode graph attends only over its bucket's KV positions, so the
  attention work and KV bytes read scale with the bucket, not with the cache's max length. A step whose rows
  reach position p needs kv_len >= p + 1 (the new token's own K/V are written at p and read back).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from neuron_opt.errors import BucketOverflowError, ConfigError

PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"


@dataclass(frozen=True, order=True)
class Bucket:
    """A compiled graph's static shape: `batch` rows attending over `kv_len` cache positions.

    prefill: [batch, kv_len] tokens (a prompt starts at position 0, so its length is the KV length it attends
    over). decode: [batch, 1] tokens over kv_len positions. verify: [batch, q_len] tokens at consecutive
    positions over kv_len positions, logits at each. `tokens` is the per-row token count.
    """

    phase: str
    batch: int
    kv_len: int
    # tokens per row: verify k + 1; decode 1; prefill S <= kv_len (0 = kv_len: a prompt from position 0)
    q_len: int = 0

    def __post_init__(self) -> None:
        if self.phase not in (PREFILL, DECODE, VERIFY):
            raise ConfigError(f"bucket.phase: must be {PREFILL!r}, {DECODE!r} or {VERIFY!r}, got {self.phase!r}")
        if self.batch < 1 or self.kv_len < 1:
            raise ConfigError(f"bucket: batch and kv_len must be >= 1, got {self.batch}x{self.kv_len}")
        if self.q_len == 0:
            object.__setattr__(self, "q_len", self.kv_len if self.phase == PREFILL else 1)
        lo = {PREFILL: 1, DECODE: 1, VERIFY: 2}[self.phase]
        if not lo <= self.q_len <= self.kv_len or (self.phase == DECODE and self.q_len != 1):
            raise ConfigError(f"bucket: q_len {self.q_len} does not suit a {self.phase} bucket of kv_len "
                              f"{self.kv_len} (verify needs 2 <= q_len <= kv_len, prefill 1 <= q_len <= kv_len, "
                              "decode 1)")

    @property
    def tokens(self) -> int:
        """Tokens per row: the prompt (chunk) length for prefill, 1 for decode, q_len for verify."""
        return self.q_len

    @property
    def generates(self) -> bool:
        """A token-generation graph (decode or verify), as opposed to a prefill: the model's `decode` flag."""
        return self.phase != PREFILL

    @property
    def num_tokens(self) -> int:
        return self.batch * self.tokens

    @property
    def key(self) -> str:
        """Stable name used for graph files and cache entries, e.g. 'decode_b4_s512' (s: the KV length),
        'verify_b4_q5_s512' or 'prefill_b1_q128_s512' (128 tokens at an offset, over 512 positions)."""
        if self.phase == VERIFY or (self.phase == PREFILL and self.q_len != self.kv_len):
            return f"{self.phase}_b{self.batch}_q{self.q_len}_s{self.kv_len}"
        return f"{self.phase}_b{self.batch}_s{self.kv_len}"

    @classmethod
    def from_key(cls, key: str) -> Bucket:
        parts = key.split("_")
        if len(parts) == 4:
            phase, b, q, s = parts
            return cls(phase, int(b[1:]), int(s[1:]), int(q[1:]))
        phase, b, s = parts
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

    prefill_lens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_kv_lens: tuple[int, ...]
    prefill_batch: int = 1
    verify_len: int = 0  # q_len of the verify buckets (num_speculative_tokens + 1); 0: no verify graphs
    offset_prefill: bool = True  # offset prefill buckets: prefix caching and chunked prefill need them
    # an embedding model's buckets: prefill graphs from position 0 only (no decode, verify or offset prefill
    # graphs); decode_batches still bounds the sequences in flight, decode_kv_lens the sequence length
    prefill_only: bool = False

    def __post_init__(self) -> None:
        for name in ("prefill_lens", "decode_batches", "decode_kv_lens"):
            vals = getattr(self, name)
            if not vals or any(int(v) < 1 for v in vals):
                raise ConfigError(f"{name}: must be a non-empty list of positive integers, got {list(vals)}")
            if list(vals) != sorted(set(vals)):
                raise ConfigError(f"{name}: must be sorted and unique, got {list(vals)}")
        if self.verify_len == 1 or self.verify_len < 0 or self.verify_len > self.decode_kv_lens[0]:
            raise ConfigError(f"num_speculative_tokens: {self.verify_len - 1} needs verify graphs of "
                              f"{self.verify_len} tokens, which must be >= 2 and fit the smallest decode bucket "
                              f"({self.decode_kv_lens[0]})")
        if self.prefill_only and (self.verify_len or self.offset_prefill):
            raise ConfigError("prefill_only: an embedding model compiles prefill graphs from position 0 only (no "
                              "--num-speculative-tokens, no offset prefill buckets)")

    @classmethod
    def build(cls, *, max_prompt_len: int, max_model_len: int, max_batch: int, min_prefill: int = 128,
              min_decode: int = 128, prefill_lens: Sequence[int] | None = None,
              decode_kv_lens: Sequence[int] | None = None, decode_batches: Sequence[int] | None = None,
              num_speculative_tokens: int = 0, offset_prefill: bool = True,
              prefill_batch: int = 1, prefill_only: bool = False) -> BucketConfig:
        """Default bucket set, or explicit lists (validated against the limits).

        max_prompt_len: the longest prompt (the largest prefill bucket by default). max_model_len: the most tokens
        one sequence holds, prompt + generated: the KV cache length per sequence, and the largest decode bucket
        (explicit decode buckets must reach it, so that the two are one number). num_speculative_tokens k > 0
        adds a verify bucket of k + 1 tokens per row for every decode bucket. offset_prefill adds the offset
        prefill buckets (module docstring). prefill_only: an embedding model's (the field's comment)."""
        if max_prompt_len > max_model_len:
            raise ConfigError(f"max_prompt_len: {max_prompt_len} exceeds max_model_len={max_model_len} (the KV "
                              "cache length)")
        pf = (sorted(set(prefill_lens)) if prefill_lens
              else powers_of_two(min(min_prefill, max_prompt_len), max_prompt_len))
        dc = (sorted(set(decode_kv_lens)) if decode_kv_lens
              else powers_of_two(min(min_decode, max_model_len), max_model_len))
        bb = sorted(set(decode_batches)) if decode_batches else powers_of_two(1, max_batch)
        if pf[-1] > max_model_len:
            raise ConfigError(f"prefill_buckets: {pf[-1]} exceeds max_model_len={max_model_len}")
        if dc[-1] > max_model_len:
            raise ConfigError(f"decode_buckets: {dc[-1]} exceeds max_model_len={max_model_len}")
        if dc[-1] < max_model_len:
            raise ConfigError(f"decode_buckets: the largest ({dc[-1]}) must be max_model_len ({max_model_len}): a "
                              f"sequence holds at most its largest decode bucket; add {max_model_len} to the decode "
                              f"buckets or set max_model_len to {dc[-1]}")
        if bb[-1] > max_batch:
            raise ConfigError(f"decode batch buckets: {bb[-1]} exceeds batch size {max_batch}")
        if prefill_batch < 1 or prefill_batch > max_batch:
            raise ConfigError(f"prefill_batch: must be 1..{max_batch} (the batch size), got {prefill_batch}")
        if num_speculative_tokens < 0:
            raise ConfigError(f"num_speculative_tokens: must be >= 0, got {num_speculative_tokens}")
        return cls(tuple(pf), tuple(bb), tuple(dc), prefill_batch, verify_len=num_speculative_tokens + 1
                   if num_speculative_tokens else 0, offset_prefill=offset_prefill, prefill_only=prefill_only)

    def buckets(self) -> list[Bucket]:
        pre = [Bucket(PREFILL, self.prefill_batch, s) for s in self.prefill_lens]
        if self.prefill_only:
            return pre
        if self.offset_prefill:
            pre += [Bucket(PREFILL, self.prefill_batch, k, s) for s in self.prefill_lens for k in self.decode_kv_lens
                    if k > s]
        dec = [Bucket(DECODE, b, s) for b in self.decode_batches for s in self.decode_kv_lens]
        ver = ([Bucket(VERIFY, b, s, self.verify_len) for b in self.decode_batches for s in self.decode_kv_lens]
               if self.verify_len else [])
        return pre + dec + ver

    @property
    def num_speculative_tokens(self) -> int:
        return max(0, self.verify_len - 1)

    def to_dict(self) -> dict[str, list[int] | int]:
        return {"prefill_lens": list(self.prefill_lens), "decode_batches": list(self.decode_batches),
                "decode_kv_lens": list(self.decode_kv_lens), "prefill_batch": self.prefill_batch,
                "verify_len": self.verify_len, "offset_prefill": self.offset_prefill,
                **({"prefill_only": True} if self.prefill_only else {})}

    @classmethod
    def from_dict(cls, d: dict) -> BucketConfig:
        """`chunked_prefill`: the key's name in manifests written before `offset_prefill`, read the same."""
        offset = d.get("offset_prefill", d.get("chunked_prefill", False))
        return cls(tuple(d["prefill_lens"]), tuple(d["decode_batches"]), tuple(d["decode_kv_lens"]),
                   int(d.get("prefill_batch", 1)), int(d.get("verify_len", 0)), bool(offset),
                   bool(d.get("prefill_only", False)))


def smallest_fitting(n: int, sizes: Iterable[int]) -> int | None:
    """The smallest size >= n, or None when none fits."""
    fits = [s for s in sizes if s >= n]
    return min(fits) if fits else None


def pick_prefill(num_tokens: int, cfg: BucketConfig, start: int = 0, granularity: int = 0) -> Bucket:
    """Bucket for `num_tokens` prompt tokens at positions start, start + 1, ...: the smallest prefill length that
    holds them, over the smallest decode length that reaches start + num_tokens when the prefill starts after
    cached tokens (an offset bucket, or the plain one when that length is the prefill length itself).

    `granularity` g > 0: the backend runs prefills of any length from 2 up to its compiled ones (the cpu backend's
    prefill layer graph has a dynamic token count), so the length is `num_tokens` rounded up to a multiple of g (at
    least 2), never beyond the compiled prefill length that fits; 0: the compiled lengths only."""
    if num_tokens < 1:
        raise ValueError("a prompt needs at least one token")
    if granularity < 0:
        raise ValueError(f"granularity: must be >= 0, got {granularity}")
    s = smallest_fitting(num_tokens, cfg.prefill_lens)
    if s is None:
        raise BucketOverflowError(
            f"prompt of {num_tokens} tokens exceeds the largest prefill bucket ({cfg.prefill_lens[-1]}); "
            "recompile with a larger --max-prompt-len or --prefill-buckets")
    if granularity:
        s = min(s, max(2, -(-num_tokens // granularity) * granularity))
    if start == 0:
        return Bucket(PREFILL, cfg.prefill_batch, s)
    if not cfg.offset_prefill:
        raise BucketOverflowError("this artifact has no offset prefill buckets (compiled with --no-offset-prefill); "
                                  "prefix caching and chunked prefill need them")
    k = smallest_fitting(max(s, start + num_tokens), cfg.decode_kv_lens)
    if k is None:
        raise BucketOverflowError(
            f"a prefill reaching position {start + num_tokens - 1} needs a KV length of {start + num_tokens}, beyond "
            f"the largest decode bucket ({cfg.decode_kv_lens[-1]})")
    return Bucket(PREFILL, cfg.prefill_batch, k, s)


def pick_decode(batch: int, max_position: int, cfg: BucketConfig) -> Bucket:
    """Bucket for `batch` rows whose furthest new token sits at `max_position` (needs kv_len > max_position)."""
    b = smallest_fitting(batch, cfg.decode_batches)
    if b is None:
        raise BucketOverflowError(
            f"decode batch of {batch} exceeds the largest decode batch bucket ({cfg.decode_batches[-1]}); "
            "recompile with a larger --batch-size")
    s = smallest_fitting(max_position + 1, cfg.decode_kv_lens)
    if s is None:
        raise BucketOverflowError(
            f"position {max_position} needs a KV length of {max_position + 1}, beyond the largest decode bucket "
            f"({cfg.decode_kv_lens[-1]}); recompile with a larger --max-model-len or --decode-buckets")
    return Bucket(DECODE, b, s)


def pick_verify(batch: int, max_position: int, cfg: BucketConfig) -> Bucket:
    """Verify bucket for `batch` rows whose last scored token sits at `max_position` (kv_len > max_position)."""
    if not cfg.verify_len:
        raise BucketOverflowError("this artifact has no verify graphs; recompile with --num-speculative-tokens K")
    d = pick_decode(batch, max_position, cfg)
    return Bucket(VERIFY, d.batch, d.kv_len, cfg.verify_len)


# A vision encoder's buckets (neuron_opt.multimodal.compiled): one graph per image size, in the family's unit (tiles,
# or patches in whole merge blocks: `step`). An image runs in the smallest size that holds it, padded.


def encoder_sizes(largest: int, step: int, explicit: Sequence[int] | None = None) -> tuple[int, ...]:
    """The encoder's bucket sizes: `explicit` (each a multiple of `step`) or step x powers of two up to the largest
    image's size, plus that size (a multiple of `step`)."""
    if step < 1 or largest < step or largest % step:
        raise ConfigError(f"encoder buckets: the largest image size {largest} must be a positive multiple of {step}")
    sizes = sorted(set(explicit)) if explicit else [step * p for p in powers_of_two(1, largest // step)]
    bad = [s for s in sizes if s < step or s % step]
    if bad:
        raise ConfigError(f"encoder_buckets: {bad} are not positive multiples of {step} (the encoder's unit)",
                          param="encoder_buckets")
    return tuple(sizes)


def pick_encoder(size: int, sizes: Sequence[int]) -> int:
    """The smallest encoder bucket that holds an image of `size` units; BucketOverflowError naming them else."""
    fit = smallest_fitting(size, sizes)
    if fit is None:
        raise BucketOverflowError(f"image of size {size} exceeds the largest compiled encoder bucket "
                                  f"({max(sizes)}); recompile with larger --encoder-buckets")
    return fit
