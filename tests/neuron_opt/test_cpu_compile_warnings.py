"""A cpu graph compile prints no FutureWarning: torch 2.13's Inductor deep-copies each exported graph, whose pytree
specs hold LeafSpec leaves, and every copy warned that LeafSpec is deprecated (five times in `make demo`'s
compile). compile_graph (neuron_opt.backends.cpu.graphs) silences exactly that warning around its AOTInductor call.
One small AOTInductor compile: slow tier."""

from __future__ import annotations

import warnings

import pytest
import torch

from neuron_opt.backends.cpu.graphs import compile_graph


@pytest.mark.slow
def test_a_cpu_graph_compile_prints_no_future_warning(tmp_path) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compile_graph(module, (torch.randn(2, 16),), None, "aten", tmp_path / "g.so", "a small graph")
    assert (tmp_path / "g.so").is_file()
    assert [str(w.message) for w in seen if issubclass(w.category, FutureWarning)] == []
