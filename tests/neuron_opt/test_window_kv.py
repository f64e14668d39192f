"""Window-sized KV: sliding-window layers hold only the blocks their window still sees, and nothing changes.

Tiny Gemma 2 (window 6, sliding and full layers alternating) and GPT-OSS (window 4, attention sinks) at a context 8x
Gemma's window, blocks of 4, prefill chunks of 8. Oracle: HF transformers' greedy generation (fp32) on the same
checkpoint, past the window, with prefix caching, chunked prefill, preemption and speculative decoding on (PEFT's
under a LoRA adapter); and the plan's KV figure against the bytes the executor allocates.
"""

from __future__ import annotations

import time

import pytest
import torch
from tiny import load_hf, make_tiny

from neuron_opt.api import build_model
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.compiler import CompileRequest, format_plan, plan_buckets
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.parallel import head_layout
from neuron_opt.planner.hardware import get_instance
from neuron_opt.planner.memory import kv_bytes, plan_memory
from neuron_opt.runtime.block_manager import WindowedBlockManager
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.generate import generate_ids
from neuron_opt.runtime.runner import ModelRunner
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.speculative import SpeculativeConfig

MAX_LEN, BS, CHUNK, BATCH = 48, 4, 8, 2


@pytest.fixture(scope="module", params=["gemma2", "gpt-oss"])
def setup(request, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ck = make_tiny(request.param, tmp_path_factory.mktemp(request.param), tokenizer=True)
    cfg = ModelConfig.from_hf(ck)
    hf = load_hf(ck)
    ckpt = open_checkpoint(ck)
    model = build_model(cfg, ckpt.state_dict(), MAX_LEN, torch.float32)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, cfg.vocab_size, (14,), generator=g).tolist()
    prompts = [shared + torch.randint(3, cfg.vocab_size, (6,), generator=g).tolist() for _ in range(2)]
    prompts.append(torch.randint(3, cfg.vocab_size, (7,), generator=g).tolist())  # one prefill bucket
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_LEN - 20, min_new_tokens=MAX_LEN - 20,
                            do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eos = hf.generation_config.eos_token_id
    eos = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    yield cfg, model, ckpt.tokenizer(), prompts, want, eos, hf  # eos: banned for min_new_tokens, on both sides
    torch.set_num_threads(threads)


def runner_for(cfg, model, tmp_path, num_kv_blocks: int = 0, spec: int = 0) -> ModelRunner:
    req = CompileRequest(model="unused", out=tmp_path, backend="eager", dtype="float32", batch_size=BATCH,
                         max_model_len=MAX_LEN, max_prompt_len=CHUNK, prefill_buckets=(CHUNK,),
                         decode_buckets=(MAX_LEN,), block_size=BS, num_kv_blocks=num_kv_blocks,
                         num_speculative_tokens=spec)
    cache, buckets = plan_buckets(cfg, req)
    return ModelRunner(EagerExecutor(model, cache), buckets, cache, cfg.vocab_size)


def run(engine: Engine, prompts, max_tokens: int, stagger: int = 3) -> list[list[int]]:
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    pending = list(range(len(prompts)))
    for step in range(2000):
        while pending and step >= stagger * (len(prompts) - len(pending)):
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params, lambda o, i=i: got[i].extend(o.new_token_ids))
        if not engine.step() and engine.num_unfinished == 0 and not pending:
            break
    blocks = engine.scheduler.blocks
    assert isinstance(blocks, WindowedBlockManager)
    assert engine.num_unfinished == 0 and engine.kv_usage == 0
    assert blocks.window.num_free_blocks == blocks.window.num_blocks - 1  # every window block given back
    return [got[i] for i in range(len(prompts))]


def test_runtime_allocates_what_the_plan_says(setup, tmp_path):
    cfg, model, *_ = setup
    runner = runner_for(cfg, model, tmp_path)
    cache, ex = runner.cache, runner.executor
    assert cache.sliding_window == cfg.sliding_window and MAX_LEN >= 8 * cfg.sliding_window
    allocated = sum(t.numel() * t.element_size() for t in ex.k_caches + ex.v_caches)
    lay = head_layout(cfg, ParallelConfig())
    plan = plan_memory(cfg, lay, get_instance("cpu"), runner.buckets, batch=BATCH, max_model_len=MAX_LEN,
                       dtype="float32", kv_dtype="float32", block_size=BS, window_kv=True)
    assert plan.kv_cache == plan.kv_cache_window == allocated
    full = kv_bytes(cfg, lay, cache.num_blocks, BS, "float32")  # every layer at full length
    assert allocated < full
    L = cfg.num_hidden_layers
    sliding = [i for i in range(L) if cfg.layer_window(i) is not None]
    assert sliding and len(sliding) < L
    for i in range(L):  # the sliding layers' pools are less than half the full layers'
        want = cache.window_num_blocks if i in sliding else cache.num_blocks
        assert ex.k_caches[i].shape[0] == ex.v_caches[i].shape[0] == want
    assert 2 * cache.window_num_blocks < cache.num_blocks
    text = format_plan(cfg, ParallelConfig(), cache, runner.buckets, "eager", "float32")
    assert "window-sized KV" in text and "KV if sliding layers held windows" not in text


