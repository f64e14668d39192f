"""Structured outputs: the sampler only ever picks tokens that keep a request's output inside its grammar.

Design decisions
- The grammar engine is xgrammar (what vLLM and SGLang use): it compiles JSON Schema, regular expressions, EBNF and
  structural tags into a token-level automaton and fills a bitmask of the allowed next tokens per step.
- `StructuredOutputs` is what a request asks for (vLLM's field names: json, regex, choice, grammar, json_object,
  structural_tag). `spec()` turns it into a `GrammarSpec`, a hashable (kind, text) pair; `GrammarCompiler` compiles
  specs for one tokenizer, through xgrammar's own cache (keyed by the text, bounded in bytes), so a schema that many
  requests send compiles once. Callers that must not block (the HTTP event loop) compile in a worker thread before
  queueing the request; the engine thread never compiles a grammar the server sent it.
- JSON Schema: a keyword the engine would not enforce is refused by name, never silently ignored
  (`check_schema`); so are formats whose outputs it cannot guarantee to validate (where its pattern is looser than
  the format, ours replaces it: exact days per month and leap days).
- Where xgrammar 0.2.8 compiles something looser than the schema, we close the gap: optional groups `(...)?` in
  patterns are spelled `(...){0,1}`, and since its length-bounded strings admit raw control characters (invalid
  JSON), a JSON-schema request never gets a token holding one (compact JSON has no place for them). Under
  structural tags (tool calls in a model's own format, whose free text may hold newlines) that last gap stays open
  for strings with min/maxLength.
- The open ends of a schema are bounded before it compiles (`bound_schema`), so a small model that loops still
  closes its object: no whitespace beyond the separators `", "` and `": "`, numbers within +-NUMBER_BOUND (at most
  15 integer digits; xgrammar then allows at most 6 fraction digits), arrays of at most MAX_ITEMS items and
  free-form objects of at most MAX_PROPERTIES members unless the schema says otherwise. An output of the bounded
  schema is valid under the original. `json_object` is such a schema too: an object nested at most
  JSON_OBJECT_DEPTH deep, with names and strings of bounded length.
- Every count a request gives the grammar engine is capped at `max_repeat` (MAX_REPEAT unless the server sets it:
  `serve --max-grammar-repeat`): `maxLength`, `maxItems`, `maxProperties` and the upper bound of a repeat `{m,n}`
  in a pattern, regex or EBNF grammar are lowered to it (an output of the capped grammar is still valid under the
  request's), and a lower bound past it (`minLength`, `minItems`, `minProperties`, `{m}`, `{m,n}`) is refused. A
  structural tag gets the same treatment in every schema, pattern and grammar it holds. Input nested too deeply
  to walk (RecursionError) is refused like any other invalid schema.
- A request's `GrammarState` owns its matcher. The matcher ends on a stop token (EOS or the request's stop ids):
  once the grammar is complete only those are allowed, and the request ends the ordinary way. A terminated matcher
  ends the request even under ignore_eos.
- Speculative decoding: `valid_prefix` cuts a draft at the first token the grammar refuses (accept, then roll back)
  before it is verified; verification masks each position and advances the matcher by every emitted token in order.
  Preemption recomputes K/V, not tokens, so the matcher's state stays valid across it.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from neuron_opt.errors import ConfigError

if TYPE_CHECKING:
    import torch

MAX_ITEMS = 64  # items of an array whose schema gives no maxItems
MAX_PROPERTIES = 32  # members of an object whose schema allows free-form properties and gives no maxProperties
NUMBER_BOUND = 10**15 - 1  # |number| of a number/integer schema without minimum or maximum
JSON_OBJECT_DEPTH = 4  # nesting of `json_object` (an object of values; a value may hold objects and arrays)
JSON_OBJECT_KEY_CHARS = 64  # a `json_object` member name's length
JSON_OBJECT_STRING_CHARS = 1024  # a `json_object` string value's length
MAX_REPEAT = 4096  # the largest count (string length, items, members, {m,n}) a request's grammar may give

# Keywords xgrammar enforces (checked one by one: each changes the grammar and its outputs validate).
_ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems", "enum", "const", "anyOf",
    "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern", "minLength", "maxLength", "format", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# Annotations: they constrain nothing, so nothing is lost by not enforcing them.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "discriminator", "contentEncoding", "contentMediaType",
})
# Formats whose every output validates: the engine's own (checked by random walks against validators), or ours where
# its pattern is looser than the format (days past the month's end, leap days of non-leap years, leading zeros in
# an IPv4 octet, unbounded fraction digits). Formats of unbounded text (email, hostname, uri, ...) are refused.
_ENGINE_FORMATS = frozenset({"uuid", "ipv6", "duration"})
_DAY = r"(0[1-9]|1[0-9]|2[0-8])"
_YEAR = r"([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999: year 0 is no date
_LEAP_YEAR = r"([0-9][0-9](0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_DATE = (rf"({_YEAR}-((0[13578]|1[02])-({_DAY[1:-1]}|29|30|31)|(0[469]|11)-({_DAY[1:-1]}|29|30)|02-{_DAY})"
         rf"|{_LEAP_YEAR}-02-29)")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]{1,6})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
}
_FORMATS = _ENGINE_FORMATS | frozenset(_FORMAT_PATTERNS)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [subschema, ...]
_SCHEMA_ONE = ("additionalProperties", "propertyNames", "items")  # a subschema (or a boolean)


def _bad(message: str) -> ConfigError:
    return ConfigError(message, param="structured_outputs")


def check_schema(schema: Any, where: str = "#") -> None:
    """Raise ConfigError naming the first keyword (and its location) that the grammar engine would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _bad(f"JSON schema at {where}: must be an object or a boolean, got {type(schema).__name__}")
    for key, value in schema.items():
        if key.startswith("x-") or key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            raise _bad(f"JSON schema keyword {key!r} at {where} is not supported (it would not be enforced)")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise _bad(f"JSON schema keyword 'allOf' with {len(value)} schemas at {where} is not supported "
                       "(one schema only); merge them into one")
        if key == "format" and value not in _FORMATS:
            raise _bad(f"JSON schema format {value!r} at {where} is not supported (supported: "
                       f"{', '.join(sorted(_FORMATS))}); give a pattern instead")
        if key in ("minLength", "maxLength") and ("pattern" in schema or "format" in schema):
            raise _bad(f"JSON schema {key!r} at {where} together with a pattern or format is not supported (it "
                       "would not be enforced); put the length into the pattern")
        if key == "items" and isinstance(value, list):
            raise _bad(f"JSON schema 'items' as a list at {where} is not supported; use prefixItems")
        if key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise _bad(f"JSON schema {key!r} at {where}: must be an object")
            for name, sub in value.items():
                check_schema(sub, f"{where}/{key}/{name}")
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list):
                raise _bad(f"JSON schema {key!r} at {where}: must be a list")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{key}/{i}")
        elif key in _SCHEMA_ONE:
            check_schema(value, f"{where}/{key}")


