"""Engine tests on a tiny random model with the real tokenizer: batched continuous decoding must give every
request exactly what the single-sequence reference loop (runtime/generate.py, `helpers.reference_generate`) gives
it, greedy and seeded sampling alike; so must `LLM`'s generation methods, which step an engine themselves.

The engine is stepped synchronously here (`engine.step()`, no thread), so the tests are deterministic.
"""

from __future__ import annotations

import pytest
import torch
from helpers import reference_generate

from neuron_opt.api import LLM, LoadedModel
from neuron_opt.errors import ConfigError, ContextLengthError, QueueFullError
from neuron_opt.runtime.engine import Engine, RequestOutput
from neuron_opt.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def llms(tiny_dir):
    # one intra-op thread: for a model this small, thread barriers cost more than they save (a lot more when
    # the machine's cores are busy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tiny_dir("smollm-tok")
    yield LLM(path, batch_size=4, max_model_len=128), LLM(path, batch_size=1, max_model_len=128)
    torch.set_num_threads(threads)


def run_all(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], max_steps: int = 500, on_step=None
) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params, outs[rid].append)
    for i in range(max_steps):
        if on_step is not None:
            on_step(i, outs)
        if not engine.step() and engine.num_unfinished == 0:
            break
    return outs


def test_batched_outputs_match_single_sequence_reference(llms):
    llm, ref = llms
    prompts = [f"Request number {i} says" + " hello" * i for i in range(7)]
    params = [
        SamplingParams(max_tokens=5 + 3 * i, temperature=0.0)
        if i % 2 == 0
        else SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=100 + i)
        for i in range(7)
    ]
    params[3] = SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5)
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, max_num_batched_tokens=16)
    ids = [list(llm.tokenizer(p)["input_ids"]) for p in prompts]
    outs = run_all(engine, {str(i): (ids[i], params[i]) for i in range(7)})
    # chunked prefill: prompts that do not fit what is left of a step's 16 tokens run as several chunks
    assert engine.stats.prefills > 7 and engine.num_unfinished == 0 and engine.kv_usage == 0
    for i in range(7):
        want = reference_generate(ref, ids[i], params[i])
        got = outs[str(i)]
        assert [t for o in got for t in o.new_token_ids] == want.token_ids, i
        assert "".join(o.text_delta for o in got) == want.text
        assert got[-1].finished and got[-1].finish_reason == want.finish_reason
        assert all(not o.finished for o in got[:-1])
        assert [o.num_output_tokens for o in got] == list(range(1, len(want.token_ids) + 1))


def test_stop_strings_and_logprobs_match_reference(llms):
    llm, ref = llms
    ids = list(llm.tokenizer("The list goes on and on")["input_ids"])
    full = reference_generate(ref, ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a string the greedy continuation is known to contain
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,), logprobs=3)
    want = reference_generate(ref, ids, params)
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids)
    got = run_all(engine, {"a": (ids, params)})["a"]
    assert (
        "".join(o.text_delta for o in got) == want.text
        and got[-1].finish_reason == "stop" == want.finish_reason
    )
    lps = [lp for o in got for lp in o.logprobs]
    assert [lp.logprob for lp in lps] == pytest.approx(want.logprobs, abs=1e-5)
    assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in lps)


def test_abort_frees_slot_for_the_next_request(llms):
    llm, ref = llms
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, max_num_seqs=1)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0)
    ids = list(llm.tokenizer("one two three")["input_ids"])

    def cancel_a(step, outs):
        if step == 3:
            engine.abort("a")

    outs = run_all(engine, {"a": (ids, long), "b": (ids, short)}, on_step=cancel_a)
    assert outs["a"][-1].finish_reason == "abort" and len(outs["a"]) < 10
    assert [t for o in outs["b"] for t in o.new_token_ids] == reference_generate(ref, ids, short).token_ids
    assert engine.kv_usage == 0 and engine.num_unfinished == 0


def test_rejections_are_synchronous(llms):
    llm, _ = llms
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, max_num_seqs=1, max_waiting=1)
    with pytest.raises(ContextLengthError, match="maximum context length is 128 tokens"):
        engine.add_request("big", [5] * 100, SamplingParams(max_tokens=50), lambda o: None)
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=2), lambda o: None)
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=2), lambda o: None)
    with pytest.raises(QueueFullError, match="retry later"):
        engine.add_request("c", [5, 6], SamplingParams(max_tokens=2), lambda o: None)


