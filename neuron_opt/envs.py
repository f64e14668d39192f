"""Every environment variable neuron_opt reads, in one place (prefix NEURON_OPT_), read once at import."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("NEURON_OPT_CACHE_DIR", Path.home() / ".cache" / "neuron_opt"))
# Number of torch intra-op threads per process (default: torch's choice).
NUM_THREADS = int(os.environ["NEURON_OPT_NUM_THREADS"]) if os.environ.get("NEURON_OPT_NUM_THREADS") else None
# `serve`'s torch threads per graph call when NUM_THREADS is unset: all | reserve (runtime/threads.py)
THREAD_POLICY = os.environ.get("NEURON_OPT_THREAD_POLICY") or "all"
# `serve --api-key` when the flag is not given: the key every /v1/* route requires (unset or empty: no key).
API_KEY = os.environ.get("NEURON_OPT_API_KEY") or None
# Public-key files (comma-separated) an artifact must be signed by to load; unset: none required (neuron_opt.signing).
# The --trusted-keys flag and LLM(trusted_keys=) take precedence.
TRUSTED_KEYS = tuple(Path(p.strip()) for p in os.environ.get("NEURON_OPT_TRUSTED_KEYS", "").split(",") if p.strip())
