"""The generation engine: step = schedule -> execute -> output processing. The one generation loop: the server
runs it in a background thread, `LLM` (neuron_opt/api.py) steps it in the caller's thread.

What lives where
- engine.py (here): the request inbox, the step loop and its glue between the scheduler (runtime/scheduler.py:
  which tokens of which requests run), the runner (the graph calls) and the sampler (runtime/sampling.py).
- runtime/output.py: detokenization, stop checks, logprobs, finish reasons, the outputs sent to callers.
- runtime/speculative.py (`SpeculativeDecoding`): with `speculative=`, what each decode step proposes and
  whether it verifies, and the acceptance of a verify row.

Threading model
- The scheduler, output processing and per-request stop state live on the engine thread; so do the graph calls
  and sampling, except with async scheduling, where each step's graph calls and sampling run as one task on the
  runner's graph thread (runtime/pipeline.py) while the engine thread schedules the next step and lands the one
  before (`_step_async`; docs/serving.md, "Async scheduling"). Nothing else touches them. Other threads (the
  HTTP event loop) talk to it only through `add_request` / `abort`, which put commands on a thread-safe inbox
  that the engine drains at the start of every step. Without `start()` there is no engine thread: the one caller
  that calls `step()` plays its part.
- Results go out through a per-request callback `on_output(RequestOutput)`, called on the engine thread.
  It must be cheap and thread-safe; the server passes `loop.call_soon_threadsafe(queue.put_nowait, ...)`.
- Validation that can fail for user input (context length, queue full) runs synchronously in `add_request`,
  in the caller's thread, so the HTTP layer can answer 400/503 before anything is queued. Admission has one
  bound, checked there once: at most max_num_seqs + max_waiting requests in flight (added, not yet finished).
  The scheduler bounds no queue of its own, so a request admitted here is never refused on the engine thread.

Within a step the decodes run first (one `runner.decode` for all running sequences) and their tokens are
emitted before the step's prefill chunks run, so streams that are already running are not delayed by new
prompts more than the scheduler's token budget allows (runtime/scheduler.py: chunked prefill, prefix caching,
preemption). With speculative decoding on that one call may be a verify of each row's proposed tokens instead,
and a step may emit several tokens per request. Prefill chunks run up to the artifact's prefill batch per graph
call. An abort frees its KV blocks at the start of the next step (at most one step later). A failing runner call
fails only the requests in it (finish_reason "error"); the engine keeps serving. A call of several rows that fails
(a prefill's chunks, a decode's or a verify's rows, a speculative proposal) is run again one row per call, so only
the request whose row fails (a token id past the model's vocabulary, say) fails, with the call and the runner's
error in its message; the others go on, their greedy output unchanged (a row rewrites only its own positions'
K/V, from the same tokens).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from neuron_opt.buckets import pick_decode
from neuron_opt.errors import ConfigError, NeuronOptError, QueueFullError
from neuron_opt.lora.registry import LoraManager
from neuron_opt.multimodal.encoder_cache import EncoderCache
from neuron_opt.multimodal.inputs import (
    ImageItem,
    MultimodalPrompt,
    cache_token_ids,
    check_images,
    image_blocks,
    image_parts,
    last_keys,
    processor_chat,
)
from neuron_opt.runtime.eagle3 import Eagle3Proposer
from neuron_opt.runtime.kv_tier import KVTier
from neuron_opt.runtime.output import OutputProcessor, RequestOutput, TokenLogprob, send, token_logprobs
from neuron_opt.runtime.pipeline import RowOutcome, StepTask, TaskResult, run_task
from neuron_opt.runtime.request import PLACEHOLDER, Request
from neuron_opt.runtime.runner import DecodeRow, ModelRunner, PrefillRow, VerifyRow
from neuron_opt.runtime.sampling import (
    SampleResult,
    SamplerState,
    SamplingParams,
    candidates_needed,
    device_inputs,
    device_results,
    host_sampling_reason,
    sample_batch,
    verify_host_reason,
    verify_inputs,
)
from neuron_opt.runtime.scheduler import DecodeWork, KVConfig, PrefillWork, Scheduler, SchedulerOutput
from neuron_opt.runtime.speculative import Proposer, SpecStats, SpecStep, SpeculativeConfig, SpeculativeDecoding
from neuron_opt.runtime.structured import GrammarCompiler
from neuron_opt.sample_ops import SamplingInputs

if TYPE_CHECKING:
    from models.eagle3 import Eagle3Head

log = logging.getLogger(__name__)


def async_scheduling_default(runner: ModelRunner) -> bool:
    """Whether async scheduling is on by default over `runner`: where its executor's graph calls leave the host
    enough to overlap (`Executor.async_scheduling`, measured per backend: docs/serving.md, "Async scheduling");
    executors that do not say are taken to (a device runs the graph while the host thread waits)."""
    return bool(getattr(runner.executor, "async_scheduling", True))


class EngineDeadError(NeuronOptError):
    """The engine loop died (a bug); new requests are refused (HTTP 500) and /health reports 503."""


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt of a conversation through the model's chat template (`tools`: OpenAI tool definitions, for
    templates that render them; `template_kwargs`: more variables for the template, e.g. enable_thinking)."""
    kw: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        kw["tools"] = tools
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def encode_multimodal_chat(tokenizer: Any, vision: Any, messages: list[dict[str, Any]],
                           tools: list[dict[str, Any]] | None = None,
                           template_kwargs: dict[str, Any] | None = None) -> MultimodalPrompt:
    """A conversation's prompt and images: through the processor of a vision-language model (`vision`:
    `ModelRunner.vision`; content parts {"type": "image", "image": PIL.Image}, neuron_opt.multimodal.inputs), or
    the tokenizer's chat template for a text model (`vision` None), where an image part is a ConfigError naming
    its field."""
    if vision is not None:
        return processor_chat(vision, messages, tools, template_kwargs)
    if parts := image_parts(messages):
        raise ConfigError(f"{parts[0][0]}: this model takes text only, not images", param=parts[0][0])
    return MultimodalPrompt(encode_chat(tokenizer, messages, tools, template_kwargs))


