"""Continuous-batching scheduler over a block KV cache: which tokens of which requests run in the next step.
Device-free.

Design decisions (vLLM's policy, on our buckets)
- KV memory is a pool of blocks (runtime/block_manager.py); a running sequence holds the blocks its tokens
  need, so sequences of mixed lengths share the pool and short ones cost only what they use.
- A step spends a token budget (`max_num_batched_tokens`): every running sequence that decodes first (one token
  each, all in one `runner.decode` or `runner.verify` call), then prompt chunks: running sequences whose
  prompt is partly prefilled, then new requests FCFS. With chunked prefill a prompt takes what is left of the
  budget, up to the largest prefill bucket, and continues next step; prompts longer than the largest prefill
  bucket run as several chunks, up to max_model_len. Without it a prompt is never cut to the budget: it runs
  whole, or, longer than the largest prefill bucket (offset prefill buckets compiled), in chunks of that
  bucket's length, so where a prompt is split depends on the prompt alone, never on the other requests (the
  first prefill of a step always runs, so a chunk longer than the budget still does).
- Prefix caching: a new request first takes its longest cached prefix (full blocks that another request
  computed) and prefills only the rest, starting at that position. With a second KV tier (`tier`,
  runtime/kv_tier.py) the prefix goes on past the pool's blocks while the tier holds the next ones: they get new
  pool blocks, the tier copies its bytes into them at admission (checked against their digests; a damaged one
  ends the restored run and the rest is prefilled), and they count as computed. Blocks the pool evicts go to the
  tier as they are handed out (`BlockManager.on_evict`).
- Window-sized KV (KVConfig.sliding_window): the window layers' blocks are a second group
  (block_manager.WindowedBlockManager); each work item carries that group's table too (`window_blocks`), and
  once a sequence's computed tokens move on, the blocks its window left behind go back to the pool. With a KV
  tier, each group's evictions go to the tier as that group's entries, and a new prompt restores the longest
  prefix of n blocks for which the full group's n blocks and the window group's blocks its next query sees are
  each in their pool or the tier (`_window_tier_prefix`); a damaged entry gives the sequence's blocks back and
  the prompt is admitted again from the pools alone.
- Preemption by recompute: when a running sequence needs a block and none is free, the newest running
  sequence gives its blocks back and goes to the front of the queue with its tokens so far; later it prefills
  them again (prompt and generated tokens, in chunks) and continues where it stopped. No request is lost and
  its client sees nothing but a pause. Artifacts without offset prefill buckets cannot resume a sequence
  mid-way, so there a request reserves blocks for its prompt + max_tokens at admission and is never preempted.
- Images (neuron_opt.multimodal): a prompt's image placeholder tokens are prompt tokens, so they count against
  the token budget one each like any other, and a chunk may split an image's tokens (the engine's encoder cache
  gives each chunk its rows). Prefix-cache keys see each image's content hash at its placeholders
  (`Request.cache_tokens`), so the same text with another image never hits. A decoder that attends among an
  image's tokens in both directions (Gemma 3) needs each image block in one chunk (`Request.atomic_spans`): a
  chunk that would end inside one ends before it, and one that starts at its first token or inside it (after a
  prefix-cache hit) runs to its end; such a chunk over the budget waits for a step where it is the first prefill
  (which always runs).
- LoRA (`lora`, neuron_opt.lora.registry.LoraManager): a request under an adapter takes a slot when it is admitted
  (waiting, FCFS, while none is free) and gives it back when it finishes or is preempted; its prefix-cache
  blocks are salted with the adapter's identity.
- A request that can never fit (prompt + max_tokens beyond the model's limit) is rejected by `validate`
  before it is queued; the check is pure, so the engine calls it in the caller's thread and the HTTP layer
  gets the error synchronously.
- The scheduler bounds no queue: admission (how many requests may be in flight) is the engine's, checked once in
  `Engine.add_request`, so a request the engine admitted is never refused here (the waiting queue also holds
  requests admitted but not yet running, and preempted ones).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from neuron_opt.errors import ConfigError
from neuron_opt.runtime.block_manager import BlockManager, WindowedBlockManager, hash_block
from neuron_opt.runtime.kv_tier import WINDOW
from neuron_opt.runtime.request import PLACEHOLDER, Request, RequestStatus


@dataclass(frozen=True)
class PrefillWork:
    """Prompt tokens (or, after a preemption, prompt and generated ones) at positions start, start + 1, ...
    `last`: they end with the request's last token, so its logits give the next token."""

    request_id: str
    blocks: tuple[int, ...]
    token_ids: tuple[int, ...]
    start: int = 0
    last: bool = True
    lora_slot: int = 0
    window_blocks: tuple[int, ...] = ()  # the window layers' table (window-sized KV), else ()


