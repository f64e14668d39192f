"""Sampling and stop conditions against direct torch computations."""

from __future__ import annotations

import pytest
import torch

from neuron_opt.errors import ConfigError
from neuron_opt.runtime.sampling import SamplerState, SamplingParams, sample_one
from neuron_opt.runtime.stopping import StopChecker, StopStrings, held_back


def test_greedy_is_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert sample_one(logits, SamplerState.create(SamplingParams())).token == int(logits.argmax())


def test_seed_reproducible_and_independent_of_other_requests():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.8, seed=42)
    a = [sample_one(logits, SamplerState.create(p)).token for _ in range(3)]
    st = SamplerState.create(p)
    b = [sample_one(logits, st).token for _ in range(20)]
    assert a == [b[0]] * 3  # same seed, same first draw
    assert len(set(b)) > 1  # and the stream moves on


def test_top_k_only_draws_from_top_k():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2))
    allowed = set(torch.topk(logits, 5).indices.tolist())
    st = SamplerState.create(SamplingParams(temperature=2.0, top_k=5, seed=0))
    assert {sample_one(logits, st).token for _ in range(200)} <= allowed


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    st = SamplerState.create(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    assert {sample_one(logits, st).token for _ in range(300)} == {0, 1}


def test_sampling_distribution_matches_softmax():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    st = SamplerState.create(SamplingParams(temperature=0.7, seed=3))
    n = 20000
    counts = torch.bincount(torch.tensor([sample_one(logits, st).token for _ in range(n)]), minlength=4)
    torch.testing.assert_close(counts.float() / n, (logits / 0.7).softmax(-1), atol=0.015, rtol=0)


def test_penalties_follow_openai_formula():
    logits = torch.zeros(10)
    logits[3] = 1.0
    st = SamplerState.create(SamplingParams(frequency_penalty=0.4, presence_penalty=0.5))
    st.observe(3), st.observe(3)
    # 1.0 - 2 * 0.4 - 0.5 = -0.3 < 0: token 3 is no longer the argmax
    assert sample_one(logits, st).token == 0


def test_logprobs_reported():
    logits = torch.tensor([0.0, 1.0, 2.0])
    r = sample_one(logits, SamplerState.create(SamplingParams(logprobs=2)))
    assert r.token == 2
    assert r.logprob == pytest.approx(float(logits.log_softmax(-1)[2]))
    assert [t for t, _ in r.top_logprobs] == [2, 1]


@pytest.mark.parametrize("kw,field", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                                      ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
                                      ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": 50}, "logprobs"),
                                      ({"min_p": 1.5}, "min_p")])
def test_invalid_params_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kw)


