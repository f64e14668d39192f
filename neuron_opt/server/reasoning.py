"""Reasoning models' thinking, split from their answer: `message.reasoning` (alias `reasoning_content`) and the
content, streamed as `delta.reasoning` before the content deltas.

Formats (vLLM's parser names, `serve --reasoning-parser NAME`, else chosen from the chat template when exactly one
format's markers are in it):
- `deepseek_r1`: `…</think>answer`. The template opens `<think>` in the prompt, so the reply starts inside the
  thinking (a leading `<think>` is dropped); without `</think>` the whole reply is reasoning.
- `qwen3` (Qwen3, SmolLM3): `<think>…</think>answer`. Where the prompt ends with `<think>` the reply starts inside
  the thinking (a repeated `<think>` is dropped); where it ends with `</think>` (`chat_template_kwargs:
  {"enable_thinking": false}`) it is all content; otherwise it is reasoning only if it begins with `<think>`.
- `granite`: `Here is my thought process:…Here is my response:answer` ("Here's" too), when the reply begins so.
- `openai_gptoss`: harmony channels, `<|channel|>analysis<|message|>…<|end|>` is reasoning and the `final` (and
  any other) channel's message is content. Its markers are special tokens, so replies are decoded with them.

Design decisions
- A parser's `split(text, start, final)` returns the reasoning and the content so far; both only grow as text is
  added (a marker's prefix at the end is held back until it resolves), so the stream is the difference of
  successive splits and the non-streamed message is the final split: they cannot disagree. Tool calls are read
  from the content only (server/tools.py), i.e. after the reasoning ends.
- Where the reply starts (`Start`) is decided once per request from the end of the prompt's text.
- Structured outputs and enforced tool calls start at the end of the thinking: the request's grammar becomes an
  xgrammar structural tag whose first element is the thinking (free text up to and including the end marker,
  optional where the reply may or may not think) and whose second is the request's own grammar (`after_reasoning`).
  The request's JSON schema goes in as the grammar of its compact JSON (the separators `", "` and `": "`, no other
  whitespace: what a schema compiles to alone, and what the generic tool format's parser reads), and is not guarded
  against raw control characters in strings (as for tool calls: runtime/structured.py). `openai_gptoss` refuses
  grammars: harmony's markers are special tokens, which the grammar engine does not produce.
- A thinking budget (vLLM's `thinking_token_budget` on chat, Anthropic's `thinking.budget_tokens`) is enforced in
  the sampler (runtime/sampling.py, ThinkingBudget): after that many tokens of thinking the end marker's tokens (the
  tokenizer's encoding of the parser's first end spelling) are forced and the answer follows. It needs a reasoning
  parser, applies where the reply may think (not where the prompt closed the thinking), and is refused for
  `openai_gptoss`, whose harmony channels end in special tokens followed by a channel header.
- `usage.completion_tokens_details.reasoning_tokens`: the tokens of the outputs the engine produced before the
  reply's text had closed its reasoning (the one closing it included); 0 when the reply has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from neuron_opt.errors import ConfigError
from neuron_opt.runtime.sampling import ThinkingBudget
from neuron_opt.runtime.structured import StructuredOutputs


class Start(Enum):
    """Where a reply starts relative to its reasoning (decided from the prompt's end)."""

    INSIDE = "inside"  # the prompt opened the thinking
    NONE = "none"  # the prompt closed it (thinking off): all content
    MAYBE = "maybe"  # the reply may open it with the start marker


@dataclass(frozen=True)
class Split:
    """A reply's text read so far: `reasoning` (None: the reply has none), `content`, and whether the reasoning
    has `ended` (what follows is content)."""

    reasoning: str | None
    content: str
    ended: bool


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """Thinking between a start and an end marker (each given in one or more spellings).

    Args:
        name: vLLM's parser name.
        starts: the start marker's spellings (the first is what a grammar writes).
        ends: the end marker's spellings (the first is what a grammar writes).
        always_inside: the reply always starts inside the thinking (DeepSeek-R1: the template opens it).
    """

    skip_special_tokens = True

    def __init__(self, name: str, starts: tuple[str, ...], ends: tuple[str, ...], always_inside: bool = False) -> None:
        self.name, self.starts, self.ends, self.always_inside = name, starts, ends, always_inside

    def start(self, prompt_tail: str) -> Start:
        """Where a reply starts, from the last characters of its prompt."""
        if self.always_inside:
            return Start.INSIDE
        tail = prompt_tail.rstrip()
        if any(tail.endswith(s) for s in self.starts):
            return Start.INSIDE
        if any(tail.endswith(e) for e in self.ends):
            return Start.NONE
        return Start.MAYBE

    def split(self, text: str, start: Start, final: bool) -> Split:
        if start is Start.NONE:
            return Split(None, text, True)
        body, stripped = text, text.lstrip()
        opened = next((s for s in self.starts if stripped.startswith(s)), None)  # (inside: a repeated one is dropped)
        if opened is not None:
            body = stripped[len(opened):]
        elif not final and any(s.startswith(stripped) for s in self.starts):
            return Split(None, "", False)  # it may still become a start marker
        elif start is Start.MAYBE:
            return Split(None, text, True)
        found = [(body.find(e), e) for e in self.ends if e in body]
        if found:
            at, end = min(found)
            return Split(body[:at], body[at + len(end):], True)
        keep = 0 if final else max(_held(body, e) for e in self.ends)
        return Split(body[:len(body) - keep], "", False)

    def budget(self, tokens: int, start: Start, tokenizer: Any) -> ThinkingBudget | None:
        """The sampler's thinking budget of `tokens` for a reply that starts at `start` (None: it cannot think, the
        prompt closed its thinking); the markers as `tokenizer` encodes them."""
        if start is Start.NONE:
            return None

        def ids(marker: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(marker, add_special_tokens=False))

        return ThinkingBudget(tokens, ids(self.starts[0]), ids(self.ends[0]), start is Start.INSIDE)

    def grammar_prefix(self, start: Start) -> dict[str, Any] | None:
        """The structural-tag element the thinking must match before the request's own grammar; None: no
        thinking. ConfigError where this format cannot be enforced."""
        if start is Start.NONE:
            return None
        if start is Start.INSIDE:
            return {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": self.ends[0]}
        return {"type": "tag", "begin": self.starts[0], "content": {"type": "any_text"}, "end": self.ends[0]}


class HarmonyParser(ReasoningParser):
    """GPT-OSS's harmony channels: the `analysis` channel's messages are reasoning, every other channel's content."""

    skip_special_tokens = False
    HEADER, MESSAGE = "<|channel|>", "<|message|>"
    ENDS = ("<|end|>", "<|return|>", "<|call|>")

    def __init__(self) -> None:
        super().__init__("openai_gptoss", (self.HEADER,), self.ENDS)

    def start(self, prompt_tail: str) -> Start:
        return Start.MAYBE

    def split(self, text: str, start: Start, final: bool) -> Split:
        first = text.find(self.HEADER)
        if first < 0:  # no harmony (yet): plain content, a header's prefix held back
            keep = 0 if final else _held(text, self.HEADER)
            return Split(None, text[:len(text) - keep], final or keep < len(text))
        reasoning: list[str] = []
        content = [text[:first]]
        ended = False
        for seg in text[first + len(self.HEADER):].split(self.HEADER):
            header, sep, body = seg.partition(self.MESSAGE)
            if not sep:  # the header is still being written
                break
            cut = [body.find(e) for e in self.ENDS if e in body]
            if cut:
                body = body[:min(cut)]
            elif not final:
                body = body[:len(body) - max(_held(body, e) for e in self.ENDS)]
            channel = header.split()[0] if header.split() else ""
            if channel == "analysis":
                reasoning.append(body)
            else:
                ended = True
                content.append(body)
        return Split("".join(reasoning) if reasoning else None, "".join(content), ended)

    def budget(self, tokens: int, start: Start, tokenizer: Any) -> ThinkingBudget | None:
        raise ConfigError("thinking_token_budget: not supported with the openai_gptoss reasoning parser (harmony's "
                          "analysis channel ends in special tokens and a channel header, not one marker)",
                          param="thinking_token_budget")

    def grammar_prefix(self, start: Start) -> dict[str, Any] | None:
        raise ConfigError("structured outputs and enforced tool calls are not supported with the openai_gptoss "
                          "reasoning parser (harmony's channel markers are special tokens, which the grammar "
                          "engine does not produce)", param="structured_outputs")


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", ("<think>",), ("</think>",), always_inside=True),
    "qwen3": ReasoningParser("qwen3", ("<think>",), ("</think>",)),
    "granite": ReasoningParser("granite", ("Here is my thought process:", "Here's my thought process:"),
                               ("Here is my response:", "Here's my response:")),
    "openai_gptoss": HarmonyParser(),
}


def reasoning_parser_for_template(template: str | None) -> str | None:
    """The reasoning format a chat template writes, when exactly one format's markers are in it; else None."""
    t = template or ""
    found = []
    if "<|channel|>" in t:
        found.append("openai_gptoss")
    if "</think>" in t:
        found.append("deepseek_r1" if "<｜Assistant｜>" in t else "qwen3")
    if "Here is my thought process:" in t:
        found.append("granite")
    return found[0] if len(found) == 1 else None


def make_reasoning_parser(name: str | None, tokenizer: Any) -> ReasoningParser | None:
    """`serve --reasoning-parser NAME`, or the one the tokenizer's chat template calls for (None: no reasoning)."""
    name = name or reasoning_parser_for_template(getattr(tokenizer, "chat_template", None))
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ConfigError(f"--reasoning-parser: unknown parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}",
                          param="reasoning_parser")
    return REASONING_PARSERS[name]


def _element(structured: StructuredOutputs) -> dict[str, Any]:
    """`structured` as one element of a structural tag (its canonical, bounded spec)."""
    spec = structured.spec()
    if spec.kind == "json":  # compact JSON, exactly as a schema compiles alone (a tag's json_schema allows more)
        import xgrammar as xgr

        ebnf = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, separators=(", ", ": "))
        return {"type": "grammar", "grammar": str(ebnf)}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.text}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.text}
    tag = json.loads(spec.text)
    return tag["format"] if isinstance(tag, dict) and tag.get("type") == "structural_tag" else tag


