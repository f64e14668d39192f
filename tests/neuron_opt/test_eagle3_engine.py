"""EAGLE-3 speculation in the serving engine (eager backend): greedy output equals the non-speculative reference
loop's token for token in a mixed batch (speculating and plain rows, stops, penalties, logprobs), across
preemption and prefix-cache hits; each proposal equals the head's chain recomputed from scratch on the target's
hidden states of the whole sequence (so the incremental bookkeeping of states and head KV is exact); bad heads and
backends are refused naming the field.

Oracles: `helpers.reference_generate` (the plain loop), and for proposals the target's `forward_with_aux` over the
whole sequence with a fresh KV followed by the head over every position (models/eagle3.py, itself checked against
speculators in tests/models/test_eagle3.py)."""

from __future__ import annotations

import pytest
import torch
from eagle3_heads import write_random_head
from helpers import assert_outputs_match_reference, reference_generate, run_engine

from models.eagle3 import Eagle3Head
from neuron_opt.api import LLM, build_model, load_eagle3
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.errors import ConfigError
from neuron_opt.runtime.eagle3 import Eagle3Proposer
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.runner import ModelRunner, PrefillRow
from neuron_opt.runtime.sampling import SamplerState, SamplingParams, sample_one
from neuron_opt.runtime.speculative import SpeculativeConfig, accept

K = 3


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tiny_dir("smollm-tok")
    head = write_random_head(tmp_path_factory.mktemp("head"), path, [0, 1, 2])
    yield (LLM(path, batch_size=4, max_model_len=128, num_speculative_tokens=K),
           LLM(path, batch_size=1, max_model_len=128), head)
    torch.set_num_threads(threads)


def _prompts(llm: LLM) -> list[list[int]]:
    texts = ["one two three four five one two three four five one two three",
             "The cat sat on the mat. The cat sat on",
             "Tell me a story about the moon and the sea.",
             "Numbers: 1 2 3 4 5 6 7 8 9"]
    return [list(llm.tokenizer(t)["input_ids"]) for t in texts]


def _head_from_scratch(ref: LLM, head: Eagle3Head, ids: list[int], k: int) -> list[int]:
    """The head's chain after `ids`, recomputed with nothing kept: the target's states of ids[:-1] from one prefill
    into a fresh slot, then the head over every position and k - 1 chain steps."""
    ref.runner.capture_aux_hidden(head.aux_layer_ids)
    ref.runner.prefill(0, ids[:-1])
    aux = ref.runner.aux_hidden[:1, :len(ids) - 1]
    kc, vc = head.kv_cache(1, torch.float32)
    slot, n = torch.tensor([0]), len(ids) - 1
    with torch.inference_mode():
        h = head.forward_layer(torch.tensor([ids[1:]]), head.project(aux), torch.arange(n)[None], slot, kc, vc)
        logits, hidden = head.logits(h[:, -1])
        out = [int(head.to_target(logits.argmax(-1))[0])]
        for step in range(1, k):
            h = head.forward_layer(torch.tensor([[out[-1]]]), hidden[:, None], torch.tensor([[n - 1 + step]]), slot,
                                   kc, vc)
            logits, hidden = head.logits(h[:, 0])
            out.append(int(head.to_target(logits.argmax(-1))[0]))
    return out


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_an_eagle3_head_equals_plain_greedy_in_a_mixed_batch(setup, adaptive):
    """Four requests at once, one of them (max_tokens 1 past its prompt's budget: k = 0 at every step) never
    speculating; stops, penalties, min_tokens and logprobs on the others."""
    llm, ref, head_dir = setup
    prompts = _prompts(llm)
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=17, stop=["mat"]),
              SamplingParams(max_tokens=25, ignore_eos=True, frequency_penalty=0.3, logprobs=1),
              SamplingParams(max_tokens=2, ignore_eos=True)]
    spec = SpeculativeConfig(K, "eagle3", adaptive=adaptive, model=str(head_dir))
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=llm.eagle3(head_dir))
    seen: list[tuple[list[int], int, list[int]]] = []
    prop = engine.proposer
    assert isinstance(prop, Eagle3Proposer)
    _recording(prop, seen)
    outs = run_engine(engine, {str(i): (p, params[i]) for i, p in enumerate(prompts)})
    assert_outputs_match_reference(outs, ref, prompts, params)
    assert engine.spec_stats.verify_steps > 0 and engine.spec_stats.draft_tokens > 0
    assert not prop.fed and not prop.pending  # every finished request gave its states back
    assert seen
    head = llm.eagle3(head_dir)
    for ids, k, p in seen[:12]:
        assert p == _head_from_scratch(ref, head, ids, k), (len(ids), k)


