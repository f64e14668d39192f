"""Speculative decoding (prompt lookup and a draft model): the verify step, the proposers, exactness and the
serving engine.

Oracles: sequential decode steps of the same runner (verify logits), the non-speculative reference loop
(runtime/generate.py via `helpers.reference_generate`: greedy output must be identical token for token), and the
target distribution itself (rejection sampling must preserve it: a chi-square test at a stated significance
level); for the draft model's proposals, the draft's own non-speculative greedy continuation.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_outputs_match_reference, reference_generate, run_engine

from neuron_opt.api import LLM
from neuron_opt.backends.cpu.backend import onednn_bf16_supported
from neuron_opt.buckets import VERIFY, Bucket, BucketConfig
from neuron_opt.errors import BucketOverflowError, ConfigError
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.runner import DecodeRow, VerifyRow
from neuron_opt.runtime.sampling import SamplerState, SamplingParams
from neuron_opt.runtime.speculative import (
    DraftModelProposer,
    NgramProposer,
    SpecController,
    SpeculativeConfig,
    accept,
)

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
    outs = run_engine(engine, {str(i): (p, params[i]) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        want = reference_generate(ref, p, params[i])
        got = outs[str(i)]
        assert [t for o in got for t in o.new_token_ids] == want.token_ids, i
        assert "".join(o.text_delta for o in got) == want.text
        assert got[-1].finish_reason == want.finish_reason
        assert [lp.logprob for o in got for lp in o.logprobs] == pytest.approx(want.logprobs, abs=1e-4)
    st = engine.spec_stats
    assert st.verify_steps > 0 and st.accepted_tokens > 0, st  # speculation ran and paid at least once
    assert st.accepted_tokens <= st.draft_tokens and st.mean_accepted_length > 1.0


def test_llm_batched_speculative_generation_equals_the_reference(llms):
    """`LLM.generate_batch(..., speculative=)`: the prompts batched through one speculating engine, each output
    the non-speculative reference's, with proposals verified."""
    llm, ref = llms
    prompts = _grounded_prompts(llm)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = llm.generate_batch(prompts, params, speculative=SpeculativeConfig(K, adaptive=False))
    assert [g.token_ids for g in got] == [reference_generate(ref, p, params).token_ids for p in prompts]
    _, stats = llm.generate_ids_speculative(prompts[0], params, SpeculativeConfig(K, adaptive=False))
    assert stats.verify_steps > 0


def test_stop_strings_cut_accepted_tokens(llms):
    llm, ref = llms
    prompt = _grounded_prompts(llm)[0]
    full = reference_generate(ref, prompt, SamplingParams(max_tokens=30, ignore_eos=True)).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    params = SamplingParams(max_tokens=30, stop=(stop,), ignore_eos=True)
    want = reference_generate(ref, prompt, params)
    out, _ = llm.generate_ids_speculative(prompt, params, SpeculativeConfig(K, adaptive=False))
    assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_rejection_sampling_preserves_the_target_distribution(llms):
    """One verify row of the tiny model, a fixed draft; 20,000 acceptances with different generator seeds. The
    first emitted token must follow the target distribution p (temperature 1.5, top-k 10, as `sample_one` draws):
    chi-square goodness of fit over the 10 tokens, rejected at significance 0.001 (critical value by
    Wilson-Hilferty). The draft is p's 2nd likeliest token, so acceptances and rejections both occur often. The
    logits are cut to the 256 largest of the first position (top-k 10 sees the same 10 tokens; each draw then
    costs a softmax over 256 entries, not 49152)."""
    llm, _ = llms
    runner = llm.runner
    prompt = _grounded_prompts(llm)[2]
    runner.prefill(3, prompt[:-1])
    full = runner.verify([VerifyRow(3, (prompt[-1], 11, 12), len(prompt) - 1)])[0]
    logits = full[:, torch.topk(full[0], 256).indices]
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
    outs = [run_engine(Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec),
                 {str(i): (p, params) for i, p in enumerate(prompts)}) for _ in range(2)]
    for i in range(len(prompts)):
        a, b = ([t for o in run[str(i)] for t in o.new_token_ids] for run in outs)
        assert len(a) == 20 and a == b


