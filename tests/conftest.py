from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py, tests/helpers.py

torch.set_num_threads(min(2, torch.get_num_threads()))

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
