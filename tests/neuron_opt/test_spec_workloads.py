"""The speculative benchmarks' prompts (neuron_opt/bench/spec_workloads.py): the server scenario's 16+ streams must be
distinct requests (identical prompts would share their prefix cache and their answers), each grounded in a text it
asks to copy."""

from __future__ import annotations

import pytest

from neuron_opt.bench.spec_workloads import GROUNDED, PARAGRAPHS, grounded_prompts


def test_grounded_prompts_are_distinct_and_copy_a_text():
    ps = grounded_prompts(18)
    assert len(set(ps)) == 18
    assert ps[:4] == GROUNDED  # bench_spec's four come first: its runs of record stay comparable
    for p in ps:
        body = p.split("\n\n", 1)[1]
        assert any(body in t or t in body for t in PARAGRAPHS), p[:60]
        assert len(body) > 300


def test_more_grounded_prompts_than_there_are_is_an_error():
    with pytest.raises(ValueError, match="at most 18"):
        grounded_prompts(19)
