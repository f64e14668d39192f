"""The device path on torch-xla's CPU device. XLA's HLO dump (what compile writes into the artifact) must be on
before torch_xla starts, so this conftest starts it: one XLA CPU device, not SPMD. tp=2 (one SPMD program over
two devices) runs in subprocesses, since SPMD mode is per process."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

from neuron_opt.backends.neuron.backend import import_xla  # noqa: E402

import_xla(dump=True)
