"""Which replica a request goes to: `PrefixAffinityRouter`, Serve's request router for the engine replicas.

Design decisions
- `--routing prefix` (the default): a request goes to the replica that was last sent the longest chain of its
  prompt's first blocks, keyed by the hashes the engine's prefix cache uses (`hash_block` over the same token ids:
  the same tokenizer, chat template and tool rendering), so requests sharing a system prompt or a conversation's
  history find its KV blocks cached. Unless that replica has more than `balance_threshold` ongoing requests beyond
  the least loaded one (SGLang's rule): then, and for a prompt with no remembered block, the least loaded replica
  (`--routing load`: always). The router remembers at most `ROUTED_BLOCKS` keys (LRU) and forgets a replica's keys
  when it dies. `/v1/embeddings`, `/tokenize` and `/detokenize` have no keys (an embedding input uses no prefix
  cache: it is pooled whole in one call) and go by load.
- Serve routes only to replicas its controller reports running and healthy, and drops one whose actor died at once
  (`on_replica_actor_died`), so a dead replica gets no new requests even before the controller replaces it.
"""


import asyncio
import importlib
from collections import Counter as Tally
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from neuron_opt.checkpoint import open_checkpoint
from neuron_opt.hub import resolve_model
from neuron_opt.runtime.block_manager import hash_block
from neuron_opt.server.limits import PROMPT_CHARS_PER_TOKEN
from neuron_opt.server.protocol import ChatCompletionRequest, CompletionRequest
from neuron_opt.server.tools import make_parser, render_messages

ROUTED_BLOCKS = 1 << 16  # prefix keys the router remembers (LRU): 64 Ki blocks, about 4 MB
MAX_KEY_BLOCKS = 256  # of a prompt's blocks, the first this many are keyed (a chain: each key names its prefix)
ROUTING_POLICIES = ("prefix", "load")