class CharTok:
    """Each token id is one character (ord); decode joins them."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def test_stop_string_is_cut_and_never_streamed():
    sc = StopChecker(CharTok(), SamplingParams(max_tokens=50, stop=("END",)), eos_token_ids=(0,))
    streamed = "".join(sc.add(ord(c)) for c in "hello EN")
    assert streamed == "hello " and sc.finish_reason is None  # "EN" held back
    streamed += sc.add(ord("D"))
    assert sc.finish_reason == "stop" and sc.text == "hello " and streamed == "hello "


def test_held_back_prefix_released_when_it_does_not_match():
    sc = StopChecker(CharTok(), SamplingParams(max_tokens=50, stop=("END",)), eos_token_ids=(0,))
    out = "".join(sc.add(ord(c)) for c in "ENx")
    assert out == "ENx" and sc.finish_reason is None
    assert held_back("abcE", StopStrings.of(("END",))) == 1


def test_eos_and_length():
    sc = StopChecker(CharTok(), SamplingParams(max_tokens=3), eos_token_ids=(0,))
    sc.add(ord("a"))
    sc.add(0)
    assert sc.finish_reason == "stop" and sc.text == "a"
    sc2 = StopChecker(CharTok(), SamplingParams(max_tokens=2), eos_token_ids=(0,))
    sc2.add(ord("a")), sc2.add(ord("b"))
    assert sc2.finish_reason == "length" and sc2.text == "ab"
    sc3 = StopChecker(CharTok(), SamplingParams(max_tokens=5, ignore_eos=True), eos_token_ids=(0,))
    sc3.add(0)
    assert sc3.finish_reason is None


@pytest.fixture(scope="module")
def real_tokenizer():
    from neuron_opt.checkpoint import open_checkpoint

    return open_checkpoint("default").tokenizer()


def test_incremental_detokenization_streams_what_the_full_re_decode_streams(real_tokenizer):
    """The fast path (tokenizers' DecodeStream, O(new tokens) per token) against the reference (decode every id
    each token) on the default model's byte-level tokenizer: identical deltas, text and finish reason for 400
    random sequences weighted towards raw byte tokens (UTF-8 characters split across tokens, invalid bytes),
    multi-byte words, stop strings and special tokens."""
    import random

    from neuron_opt.runtime.stopping import stream_decoder

    tok = real_tokenizer
    assert stream_decoder(tok) is not None and stream_decoder(CharTok()) is None  # CharTok: the reference path
    V = len(tok)
    byte_tokens = [i for i in range(V) if "\ufffd" in tok.decode([i])]
    words = [tok(w)["input_ids"] for w in ("é", "你好", "🙂", " stop", "ST", "OP", "<|im_end|>")]
    rng = random.Random(0)
    for _ in range(400):
        ids: list[int] = []
        while len(ids) < rng.randint(1, 40):
            r = rng.random()
            ids += [rng.choice(byte_tokens)] if r < 0.3 else rng.choice(words) if r < 0.6 else [rng.randrange(V)]
        params = SamplingParams(max_tokens=len(ids), stop=("STOP", "你好🙂") if rng.random() < 0.5 else (),
                                ignore_eos=True)
        fast, ref = (StopChecker(tok, params, (2,), incremental=inc) for inc in (True, False))
        for t in ids:
            assert fast.add(t) == ref.add(t), ids
            if ref.finish_reason:
                break
        assert (fast.text, fast.finish_reason) == (ref.text, ref.finish_reason), ids
    assert fast.text == ref.text


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row's reference filter: -inf below the k-th largest logit, then outside the smallest prefix of the sorted
    distribution whose mass reaches top_p."""
    if top_k and top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def test_batched_sampling_equals_the_per_row_reference():
    """sample_batch over a mixed batch (greedy, top-k, top-p, both, penalties, banned tokens, logprobs) against
    the per-row reference: each row's own processed logits, its own temperature/top-k/top-p filter
    (`top_k_top_p`), and the inverse CDF of the same uniform draw from a copy of its generator."""
    from neuron_opt.runtime.sampling import processed_logits, sample_batch

    V = 300
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=1),
              SamplingParams(temperature=1.3, top_p=0.7, seed=2), SamplingParams(temperature=0.6, top_k=50,
                                                                                 top_p=0.9, seed=3),
              SamplingParams(temperature=1.0, seed=4, presence_penalty=1.5, frequency_penalty=0.5, logprobs=3),
              SamplingParams(presence_penalty=2.0), SamplingParams(temperature=2.0, top_k=V + 5, seed=6)]
    banned = [(), (int(logits[1].argmax()),), (), (), (7, 8), (), ()]
    for _ in range(20):
        states = [SamplerState.create(p) for p in params]
        for st in states[4:6]:
            for t in (int(logits[4].argmax()), int(logits[5].argmax()), 3):
                st.observe(t)
        copies = [None if st.generator is None else torch.Generator().set_state(st.generator.get_state())
                  for st in states]
        got = sample_batch(logits, states, banned)
        for i, (st, g) in enumerate(zip(states, copies, strict=True)):
            z = processed_logits(logits[i], st, banned[i])
            if st.params.greedy:
                want = int(z.argmax())
            else:
                cum = top_k_top_p(z / st.params.temperature, st.params.top_k, st.params.top_p).softmax(-1).cumsum(-1)
                u = torch.rand((), generator=g)
                want = int((cum > u * cum[-1]).nonzero()[0])
            assert got[i].token == want, i
            assert got[i].token not in banned[i]
            if st.params.logprobs is not None:
                assert got[i].logprob == pytest.approx(float(z.log_softmax(-1)[want]))
                assert len(got[i].top_logprobs) == 3
        logits = logits.roll(1, dims=1)


def _think(params: SamplingParams, logits: torch.Tensor, steps: int, script: dict[int, int] | None = None,
           banned: tuple[int, ...] = ()) -> list[int]:
    """`steps` tokens sampled one at a time (step j takes `script[j]` where given, as if the model wrote it)."""
    st, out = SamplerState.create(params), []
    for j in range(steps):
        tok = (script or {}).get(j)
        if tok is None or st.forced_token is not None:
            tok = sample_one(logits, st, banned).token
        st.observe(tok)
        out.append(tok)
    return out