def test_every_admitted_request_runs(llms):
    """Admission is one bound (max_num_seqs + max_waiting in flight), checked in add_request: requests admitted
    before the engine thread drains its inbox are all queued and served, none fails on the engine thread."""
    llm, _ = llms
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, max_num_seqs=1, max_waiting=2)
    p = SamplingParams(max_tokens=2, temperature=0.0)
    outs = run_all(engine, {rid: ([5, 6], p) for rid in "abc"})
    assert {rid: o[-1].finish_reason for rid, o in outs.items()} == {"a": "length", "b": "length", "c": "length"}
    assert engine.num_unfinished == 0


class FailingRunner:
    """Delegates to a real runner; prefill of a prompt starting with token 13 raises (a backend failure)."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def prefill_rows(self, rows, candidates=None):
        if rows[0].tokens[0] == 13:
            raise RuntimeError("simulated backend failure")
        return self._runner.prefill_rows(rows, candidates)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_runner_failure_fails_only_that_request(llms, async_scheduling):
    llm, ref = llms
    engine = Engine(FailingRunner(llm.runner), llm.tokenizer, llm.eos_token_ids, async_scheduling=async_scheduling)
    p = SamplingParams(max_tokens=6, temperature=0.0)
    outs = run_all(engine, {"bad": ([13, 14, 15], p), "good": ([20, 21, 22], p)})
    assert outs["bad"][-1].finish_reason == "error" and "simulated backend failure" in outs["bad"][-1].error
    assert [t for o in outs["good"] for t in o.new_token_ids] == reference_generate(ref, [20, 21, 22], p).token_ids
    assert engine.kv_usage == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_background_thread_serves_and_stops(llms, async_scheduling):
    import threading

    llm, ref = llms
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, async_scheduling=async_scheduling)
    engine.start()
    done, outs = threading.Event(), []

    def on_output(o):
        outs.append(o)
        if o.finished:
            done.set()

    p = SamplingParams(max_tokens=8, temperature=0.0)
    engine.add_request("x", [30, 31], p, on_output)
    assert done.wait(30)
    engine.stop()
    assert not engine.is_alive()
    assert [t for o in outs for t in o.new_token_ids] == reference_generate(ref, [30, 31], p).token_ids


def test_llm_generation_steps_an_engine_and_equals_the_reference(llms):
    """`LLM.generate_batch`: 7 prompts on a batch-4 model (three wait for a free sequence), greedy, seeded, with
    penalties, a stop string and logprobs; each output equals the reference loop's for its prompt alone, and
    `generate_ids` gives a prompt what the batch gave it."""
    llm, ref = llms
    ids = [list(llm.tokenizer(f"Request number {i} says" + " hello" * i)["input_ids"]) for i in range(7)]
    full = reference_generate(ref, ids[5], SamplingParams(max_tokens=12, ignore_eos=True)).text
    params = [SamplingParams(max_tokens=5 + 3 * i) if i % 2 == 0 else
              SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=100 + i, logprobs=2)
              for i in range(7)]
    params[3] = SamplingParams(max_tokens=10, presence_penalty=1.0, frequency_penalty=0.5, logprobs=0)
    params[5] = SamplingParams(max_tokens=12, stop=(full[len(full) // 2: len(full) // 2 + 3],), ignore_eos=True)
    got = llm.generate_batch(ids, params)
    for i in range(7):
        want = reference_generate(ref, ids[i], params[i])
        assert (got[i].token_ids, got[i].text, got[i].finish_reason) == \
            (want.token_ids, want.text, want.finish_reason), i
        assert got[i].logprobs == pytest.approx(want.logprobs, abs=1e-5) and got[i].prompt_token_ids == ids[i]
    assert got[5].finish_reason == "stop" and len(got[3].logprobs) == len(got[3].token_ids)
    assert llm.generate_ids(ids[1], params[1]).token_ids == got[1].token_ids


def test_llm_refuses_and_raises_as_the_engine_does(llms):
    """A prompt beyond max_model_len is refused before anything runs;
    a failed runner call raises its own exception after the other requests finish."""
    llm, _ = llms
    with pytest.raises(ContextLengthError, match="maximum context length is 128 tokens"):
        llm.generate_ids([5] * 129, SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError, match="2 sampling parameters for 1 prompts"):
        llm.generate_batch([[5, 6]], [SamplingParams(), SamplingParams()])
    failing = LLM.from_loaded(LoadedModel(manifest=None, model_config=llm.config, tokenizer=llm.tokenizer,
                                          runner=FailingRunner(llm.runner), dtype=llm.dtype))
    with pytest.raises(RuntimeError, match="simulated backend failure"):
        failing.generate_batch([[20, 21, 22], [13, 14, 15]], SamplingParams(max_tokens=6))
