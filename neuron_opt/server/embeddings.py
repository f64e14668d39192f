"""`POST /v1/embeddings`: OpenAI's request and response shapes over an embedding model's engine
(docs/embeddings.md).

Design decisions
- `input` is a string, a list of strings, a list of token ids or a list of id lists (OpenAI's four forms); each
  item is one engine request (a prefill-only sequence that finishes with its pooled vector), so a request's items
  are batched with every other request's under the same scheduler, up to the prefill batch per graph call.
- Texts are tokenized as sentence-transformers does (`embeddings.text_ids`: with the tokenizer's special tokens,
  or through the chat template for a checkpoint with the `message` modality); no prompt or instruction is
  prepended (the client sends it as part of the text).
- `dimensions` truncates each vector to its first `dimensions` entries and L2-normalises it again. Only a model
  trained for it gives meaningful truncated vectors (Matryoshka), and a checkpoint does not say so in its files:
  the sizes are declared at compile time (`compile --matryoshka-dims`), and any other value is a 400.
- `encoding_format` "base64" is the float32 little-endian bytes of each vector, base64-encoded (what the `openai`
  client asks for by default and decodes).
- Refusals before any work: a generation model (400 naming `model`), an empty input, more items than
  `--max-embedding-inputs`, an item past the prompt bound or the model's context, token ids outside the vocabulary.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import torch
import torch.nn.functional as F

from neuron_opt.embeddings import text_ids
from neuron_opt.runtime.output import RequestOutput
from neuron_opt.server.protocol import ProtocolError, _Strict
from neuron_opt.server.serving import EngineError, OpenAIServing


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def items(self) -> list[str | list[int]]:
        """The inputs, one per embedding."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(t, int) for t in self.input):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]


def encode_vector(v: torch.Tensor, encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI sends it: a list of floats, or the base64 of its float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


def truncate(v: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The first `dimensions` entries, L2-normalised again (None: `v` unchanged)."""
    if dimensions is None:
        return v
    return F.normalize(v[:dimensions].float(), p=2.0, dim=-1)


class EmbeddingServing:
    """`/v1/embeddings` over an OpenAIServing's engine, tokenizer, limits and metrics."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _check(self, req: EmbeddingRequest) -> list[str | list[int]]:
        s = self.serving
        s.check_model(req.model)
        if not s.engine.embeds:
            raise ProtocolError("this model generates text: it has no pooling step for embeddings (compile the "
                                "checkpoint with --task embed and serve that artifact)", "model")
        items = req.items()
        if not items:
            raise ProtocolError("input: must not be empty", "input")
        if len(items) > s.limits.max_embedding_inputs:
            raise ProtocolError(f"input: {len(items)} inputs; this server takes at most "
                                f"{s.limits.max_embedding_inputs} per request (--max-embedding-inputs)", "input")
        bound = s.limits.prompt_chars(s.max_model_len)
        for item in items:
            if len(item) == 0:
                raise ProtocolError("input: an input must not be empty", "input")
            if len(item) > bound:
                raise ProtocolError(f"input: an input of {len(item)} {'characters' if isinstance(item, str) else 'ids'}"
                                    f" exceeds this server's bound of {bound} (--max-prompt-chars)", "input")
        dims = s.engine.runner.matryoshka_dims
        if req.dimensions is not None and req.dimensions not in dims:
            raise ProtocolError(
                f"dimensions: {req.dimensions} is not a size this model may be truncated to "
                f"({'declared: ' + ', '.join(map(str, dims)) if dims else 'it declares no Matryoshka sizes'}; "
                "compile with --matryoshka-dims)", "dimensions")
        return items

    async def create(self, req: EmbeddingRequest, arrival: float) -> dict[str, Any]:
        s = self.serving
        items = self._check(req)
        prompts: list[list[int]] = []
        for item in items:
            ids = (await asyncio.to_thread(text_ids, s.engine.runner.model_config, s.tokenizer, item)
                   if isinstance(item, str) else list(item))
            s._check_ids(ids, "input", s.vocab_size)
            prompts.append(ids)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[RequestOutput]] = []
        rids: list[str] = []
        try:
            for ids in prompts:
                fut: asyncio.Future[RequestOutput] = loop.create_future()
                rid = uuid.uuid4().hex
                s.engine.add_embedding_request(
                    rid, ids, lambda o, f=fut: loop.call_soon_threadsafe(_resolve, f, o), arrival_time=arrival)
                futures.append(fut)
                rids.append(rid)
            outs = await asyncio.gather(*futures)
        except BaseException:
            for rid, fut in zip(rids, futures, strict=False):
                if not fut.done():
                    s.engine.abort(rid)
            raise
        now = time.monotonic()
        data = []
        for i, out in enumerate(outs):
            if out.finish_reason != "stop" or out.embedding is None:
                raise EngineError(out.error or f"embedding ended with {out.finish_reason}")
            s.metrics.request_finished("stop", out.num_prompt_tokens, 0, now - arrival)
            v = truncate(out.embedding, req.dimensions)
            data.append({"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)})
        n = sum(len(p) for p in prompts)
        return {"object": "list", "data": data, "model": s.model_name,
                "usage": {"prompt_tokens": n, "total_tokens": n}}


def _resolve(fut: asyncio.Future[RequestOutput], out: RequestOutput) -> None:
    if not fut.done():
        fut.set_result(out)