def _types(schema: dict[str, Any]) -> set[str]:
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def engine_pattern(pattern: str) -> str:
    """`pattern` with every optional group `(...)?` spelled `(...){0,1}`: the same language. xgrammar 0.2.8 reads
    `(x[0-9]+)?` inside a JSON string as if the `x` alone were optional (it accepts "5"); `{0,1}` it reads right
    (both checked in the tests)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == ")" and pattern.startswith("?", i + 1):
            out.append("){0,1}")
            i += 3 if pattern.startswith("??", i + 1) else 2  # lazy or greedy: the same strings match
            continue
        out.append(ch)
        i += 1
    return "".join(out)


_CAPPED = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))


def bound_schema(schema: Any, max_repeat: int = MAX_REPEAT) -> Any:
    """A copy of `schema` whose open ends are bounded and whose counts are capped at `max_repeat` (see the module
    docstring); its outputs are valid under `schema` itself. ConfigError for a lower bound past `max_repeat`."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bound_schema(sub, max_repeat) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [bound_schema(sub, max_repeat) for sub in value]
        elif key in _SCHEMA_ONE:
            out[key] = bound_schema(value, max_repeat)
        else:
            out[key] = value
    if out.get("format") in _FORMAT_PATTERNS:
        out["pattern"] = _FORMAT_PATTERNS[out.pop("format")]

    if isinstance(out.get("pattern"), str):
        out["pattern"] = cap_repeats(engine_pattern(out["pattern"]), max_repeat, "pattern")
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {cap_repeats(engine_pattern(k), max_repeat, "pattern"): v
                                    for k, v in out["patternProperties"].items()}
    for low, high in _CAPPED:
        if isinstance(out.get(low), int) and out[low] > max_repeat:
            raise _bad(f"JSON schema {low!r} {out[low]} is past this server's bound on grammar counts ({max_repeat})")
        if isinstance(out.get(high), int) and out[high] > max_repeat:
            out[high] = max_repeat
    types = _types(out)
    if types & {"number", "integer"} and "enum" not in out and "const" not in out:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -NUMBER_BOUND
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = NUMBER_BOUND
    if ("array" in types or "items" in out or "prefixItems" in out) and "maxItems" not in out:
        out["maxItems"] = max(MAX_ITEMS, out.get("minItems", 0), len(out.get("prefixItems", ())))
    free = out.get("additionalProperties", False) is not False or "patternProperties" in out
    if "object" in types and free and "maxProperties" not in out:
        out["maxProperties"] = max(MAX_PROPERTIES, out.get("minProperties", 0)) + len(out.get("properties", {}))
    return out


