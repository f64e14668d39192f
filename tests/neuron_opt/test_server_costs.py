"""Work a request makes expensive, bounded before it is done, each against a live server (tiny random model, real
tokenizer, loopback) with a normal request served beside it: grammar counts capped (schemas, patterns, regexes,
EBNF, structural tags), grammar compiles in their own pool with a timeout and after the queue check, input nested
too deeply to parse a 400, prompt ids checked against the model's vocabulary, and one request's failure inside a
prefill, decode or verify call isolated to it."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import eager_runner, live_server, one_thread_llm
from tiny import make_tiny

from neuron_opt.api import LLM
from neuron_opt.runtime.engine import Engine
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.structured import StructuredOutputs
from neuron_opt.server.limits import GRAMMAR_QUEUE_PER_WORKER, ServerLimits

C, CHAT = "/v1/completions", "/v1/chat/completions"
CAP = 8  # the servers' --max-grammar-repeat here
SLOW_REGEX = "([a-z]{{0,1000}}[0-9]){{0,{}}}"  # compiles in about 0.3 s on a 2-core machine (1,000-odd repeats)
FLOOD_REGEX = "([a-z]{{0,{}}}[0-9]){{0,1000}}"  # each inner bound compiles anew, about 0.2 s (xgrammar reuses the rest)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with one_thread_llm(tiny_dir("smollm-tok"), 2, 256) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with live_server(llm, max_num_seqs=2, limits=ServerLimits(max_grammar_repeat=CAP)) as (url, engine):
        yield url, engine


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120)


def complete(url: str, **kw) -> httpx.Response:
    return post(url + C, {"prompt": "Answer:", "max_tokens": 48, "temperature": 0, **kw})


def served_beside(url: str, attack, **normal) -> httpx.Response:
    """Run `attack()` while a normal request (`normal`: its fields) is served; return the attack's response after
    checking the normal one got its whole answer."""
    with ThreadPoolExecutor(2) as pool:
        normal = pool.submit(complete, url, max_tokens=12, ignore_eos=True, **normal)
        r = attack()
        ok = normal.result()
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12, ok.text
    return r


# ---- counts capped ---------------------------------------------------------------------------------------------


def test_an_upper_bound_past_the_cap_is_lowered_to_it(server):
    url, _ = server
    r = served_beside(url, lambda: complete(url, guided_json={"type": "string", "maxLength": 10**9}))
    assert r.status_code == 200, r.text
    out = json.loads(r.json()["choices"][0]["text"])
    assert isinstance(out, str) and len(out) <= CAP
    items = complete(url, guided_json={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                       "maxItems": 10**6, "minItems": 1})
    assert items.status_code == 200, items.text
    assert 1 <= len(json.loads(items.json()["choices"][0]["text"])) <= CAP


@pytest.mark.parametrize("field, value, count", [
    ("guided_json", {"type": "string", "minLength": 10**6}, "'minLength' 1000000"),
    ("guided_json", {"type": "array", "minItems": 9}, "'minItems' 9"),
    ("guided_json", {"type": "string", "pattern": "^a{100}$"}, "{100}"),
    ("guided_regex", "a{9}", "{9}"),
    ("guided_regex", "[ab]{99999999999999999999,}", "{99999999999999999999}"),
    ("guided_grammar", 'root ::= "a"{20,30}', "{20}"),
])
def test_a_lower_bound_past_the_cap_is_a_400_naming_the_field(server, field, value, count):
    url, _ = server
    r = served_beside(url, lambda: complete(url, **{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and count in err["message"] and f"({CAP})" in err["message"], err


def test_repeats_in_regexes_and_grammars_are_capped_outside_literals(server):
    url, _ = server
    r = complete(url, guided_regex="[ab]{1,100000}c", ignore_eos=True)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.endswith("c") and 2 <= len(text) <= CAP + 1 and set(text[:-1]) <= {"a", "b"}, text
    # braces inside a class or a string literal are characters, not repeats
    r = complete(url, guided_grammar='root ::= "{99}" [a-z]{1,50000} "."', ignore_eos=True)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.startswith("{99}") and text.endswith(".") and len(text) <= 4 + CAP + 1, text


def test_a_structural_tag_goes_through_the_same_checks(server):
    url, _ = server

    def tag(schema: dict) -> str:
        content = {"type": "json_schema", "json_schema": schema}
        return json.dumps({"type": "structural_tag",
                           "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": content}})

    r = served_beside(url, lambda: complete(url, structured_outputs={"structural_tag": tag(
        {"type": "string", "maxLength": 10**9})}))
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.startswith("<a>") and text.endswith("</a>") and len(json.loads(text[3:-4])) <= CAP, text
    r = complete(url, structured_outputs={"structural_tag": tag({"type": "string", "minLength": 100})})
    assert r.status_code == 400 and "'minLength' 100" in r.json()["error"]["message"], r.text
    r = complete(url, structured_outputs={"structural_tag": tag({"type": "string", "contentSchema": {}})})
    assert r.status_code == 400 and "'contentSchema'" in r.json()["error"]["message"], r.text


def test_the_cap_applies_to_the_library_too():
    spec = StructuredOutputs(json={"type": "array", "maxItems": 10**6}, max_repeat=5).spec()
    assert json.loads(spec.text)["maxItems"] == 5
    assert StructuredOutputs(regex=r"\{5000}[{9999}]a{2,9999}", max_repeat=5).spec().text == r"\{5000}[{9999}]a{2,5}"


# ---- nesting -------------------------------------------------------------------------------------------------


def test_input_nested_too_deeply_is_a_400(server):
    url, _ = server
    deep = "[" * 100_000 + "]" * 100_000
    r = served_beside(url, lambda: complete(url, guided_json=deep))
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    r = complete(url, structured_outputs={"structural_tag": deep})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = post(url + CHAT, {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    # nested past the body parser's own limit: a 400 naming the JSON
    r = httpx.post(url + C, content=b'{"prompt": "x", "guided_json": ' + deep.encode() + b"}",
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]["message"], r.text


# ---- the grammar pool ----------------------------------------------------------------------------------------


def test_a_grammar_past_the_compile_timeout_fails_only_its_request(llm):
    limits = ServerLimits(grammar_compile_timeout=0.01)
    with live_server(llm, max_num_seqs=2, limits=limits) as (url, _):
        r = served_beside(url, lambda: complete(url, guided_regex=SLOW_REGEX.format(1001)))
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        assert "did not compile within 0.01 s" in r.json()["error"]["message"]


def test_compiles_past_the_pool_bound_are_503_and_other_requests_go_on(llm):
    limits = ServerLimits(max_grammar_compiles=1, grammar_compile_timeout=0.01)
    n = GRAMMAR_QUEUE_PER_WORKER + 8
    with live_server(llm, max_num_seqs=2, limits=limits) as (url, _):
        barrier = threading.Barrier(n)

        def attack(i: int) -> httpx.Response:
            barrier.wait()
            return complete(url, max_tokens=2, guided_regex=SLOW_REGEX.format(1002 + i))

        with ThreadPoolExecutor(n) as pool:
            rs = served_beside(url, lambda: list(pool.map(attack, range(n))))
        codes = [r.status_code for r in rs]
        # each compile holds the one worker after its request timed out; how many find the queue full depends on
        # the machine's speed (test_the_grammar_pool_bound pins the bound itself)
        assert set(codes) <= {400, 503} and 400 in codes, codes
        assert all(r.headers["retry-after"] == "1" for r in rs if r.status_code == 503)


CAP_FLOOD = 4000  # inner bounds of FLOOD_REGEX stay under the default --max-grammar-repeat
LATENCY_FACTOR = 4  # the most a grammar flood may slow other requests (median over several, against a baseline)


def test_a_grammar_flood_keeps_other_requests_latency_within_a_factor(llm):
    """Clients that send a costly grammar at once each time their last one is refused fill the grammar pool for the
    whole measurement; meanwhile a plain request's median latency stays within LATENCY_FACTOR of its median with
    no flood (the pool's one worker takes at most one core; compiles run in neither the event loop nor the engine
    thread, nor the default executor that tokenizes)."""
    import itertools
    import statistics
    import time

    limits = ServerLimits(max_grammar_compiles=1, grammar_compile_timeout=0.05)
    with live_server(llm, max_num_seqs=2, limits=limits) as (url, _):
        def timed() -> float:
            t = time.monotonic()
            r = complete(url, max_tokens=8, ignore_eos=True)
            assert r.status_code == 200, r.text
            return time.monotonic() - t

        timed()
        baseline = statistics.median(timed() for _ in range(7))
        stop, codes, sizes = threading.Event(), [], itertools.count(1000)  # a new regex each time: no cache hit

        def flood() -> None:
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    codes.append(http.post(url + C, json={"prompt": "x", "max_tokens": 2, "guided_regex":
                                                          FLOOD_REGEX.format(next(sizes) % CAP_FLOOD)}).status_code)

        clients = [threading.Thread(target=flood) for _ in range(4)]
        for t in clients:
            t.start()
        try:
            while len(codes) < 4:  # the flood is on
                time.sleep(0.01)
            flooded = statistics.median(timed() for _ in range(7))
        finally:
            stop.set()
            for t in clients:
                t.join(120)
    assert flooded <= LATENCY_FACTOR * baseline, (flooded, baseline)
    assert 400 in codes and set(codes) <= {200, 400, 503}, codes  # compiles timed out (some may be quick)


def test_the_grammar_pool_bound():
    """The pool's bound, exactly: compiles that cannot finish until released (a stand-in for grammars that take
    long) fill the worker and its queue; one more is a QueueFullError at once; once they end, the pool serves."""
    import asyncio

    from neuron_opt.errors import QueueFullError
    from neuron_opt.server.grammar_pool import GrammarPool

    release = threading.Event()
    pool = GrammarPool(lambda params: release.wait(60) and params, ServerLimits(max_grammar_compiles=2,
                                                                                   grammar_compile_timeout=60))
    bound = 2 * (1 + GRAMMAR_QUEUE_PER_WORKER)

    async def run() -> list:
        held = [asyncio.ensure_future(pool.compile(i)) for i in range(bound)]
        await asyncio.sleep(0)  # every one has taken its place
        with pytest.raises(QueueFullError):
            await pool.compile(-1)
        release.set()
        done = await asyncio.gather(*held)
        return [*done, await pool.compile(bound)]

    assert asyncio.run(run()) == [*range(bound), bound]


def test_a_full_queue_refuses_before_compiling(llm):
    with live_server(llm, max_num_seqs=1, max_waiting=0) as (url, _):
        started = threading.Event()

        def hold() -> None:
            with httpx.stream("POST", url + C, json={"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                                      "stream": True}, timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()

        t = threading.Thread(target=hold)
        t.start()
        assert started.wait(60)
        r = complete(url, guided_regex="(")  # would be a 400 if it compiled
        t.join(120)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text


# ---- prompt ids ---------------------------------------------------------------------------------------------


def test_prompt_ids_are_checked_against_the_models_vocabulary(tmp_path):
    small = LLM(make_tiny("qwen3", tmp_path / "q", tokenizer=True), batch_size=2, max_model_len=64)
    vocab = small.runner.vocab_size
    assert len(small.tokenizer) > vocab  # the tokenizer knows ids the model has no embedding for
    with live_server(small, max_num_seqs=2) as (url, _):
        r = served_beside(url, lambda: complete(url, prompt=[5, vocab]), prompt=[5, 6, 7])
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert complete(url, prompt=[5, vocab - 1], max_tokens=2).status_code == 200
        r = post(url + CHAT, {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text  # its template's ids


def test_a_failing_chunk_in_a_batched_prefill_fails_only_its_request(tiny_dir):
    from transformers import AutoTokenizer

    path = tiny_dir("smollm-tok")
    runner = eager_runner(path, max_model_len=64, max_batch=2, prefill_batch=2)
    tok = AutoTokenizer.from_pretrained(path)
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(prompts: dict[str, list[int]]) -> dict:
        engine = Engine(runner, tok, (2,), max_num_seqs=2)
        outs: dict = {rid: [] for rid in prompts}
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, params, outs[rid].append)
        while engine.step() or engine.num_unfinished:
            pass
        assert engine.num_unfinished == 0 and engine.stats.prefills >= len(prompts)
        return outs

    alone = run({"good": [1, 5, 9, 13]})["good"]
    both = run({"bad": [1, 5, runner.vocab_size + 7], "good": [1, 5, 9, 13]})
    assert both["bad"][-1].finish_reason == "error" and "prefill failed" in both["bad"][-1].error
    assert [t for o in both["good"] for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]
    assert both["good"][-1].finish_reason == "length"


@pytest.mark.parametrize("what", ["decode", "verify"])
def test_a_failing_row_in_a_batched_decode_or_verify_fails_only_its_request(tiny_dir, what):
    """A model whose embedding table is shorter than its output vocabulary: a request that samples a token past
    the table fails when that token is fed back, in a decode (or, speculating, a verify) call batched with a good
    request, which goes on with the tokens it makes alone."""
    from transformers import AutoTokenizer

    from neuron_opt.runtime.speculative import SpeculativeConfig

    path = tiny_dir("smollm-tok")
    runner = eager_runner(path, max_model_len=64, max_batch=2, prefill_batch=2, num_speculative_tokens=2)
    tok = AutoTokenizer.from_pretrained(path)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    good, bad = [1, 5, 9, 13], [7, 7, 7, 7]  # the tiny model repeats 13 after the good one (prompt lookup finds it)
    spec = SpeculativeConfig(2, adaptive=False) if what == "verify" else None

    def run(prompts: dict[str, list[int]]) -> tuple[dict, Engine]:
        engine = Engine(runner, tok, (2,), max_num_seqs=2, speculative=spec)
        outs: dict = {rid: [] for rid in prompts}
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, params, outs[rid].append)
        while engine.step() or engine.num_unfinished:
            pass
        return outs, engine

    def tokens(outs: list) -> list[int]:
        return [t for o in outs for t in o.new_token_ids]

    ref = {rid: tokens(o) for rid, o in run({"good": good, "bad": bad})[0].items()}
    table = 1 + max(good + ref["good"])
    assert max(bad) < table <= ref["bad"][0]  # the bad request's first token is past the shortened table
    embed = runner.executor.model.model.embed_tokens
    full = embed.weight
    embed.weight = torch.nn.Parameter(full[:table], requires_grad=False)
    try:
        outs, engine = run({"good": good, "bad": bad})
    finally:
        embed.weight = full
    err = outs["bad"][-1]
    assert err.finish_reason == "error" and err.error.startswith(f"{what} failed: index out of range"), err
    assert tokens(outs["bad"]) == ref["bad"][:1]  # its prefill's token, then the failing call
    assert tokens(outs["good"]) == ref["good"] and outs["good"][-1].finish_reason == "length"
    assert engine.num_unfinished == 0
    if spec is not None:
        assert engine.spec_stats.verify_steps >= 2 and engine.spec_stats.accepted_tokens > 0


# ---- serve's flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--enable-lora-runtime-loading"], "--enable-lora-runtime-loading: give --lora-runtime-root DIR"),
    (["--lora-runtime-root", "."], "--lora-runtime-root: needs --enable-lora-runtime-loading"),
    (["--max-cpu-loras", "3"], "--max-cpu-loras: needs --enable-lora-runtime-loading"),
    (["--enable-lora-runtime-loading", "--lora-runtime-root", "/no/such/dir"], "is not a directory"),
    (["--max-connections", "0"], "--max-connections: must be >= 1"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive: must be >= 1"),
    (["--grammar-compile-timeout", "0"], "grammar_compile_timeout: must be > 0"),
    (["--max-grammar-repeat", "0"], "max_grammar_repeat: must be >= 1"),
    (["--data-parallel", "2", "--max-connections", "5"], "--max-connections: the single-process server's"),
])
def test_serve_refuses_bad_bound_flags_before_loading(argv, message, capsys):
    from neuron_opt.cli import main

    assert main(["serve", "--model", "default", *argv]) == 2
    assert message in capsys.readouterr().err


def test_vllms_env_var_turns_runtime_lora_loading_on(monkeypatch, capsys):
    from neuron_opt import envs
    from neuron_opt.cli import main

    monkeypatch.setattr(envs, "ALLOW_RUNTIME_LORA_UPDATING", True)  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=true
    assert main(["serve", "--model", "default"]) == 2
    assert "give --lora-runtime-root DIR" in capsys.readouterr().err