class PrefixKeys:
    """The prefix-cache keys of a request's full prompt blocks, as its replica's engine computes them: the prompt's
    token ids (completions: the prompt as tokenized by `OpenAIServing`; chat: the messages and tools rendered as a
    chat request renders them, through the chat template), chained with `hash_block`. A request the replica will
    refuse has no keys (it is routed by load and answered there).

    The work is bounded by the keys' reach, not by the body: only the prompt's first `max_chars` characters
    (PROMPT_CHARS_PER_TOKEN per token of the `max_blocks` keyed blocks: limits.py's generous bound) are tokenized
    (chat: the messages past them left out, the one across the cut cut), and of token ids the first keyed ones
    read. The keys are the whole prompt's unless its first keyed tokens average more characters than that bound,
    and then only the last keys differ (a routing hint lost, nothing more)."""

    def __init__(self, tokenizer: Any, block_size: int, tool_call_parser: str | None,
                 max_blocks: int = MAX_KEY_BLOCKS) -> None:
        self.tokenizer, self.block_size, self.max_blocks = tokenizer, block_size, max_blocks
        self.max_chars = PROMPT_CHARS_PER_TOKEN * max_blocks * block_size
        self.parser = make_parser(tool_call_parser, tokenizer)

    def _cut(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages within the first `max_chars` characters of text."""
        out, budget = [], self.max_chars
        for m in messages:
            if budget <= 0:
                break
            content = m.get("content")
            if isinstance(content, str):
                m = {**m, "content": content[:budget]}
                budget -= len(content)
            out.append(m)
        return out

    def prompt_ids(self, route: str, body: bytes) -> list[int]:
        if route == "completions":
            prompt = CompletionRequest.model_validate_json(body or b"null").prompt_input()
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt[:self.max_chars])["input_ids"])
            return list(prompt[:self.max_blocks * self.block_size])
        if route == "chat":
            req = ChatCompletionRequest.model_validate_json(body or b"null")
            rendered, tools = render_messages(self._cut(req.message_dicts()), self.parser, req.tool_request())
            kw = {"tools": tools} if tools else {}
            out = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, **kw)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return []

    def __call__(self, route: str, body: bytes) -> tuple[bytes, ...]:
        try:
            ids = self.prompt_ids(route, body)
        except Exception:  # noqa: BLE001 -- invalid for the replica too, which answers it with the reason
            return ()
        keys, parent = [], None
        for start in range(0, min(len(ids) // self.block_size, self.max_blocks) * self.block_size, self.block_size):
            parent = hash_block(parent, ids[start:start + self.block_size])
            keys.append(parent)
        return tuple(keys)


class RoutingStats:
    """What the request router decided, per replica: read by the Router's /metrics (same process)."""

    def __init__(self) -> None:
        self.routed: Tally[tuple[str, str]] = Tally()  # (replica, reason) -> requests

    def count(self, replica: str, reason: str) -> None:
        self.routed[(replica, reason)] += 1


ROUTING = RoutingStats()


def load_tokenizer(source: dict[str, str | None]) -> Any:
    """The tokenizer the replicas use: an artifact's (`{"artifact": dir}`) or a checkpoint's (`{"model": spec,
    "revision": ..., "gguf_file": ...}`, a Hub id fetched here: neuron_opt.hub)."""
    if "artifact" in source:
        # transformers here, not at the top: a replica sets up its device runtime before importing it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(Path(source["artifact"]) / "tokenizer")
    return open_checkpoint(resolve_model(str(source["model"]), revision=source.get("revision"),
                                         gguf_file=source.get("gguf_file"))).tokenizer()


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Serve's request router for the engine replicas (module docstring, "Routing"). `request_router_kwargs`:
    tokenizer (load_tokenizer's source), block_size, tool_call_parser, policy ("prefix" | "load"),
    balance_threshold (ongoing requests)."""

    def initialize_state(self, tokenizer: dict[str, str], block_size: int, tool_call_parser: str | None = None,
                         policy: str = "prefix", balance_threshold: int = 4) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r}: one of {ROUTING_POLICIES}")
        self.policy, self.balance_threshold = policy, balance_threshold
        self.keys = PrefixKeys(load_tokenizer(tokenizer), block_size, tool_call_parser) if policy == "prefix" else None
        self.owner: OrderedDict[bytes, ReplicaID] = OrderedDict()
        # request id -> (its keys, why it goes where it goes, the replica holding its prefix)
        self.pending: dict[str, tuple[tuple[bytes, ...], str, ReplicaID | None]] = {}

    async def _request_keys(self, request: PendingRequest) -> tuple[bytes, ...]:
        rid = request.metadata.internal_request_id
        if rid not in self.pending:  # once per request (routing may take several rounds)
            route, body = request.args[0], request.args[1]
            keys = await asyncio.to_thread(self.keys, route, body) if self.keys is not None else ()
            self.pending[rid] = (keys, "load", None)
        return self.pending[rid][0]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or self.policy == "load" or not candidate_replicas:
            return [candidate_replicas]  # Serve probes them and takes the least loaded with room
        keys = await self._request_keys(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        match = next((by_id[o] for k in reversed(keys) if (o := self.owner.get(k)) in by_id), None)
        rid = pending_request.metadata.internal_request_id
        if match is None:
            return [candidate_replicas]
        lens = [n for r in candidate_replicas if (n := self.replica_queue_len_cache.get(r.replica_id)) is not None]
        mine = self.replica_queue_len_cache.get(match.replica_id)
        if mine is not None and lens and mine - min(lens) > self.balance_threshold:
            self.pending[rid] = (keys, "balance", match.replica_id)
            return [candidate_replicas]
        self.pending[rid] = (keys, "prefix", match.replica_id)
        # the replica holding the prefix first; when it has no room, the least loaded of the others
        return [[match], [r for r in candidate_replicas if r is not match]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        keys, reason, holder = self.pending.pop(pending_request.metadata.internal_request_id, ((), "load", None))
        if reason == "prefix" and holder != replica_id:
            reason = "full"  # the prefix's replica had no room: the least loaded of the others took it
        # this module's ROUTING, which the Router's /metrics reads: Serve ships this class to the router's process by
        # value, with a copy of the module's globals
        importlib.import_module(__name__).ROUTING.count(replica_id.unique_id, reason)
        for k in keys:
            self.owner[k] = replica_id
            self.owner.move_to_end(k)
        while len(self.owner) > ROUTED_BLOCKS:
            self.owner.popitem(last=False)

    def _forget(self, alive: set[ReplicaID]) -> None:
        for k in [k for k, o in self.owner.items() if o not in alive]:
            del self.owner[k]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(set(self.curr_replicas))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget({r.replica_id for r in replicas})
