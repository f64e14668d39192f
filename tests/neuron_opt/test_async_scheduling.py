"""Async scheduling (runtime/engine.py, runtime/pipeline.py): the engine that schedules and builds step N + 1 while
step N runs, and lands step N while step N + 1 runs, gives every request what the synchronous loop gives it: the
same tokens, the same streamed deltas, the same finish and stop reasons, under stop strings, stop ids, aborts,
preemption, chunked prefill with prefix caching, structured outputs, LoRA and speculative decoding (which turns
async scheduling off). The oracle is the synchronous engine (`async_scheduling=False`) on the same requests, itself
checked against the single-sequence reference loop (test_engine.py, test_structured_engine.py).

Tiny random models on the eager backend, one intra-op thread; each engine is stepped here (the graph calls run on
the engine's graph thread).
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import reference_generate

from neuron_opt.api import LLM, build_model
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig
from neuron_opt.errors import ConfigError
from neuron_opt.runtime.engine import Engine, RequestOutput
from neuron_opt.runtime.runner import ModelRunner
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.speculative import SpeculativeConfig
from neuron_opt.runtime.structured import GrammarState, StructuredOutputs

MAX_LEN, BS, K = 128, 8, 3
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{2}"


@pytest.fixture(scope="module")
def setup(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = LLM(tiny_dir("smollm-tok"), batch_size=1, max_model_len=MAX_LEN)
    system = "You are a careful assistant. Answer briefly and do not repeat yourself. " * 2
    prompts = [list(ref.tokenizer(system + f"Question {i}: what comes next?")["input_ids"]) for i in range(6)]
    free = reference_generate(ref, prompts[0], SamplingParams(max_tokens=16, ignore_eos=True))
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]  # text the greedy continuation is known to hold
    params = [
        SamplingParams(max_tokens=16, stop=(stop,), logprobs=2),
        SamplingParams(max_tokens=16, stop_token_ids=(free.token_ids[6],)),
        SamplingParams(max_tokens=9, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(max_tokens=40, structured=StructuredOutputs(regex=REGEX)),
        SamplingParams(max_tokens=12, min_tokens=12, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3, ignore_eos=True),
    ]
    prompts[1] = prompts[0]  # its greedy continuation holds the stop token
    yield ref, prompts, params, stop
    torch.set_num_threads(threads)


def engine_for(ref, num_blocks: int = 0, device_default: bool = False, **kw) -> Engine:
    """`device_default`: the executor leaves async scheduling's default on, as a device's does."""
    cache = CacheConfig(max_batch=4, max_model_len=MAX_LEN, block_size=BS, num_blocks=num_blocks)
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=MAX_LEN, max_batch=4, min_prefill=16,
                                 min_decode=16, num_speculative_tokens=K)
    model = build_model(ref.config, dict(ref.runner.executor.model.state_dict()), MAX_LEN, torch.float32)
    executor = EagerExecutor(model, cache)
    if device_default:
        executor.async_scheduling = True
    runner = ModelRunner(executor, buckets, cache, ref.config.vocab_size)
    return Engine(runner, ref.tokenizer, ref.eos_token_ids, **kw)


def run(engine: Engine, prompts, params, on_output=None) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {str(i): [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        rid = str(i)
        engine.add_request(rid, p, sp, lambda o, rid=rid: (outs[rid].append(o), on_output and on_output(engine, o)))
    for _ in range(3000):
        if not engine.step() and engine.num_unfinished == 0:
            break
    assert engine.num_unfinished == 0 and engine.kv_usage == 0 and engine._flight is None
    return outs


def stream(outs: list[RequestOutput]) -> list[tuple]:
    """What a client sees of a request: each output's tokens, text delta, logprobs and end. Logprobs to float
    rounding: a step's batch (so its graph's shape) may differ between the loops, e.g. a row the asynchronous one
    runs after a stop string, or a prompt admitted a step later."""
    return [(o.new_token_ids, o.text_delta, [(lp.token_id, pytest.approx(lp.logprob, abs=1e-4)) for lp in o.logprobs],
             o.finished, o.finish_reason, o.stop_reason, o.num_output_tokens) for o in outs]


FEATURES = {
    "plain": dict(max_num_batched_tokens=2048),
    "chunked+prefix": dict(max_num_batched_tokens=24),  # prompts in chunks, the shared system prompt cached
    "preemption": dict(num_blocks=-1, max_num_batched_tokens=64, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_async_streams_equal_the_synchronous_loop(setup, name):
    ref, prompts, params, stop = setup
    features = FEATURES[name]
    if features.get("num_blocks") == -1:  # room for three prompts and a block: the newest are preempted
        features = {**features, "num_blocks": 2 + 3 * -(-max(len(p) for p in prompts) // BS)}
    sync = engine_for(ref, async_scheduling=False, **features)
    want = run(sync, prompts, params)
    assert not sync.async_scheduling and not engine_for(ref).async_scheduling  # the eager backend's default
    engine = engine_for(ref, async_scheduling=True, **features)
    got = run(engine, prompts, params)
    for rid in want:
        assert stream(got[rid]) == stream(want[rid]), rid
    ends = {rid: (w[-1].finish_reason, w[-1].stop_reason) for rid, w in want.items()}
    assert ends["0"] == ("stop", stop) and ends["1"] == ("stop", params[1].stop_token_ids[0])  # both rules ran
    assert re.fullmatch(REGEX, "".join(o.text_delta for o in want["3"]))
    assert engine.stats.wait_s > 0
    # the steps themselves may differ: the asynchronous loop schedules step N + 1 before step N's finished requests
    # give back their blocks and budget
    if name == "preemption":
        assert engine.stats.preemptions > 0 and sync.stats.preemptions > 0
    if name == "plain":  # one row more than the synchronous loop ran: request 0's, after its stop string, dropped
        assert engine.stats.decode_rows == sync.stats.decode_rows + 1
        assert engine.stats.prefills == sync.stats.prefills


def test_no_text_past_a_stop_string_is_streamed(setup):
    ref, prompts, params, stop = setup
    want = run(engine_for(ref, async_scheduling=False), prompts[:1], params[:1])["0"]
    seen: list[RequestOutput] = []
    engine = engine_for(ref, async_scheduling=True)
    got = run(engine, prompts[:1], params[:1], on_output=lambda e, o: seen.append(o))["0"]
    text = "".join(o.text_delta for o in got)
    assert text == "".join(o.text_delta for o in want) and stop not in text
    full = reference_generate(ref, prompts[0], SamplingParams(max_tokens=16, ignore_eos=True))
    assert full.text.startswith(text + stop)  # the stream ends exactly before the stop string
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]  # nothing after the end
    assert [t for o in seen for t in o.new_token_ids] == full.token_ids[:len(seen)]
    assert engine.stats.decode_rows == len(seen)  # the row after the stop ran, and its token was dropped


def test_abort_mid_stream_stops_the_stream_where_the_synchronous_loop_does(setup):
    ref, prompts, params, _ = setup
    params = [SamplingParams(max_tokens=14, ignore_eos=True)] * 3

    def abort_after_three(engine: Engine, o: RequestOutput) -> None:
        if o.request_id == "1" and o.num_output_tokens == 3:
            engine.abort("1")  # from the callback, on the engine's thread: applied at the next step

    want = run(engine_for(ref, async_scheduling=False), prompts[:3], params, abort_after_three)
    engine = engine_for(ref, async_scheduling=True)
    got = run(engine, prompts[:3], params, abort_after_three)
    assert {rid: stream(o) for rid, o in got.items()} == {rid: stream(o) for rid, o in want.items()}
    aborted = got["1"]
    assert [len(o.new_token_ids) for o in aborted] == [1, 1, 1, 0] and aborted[-1].finish_reason == "abort"
    assert all(len(o) == 14 and o[-1].finish_reason == "length" for rid, o in got.items() if rid != "1")


def test_structured_masks_are_filled_while_the_graph_runs(setup, monkeypatch):
    """A grammar row's mask for a step is filled on the engine thread while the step's graph call runs
    (`GrammarState.prepare`, once the token before it is known); the sampler takes that row, and the text still
    matches the grammar."""
    ref, prompts, params, _ = setup
    used: list[bool] = []
    fill = GrammarState.fill

    def spy(self, bitmask, row):
        used.append(self._next is not None)
        fill(self, bitmask, row)

    monkeypatch.setattr(GrammarState, "fill", spy)
    got = run(engine_for(ref, async_scheduling=True), prompts[3:4], params[3:4])["0"]
    assert re.fullmatch(REGEX, "".join(o.text_delta for o in got)) and got[-1].finish_reason == "stop"
    assert len(used) == len(got) and all(used)  # every token's mask was the one filled while its graph ran


def test_lora_rows_equal_the_synchronous_loop(tmp_path):
    pytest.importorskip("peft")
    from peft_adapters import make_adapter
    from tiny import make_tiny

    from neuron_opt.lora.config import LoraConfig

    base = make_tiny("qwen2", tmp_path / "base", tokenizer=True)
    adapter = make_adapter(base, tmp_path / "a", 4, 8, ["q_proj", "v_proj", "down_proj"], 1)
    llm = LLM(base, batch_size=4, max_model_len=64, lora=LoraConfig(max_loras=1, max_lora_rank=4))
    llm.loras.register("a", adapter)
    prompts = [[5, 9, 13, 2, 44, 71, 8], [17, 3, 99, 120, 6], [30, 31, 32, 33, 34], [250, 11, 7]]
    loras = ["a", None, "a", None]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)

    def go(async_scheduling: bool) -> dict[str, list[tuple]]:
        engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, loras=llm.loras,
                        async_scheduling=async_scheduling)
        outs: dict[str, list[RequestOutput]] = {str(i): [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, sp, outs[str(i)].append, lora=loras[i])
        while engine.num_unfinished:
            engine.step()
        return {rid: stream(o) for rid, o in outs.items()}

    want = go(False)
    assert go(True) == want
    assert want["0"] != want["1"]  # the adapter changed the text


def test_speculative_decoding_runs_synchronously(setup):
    ref, prompts, params, _ = setup
    spec = SpeculativeConfig(K, adaptive=False)
    assert engine_for(ref, device_default=True).async_scheduling
    engine = engine_for(ref, device_default=True, speculative=spec)
    assert not engine.async_scheduling  # its proposals need each step's sampled tokens
    got = run(engine, prompts, params)
    assert engine.spec_stats.verify_steps > 0 and engine.stats.wait_s == 0
    want = run(engine_for(ref, speculative=spec, async_scheduling=False), prompts, params)
    assert {rid: stream(o) for rid, o in got.items()} == {rid: stream(o) for rid, o in want.items()}
    with pytest.raises(ConfigError, match="async_scheduling: speculative decoding"):
        engine_for(ref, speculative=spec, async_scheduling=True)


def test_the_flag_reaches_serve_run_batch_generate_and_llm(setup, tiny_dir):
    from neuron_opt.cli import build_parser
    from neuron_opt.commands.serve_engine import build_engine

    path = str(tiny_dir("smollm-tok"))
    parser = build_parser()
    for command, extra in (("serve", []), ("run-batch", ["-i", "x", "-o", "y"]), ("generate", ["--prompt", "hi"])):
        for flag, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
            assert parser.parse_args([command, "--model", path, *extra, *flag]).async_scheduling is want, command
    args = parser.parse_args(["serve", "--model", path, "--max-num-seqs", "2", "--max-model-len", "64",
                              "--async-scheduling"])
    assert build_engine(args).async_scheduling
    args.async_scheduling = None
    assert not build_engine(args).async_scheduling  # the eager backend's default
    ref, prompts, _, _ = setup
    sp = SamplingParams(max_tokens=6, temperature=0.9, seed=1, stop=("e",))
    outs = [LLM(path, batch_size=4, max_model_len=MAX_LEN, async_scheduling=a).generate_batch(prompts[:4], sp)
            for a in (True, False)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs[0]] == \
        [(o.token_ids, o.text, o.finish_reason) for o in outs[1]]


class FailingDecodes:
    """Delegates to a real runner; a decode call with a row whose input token is `BAD` raises (a backend failure)."""

    BAD = 42

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def decode(self, rows, candidates=None):
        if any(r.token == self.BAD for r in rows):
            raise RuntimeError("simulated decode failure")
        return self._runner.decode(rows, candidates)

    def run_decode(self, bucket, inputs, num_rows, candidates=None):
        if bool((inputs.input_ids[:num_rows, 0] == self.BAD).any()):
            raise RuntimeError("simulated decode failure")
        return self._runner.run_decode(bucket, inputs, num_rows, candidates)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_decode_row_fails_only_its_request(setup, async_scheduling):
    """The batched decode call fails; each row runs again alone and only the row that fails fails."""
    ref, prompts, _, _ = setup
    base = engine_for(ref)
    engine = Engine(FailingDecodes(base.runner), ref.tokenizer, ref.eos_token_ids, async_scheduling=async_scheduling)
    bad = SamplingParams(max_tokens=6, logit_bias=((FailingDecodes.BAD, 100.0),))  # its decode rows carry BAD
    good = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((FailingDecodes.BAD, -100.0),))
    outs = run(engine, prompts[:3], [good, bad, good])
    assert outs["1"][-1].finish_reason == "error" and "decode failed: simulated" in outs["1"][-1].error
    for rid in ("0", "2"):
        want = reference_generate(ref, prompts[int(rid)], good)
        assert [t for o in outs[rid] for t in o.new_token_ids] == want.token_ids
