"""Grammar compiles in a bounded pool of their own, each with a timeout.

Design decisions
- Compiling a request's grammar is the one piece of a request's work whose cost the request itself sets (a schema,
  a regex, an EBNF grammar). It runs in `max_grammar_compiles` threads of its own, never in the event loop's
  default executor (which tokenizes and renders chat templates for every request), so costly grammars delay only
  other grammars.
- At most GRAMMAR_QUEUE_PER_WORKER x workers compiles wait for a thread; one more is a 503 with Retry-After
  (QueueFullError), as a full engine queue is. The caller checks the engine's admission first, so a request the
  engine would refuse never costs a compile.
- A compile past `grammar_compile_timeout` seconds fails its request with a 400 naming the field. A thread cannot
  be stopped, so the compile runs on and holds its worker until it ends (its result lands in xgrammar's cache); the
  pool's bound counts it until then, so timed-out compiles cannot pile up threads.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from neuron_opt.errors import ConfigError, QueueFullError
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.server.limits import GRAMMAR_QUEUE_PER_WORKER, ServerLimits


class GrammarPool:
    """Compiles requests' grammars through `compile_grammar` (Engine.compile_grammar) under `limits`."""

    def __init__(self, compile_grammar: Any, limits: ServerLimits) -> None:
        self._compile = compile_grammar
        self.workers = limits.max_grammar_compiles
        self.timeout = limits.grammar_compile_timeout
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="neuron-opt-grammar")
        self._lock = threading.Lock()
        self._held = 0  # compiles queued or running (a timed-out one until its thread is done)

    def _release(self, _: Any) -> None:
        with self._lock:
            self._held -= 1

    async def compile(self, params: SamplingParams) -> Any:
        """The compiled grammar of `params.structured`. Raises QueueFullError (pool full), ConfigError (the grammar
        is refused, does not compile, or does not compile within the timeout)."""
        with self._lock:
            if self._held >= self.workers * (1 + GRAMMAR_QUEUE_PER_WORKER):
                raise QueueFullError(f"server busy: {self._held} grammars compiling or waiting to; retry later")
            self._held += 1
        future = self._pool.submit(self._compile, params)
        future.add_done_callback(self._release)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except asyncio.TimeoutError:
            raise ConfigError(f"structured outputs: the grammar did not compile within {self.timeout:g} s; simplify "
                              "it", param="structured_outputs") from None