def test_controller_verifies_only_when_the_expected_tokens_beat_the_cost():
    c = SpecController(num_speculative_tokens=4, explore_every=8)
    assert not c.should_verify({"a": 0}, 1)
    assert c.should_verify({"a": 4}, 1)  # nothing measured: a verify step first
    c.observe_step("verify", 1, 0.030)  # a verify costs 3 decodes
    assert not c.should_verify({"a": 4}, 1)  # then a plain step, to measure that phase too
    c.observe_step("decode", 1, 0.010)
    for _ in range(30):
        c.observe_acceptance("a", 0, 4)  # never accepted: E -> 1 token per verify
    # plain steps, except that the 8th verifies again (the acceptance may have changed), then the 16th after it
    assert [c.should_verify({"a": 4}, 1) for _ in range(24)] == [False] * 7 + [True] + [False] * 15 + [True]
    for _ in range(30):
        c.observe_acceptance("b", 4, 4)  # always accepted: E -> 5 tokens per verify
    assert all(c.should_verify({"b": 4}, 1) for _ in range(10))
    assert c.expected_tokens("b", 4) == pytest.approx(5, rel=0.05)


@pytest.mark.slow  # ~60 s of cold cpu compile (make test-slow)
def test_cpu_compiled_verify_graphs_match_eager_and_keep_greedy_exact(tiny_dir, tmp_path, llms, capsys):
    """The cpu backend's verify graphs (a layer graph over q = k + 1 tokens, a head over B * q rows): logits
    equal the eager verify step's, and speculative greedy through the artifact equals eager greedy, with prompt
    lookup and with the draft model compiled alongside (`compile --speculative-model`)."""
    import dataclasses
    import json

    from neuron_opt.artifact import read_manifest
    from neuron_opt.cli import main
    from neuron_opt.compiler import CompileRequest, compile_artifact, distinct_graphs

    llm, ref = llms
    # the target drafts for itself here: the draft's graphs are the target's prefill and decode graphs, so they
    # come from the compile cache (a 1-layer draft of other weights is tested eagerly below)
    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / "art", backend="cpu", dtype="float32",
                         batch_size=1, max_model_len=128, prefill_buckets=(16, 64), decode_buckets=(32, 128),
                         cache_dir=tmp_path / "cache", num_speculative_tokens=K,
                         speculative_model=str(tiny_dir("smollm-tok")))
    with pytest.raises(ConfigError, match="add --num-speculative-tokens K"):
        compile_artifact(dataclasses.replace(req, num_speculative_tokens=0), log=lambda s: None, progress=False)
    assert not (tmp_path / "art").exists()
    report = compile_artifact(req, log=lambda s: None, progress=False)
    buckets = report.manifest.buckets
    assert buckets.num_speculative_tokens == K and "verify_b1_q4_s128" in report.manifest.graphs
    drafted = read_manifest(tmp_path / "art" / "draft")  # its own artifact, hashed into the target's too
    assert report.manifest.draft == "draft" and "draft/manifest.json" in read_manifest(tmp_path / "art").files
    assert (drafted.cache.max_model_len, drafted.buckets.prefill_lens, drafted.buckets.verify_len) == (128, (16, 64), 0)
    assert {h.split("/")[0] for h in report.hits} == {"draft"}
    assert not any(m.startswith("draft/") for m in report.misses)
    prompt_text = "abc abc abc abc abc abc"
    cli = ["generate", str(tmp_path / "art"), "--prompt", prompt_text, "--max-new-tokens", "20", "--temperature",
           "0", "--json"]
    assert main(cli + ["--speculative-method", "draft_model"]) == 0
    doc = json.loads(capsys.readouterr().out)
    plain = reference_generate(ref, list(ref.tokenizer(prompt_text)["input_ids"]), SamplingParams(max_tokens=20))
    assert doc["token_ids"] == plain.token_ids and doc["speculative"]["verify_steps"] > 0
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
    assert out.token_ids == reference_generate(ref, prompt, params).token_ids and stats.accepted_tokens > 0
    with pytest.raises(ConfigError, match="num_speculative_tokens=3"):
        LLM(tmp_path / "art", num_speculative_tokens=2)