@dataclass
class _Sequence:
    """A request's state on the engine thread besides its output stream (runtime/output.py)."""

    request: Request
    state: SamplerState
    images: tuple[ImageItem, ...] = ()  # its prompt's images (neuron_opt.multimodal)
    rope: tuple[torch.Tensor, int] | None = None  # M-RoPE: the prompt's [3, n] positions and the decode delta


@dataclass
class _Command:
    kind: str  # "add" | "abort"
    request_id: str
    seq: _Sequence | None = None
    params: SamplingParams | None = None
    on_output: Callable[[RequestOutput], object] | None = None


@dataclass
class _Flight:
    """A step handed to the graph thread (async scheduling), its outputs not yet taken."""

    task: StepTask
    future: concurrent.futures.Future[TaskResult]


@dataclass
class EngineStats:
    """Counters of the engine thread. Seconds are wall time on it, summed over steps: `graph_s` in the runner's
    graph calls (input building included; with speculative decoding, the proposer's planning too), `sample_s` in
    sampling, `output_s` in output processing (detokenizing, stop checks, the callbacks); the rest of
    `sum(step_times)` is scheduling and glue. `prefill_tokens`: prompt tokens prefilled; `prefill_graph_tokens`:
    tokens the prefill graphs ran (rows x tokens of their buckets), so their difference is padding.
    `step_tokens`: how many steps scheduled each token count (a decode row counts 1, a prefill chunk its tokens).
    With async scheduling `graph_s` and `sample_s` are the graph thread's, `wait_s` is the time the engine thread
    waited for it (the rest of a step's wall time overlapped the graph calls), and `step_times` also holds the
    steps that only landed the step in flight (no rows of their own, not counted in `steps`)."""

    steps: int = 0
    decode_rows: int = 0
    prefills: int = 0  # prefill chunks run
    preemptions: int = 0
    step_times: list[float] = field(default_factory=list)
    step_s: float = 0.0  # sum of every step's wall time (step_times keeps the first 100,000)
    graph_s: float = 0.0
    sample_s: float = 0.0
    output_s: float = 0.0
    wait_s: float = 0.0
    prefill_tokens: int = 0
    prefill_graph_tokens: int = 0
    step_tokens: collections.Counter[int] = field(default_factory=collections.Counter)


