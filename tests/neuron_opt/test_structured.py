"""Structured outputs below the engine: the schema gate, the bounds, the grammars' accepted strings, and the
sampler's masking.

Oracles: `jsonschema` (every string a JSON-schema grammar accepts validates against the schema the request sent),
Python's `re` (regex), the choice list itself, and the sampler's own unmasked path (masking changes nothing but
the masked tokens). The accepted strings are random walks of the grammar over the real tokenizer: at each step a
random allowed token, so the walks cover what any model could be made to write.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import uuid

import jsonschema
import pytest
import torch
from helpers import grammar_walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.errors import ConfigError
from neuron_opt.runtime.sampling import SamplerState, SamplingParams, processed_logits, sample_batch
from neuron_opt.runtime.structured import (
    MAX_ITEMS,
    NUMBER_BOUND,
    GrammarCompiler,
    StructuredOutputs,
    bound_schema,
    check_schema,
    json_object_schema,
)

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return open_checkpoint("default").tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok), (EOS,))


def allowed(state, vocab: int) -> torch.Tensor:
    """The token ids the grammar allows next."""
    import xgrammar as xgr

    bm = xgr.allocate_token_bitmask(1, vocab)
    state.fill(bm, 0)
    bits = (bm[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [V/32, 32]
    return bits.flatten()[:vocab].nonzero().flatten()


def walk(compiler, tok, structured: StructuredOutputs, seed: int, max_steps: int = 400) -> str:
    return grammar_walk(compiler, tok, structured, seed, max_steps)


# ---- the schema gate and the bounds ---------------------------------------------------------------------------

@pytest.mark.parametrize("schema,where", [
    ({"type": "integer", "not": {"const": 3}}, "'not' at #"),
    ({"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}},
     "'uniqueItems' at #/properties/xs"),
    ({"anyOf": [{"type": "string"}, {"if": {"type": "string"}}]}, "'if' at #/anyOf/1"),
    ({"$defs": {"a": {"type": "array", "contains": {"const": 1}}}, "$ref": "#/$defs/a"}, "'contains' at #/$defs/a"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "'allOf' with 2 schemas"),
    ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
    ({"type": "string", "format": "email"}, "format 'email'"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'maxLength' at # together with a pattern or format"),
    ({"type": "string", "format": "date", "minLength": 3}, "'minLength' at # together with a pattern or format"),
    ({"type": "array", "items": [{"type": "integer"}]}, "'items' as a list"),
    ({"type": "object", "properties": []}, "'properties' at #: must be an object"),
    ("string", "must be an object or a boolean"),
])
def test_a_keyword_the_engine_would_not_enforce_is_refused_by_name(schema, where):
    with pytest.raises(ConfigError, match=re.escape(where)) as e:
        check_schema(schema)
    assert e.value.param == "structured_outputs"


def test_annotations_and_extensions_pass_the_gate():
    check_schema({"title": "T", "description": "d", "$schema": "https://json-schema.org/draft/2020-12/schema",
                  "type": "object", "properties": {"a": {"type": "integer", "default": 3, "examples": [1],
                                                         "x-unit": "m"}}, "allOf": [{"required": ["a"]}]})


def test_bounds_close_every_open_end_and_keep_what_the_schema_states():
    s = bound_schema({"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number", "minimum": 0}, "e": {"type": "integer", "enum": [1, 2]},
        "xs": {"type": "array", "items": {"type": "number"}}, "ys": {"type": "array", "minItems": 100},
        "m": {"type": "object", "additionalProperties": {"type": "string"}}, "k": {"type": "object"}}})
    p = s["properties"]
    assert (p["n"]["minimum"], p["n"]["maximum"]) == (-NUMBER_BOUND, NUMBER_BOUND)
    assert (p["x"]["minimum"], p["x"]["maximum"]) == (0, NUMBER_BOUND)
    assert "minimum" not in p["e"]  # an enum is bounded already
    assert p["xs"]["maxItems"] == MAX_ITEMS and p["xs"]["items"]["maximum"] == NUMBER_BOUND
    assert p["ys"]["maxItems"] == 100
    assert "maxProperties" in p["m"] and "maxProperties" not in p["k"]  # k admits no free members anyway


def test_structured_outputs_take_exactly_one_kind():
    with pytest.raises(ConfigError, match="exactly one of"):
        StructuredOutputs()
    with pytest.raises(ConfigError, match="exactly one of"):
        StructuredOutputs(regex="a", grammar="root ::= \"a\"")
    with pytest.raises(ConfigError, match="choice must be"):
        StructuredOutputs(choice=("a", ""))


@pytest.mark.parametrize("structured,message", [
    (StructuredOutputs(regex="a(b"), "regex does not compile: Regex parsing error"),
    (StructuredOutputs(grammar="root ::= x"), 'grammar does not compile: EBNF parser error at line 1, column 10: '
                                               'Rule "x" is not defined'),
    (StructuredOutputs(json={"type": "strang"}), 'JSON schema does not compile: Unsupported type "strang"'),
    (StructuredOutputs(json="{nope"), "JSON schema is not valid JSON"),
    (StructuredOutputs(structural_tag='{"type": "structural_tag"}'), "structural tag does not compile"),
])
def test_what_does_not_compile_says_why_without_the_engines_source_lines(compiler, structured, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        compiler.compile(structured)
    assert ".cc:" not in str(e.value)


# ---- accepted strings against independent oracles --------------------------------------------------------------

def leaf() -> st.SearchStrategy:
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda a, b: {"type": "integer", "minimum": min(a, b), "maximum": max(a, b)},
                  st.integers(-10**6, 10**6), st.integers(-10**6, 10**6)),
        st.just({"type": "integer"}),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda xs: {"enum": xs}, st.lists(st.sampled_from(["a", "b c", 1, 2.5, None, True]), min_size=1,
                                                     max_size=4, unique_by=repr)),
        st.builds(lambda v: {"const": v}, st.sampled_from(["x", 7, False])),
        st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
        st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(sorted(FORMATS))),
    )


def _rfc3339_time(s: str) -> None:
    """RFC 3339's full-time (second 60 is a leap second: valid there, not to Python's parser)."""
    datetime.time.fromisoformat(re.sub(r":60(?=[.Zz+-])", ":59", s).replace("z", "Z"))


# format -> an independent check that raises on an invalid value (Python's own parsers)
FORMATS = {
    "date": lambda s: datetime.date.fromisoformat(s),
    "time": _rfc3339_time,
    "date-time": lambda s: (datetime.date.fromisoformat(s[:10]), _rfc3339_time(s[11:]), s[10] in "Tt") and None,
    "ipv4": lambda s: ipaddress.IPv4Address(s),
    "ipv6": lambda s: ipaddress.IPv6Address(s),
    "uuid": lambda s: uuid.UUID(s) if re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", s) else 1 / 0,
    "duration": lambda s: re.fullmatch(r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?", s)
    or 1 / 0,
}


def formats_hold(value, schema) -> bool:
    """Every string under a `format` keyword passes that format's independent check (for anyOf: in a branch the
    value validates against)."""
    if not isinstance(schema, dict):
        return True
    if "format" in schema and isinstance(value, str):
        try:
            FORMATS[schema["format"]](value)
        except Exception:  # noqa: BLE001 -- any parser error means the value is not of the format
            return False
    if "anyOf" in schema and not any(jsonschema.Draft202012Validator(sub).is_valid(value) and formats_hold(value, sub)
                                     for sub in schema["anyOf"]):
        return False
    if isinstance(value, dict):
        return all(formats_hold(v, schema.get("properties", {}).get(k)) for k, v in value.items())
    if isinstance(value, list):
        return all(formats_hold(v, schema.get("items")) for v in value)
    return True


# patterns with optional groups around repeats, which the engine reads wrong unless spelled {0,1} (engine_pattern)
PATTERNS = [r"^[a-c]{1,3}$", r"^\d{2}-\d$", r"^v(\.[0-9]{1,2})?$", r"^(x[0-9]+)?(-[a-b]*)??$", r"^(a|bc)+$"]


def schemas() -> st.SearchStrategy:
    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        obj = st.dictionaries(st.sampled_from(["a", "b", "name", "x y"]), children, min_size=1, max_size=3).flatmap(
            lambda props: st.builds(lambda req: {"type": "object", "properties": props, "required": sorted(req)},
                                    st.sets(st.sampled_from(sorted(props)))))
        arr = st.builds(lambda it, lo, hi: {"type": "array", "items": it, "minItems": lo, "maxItems": lo + hi},
                        children, st.integers(0, 2), st.integers(0, 2))
        any_of = st.builds(lambda xs: {"anyOf": xs}, st.lists(children, min_size=1, max_size=3))
        return st.one_of(obj, arr, any_of)

    return st.recursive(leaf(), extend, max_leaves=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas(), seed=st.integers(0, 2**16))
def test_every_string_a_schema_grammar_accepts_validates(compiler, tok, schema, seed):
    text = walk(compiler, tok, StructuredOutputs(json=schema), seed)
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert formats_hold(value, schema), value


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_string_of_a_format_passes_its_parser(compiler, tok, fmt):
    for seed in range(8):
        FORMATS[fmt](json.loads(walk(compiler, tok, StructuredOutputs(json={"type": "string", "format": fmt}),
                                     seed)))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_strings_match_the_pattern(compiler, tok, pattern):
    for seed in range(10):
        text = json.loads(walk(compiler, tok, StructuredOutputs(json={"type": "string", "pattern": pattern}),
                               seed))
        assert re.search(pattern, text), text


def test_json_object_accepts_only_bounded_objects(compiler, tok):
    schema = json_object_schema()
    for seed in range(3):
        value = json.loads(walk(compiler, tok, StructuredOutputs(json_object=True), seed, max_steps=3000))
        assert isinstance(value, dict)
        jsonschema.validate(value, schema)


@pytest.mark.parametrize("structured,check", [
    (StructuredOutputs(regex=r"[A-Z][a-z]{0,4} \d{1,3}"), lambda s: re.fullmatch(r"[A-Z][a-z]{0,4} \d{1,3}", s)),
    (StructuredOutputs(choice=("yes", "no", 'say "é"\n')), lambda s: s in ("yes", "no", 'say "é"\n')),
    (StructuredOutputs(grammar='root ::= "(" item ("," item){0,2} ")"\nitem ::= [0-9]+ | "x"'),
     lambda s: re.fullmatch(r"\((\d+|x)(,(\d+|x)){0,2}\)", s)),
])
def test_regex_choice_and_grammar_strings_match(compiler, tok, structured, check):
    for seed in range(10):
        text = walk(compiler, tok, structured, seed)
        assert check(text), text


def test_a_draft_is_cut_at_the_first_token_the_grammar_refuses_and_the_state_is_kept(compiler, tok):
    state = compiler.state(StructuredOutputs(choice=("hello world",)))
    good = tok("hello world")["input_ids"]
    assert state.valid_prefix(good + [tok("!")["input_ids"][0]]) == len(good)
    assert state.valid_prefix([tok("bye")["input_ids"][0]]) == 0
    for t in good:  # unchanged by the two probes: the whole string is still ahead
        state.accept(t)
    state.accept(EOS)
    assert state.terminated


# ---- the sampler ------------------------------------------------------------------------------------------------

def test_masking_bias_penalties_and_bans_are_the_same_batched_and_one_row_at_a_time(compiler, tok):
    g = torch.Generator().manual_seed(0)
    V = len(tok)
    logits = torch.randn(4, V, generator=g)
    params = [SamplingParams(logit_bias=((5, 3.0), (6, -100.0)), presence_penalty=0.5),
              SamplingParams(structured=StructuredOutputs(choice=("yes", "no")), logit_bias=((9, 2.0),)),
              SamplingParams(structured=StructuredOutputs(regex="[0-9]+"), logprobs=3),
              SamplingParams()]
    states = [SamplerState.create(p, None if p.structured is None else compiler.state(p.structured)) for p in params]
    states[0].observe(5)
    banned = [(EOS,), (), (EOS,), ()]
    got = sample_batch(logits, states, banned)
    for i, (state, res) in enumerate(zip(states, got, strict=True)):
        row = processed_logits(logits[i], state, banned[i])
        assert res.token == int(row.argmax()), i
    assert got[1].token in allowed(states[1].grammar, V).tolist()
    assert tok.decode([got[2].token]).isdigit() and got[2].logprob is not None


def test_a_grammar_that_can_only_end_wins_over_min_tokens(compiler, tok):
    state = compiler.state(StructuredOutputs(choice=("ok",)))
    for t in tok("ok")["input_ids"]:
        state.accept(t)
    st = SamplerState.create(SamplingParams(structured=StructuredOutputs(choice=("ok",)), min_tokens=10), state)
    assert sample_batch(torch.zeros(1, len(tok)), [st], [(EOS,)])[0].token == EOS


def test_logit_bias_is_refused_out_of_range():
    with pytest.raises(ConfigError, match=r"logit_bias: the bias of token 3 must be in \[-100, 100\]"):
        SamplingParams(logit_bias=((3, 100.5),))
    with pytest.raises(ConfigError, match="logit_bias: token id -1 is negative"):
        SamplingParams(logit_bias=((-1, 1.0),))
    with pytest.raises(ConfigError, match="temperature: must be a finite number"):
        SamplingParams(temperature=float("nan"))
