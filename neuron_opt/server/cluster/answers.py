"""How the router answers in each API's shapes where it speaks for itself: its own refusals (401, 413, 503) and a
replica's error, and the events that end a stream whose replica failed after the stream had started.

- OpenAI (`/v1/completions`, `/v1/chat/completions`, ...): `data: {"error": {...}}` then `data: [DONE]`.
- Anthropic (`/v1/messages*`): errors in Anthropic's body (`{"type": "error", "error": {...}}`); a stream ends with
  Anthropic's `event: error` (its streams have no `[DONE]`).
- Responses (`/v1/responses`): errors in the OpenAI body; a stream ends with the Responses API's `error` event,
  numbered after the events already sent.
"""

from __future__ import annotations

import json
from typing import Any

from neuron_opt.server.anthropic import anthropic_error
from neuron_opt.server.app import error_body
from neuron_opt.server.serving import sse

OPENAI, ANTHROPIC, RESPONSES = "openai", "anthropic", "responses"


def error_content(api: str, status: int, content: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped error body (`app.error_payload`'s) in the shape of `api`."""
    if api != ANTHROPIC:
        return content
    err = content["error"]
    return anthropic_error(status, err["message"], err.get("param"))


def failed_stream(api: str, status: int, message: str, events_sent: int) -> list[str]:
    """The events that end a stream of `api` which failed after `events_sent` events."""
    if api == ANTHROPIC:
        return [f"event: error\ndata: {json.dumps(anthropic_error(status, message))}\n\n"]
    if api == RESPONSES:
        return ["event: error\n" + sse({"type": "error", "code": "server_error", "message": message, "param": None,
                                        "sequence_number": events_sent})]
    type_ = "GatewayTimeoutError" if status == 504 else "ServiceUnavailableError"
    return [sse(error_body(status, message, type_)), "data: [DONE]\n\n"]