@pytest.mark.skipif(not onednn_bf16_supported(), reason="bf16 cpu graphs need oneDNN bf16 (AVX-512 BW/VL/DQ or "
                    "AVX-NE-CONVERT); the cpu backend refuses bf16 on this CPU")
@pytest.mark.slow  # ~70 s of bf16 compiles; fp32 verify graphs against eager stay in the default suite
def test_bf16_exact_verify_rows_are_bitwise_the_decode_steps_logits(tiny_dir, tmp_path):
    """bf16 (the cpu backend's exact_verify, on by default): a verify row runs the decode step's computation (its
    GEMM kernel, its attention loop, its fp32-logits template head: the same rows at 1 and k + 1), so its logits are
    bitwise those of sequential decode steps (and fp32, not widened bf16), and speculative greedy is token for token
    plain greedy on the same artifact. With exact_verify=off the verify graph is the cheaper batched one (SDPA,
    oneDNN GEMMs) and the logits only come close."""
    import dataclasses

    from neuron_opt.compiler import CompileRequest, compile_artifact

    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / "exact", backend="cpu",
                         dtype="bfloat16", batch_size=1, max_model_len=128, prefill_buckets=(16, 64),
                         decode_buckets=(128,), cache_dir=tmp_path / "cache", num_speculative_tokens=K)
    compile_artifact(req, log=lambda s: None, progress=False)
    compile_artifact(dataclasses.replace(req, out=tmp_path / "batched", backend_options={"exact_verify": "off"}),
                     log=lambda s: None, progress=False)
    seq = [1, 17, 42, 99, 5, 123, 7, 300, 301, 302, 303]
    for name, exact in (("exact", True), ("batched", False)):
        runner = LLM(tmp_path / name).runner
        runner.prefill((1,), seq[:6])
        ref = [runner.decode([DecodeRow((1,), seq[i], i)])[0] for i in range(6, 10)]
        runner.prefill((2,), seq[:6])  # the same prefix again, in another block: the verify writes its own K/V
        got = runner.verify([VerifyRow((2,), tuple(seq[6:10]), 6)])[0]
        for j in range(K + 1):
            if exact:
                assert torch.equal(got[j], ref[j]), f"row {j}: {(got[j] - ref[j]).abs().max()}"
                assert not torch.equal(ref[j], ref[j].bfloat16().float())  # fp32 logits, not widened bf16
            else:
                torch.testing.assert_close(got[j], ref[j], atol=0.25, rtol=0)
    compiled = LLM(tmp_path / "exact")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in _grounded_prompts(compiled):
        out, stats = compiled.generate_ids_speculative(prompt, params, SpeculativeConfig(K, adaptive=False))
        assert out.token_ids == reference_generate(compiled, prompt, params).token_ids
        assert stats.accepted_tokens > 0


@pytest.mark.slow  # ~60 s; the operator's row independence is tested bitwise in test_cpu_ops.py
@pytest.mark.skipif(not onednn_bf16_supported(), reason="bf16 cpu graphs need oneDNN bf16 (AVX-512 BW/VL/DQ or "
                    "AVX-NE-CONVERT); the cpu backend refuses bf16 on this CPU")
