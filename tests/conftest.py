from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py, tests/helpers.py

# At most 2 torch threads per process, split between pytest-xdist's workers (`make test` runs 2 on 2 cores: one
# thread each). OpenMP's barriers spin, so two 2-thread processes on 2 cores keep waiting on descheduled threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _WORKERS))

# tests/xla needs torch-xla 2.9 (its own venv: `make test-xla`); the default venv does not collect it
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(variant) -> path of a tiny random HF checkpoint (made once per session)."""
    from tiny import make_tiny

    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_tiny(variant, tmp_path_factory.mktemp(variant))
        return made[variant]

    return get
