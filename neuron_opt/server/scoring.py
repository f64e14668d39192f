"""Scoring with /v1/completions: `echo` (the prompt back, with its tokens' logprobs), vLLM's `prompt_logprobs`,
and vLLM's `GET /tokenizer_info` -- what lm-evaluation-harness's `local-completions` needs for log-likelihoods.

Design decisions
- Prompt logprobs come from the prefill's logits at every position (ModelRunner.prefill_rows(all_positions=True),
  on every backend and tp): the model's own distribution, without penalties, bias or temperature.
  A request that asks for them is prefilled whole (no prefix-cache hit), since a cached prefix has no logits.
- `echo` with `logprobs: k`: the choice's `logprobs` cover the prompt's tokens, then the generated ones; the first
  prompt token has `null` logprob and top logprobs (nothing predicts it). A prompt token's `top_logprobs` holds the
  k likeliest tokens and the token itself, as OpenAI's legacy completions did.
- `echo` with `stream`: the prompt's text and logprobs come in each choice's first chunk (serving.py,
  `_stream_completion`); `prompt_logprobs` with `stream` is refused, as in vLLM.
- `echo` with `max_tokens: 0` returns the prompt only: the engine generates one token, which the response leaves
  out (text, logprobs, usage and finish_reason "length").
- vLLM's `prompt_logprobs: k`: each choice's `prompt_logprobs`, `[null, {token id: {logprob, rank,
  decoded_token}}, ...]`, the prompt's own token and the k likeliest per position.
- A prompt given as token ids is used as given (no BOS added); a text prompt is tokenized with the tokenizer's
  special tokens, as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from neuron_opt.runtime.output import TokenLogprob

TokenStr = Callable[[int], str]


def echo_logprobs(prompt: Sequence[int], prompt_lps: Sequence[TokenLogprob | None], generated: Sequence[TokenLogprob],
                  token_str: TokenStr) -> dict[str, list[Any]]:
    """The legacy completions `logprobs` of an echoed prompt and its generated tokens."""
    tokens, values, tops, offsets, at = [], [], [], [], 0
    for tid, lp in zip(prompt, prompt_lps, strict=True):
        s = token_str(tid)
        tokens.append(s)
        offsets.append(at)
        at += len(s)
        values.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {**{token_str(t): v for t, v in lp.top}, s: lp.logprob})
    for lp in generated:
        s = token_str(lp.token_id)
        tokens.append(s)
        offsets.append(at)
        at += len(s)
        values.append(lp.logprob)
        tops.append({token_str(t): v for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(prompt_lps: Sequence[TokenLogprob | None], k: int,
                         token_str: TokenStr) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token, its own and the `k` likeliest tokens' entries."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in prompt_lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token_str(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top[:k], 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": token_str(t)})
        out.append(entry)
    return out


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's `GET /tokenizer_info`: the tokenizer's class and its JSON-representable configuration (the chat
    template and the special tokens among it)."""
    out: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key, value in sorted(getattr(tokenizer, "init_kwargs", {}).items()):
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
        out[key] = value
    out["chat_template"] = getattr(tokenizer, "chat_template", None)
    out["added_tokens_decoder"] = {str(i): {"content": t.content, "special": t.special}
                                   for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        out[name] = getattr(tokenizer, name, None)
    out["model_max_length"] = min(int(getattr(tokenizer, "model_max_length", 0) or 0), 2**53)
    return out