def test_bf16_exact_verify_on_the_linear_operator_is_bitwise_the_decode_steps_logits(tiny_dir, tmp_path):
    """bf16 with one_row_gemm=kernel and head_gemm=kernel: the batch-1 decode and verify layers' GEMMs and every
    head run on cpu_ops' bf16_linear, whose rows do not depend on the rows beside them, so a verify row's logits are
    bitwise the decode step's (and fp32 sums, not widened bf16)."""
    from neuron_opt.compiler import CompileRequest, compile_artifact

    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / "kernel", backend="cpu",
                         dtype="bfloat16", batch_size=1, max_model_len=128, prefill_buckets=(16, 64),
                         decode_buckets=(128,), cache_dir=tmp_path / "cache", num_speculative_tokens=K,
                         backend_options={"one_row_gemm": "kernel", "head_gemm": "kernel"})
    compile_artifact(req, log=lambda s: None, progress=False)
    seq = [1, 17, 42, 99, 5, 123, 7, 300, 301, 302, 303]
    runner = LLM(tmp_path / "kernel").runner
    runner.prefill((1,), seq[:6])
    ref = [runner.decode([DecodeRow((1,), seq[i], i)])[0] for i in range(6, 10)]
    runner.prefill((2,), seq[:6])
    got = runner.verify([VerifyRow((2,), tuple(seq[6:10]), 6)])[0]
    for j in range(K + 1):
        assert torch.equal(got[j], ref[j]), f"row {j}: {(got[j] - ref[j]).abs().max()}"
        assert not torch.equal(ref[j], ref[j].bfloat16().float())


@pytest.mark.slow  # ~60 s; the operator's row independence is tested bitwise in test_cpu_ops.py
def test_int8_exact_verify_rows_are_bitwise_the_decode_steps_logits(tiny_dir, tmp_path):
    """int8 weights with an int8 head (fp32 compute, any CPU): every int8 product of the decode and verify graphs
    runs on torch.ops.neuron_opt.int8_linear, whose rows do not depend on the rows beside them, so a verify row's
    logits are bitwise the decode step's, as for bf16 above."""
    from neuron_opt.compiler import CompileRequest, compile_artifact

    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / "int8", backend="cpu", dtype="float32",
                         batch_size=1, max_model_len=128, prefill_buckets=(16, 64), decode_buckets=(128,),
                         cache_dir=tmp_path / "cache", num_speculative_tokens=K, quantize="int8",
                         quantize_lm_head=True)
    compile_artifact(req, log=lambda s: None, progress=False)
    seq = [1, 17, 42, 99, 5, 123, 7, 300, 301, 302, 303]
    runner = LLM(tmp_path / "int8").runner
    runner.prefill((1,), seq[:6])
    ref = [runner.decode([DecodeRow((1,), seq[i], i)])[0] for i in range(6, 10)]
    runner.prefill((2,), seq[:6])
    got = runner.verify([VerifyRow((2,), tuple(seq[6:10]), 6)])[0]
    for j in range(K + 1):
        assert torch.equal(got[j], ref[j]), f"row {j}: {(got[j] - ref[j]).abs().max()}"


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
        assert out.token_ids == reference_generate(one, prompt, params).token_ids and stats.verify_steps > 0
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
    want = reference_generate(ref, ref.encode_chat(messages), SamplingParams(max_tokens=24)).text
    with live_server(llm, max_num_seqs=4, speculative=SpeculativeConfig(K, adaptive=False)) as (url, engine):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        metrics = httpx.get(url + "/metrics").text
    assert text == want
    st = engine.spec_stats
    assert st.verify_steps > 0
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {float(st.draft_tokens)}' in metrics
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(st.accepted_tokens)}' \
        in metrics
    assert "neuron_opt:spec_decode_mean_accepted_length" in metrics


# ---- the draft-model proposer -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A second tiny model with the default tokenizer: other weights (seed 1) and one layer."""
    from tiny import make_tiny

    return make_tiny("smollm-tok-1layer", tmp_path_factory.mktemp("draft"), seed=1)


