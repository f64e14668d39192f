"""The engine on the block KV cache: prefix caching, chunked prefill, preemption and the second KV tier change no
output.

Oracle: the single-sequence reference loop (runtime/generate.py via `helpers.reference_generate`, whole prompts, no
cache sharing) on the same tiny model (fp32, the real tokenizer). Every request of a workload with a long shared
prefix must get exactly the reference's tokens with prefix caching and chunked prefill on or off, and when the block
pool is too small for the workload (requests are preempted and recomputed).
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import reference_generate

from neuron_opt.api import LLM, build_model
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.runtime.block_manager import hash_block
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.kv_tier import HostBlocks, KVTier
from neuron_opt.runtime.runner import ModelRunner
from neuron_opt.runtime.sampling import SamplingParams

MAX_LEN, BS = 128, 8


@pytest.fixture(scope="module")
def setup(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tiny_dir("smollm-tok")
    ref = LLM(path, batch_size=1, max_model_len=MAX_LEN)
    sd = {k: v for k, v in ref.runner.executor.model.state_dict().items()}
    model = build_model(ref.config, sd, MAX_LEN, torch.float32)
    system = "You are a careful assistant. Answer in one short sentence, and never repeat the question. " * 2
    prompts = [list(ref.tokenizer(system + f"Question {i}: what is {i} times {i + 1}?")["input_ids"])
               for i in range(6)]
    params = [SamplingParams(max_tokens=14, min_tokens=14, temperature=0.0) for _ in range(5)]
    params.append(SamplingParams(max_tokens=14, min_tokens=14, temperature=0.9, top_k=40, seed=7))
    want = [reference_generate(ref, p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    yield model, ref, prompts, params, want
    torch.set_num_threads(threads)


def engine_for(model, ref, num_blocks: int = 0, prefill_batch: int = 1, offset_prefill: bool = True,
               tier_blocks: int = 0, disk=None, **kw) -> Engine:
    """`tier_blocks`: a second KV tier of that many blocks' bytes (0: none); `disk`: its disk level's directory,
    of 24 blocks."""
    cache = CacheConfig(max_batch=4, max_model_len=MAX_LEN, block_size=BS, num_blocks=num_blocks)
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=MAX_LEN, max_batch=4, min_prefill=16,
                                 min_decode=16, prefill_batch=prefill_batch, offset_prefill=offset_prefill)
    executor = EagerExecutor(model, cache)
    runner = ModelRunner(executor, buckets, cache, ref.config.vocab_size)
    if tier_blocks:
        pools = HostBlocks(executor.k_caches, executor.v_caches)
        one = pools.block_bytes
        kw["kv_tier"] = KVTier(pools, tier_blocks * one, disk, 24 * (one + 16))
    return Engine(runner, ref.tokenizer, ref.eos_token_ids, **kw)


def run(engine: Engine, prompts, params, stagger: int = 0) -> list[list[int]]:
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    for step in range(2000):
        while pending and step >= stagger * (len(prompts) - len(pending)):  # arrivals spread over the run
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params[i],
                               lambda o, i=i: got[i].extend(o.new_token_ids))
        if not engine.step() and engine.num_unfinished == 0 and not pending:
            break
    assert engine.num_unfinished == 0 and engine.kv_usage == 0
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize("caching,chunked", [(True, True), (True, False), (False, True), (False, False)])
def test_prefix_caching_and_chunked_prefill_change_no_output(setup, caching, chunked):
    model, ref, prompts, params, want = setup
    assert all(len(p) > 32 for p in prompts)  # longer than a chunk of the 24-token budget
    engine = engine_for(model, ref, max_num_batched_tokens=24, enable_prefix_caching=caching,
                        enable_chunked_prefill=chunked)
    assert run(engine, prompts, params, stagger=3) == want
    stats = engine.prefix_cache_stats
    if caching:  # the shared system prompt is prefilled once: later requests hit its full blocks
        assert stats.hits >= 4 * (len(prompts[0]) // 2 // BS) * BS and engine.stats.prefills >= len(prompts)
    else:
        assert stats.hits == 0
    if chunked:
        assert engine.stats.prefills > len(prompts)  # prompts ran as several chunks


def test_batched_prefill_runs_several_chunks_per_call_and_changes_no_output(setup):
    model, ref, prompts, params, want = setup
    engine = engine_for(model, ref, prefill_batch=3, max_num_batched_tokens=160)
    calls = []
    inner = engine.runner.prefill_rows
    engine.runner.prefill_rows = lambda rows, candidates=None: calls.append(len(rows)) or inner(rows, candidates)
    assert run(engine, prompts, params) == want
    assert max(calls) == 3 and engine.runner.last_bucket is not None


def test_waiting_prompts_share_a_prefill_step_and_change_no_output(setup):
    """Prompts added together are prefilled in one engine step (each has its first token after it), in graph calls
    of up to the prefill batch rows, and every request gets the reference's tokens."""
    model, ref, prompts, params, want = setup
    n = 4  # the engine's max_num_seqs (its largest decode batch)
    for prefill_batch, calls_per_step in ((1, [1, 1, 1, 1]), (3, [3, 1])):
        # the synchronous loop: one step() runs its prefills and emits their tokens (async scheduling lands a
        # step's tokens in the next step() call)
        engine = engine_for(model, ref, prefill_batch=prefill_batch, max_num_batched_tokens=2048,
                            async_scheduling=False)
        calls: list[int] = []
        inner = engine.runner.prefill_rows
        engine.runner.prefill_rows = lambda rows, candidates=None, inner=inner, calls=calls: (
            calls.append(len(rows)) or inner(rows, candidates))
        got: dict[int, list[int]] = {i: [] for i in range(n)}
        for i in range(n):
            engine.add_request(str(i), prompts[i], params[i], lambda o, i=i, got=got: got[i].extend(o.new_token_ids))
        engine.step()
        assert calls == calls_per_step and all(len(t) == 1 for t in got.values())
        while engine.step():
            pass
        assert [got[i] for i in range(n)] == want[:n] and calls == calls_per_step