def test_thinking_budget_forces_the_end_marker_after_budget_thinking_tokens():
    """A ThinkingBudget of 4 with a three-token end marker: inside from the start, tokens 0-3 are the model's and
    4-6 the marker (over EOS bans and temperature), then the model's again; starting outside, counting begins after
    the start marker's tokens; a thinking the model closes itself is left alone, and nothing is forced after it."""
    from neuron_opt.runtime.sampling import ThinkingBudget

    V, START, END = 50, (40, 41), (45, 46, 47)
    logits = torch.zeros(V)
    logits[7] = 5.0  # the model's choice, greedy
    inside = ThinkingBudget(4, START, END, inside=True)
    assert _think(SamplingParams(thinking_budget=inside), logits, 9) == [7] * 4 + list(END) + [7, 7]
    hot = SamplingParams(temperature=1.5, seed=1, thinking_budget=inside)
    assert _think(hot, logits, 7, banned=(45,))[4:] == list(END)
    assert _think(SamplingParams(thinking_budget=ThinkingBudget(0, START, END, True)), logits, 4) == [*END, 7]
    outside = SamplingParams(thinking_budget=ThinkingBudget(4, START, END, inside=False))
    assert _think(outside, logits, 4) == [7] * 4  # no thinking: nothing to force
    assert _think(outside, logits, 11, {2: 40, 3: 41}) == [7, 7, 40, 41, 7, 7, 7, 7, *END]
    closed = {1: 45, 2: 46, 3: 47, 10: 40, 11: 41}
    assert _think(SamplingParams(thinking_budget=inside), logits, 18, closed) == \
        [7, 45, 46, 47, 7, 7, 7, 7, 7, 7, 40, 41, 7, 7, 7, 7, 7, 7]
    with pytest.raises(ConfigError, match="thinking_token_budget"):
        ThinkingBudget(-1, START, END, True)


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    st = SamplerState.create(SamplingParams(temperature=1.0, min_p=0.2, seed=0))  # 0.2 x 0.5 = 0.1
    assert {sample_one(torch.log(probs), st).token for _ in range(400)} == {0, 1, 2}


def test_the_device_definition_run_on_the_host_samples_what_the_host_sampler_samples():
    """`device_inputs` + sample_ops (what a neuron graph computes, here on CPU tensors) against `sample_batch`,
    with two generators seeded alike: temperature, top-k, top-p, min-p, penalties, logit_bias, banned and forced
    tokens, logprobs; 20 steps, each row observing its token. Building the inputs again before the results (a graph
    call that failed, run again) gives the same draws."""
    from neuron_opt.runtime.sampling import device_inputs, device_results, sample_batch
    from neuron_opt.sample_ops import adjust_rows, logprob_rows, sample_rows

    g = torch.Generator().manual_seed(5)
    params = [SamplingParams(logprobs=2), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=1.2, top_k=7, seed=2, presence_penalty=0.6, frequency_penalty=0.4),
              SamplingParams(temperature=0.7, top_p=0.8, min_p=0.1, seed=3, logit_bias=((4, 2.0), (9, -1.5)),
                             logprobs=0),
              SamplingParams(temperature=1.0, seed=4, min_tokens=5)]
    host, dev = [SamplerState.create(p) for p in params], [SamplerState.create(p) for p in params]
    for step in range(20):
        logits = torch.randn(len(params), 64, generator=g) * 2
        banned = [(), (), (), (), (3, 5) if step < 5 else ()]
        want = sample_batch(logits, host, banned)
        s = device_inputs(dev, banned, 64)
        assert torch.equal(device_inputs(dev, banned, 64).u, s.u)  # a graph call that failed draws nothing
        x = adjust_rows(logits, s)
        ids = sample_rows(x, s)
        got = device_results(ids.tolist(), logprob_rows(x, ids, s.logprobs), dev)
        assert [r.token for r in got] == [r.token for r in want]
        for a, b in zip(got, want, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6) if b.logprob is not None else a.logprob is None
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        for st_h, st_d, r in zip(host, dev, want, strict=True):
            st_h.observe(r.token)
            st_d.observe(r.token)


def test_min_p_from_an_openai_request():
    """`min_p` is one of vLLM's extra sampling fields of the OpenAI routes (0: off); out of [0, 1] names the field."""
    from neuron_opt.server.protocol import CompletionRequest

    assert CompletionRequest(model="m", prompt="x", min_p=0.1).sampling_params(1, 64, 100).min_p == 0.1
    assert CompletionRequest(model="m", prompt="x").sampling_params(1, 64, 100).min_p == 0.0
    with pytest.raises(ConfigError, match="min_p"):
        CompletionRequest(model="m", prompt="x", min_p=1.5).sampling_params(1, 64, 100)
