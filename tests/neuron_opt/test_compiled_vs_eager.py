"""Compiled (cpu backend, fp32) vs eager through the whole artifact path: identical greedy tokens for prompt lengths
at, one below and one above every prefill bucket, decode crossing every KV bucket and positions past 512."""

from __future__ import annotations

import pytest
import torch
from helpers import eager_runner

from neuron_opt.api import LLM
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.errors import BucketOverflowError, ContextLengthError
from neuron_opt.runtime.generate import generate_ids
from neuron_opt.runtime.sampling import SamplingParams

# a cold cpu compile of its own (~150 s on 2 cores) and its checks: make test-slow
pytestmark = pytest.mark.slow

PREFILL = (16, 32, 64)
DECODE = (32, 128, 512, 1024)
MAX_LEN = 1024


@pytest.fixture(scope="module")
def runners(tiny_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny graphs: thread barriers cost more than they save
    ck = tiny_dir("smollm-tok")
    out = tmp_path_factory.mktemp("cmp") / "art"
    req = CompileRequest(model=str(ck), out=out, backend="cpu", dtype="float32", max_model_len=MAX_LEN,
                         prefill_buckets=PREFILL, decode_buckets=DECODE, cache_dir=out.parent / "cache")
    compile_artifact(req, log=lambda s: None, progress=False)
    llm = LLM(out)
    yield llm, eager_runner(ck, max_model_len=MAX_LEN, prefill_lens=PREFILL, decode_kv_lens=DECODE), req
    torch.set_num_threads(threads)


def _prompt(n: int) -> list[int]:
    return torch.randint(5, 49000, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.mark.parametrize("n", sorted({s + d for s in PREFILL for d in (-1, 0, 1)} - {PREFILL[-1] + 1}))
def test_prompt_lengths_around_every_prefill_bucket(runners, n):
    llm, ref, _ = runners
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # 40 tokens: crosses the 32 and 128 KV buckets
    got = llm.generate_ids(_prompt(n), params).token_ids
    assert got == generate_ids(ref, llm.tokenizer, _prompt(n), params, ()).token_ids


@pytest.mark.parametrize("n", [3, 37, 47])
def test_prompt_lengths_between_the_buckets_run_at_their_length_and_equal_eager(runners, n):
    """The cpu executor runs prefills at the prompt's length rounded up to its granularity (37 and 47 tokens: 48,
    not the 64 bucket); the eager reference pads to the compiled buckets: the tokens must not differ."""
    llm, ref, _ = runners
    runner = llm.runner
    g = runner.prefill_granularity
    assert g == 16 and ref.prefill_granularity == 0
    runner.prefill(0, _prompt(n))
    assert runner.last_bucket.tokens == max(2, -(-n // g) * g) and (n < 33 or runner.last_bucket.tokens < 64)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = llm.generate_ids(_prompt(n), params).token_ids
    assert got == generate_ids(ref, llm.tokenizer, _prompt(n), params, ()).token_ids


def test_positions_past_512_cross_every_decode_bucket(runners):
    llm, ref, _ = runners
    params = SamplingParams(max_tokens=560, ignore_eos=True)
    got = llm.generate_ids(_prompt(60), params)
    want = generate_ids(ref, llm.tokenizer, _prompt(60), params, ())
    assert got.token_ids == want.token_ids and len(got.token_ids) == 560
    assert llm.runner.last_bucket.kv_len == 1024  # the last step attended over the 1024 bucket


def test_one_above_the_largest_bucket_runs_in_two_chunks(runners, tiny_dir):
    """The artifact has offset prefill buckets: `LLM` runs a prompt beyond the largest prefill bucket as chunks of
    that bucket (64 + 1 tokens); oracle: eager with a bucket that holds it whole. One runner call cannot."""
    llm, _, _ = runners
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    whole = eager_runner(tiny_dir("smollm-tok"), max_model_len=MAX_LEN, prefill_lens=(*PREFILL, 128),
                         decode_kv_lens=DECODE)
    assert llm.generate_ids(_prompt(65), params).token_ids == generate_ids(whole, llm.tokenizer, _prompt(65), params,
                                                                           ()).token_ids
    with pytest.raises(ContextLengthError, match=f"maximum context length is {MAX_LEN} tokens"):
        llm.generate_ids(_prompt(MAX_LEN + 1), SamplingParams(max_tokens=4))
    with pytest.raises(BucketOverflowError, match="--max-prompt-len"):
        llm.runner.prefill(0, _prompt(65))


def test_recompile_with_one_bucket_added_compiles_only_that_bucket(runners, tmp_path):
    import dataclasses

    _, _, req = runners
    req2 = dataclasses.replace(req, out=tmp_path / "art2", decode_buckets=(*DECODE[:-1], 768, DECODE[-1]))
    report = compile_artifact(req2, log=lambda s: None, progress=False)
    old = {b.key for b in compile_artifact(req, log=lambda s: None, progress=False).manifest.buckets.buckets()}
    new = {b.key for b in report.manifest.buckets.buckets()} - old
    # the decode bucket, and the offset prefill buckets over it (every prefill length over KV 768)
    assert new == {"decode_b1_s768"} | {f"prefill_b1_q{s}_s768" for s in PREFILL}
    assert report.misses == {f"{k}/rank0": "new bucket (never compiled with any settings)" for k in new}
    assert len(report.hits) == len(old)
    graphs = report.manifest.graphs  # the offset buckets run the prefill graph: nothing new was compiled for them
    assert all(graphs[f"prefill_b1_q{s}_s768"] == graphs["prefill_b1_s16"] for s in PREFILL)
    again = compile_artifact(dataclasses.replace(req2, out=tmp_path / "art3"), log=lambda s: None, progress=False)
    assert not again.misses and len(again.hits) == len(old) + len(new)


def test_the_kv_tier_restores_an_evicted_prefix_over_the_cpu_pools(runners):
    """The second KV tier over the cpu executor's pools: a conversation's second turn, after a long prompt took
    every block of the pool (33 of 32 positions) and evicted the first turn's, gets the same tokens as without the
    tier, and the first turn's 3 full blocks come back from the tier instead of being prefilled."""
    from helpers import NoTok

    from neuron_opt.runtime.engine import Engine
    from neuron_opt.runtime.kv_tier import HostBlocks, KVTier

    llm, _, _ = runners
    runner, ex = llm.runner, llm.runner.executor
    sp = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)

    def serve(engine: Engine, prompt: list[int]) -> list[int]:
        got: list[int] = []
        engine.add_request(str(len(prompt)), prompt, sp, lambda o: got.extend(o.new_token_ids))
        while engine.step():
            pass
        return got

    def conversation(tier: KVTier | None) -> tuple[list[int], int, int]:
        engine = Engine(runner, NoTok(), (), max_num_batched_tokens=256, kv_tier=tier)
        first = serve(engine, _prompt(100))
        serve(engine, _prompt(1000))  # 32 blocks: the whole pool
        turn2 = _prompt(100) + first + _prompt(20)
        before = engine.stats.prefill_tokens
        return serve(engine, turn2), engine.stats.prefill_tokens - before, len(turn2)

    one = KVTier(HostBlocks(ex.k_caches, ex.v_caches), 1 << 30).block_bytes
    tier = KVTier(HostBlocks(ex.k_caches, ex.v_caches), 40 * one)
    with_tier, without = conversation(tier), conversation(None)
    assert with_tier[0] == without[0]
    assert without[1] == without[2] and with_tier[1] == with_tier[2] - 3 * 32
    assert tier.stats.hits == 3 * 32 and tier.num_bytes <= tier.max_bytes
