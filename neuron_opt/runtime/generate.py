"""The reference generation loop, for one sequence: prefill, then decode until a stop condition.

No production path runs it: `LLM`, `generate` and `serve` all generate through the engine (runtime/engine.py).
It is the oracle the engine's tests compare against (STYLE 11: a reference path beside the fast one), kept as
plain as the job allows: one sequence in one KV slot, `sample_one` per token, the same `StopChecker`; no
scheduler, no block tables, no batching, no speculation.
"""

from __future__ import annotations

from neuron_opt.runtime.output import GenerationOutput
from neuron_opt.runtime.runner import DecodeRow, ModelRunner
from neuron_opt.runtime.sampling import SamplerState, SamplingParams, candidates_needed, sample_one
from neuron_opt.runtime.stopping import StopChecker
from neuron_opt.runtime.structured import GrammarState


def generate_ids(runner: ModelRunner, tokenizer: object, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], slot: int = 0,
                 grammar: GrammarState | None = None) -> GenerationOutput:
    """`grammar`: the state of `params.structured`'s grammar (required exactly when it is set)."""
    runner.check_fits(len(prompt_ids), params.max_tokens)
    state = SamplerState.create(params, grammar)
    stop = StopChecker(tokenizer, params, eos_token_ids)
    k = candidates_needed(params, len(eos_token_ids) if params.min_tokens else 0)
    logits = runner.prefill(slot, prompt_ids, candidates=k)
    logprobs: list[float] = []
    position = len(prompt_ids)
    while True:
        banned = eos_token_ids if len(stop.token_ids) < params.min_tokens else ()
        res = sample_one(logits, state, banned)
        state.observe(res.token)
        if res.logprob is not None:
            logprobs.append(res.logprob)
        stop.add(res.token, state.grammar_done)
        if stop.finish_reason is not None:
            break
        logits = runner.decode([DecodeRow(slot, res.token, position)], candidates=k)[0]
        position += 1
    return GenerationOutput(list(prompt_ids), stop.token_ids, stop.text, stop.finish_reason, logprobs)