def test_exact_across_preemption_and_prefix_cache_hits(setup):
    """Prefix caching and chunked prefill on, requests sharing a long prefix (cache hits: the head gets no target
    states for those positions), and a block pool too small for all of them at once (preemption and recompute):
    still the plain loop's greedy text."""
    llm, ref, head_dir = setup
    base = _prompts(llm)[0] * 4
    prompts = [base + [11, 12], base + [13], base + [14, 15, 16], base[:20]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    BS = 8
    blocks = 1 + 3 * -(-max(len(p) for p in prompts) // BS) + 1
    cache = CacheConfig(max_batch=4, max_model_len=128, block_size=BS, num_blocks=blocks)
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=128, max_batch=4, min_prefill=16, min_decode=16,
                                 num_speculative_tokens=K)
    sd = dict(ref.runner.executor.model.state_dict())
    runner = ModelRunner(EagerExecutor(build_model(ref.config, sd, 128, torch.float32), cache), buckets, cache,
                         ref.config.vocab_size, ref.config)
    spec = SpeculativeConfig(K, "eagle3", adaptive=False, model=str(head_dir))
    engine = Engine(runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=llm.eagle3(head_dir),
                    enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=24)
    outs = run_engine(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert [t for o in outs[str(i)] for t in o.new_token_ids] == reference_generate(ref, p, params).token_ids, i
    assert engine.spec_stats.verify_steps > 0
    assert engine.stats.preemptions > 0 and engine.prefix_cache_stats.hits > 0


def _recording(prop: Eagle3Proposer, seen: list) -> None:
    """Record every (token ids, k, proposal) the engine gets from the proposer; it proposes exactly as before."""
    inner = prop.propose_batch

    def recording(items, seqs):
        got = inner(items, seqs)
        seen.extend((list(ids), k, p) for (_, ids, k), p in zip(items, got, strict=True) if k)
        return got

    prop.propose_batch = recording


def test_head_entries_in_the_targets_blocks_carry_prefix_hits_and_preemption(setup):
    """The head's K/V live in the target's blocks: a prompt that shares a finished request's prefix finds the
    head's entries of the shared blocks (not recomputed: `reused`), and sequences preempted by a small pool find
    theirs again; every proposal still equals the head's chain recomputed from scratch on the target's states of
    the whole sequence, and greedy equals the plain loop's."""
    llm, ref, head_dir = setup
    base = _prompts(llm)[1] * 3
    first = [base + [11]]
    later = [base + [12, 13], base + [14], base + [15, 16, 17]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    BS = 16
    blocks = 1 + 128 // BS + 1  # the least the model allows: three sequences of ~80 tokens preempt
    cache = CacheConfig(max_batch=4, max_model_len=128, block_size=BS, num_blocks=blocks)
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=128, max_batch=4, min_prefill=16, min_decode=16,
                                 num_speculative_tokens=K)
    sd = dict(ref.runner.executor.model.state_dict())
    runner = ModelRunner(EagerExecutor(build_model(ref.config, sd, 128, torch.float32), cache), buckets, cache,
                         ref.config.vocab_size, ref.config)
    spec = SpeculativeConfig(K, "eagle3", adaptive=False, model=str(head_dir))
    engine = Engine(runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=llm.eagle3(head_dir),
                    enable_prefix_caching=True)
    prop = engine.proposer
    assert isinstance(prop, Eagle3Proposer)
    seen: list[tuple[list[int], int, list[int]]] = []
    _recording(prop, seen)
    outs = run_engine(engine, {"a": (first[0], params)})
    reused, alone = prop.reused, len(seen)
    outs |= run_engine(engine, {str(i): (p, params) for i, p in enumerate(later)})
    assert outs["a"] and [t for o in outs["a"] for t in o.new_token_ids] == \
        reference_generate(ref, first[0], params).token_ids
    for i, p in enumerate(later):
        assert [t for o in outs[str(i)] for t in o.new_token_ids] == reference_generate(ref, p, params).token_ids, i
    assert engine.prefix_cache_stats.hits > 0 and engine.stats.preemptions > 0
    assert prop.reused - reused >= len(later) * (len(base) // BS * BS - 1)  # the shared blocks' entries, found
    head = llm.eagle3(head_dir)
    for ids, k, p in seen[alone:]:  # those of the sequences that shared blocks and were preempted
        assert p == _head_from_scratch(ref, head, ids, k), (len(ids), k)


def _sampled_reference(ref: LLM, head: Eagle3Head, prompt: list[int], params: SamplingParams) -> list[int]:
    """The speculating engine's tokens for one sampled request, recomputed on the host with nothing shared: the
    target's logits over the whole sequence and its proposals (one prefill of every position), the head's chain
    from scratch, and `speculative.accept` (rejection sampling) with the request's own seeded generator, K (or
    what max_tokens leaves) proposals at every step."""
    state = SamplerState.create(params)
    out: list[int] = []
    while len(out) < params.max_tokens:
        seq = prompt + out
        k = min(K, params.max_tokens - len(out) - 1) if out else 0
        draft = _head_from_scratch(ref, head, seq, k) if k else []
        every = ref.runner.prefill_rows([PrefillRow(0, tuple(seq + draft))], all_positions=True)[0]
        if not out:  # the prefill's token
            res = sample_one(every[len(seq) - 1], state)
            state.observe(res.token)
            out.append(res.token)
            continue
        out += [r.token for r in accept(every[len(seq) - 1:], draft, state, [()] * (k + 1))]
    return out[:params.max_tokens]


def test_sampled_rows_are_verified_by_rejection_sampling_as_the_host_reference(setup):
    """Sampled requests (seeded; temperature, top-p) beside a greedy one, always verifying: each sampled request's
    tokens equal the host reference's (`_sampled_reference`: the target's own logits, the head's chain from scratch,
    rejection sampling with the request's generator), so its proposals are verified by rejection sampling on the
    exact target distribution, position by position."""
    llm, ref, head_dir = setup
    prompts = _prompts(llm)[:3]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.7, seed=11),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_p=0.9, seed=12),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    spec = SpeculativeConfig(K, "eagle3", adaptive=False, model=str(head_dir))
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, speculative=spec, draft=llm.eagle3(head_dir))
    outs = run_engine(engine, {str(i): (p, params[i]) for i, p in enumerate(prompts)})
    assert engine.spec_stats.verify_steps > 0 and engine.spec_stats.draft_tokens > 0
    head = llm.eagle3(head_dir)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        got = [t for o in outs[str(i)] for t in o.new_token_ids]
        assert got == _sampled_reference(ref, head, p, sp), i


