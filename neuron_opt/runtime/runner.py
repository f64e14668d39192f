"""Model runner: picks the bucket, pads inputs to its shape, runs the graph, returns logits.

Prefill vs decode is decided here, once, by the bucket choice. A prefill runs at the compiled prefill length that
fits, or, on executors that say they run any prefill length (`prefill_granularity` g > 0: the cpu backend), at
its length rounded up to a multiple of g. A sequence's KV lives in the blocks it is given
(its block table, from the scheduler's block manager); callers without a block manager name a slot number
instead, which stands for a fixed range of blocks (`slot_blocks`: the contiguous layout of the default pool).
Padding rules:
- tokens beyond a row's own write the null block (slot mapping 0); their positions continue the row's (capped
  at max_model_len - 1) and their outputs are dropped. Block tables are padded with the null block, whose
  logical positions lie beyond the row's tokens (masked for every real query).
- missing batch rows: one token at position 0 over the null block.
Window-sized KV (CacheConfig.sliding_window): the sliding layers' pool has tables of its own. A row from the
scheduler carries them (`window_blocks`: the null block for logical blocks out of the window); a slot number
stands there for a ring of `window_blocks_per_sequence` blocks (logical block i in ring block i mod n), exact
because a step's queries see at most that many consecutive blocks and the mask hides every older position.
Each row may name a LoRA adapter slot (`lora_slot`, neuron_opt.lora; 0: the base model), which becomes the step's
`lora_slots` for executors of a model with a LoRA capacity; padding rows take slot 0.
On an executor that samples on the device (`samples_on_device`: the neuron backend), `decode_sampled` and
`prefill_sampled` hand the step's sampling inputs (neuron_opt.sample_ops.SamplingInputs) to the graph and return the
rows' token ids, not their logits; `verify_sampled` returns each scored position's acceptance and token.
`stats` counts the time in graph calls and the bytes they moved device -> host.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from neuron_opt.backends.base import Executor, StepInputs
from neuron_opt.buckets import VERIFY, Bucket, BucketConfig, pick_decode, pick_prefill, pick_verify
from neuron_opt.config import CacheConfig
from neuron_opt.errors import BucketOverflowError, ConfigError, ContextLengthError
from neuron_opt.runtime.sampling import warm_inputs
from neuron_opt.sample_ops import SamplingInputs, verify_outputs

Blocks = int | Sequence[int]  # a sequence's block table, or a slot number (slot_blocks)


@dataclass(frozen=True)
class DecodeRow:
    blocks: Blocks
    token: int
    position: int
    lora_slot: int = 0
    window_blocks: Sequence[int] = ()  # the window layers' table (window-sized KV with a block table)
    rope_delta: int = 0  # M-RoPE: the token rotates at position + rope_delta on every axis (ModelConfig.mrope_section)


@dataclass(frozen=True)
class PrefillRow:
    """Prompt tokens (a whole prompt, or a chunk of one) at positions start, start + 1, ...; the blocks must
    cover them, and positions before `start` must already hold their K/V (a cached prefix, earlier chunks)."""

    blocks: Blocks
    tokens: tuple[int, ...]
    start: int = 0
    lora_slot: int = 0
    window_blocks: Sequence[int] = ()  # the window layers' table (window-sized KV with a block table)
    # image embeddings at some of the tokens: (indices into `tokens` [k], rows [k, H]) that replace those tokens'
    # embeddings (neuron_opt.multimodal.encoder_cache.EncoderCache.chunk_embeds); None: tokens only
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # M-RoPE (ModelConfig.mrope_section): the tokens' [3, len(tokens)] rotary positions; None: their positions
    rope_positions: torch.Tensor | None = None
    # the last key position each token attends to [len(tokens)] (a bidirectional image block's tokens see the
    # whole block: neuron_opt.multimodal.inputs.last_keys); None: its own position (causal)
    last_keys: torch.Tensor | None = None


@dataclass(frozen=True)
class VerifyRow:
    """A verify row: `tokens` (the last accepted token, then the proposed ones) at positions `position`,
    `position + 1`, ...; fewer than the bucket's q_len are padded (their K/V go to the null block)."""

    blocks: Blocks
    tokens: tuple[int, ...]
    position: int
    lora_slot: int = 0
    window_blocks: Sequence[int] = ()  # the window layers' table (window-sized KV with a block table)
    rope_delta: int = 0  # M-RoPE: as DecodeRow's


