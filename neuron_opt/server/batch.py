"""`neuron-opt run-batch`: OpenAI batch files (vLLM's `run-batch` format) through the serving code in-process.

Design decisions
- Input: one request per non-blank line, `{"custom_id", "method": "POST", "url", "body"}`, `url` one of
  /v1/chat/completions, /v1/completions, /v1/embeddings; `body` is what the route takes (not streamed). Output: one
  line per input line, in input order, `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
  "error"}`. A failed request has its status and OpenAI error body under `response` and the error object in
  `error` (null on success).
- A bad line (not JSON, a missing or wrong field, an unknown url, a route's 400) is an error line that names its
  line number: never dropped, and the rest of the file goes on.
- Full batch: up to `window` requests are in the engine at once (the runner's batch and a queue behind it), so the
  engine runs at full batch; results are written in input order as soon as the lines before them are written.
- Resumable: an existing output file holding the results of the first K lines (a last line cut mid-write is
  dropped) is continued from line K + 1, after checking that its custom_ids are the input's.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from neuron_opt.errors import ConfigError
from neuron_opt.server.embeddings import EmbeddingRequest, EmbeddingServing
from neuron_opt.server.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from neuron_opt.server.serving import OpenAIServing

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

ErrorPayload = Callable[[Exception], "tuple[int, dict[str, Any]]"]


def input_lines(path: Path) -> list[tuple[int, str]]:
    """The input file's non-blank lines, with their line numbers (1-based)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--input-file: cannot read {path}: {e}", param="input_file") from None
    return [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]


def _custom_id(line: str) -> Any:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj.get("custom_id") if isinstance(obj, dict) else None


def resume_from(path: Path, lines: list[tuple[int, str]]) -> int:
    """How many input lines `path` already holds results for (0 when it does not exist). A last line cut
    mid-write is removed from the file; a result whose custom_id is not its input line's is a ConfigError."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # the last line was being written when the run stopped
        with path.open("r+b") as f:
            f.truncate(end)
    done = data[:end].decode("utf-8", errors="replace").splitlines()
    if len(done) > len(lines):
        raise ConfigError(f"--output-file: {path} holds {len(done)} results but the input has {len(lines)} lines; "
                          "it is not this input's output", param="output_file")
    for k, out in enumerate(done):
        number, line = lines[k]
        if _custom_id(out) != _custom_id(line):
            raise ConfigError(f"--output-file: {path} line {k + 1} is not the result of input line {number} (custom_id "
                              f"{_custom_id(out)!r}, expected {_custom_id(line)!r}); remove the file or give another",
                              param="output_file")
    return len(done)


class BatchRunner:
    """Runs batch lines through the serving code. `error_payload`: exception -> (HTTP status, OpenAI error body),
    the server's own mapping (server/app.py)."""

    def __init__(self, serving: OpenAIServing, error_payload: ErrorPayload) -> None:
        self.serving, self.embeddings = serving, EmbeddingServing(serving)
        self.error_payload = error_payload

    async def _body(self, url: str, body: Any) -> dict[str, Any]:
        arrival = time.monotonic()
        raw = json.dumps(body)
        if url == "/v1/embeddings":
            return await self.embeddings.create(EmbeddingRequest.model_validate_json(raw), arrival)
        req: ChatCompletionRequest | CompletionRequest = (
            ChatCompletionRequest if url == "/v1/chat/completions" else CompletionRequest).model_validate_json(raw)
        if req.stream:
            raise ProtocolError("stream: a batch request is not streamed", "stream")

        async def connected() -> bool:
            return False

        result = await (self.serving.chat(req, arrival, connected) if isinstance(req, ChatCompletionRequest)
                        else self.serving.completions(req, arrival, connected))
        assert isinstance(result, dict)
        return result

    async def run_line(self, number: int, line: str) -> dict[str, Any]:
        """The output object of `line`, line `number` of the input file."""
        custom_id = _custom_id(line)
        try:
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ProtocolError(f"line {number}: not JSON ({e})") from None
            if not isinstance(obj, dict):
                raise ProtocolError(f"line {number}: must be a JSON object")
            unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
            if unknown:
                raise ProtocolError(f"line {number}: unknown field {unknown[0]!r}", unknown[0])
            if not isinstance(custom_id, str) or not custom_id:
                raise ProtocolError(f"line {number}: custom_id must be a non-empty string", "custom_id")
            if obj.get("method") != "POST":
                raise ProtocolError(f"line {number}: method must be 'POST'", "method")
            if obj.get("url") not in ROUTES:
                raise ProtocolError(f"line {number}: url must be one of {', '.join(ROUTES)}", "url")
            if not isinstance(obj.get("body"), dict):
                raise ProtocolError(f"line {number}: body must be a JSON object", "body")
            status, body, error = 200, await self._body(obj["url"], obj["body"]), None
        except Exception as e:  # every failure is this line's error line (a 500 logs its details under an id)
            status, body = self.error_payload(e)
            error = body["error"]
            if not error["message"].startswith(f"line {number}:"):
                error["message"] = f"line {number}: {error['message']}"
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
                "error": error}

    async def run(self, lines: list[tuple[int, str]], start: int, out: TextIO, window: int,
                  progress: Callable[[int], object]) -> tuple[int, int]:
        """Lines `start`... of `lines`, at most `window` at once, their results appended to `out` in input order;
        `progress(k)` after each k written. Returns (succeeded, failed)."""
        ready: dict[int, dict[str, Any]] = {}
        written, counts = start, [0, 0]
        slots = asyncio.Semaphore(window)

        async def one(i: int) -> None:
            try:
                ready[i] = await self.run_line(*lines[i])
            finally:
                slots.release()

        def flush() -> None:
            nonlocal written
            n = 0
            while written in ready:
                result = ready.pop(written)
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                counts[result["error"] is not None] += 1
                written, n = written + 1, n + 1
            if n:
                out.flush()
                progress(n)

        tasks: list[asyncio.Task[None]] = []
        for i in range(start, len(lines)):
            await slots.acquire()
            flush()
            tasks.append(asyncio.create_task(one(i)))
        for t in tasks:
            await t
            flush()
        return counts[0], counts[1]