@dataclass(frozen=True)
class DecodeWork:
    request_id: str
    blocks: tuple[int, ...]
    token: int
    position: int
    lora_slot: int = 0
    window_blocks: tuple[int, ...] = ()  # the window layers' table (window-sized KV), else ()


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: tuple[DecodeWork, ...] = ()
    prefills: tuple[PrefillWork, ...] = ()
    preempted: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass(frozen=True)
class KVConfig:
    """The block pool and how the scheduler uses it."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_prefill_len: int  # the largest prefill bucket: the longest chunk
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # the artifact has offset prefill buckets: a prefill may start after cached tokens. Needed by prefix caching,
    # chunked prefill and preemption (recompute resumes mid-sequence)
    offset_prefill: bool = True
    # window-sized KV (CacheConfig.sliding_window): the window layers' pool and window; 0: one pool for every layer
    sliding_window: int = 0
    window_num_blocks: int = 0

    def __post_init__(self) -> None:
        for flag in ("enable_prefix_caching", "enable_chunked_prefill"):
            if getattr(self, flag) and not self.offset_prefill:
                raise ConfigError(f"{flag}: this model has no offset prefill buckets (compiled with "
                                  "--no-offset-prefill); recompile without it, or turn the feature off")


class Scheduler:
    """Tracks waiting and running requests and their KV blocks.

    Args:
        max_num_seqs: most requests running at once (the largest decode batch).
        kv: the block pool and the features that use it.
        max_num_batched_tokens: tokens per step (decodes count one each).
        check_fits: `(prompt_len, max_tokens, chunked) -> None`, raising ContextLengthError when a request can
            never run (the runner's `check_fits`; `chunked`: a prompt may run as several prefill chunks, which
            offset prefill buckets allow with or without chunked prefill).
        lookahead: extra positions every decoding sequence holds blocks for (speculative tokens verified in
            one step).
        lora: the adapter slots (`acquire(name) -> slot | None`, `release(slot)`), for requests under an adapter.
        tier: the second KV tier (runtime/kv_tier.KVTier: `key in tier`, `store(key, block)`, `load(keys, blocks)
            -> n`, `record_lookup(tokens, hits)`; with window-sized KV also its window group: `windowed`,
            `holds(key, group)` and the group argument of `store` and `load`), or None.
    """

    def __init__(
        self,
        max_num_seqs: int,
        kv: KVConfig,
        *,
        max_num_batched_tokens: int = 2048,
        check_fits: Callable[[int, int, bool], None] | None = None,
        lookahead: int = 0,
        lora: Any = None,
        tier: Any = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens: must be >= 1, got {max_num_batched_tokens}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens, self.kv, self.lookahead = max_num_batched_tokens, kv, lookahead
        self._check_fits = check_fits
        self.lora = lora
        if tier is not None and not kv.enable_prefix_caching:
            raise ConfigError("kv_offloading_size: the KV tier keeps prefix-cache blocks; turn prefix caching on",
                              param="kv_offloading_size")
        if tier is not None and bool(kv.sliding_window) != tier.windowed:
            raise ConfigError("kv_offloading_size: this model keeps window-sized KV for its sliding-window layers "
                              "(a pool of their own): its KV tier needs both groups' pools (kv_tier.group_blocks)"
                              if kv.sliding_window else "kv_offloading_size: the KV tier holds a window group, "
                              "which this model's pool does not have", param="kv_offloading_size")
        self.tier = tier
        self.blocks: BlockManager | WindowedBlockManager = BlockManager(
            kv.num_blocks, kv.block_size, kv.enable_prefix_caching,
            tier.store if tier is not None else None) if not kv.sliding_window else \
            WindowedBlockManager(kv.num_blocks, kv.window_num_blocks, kv.block_size, kv.sliding_window,
                                 kv.enable_prefix_caching, tier.store if tier is not None else None,
                                 partial(tier.store, group=WINDOW) if tier is not None else None)
        self._pools_only: str | None = None  # a request admitted again without the tier (a damaged window entry)
        self.waiting: deque[Request] = deque()
        self.running: OrderedDict[str, Request] = OrderedDict()  # admission order = decode row order
        self.num_preemptions = 0

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def validate(self, prompt_len: int, max_tokens: int) -> None:
        """Raise if a request with these sizes can never run. Pure: safe to call from any thread."""
        if prompt_len < 1:
            raise ConfigError("prompt: must contain at least one token")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens: must be at least 1, got {max_tokens}", param="max_tokens")
        if self._check_fits is not None:
            self._check_fits(prompt_len, max_tokens, self.kv.offset_prefill)

    # ---- mutations -----------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.validate(req.num_prompt_tokens, req.max_tokens)
        if req.request_id in self.running or any(r.request_id == req.request_id for r in self.waiting):
            raise ConfigError(f"request_id: {req.request_id!r} is already in use")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        """Decode every running sequence that has its prompt computed; spend the rest of the token budget on
        prompt chunks; preempt the newest sequences when blocks run out."""
        budget = self.max_num_batched_tokens
        preempted: list[str] = []
        scheduled: set[str] = set()  # never preempted later in the step that scheduled them
        decodes: list[DecodeWork] = []
        for rid in list(self.running):
            req = self.running.get(rid)
            if req is None or req.num_tokens - req.num_computed_tokens != 1:
                continue  # preempted in this loop, or still prefilling
            need = min(req.num_computed_tokens + 1 + self.lookahead, self.kv.max_model_len)
            if not self._allocate_or_preempt(req, need, preempted, scheduled):
                continue
            decodes.append(DecodeWork(rid, tuple(self.blocks.table(rid)), req.last_token, req.num_computed_tokens,
                                      req.lora_slot, self._window_table(rid)))
            scheduled.add(rid)
            budget -= 1
        prefills: list[PrefillWork] = []
        chunked = self.kv.enable_chunked_prefill
        for rid in list(self.running):  # prompts already partly prefilled (earlier chunks)
            req = self.running.get(rid)
            if req is None or req.num_tokens - req.num_computed_tokens <= 1:
                continue
            chunk = min(req.num_tokens - req.num_computed_tokens, self.kv.max_prefill_len)
            if chunked:
                if budget <= 0:
                    continue
                chunk = min(chunk, budget)
            chunk = self._fit_spans(req, req.num_computed_tokens, chunk)
            if prefills and chunk > budget:
                continue  # never cut to the budget (nor inside an atomic span): next step
            if self._allocate_or_preempt(req, req.num_computed_tokens + chunk, preempted, scheduled):
                prefills.append(self._prefill_work(req, chunk))
                scheduled.add(rid)
                budget -= chunk
        while self.waiting and len(self.running) < self.max_num_seqs and (budget > 0 or not (prefills or chunked)):
            req = self.waiting[0]
            if self._prompt_pending(req.share_prefix_with):
                break  # a sibling sample: its prompt's blocks will be in the prefix cache after this step
            if req.lora_name is not None and not req.lora_slot:
                slot = self.lora.acquire(req.lora_name) if self.lora is not None else None
                if slot is None:
                    break  # every adapter slot is in use: wait, as for blocks
                req.lora_slot = slot
            tokens = req.cache_tokens()
            if self._window_tier:
                prefix, restore = self._window_tier_prefix(req, tokens)
            else:
                prefix = [] if req.scores_prompt and not req.output_token_ids else self.blocks.cached_prefix(
                    tokens, req.cache_salt)
                restore = self._tier_prefix(req, tokens, prefix)
            computed = (len(prefix) + len(restore)) * self.kv.block_size
            chunk = self._first_chunk(req, computed, budget)
            if prefills and chunk > budget:
                break  # FCFS: do not let a shorter prompt overtake the head of the queue
            # without offset prefill a request reserves its whole length: it can never be preempted
            need = (computed + chunk if self.kv.offset_prefill
                    else min(req.num_prompt_tokens + req.max_tokens + self.lookahead, self.kv.max_model_len))
            if not self._allocate_new(req, need, prefix, restore):
                break  # wait for blocks: running sequences finish or shrink the queue's demand
            restored = self._restore(req, len(prefix), restore)
            if restored < 0:  # window-sized KV, a damaged entry: its blocks are back; admitted again from the pools
                self._pools_only = req.request_id
                continue
            self._pools_only = None
            if restored < len(restore):  # a damaged entry ended the run: the rest is prefilled (its blocks are held)
                computed = (len(prefix) + restored) * self.kv.block_size
                chunk = self._first_chunk(req, computed, budget)
            self.waiting.popleft()
            if not req.output_token_ids:  # a first admission, not a resumed preemption
                self._record_lookup(req, len(prefix), restored)
                req.scheduled_time = req.scheduled_time or time.monotonic()
                req.num_cached_tokens = computed
            req.num_computed_tokens, req.status = computed, RequestStatus.RUNNING
            self.running[req.request_id] = req
            prefills.append(self._prefill_work(req, chunk))
            budget -= chunk
        return SchedulerOutput(tuple(decodes), tuple(prefills), tuple(preempted))

    def _first_chunk(self, req: Request, computed: int, budget: int) -> int:
        """Tokens a new request prefills in this step after `computed` cached ones: a chunk of the budget left, or
        without chunked prefill the rest up to the largest prefill bucket (the caller makes it wait for a step of
        its own when others prefill and it is over the budget)."""
        remaining = req.num_tokens - computed
        if self.kv.enable_chunked_prefill:
            return self._fit_spans(req, computed, min(remaining, max(budget, 1), self.kv.max_prefill_len))
        # whole, or the largest prefill bucket's length (a long prompt, a resumed preempted sequence): split by the
        # prompt alone, never by the budget
        return self._fit_spans(req, computed, min(remaining, self.kv.max_prefill_len))

    @staticmethod
    def _fit_spans(req: Request, start: int, chunk: int) -> int:
        """`chunk` tokens from `start`, made to end outside every atomic span of `req`: cut to end before a span it
        would end inside, or, starting at that span's first token or inside it (a prefix-cache hit ended there),
        grown to its end (spans are at most the largest prefill bucket long: Engine.add_request checks)."""
        end = start + chunk
        for a, b in req.atomic_spans:
            if a < end < b:
                return a - start if a > start else b - start
        return chunk

    def _tier_prefix(self, req: Request, tokens: list[int], prefix: list[int]) -> list[bytes]:
        """The hashes of the full blocks after the pool's `prefix` that the KV tier holds, in a run (never the
        block of the last token, which must be computed for its logits)."""
        if self.tier is None or (req.scores_prompt and not req.output_token_ids):
            return []
        bs, bm = self.kv.block_size, self.blocks
        assert isinstance(bm, BlockManager)  # the tier refuses window-sized KV
        parent = bm.block_hash[prefix[-1]] if prefix else req.cache_salt
        out: list[bytes] = []
        for i in range(len(prefix), (len(tokens) - 1) // bs):
            h = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            if h not in self.tier:
                break
            out.append(h)
            parent = h
        return out

    @property
    def _window_tier(self) -> bool:
        return self.tier is not None and isinstance(self.blocks, WindowedBlockManager)

    def _window_tier_prefix(self, req: Request, tokens: list[int]) -> tuple[list[int], list[bytes]]:
        """Window-sized KV with a tier: the full group's pool blocks of the longest restorable prefix of n blocks,
        and the hashes of its blocks after them (the tier holds the full group's entries): n is the longest for
        which the full group's n blocks are in its pool (a leading run) or the tier, and the window group's blocks
        a query after them sees are in its pool (a leading run, `window_hits`) or the tier. Never the block of the
        prompt's last token."""
        bm, bs = self.blocks, self.kv.block_size
        assert isinstance(bm, WindowedBlockManager)
        if req.scores_prompt and not req.output_token_ids:
            return [], []
        if self._pools_only == req.request_id:
            return bm.cached_prefix(tokens, req.cache_salt), []
        pool = bm.full.cached_prefix(tokens, req.cache_salt)
        chain = [h for b in pool if (h := bm.full.block_hash[b]) is not None]  # cached: every one has its hash
        parent = chain[-1] if chain else req.cache_salt
        for i in range(len(pool), (len(tokens) - 1) // bs):
            h = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            if not self.tier.holds(h):
                break
            chain.append(h)
            parent = h
        for n in range(len(chain), 0, -1):
            hashes = chain[:n]
            if all(self.tier.holds(h, WINDOW) for h in hashes[bm.window_hits(hashes):]):
                return pool[:n], hashes[len(pool[:n]):]
        return [], []

    def _allocate_new(self, req: Request, need: int, prefix: list[int], restore: list[bytes]) -> bool:
        """Blocks for a new request's first `need` positions, taking its pool `prefix`; the blocks for `restore`
        are new ones (the tier fills them)."""
        if self._window_tier:
            bm = self.blocks
            assert isinstance(bm, WindowedBlockManager)
            hashes = [h for b in prefix if (h := bm.full.block_hash[b]) is not None] + restore
            return bm.allocate(req.request_id, need, prefix, hashes)
        return self.blocks.allocate(req.request_id, need, prefix)

    def _restore(self, req: Request, num_prefix: int, keys: list[bytes]) -> int:
        """The tier's entries `keys` copied into `req`'s blocks after its `num_prefix` pool blocks (just allocated);
        how many were (the run ends at a damaged or missing entry). Window-sized KV: the window group's blocks a
        query after them sees, past its cached run, are copied too; a damaged or missing entry of either group
        gives the request's blocks back and returns -1."""
        rid, bm = req.request_id, self.blocks
        if not self._window_tier:
            return self.tier.load(keys, bm.table(rid)[num_prefix:num_prefix + len(keys)]) if keys else 0
        assert isinstance(bm, WindowedBlockManager)
        hashes = [h for b in bm.table(rid)[:num_prefix] if (h := bm.full.block_hash[b]) is not None] + keys
        m = bm.window_hits(hashes)  # the allocation took the window group's cached run; the rest is new
        if self.tier.load(keys, bm.table(rid)[num_prefix:len(hashes)]) < len(keys) or \
                self.tier.load(hashes[m:], bm.window_table(rid)[m:len(hashes)], WINDOW) < len(hashes) - m:
            bm.free_sequence(rid)
            return -1
        return len(keys)

    def _record_lookup(self, req: Request, num_prefix: int, num_restored: int) -> None:
        """Count an admitted prompt's hits: in the pool (its prefix blocks), and in the tier (the tokens past those,
        up to its last full block, looked up; its restored blocks' tokens hit)."""
        bs = self.kv.block_size
        self.blocks.record_lookup(req.num_prompt_tokens, num_prefix * bs)
        if self.tier is not None:
            self.tier.record_lookup(max(0, (req.num_tokens - 1) // bs * bs - num_prefix * bs), num_restored * bs)

    def _prompt_pending(self, request_id: str | None) -> bool:
        """The prompt of `request_id` is still being computed (it is admitted or running, not finished), and a
        request sharing it would find its blocks in the prefix cache later."""
        if request_id is None or not self.kv.enable_prefix_caching:
            return False
        req = self.running.get(request_id)
        return req is not None and req.num_computed_tokens < req.num_prompt_tokens

    def _prefill_work(self, req: Request, chunk: int) -> PrefillWork:
        start = req.num_computed_tokens
        tokens = (req.prompt_token_ids + req.output_token_ids)[start:start + chunk]
        return PrefillWork(req.request_id, tuple(self.blocks.table(req.request_id)), tuple(tokens), start,
                           start + chunk == req.num_tokens, req.lora_slot, self._window_table(req.request_id))

    def _window_table(self, request_id: str) -> tuple[int, ...]:
        blocks = self.blocks
        return tuple(blocks.window_table(request_id)) if isinstance(blocks, WindowedBlockManager) else ()

    def _slide(self, req: Request) -> None:
        """Window-sized KV: the blocks no later query of `req` sees go back to the window pool."""
        if isinstance(self.blocks, WindowedBlockManager):
            self.blocks.slide(req.request_id, req.num_computed_tokens)

    def _allocate_or_preempt(self, req: Request, num_tokens: int, preempted: list[str], scheduled: set[str]) -> bool:
        """Blocks for `num_tokens` of a running request, preempting the newest running requests not yet
        scheduled this step (`req` itself when none is left) until they fit. False when `req` itself had to go."""
        while not self.blocks.allocate(req.request_id, num_tokens):
            victim = next((r for r in reversed(self.running.values()) if r.request_id not in scheduled), req)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot and self.lora is not None:
            self.lora.release(req.lora_slot)
        req.lora_slot = 0

    def _preempt(self, req: Request) -> None:
        self.blocks.free_sequence(req.request_id)
        self._release_lora(req)
        del self.running[req.request_id]
        req.num_computed_tokens, req.status = 0, RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update_prefill(self, request_id: str, num_tokens: int) -> None:
        """A prefill chunk that did not reach the last token ran: its tokens now have K/V."""
        req = self.running[request_id]
        req.num_computed_tokens += num_tokens
        self.blocks.commit(request_id, req.cache_tokens(), req.num_computed_tokens, req.cache_salt)
        self._slide(req)

    def update(self, request_id: str, token: int) -> Request:
        """Record the token sampled from the last computed position: everything before it now has K/V."""
        req = self.running[request_id]
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(token)
        if self.blocks.has_new_full_block(request_id, req.num_computed_tokens):  # (skips the list copy otherwise)
            self.blocks.commit(request_id, req.cache_tokens(), req.num_computed_tokens, req.cache_salt)
        self._slide(req)
        return req

    def resolve(self, request_id: str, token: int) -> None:
        """Async scheduling: `token`, sampled by a step that was in flight, replaces the `PLACEHOLDER` that `update`
        recorded for it (running, or preempted meanwhile). Its K/V is not committed before the next `update`, so
        no block hash ever holds a placeholder. A request that finished meanwhile is ignored."""
        req = self.running.get(request_id)
        if req is None:
            req = next((r for r in self.waiting if r.request_id == request_id), None)
        if req is not None and req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
            req.output_token_ids[-1] = token

    def finish(self, request_id: str) -> Request | None:
        """Release a request (finished, aborted or failed) and its blocks. Unknown ids are ignored (a client may
        cancel a request that has just finished)."""
        req = self.running.pop(request_id, None)
        if req is not None:
            self.blocks.free_sequence(request_id)
            self._release_lora(req)
        else:
            req = next((r for r in self.waiting if r.request_id == request_id), None)
            if req is None:
                return None
            self.waiting.remove(req)
            self._release_lora(req)  # a request may hold its adapter's slot while it waits for blocks
        req.status = RequestStatus.FINISHED
        return req