@dataclass
class RunnerStats:
    """Counters of the runner's graph calls. `graph_s`: wall time inside the executor's `run` (inputs to the device,
    the graph, its outputs back: the time the device is busy with a step, as the host sees it); `d2h_bytes`: bytes
    the calls moved device -> host, on executors that report them (`d2h_bytes`: the neuron backend; the cpu and
    eager backends' outputs are already host tensors); `device_sampled` / `host_sampled`: rows whose token was
    sampled in the graph / on the host from logits on an executor that samples on the device (`host_fallback`:
    those of the latter that asked for what the graph cannot sample exactly: runtime.sampling.host_sampling_reason)."""

    graph_calls: int = 0
    graph_s: float = 0.0
    d2h_bytes: int = 0
    last_d2h_bytes: int = 0
    device_sampled: int = 0
    host_fallback: int = 0


class ModelRunner:
    """`model_config`: the model's ModelConfig where the caller has it (LoRA adapters are checked against it; an
    embedding model's `matryoshka_dims`, the sizes its vectors may be truncated to, come from it). `vision`: a
    vision-language model's image side (neuron_opt.multimodal.vision.VisionModel: processor and encoder), None
    for a text model."""

    def __init__(self, executor: Executor, buckets: BucketConfig, cache: CacheConfig, vocab_size: int,
                 model_config: Any = None, vision: Any = None) -> None:
        self.executor, self.buckets, self.cache, self.vocab_size = executor, buckets, cache, vocab_size
        self.model_config = model_config
        self.vision = vision
        self.matryoshka_dims = tuple(getattr(model_config, "matryoshka_dims", ()))
        self.last_bucket: Bucket | None = None
        self._graph_thread: concurrent.futures.ThreadPoolExecutor | None = None
        # tokens a prefill is padded to a multiple of, on executors that run any prefill length (0: the compiled
        # prefill lengths only; buckets.pick_prefill)
        self.prefill_granularity = int(getattr(executor, "prefill_granularity", 0))
        # torch threads of each graph call, set on the calling thread (`serve`'s engine thread: runtime/threads.py);
        # None: left as they are
        self.num_threads: int | None = None
        self.stats = RunnerStats()

    @property
    def samples_on_device(self) -> bool:
        """The executor's graphs take sampling inputs and return token ids (`decode_sampled`, `prefill_sampled`)."""
        return bool(getattr(self.executor, "samples_on_device", False))

    def warm_sampling(self) -> None:
        """On an executor that samples on the device, compile (on a NeuronCore: load) the sampling graphs the first
        requests take, for every bucket, so none compiles under a request: each bucket run once on its null-block
        inputs (`Executor.warm`) with all-greedy and all-sampled rows (`runtime.sampling.warm_inputs`: temperature
        only, or at tp > 1 a top_k within the candidates, as the vocab-parallel path samples). Other shapes (a mask,
        logprobs, other filters) compile on first use. Nothing for other executors."""
        if not self.samples_on_device:
            return
        for bucket in sorted(self.buckets.buckets(), key=lambda b: b.key):
            q = bucket.tokens if bucket.phase == VERIFY else 0
            for sampling in warm_inputs(bucket.batch * max(q, 1), self.vocab_size, self.sample_candidates or 0, q):
                self.executor.warm(bucket, sampling)  # type: ignore[attr-defined]

    @property
    def sample_candidates(self) -> int | None:
        """Top logits per rank the executor's vocab-parallel sampling sees (None: the whole row)."""
        return getattr(self.executor, "sample_candidates", None)

    @property
    def embeds(self) -> bool:
        """An embedding model's runner: its graphs return pooled vectors (`embed_rows`), not logits."""
        return self.buckets.prefill_only

    @property
    def max_prompt_len(self) -> int:
        return self.buckets.prefill_lens[-1]

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + generated) one sequence can hold: the KV cache length, which is also the largest
        decode bucket (BucketConfig.build keeps them one number)."""
        return self.cache.max_model_len

    def check_fits(self, prompt_len: int, max_tokens: int, chunked: bool = False) -> None:
        """Raise ContextLengthError for a request that can never run. `chunked`: a prompt may be prefilled in
        several chunks (the artifact has offset prefill buckets: the scheduler splits a longer prompt, with or
        without chunked prefill), so only max_model_len limits it, not the largest prefill bucket."""
        limit = self.max_model_len if chunked else self.max_prompt_len
        if prompt_len > limit:
            which = ("max_model_len" if chunked else
                     f"the largest prefill bucket; this artifact has no offset prefill buckets to split a prompt, "
                     f"max_model_len is {self.max_model_len}")
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens ({which}). However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input.", param="input"
                if self.embeds else None)
        if self.embeds:  # an embedding request generates nothing: its input is all it holds
            return
        if prompt_len + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens (max_model_len) and your request has {prompt_len} input tokens "
                f"({max_tokens} > {self.max_model_len} - {prompt_len}).", param="max_tokens")

    def slot_blocks(self, slot: int) -> tuple[int, ...]:
        """The blocks that slot number `slot` stands for: blocks 1 + slot * n .. (n per max_model_len sequence), the
        contiguous layout of the default pool (block 0 is the null block)."""
        n = self.cache.blocks_per_sequence
        if not 0 <= slot or 1 + (slot + 1) * n > self.cache.num_blocks:
            raise ValueError(f"slot {slot}: the pool of {self.cache.num_blocks} blocks holds "
                             f"{(self.cache.num_blocks - 1) // n} slots of {n} blocks")
        return tuple(range(1 + slot * n, 1 + (slot + 1) * n))

    @property
    def num_slots(self) -> int:
        """Sequences the pools hold in the slot layout (`slot_blocks`, and the window pool's rings)."""
        n = (self.cache.num_blocks - 1) // self.cache.blocks_per_sequence
        if self.cache.sliding_window:
            n = min(n, (self.cache.window_num_blocks - 1) // self.cache.window_blocks_per_sequence)
        return n

    def _blocks(self, b: Blocks) -> Sequence[int]:
        return self.slot_blocks(b) if isinstance(b, int) else b

    def _window_blocks(self, row: DecodeRow | PrefillRow | VerifyRow) -> Sequence[int]:
        """A row's window-layer table: its own, or a slot number's ring (module docstring)."""
        if not isinstance(row.blocks, int):
            if not row.window_blocks:
                raise ValueError("this model holds window-sized KV: a row with a block table needs window_blocks")
            return row.window_blocks
        n, slot = self.cache.window_blocks_per_sequence, row.blocks
        if not 0 <= slot or 1 + (slot + 1) * n > self.cache.window_num_blocks:
            raise ValueError(f"slot {slot}: the window pool of {self.cache.window_num_blocks} blocks holds "
                             f"{(self.cache.window_num_blocks - 1) // n} slots of {n} blocks")
        return [1 + slot * n + i % n for i in range(self.cache.blocks_per_sequence)]

    def _window_inputs(self, rows: Sequence[DecodeRow | PrefillRow | VerifyRow], starts: Sequence[int],
                       counts: Sequence[int], shape: tuple[int, int], kv_len: int) -> tuple[torch.Tensor, ...]:
        """The window layers' slot mapping [B, S] (row i's `counts[i]` tokens from `starts[i]`) and tables, or ()
        for a model without window-sized KV."""
        if not self.cache.sliding_window:
            return ()
        slots = torch.zeros(shape, dtype=torch.long)
        tables = []
        for i, (r, start, n) in enumerate(zip(rows, starts, counts, strict=True)):
            blocks = self._window_blocks(r)
            slots[i, :n] = torch.tensor([self._slot(blocks, p) for p in range(start, start + n)])
            if not bool(slots[i, :n].ge(self.cache.block_size).all()):
                raise ValueError(f"a row writes positions {start}..{start + n - 1} into a released window block")
            tables.append(blocks)
        return slots, self._tables(tables, shape[0], kv_len)

    def _slot(self, blocks: Sequence[int], position: int) -> int:
        bs = self.cache.block_size
        if position // bs >= len(blocks):
            raise ValueError(f"position {position} lies beyond the {len(blocks)} block(s) given ({bs} positions each)")
        return blocks[position // bs] * bs + position % bs

    def _tables(self, rows: Sequence[Sequence[int]], batch: int, kv_len: int) -> torch.Tensor:
        nb = -(-kv_len // self.cache.block_size)
        tables = torch.zeros(batch, nb, dtype=torch.long)
        for i, blocks in enumerate(rows):
            use = list(blocks[:nb])
            tables[i, : len(use)] = torch.tensor(use, dtype=torch.long)
        return tables

    def graph_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one thread that runs this runner's graph calls under async scheduling (runtime/pipeline.py), made on
        first use and kept for every engine over the runner, so one OpenMP team serves them all."""
        if self._graph_thread is None:
            self._graph_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="neuron-opt-graph")
        return self._graph_thread

    def capture_aux_hidden(self, layer_ids: tuple[int, ...]) -> None:
        """From now on every graph call also returns the residual stream entering these target layers at every
        position (`aux_hidden`), for an EAGLE-3 head; ConfigError on an executor whose graphs do not."""
        capture = getattr(self.executor, "capture_aux_hidden", None)
        if capture is None:
            raise ConfigError("speculative_method: eagle3 reads the model's hidden states, which this executor's "
                              "graphs do not return (the eager, cpu and neuron backends' do)",
                              param="speculative_method")
        capture(tuple(layer_ids))
        self.warm_sampling()  # traced graphs (tp > 1) record their sampling: the new graphs' too

    @property
    def aux_hidden(self) -> torch.Tensor:
        """The last graph call's auxiliary hidden states [B, S, n_aux * H] over its bucket's rows and positions
        (`capture_aux_hidden`)."""
        aux = getattr(self.executor, "aux_hidden", None)
        if aux is None:
            raise ValueError("no auxiliary hidden states: capture_aux_hidden first")
        return aux

    def eagle3_chain(self, head: Any) -> Any:
        """The executor's own way of running an EAGLE-3 head's draft chain, its K/V in pools of this cache's block
        layout (the cpu backend's compiled graphs, the neuron backend's device graphs: runtime/eagle3.HeadChain),
        or None where the head runs in torch on the host."""
        make = getattr(self.executor, "eagle3_chain", None)
        return None if make is None else make(head, self.cache, self.buckets)

    def embedding_fn(self) -> Any:
        """The model's token embeddings as a function of token ids (unscaled rows [..., H]), which an EAGLE-3 head
        saved without its own shares; ConfigError on an executor that does not hold the table."""
        embed = getattr(self.executor, "embed", None)
        if embed is None:
            raise ConfigError("speculative_model: the eagle3 head has no embed_tokens of its own and this executor "
                              "does not share the model's (the eager, cpu and neuron backends do)",
                              param="speculative_model")
        return embed

    @property
    def lora_config(self) -> Any:
        """The model's LoRA capacity (neuron_opt.lora.LoraConfig), None when it takes no adapters."""
        return getattr(self.executor, "lora_config", None)

    def _lora_slots(self, rows: Sequence[Any], batch: int) -> torch.Tensor | None:
        """The step's per-row adapter slots [batch] (padding rows 0), None for a model without LoRA."""
        if self.lora_config is None:
            if any(r.lora_slot for r in rows):
                raise ValueError("a row names a LoRA slot, but this model was compiled without --enable-lora")
            return None
        slots = torch.zeros(batch, dtype=torch.long)
        slots[: len(rows)] = torch.tensor([r.lora_slot for r in rows], dtype=torch.long)
        return slots

    def encode_image(self, item: Any) -> torch.Tensor:
        """One image's embeddings [placeholder tokens, H] (neuron_opt.multimodal.inputs.ImageItem) by the model's
        vision encoder; ConfigError for a text model."""
        if self.vision is None:
            raise ConfigError("messages: this model takes text only, not images", param="messages")
        return self.vision.encode(item)

    def _run(self, bucket: Bucket, inputs: StepInputs, candidates: int | None,
             sampling: SamplingInputs | None = None) -> Any:
        self.last_bucket = bucket
        if self.num_threads is not None and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        t0 = time.perf_counter()
        if sampling is not None:
            if not self.samples_on_device:
                raise ConfigError("this executor's graphs return logits; sample on the host")
            out = self.executor.run(bucket, inputs, sampling=sampling)
        elif candidates is not None and getattr(self.executor, "gathers_candidates", False):
            # vocab-parallel TP: ranks send only their top-`candidates` logits (see neuron_opt.parallel.vocab)
            out = self.executor.run(bucket, inputs, candidates=candidates)
        else:
            out = self.executor.run(bucket, inputs)
        st = self.stats
        st.graph_calls, st.graph_s = st.graph_calls + 1, st.graph_s + time.perf_counter() - t0
        st.last_d2h_bytes = int(getattr(self.executor, "d2h_bytes", 0))
        st.d2h_bytes += st.last_d2h_bytes
        return out

    def prefill(self, blocks: Blocks, token_ids: Sequence[int], candidates: int | None = None,
                start: int = 0) -> torch.Tensor:
        """Run prompt tokens (from position `start`) into `blocks`; returns fp32 logits [V] of the last one.

        `candidates`: how many top logits per rank the sampler needs (None = the full distribution); executors
        that gather candidates return -inf for the rest, which is exact for greedy and top-k sampling."""
        return self.prefill_rows([PrefillRow(blocks, tuple(token_ids), start)], candidates)[0]

    def prefill_rows(self, rows: Sequence[PrefillRow], candidates: int | None = None,
                     all_positions: bool = False) -> torch.Tensor:
        """Several prompts (or chunks) in one graph call, up to the prefill batch; fp32 logits [len(rows), V] of
        each row's last token, or with `all_positions` [len(rows), S, V] of each of the bucket's S positions (a
        row's own are its first len(tokens); the full distribution, `candidates` is not used)."""
        if self.embeds:
            raise ConfigError("this is an embedding model: it returns pooled vectors (embed_rows), not logits")
        bucket, inputs = self._prefill_inputs(rows)
        if not all_positions:
            return self._run(bucket, inputs, candidates)[: len(rows), : self.vocab_size]
        B, S = inputs.input_ids.shape
        every = torch.arange(S).expand(B, S).contiguous()  # [B, S]
        inputs = replace(inputs, last_index=every)
        return self._run(bucket, inputs, None)[: len(rows), :, : self.vocab_size]

    def prefill_sampled(self, rows: Sequence[PrefillRow], sampling: SamplingInputs) -> list[torch.Tensor]:
        """`prefill_rows` with each row's next token sampled in the graph from its last position (`sampling`: one
        row each); the token ids [len(rows)] (and logprobs asked for: neuron_opt.backends.neuron.NeuronExecutor)."""
        bucket, inputs = self._prefill_inputs(rows)
        return self._sampled(self._run(bucket, inputs, None, sampling), len(rows))

    def decode_sampled(self, rows: list[DecodeRow], sampling: SamplingInputs) -> list[torch.Tensor]:
        """`decode` with each row's token sampled in the graph (`sampling`: one row each); the token ids
        [len(rows)] (and the logprobs asked for)."""
        bucket, inputs = self.decode_inputs(rows)
        return self.run_decode_sampled(bucket, inputs, len(rows), sampling)

    def run_decode_sampled(self, bucket: Bucket, inputs: StepInputs, num_rows: int,
                           sampling: SamplingInputs) -> list[torch.Tensor]:
        """`run_decode` with the rows' tokens sampled in the graph (`decode_sampled`)."""
        return self._sampled(self._run(bucket, inputs, None, sampling), num_rows)

    def _sampled(self, outs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        self.stats.device_sampled += n
        return [t[:n] for t in outs]

    def embed_rows(self, rows: Sequence[PrefillRow]) -> torch.Tensor:
        """An embedding model's inputs in one graph call, up to the prefill batch, each whole and from position 0
        (the pooling sees every token of it); their fp32 embeddings [len(rows), H]."""
        if not self.embeds:
            raise ConfigError("this is a generation model: it has no pooling step; compile with --task embed")
        if any(r.start for r in rows):
            raise ValueError("an embedding row starts at position 0 (its whole input in one call)")
        bucket, inputs = self._prefill_inputs(rows)
        return self._run(bucket, inputs, None)[: len(rows)]

    def _prefill_inputs(self, rows: Sequence[PrefillRow]) -> tuple[Bucket, StepInputs]:
        if not rows or len(rows) > self.buckets.prefill_batch:
            raise ValueError(f"prefill takes 1..{self.buckets.prefill_batch} rows, got {len(rows)}")
        # the longest row's tokens, from the latest start: every row's last position lies within the KV length
        bucket = pick_prefill(max(len(r.tokens) for r in rows), self.buckets, max(r.start for r in rows),
                              self.prefill_granularity)
        B, S = bucket.batch, bucket.tokens
        ids = torch.zeros(B, S, dtype=torch.long)
        pos = torch.zeros(B, S, dtype=torch.long)
        slots = torch.zeros(B, S, dtype=torch.long)
        last = torch.zeros(B, dtype=torch.long)
        tables = []
        for i, r in enumerate(rows):
            n, blocks = len(r.tokens), self._blocks(r.blocks)
            if n < 1:
                raise ValueError("a prefill row needs at least one token")
            ids[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
            pos[i] = torch.arange(r.start, r.start + S).clamp(max=self.max_model_len - 1)
            slots[i, :n] = torch.tensor([self._slot(blocks, p) for p in range(r.start, r.start + n)])
            last[i] = n - 1
            tables.append(blocks)
        window = self._window_inputs(rows, [r.start for r in rows], [len(r.tokens) for r in rows], (B, S),
                                     bucket.kv_len)
        inputs = StepInputs(ids, pos, slots, self._tables(tables, B, bucket.kv_len), last, self._lora_slots(rows, B),
                            *window)
        return bucket, self._with_last_keys(self._with_rope(self._with_embeds(inputs, rows),
                                                            [r.rope_positions for r in rows]), rows)

    def _with_last_keys(self, inputs: StepInputs, rows: Sequence[PrefillRow]) -> StepInputs:
        """`inputs` with the step's last key positions [B, S] (`positions` where a row gives none); unchanged when
        no row gives any."""
        given = [(i, r.last_keys) for i, r in enumerate(rows) if r.last_keys is not None]
        if not given:
            return inputs
        if not getattr(self.executor, "takes_last_keys", False):
            raise ConfigError("images: this executor's graphs attend causally only; a model with bidirectional "
                              "image blocks (Gemma 3) runs on the eager backend", param="messages")
        keys = inputs.positions.clone()
        for i, t in given:
            if t.shape != (len(rows[i].tokens),):
                raise ValueError(f"a prefill row's last keys are {list(t.shape)}, not [{len(rows[i].tokens)}]")
            keys[i, :t.shape[0]] = t
        return replace(inputs, last_keys=keys)

    def _with_rope(self, inputs: StepInputs, tables: Sequence[torch.Tensor | None]) -> StepInputs:
        """`inputs` with M-RoPE's [3, B, S] positions for a model with mrope_section: each row's table over its
        first tokens, `positions` on every axis elsewhere (text, padding); unchanged for other models."""
        if not getattr(self.model_config, "mrope_section", ()):
            if any(t is not None for t in tables):
                raise ValueError("3-D rotary positions for a model without M-RoPE")
            return inputs
        B, S = inputs.positions.shape
        rope = inputs.positions.expand(3, B, S).clone()
        for i, t in enumerate(tables):
            if t is not None:
                rope[:, i, :t.shape[1]] = t
        return replace(inputs, rope_positions=rope)

    def _with_embeds(self, inputs: StepInputs, rows: Sequence[PrefillRow]) -> StepInputs:
        """`inputs` with the rows' image embeddings as the step's (mask [B, S], rows [B, S, H]); unchanged when no
        row has any."""
        with_embeds = [(i, r.embeds) for i, r in enumerate(rows) if r.embeds is not None]
        if not with_embeds:
            return inputs
        if not getattr(self.executor, "takes_embeddings", False):
            raise ConfigError("images: this executor's graphs take token ids only (vision-language models run on the "
                              "eager and cpu backends, tp > 1 on eager ranks)", param="messages")
        B, S = inputs.input_ids.shape
        H = with_embeds[0][1][1].shape[-1]
        mask = torch.zeros(B, S, dtype=torch.bool)
        embeds = torch.zeros(B, S, H, dtype=with_embeds[0][1][1].dtype)
        for i, (idx, vals) in with_embeds:
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(rows[i].tokens)):
                raise ValueError(f"a prefill row's image embeddings index past its {len(rows[i].tokens)} tokens")
            mask[i, idx] = True
            embeds[i, idx] = vals
        return replace(inputs, mm_mask=mask, mm_embeds=embeds)

    def decode(self, rows: list[DecodeRow], candidates: int | None = None) -> torch.Tensor:
        """One token per row at its position; returns fp32 logits [len(rows), V]."""
        bucket, inputs = self.decode_inputs(rows)
        return self.run_decode(bucket, inputs, len(rows), candidates)

    def run_decode(self, bucket: Bucket, inputs: StepInputs, num_rows: int,
                   candidates: int | None = None) -> torch.Tensor:
        """A decode step whose inputs `decode_inputs` built (row i's token may be written into `input_ids[i, 0]`
        after: async scheduling builds them before the tokens are sampled); fp32 logits [num_rows, V]."""
        return self._run(bucket, inputs, candidates)[:num_rows, : self.vocab_size]

    def decode_inputs(self, rows: Sequence[DecodeRow]) -> tuple[Bucket, StepInputs]:
        """The bucket and padded inputs of a decode step of `rows` (`decode` = this, then `run_decode`)."""
        bucket = pick_decode(len(rows), max(r.position for r in rows), self.buckets)
        B = bucket.batch
        ids = torch.zeros(B, 1, dtype=torch.long)
        pos = torch.zeros(B, 1, dtype=torch.long)
        slots = torch.zeros(B, 1, dtype=torch.long)
        tables = []
        for i, r in enumerate(rows):
            blocks = self._blocks(r.blocks)
            ids[i, 0], pos[i, 0], slots[i, 0] = r.token, r.position, self._slot(blocks, r.position)
            tables.append(blocks)
        window = self._window_inputs(rows, [r.position for r in rows], [1] * len(rows), (B, 1), bucket.kv_len)
        inputs = StepInputs(ids, pos, slots, self._tables(tables, B, bucket.kv_len), torch.zeros(B, dtype=torch.long),
                            self._lora_slots(rows, B), *window)
        return bucket, self._with_rope(inputs, [torch.full((3, 1), r.position + r.rope_delta) if r.rope_delta
                                                else None for r in rows])

    @property
    def verify_len(self) -> int:
        """Tokens per row of the verify graphs (num_speculative_tokens + 1), 0 when the artifact has none."""
        return self.buckets.verify_len

    def verify(self, rows: list[VerifyRow], candidates: int | None = None) -> torch.Tensor:
        """Score each row's tokens at consecutive positions in one graph call; returns fp32 logits
        [len(rows), q_len, V]: position j's logits predict the token after `tokens[j]`."""
        bucket, inputs = self._verify_inputs(rows)
        return self._run(bucket, inputs, candidates)[: len(rows), :, : self.vocab_size]

    def verify_sampled(self, rows: list[VerifyRow], sampling: SamplingInputs) -> dict[str, torch.Tensor]:
        """`verify` on an executor that samples on the device, with each row's proposals accepted in the graph
        (`sampling`: one row per scored position, runtime.sampling.verify_inputs): the outputs by name
        (neuron_opt.sample_ops.verify_outputs), each [len(rows), q, ...]."""
        bucket, inputs = self._verify_inputs(rows)
        outs = self._run(bucket, inputs, None, sampling)
        self.stats.device_sampled += len(rows)
        return {k: t.reshape(bucket.batch, bucket.tokens, *t.shape[1:])[: len(rows)]
                for k, t in verify_outputs(outs, sampling.logprobs).items()}

    def _verify_inputs(self, rows: list[VerifyRow]) -> tuple[Bucket, StepInputs]:
        q = self.verify_len
        if not q:
            raise BucketOverflowError("this model has no verify graphs; recompile with --num-speculative-tokens K")
        if any(not 1 <= len(r.tokens) <= q for r in rows):
            raise ValueError(f"verify rows take 1..{q} tokens, got {[len(r.tokens) for r in rows]}")
        bucket = pick_verify(len(rows), max(r.position + q - 1 for r in rows), self.buckets)
        B = bucket.batch
        ids = torch.zeros(B, q, dtype=torch.long)
        pos = torch.arange(q).repeat(B, 1)  # padding rows: positions 0..q-1 over the null block
        slots = torch.zeros(B, q, dtype=torch.long)
        tables = []
        for i, r in enumerate(rows):
            n, blocks = len(r.tokens), self._blocks(r.blocks)
            ids[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
            pos[i] = torch.arange(r.position, r.position + q).clamp(max=self.max_model_len - 1)
            slots[i, :n] = torch.tensor([self._slot(blocks, r.position + j) for j in range(n)])
            tables.append(blocks)
        window = self._window_inputs(rows, [r.position for r in rows], [len(r.tokens) for r in rows], (B, q),
                                     bucket.kv_len)
        inputs = StepInputs(ids, pos, slots, self._tables(tables, B, bucket.kv_len),
                            torch.arange(q).expand(B, q).contiguous(), self._lora_slots(rows, B), *window)
        return bucket, self._with_rope(inputs, [(pos[i] + r.rope_delta).expand(3, q) if r.rope_delta else None
                                                for i, r in enumerate(rows)])