def test_preempted_requests_finish_with_the_same_tokens(setup):
    model, ref, prompts, params, want = setup
    # room for three prompts and a block (of 4 running): as they decode, the newest are preempted and recomputed
    blocks = 1 + 3 * -(-max(len(p) for p in prompts) // BS) + 1
    engine = engine_for(model, ref, num_blocks=blocks, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert run(engine, prompts, params) == want
    assert engine.stats.preemptions > 0


def test_prompts_beyond_the_largest_prefill_bucket_are_served_by_chunks(setup):
    model, ref, prompts, params, _ = setup
    long_prompt = prompts[0] * 2  # > 64, the largest prefill bucket
    sp = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    engine = engine_for(model, ref)
    assert run(engine, [long_prompt], [sp]) == [reference_generate(ref, long_prompt, sp).token_ids]
    # without chunked prefill: chunks of the largest prefill bucket, never cut to the budget (smaller here), so
    # where the prompt splits depends on the prompt alone
    off = engine_for(model, ref, enable_chunked_prefill=False, max_num_batched_tokens=8)
    assert run(off, [long_prompt], [sp]) == [reference_generate(ref, long_prompt, sp).token_ids]
    assert off.stats.prefill_tokens == len(long_prompt) and off.stats.prefills == -(-len(long_prompt) // 64)
    # an artifact without offset prefill buckets cannot continue a prompt: refused
    whole = engine_for(model, ref, offset_prefill=False)
    with pytest.raises(Exception, match="maximum context length is 64"):
        whole.add_request("x", long_prompt, sp, lambda o: None)


@pytest.mark.parametrize("tier,corrupt", [(None, None), ("ram", None), ("ram", 2), ("disk", None)])
def test_a_returning_turn_is_restored_from_the_kv_tier_with_the_same_tokens(setup, tier, corrupt, tmp_path):
    """A conversation's first turn, then other prompts that evict its blocks from a pool of 16, then its second
    turn (the first turn's prompt and reply, and a new question): the same tokens as the reference whole-prompt
    loop. With the tier, the second turn's blocks of the first turn come back from it, not prefilled (the prefill
    token count shows it), and a corrupted entry (`corrupt`: its block index) ends the restored run: that block
    and the rest are prefilled. "disk": RAM for 2 blocks, so the first turn's come back from the disk level."""
    model, ref, prompts, _, _ = setup
    sp = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    engine = engine_for(model, ref, num_blocks=17, tier_blocks={None: 0, "ram": 24, "disk": 2}[tier],
                        disk=tmp_path if tier == "disk" else None, max_num_batched_tokens=64)
    first = run(engine, [prompts[0]], [sp])[0]
    for i in range(3):  # 7 blocks each: the first turn's are evicted (16 in the pool)
        run(engine, [list(ref.tokenizer(f"Unrelated note {i}: the weather is mild. " * 4)["input_ids"])], [sp])
    turn2 = prompts[0] + first + prompts[1][-10:]
    kept = (len(prompts[0]) + len(first) - 1) // BS  # the first turn's blocks with K/V (its last token has none)
    keys = [hash_block(None, turn2[:BS])]
    for i in range(1, kept):
        keys.append(hash_block(keys[-1], turn2[i * BS:(i + 1) * BS]))
    if tier:
        assert all(k in engine.kv_tier for k in keys)  # every one was evicted into the tier
        t = engine.kv_tier
        for _ in range(1000):  # the background thread hashes entries (and writes the disk level) off the engine's
            if all(e.digest is not None for e in t.entries.values()) and not (t.disk and t.disk.pending):
                break
            time.sleep(0.01)
        if corrupt is not None:
            t.entries[keys[corrupt]].data[3] ^= 1
    tokens, pool_hits = engine.stats.prefill_tokens, engine.prefix_cache_stats.hits
    assert run(engine, [turn2], [sp])[0] == reference_generate(ref, turn2, sp).token_ids
    assert engine.prefix_cache_stats.hits == pool_hits  # nothing of it was left in the pool
    restored = 0 if not tier else kept if corrupt is None else corrupt
    assert engine.stats.prefill_tokens - tokens == len(turn2) - restored * BS
    if tier:
        st = engine.kv_tier.stats
        assert st.hits == restored * BS and st.corrupt == (corrupt is not None)
        assert (st.restored_disk if tier == "disk" else st.restored_ram) == restored
        assert corrupt is None or keys[corrupt] not in engine.kv_tier  # dropped, never used
        assert engine.kv_tier.num_bytes <= engine.kv_tier.max_bytes