def test_draft_proposals_are_the_drafts_greedy_continuation_after_any_history(llms, draft_dir):
    """Proposals equal the draft's own greedy decoding of the sequence so far, also after the sequence moved on by
    tokens the draft did not propose (a rejection) or by all it proposed plus one (full acceptance), and for
    several sequences in one call with different k."""
    llm, _ = llms
    ref = LLM(draft_dir, batch_size=1, max_model_len=128)
    prop = DraftModelProposer(LLM(draft_dir, batch_size=4, max_model_len=128).runner)

    def greedy(ids: list[int], n: int) -> list[int]:
        return reference_generate(ref, ids, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids

    a, b = _grounded_prompts(llm)[:2]
    got = prop.propose_batch([("a", a, 4), ("b", b, 2)])
    assert got == [greedy(a, 4), greedy(b, 2)]
    calls = prop.draft_calls
    a2 = a + got[0][:1] + [77]  # one accepted, then the target's own token
    b2 = b + got[1] + [88]  # all accepted plus a bonus: the draft had not seen the last proposal
    got2 = prop.propose_batch([("a", a2, 3), ("b", b2, 3)])
    assert got2 == [greedy(a2, 3), greedy(b2, 3)]
    assert prop.draft_calls - calls == 1 + 3  # one catch-up step for b's extra token, then 3 batched decodes
    assert prop.propose_batch([("a", a2 + [5] * 9, 2)]) == [greedy(a2 + [5] * 9, 2)]  # a long gap: prefilled
    assert prop.propose_batch([("c", a, 0)]) == [[]]
    prop.forget("a"), prop.forget("b")
    assert sorted(prop._free) == [0, 1, 2, 3]


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_a_draft_model_is_identical_to_non_speculative_greedy(llms, draft_dir, adaptive):
    llm, ref = llms
    prompts = _grounded_prompts(llm)
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=17),
              SamplingParams(max_tokens=25, ignore_eos=True, frequency_penalty=0.3, logprobs=1),
              SamplingParams(max_tokens=28, ignore_eos=True, min_tokens=4)]
    draft = llm.draft(draft_dir, 4)
    spec = SpeculativeConfig(K, "draft_model", adaptive=adaptive, model=str(draft_dir))
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=draft.runner)
    outs = run_engine(engine, {str(i): (p, params[i]) for i, p in enumerate(prompts)})
    assert_outputs_match_reference(outs, ref, prompts, params)
    assert engine.spec_stats.verify_steps > 0 and engine.spec_stats.draft_tokens > 0
    assert not engine.proposer.slot  # every finished request gave its draft slot back


def test_the_target_as_its_own_draft_has_every_proposal_accepted(llms, tiny_dir):
    """fp32, eager: the draft's greedy continuation is the target's, so a verify accepts all k proposals (up to the
    request's end) and emits k + 1 tokens; the text equals non-speculative greedy."""
    llm, ref = llms
    prompt = _grounded_prompts(llm)[2]
    params = SamplingParams(max_tokens=33, ignore_eos=True)
    out, st = llm.generate_ids_speculative(prompt, params, SpeculativeConfig(
        K, "draft_model", adaptive=False, model=str(tiny_dir("smollm-tok"))))
    assert out.token_ids == reference_generate(ref, prompt, params).token_ids
    assert st.accepted_tokens == st.draft_tokens > 0
    assert st.verify_steps == 8  # 33 tokens: 1 from prefill, then 8 verifies of k + 1 = 4


