"""Async scheduling beside sampling on the device (the neuron backend, torch-xla's CPU device): the pipelined step
hands its graph calls the rows' sampling inputs and takes token ids back (the logits stay on the device), and every
request gets what the synchronous loop gives it: the same tokens, text deltas, logprobs and finish and stop reasons,
under stop strings, stop ids, an abort, preemption with chunked prefill, structured outputs, penalties and seeded
sampling. Async scheduling is the neuron backend's default; `async_scheduling=False` turns it off.

Oracle: the synchronous engine (`async_scheduling=False`) over the same runner, itself checked against the host
sampler token for token (test_device_sampling.py). What each step moved device -> host is the runner's count
(checked against torch-xla's own transfer metrics in test_device_sampling.py).
"""

from __future__ import annotations

import re

import pytest
from tiny import make_tiny

from neuron_opt.api import LLM
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.runtime.engine import Engine, RequestOutput
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.structured import StructuredOutputs

pytestmark = pytest.mark.xla
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{2}"
BLOCK, MAX_LEN = 16, 64


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A one-layer tiny model with a tokenizer, compiled for the neuron backend with a pool of 5 blocks of 16 (and
    the null block), so a batch of long requests preempts."""
    root = tmp_path_factory.mktemp("async")
    ckpt = make_tiny("smollm-tok-1layer", root / "ckpt", tokenizer=True)
    compile_artifact(CompileRequest(model=str(ckpt), out=root / "art", backend="neuron", dtype="float32",
                                    use_cache=False, max_model_len=MAX_LEN, prefill_buckets=(16,),
                                    decode_buckets=(MAX_LEN,), batch_size=4, prefill_batch=2, block_size=BLOCK,
                                    num_kv_blocks=6), log=lambda s: None, progress=False)
    return LLM(root / "art")


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
        abort: tuple[str, int] | None = None) -> dict[str, list[RequestOutput]]:
    """Every request to its end; `abort`: (request id, tokens) aborts that request from its output callback once it
    has that many tokens (applied at the next step)."""
    outs: dict[str, list[RequestOutput]] = {str(i): [] for i in range(len(prompts))}

    def on_output(rid: str, o: RequestOutput) -> None:
        outs[rid].append(o)
        if abort is not None and rid == abort[0] and o.num_output_tokens == abort[1] and not o.finished:
            engine.abort(rid)

    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp, lambda o, rid=str(i): on_output(rid, o))
    for _ in range(3000):
        if not engine.step() and engine.num_unfinished == 0:
            break
    assert engine.num_unfinished == 0 and engine.kv_usage == 0 and engine._flight is None
    return outs


def stream(outs: list[RequestOutput]) -> list[tuple]:
    """What a client sees of a request. Logprobs to float rounding: a step's batch (so its graph's shape) may differ
    between the loops (a row the asynchronous one runs after a stop string, a prompt admitted a step later)."""
    return [(o.new_token_ids, o.text_delta, [(lp.token_id, pytest.approx(lp.logprob, abs=1e-4)) for lp in o.logprobs],
             o.finished, o.finish_reason, o.stop_reason, o.num_output_tokens) for o in outs]


def test_async_with_device_sampling_streams_equal_the_synchronous_loop(loaded):
    runner, tok = loaded.runner, loaded.tokenizer
    eos = loaded.eos_token_ids
    prompts = [list(tok(f"Person {i}: who comes next in line?")["input_ids"]) for i in range(6)]
    free = Engine(runner, tok, eos, async_scheduling=False)
    first = run(free, prompts[:1], [SamplingParams(max_tokens=16, ignore_eos=True)])["0"]
    text = "".join(o.text_delta for o in first)
    stop = text[len(text) // 2:len(text) // 2 + 3]  # text the greedy continuation is known to hold
    prompts[1] = prompts[0]
    params = [SamplingParams(max_tokens=16, stop=(stop,), logprobs=2),
              SamplingParams(max_tokens=16, stop_token_ids=(first[6].new_token_ids[0],)),
              SamplingParams(max_tokens=30, structured=StructuredOutputs(regex=REGEX), temperature=0.7, seed=2),
              SamplingParams(max_tokens=30, min_tokens=30, temperature=0.8, top_p=0.9, presence_penalty=0.5, seed=7),
              SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=3, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=40, frequency_penalty=0.4, ignore_eos=True)]
    assert Engine(runner, tok, eos).async_scheduling  # the neuron backend's default (docs/serving.md)
    st = runner.stats
    outs, engines = {}, {}
    for on in (False, True):
        engines[on] = Engine(runner, tok, eos, async_scheduling=on, max_num_batched_tokens=24)
        fallback, sampled = st.host_fallback, st.device_sampled
        outs[on] = run(engines[on], prompts, params, abort=("5", 20))
        assert st.host_fallback == fallback and st.device_sampled > sampled  # every row sampled in the graphs
        assert st.last_d2h_bytes < runner.vocab_size  # token ids came back, not logits
    want, got = outs[False], outs[True]
    for rid in want:
        assert stream(got[rid]) == stream(want[rid]), rid
    ends = {rid: (w[-1].finish_reason, w[-1].stop_reason) for rid, w in want.items()}
    assert ends["0"] == ("stop", stop) and ends["1"] == ("stop", params[1].stop_token_ids[0])
    assert ends["5"] == ("abort", None) and sum(len(o.new_token_ids) for o in want["5"]) == 20
    assert re.fullmatch(REGEX, "".join(o.text_delta for o in want["2"]))
    assert sum(len(o.new_token_ids) for o in want["3"]) == 30
    sync, pipelined = engines[False], engines[True]
    assert pipelined.stats.wait_s > 0 and pipelined.stats.preemptions > 0 and sync.stats.preemptions > 0