def test_greedy_matches_hf_past_the_window(setup, tmp_path):
    cfg, model, tok, prompts, want, eos, _ = setup
    n = MAX_LEN - 20
    for caching, chunked in [(True, True), (False, True)]:
        engine = Engine(runner_for(cfg, model, tmp_path), tok, eos, max_num_batched_tokens=CHUNK,
                        enable_prefix_caching=caching, enable_chunked_prefill=chunked)
        assert run(engine, prompts, n) == want
        if caching:  # the second prompt took the shared prefix's blocks from both groups
            assert engine.prefix_cache_stats.hits >= 8
        assert engine.stats.prefills > len(prompts)  # prompts ran in chunks
    # the reference loop's KV slot: a ring of window blocks
    runner = runner_for(cfg, model, tmp_path)
    out = generate_ids(runner, tok, prompts[2], SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0), eos)
    assert out.token_ids == want[2]


def test_preemption_and_speculation_stay_exact(setup, tmp_path):
    cfg, model, tok, prompts, want, eos, _ = setup
    n = MAX_LEN - 20
    runner = runner_for(cfg, model, tmp_path, num_kv_blocks=MAX_LEN // BS + 1)  # one sequence's blocks
    engine = Engine(runner, tok, eos, max_num_batched_tokens=CHUNK)
    assert run(engine, prompts, n, stagger=1) == want
    assert engine.stats.preemptions > 0
    spec = SpeculativeConfig(num_speculative_tokens=2, adaptive=False)
    engine = Engine(runner_for(cfg, model, tmp_path, spec=2), tok, eos, max_num_batched_tokens=CHUNK,
                    speculative=spec)
    # k positions short of max_model_len: a verify row there would reach past the largest decode bucket
    assert run(engine, prompts, n - 2) == [w[:n - 2] for w in want]
    assert engine.speculation is not None and engine.speculation.stats.accepted_tokens > 0
    # the target as its own draft model: the draft's KV slots are rings of window blocks (it proposes for the
    # prompt one prefill call reaches, past the window)
    spec = SpeculativeConfig(num_speculative_tokens=2, method="draft_model", model="the target", adaptive=False)
    engine = Engine(runner_for(cfg, model, tmp_path, spec=2), tok, eos, max_num_batched_tokens=CHUNK,
                    speculative=spec, draft=runner_for(cfg, model, tmp_path))
    assert run(engine, prompts, n - 2) == [w[:n - 2] for w in want]
    assert engine.speculation.stats.accepted_tokens >= n - 2 - 10


@pytest.mark.parametrize("corrupt", [False, True])
def test_an_evicted_prefix_comes_back_from_the_kv_tier_in_both_groups(setup, tmp_path, corrupt):
    """The KV tier under window-sized KV: a first turn, then three other prompts that evict its blocks from both
    pools (the full pool holds one sequence), then the second turn (the first turn's prompt and reply and 4 more
    tokens): HF's greedy tokens. Its first turn's 6 full-layer blocks and the 2 window-layer blocks its next query
    sees come back from the tier's two groups, not prefilled. `corrupt`: a damaged window-layer entry is detected,
    dropped and never used: the whole prompt is prefilled, with the same tokens."""
    from neuron_opt.runtime.block_manager import hash_block
    from neuron_opt.runtime.kv_tier import WINDOW, KVTier, tier_pools

    cfg, model, tok, prompts, _, eos, hf = setup
    runner = runner_for(cfg, model, tmp_path, num_kv_blocks=MAX_LEN // BS + 1)
    full, window = tier_pools(runner.executor, cfg, runner.cache)
    sliding = [i for i in range(cfg.num_hidden_layers) if cfg.layer_window(i) is not None]
    assert len(window.caches) == 2 * len(sliding) and len(full.caches) == 2 * (cfg.num_hidden_layers - len(sliding))
    assert all(c.shape[0] == runner.cache.window_num_blocks for c in window.caches)
    tier = KVTier(full, 64 * full.block_bytes, window_pools=window)
    engine = Engine(runner, tok, eos, max_num_batched_tokens=CHUNK, kv_tier=tier)
    first = run(engine, [prompts[0]], 8)[0]
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        run(engine, [torch.randint(3, cfg.vocab_size, (20,), generator=g).tolist()], 8)
    turn2 = prompts[0] + first + prompts[1][-4:]
    kept = (len(prompts[0]) + len(first) - 1) // BS  # 6: the first turn's blocks with K/V
    keys = [hash_block(None, turn2[:BS])]
    for i in range(1, kept):
        keys.append(hash_block(keys[-1], turn2[i * BS:(i + 1) * BS]))
    seen = engine.scheduler.blocks.first_visible_block(kept * BS)  # the window blocks the next query sees
    assert kept == 6 and seen < kept and all(tier.holds(k) for k in keys)
    assert all(tier.holds(k, WINDOW) for k in keys[seen:])
    if corrupt:
        entry = tier.entries[b"window:" + keys[-1]]
        for _ in range(1000):  # the background thread hashes entries off the engine thread
            if entry.digest is not None:
                break
            time.sleep(0.01)
        entry.data[5] ^= 1
    tokens, pool_hits, stats = engine.stats.prefill_tokens, engine.prefix_cache_stats.hits, tier.stats
    restored = 0 if corrupt else kept
    with torch.no_grad():
        want = hf.generate(torch.tensor([turn2]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, len(turn2):].tolist()
    assert run(engine, [turn2], 8)[0] == want
    assert engine.prefix_cache_stats.hits == pool_hits  # nothing of it was left in either pool
    assert engine.stats.prefill_tokens - tokens == len(turn2) - restored * BS
    assert stats.hits == restored * BS and stats.corrupt == corrupt
    # copied in: every block of both groups; with the damaged entry, the full group's and the window entry before
    # it (then given back with the sequence's blocks, unused)
    assert stats.restored_ram == kept + (kept - seen) - (1 if corrupt else 0)
    assert tier.num_bytes <= tier.max_bytes


def test_tp_ranks_hold_window_sized_kv(setup, tmp_path):
    """Eager tp 2 (rank processes): the window layers' slot mapping and tables reach the ranks, whose pools are
    window-sized; greedy text past the window equals HF's."""
    from neuron_opt.executors.factory import CheckpointSpec, create_executor

    cfg, model, tok, prompts, want, eos, _ = setup
    if cfg.is_moe:
        pytest.skip("one family is enough: the ranks' code path does not depend on it")
    one = runner_for(cfg, model, tmp_path)
    sd = dict(model.state_dict())  # HF names: the canonical state dict
    ex = create_executor(CheckpointSpec(cfg, sd, ParallelConfig(tp=2), one.cache))
    try:
        engine = Engine(ModelRunner(ex, one.buckets, one.cache, cfg.vocab_size), tok, eos,
                        max_num_batched_tokens=CHUNK)
        assert run(engine, prompts, MAX_LEN - 20) == want
    finally:
        ex.close()

@pytest.mark.slow
def test_cpu_graphs_hold_window_sized_kv(tmp_path):
    """The cpu backend: one layer graph serves both pools (their block count a dynamic dimension); greedy text past
    the window equals HF's, with prefix caching and chunked prefill on. Slow: it compiles the cpu graphs (about
    4 CPU-minutes on 2 cores)."""
    from neuron_opt.api import LLM
    from neuron_opt.compiler import compile_artifact

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ck = make_tiny("gemma2", tmp_path / "ck", tokenizer=True)
        req = CompileRequest(model=str(ck), out=tmp_path / "art", backend="cpu", dtype="float32", batch_size=BATCH,
                             max_model_len=MAX_LEN, max_prompt_len=16, prefill_buckets=(16,),
                             decode_buckets=(MAX_LEN,), block_size=BS, use_cache=False)
        compile_artifact(req, log=lambda s: None, progress=False)
        llm = LLM(tmp_path / "art")
        cache, ex = llm.runner.cache, llm.runner.executor
        assert cache.sliding_window == 6 and cache.window_num_blocks < cache.num_blocks
        assert [k.shape[0] for k in ex.k_caches] == [cache.window_num_blocks, cache.num_blocks]  # sliding, full
        hf = load_hf(ck)
        g = torch.Generator().manual_seed(6)
        shared = torch.randint(3, hf.config.vocab_size, (14,), generator=g).tolist()
        prompts = [shared + torch.randint(3, hf.config.vocab_size, (6,), generator=g).tolist() for _ in range(2)]
        with torch.no_grad():
            want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_LEN - 20, min_new_tokens=MAX_LEN - 20,
                                do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        eos = hf.generation_config.eos_token_id
        engine = Engine(llm.runner, llm.tokenizer, (eos,) if isinstance(eos, int) else tuple(eos or ()),
                        max_num_batched_tokens=CHUNK)
        assert run(engine, prompts, MAX_LEN - 20) == want
        assert engine.prefix_cache_stats.hits >= 8
    finally:
        torch.set_num_threads(threads)


def test_default_compile_caps_the_prefill_chunk_at_the_window(tmp_path):
    """Default compile flags: a windowed model's largest prefill bucket is its window, at least 128 tokens (here 128,
    under max_model_len 1024), so its sliding layers hold window-sized KV (the plan's figure is the allocation); a
    prompt longer than that runs through `LLM` in chunks of it and generates HF's greedy text. An explicit
    --max-prompt-len wins."""
    from neuron_opt.api import LLM
    from neuron_opt.compiler import compile_artifact

    ck = make_tiny("gemma2", tmp_path / "ck", tokenizer=True)
    logged: list[str] = []
    compile_artifact(CompileRequest(model=str(ck), out=tmp_path / "art", backend="eager", dtype="float32"),
                     log=logged.append, progress=False)
    assert "a prefill chunk of up to 128 tokens (compile's default chunk for sliding windows" in logged[0]
    llm = LLM(tmp_path / "art")
    cache, buckets, ex = llm.runner.cache, llm.runner.buckets, llm.runner.executor
    cfg = llm.config
    assert cache.max_model_len == 1024 and buckets.prefill_lens[-1] == 128 and buckets.offset_prefill
    assert cache.sliding_window == 6 and 4 * cache.window_num_blocks < cache.num_blocks
    assert [k.shape[0] for k in ex.k_caches] == [cache.window_num_blocks, cache.num_blocks]  # sliding, full
    allocated = sum(t.numel() * t.element_size() for t in ex.k_caches + ex.v_caches)
    lay = head_layout(cfg, ParallelConfig())
    plan = plan_memory(cfg, lay, get_instance("cpu"), buckets, batch=cache.max_batch, max_model_len=1024,
                       dtype="float32", kv_dtype="float32", block_size=cache.block_size, window_kv=True)
    assert plan.kv_cache == allocated < kv_bytes(cfg, lay, cache.num_blocks, cache.block_size, "float32")
    hf = load_hf(ck)
    prompt = torch.randint(3, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    got = llm.generate_ids(prompt, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0))
    assert got.token_ids == want
    explicit, _ = plan_buckets(cfg, CompileRequest(model="unused", out=tmp_path, backend="eager", max_prompt_len=1024))
    assert explicit.sliding_window == 0  # chunks of 1024: the sliding layers would see every position


def test_lora_adapters_on_window_pools_equal_peft(tmp_path):
    """LoRA on a sliding-window model (Gemma 2): an artifact compiled with adapters and window-sized KV serves a batch
    of an adapter's row and a base row of one prompt, in chunks, text past the window; the oracle is PEFT on HF."""
    peft = pytest.importorskip("peft")
    from peft_adapters import hf_greedy, make_adapter

    from neuron_opt.api import LLM
    from neuron_opt.compiler import compile_artifact
    from neuron_opt.lora.config import LoraConfig
    from neuron_opt.lora.registry import LoRARequest

    ck = make_tiny("gemma2", tmp_path / "ck", tokenizer=True)
    adapter = make_adapter(ck, tmp_path / "adapter", 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], 1)
    compile_artifact(CompileRequest(model=str(ck), out=tmp_path / "art", backend="eager", dtype="float32",
                                    batch_size=BATCH, max_model_len=MAX_LEN, max_prompt_len=CHUNK,
                                    prefill_buckets=(CHUNK,), decode_buckets=(MAX_LEN,), block_size=BS,
                                    lora=LoraConfig(max_loras=1, max_lora_rank=4)), log=lambda s: None, progress=False)
    llm = LLM(tmp_path / "art")
    assert llm.runner.cache.window_num_blocks < llm.runner.cache.num_blocks  # the sliding layers hold windows
    prompt = torch.randint(3, 257, (14,), generator=torch.Generator().manual_seed(8)).tolist()
    n = 24  # to position 38: past the window, through window blocks freed and reused
    want = [hf_greedy(peft.PeftModel.from_pretrained(load_hf(ck), adapter).eval(), prompt, n),
            hf_greedy(load_hf(ck), prompt, n)]
    assert want[0] != want[1]  # the adapter changes the text: the test can fail
    outs = llm.generate_batch([prompt, prompt], SamplingParams(max_tokens=n, ignore_eos=True),
                              lora_request=[LoRARequest("a", str(adapter)), None])
    assert [o.token_ids for o in outs] == want