def test_bad_draft_models_are_refused_with_the_field(llms, draft_dir, tmp_path):
    from tiny import make_tiny

    llm, _ = llms
    with pytest.raises(ConfigError, match="needs a draft model") as e:
        SpeculativeConfig(K, "draft_model")
    assert e.value.param == "speculative_model"
    with pytest.raises(ConfigError, match="takes none"):
        SpeculativeConfig(K, "ngram", model=str(draft_dir))
    spec = SpeculativeConfig(K, "draft_model", model=str(draft_dir))
    with pytest.raises(ConfigError, match="a draft runner goes with"):
        Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec)
    small = LLM(draft_dir, batch_size=2, max_model_len=128)
    with pytest.raises(ConfigError, match="--batch-size 4"):
        Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=small.runner)
    short = LLM(draft_dir, batch_size=4, max_model_len=64)
    with pytest.raises(ConfigError, match="--max-model-len 128"):
        Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=short.runner)
    import shutil

    from transformers import AutoTokenizer

    retok = shutil.copytree(draft_dir, tmp_path / "retok")  # same weights, a tokenizer with one token more
    tok = AutoTokenizer.from_pretrained(retok)
    tok.add_tokens(["<not-in-the-target>"])
    tok.save_pretrained(retok)
    with pytest.raises(ConfigError, match="tokenizer differs from the target's"):
        llm.draft(retok, 4)
    other = LLM(make_tiny("llama-gqa2", tmp_path / "gqa2", tokenizer=True), batch_size=4, max_model_len=128)
    with pytest.raises(ConfigError, match="vocabulary has 257 tokens"):
        Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=other.runner)


def test_cli_generate_with_a_draft_model_matches_plain_greedy(tiny_dir, draft_dir, capsys):
    import json

    from neuron_opt.cli import main

    target = str(tiny_dir("smollm-tok"))
    base = ["generate", "--model", target, "--prompt", "abc abc abc abc abc", "--max-new-tokens", "12",
            "--temperature", "0", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--speculative-model", str(draft_dir), "--num-speculative-tokens", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["speculative"]["verify_steps"] > 0
    assert main(base + ["--speculative-method", "ngram", "--speculative-model", str(draft_dir)]) == 2
    assert "the ngram method takes none" in capsys.readouterr().err


def test_serve_flags_build_a_draft_engine_and_concurrent_streams_equal_plain_greedy(llms, tiny_dir, draft_dir):
    """`serve --speculative-model` wires the draft into the engine (a KV slot per sequence); four streams at once
    through the official client (continuous batching: rows finish at different steps) equal plain greedy."""
    import asyncio

    import openai
    from helpers import live_server

    from neuron_opt.cli import build_parser
    from neuron_opt.commands.serve_engine import build_engine

    args = build_parser().parse_args(["serve", "--model", str(tiny_dir("smollm-tok")), "--max-num-seqs", "3",
                                      "--max-model-len", "128", "--speculative-model", str(draft_dir),
                                      "--num-speculative-tokens", str(K)])
    built = build_engine(args)
    assert isinstance(built.proposer, DraftModelProposer) and built.proposer.num_slots == 3
    assert built.spec.method == "draft_model" and built.spec.num_speculative_tokens == K

    llm, ref = llms
    prompts = [llm.tokenizer.decode(p) for p in _grounded_prompts(llm)]
    lengths = [20, 9, 14, 17]
    want = [reference_generate(ref, list(llm.tokenizer(p)["input_ids"]),
                               SamplingParams(max_tokens=n, ignore_eos=True)).text
            for p, n in zip(prompts, lengths, strict=True)]
    spec = SpeculativeConfig(K, "draft_model", adaptive=False, model=str(draft_dir))
    with live_server(llm, max_num_seqs=4, speculative=spec, draft=llm.draft(draft_dir, 4).runner) as (url, engine):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def one(prompt: str, n: int) -> str:
            chunks = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        async def all_at_once() -> list[str]:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))

        got = asyncio.run(all_at_once())
    assert got == want
    assert engine.spec_stats.verify_steps > 0 and not engine.proposer.slot


VERIFY_PARAMS = [SamplingParams(), SamplingParams(presence_penalty=1.5, logprobs=2),
                 SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=1.2, top_k=6, seed=2, logprobs=0),
                 SamplingParams(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05, seed=3, frequency_penalty=0.8,
                                logit_bias=((4, 2.0), (9, -1.0)), logprobs=3)]