def test_bad_heads_and_backends_are_refused_naming_the_field(setup, tmp_path, tiny_dir):
    llm, _, head_dir = setup
    bad_ids = write_random_head(tmp_path / "ids", tiny_dir("smollm-tok"), [0, 1, 5])
    with pytest.raises(ConfigError, match=r"reads layers \[0, 1, 5\]; the model has 2 layers") as e:
        load_eagle3(bad_ids, llm.loaded)
    assert e.value.param == "speculative_model"
    default_ids = write_random_head(tmp_path / "default", tiny_dir("smollm-tok"), None)
    with pytest.raises(ConfigError, match=r"the default: it names none"):
        load_eagle3(default_ids, llm.loaded)
    other = write_random_head(tmp_path / "other", tiny_dir("llama-gqa2"), [0, 1, 2])
    with pytest.raises(ConfigError, match="vocabulary of 257 tokens; the model has 49152"):
        load_eagle3(other, llm.loaded)
    with pytest.raises(ConfigError, match="needs a model") as e:
        SpeculativeConfig(K, "eagle3")
    assert e.value.param == "speculative_model"
    with pytest.raises(ConfigError, match="takes an EAGLE-3 head"):
        Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, draft=llm.runner,
               speculative=SpeculativeConfig(K, "eagle3", model=str(head_dir)))