class Engine:
    """Continuous-batching engine over a ModelRunner.

    Args:
        runner: the model runner (eager or compiled backend).
        tokenizer: used for incremental detokenization and stop strings.
        eos_token_ids: tokens that end a sequence unless `ignore_eos` (runtime.output.model_eos_token_ids).
        max_num_seqs: most sequences running at once (capped by the artifact's largest decode batch).
        max_waiting: requests in flight beyond max_num_seqs before `add_request` raises QueueFullError.
        max_num_batched_tokens: tokens per step, decodes first, then prefill chunks (see scheduler.py).
        enable_prefix_caching, enable_chunked_prefill: None = on when the artifact has offset prefill buckets;
            True where it has none is an error.
        speculative: speculative decoding settings (runtime/speculative.py), or None.
        draft: the draft model's runner, for `speculative.method == "draft_model"`; the EAGLE-3 head
            (api.load_eagle3), for "eagle3"; None otherwise.
        grammars: the model's GrammarCompiler, to share its cache of compiled grammars with other engines of the
            same model; None: the engine's own.
        loras: the model's LoRA adapters and slots (neuron_opt.lora.registry.LoraManager), shared with other
            engines of the model; None: the engine's own when the model has a LoRA capacity.
        kv_tier: a second KV tier over this runner's pools (runtime/kv_tier.KVTier: evicted prefix-cache blocks
            kept in host memory and restored on a hit), or None.
        async_scheduling: overlap the host's work with the graph calls (module docstring); None: the executor's
            default (`async_scheduling_default`), off with speculative decoding and for embedding models, which
            refuse True.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: object,
        eos_token_ids: tuple[int, ...],
        *,
        max_num_seqs: int | None = None,
        max_waiting: int = 1024,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool | None = None,
        enable_chunked_prefill: bool | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: ModelRunner | Eagle3Head | None = None,
        grammars: GrammarCompiler | None = None,
        loras: LoraManager | None = None,
        kv_tier: KVTier | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        self.runner, self.tokenizer, self.eos_token_ids = runner, tokenizer, tuple(eos_token_ids)
        largest = runner.buckets.decode_batches[-1]
        seqs = largest if max_num_seqs is None else min(max_num_seqs, largest)
        if speculative is None and draft is not None:
            raise ConfigError("speculative_model: a draft runner goes with the draft_model method, and only with it",
                              param="speculative_model")
        if runner.embeds and speculative is not None:
            raise ConfigError("speculative: an embedding model generates no tokens", param="speculative")
        self.embeds = runner.embeds  # an embedding model: requests come through add_embedding_request
        self.spec = speculative
        self.speculation = None if speculative is None else SpeculativeDecoding(speculative, runner, draft, seqs)
        offset = runner.buckets.offset_prefill
        cache = runner.cache
        kv = KVConfig(cache.num_blocks, cache.block_size, cache.max_model_len, runner.max_prompt_len,
                      offset if enable_prefix_caching is None else enable_prefix_caching,
                      offset if enable_chunked_prefill is None else enable_chunked_prefill, offset,
                      cache.sliding_window, cache.window_num_blocks)
        self.scheduler = Scheduler(
            seqs,
            kv,
            max_num_batched_tokens=max_num_batched_tokens,
            check_fits=runner.check_fits,
            lookahead=speculative.num_speculative_tokens if speculative is not None else 0,
            tier=kv_tier,
        )
        self.kv_tier = kv_tier
        if loras is None and runner.lora_config is not None:
            loras = LoraManager(runner.executor, runner.model_config)
        self.loras = loras
        self.scheduler.lora = loras
        # the LoRA adapters of the running and of the waiting requests, with their request counts, as of the last
        # step (vLLM's scheduler stats behind vllm:lora_requests_info); replaced whole, so any thread may read it
        self.lora_adapters: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self.max_waiting = max_waiting
        # image embeddings of the requests in flight (a vision-language model's runner only)
        self.encoder_cache = EncoderCache(runner.encode_image) if runner.vision is not None else None
        self.stats = EngineStats()
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids)  # engine thread only
        self._inbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._seqs: dict[str, _Sequence] = {}  # engine thread only
        # prompt logprobs computed so far (those of prompt tokens 1, 2, ...), until the first output takes them
        self._prompt_lps: dict[str, list[TokenLogprob]] = {}  # engine thread only
        self._pending = 0  # requests added but not yet finished (any thread; guarded by _lock)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None  # set if the loop itself died (a bug)
        self.grammars = grammars if grammars is not None else GrammarCompiler(tokenizer, runner.vocab_size,
                                                                              self.eos_token_ids)
        self.async_scheduling = self._resolve_async(async_scheduling)
        # a KV tier copies block bytes and LoRA loads adapter slots on the host while scheduling: with either, a
        # step is scheduled once the one in flight has ended (its landing still overlaps the next)
        self._schedule_after_flight = kv_tier is not None or loras is not None
        self._flight: _Flight | None = None  # engine thread only

    def _resolve_async(self, asked: bool | None) -> bool:
        why = ("speculative decoding proposes from each step's sampled tokens, which a step scheduled before them "
               "lacks" if self.spec is not None else
               "an embedding model has no decode steps to overlap" if self.embeds else
               "the pipelined step does not yet carry image embeddings and 3-D rotary positions (a vision-language "
               "model)" if self.runner.vision is not None else None)
        if asked and why is not None:
            raise ConfigError(f"async_scheduling: {why}; turn one of them off", param="async_scheduling")
        if asked is None:
            return why is None and async_scheduling_default(self.runner)
        return asked

    # ---- public, thread-safe -------------------------------------------------------------------------

    @property
    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counters (all zero without it)."""
        return self.speculation.stats if self.speculation is not None else SpecStats()

    @property
    def proposer(self) -> Proposer | Eagle3Proposer | None:
        """Speculative decoding's proposer (None without it)."""
        return self.speculation.proposer if self.speculation is not None else None

    @property
    def runners(self) -> tuple[ModelRunner, ...]:
        """The runners whose graph calls this engine's thread makes: the model's, and a draft model's."""
        draft = getattr(self.proposer, "runner", None)
        return (self.runner,) if draft is None else (self.runner, draft)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV block pool held by sequences (0-1); cached free blocks count as free."""
        bm = self.scheduler.blocks
        return 1.0 - bm.num_free_blocks / (bm.num_blocks - 1)

    @property
    def prefix_cache_stats(self) -> Any:
        return self.scheduler.blocks.stats

    @property
    def num_unfinished(self) -> int:
        return self._pending

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """A conversation's prompt ids through the model's chat template (`encode_chat`)."""
        return encode_chat(self.tokenizer, messages, tools, template_kwargs)

    def encode_multimodal_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                               template_kwargs: dict[str, Any] | None = None) -> MultimodalPrompt:
        """A conversation's prompt ids and images (`encode_multimodal_chat`): pass `.token_ids` and `.images` to
        `add_request`. Thread-safe (preprocessing runs in the caller's thread)."""
        return encode_multimodal_chat(self.tokenizer, self.runner.vision, messages, tools, template_kwargs)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of `params.structured` (None without one); ConfigError if it does not compile.
        Thread-safe and cached: the server calls it in a worker thread before `add_request`, so the event loop and
        the engine thread never wait for a compile."""
        return None if params.structured is None else self.grammars.compile(params.structured)

    def check_admission(self, n: int = 1) -> None:
        """QueueFullError unless `n` more requests would be admitted now: callers check before costly work for a
        request (compiling its grammar); `add_request` checks again."""
        with self._lock:
            self._admit(n)

    def _admit(self, n: int) -> None:
        if self._pending + n > self.scheduler.max_num_seqs + self.max_waiting:
            raise QueueFullError(
                f"server busy: {self._pending} requests in flight "
                f"({self.scheduler.max_num_seqs} running + {self.max_waiting} waiting); retry later"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], object],
        arrival_time: float | None = None,
        grammar: Any = None,
        share_prefix_with: str | None = None,
        lora: str | None = None,
        images: tuple[ImageItem, ...] = (),
        rope_positions: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        """Queue a request. Raises ContextLengthError / ConfigError / QueueFullError synchronously.

        Args:
            grammar: `compile_grammar(params)`'s result when the caller compiled it already (else compiled here).
            share_prefix_with: a request queued before this one with the same prompt (a sibling sample of `n`):
                this one is admitted after that one's prompt has K/V, so it takes its blocks from the prefix cache.
            lora: the name of a registered LoRA adapter to run under (`loras`); None: the base model.
            images: the prompt's images (`encode_multimodal_chat`'s), for a vision-language model.
            rope_positions: an M-RoPE model's prompt positions [3, len(prompt)] and decode delta
                (`encode_multimodal_chat`'s `rope_positions`); None: 1-D positions.
        """
        if images:
            if self.encoder_cache is None:
                raise ConfigError("messages: this model takes text only, not images", param="messages")
            check_images(images, len(prompt_token_ids))
            self._check_image_blocks(images)
        if rope_positions is not None and tuple(rope_positions[0].shape) != (3, len(prompt_token_ids)):
            raise ConfigError(f"rope_positions: [3, {len(prompt_token_ids)}] positions for the prompt, got "
                              f"{list(rope_positions[0].shape)}", param="messages")
        if self.embeds:
            raise ConfigError("this model is an embedding model (compiled with --task embed): it computes embeddings "
                              "(/v1/embeddings, LLM.embed), not text", param="model")
        self._submit(request_id, prompt_token_ids, params, on_output, arrival_time, grammar, share_prefix_with, lora,
                     tuple(images), rope_positions)

    def add_embedding_request(self, request_id: str, prompt_token_ids: list[int],
                              on_output: Callable[[RequestOutput], object], arrival_time: float | None = None) -> None:
        """Queue an embedding request (an embedding model's engine only): one prefill of the whole input, whose
        pooled vector comes back in a finished RequestOutput's `embedding`. Raises like `add_request`."""
        if not self.embeds:
            raise ConfigError("this model generates text: it has no pooling step for embeddings; compile the "
                              "checkpoint with --task embed", param="model")
        self._submit(request_id, prompt_token_ids, SamplingParams(max_tokens=1), on_output, arrival_time)

    def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                on_output: Callable[[RequestOutput], object], arrival_time: float | None = None, grammar: Any = None,
                share_prefix_with: str | None = None, lora: str | None = None,
                images: tuple[ImageItem, ...] = (), rope: tuple[torch.Tensor, int] | None = None) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.error!r}")
        self.scheduler.validate(len(prompt_token_ids), params.max_tokens)
        state = None
        if params.structured is not None:
            state = self.grammars.state(params.structured, params.stop_token_ids, grammar)
        salt = None
        if lora is not None:
            if self.loras is None:
                raise ConfigError("lora: this model was compiled without --enable-lora", param="model")
            try:
                salt = self.loras.begin_request(lora)
            except KeyError:
                raise ConfigError(f"lora: no adapter named {lora!r} is loaded", param="model") from None
        with self._lock:
            try:
                self._admit(1)
            except QueueFullError:
                if lora is not None:
                    self.loras.end_request(lora)  # type: ignore[union-attr]
                raise
            self._pending += 1
        req = Request(
            request_id,
            list(prompt_token_ids),
            params.max_tokens,
            arrival_time if arrival_time is not None else time.monotonic(),
            share_prefix_with=share_prefix_with,
            lora_name=lora,
            cache_salt=salt,
            scores_prompt=params.prompt_logprobs is not None,
            cache_token_ids=cache_token_ids(prompt_token_ids, images) if images else None,
            atomic_spans=image_blocks(images) if images and self._bidirectional_images else (),
        )
        seq = _Sequence(req, SamplerState.create(params, state), images, rope)
        self._inbox.put(_Command("add", request_id, seq, params, on_output))

    def abort(self, request_id: str) -> None:
        """Cancel a request (e.g. its client went away); its KV blocks are freed at the start of the next step."""
        self._inbox.put(_Command("abort", request_id))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="neuron-opt-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after the current step. Unfinished requests are aborted (callers drain first)."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.scheduler.has_work():
                    cmd = self._inbox.get()  # idle: block until a request arrives
                    if cmd is None:
                        break
                    self._apply(cmd)
                self.step()
        except BaseException as e:  # a bug in the engine itself: fail every request, report unhealthy
            self.error = e
            log.error("engine loop died:\n%s", traceback.format_exc())
            for rid in list(self._seqs):
                self._fail(rid, f"engine failure: {e}")
        finally:
            self._settle()
            for rid in list(self._seqs):
                self._end(rid, "abort")

    def _apply(self, cmd: _Command) -> None:
        if cmd.kind == "add":
            assert cmd.seq is not None and cmd.params is not None and cmd.on_output is not None
            try:
                self.scheduler.add(cmd.seq.request)
            except Exception as e:  # a bug (admission and validation ran in add_request): fail this request only
                with self._lock:
                    self._pending -= 1
                if cmd.seq.request.lora_name is not None and self.loras is not None:
                    self.loras.end_request(cmd.seq.request.lora_name)
                send(cmd.on_output, RequestOutput(cmd.request_id, (), "", cmd.seq.request.num_prompt_tokens, 0, True,
                                                  "error", error=str(e), time=time.monotonic(), exception=e))
                return
            self._seqs[cmd.request_id] = cmd.seq
            self.outputs.add(cmd.request_id, cmd.params, cmd.seq.request.num_prompt_tokens, cmd.on_output)
        elif cmd.request_id in self._seqs:
            self._end(cmd.request_id, "abort")

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd is None:
                self._stop.set()
                return
            self._apply(cmd)

    def step(self) -> bool:
        """One engine iteration. Returns False when there was nothing to do. The loop thread calls it, or, with no
        loop started, one caller's thread (`LLM` steps its engine until its requests finish)."""
        self._drain_inbox()
        if self.async_scheduling:
            return self._step_async()
        out = self.scheduler.schedule()
        if out.is_empty:
            self._note_lora_adapters()
            return False
        t0 = time.perf_counter()
        if self.speculation is not None:  # (speculation runs this synchronous loop only)
            for rid in out.preempted:
                self.speculation.preempted(rid)
        if out.decodes:
            self._decode_or_verify(out.decodes)
        per_call = self.runner.buckets.prefill_batch
        for i in range(0, len(out.prefills), per_call):
            self._prefill(out.prefills[i:i + per_call])
        self._count_step(out, t0)
        self._note_lora_adapters()
        return True

    def _count_step(self, out: SchedulerOutput, t0: float) -> None:
        st = self.stats
        st.steps, st.decode_rows, st.prefills, st.preemptions = (
            st.steps + 1,
            st.decode_rows + len(out.decodes),
            st.prefills + len(out.prefills),
            st.preemptions + len(out.preempted),
        )
        st.step_tokens[len(out.decodes) + sum(len(p.token_ids) for p in out.prefills)] += 1
        dt = time.perf_counter() - t0
        st.step_s += dt
        if len(st.step_times) < 100_000:
            st.step_times.append(dt)
    # ---- async scheduling (engine thread) -----------------------------------------------------------------

    def _step_async(self) -> bool:
        """One step with async scheduling: schedule step N + 1 and build its decode inputs while step N runs on the
        graph thread (its rows' tokens are `PLACEHOLDER`s until then), take step N's tokens, hand step N + 1 over,
        then land step N (detokenize, stop checks, callbacks) while step N + 1 runs. A step with prompt-logprob rows
        runs on this thread after step N has landed (the synchronous path)."""
        flight, self._flight = self._flight, None
        done: dict[str, RowOutcome] | None = None
        if flight is not None and self._schedule_after_flight:
            done = self._take(flight)
        out = self.scheduler.schedule()
        if flight is None and out.is_empty:
            self._note_lora_adapters()
            return False
        t0 = time.perf_counter()
        pipelined = not any(self._seqs[p.request_id].request.scores_prompt for p in out.prefills)
        built = self.runner.decode_inputs(self._decode_rows(out.decodes)) if pipelined and out.decodes else None
        if flight is not None:
            if done is None:
                done = self._take(flight)
            out, built = self._patch(out, done, built)
        if pipelined:
            if not out.is_empty:
                self._flight = self._launch(out, built, set(done or ()))
            if done is not None:
                self._land(done)
        else:
            if done is not None:
                self._land(done)
            out = SchedulerOutput(tuple(d for d in out.decodes if d.request_id in self._seqs),
                                  tuple(p for p in out.prefills if p.request_id in self._seqs), out.preempted)
            if out.decodes:
                self._decode_or_verify(out.decodes)
            per_call = self.runner.buckets.prefill_batch
            for i in range(0, len(out.prefills), per_call):
                self._prefill(out.prefills[i:i + per_call])
        if not out.is_empty:
            self._count_step(out, t0)
        elif len(self.stats.step_times) < 100_000:  # it only landed the step in flight: its time still counts
            self.stats.step_times.append(time.perf_counter() - t0)
        flight = self._flight
        if flight is not None and not any(rid in self._seqs for rid in self._flight_ids(flight.task)):
            self._settle()  # every row's request ended while it ran: no graph call outlives the engine's requests
        self._note_lora_adapters()
        return True

    @staticmethod
    def _flight_ids(task: StepTask) -> list[str]:
        return [d.request_id for d in task.decodes] + [p.request_id for g in task.prefill_groups for p in g]

    def _decode_rows(self, decodes: Sequence[DecodeWork]) -> list[DecodeRow]:
        return [DecodeRow(d.blocks, d.token, d.position, d.lora_slot, d.window_blocks, self._rope_delta(d.request_id))
                for d in decodes]

    def _take(self, flight: _Flight) -> dict[str, RowOutcome]:
        """Wait for the step in flight; its sampled tokens replace their placeholders in the scheduler."""
        t0 = time.perf_counter()
        res = flight.future.result()
        st = self.stats
        st.wait_s += time.perf_counter() - t0
        st.graph_s, st.sample_s = st.graph_s + res.graph_s, st.sample_s + res.sample_s
        st.prefill_graph_tokens += res.prefill_graph_tokens
        for rid, o in res.rows.items():
            if o.result is not None:
                self.scheduler.resolve(rid, o.result.token)
        return res.rows

    def _patch(self, out: SchedulerOutput, done: dict[str, RowOutcome],
               built: Any) -> tuple[SchedulerOutput, Any]:
        """The scheduled step with the taken tokens in place of their placeholders, less the rows of requests that
        are gone (aborted, finished) or that those tokens end by a rule needing no text (EOS, stop ids,
        max_tokens, a grammar's end, a failed call: they land as finished). `built`: the decode inputs made
        before, tokens written in, or None when rows were dropped (built again at launch)."""
        ended = {rid for rid, o in done.items() if rid in self._seqs and (
            o.result is None or self.outputs.ends_on(rid, o.result.token, o.grammar_done))}
        tokens = {rid: o.result.token for rid, o in done.items() if o.result is not None}

        def live(rid: str) -> bool:
            return rid in self._seqs and rid not in ended

        decodes = tuple(replace(d, token=tokens[d.request_id]) if d.token == PLACEHOLDER else d
                        for d in out.decodes if live(d.request_id))
        prefills = tuple(replace(p, token_ids=tuple(tokens[p.request_id] if t == PLACEHOLDER else t
                                                    for t in p.token_ids)) if PLACEHOLDER in p.token_ids else p
                         for p in out.prefills if live(p.request_id))
        if built is not None:
            if len(decodes) == len(out.decodes):
                ids = built[1].input_ids
                for i, d in enumerate(decodes):
                    ids[i, 0] = d.token
            else:
                built = None
        return SchedulerOutput(decodes, prefills, out.preempted), built

    def _launch(self, out: SchedulerOutput, built: Any, unlanded: set[str]) -> _Flight:
        """Hand the step to the graph thread, record its rows' tokens as placeholders, and fill their grammar masks
        while its graph calls run. `unlanded`: requests whose last token has not landed yet (one more token than
        their output stream holds counts towards min_tokens)."""
        sampled = [d.request_id for d in out.decodes] + [p.request_id for p in out.prefills if p.last]
        states = {rid: self._seqs[rid].state for rid in sampled}
        banned = {rid: self.outputs.banned(rid, int(rid in unlanded)) for rid in sampled}

        def candidates(ids: Sequence[str]) -> int | None:  # `_candidates`, with the banned ids of this step
            if not ids:
                return 1  # a call that samples nothing (prefill chunks that do not end their prompt)
            ks = [candidates_needed(states[rid].params, len(banned[rid])) for rid in ids]
            return None if None in ks else max(k for k in ks if k is not None)

        if out.decodes and built is None:
            built = self.runner.decode_inputs(self._decode_rows(out.decodes))
        per_call = self.runner.buckets.prefill_batch
        groups = tuple(out.prefills[i:i + per_call] for i in range(0, len(out.prefills), per_call))
        task = StepTask(out.decodes, built, groups, states, banned,
                        candidates([d.request_id for d in out.decodes]),
                        tuple(candidates([p.request_id for p in g if p.last]) for g in groups),
                        torch.get_num_threads())
        for p in out.prefills:
            if not p.last:
                self.scheduler.update_prefill(p.request_id, len(p.token_ids))
        self.stats.prefill_tokens += sum(len(p.token_ids) for p in out.prefills)
        for rid in sampled:
            self.scheduler.update(rid, PLACEHOLDER)
        future = self.runner.graph_thread().submit(run_task, self.runner, task)
        try:
            for st in states.values():
                if st.grammar is not None:
                    st.grammar.prepare(self.runner.vocab_size)
        finally:
            task.masks_ready.set()
        return _Flight(task, future)

    def _land(self, done: dict[str, RowOutcome]) -> None:
        """Output processing of a taken step: each row's token delivered, or its call's error; rows of requests that
        finished or were aborted meanwhile are dropped (a token after a stop never reaches a client)."""
        t0 = time.perf_counter()
        for rid, o in done.items():
            if rid not in self._seqs:
                continue
            if o.result is None:
                log.error("%s failed: %r", o.what, o.error)
                self._fail(rid, f"{o.what} failed: {o.error}", o.error)
                continue
            self._deliver(rid, [o.result], o.grammar_done, record=False)
        self.stats.output_s += time.perf_counter() - t0

    def _settle(self) -> None:
        """Wait for the step in flight, if any, and drop its outputs (the engine is stopping)."""
        flight, self._flight = self._flight, None
        if flight is not None:
            try:
                flight.future.result()
            except Exception:
                log.warning("the step in flight failed while the engine stopped:\n%s", traceback.format_exc())

    def _note_lora_adapters(self) -> None:
        if self.loras is None:
            return

        def count(requests: Any) -> dict[str, int]:
            out: dict[str, int] = {}
            for r in requests:
                if r.lora_name is not None:
                    out[r.lora_name] = out.get(r.lora_name, 0) + 1
            return out

        self.lora_adapters = (count(self.scheduler.running.values()), count(self.scheduler.waiting))

    def _prefill(self, group: tuple[PrefillWork, ...]) -> None:
        """Prefill chunks in one graph call; the chunks that end a request's tokens sample its next token."""
        if self.embeds:
            self._embed(group)
            return
        sampled = [p.request_id for p in group if p.last]
        scoring = [i for i, p in enumerate(group) if self._seqs[p.request_id].request.scores_prompt]
        t0 = time.perf_counter()
        try:
            rows = [PrefillRow(p.blocks, p.token_ids, p.start, p.lora_slot, p.window_blocks, self._chunk_embeds(p),
                               self._chunk_rope(p), self._chunk_last_keys(p)) for p in group]
            if scoring:  # every position's logits: the scoring rows' prompt logprobs, everyone's last row
                every = self.runner.prefill_rows(rows, all_positions=True)  # [len(group), S, V]
                self._score_prompts(group, scoring, every)
                logits = every[torch.arange(len(group)), torch.tensor([len(p.token_ids) - 1 for p in group])]
            elif sampled and (sampling := self._device_sampling([p.request_id if p.last else None
                                                                 for p in group])) is not None:
                logits = self.runner.prefill_sampled(rows, sampling)  # the tokens, sampled in the graph
            else:
                logits = self.runner.prefill_rows(rows, candidates=self._candidates(sampled) if sampled else 1)
        except Exception as e:  # each chunk alone rewrites only its own K/V
            self._isolate_failure("prefill", group, e, lambda p: self._prefill((p,)))
            return
        st = self.stats
        st.graph_s += time.perf_counter() - t0
        if self.speculation is not None and self.speculation.wants_hidden:
            aux = self.runner.aux_hidden
            for i, p in enumerate(group):
                self.speculation.observe_hidden(p.request_id, p.start, aux[i, :len(p.token_ids)])
        st.prefill_tokens += sum(len(p.token_ids) for p in group)
        if self.runner.last_bucket is not None:
            st.prefill_graph_tokens += self.runner.last_bucket.num_tokens
        for p in group:
            if not p.last:
                self.scheduler.update_prefill(p.request_id, len(p.token_ids))
        if sampled:
            last = [i for i, p in enumerate(group) if p.last]
            self._update(sampled, logits[last] if isinstance(logits, torch.Tensor) else [t[last] for t in logits])

    def _chunk_embeds(self, p: PrefillWork) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image embeddings of a prefill chunk's placeholder positions (the encoder cache encodes each image
        once per request, when a chunk first holds its tokens); None for a chunk without any."""
        images = self._seqs[p.request_id].images
        if not images or self.encoder_cache is None:
            return None
        return self.encoder_cache.chunk_embeds(p.request_id, images, p.start, len(p.token_ids))

    @property
    def _bidirectional_images(self) -> bool:
        return bool(getattr(self.runner.vision, "bidirectional", False))

    def _check_image_blocks(self, images: tuple[ImageItem, ...]) -> None:
        """ConfigError for a bidirectional image block longer than the largest prefill chunk (each runs in one)."""
        if not self._bidirectional_images:
            return
        longest = max(b - a for a, b in image_blocks(images))
        if longest > self.scheduler.kv.max_prefill_len:
            raise ConfigError(f"messages: an image of {longest} tokens attends to itself bidirectionally, so it is "
                              f"prefilled in one chunk, but the largest prefill chunk is "
                              f"{self.scheduler.kv.max_prefill_len} tokens", param="messages")

    def _chunk_last_keys(self, p: PrefillWork) -> torch.Tensor | None:
        """The last key each token of a prefill chunk sees [n] (multimodal.inputs.last_keys), for a request with
        bidirectional image blocks in the chunk; None otherwise (causal)."""
        spans = self._seqs[p.request_id].request.atomic_spans
        n = len(p.token_ids)
        if not any(a < p.start + n and b > p.start for a, b in spans):
            return None
        return last_keys(spans, p.start, n)

    def _chunk_rope(self, p: PrefillWork) -> torch.Tensor | None:
        """An M-RoPE request's [3, n] rotary positions of a prefill chunk: the prompt's table, then (generated tokens
        prefilled again after a preemption) position + delta; None for a request without a table."""
        rope = self._seqs[p.request_id].rope
        if rope is None:
            return None
        table, delta = rope
        pos = torch.arange(p.start, p.start + len(p.token_ids))
        out = (pos + delta).expand(3, -1).clone()
        inside = pos < table.shape[1]
        out[:, inside] = table[:, pos[inside]]
        return out

    def _rope_delta(self, request_id: str) -> int:
        rope = self._seqs[request_id].rope
        return 0 if rope is None else rope[1]

    def _score_prompts(self, group: tuple[PrefillWork, ...], scoring: list[int], every: torch.Tensor) -> None:
        """Prompt logprobs from a prefill's logits at every position [len(group), S, V]: position j's logits score
        prompt token j + 1 (the chunk's last position scores the next chunk's first token)."""
        for i in scoring:
            p = group[i]
            seq = self._seqs[p.request_id]
            prompt, params = seq.request.prompt_token_ids, seq.state.params
            done = self._prompt_lps.setdefault(p.request_id, [])
            first = max(p.start, len(done))  # the positions whose token after them is not scored yet
            last = min(p.start + len(p.token_ids), len(prompt) - 1)
            if first < last:
                done += token_logprobs(every[i, first - p.start:last - p.start], prompt[first + 1:last + 1],
                                       params.prompt_logprobs or 0)

    def _embed(self, group: tuple[PrefillWork, ...]) -> None:
        """Embedding requests' inputs in one graph call (each whole: an embedding model has no chunked prefill or
        prefix cache); each request finishes with its pooled vector."""
        try:
            vectors = self.runner.embed_rows([PrefillRow(p.blocks, p.token_ids, p.start) for p in group])
        except Exception as e:
            log.error("embedding failed:\n%s", traceback.format_exc())
            for p in group:
                self._fail(p.request_id, f"embedding failed: {e}", e)
            return
        for i, p in enumerate(group):
            n = self._seqs[p.request_id].request.num_prompt_tokens
            out = RequestOutput(p.request_id, (), "", n, 0, True, "stop", time=time.monotonic(), embedding=vectors[i])
            self._release(p.request_id)
            self.outputs.send_output(out)

    def _decode_or_verify(self, decodes: tuple[DecodeWork, ...]) -> None:
        """One graph call for every running sequence: a plain decode, or, when speculating and the policy says it
        pays, a verify of each row's proposals (rows without one ride along with their single token)."""
        spec = self.speculation
        step: SpecStep | None = None
        t0 = time.perf_counter()
        if spec is not None:
            seqs = [self._seqs[d.request_id] for d in decodes]
            try:
                step = spec.plan(decodes, [s.request for s in seqs], [s.state.grammar for s in seqs])
            except Exception as e:  # each row planned alone
                self._isolate_failure("speculative proposal", decodes, e, lambda d: self._decode_or_verify((d,)))
                return
        self._run_decodes(decodes, step, t0)

    def _run_decodes(self, decodes: tuple[DecodeWork, ...], step: SpecStep | None, t0: float) -> None:
        """The graph call of a planned decode step (`step`: None when not speculating) and its rows' tokens. A call
        of several rows that fails is run again one row per call, with the same plan (a row rewrites only its own
        positions' K/V, from the same tokens), so only the request whose row fails fails; the others go on."""
        ids = [d.request_id for d in decodes]
        verify = step is not None and step.verify
        logits: Any  # [B, (q,) V] logits, or what a graph that samples returns (runner.decode_sampled, verify_sampled)
        try:
            if verify:
                assert step is not None
                rows = [VerifyRow(d.blocks, (d.token, *step.proposals[d.request_id]), d.position, d.lora_slot,
                                  d.window_blocks, self._rope_delta(d.request_id)) for d in decodes]
                vsampling = self._verify_sampling(ids, step)
                logits = (self.runner.verify_sampled(rows, vsampling) if vsampling is not None  # accepted in the graph
                          else self.runner.verify(rows, candidates=self._candidates(ids)))
            else:
                drows = [DecodeRow(d.blocks, d.token, d.position, d.lora_slot, d.window_blocks,
                                   self._rope_delta(d.request_id)) for d in decodes]
                sampling = self._device_sampling(ids)
                logits = (self.runner.decode_sampled(drows, sampling) if sampling is not None
                          else self.runner.decode(drows, candidates=self._candidates(ids)))
            self.stats.graph_s += time.perf_counter() - t0
        except Exception as e:
            def alone(d: DecodeWork) -> None:  # the same plan, at batch 1
                one = step and replace(step, batch=pick_decode(1, d.position, self.runner.buckets).batch)
                self._run_decodes((d,), one, time.perf_counter())

            self._isolate_failure("verify" if verify else "decode", decodes, e, alone)
            return
        spec = self.speculation
        if spec is None or step is None:
            self._update(ids, logits)
            return
        spec.observe_step(step, time.perf_counter() - t0)
        aux = self.runner.aux_hidden if spec.wants_hidden else None
        if step.verify:
            for i, d in enumerate(decodes):
                row = {k: t[i] for k, t in logits.items()} if isinstance(logits, dict) else logits[i]
                self._update_verified(spec, d, row, step.proposals.get(d.request_id, []),
                                      None if aux is None else aux[i])
            return
        if aux is not None:
            for i, d in enumerate(decodes):
                spec.observe_hidden(d.request_id, d.position, aux[i, :1])
        for rid, token in zip(ids, self._update(ids, logits), strict=True):
            if rid in self._seqs:  # the sampled token against the first proposal: acceptance, measured for free
                spec.observe_decoded(rid, step.proposals.get(rid, []), token)

    def _update_verified(self, spec: SpeculativeDecoding, d: DecodeWork, logits: torch.Tensor | dict[str, torch.Tensor],
                         draft: list[int], aux: torch.Tensor | None) -> None:
        """Accept a prefix of `draft` from its verify logits [q, V] (or the graph's acceptance of it:
        `runner.verify_sampled`'s outputs of the row) and deliver the tokens (up to a stop). `aux`:
        the row's auxiliary hidden states [q, A] for a proposer that reads them (those of the scored tokens that
        were accepted are handed over)."""
        request_id = d.request_id
        seq = self._seqs[request_id]
        banned_for = [self.outputs.banned(request_id, j) for j in range(len(draft) + 1)]
        results = spec.accept(request_id, logits, draft, seq.state, banned_for)
        if aux is not None:  # the last accepted token and the accepted proposals; the one after them is not run
            spec.observe_hidden(request_id, d.position, aux[:len(results)])
        self._deliver(request_id, results, seq.state.grammar_done)

    def _isolate_failure(self, what: str, rows: Sequence[PrefillWork] | Sequence[DecodeWork], error: Exception,
                         alone: Callable[[Any], None]) -> None:
        """A runner call over `rows` raised `error` (called in its `except`): with several rows, each runs again in
        a call of its own (`alone(row)`), so only the request whose row fails fails; one row: its request fails,
        with `what` and the error in its message."""
        if len(rows) > 1:
            log.warning("%s of %d rows failed (%r); running them one at a time", what, len(rows), error)
            for row in rows:
                alone(row)
            return
        log.error("%s failed:\n%s", what, traceback.format_exc())
        self._fail(rows[0].request_id, f"{what} failed: {error}", error)

    def _candidates(self, request_ids: list[str]) -> int | None:
        """Top logits per rank the batch's sampling needs (vocab-parallel TP); None when any row needs them all."""
        ks = []
        for rid in request_ids:
            k = candidates_needed(self._seqs[rid].state.params, len(self.outputs.banned(rid)))
            if k is None:
                return None
            ks.append(k)
        return max(ks)

    def _device_sampling(self, request_ids: Sequence[str | None]) -> SamplingInputs | None:
        """The step's sampling inputs for a graph that samples its rows' tokens (a None row samples nothing); None
        when the executor's graphs return logits, or some row needs the host sampler this step (counted in the
        runner's `host_fallback`)."""
        if not self.runner.samples_on_device:
            return None
        states = [None if rid is None else self._seqs[rid].state for rid in request_ids]
        k = self.runner.sample_candidates
        if any(host_sampling_reason(st, k) is not None for st in states):
            self.runner.stats.host_fallback += sum(st is not None for st in states)
            return None
        banned = [() if rid is None else self.outputs.banned(rid) for rid in request_ids]
        return device_inputs(states, banned, self.runner.vocab_size)

    def _verify_sampling(self, request_ids: list[str], step: SpecStep) -> SamplingInputs | None:
        """A verify step's sampling inputs for a graph that accepts the proposals itself (one row per scored
        position: runtime.sampling.verify_inputs); None when the executor's graphs return logits, or some row needs
        the host verifier this step (counted in the runner's `host_fallback`)."""
        if not self.runner.samples_on_device:
            return None
        states = [self._seqs[rid].state for rid in request_ids]
        drafts = [step.proposals.get(rid, []) for rid in request_ids]
        k = self.runner.sample_candidates
        if any(verify_host_reason(st, d, k) is not None for st, d in zip(states, drafts, strict=True)):
            self.runner.stats.host_fallback += len(request_ids)
            return None
        banned_for = [[self.outputs.banned(rid, j) for j in range(len(d) + 1)]
                      for rid, d in zip(request_ids, drafts, strict=True)]
        return verify_inputs(states, drafts, banned_for, self.runner.verify_len, self.runner.vocab_size)

    def _update(self, request_ids: list[str], logits: torch.Tensor | list[torch.Tensor]) -> list[int]:
        """Sample each request's next token from its row of `logits` [len(request_ids), V] in one batch and
        deliver it; or, from a graph that sampled them (a list: `runner.decode_sampled`), deliver its tokens.
        Returns the tokens."""
        t0 = time.perf_counter()
        seqs = [self._seqs[rid] for rid in request_ids]
        if isinstance(logits, torch.Tensor):
            banned = [self.outputs.banned(rid) for rid in request_ids]
            results = sample_batch(logits, [seq.state for seq in seqs], banned)
        else:
            results = device_results(logits[0].tolist(), tuple(logits[1:]) or None, [seq.state for seq in seqs])
        t1 = time.perf_counter()
        for rid, seq, res in zip(request_ids, seqs, results, strict=True):
            seq.state.observe(res.token)
            self._deliver(rid, [res], seq.state.grammar_done)
        self.stats.sample_s += t1 - t0
        self.stats.output_s += time.perf_counter() - t1
        return [res.token for res in results]

    def _deliver(self, request_id: str, results: Sequence[SampleResult], grammar_done: bool,
                 record: bool = True) -> None:
        """The request's new tokens through output processing (up to the first that finishes it), recorded in the
        scheduler (`record`; async scheduling recorded them when it launched their step), then sent; a finished
        request is released first."""
        out, taken = self.outputs.process(request_id, results, grammar_done)
        if record:
            for res in results[:taken]:
                self.scheduler.update(request_id, res.token)
        if request_id in self._prompt_lps:  # the first output carries the prompt's logprobs
            out = replace(out, prompt_logprobs=(None, *self._prompt_lps.pop(request_id)))
        if out.finished:
            req = self._seqs[request_id].request
            out = replace(out, scheduled_time=req.scheduled_time, num_cached_tokens=req.num_cached_tokens)
            self._release(request_id)
        self.outputs.send_output(out)

    def _release(self, request_id: str) -> None:
        """Forget a finished request: its blocks, its speculative state, its place among those in flight."""
        seq = self._seqs.pop(request_id)
        self._prompt_lps.pop(request_id, None)
        self.scheduler.finish(request_id)
        if self.encoder_cache is not None:
            self.encoder_cache.release(request_id, seq.images)
        if seq.request.lora_name is not None and self.loras is not None:
            self.loras.end_request(seq.request.lora_name)
        if self.speculation is not None:
            self.speculation.forget(request_id)
        with self._lock:
            self._pending -= 1

    def _end(self, request_id: str, reason: str, error: str | None = None,
             exception: BaseException | None = None) -> None:
        """Finish a request without a token of its own ("abort" or "error")."""
        out = self.outputs.finish(request_id, reason, error, exception)
        self._release(request_id)
        self.outputs.send_output(out)

    def _fail(self, request_id: str, message: str, exception: BaseException | None = None) -> None:
        if request_id in self._seqs:
            self._end(request_id, "error", message, exception)