@pytest.mark.parametrize("tp", [1, 2])
def test_acceptance_in_the_graph_equals_the_host_verifier(tp):
    """The verify step's sampling as a device graph records it (backends.neuron `sample_on_device`; at tp 2 the
    vocab-parallel `spmd_sample`, its two ranks as two threads whose all-reduce sums their operands), on CPU
    tensors fed `verify_inputs`, then `accept_device`, against the host verifier `accept` on the same logits with the
    same seeded generators: the same tokens, logprobs, generator states and penalty counts, for greedy and sampled
    rows with penalties, bias, min-p/top-k/top-p and a banned token, over drafts the target accepts in part (so
    acceptances, rejections and bonus tokens all occur)."""
    from neuron_opt.backends.neuron.backend import sample_on_device
    from neuron_opt.runtime.sampling import verify_inputs
    from neuron_opt.runtime.speculative import accept_device
    from neuron_opt.sample_ops import verify_outputs

    V, q = 40, K + 1
    gen = torch.Generator().manual_seed(7)
    seen = set()
    for trial in range(30):
        logits = torch.randn(len(VERIFY_PARAMS), q, V, generator=gen) * 2
        drafts = []
        for r in range(len(VERIFY_PARAMS)):
            best = logits[r].argmax(-1).tolist()
            n = (trial + r) % (K + 1)
            drafts.append([best[j] if (trial + j + r) % 3 else (best[j] + 1) % V for j in range(n)])
        banned_for = [[(5,) if j == 0 else () for j in range(len(d) + 1)] for d in drafts]
        host = [SamplerState.create(p) for p in VERIFY_PARAMS]
        dev = [SamplerState.create(p) for p in VERIFY_PARAMS]
        for st in (*host, *dev):
            for t in (3, 4, 3):
                st.observe(t)
        s = verify_inputs(dev, drafts, banned_for, q, V)
        outs = sample_on_device(logits, s, V) if tp == 1 else _spmd_ranks(logits.reshape(-1, V), s, V)
        named = {k: t.reshape(len(dev), q, *t.shape[1:]) for k, t in verify_outputs(outs, s.logprobs).items()}
        for r in range(len(dev)):
            want = accept(logits[r], drafts[r], host[r], banned_for[r])
            got = accept_device({k: t[r] for k, t in named.items()}, drafts[r], dev[r])
            assert [x.token for x in got] == [x.token for x in want], (trial, r)
            seen.add((r, len(got) - 1 == len(drafts[r])))
            for g, w in zip(got, want, strict=True):
                assert (g.logprob is None) == (w.logprob is None)
                if w.logprob is not None:
                    assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
                    assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
            if host[r].generator is not None:
                assert torch.equal(host[r].generator.get_state(), dev[r].generator.get_state())
            assert host[r].counts == dev[r].counts
    assert seen == {(r, every) for r in range(len(VERIFY_PARAMS)) for every in (False, True)}


def _spmd_ranks(logits: torch.Tensor, s, vocab: int) -> list[torch.Tensor]:
    """`spmd_sample` of two ranks, each holding half of the vocabulary, as two threads: an all-reduce returns the
    sum of both ranks' operands (what the SPMD program's all-reduce does). Rank 0's outputs."""
    import threading

    from neuron_opt.backends.neuron.backend import spmd_sample

    barrier, slots = threading.Barrier(2), [None, None]

    class Comm:
        tp = 2

        def __init__(self, rank: int) -> None:
            self.rank, self.rank_tensor = rank, torch.tensor([rank], dtype=torch.int32)

        def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
            slots[self.rank] = t
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total

    half, outs = vocab // 2, [None, None]
    si = s.map(lambda t: t.to(torch.int32) if t.dtype == torch.int64 else t)

    def rank(r: int) -> None:
        outs[r] = spmd_sample(logits[:, r * half:(r + 1) * half], si, vocab, Comm(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs[0]
