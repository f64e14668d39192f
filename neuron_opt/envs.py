"""Every environment variable neuron_opt reads, in one place (prefix NEURON_OPT_, and one of vLLM's where we honour
it), read once at import."""

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
# Public-key files (comma-separated) an artifact must be signed by to load; unset (None): none required; set but
# naming no file: an error where keys are read (neuron_opt.signing). --trusted-keys and LLM(trusted_keys=) take
# precedence.
TRUSTED_KEYS = (None if "NEURON_OPT_TRUSTED_KEYS" not in os.environ else
                tuple(Path(p.strip()) for p in os.environ["NEURON_OPT_TRUSTED_KEYS"].split(",") if p.strip()))
# vLLM's opt-in to runtime LoRA loading, honoured as `serve --enable-lora-runtime-loading` (true/1: on).
ALLOW_RUNTIME_LORA_UPDATING = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
