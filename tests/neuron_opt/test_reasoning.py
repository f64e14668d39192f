"""Reasoning parsers (server/reasoning.py): the split of replies fed token by token through the real tokenizer, the
grammar that starts where thinking ends, and chat through the official `openai` client against a live server.

Oracles: `str.partition` at the markers for the split; the xgrammar matcher for the grammar; the server's own
/v1/completions on the prompt ids `LLM.encode_chat` renders (greedy: the same text) for what the chat reply
splits; the streamed chunks against the non-streamed reply; `jsonschema` for the tool call's arguments. The model
is the tiny random one with the real tokenizer; a `logit_bias` on the tokens of `</think>` makes it close its
thinking.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from helpers import live_server

from neuron_opt.api import LLM
from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.runtime.structured import GrammarCompiler, StructuredOutputs
from neuron_opt.server.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    Start,
    after_reasoning,
    make_reasoning_parser,
    reasoning_parser_for_template,
)

MODEL = "tiny"
# ChatML whose generation prompt opens the thinking, or closes it at once with enable_thinking=false (as Qwen3's)
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
MSGS = [{"role": "user", "content": "Why is the sky blue?"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False}}}

REPLIES = [  # (parser, where the reply starts, reply, its reasoning, its content)
    ("deepseek_r1", Start.INSIDE, "Let me think: 2+2.\n</think>\n\nIt is 4.", "Let me think: 2+2.\n", "\n\nIt is 4."),
    ("deepseek_r1", Start.INSIDE, "<think>hmm</think>ok", "hmm", "ok"),
    ("deepseek_r1", Start.INSIDE, "still thinking <thi", "still thinking <thi", ""),
    ("qwen3", Start.MAYBE, "<think>\nsmall < large\n</think>\n\nYes.", "\nsmall < large\n", "\n\nYes."),
    ("qwen3", Start.MAYBE, "<b>No</b> thinking here.", None, "<b>No</b> thinking here."),
    ("qwen3", Start.NONE, "plain </think> text", None, "plain </think> text"),
    ("qwen3", Start.INSIDE, "\n<think>again</think>done", "again", "done"),
    ("qwen3", Start.INSIDE, "no end yet", "no end yet", ""),
    ("granite", Start.MAYBE, "Here is my thought process: a, b. Here is my response: c.", " a, b. ", " c."),
    ("granite", Start.MAYBE, "Here's my thought process:x Here's my response:y", "x ", "y"),
    ("openai_gptoss", Start.MAYBE, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Answer.", "Think.", "Answer."),
]


@pytest.fixture(scope="module")
def tok():
    return open_checkpoint("default").tokenizer()


@pytest.mark.parametrize("name,start,reply,reasoning,content", REPLIES)
def test_split_token_by_token(tok, name, start, reply, reasoning, content):
    """Fed the reply's tokens one at a time, the reasoning deltas add up to the final split's reasoning, the
    content only grows, and the final split is the text around the markers."""
    parser = REASONING_PARSERS[name]
    ids = tok(reply, add_special_tokens=False)["input_ids"]
    stream, thought, last = ReasoningStream(parser, start), "", ""
    for k in range(1, len(ids) + 1):
        delta, text = stream.feed(tok.decode(ids[:k]), k == len(ids), k)
        assert text.startswith(last), (text, last)
        thought, last = thought + delta, text
    final = parser.split(reply, start, True)
    assert (final.reasoning, final.content) == (reasoning, content)
    assert thought == (reasoning or "") and last == content
    if reasoning is None:
        assert stream.tokens == 0
    elif final.ended:  # the tokens up to the one completing the end marker (harmony: the final channel's header)
        end = "final<|message|>" if name == "openai_gptoss" else next(e for e in parser.ends if e in reply)
        assert stream.tokens == next(k for k in range(1, len(ids) + 1) if end in tok.decode(ids[:k]))
    else:
        assert stream.tokens == len(ids)


def test_parser_from_template(tok):
    assert reasoning_parser_for_template(THINK_TEMPLATE) == "qwen3"
    assert reasoning_parser_for_template("<｜Assistant｜><think>\n{{ x }}</think>") == "deepseek_r1"
    assert reasoning_parser_for_template("<|start|>assistant<|channel|>final<|message|>") == "openai_gptoss"
    assert reasoning_parser_for_template("Here is my thought process: ... Here is my response:") == "granite"
    assert reasoning_parser_for_template("</think> <|channel|>") is None  # ambiguous: --reasoning-parser decides
    assert make_reasoning_parser(None, tok) is None  # SmolLM2's template has no thinking
    assert make_reasoning_parser("granite", tok) is REASONING_PARSERS["granite"]
    with pytest.raises(ValueError, match="--reasoning-parser: unknown parser 'r2'"):
        make_reasoning_parser("r2", tok)


def test_grammar_starts_after_thinking(tok):
    """The JSON schema binds only after `</think>`; where the reply may not think, it binds from the start too."""
    compiler = GrammarCompiler(tok, 49152, (tok.eos_token_id,))
    schema = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    qwen3 = REASONING_PARSERS["qwen3"]

    def accepts(structured: StructuredOutputs, text: str) -> bool:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return compiler.state(structured).valid_prefix(ids) == len(ids)

    inside = after_reasoning(schema, qwen3, Start.INSIDE)
    assert accepts(inside, 'free {text} here</think>{"a": 12}')
    assert not accepts(inside, '{"a": 12}') and not accepts(inside, 'x</think>{"a": "no"}')
    maybe = after_reasoning(schema, qwen3, Start.MAYBE)
    assert accepts(maybe, '{"a": 1}') and accepts(maybe, '<think>hm</think>{"a": 1}')
    assert not accepts(maybe, 'hm</think>{"a": 1}')
    assert after_reasoning(schema, qwen3, Start.NONE) is schema
    with pytest.raises(ValueError, match="openai_gptoss"):
        after_reasoning(schema, REASONING_PARSERS["openai_gptoss"], Start.MAYBE)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(tiny_dir("smollm-tok"), batch_size=2, max_model_len=768)
    llm.tokenizer.chat_template = THINK_TEMPLATE
    yield llm
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(llm):
    parser = make_reasoning_parser(None, llm.tokenizer)  # from the template: qwen3
    with live_server(llm, max_num_seqs=2, reasoning_parser=parser) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def _completion(client, llm, kwargs):
    ids = llm.encode_chat(MSGS, None, kwargs)
    return client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)


def test_thinking_on_and_off(llm, client):
    """The template opens the thinking: the whole greedy reply is reasoning. `enable_thinking: false` (passed to
    the template) closes it in the prompt: the reply is content."""
    on = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0)
    raw = _completion(client, llm, None)
    msg = on.choices[0].message
    assert msg.content is None and msg.reasoning == raw.choices[0].text
    assert msg.model_extra["reasoning_content"] == msg.reasoning
    assert on.usage.completion_tokens_details.reasoning_tokens == on.usage.completion_tokens == 12
    off = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    raw = _completion(client, llm, {"enable_thinking": False})
    assert raw.choices[0].text and off.choices[0].message.content == raw.choices[0].text
    assert off.choices[0].message.reasoning is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    hidden = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                            extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.reasoning is None and hidden.usage.completion_tokens == 12


def _end_bias(llm):
    return {str(t): 100 for t in llm.tokenizer("</think>", add_special_tokens=False)["input_ids"]}


def test_tool_call_after_thinking(llm, client):
    """With the end marker's tokens favoured, the reply thinks in them until it writes `</think>`; the grammar then
    forces the call. Streamed: the reasoning deltas come first and the chunks add up to the non-streamed reply."""
    kw = dict(model=MODEL, messages=MSGS, tools=[ADD], tool_choice="required", temperature=1.0, seed=3,
              max_tokens=200, logprobs=True, logit_bias=_end_bias(llm))
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    tokens = [t.token for t in c.logprobs.content]
    closed = next(k for k in range(1, len(tokens) + 1) if "</think>" in "".join(tokens[:k]))
    assert c.message.reasoning == "".join(tokens)[:"".join(tokens).index("</think>")]
    assert r.usage.completion_tokens_details.reasoning_tokens == closed
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "add"
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), ADD["function"]["parameters"])

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    kinds, thought, calls = [], "", {}
    for ch in chunks[:-1]:
        d = ch.choices[0].delta
        if d.model_extra.get("reasoning"):
            kinds.append("reasoning")
            thought += d.model_extra["reasoning"]
            assert d.model_extra["reasoning_content"] == d.model_extra["reasoning"]
        for tc in d.tool_calls or ():
            kinds.append("tool")
            calls.setdefault(tc.index, ["", ""])
            calls[tc.index][0] += tc.function.name or ""
            calls[tc.index][1] += tc.function.arguments or ""
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning") and "tool" in kinds
    assert thought == c.message.reasoning
    assert [tuple(v) for v in calls.values()] == [(t.function.name, t.function.arguments)
                                                  for t in c.message.tool_calls]
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == closed


def test_structured_output_after_thinking(llm, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=1.0, seed=5, max_tokens=200, logit_bias=_end_bias(llm),
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    msg = r.choices[0].message
    assert "</think>" not in msg.reasoning and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.content), schema)


def test_thinking_token_budget_forces_the_end_of_thinking(llm, client):
    """vLLM's `thinking_token_budget`: the greedy reply thinks its first `budget` tokens as it would unbudgeted (the
    server's raw completion of the same prompt), then the tokens of `</think>` are forced and the answer follows;
    streamed the same. Budget 0 closes the thinking at once; with the thinking off in the prompt nothing changes."""
    end = [llm.tokenizer.decode([t]) for t in llm.tokenizer("</think>", add_special_tokens=False)["input_ids"]]
    raw = client.completions.create(model=MODEL, prompt=llm.encode_chat(MSGS), max_tokens=6, temperature=0,
                                    logprobs=0).choices[0].logprobs.tokens
    for budget in (6, 0):
        kw = dict(model=MODEL, messages=MSGS, max_tokens=6 + len(end) + 4, temperature=0, logprobs=True,
                  extra_body={"thinking_token_budget": budget})
        r = client.chat.completions.create(**kw)
        tokens = [t.token for t in r.choices[0].logprobs.content]
        assert tokens[:budget] == raw[:budget] and tokens[budget:budget + len(end)] == end
        msg = r.choices[0].message
        assert (msg.reasoning or "") == "".join(tokens[:budget]) and msg.content == "".join(tokens[budget + len(end):])
        assert msg.content and r.usage.completion_tokens_details.reasoning_tokens == budget + len(end)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    off = dict(model=MODEL, messages=MSGS, max_tokens=8, temperature=0)
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    assert client.chat.completions.create(**off, extra_body={**no_thinking, "thinking_token_budget": 0}) \
        .choices[0].message.content == client.chat.completions.create(**off, extra_body=no_thinking) \
        .choices[0].message.content


def test_anthropic_budget_tokens_is_chats_thinking_token_budget():
    from neuron_opt.server.anthropic import MessagesRequest

    body = {"model": MODEL, "max_tokens": 2000, "messages": MSGS}
    assert MessagesRequest.model_validate(
        {**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}).chat_request(True).thinking_token_budget \
        == 1024
    assert MessagesRequest.model_validate(body).chat_request(True).thinking_token_budget is None


@pytest.mark.slow
def test_anthropic_thinking_block_stops_at_budget_tokens(tiny_dir):
    """The official `anthropic` client, `thinking: {"type": "enabled", "budget_tokens": 1024}` on the tiny model
    (which never closes its thinking itself): the thinking block holds the reply's first 1024 tokens (the chat reply
    of the same request unbudgeted, its logprobs' tokens), and a text block follows it."""
    import anthropic

    llm = LLM(tiny_dir("smollm-tok"), batch_size=2, max_model_len=1280)
    llm.tokenizer.chat_template = THINK_TEMPLATE
    with live_server(llm, max_num_seqs=2, reasoning_parser=make_reasoning_parser(None, llm.tokenizer)) as (url, _):
        ant = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        m = ant.messages.create(model=MODEL, max_tokens=1032, messages=MSGS, extra_body={"temperature": 0},
                                thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text
        ref = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1024, temperature=0, logprobs=True,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert m.content[0].thinking == "".join(t.token for t in ref.choices[0].logprobs.content)


def test_a_negative_thinking_token_budget_is_a_400(server):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"messages": MSGS, "thinking_token_budget": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    assert httpx.get(server[0] + "/health").status_code == 200


@pytest.mark.parametrize("kwargs,message", [
    ({"messages": []}, "messages may not be set"),
    ({"add_generation_prompt": False, "tools": []}, "add_generation_prompt, tools may not be set"),
    ({"x": "y" * 300_000}, "at most"),
])
def test_bad_template_kwargs(server, kwargs, message):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"messages": MSGS, "chat_template_kwargs": kwargs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert message in r.json()["error"]["message"]
    assert httpx.get(server[0] + "/health").status_code == 200
