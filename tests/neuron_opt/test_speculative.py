"""Speculative decoding (prompt lookup): the verify step, the proposer, exactness and the serving engine.

Oracles: sequential decode steps of the same runner (verify logits), the non-speculative reference loop
(`LLM.generate_ids`: greedy output must be identical token for token), and the target distribution itself
(rejection sampling must preserve it: a chi-square test at a stated significance level).
"""

from __future__ import annotations

import math

import pytest
import torch

from neuron_opt.api import LLM
from neuron_opt.buckets import VERIFY, Bucket, BucketConfig
from neuron_opt.errors import BucketOverflowError, ConfigError
from neuron_opt.runtime.engine import Engine, RequestOutput
from neuron_opt.runtime.runner import DecodeRow, VerifyRow
from neuron_opt.runtime.sampling import SamplerState, SamplingParams
from neuron_opt.runtime.speculative import NgramProposer, SpecController, SpeculativeConfig, accept

K = 3


@pytest.fixture(scope="module")
def llms(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tiny_dir("smollm-tok")
    yield (LLM(path, batch_size=4, max_model_len=128, num_speculative_tokens=K),
           LLM(path, batch_size=1, max_model_len=128))
    torch.set_num_threads(threads)


# ---- buckets and the proposer ---------------------------------------------------------------------------

def test_verify_buckets_mirror_the_decode_buckets_and_round_trip_their_keys():
    cfg = BucketConfig.build(max_prompt_len=64, max_model_len=256, max_batch=2, min_decode=128,
                             num_speculative_tokens=4)
    ver = [b for b in cfg.buckets() if b.phase == VERIFY]
    assert [(b.batch, b.kv_len, b.q_len) for b in ver] == [(1, 128, 5), (1, 256, 5), (2, 128, 5), (2, 256, 5)]
    assert all(Bucket.from_key(b.key) == b and b.tokens == 5 for b in ver)
    assert BucketConfig.from_dict(cfg.to_dict()) == cfg and cfg.num_speculative_tokens == 4
    assert not [b for b in BucketConfig.build(max_prompt_len=64, max_model_len=256, max_batch=2).buckets()
                if b.phase == VERIFY]
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        BucketConfig.build(max_prompt_len=64, max_model_len=256, max_batch=2, num_speculative_tokens=-1)


def test_ngram_proposer_continues_the_most_recent_earlier_match():
    prop = NgramProposer(prompt_lookup_max=3, prompt_lookup_min=2)
    #          0  1  2  3  4  5  6  7  8  9
    ids = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]
    # suffix (6, 7) occurs at 1 and 6: the most recent (6) is continued -> 1, 2, 6
    assert prop.propose(ids, 3) == [1, 2, 6]
    assert prop.propose(ids, 1) == [1]
    # the longest n first: suffix (5, 6, 7) of [..., 5, 6, 7] matches at 0 -> 8, 9, 5
    assert prop.propose([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert prop.propose([1, 2, 3, 4], 3) == []  # no repeat
    assert prop.propose([4, 4], 3) == []  # below prompt_lookup_min
    assert NgramProposer(2, 1).propose([4, 4], 3) == [4]  # a match right before the suffix: what follows it


def test_bad_speculative_settings_are_refused_with_the_field():
    with pytest.raises(ConfigError, match="num_speculative_tokens") as e:
        SpeculativeConfig(num_speculative_tokens=0)
    assert e.value.param == "num_speculative_tokens"
    with pytest.raises(ConfigError, match="speculative_method"):
        SpeculativeConfig(num_speculative_tokens=2, method="eagle")
    with pytest.raises(ConfigError, match="prompt_lookup"):
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2)


# ---- the verify step ------------------------------------------------------------------------------------

def test_verify_logits_equal_sequential_decode_logits(llms):
    llm, _ = llms
    runner = llm.runner
    seq = [1, 17, 42, 99, 5, 123, 7, 300, 301, 302, 303]
    # reference: prefill 7 tokens into slot 0, then decode tokens 7..10 one at a time
    ref = [runner.prefill(0, seq[:7])]
    ref += [runner.decode([DecodeRow(0, seq[i], i)])[0] for i in range(7, 10)]
    # verify: prefill 6 tokens into slot 1, then score tokens 6..9 in one call (and a shorter row in slot 2)
    runner.prefill(1, seq[:6])
    runner.prefill(2, seq[:6])
    got = runner.verify([VerifyRow(1, tuple(seq[6:10]), 6), VerifyRow(2, (seq[6],), 6)])
    assert got.shape == (2, K + 1, llm.config.vocab_size)
    for j in range(4):
        torch.testing.assert_close(got[0, j], ref[j], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1, 0], ref[0], atol=1e-4, rtol=0)