_REPEAT = re.compile(r"\{([0-9]+)(,([0-9]*))?\}")


def cap_repeats(text: str, max_repeat: int, what: str, ebnf: bool = False) -> str:
    """`text` (a regex, or with `ebnf` an EBNF grammar) with the upper bound of every repeat `{m,n}` lowered to
    `max_repeat`; ConfigError for a lower bound past it. Escapes, character classes and (EBNF) string literals are
    skipped: a brace there is a character, not a repeat."""
    out, i, n = [], 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            out.append(text[i:i + 2])
            i += 2
            continue
        if ch == "[" or (ebnf and ch in "\"'"):
            end = _literal_end(text, i, "]" if ch == "[" else ch)
            out.append(text[i:end])
            i = end
            continue
        m = _REPEAT.match(text, i) if ch == "{" else None
        if m is None:
            out.append(ch)
            i += 1
            continue
        low, comma, high = m.group(1), m.group(2), m.group(3)
        if len(low) > 9 or int(low) > max_repeat:
            raise _bad(f"{what}: the repeat count {{{low}}} is past this server's bound on grammar counts "
                       f"({max_repeat})")
        if comma is None or not high or (len(high) <= 9 and int(high) <= max_repeat):
            out.append(m.group(0))
        else:
            out.append(f"{{{low},{max_repeat}}}")
        i = m.end()
    return "".join(out)


def _literal_end(text: str, start: int, close: str) -> int:
    """The index after the `close` that ends the class or string opened at `start` (escapes skipped)."""
    i = start + 1
    if close == "]" and text.startswith("]", i):  # `[]...]`: a leading ] is a member
        i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == close:
            return i + 1
        else:
            i += 1
    return len(text)


def bound_structural_tag(text: str, max_repeat: int) -> str:
    """A structural tag (JSON text) with every JSON schema in it checked and bounded (`json_schema` / `schema`
    members) and every regex (`pattern` / `regex`) and EBNF grammar (`grammar` / `ebnf`) capped."""
    try:
        tag = json.loads(text)
    except ValueError as e:
        raise _bad(f"structural tag is not valid JSON: {e}") from None

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in ("json_schema", "schema") and isinstance(value, dict | bool):
                check_schema(value)
                out[key] = bound_schema(value, max_repeat)
            elif key in ("pattern", "regex") and isinstance(value, str):
                out[key] = cap_repeats(value, max_repeat, f"structural tag {key}")
            elif key in ("grammar", "ebnf") and isinstance(value, str):
                out[key] = cap_repeats(value, max_repeat, f"structural tag {key}", ebnf=True)
            else:
                out[key] = walk(value)
        return out

    return json.dumps(walk(tag))


