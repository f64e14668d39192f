"""The cluster tests' checkpoint and its single-process reference (each test module skips itself without Ray: a
skip here would stop the collection of the whole suite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_opt.api import LLM


@pytest.fixture(scope="session")
def ckpt(tiny_dir) -> Path:
    return tiny_dir("smollm-tok")


@pytest.fixture(scope="session")
def ref(ckpt):
    return LLM(ckpt, batch_size=1, max_model_len=256)