def test_verify_without_verify_graphs_says_how_to_get_them(llms):
    _, ref = llms
    with pytest.raises(BucketOverflowError, match="--num-speculative-tokens"):
        ref.runner.verify([VerifyRow(0, (1, 2), 3)])
    with pytest.raises(ConfigError, match="compile with --num-speculative-tokens") as e:
        Engine(ref.runner, ref.tokenizer, ref.eos_token_ids, speculative=SpeculativeConfig(2))
    assert e.value.param == "num_speculative_tokens"


# ---- exactness --------------------------------------------------------------------------------------------

def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params, outs[rid].append)
    for _ in range(1000):
        if not engine.step() and engine.num_unfinished == 0:
            break
    return outs


def _grounded_prompts(llm: LLM) -> list[list[int]]:
    """Prompts whose continuation repeats text of the prompt (what prompt lookup is for): a random model's greedy
    continuation of a repeated phrase tends to loop, which the proposer then predicts."""
    texts = ["one two three four five one two three four five one two three",
             "abc abc abc abc abc abc abc",
             "The cat sat on the mat. The cat sat on the mat. The cat sat on",
             "Numbers: 1 2 3 4 5 6 7 8 9 1 2 3 4 5 6 7 8 9 1 2 3"]
    return [list(llm.tokenizer(t)["input_ids"]) for t in texts]


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_is_identical_to_non_speculative_greedy(llms, adaptive):
    llm, ref = llms
    prompts = _grounded_prompts(llm)
    params = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=23),
              SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=0.5, logprobs=2),
              SamplingParams(max_tokens=37, ignore_eos=True, min_tokens=5)]
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids,
                    speculative=SpeculativeConfig(K, adaptive=adaptive))
    outs = _run(engine, {str(i): (p, params[i]) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        want = ref.generate_ids(p, params[i])
        got = outs[str(i)]
        assert [t for o in got for t in o.new_token_ids] == want.token_ids, i
        assert "".join(o.text_delta for o in got) == want.text
        assert got[-1].finish_reason == want.finish_reason
        assert [lp.logprob for o in got for lp in o.logprobs] == pytest.approx(want.logprobs, abs=1e-4)
    st = engine.spec_stats
    assert st.verify_steps > 0 and st.accepted_tokens > 0, st  # speculation ran and paid at least once
    assert st.accepted_tokens <= st.draft_tokens and st.mean_accepted_length > 1.0


def test_stop_strings_cut_accepted_tokens(llms):
    llm, ref = llms
    prompt = _grounded_prompts(llm)[0]
    full = ref.generate_ids(prompt, SamplingParams(max_tokens=30, ignore_eos=True)).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    params = SamplingParams(max_tokens=30, stop=(stop,), ignore_eos=True)
    want = ref.generate_ids(prompt, params)
    out, _ = llm.generate_ids_speculative(prompt, params, SpeculativeConfig(K, adaptive=False))
    assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_rejection_sampling_preserves_the_target_distribution(llms):
    """One verify row of the tiny model, a fixed draft; 20,000 acceptances with different generator seeds. The
    first emitted token must follow the target distribution p (temperature 1.5, top-k 10, as `sample_one` draws):
    chi-square goodness of fit over the 10 tokens, rejected at significance 0.001 (critical value by
    Wilson-Hilferty). The draft is p's 2nd likeliest token, so acceptances and rejections both occur often."""
    llm, _ = llms
    runner = llm.runner
    prompt = _grounded_prompts(llm)[2]
    runner.prefill(3, prompt[:-1])
    logits = runner.verify([VerifyRow(3, (prompt[-1], 11, 12), len(prompt) - 1)])[0]
    params = SamplingParams(temperature=1.5, top_k=10, max_tokens=8)
    top = torch.topk(logits[0], 10).indices.tolist()
    p = torch.softmax(logits[0][top] / 1.5, -1)
    draft = [top[1], 12]
    n, counts = 20_000, torch.zeros(10)
    for i in range(n):
        st = SamplerState(params, torch.Generator().manual_seed(i))
        counts[top.index(accept(logits, draft, st, [(), (), ()])[0].token)] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    df, z = 9, 3.0902  # z of the 0.999 normal quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < critical, (chi2, critical, counts.tolist(), expected.tolist())
    assert 0.02 < counts[1].item() / n < 0.98  # the draft token is neither always nor never taken


def test_sampled_requests_finish_under_speculation_and_are_reproducible(llms):
    llm, _ = llms
    prompts = _grounded_prompts(llm)
    params = SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=5, ignore_eos=True)
    # adaptive=False: the adaptive rule decides verify-or-decode from measured step times, and the two paths draw
    # different numbers of uniforms, so a seeded run repeats exactly only when the decisions do
    spec = SpeculativeConfig(K, adaptive=False)
    outs = [_run(Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec),
                 {str(i): (p, params) for i, p in enumerate(prompts)}) for _ in range(2)]
    for i in range(len(prompts)):
        a, b = ([t for o in run[str(i)] for t in o.new_token_ids] for run in outs)
        assert len(a) == 20 and a == b