def json_object_schema(depth: int = JSON_OBJECT_DEPTH) -> dict[str, Any]:
    """Any JSON object nested at most `depth` deep, with at most MAX_PROPERTIES members per object, MAX_ITEMS
    items per array, and bounded names and strings (the bounded form of `response_format: {"type":
    "json_object"}`)."""
    scalars: list[dict[str, Any]] = [{"type": "string", "maxLength": JSON_OBJECT_STRING_CHARS}, {"type": "number"},
                                     {"type": "boolean"}, {"type": "null"}]
    names = {"maxLength": JSON_OBJECT_KEY_CHARS}

    def obj(values: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": values, "propertyNames": names}

    defs: dict[str, Any] = {"v0": {"anyOf": scalars}}
    for d in range(1, depth):
        inner = {"$ref": f"#/$defs/v{d - 1}"}
        defs[f"v{d}"] = {"anyOf": [*scalars, {"type": "array", "items": inner}, obj(inner)]}
    return bound_schema({**obj({"$ref": f"#/$defs/v{depth - 1}"}), "$defs": defs})


@dataclass(frozen=True)
class GrammarSpec:
    """A compiled grammar's identity: kind ("json" schema, "regex", "grammar" EBNF, "structural_tag") and its text."""

    kind: str
    text: str


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (exactly one field set; vLLM's `structured_outputs` names).

    Args:
        json: a JSON schema (dict or its JSON text).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar whose start rule is `root`.
        json_object: any JSON object.
        structural_tag: an xgrammar structural tag (JSON text): free text with constrained regions.
        max_repeat: the cap on every count the grammar gives (see the module docstring).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    max_repeat: int = MAX_REPEAT

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise _bad(f"structured outputs: give exactly one of json, regex, choice, grammar, json_object, "
                       f"structural_tag (got {', '.join(given) or 'none'})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise _bad("structured outputs: choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar", "structural_tag"):
            if getattr(self, name) == "":
                raise _bad(f"structured outputs: {name} must not be empty")

    def spec(self) -> GrammarSpec:
        """The canonical spec: JSON schemas checked (ConfigError naming an unsupported keyword) and bounded, every
        count capped at `max_repeat`; ConfigError for input nested too deeply to walk."""
        try:
            return self._spec()
        except RecursionError:
            raise _bad("structured outputs: the schema or grammar is nested too deeply") from None

    def _spec(self) -> GrammarSpec:
        if self.json_object:
            return GrammarSpec("json", json.dumps(json_object_schema(), sort_keys=True))
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise _bad(f"JSON schema is not valid JSON: {e}") from None
            check_schema(schema)
            return GrammarSpec("json", json.dumps(bound_schema(schema, self.max_repeat)))
        if self.choice is not None:  # EBNF string literals take JSON's escapes
            return GrammarSpec("grammar", "root ::= " + " | ".join(json.dumps(c) for c in self.choice))
        if self.regex is not None:
            return GrammarSpec("regex", cap_repeats(self.regex, self.max_repeat, "regex"))
        if self.grammar is not None:
            return GrammarSpec("grammar", cap_repeats(self.grammar, self.max_repeat, "grammar", ebnf=True))
        assert self.structural_tag is not None
        return GrammarSpec("structural_tag", bound_structural_tag(self.structural_tag, self.max_repeat))


_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+\.cc:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer (thread-safe; xgrammar caches compiled grammars by their text).
    The tokenizer's tables are built on the first compile, so a model that never sees a grammar never pays.

    Args:
        tokenizer: the model's HF tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's: the extra ids are never allowed).
        eos_token_ids: the model's end tokens; with a request's stop ids they end its grammar.
        cache_bytes: most memory the compiled-grammar cache holds.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_bytes: int = 256 << 20) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self.cache_bytes = cache_bytes
        self._compiler: Any = None
        self._no_controls: torch.Tensor | None = None  # bitmask row: the tokens without a raw control character
        self._lock = threading.Lock()

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:  # xgrammar (and torch) on first use: the CLI's parser imports this module
                import torch
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self.cache_bytes)
                ok = torch.tensor([not any(b < 0x20 for b in t) for t in info.decoded_vocab], dtype=torch.bool)
                ok = torch.nn.functional.pad(ok, (0, -ok.numel() % 32))
                bits = (ok.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(-1)  # [V/32] packed, LSB first
                self._no_controls = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
            return self._compiler

    def compile(self, structured: StructuredOutputs) -> Any:
        """The xgrammar CompiledGrammar of `structured`; ConfigError (param structured_outputs) if it is refused or
        does not compile."""
        spec = structured.spec()
        c = self._xgr_compiler()
        try:
            if spec.kind == "json":
                return c.compile_json_schema(spec.text, any_whitespace=False, separators=(", ", ": "))
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "grammar":
                return c.compile_grammar(spec.text)
            return c.compile_structural_tag(spec.text)
        except Exception as e:  # xgrammar's parse and conversion errors, whatever their class: this request's only
            raise _bad(f"{_KIND_NAMES[spec.kind]} does not compile: {_CPP_PREFIX.sub('', str(e)).strip()}") from None

    def state(self, structured: StructuredOutputs, stop_token_ids: tuple[int, ...] = (),
              compiled: Any = None) -> GrammarState:
        """A new request's grammar state (`compiled`: this compiler's result for `structured`, if already made);
        it ends on EOS or one of the request's `stop_token_ids`."""
        stops = tuple(dict.fromkeys(self.eos_token_ids + tuple(stop_token_ids)))
        compiled = compiled if compiled is not None else self.compile(structured)
        return GrammarState(compiled, stops, self._no_controls if structured.spec().kind == "json" else None)


_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "structural_tag": "structural tag"}