def after_reasoning(structured: StructuredOutputs, parser: ReasoningParser, start: Start) -> StructuredOutputs:
    """The grammar of a reply that thinks first, then matches `structured` (see the module docstring)."""
    prefix = parser.grammar_prefix(start)
    if prefix is None:
        return structured
    rest = _element(structured)
    fmt: dict[str, Any] = {"type": "sequence", "elements": [prefix, rest]}
    if start is Start.MAYBE:
        fmt = {"type": "or", "elements": [fmt, rest]}
    return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


class ReasoningStream:
    """One choice's reply read as it is generated; `tokens` counts its reasoning tokens (see the module
    docstring)."""

    def __init__(self, parser: ReasoningParser, start: Start) -> None:
        self.parser, self.start = parser, start
        self.reasoning = ""
        self.had_reasoning = False
        self._counted = 0
        self._ended = start is Start.NONE

    def feed(self, text: str, final: bool, num_tokens: int) -> tuple[str, str]:
        """`text`: the reply so far, of `num_tokens` tokens. Returns (new reasoning, the content so far)."""
        s = self.parser.split(text, self.start, final)
        if not self._ended:
            self._counted = num_tokens
        self._ended = self._ended or s.ended
        self.had_reasoning = self.had_reasoning or s.reasoning is not None
        delta = ""
        if s.reasoning is not None and len(s.reasoning) > len(self.reasoning):
            delta = s.reasoning[len(self.reasoning):]
            self.reasoning = s.reasoning
        return delta, s.content

    @property
    def tokens(self) -> int:
        return self._counted if self.had_reasoning else 0
