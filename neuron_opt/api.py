"""Python API: `LLM(model).generate(prompt)` / `.chat(messages)`.

`model` is a compiled artifact directory (from `neuron-opt compile`), an HF checkpoint directory, a GGUF file,
"default" (the embedded SmolLM2-135M-Instruct), or a Hugging Face Hub id (`org/name`, `org/name:Q4_K_M`; `revision=`,
`gguf_file=`: neuron_opt.hub). Checkpoints run on the eager reference backend in memory; artifacts run on the backend
they were compiled for.

    from neuron_opt import LLM, SamplingParams
    llm = LLM("default")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32))
    print(out.text)

LoRA adapters (docs/lora.md): an artifact compiled with `--enable-lora` (or a checkpoint with `lora=LoraConfig(...)`)
runs each call's prompts under an adapter, vLLM-style:

    llm = LLM("artifact-dir")
    out = llm.generate("...", lora_request=LoRARequest("sql", "/path/to/peft-adapter"))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from models.eagle3 import Eagle3Head
from neuron_opt.artifact import VerifiedManifest
from neuron_opt.checkpoint.eagle3 import check_head, load_head
from neuron_opt.config import ModelConfig, ParallelConfig, torch_dtype
from neuron_opt.embeddings import text_ids
from neuron_opt.errors import ConfigError
from neuron_opt.executors import LoadedModel, is_artifact, load_model
from neuron_opt.executors import build_model as build_model  # re-exported: eager models for tests and scripts
from neuron_opt.hub import resolve_eagle3_head
from neuron_opt.lora.config import LoraConfig
from neuron_opt.lora.registry import LoraManager, LoRARequest
from neuron_opt.multimodal.inputs import MultimodalPrompt
from neuron_opt.object_store import is_remote, resolve
from neuron_opt.runtime.engine import Engine, encode_chat, encode_multimodal_chat
from neuron_opt.runtime.output import GenerationOutput, RequestOutput, collect, model_eos_token_ids
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.speculative import SpecStats, SpeculativeConfig, check_draft_tokenizer
from neuron_opt.runtime.structured import GrammarCompiler
from neuron_opt.server.media import refuse_images


def embedding_inputs(inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                     tokenizer: Any, cfg: ModelConfig) -> list[list[int]]:
    """`LLM.embed`'s inputs as token id lists: a text, texts (tokenized as sentence-transformers does:
    `embeddings.text_ids`), token ids, or lists of token ids."""
    if isinstance(inputs, str):
        inputs = [inputs]
    items = list(inputs)
    if not items:
        raise ConfigError("inputs: give at least one text or token id list", param="inputs")
    if all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[union-attr]
    if all(isinstance(t, str) for t in items):
        return [text_ids(cfg, tokenizer, t) for t in items]  # type: ignore[arg-type]
    if all(not isinstance(t, str) and all(isinstance(i, int) for i in t) for t in items):  # type: ignore[union-attr]
        return [[int(i) for i in t] for t in items]  # type: ignore[union-attr]
    raise ConfigError("inputs: a text, a list of texts, a list of token ids or a list of token id lists (not a mix)",
                      param="inputs")


def load_draft(model: str | Path, target: LoadedModel, max_num_seqs: int,
               trusted_keys: Sequence[str | Path] | None = None) -> LoadedModel:
    """The draft model for speculative decoding with `target`: an artifact as compiled (its batch size and
    max_model_len must cover the engine's: the Engine checks), or a checkpoint run eagerly in the target's dtype
    with a KV slot for each of `max_num_seqs` sequences at the target's max_model_len. Its tokenizer must be the
    target's (ConfigError otherwise)."""
    draft = (load_model(model, trusted_keys=trusted_keys) if is_artifact(model) else
             load_model(model, dtype=target.dtype, max_model_len=target.runner.max_model_len, batch_size=max_num_seqs))
    check_draft_tokenizer(draft.tokenizer, target.tokenizer, model)
    return draft


def load_eagle3(model: str | Path, target: LoadedModel) -> Eagle3Head:
    """An EAGLE-3 head (a directory in the EAGLE/SpecForge or speculators layout, or a Hub id) for speculative
    decoding with `target`, in the target's dtype, checked against it (vocabulary, hidden size, the layers it reads:
    ConfigError naming speculative_model), sharing the target's embeddings when it has none of its own."""
    path = resolve_eagle3_head(model)
    head = load_head(path, target.runner.max_model_len, torch_dtype(target.dtype))
    head.aux_layer_ids = check_head(head.cfg, target.model_config, str(model))
    if head.embed_tokens is None:
        head.share_embedding(target.runner.embedding_fn())
    return head


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
    from there (`s3_endpoint_url`: an S3-compatible store; default AWS_ENDPOINT_URL, else AWS S3). A Hub id is
    fetched into the Hub cache (`revision`: its branch, tag or commit; `gguf_file`: a GGUF repo's file to use).


    Generation is the serving engine's (runtime/engine.py), stepped in the calling thread: each call builds an
    `Engine` over this model's runner (no model work: the scheduler's block tables, the sampler and output state)
    with the call's requests, and steps it until every one has finished. Each prompt is prefilled in one call, or,
    longer than the largest prefill bucket, in chunks of that bucket's length (an artifact compiled without offset
    prefill refuses it, ContextLengthError); no chunked prefill cuts a prompt to a step's token budget and no KV
    is shared between prompts or calls (no prefix caching), so a prompt's output does not depend on the others.
    Requests beyond the runner's largest decode batch wait for a free sequence slot. `async_scheduling`: the engines
    overlap each step's host work with the graph calls (runtime/engine.py; None: the backend's default), with the
    same outputs as the synchronous loop."""

    def __init__(self, model: str | Path, *, dtype: str | None = None, max_model_len: int | None = None,
                 batch_size: int | None = None, parallel: ParallelConfig | None = None,
                 num_speculative_tokens: int | None = None,
                 trusted_keys: Sequence[str | Path] | None = None, verified: VerifiedManifest | None = None,
                 s3_endpoint_url: str | None = None, lora: LoraConfig | None = None, revision: str | None = None,
                 gguf_file: str | None = None, async_scheduling: bool | None = None) -> None:
        if is_remote(model):
            model = resolve(model, endpoint_url=s3_endpoint_url, trusted_keys=trusted_keys)
        self._adopt(load_model(model, dtype=dtype, max_model_len=max_model_len, batch_size=batch_size,
                               parallel=parallel, num_speculative_tokens=num_speculative_tokens,
                               trusted_keys=trusted_keys, verified=verified, lora=lora, revision=revision,
                               gguf_file=gguf_file), trusted_keys)
        self.async_scheduling = async_scheduling

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, trusted_keys: Sequence[str | Path] | None = None) -> LLM:
        """An LLM over a model already loaded (`load_model`); `trusted_keys`: what its draft artifacts need."""
        llm = cls.__new__(cls)
        llm._adopt(loaded, trusted_keys)
        return llm

    def _adopt(self, loaded: LoadedModel, trusted_keys: Sequence[str | Path] | None) -> None:
        self.loaded = loaded
        self.config, self.tokenizer, self.runner, self.dtype = (loaded.model_config, loaded.tokenizer, loaded.runner,
                                                                loaded.dtype)
        self._drafts: dict[tuple[str, int], LLM] = {}
        self._heads: dict[str, Eagle3Head] = {}
        self.trusted_keys = trusted_keys
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        self.loras = LoraManager(self.runner.executor, self.config) if self.runner.lora_config is not None else None
        self._lora_paths: dict[str, str] = {}
        self.async_scheduling: bool | None = None  # the engines' (runtime/engine.py); None: the backend's default

    def add_lora(self, request: LoRARequest) -> None:
        """Register `request.lora_path` under `request.lora_name` (validated now; ConfigError naming the field).
        Registering the same name and path again does nothing; the name with another path is refused."""
        if self.loras is None:
            raise ConfigError("lora_request: this model takes no LoRA adapters (compile it with --enable-lora, or "
                              "give a checkpoint lora=LoraConfig(...))", param="lora_request")
        if request.lora_name in self.loras:
            if self._lora_paths.get(request.lora_name) != str(request.lora_path):
                raise ConfigError(f"lora_request: {request.lora_name!r} is registered with another path "
                                  f"({self._lora_paths.get(request.lora_name)})", param="lora_request")
            return
        self.loras.register(request.lora_name, request.lora_path)
        self._lora_paths[request.lora_name] = str(request.lora_path)

    def remove_lora(self, name: str) -> None:
        """Forget a registered adapter (KeyError when unknown)."""
        if self.loras is None:
            raise KeyError(name)
        self.loras.unregister(name)
        self._lora_paths.pop(name, None)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return model_eos_token_ids(self.config.eos_token_ids, self.tokenizer)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt of a conversation through the model's chat template (`tools`: OpenAI tool definitions, for
        templates that render them; `template_kwargs`: more variables for the template, e.g. enable_thinking)."""
        return encode_chat(self.tokenizer, messages, tools, template_kwargs)

    def encode_multimodal_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                               template_kwargs: dict[str, Any] | None = None) -> MultimodalPrompt:
        """A conversation's prompt and images (content parts {"type": "image", "image": PIL.Image}) through the
        model's processor (a vision-language model) or chat template (runtime.engine.encode_multimodal_chat); a
        prompt `generate_batch` takes."""
        return encode_multimodal_chat(self.tokenizer, self.runner.vision, messages, tools, template_kwargs)

    def _run(self, prompts: Sequence[Sequence[int] | MultimodalPrompt], params: Sequence[SamplingParams],
             speculative: SpeculativeConfig | None,
             loras: Sequence[LoRARequest | None] | None = None) -> tuple[list[GenerationOutput], SpecStats]:
        """Every prompt through one engine, stepped here until all have finished; their outputs in prompt order and
        the engine's speculation counters. A request that fails raises its error (after the others finish).
        `loras`: each prompt's adapter (None: the base model)."""
        if len(prompts) != len(params):
            raise ConfigError(f"params: {len(params)} sampling parameters for {len(prompts)} prompts; give one, or "
                              "one per prompt", param="params")
        loras = list(loras) if loras is not None else [None] * len(prompts)
        if len(loras) != len(prompts):
            raise ConfigError(f"lora_request: {len(loras)} adapters for {len(prompts)} prompts; give one, or one per "
                              "prompt", param="lora_request")
        for lr in loras:
            if lr is not None:
                self.add_lora(lr)
        seqs = max(1, min(len(prompts), self.runner.buckets.decode_batches[-1]))
        draft: Any = None
        if speculative is not None and speculative.method == "eagle3":
            draft = self.eagle3(speculative.model)
        elif speculative is not None and speculative.model is not None:
            draft = self.draft(speculative.model, seqs).runner
        engine = Engine(self.runner, self.tokenizer, self.eos_token_ids, max_num_seqs=seqs,
                        max_waiting=len(prompts), enable_prefix_caching=False, enable_chunked_prefill=False,
                        speculative=speculative, draft=draft, grammars=self.grammars, loras=self.loras,
                        async_scheduling=self.async_scheduling)
        outs: list[list[RequestOutput]] = [[] for _ in prompts]
        mm = [p if isinstance(p, MultimodalPrompt) else MultimodalPrompt(list(p)) for p in prompts]
        prompts = [m.token_ids for m in mm]
        for i, (m, p, lr) in enumerate(zip(mm, params, loras, strict=True)):
            engine.add_request(str(i), m.token_ids, p, outs[i].append, lora=lr.lora_name if lr is not None else None,
                               images=m.images, rope_positions=m.rope_positions)
        while engine.num_unfinished:
            engine.step()
        for o in outs:
            last = o[-1]
            if last.finish_reason == "error":
                if last.exception is not None:
                    raise last.exception
                raise RuntimeError(f"generation failed: {last.error}")
        return [collect(ids, o) for ids, o in zip(prompts, outs, strict=True)], engine.spec_stats

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams | None = None,
                     lora_request: LoRARequest | None = None) -> GenerationOutput:
        return self._run([prompt_ids], [params or SamplingParams()], None, [lora_request])[0][0]

    def generate_batch(self, prompts: Sequence[Sequence[int] | MultimodalPrompt],
                       params: SamplingParams | Sequence[SamplingParams] | None = None,
                       speculative: SpeculativeConfig | None = None,
                       lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                       ) -> list[GenerationOutput]:
        """Many prompts (token ids, or `encode_multimodal_chat`'s prompts with images) batched through the engine
        (continuous batching: up to the runner's largest decode batch at once); `params`: one for all, or one per
        prompt; `speculative`: speculative decoding for all of them. Each output is what `generate_ids` gives its
        prompt alone (greedy: the same tokens up to the rounding differences between batch sizes of the graphs;
        seeded: the same samples)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        return self._run(prompts, params, speculative, lora_request)[0]

    def generate_ids_speculative(self, prompt_ids: list[int], params: SamplingParams | None,
                                 speculative: SpeculativeConfig,
                                 lora_request: LoRARequest | None = None) -> tuple[GenerationOutput, SpecStats]:
        """One sequence with speculative decoding: greedy output equals `generate_ids`'; also returns the
        engine's speculation counters. A draft model (`speculative.model`) is loaded on first use and kept for
        later calls. Under a LoRA adapter the target verifies with the adapter and the draft proposes without it
        (a draft model takes no adapters): the output is still `generate_ids`' under the adapter."""
        outs, stats = self._run([prompt_ids], [params or SamplingParams()], speculative, [lora_request])
        return outs[0], stats

    def draft(self, model: str | Path, max_num_seqs: int) -> LLM:
        """The draft model for speculative decoding with this one (kept per path and `max_num_seqs`: `load_draft`).
        Its tokenizer must be this model's (ConfigError otherwise)."""
        key = (str(model), max_num_seqs)
        if key not in self._drafts:
            self._drafts[key] = LLM.from_loaded(load_draft(model, self.loaded, max_num_seqs, self.trusted_keys),
                                                self.trusted_keys)
        return self._drafts[key]

    def eagle3(self, model: str | Path) -> Eagle3Head:
        """The EAGLE-3 head for speculative decoding with this model (kept per path: `load_eagle3`)."""
        if str(model) not in self._heads:
            self._heads[str(model)] = load_eagle3(model, self.loaded)
        return self._heads[str(model)]

    def embed(self, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> list[list[float]]:
        """Embeddings of an embedding model (`compile --task embed`, or a sentence-transformers checkpoint): one
        vector per input, in order. `inputs`: a text, texts, token ids, or lists of token ids; texts are tokenized
        as sentence-transformers does (the tokenizer's special tokens added), and no prompt is prepended. The inputs
        run through one engine, up to the prefill batch per graph call (mixed lengths padded to the call's
        bucket); each vector is what that input gives alone."""
        return [v.tolist() for v in self.embed_tensors(inputs)]

    def embed_tensors(self, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> list[Any]:
        """`embed`, each vector an fp32 torch tensor [hidden_size]."""
        if not self.runner.embeds:
            raise ConfigError("embed: this model generates text; compile the checkpoint with --task embed",
                              param="model")
        batch = embedding_inputs(inputs, self.tokenizer, self.config)
        V = self.config.vocab_size
        if bad := [t for ids in batch for t in ids if not 0 <= t < V]:
            raise ConfigError(f"inputs: token ids {bad[:5]} are outside the vocabulary (0..{V - 1})", param="inputs")
        seqs = max(1, min(len(batch), self.runner.buckets.decode_batches[-1]))
        engine = Engine(self.runner, self.tokenizer, self.eos_token_ids, max_num_seqs=seqs, max_waiting=len(batch))
        outs: list[list[RequestOutput]] = [[] for _ in batch]
        for i, ids in enumerate(batch):
            engine.add_embedding_request(str(i), ids, outs[i].append)
        while engine.num_unfinished:
            engine.step()
        for o in outs:
            if o[-1].finish_reason == "error":
                if o[-1].exception is not None:
                    raise o[-1].exception
                raise RuntimeError(f"embedding failed: {o[-1].error}")
        return [o[-1].embedding for o in outs]

    def generate(self, prompt: str, params: SamplingParams | None = None,
                 lora_request: LoRARequest | None = None) -> GenerationOutput:
        ids = self.tokenizer(prompt)["input_ids"]
        return self.generate_ids(list(ids), params, lora_request)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
             lora_request: LoRARequest | None = None) -> GenerationOutput:
        """One conversation's reply (OpenAI's or HF's shape). Content may hold images as HF-format parts {"type":
        "image", "image": PIL.Image} (or vLLM's `image_pil`) for a vision-language model (`encode_multimodal_chat`);
        for a model that takes no images they are a ConfigError naming the part (`self.loaded.modalities`)."""
        refuse_images(messages, self.loaded.modalities, self.config.architecture)
        return self._run([self.encode_multimodal_chat(messages)], [params or SamplingParams()], None,
                         [lora_request])[0][0]