class GrammarState:
    """One request's position in its grammar.

    Args:
        compiled: the request's compiled grammar.
        stop_token_ids: the tokens that end the request (EOS and its own stop ids): the grammar's end.
        allow: a packed bitmask row [ceil(V / 32)] of the only tokens this request may ever take (JSON: no raw
            control characters), or None.
    """

    def __init__(self, compiled: Any, stop_token_ids: tuple[int, ...], allow: torch.Tensor | None = None) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        self._allow = allow
        self._next: torch.Tensor | None = None  # `prepare`'s row, until the next `accept`

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (xgrammar's packed int32 layout)."""
        if self._next is not None:
            bitmask[row] = self._next
            return
        self._compute(bitmask, row)

    def _compute(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._allow is not None:
            bitmask[row] &= self._allow

    def prepare(self, vocab_size: int) -> None:
        """Compute the tokens allowed next now (of logits `vocab_size` wide), for the `fill` of the next sampling
        (async scheduling fills a step's masks while its graph runs); `accept` drops them."""
        import xgrammar as xgr

        row = xgr.allocate_token_bitmask(1, vocab_size)
        self._compute(row, 0)
        self._next = row[0]

    def accept(self, token: int) -> None:
        self._next = None
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} is not allowed by the request's grammar (sampled outside its mask)")

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a verify step's look-ahead over its proposals)."""
        self._next = None
        self._matcher.rollback(n)

    def _allows(self, token: int) -> bool:
        return self._allow is None or bool((int(self._allow[token // 32]) >> (token % 32)) & 1)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (a draft) the grammar accepts in order; the state is left unchanged."""
        n = 0
        for t in tokens:
            if self._matcher.is_terminated() or not self._allows(t) or not self._matcher.accept_token(t):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n


def apply_grammar_masks(logits: torch.Tensor, states: dict[int, GrammarState]) -> None:
    """Set to -inf, in place, every logit of row i of `logits` [B, V] that states[i]'s grammar does not allow."""
    import xgrammar as xgr

    rows = sorted(states)
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for i in rows:
        states[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
