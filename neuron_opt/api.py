"""Python API: `LLM(model).generate(prompt)` / `.chat(messages)`.

`model` is a compiled artifact directory (from `neuron-opt compile`), an HF checkpoint directory, a GGUF file, or
"default" (the embedded SmolLM2-135M-Instruct). Checkpoints run on the eager reference backend in memory;
artifacts run on the backend they were compiled for.

    from neuron_opt import LLM, SamplingParams
    llm = LLM("default")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32))
    print(out.text)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from neuron_opt.artifact import VerifiedManifest
from neuron_opt.config import ParallelConfig
from neuron_opt.executors import build_model as build_model  # re-exported: eager models for tests and scripts
from neuron_opt.executors import is_artifact, load_model
from neuron_opt.object_store import is_remote, resolve
from neuron_opt.runtime.generate import GenerationOutput, generate_ids
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.speculative import SpecStats, SpeculativeConfig, check_draft_tokenizer
from neuron_opt.runtime.structured import GrammarCompiler


class LLM:
    """`dtype`, `max_model_len`, `batch_size`, `parallel`, `num_speculative_tokens` (k: verify graphs of k + 1
    tokens for speculative decoding): for a checkpoint, how to run it (defaults float32, the model's limit up to
    2048, 1, tp=1, none); for an artifact, left unset (it fixes them) or equal to its own.

    `trusted_keys`: public-key files (`neuron-opt keygen`) an artifact, and a draft artifact, must be signed by
    (ArtifactError before anything of it loads otherwise); None: NEURON_OPT_TRUSTED_KEYS; empty: none required.
    Checkpoints hold no code (safetensors and GGUF, never unpickled) and need no signature. `verified`: the
    artifact's manifest when the caller has already read it with every check (read_verified), so it is not read
    again (neuron_opt.executors.loader).

    `model` may be an artifact's s3:// URI: it is pulled once into the local artifact cache, verified, and loaded
    from there (`s3_endpoint_url`: an S3-compatible store; default AWS_ENDPOINT_URL, else AWS S3)."""

    def __init__(self, model: str | Path, *, dtype: str | None = None, max_model_len: int | None = None,
                 batch_size: int | None = None, parallel: ParallelConfig | None = None,
                 num_speculative_tokens: int | None = None,
                 trusted_keys: Sequence[str | Path] | None = None, verified: VerifiedManifest | None = None,
                 s3_endpoint_url: str | None = None) -> None:
        self._drafts: dict[tuple[str, int], LLM] = {}
        self.trusted_keys = trusted_keys
        if is_remote(model):
            model = resolve(model, endpoint_url=s3_endpoint_url, trusted_keys=trusted_keys)
        loaded = load_model(model, dtype=dtype, max_model_len=max_model_len, batch_size=batch_size,
                            parallel=parallel, num_speculative_tokens=num_speculative_tokens, trusted_keys=trusted_keys,
                            verified=verified)
        self.config, self.tokenizer, self.runner = loaded.model_config, loaded.tokenizer, loaded.runner
        self.dtype: str = loaded.dtype
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt of a conversation through the model's chat template (`tools`: OpenAI tool definitions, for
        templates that render them)."""
        kw = {"tools": tools} if tools else {}
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids)

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams | None = None) -> GenerationOutput:
        params = params or SamplingParams()
        grammar = None if params.structured is None else self.grammars.state(params.structured, params.stop_token_ids)
        return generate_ids(self.runner, self.tokenizer, prompt_ids, params, self.eos_token_ids, grammar=grammar)

    def generate_ids_speculative(self, prompt_ids: list[int], params: SamplingParams | None,
                                 speculative: SpeculativeConfig) -> tuple[GenerationOutput, SpecStats]:
        """One sequence through the serving engine with speculative decoding (stepped here, no thread): greedy
        output equals `generate_ids`'; also returns the engine's speculation counters. A draft model
        (`speculative.model`) is loaded on first use and kept for later calls."""
        from neuron_opt.runtime.engine import Engine, RequestOutput

        params = params or SamplingParams()
        draft = self.draft(speculative.model, 1).runner if speculative.model is not None else None
        engine = Engine(self.runner, self.tokenizer, self.eos_token_ids, max_num_seqs=1, speculative=speculative,
                        draft=draft)
        outs: list[RequestOutput] = []
        engine.add_request("0", list(prompt_ids), params, outs.append)
        while engine.num_unfinished:
            engine.step()
        last = outs[-1]
        if last.finish_reason == "error":
            raise RuntimeError(f"generation failed: {last.error}")
        tokens = [t for o in outs for t in o.new_token_ids]
        logprobs = [lp.logprob for o in outs for lp in o.logprobs]
        text = "".join(o.text_delta for o in outs)
        return (GenerationOutput(list(prompt_ids), tokens, text, last.finish_reason or "stop", logprobs),
                engine.spec_stats)

    def draft(self, model: str | Path, max_num_seqs: int) -> LLM:
        """The draft model for speculative decoding with this one (kept per path): an artifact as compiled (its
        batch size and max_model_len must cover the engine's), or a checkpoint run eagerly in this model's dtype
        with a KV slot for each of `max_num_seqs` sequences at this model's max_model_len. Its tokenizer must be
        this model's (ConfigError otherwise)."""
        key = (str(model), max_num_seqs)
        drafts = self._drafts
        if key not in drafts:
            draft = (LLM(model, trusted_keys=self.trusted_keys) if is_artifact(model) else
                     LLM(model, dtype=self.dtype, max_model_len=self.runner.max_model_len, batch_size=max_num_seqs))
            check_draft_tokenizer(draft.tokenizer, self.tokenizer, model)
            drafts[key] = draft
        return drafts[key]

    def generate(self, prompt: str, params: SamplingParams | None = None) -> GenerationOutput:
        ids = self.tokenizer(prompt)["input_ids"]
        return self.generate_ids(list(ids), params)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> GenerationOutput:
        return self.generate_ids(self.encode_chat(messages), params)