def test_cli_generate_and_serve_flags_take_an_eagle3_head(setup, tiny_dir, capsys):
    """`generate --speculative-method eagle3 --speculative-model HEAD` (vLLM's flags) gives plain greedy's tokens;
    `serve` with the same flags builds an engine around the head."""
    import json as json_

    from neuron_opt.cli import build_parser, main
    from neuron_opt.commands.serve_engine import build_engine

    _, _, head_dir = setup
    target = str(tiny_dir("smollm-tok"))
    base = ["generate", "--model", target, "--prompt", "abc abc abc abc abc", "--max-new-tokens", "12",
            "--temperature", "0", "--json"]
    assert main(base) == 0
    plain = json_.loads(capsys.readouterr().out)
    flags = ["--speculative-method", "eagle3", "--speculative-model", str(head_dir), "--num-speculative-tokens", "3"]
    assert main(base + flags + ["--no-speculative-adaptive"]) == 0
    spec = json_.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["speculative"]["verify_steps"] > 0
    assert main(base + ["--speculative-method", "eagle3"]) == 2
    assert "the eagle3 method needs a model" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--model", target, "--max-num-seqs", "3", "--max-model-len", "128",
                                      *flags])
    built = build_engine(args)
    assert isinstance(built.proposer, Eagle3Proposer) and built.proposer.block_size == built.runner.cache.block_size
    assert built.spec.method == "eagle3"


@pytest.mark.slow  # a cpu artifact's compile (prefill, decode and verify layer graphs, two heads), the chain graph
@pytest.mark.timeout(1800)
def test_cpu_artifact_runs_an_eagle3_head_exactly(setup, tiny_dir, tmp_path):
    """The cpu backend hands over the stream between its layer graphs and runs the head's chain as its compiled
    graph (backends/cpu/eagle3.py): greedy through a compiled artifact with the head equals eager plain greedy, for
    four prompts in turn."""
    from neuron_opt.compiler import CompileRequest, compile_artifact

    llm, ref, head_dir = setup
    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / "art", backend="cpu", dtype="float32",
                         batch_size=1, max_model_len=128, prefill_buckets=(64,), decode_buckets=(128,),
                         cache_dir=tmp_path / "cache", num_speculative_tokens=K)
    compile_artifact(req, log=lambda s: None, progress=False)
    compiled = LLM(tmp_path / "art")
    prompts = _prompts(llm)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 12, 25, 20)]
    spec = SpeculativeConfig(K, "eagle3", adaptive=False, model=str(head_dir))
    outs = compiled.generate_batch(prompts, params, speculative=spec)
    for p, sp, out in zip(prompts, params, outs, strict=True):
        assert out.token_ids == reference_generate(ref, p, sp).token_ids
    _, stats = compiled.generate_ids_speculative(prompts[0], params[0], spec)
    assert stats.verify_steps > 0 and stats.draft_tokens > 0
    chain = compiled.runner.executor._chain[1]
    assert type(chain).__name__ == "CpuEagle3Chain" and chain.calls["chain"] > 0


@pytest.mark.slow  # two rank processes (the default suite's budget)
def test_tp2_rank_processes_hand_over_their_states_and_stay_exact(setup, tiny_dir):
    """Eager tp 2 (rank processes): rank 0 sends the streams (whole on every rank) with the logits, the ranks
    gather the shared embeddings; greedy with the head equals the one-rank plain loop's."""
    from neuron_opt.config import ParallelConfig

    _, ref, head_dir = setup
    tp = LLM(tiny_dir("smollm-tok"), batch_size=2, max_model_len=128, num_speculative_tokens=K,
             parallel=ParallelConfig(tp=2))
    try:
        prompts = _prompts(tp)[:2]
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        spec = SpeculativeConfig(K, "eagle3", adaptive=False, model=str(head_dir))
        outs = tp.generate_batch(prompts, params, speculative=spec)
        for p, out in zip(prompts, outs, strict=True):
            assert out.token_ids == reference_generate(ref, p, params).token_ids
        _, stats = tp.generate_ids_speculative(prompts[0], params, spec)
        assert stats.verify_steps > 0 and stats.draft_tokens > 0
        ids = torch.tensor([[5, 77, 49151]])
        torch.testing.assert_close(tp.runner.embedding_fn()(ids), ref.runner.embedding_fn()(ids))
    finally:
        tp.runner.executor.close()