def test_controller_verifies_only_when_the_expected_tokens_beat_the_cost():
    c = SpecController(num_speculative_tokens=4)
    assert not c.should_verify({"a": []}, 1)
    assert c.should_verify({"a": [1, 2, 3, 4]}, 1)  # no measurements yet: cost ratio 1
    c.observe_step("decode", 1, 0.010)
    c.observe_step("verify", 1, 0.030)  # a verify costs 3 decodes
    for _ in range(30):
        c.observe_acceptance("a", 0, 4)  # never accepted: E -> 1 token per verify
    assert not c.should_verify({"a": [1, 2, 3, 4]}, 1)
    for _ in range(30):
        c.observe_acceptance("b", 4, 4)  # always accepted: E -> 5 tokens per verify
    assert c.should_verify({"b": [1, 2, 3, 4]}, 1)
    assert c.expected_tokens("b", 4) == pytest.approx(5, rel=0.05)


def test_cpu_compiled_verify_graphs_match_eager_and_keep_greedy_exact(tiny_dir, tmp_path, llms):
    """The cpu backend's verify graphs (a layer graph over q = k + 1 tokens, a head over B * q rows): logits
    equal the eager verify step's, and speculative greedy through the artifact equals eager greedy."""
    from neuron_opt.compiler import CompileRequest, compile_artifact, distinct_graphs

    llm, ref = llms
    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / "art", backend="cpu", dtype="float32",
                         batch_size=1, max_model_len=128, prefill_buckets=(16, 64), decode_buckets=(32, 128),
                         cache_dir=tmp_path / "cache", num_speculative_tokens=K)
    report = compile_artifact(req, log=lambda s: None, progress=False)
    buckets = report.manifest.buckets
    assert buckets.num_speculative_tokens == K and "verify_b1_q4_s128" in report.manifest.graphs
    # graphs compiled: layers prefill, decode, verify (batch 1); heads for 1 and 4 rows
    assert distinct_graphs(buckets, "cpu") == 5
    compiled = LLM(tmp_path / "art")
    seq = [1, 17, 42, 99, 5, 123, 7, 300, 301, 302, 303]
    for runner in (compiled.runner, llm.runner):
        runner.prefill(0, seq[:6])
    rows = [VerifyRow(0, tuple(seq[6:10]), 6)]
    torch.testing.assert_close(compiled.runner.verify(rows), llm.runner.verify(rows), atol=1e-4, rtol=0)
    prompt = _grounded_prompts(llm)[1]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    out, stats = compiled.generate_ids_speculative(prompt, params, SpeculativeConfig(K, adaptive=False))
    assert out.token_ids == ref.generate_ids(prompt, params).token_ids and stats.accepted_tokens > 0
    with pytest.raises(ConfigError, match="num_speculative_tokens=3"):
        LLM(tmp_path / "art", num_speculative_tokens=2)


def test_tp2_rank_processes_verify_like_one_rank(tiny_dir):
    """Verify steps through real TP ranks (the logits of every position gathered over the vocab-parallel head)."""
    from neuron_opt.config import ParallelConfig

    d = tiny_dir("smollm-tok")
    tp = LLM(d, max_model_len=64, num_speculative_tokens=K, parallel=ParallelConfig(tp=2))
    one = LLM(d, max_model_len=64, num_speculative_tokens=K)
    try:
        seq = [1, 17, 42, 99, 5, 123, 7, 300, 301, 302]
        for r in (tp.runner, one.runner):
            r.prefill(0, seq[:6])
        rows = [VerifyRow(0, tuple(seq[6:10]), 6)]
        torch.testing.assert_close(tp.runner.verify(rows), one.runner.verify(rows), atol=1e-4, rtol=0)
        prompt = [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        out, stats = tp.generate_ids_speculative(prompt, params, SpeculativeConfig(K, adaptive=False))
        assert out.token_ids == one.generate_ids(prompt, params).token_ids and stats.verify_steps > 0
    finally:
        tp.runner.executor.close()


def test_server_streams_speculative_output_and_reports_it_in_metrics(llms):
    """The OpenAI surface is unchanged: streamed chat through a speculating engine equals non-speculative greedy;
    /metrics carries the spec_decode counters."""
    import httpx
    import openai
    from helpers import live_server

    llm, ref = llms
    messages = [{"role": "user", "content": "one two three four five one two three four five one two three"}]
    want = ref.generate_ids(ref.encode_chat(messages), SamplingParams(max_tokens=24)).text
    with live_server(llm, max_num_seqs=4, speculative=SpeculativeConfig(K, adaptive=False)) as (url, engine):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        metrics = httpx.get(url + "/metrics").text
    assert text == want
    st = engine.spec_stats
    assert st.verify_steps > 0
    assert f'neuron_opt:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {float(st.draft_tokens)}' in metrics
    assert f'neuron_opt:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(st.accepted_tokens)}' \
        in metrics
    assert "neuron_opt:spec_decode_mean_accepted_length" in metrics
