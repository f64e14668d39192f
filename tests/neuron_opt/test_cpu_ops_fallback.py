"""Where the cpu backend's C++ operators do not build (neuron_opt/backends/cpu/ops.py): the build error is logged
with the forms the backend takes instead, compiles pick those forms, and an artifact whose graphs call the operators
is refused saying how to compile without them. The build is made to fail here; that the operators do build on this
machine is test_cpu_ops.py's first check. The fallback forms' graphs against eager: test_cpu_ops.py (fused decode
attention, default suite), test_cpu_variants.py and test_quant_model.py (MoE and int8, `make test-slow`)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.cpp_extension

from neuron_opt.backends.cpu import ops as cpu_ops
from neuron_opt.backends.cpu.backend import CpuBackend
from neuron_opt.errors import ArtifactError

FALLBACKS = {"decode_attention": "fused", "int8_linear": "inductor", "moe_gather": "inductor"}


@pytest.fixture
def failed_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'neuron_opt_cpu_ops': c++: not found")

    monkeypatch.setattr(cpu_ops, "_state", {})  # this process's real build result comes back afterwards
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)


def test_a_failed_build_is_logged_with_the_forms_taken_instead(failed_build, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=cpu_ops.__name__):
        err = cpu_ops.load()
    assert err == "RuntimeError: Error building extension 'neuron_opt_cpu_ops': c++: not found"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and err in record.getMessage()
    for name, form in FALLBACKS.items():
        assert f"{name}={form}" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_ops.__name__):
        assert cpu_ops.load() == err  # tried once per process: the error is remembered, not logged again
    assert not caplog.records


def test_compiles_take_the_fallback_forms_and_keep_explicit_options(failed_build) -> None:
    assert {k: CpuBackend(torch.float32).options[k] for k in FALLBACKS} == FALLBACKS
    assert CpuBackend(torch.float32, {"decode_attention": "sdpa"}).options["decode_attention"] == "sdpa"


def test_an_artifact_calling_the_operators_is_refused_with_the_options_to_do_without(failed_build) -> None:
    with pytest.raises(ArtifactError, match="c\\+\\+: not found") as e:
        cpu_ops.ensure("this artifact's cpu graphs", ArtifactError)
    for name, form in FALLBACKS.items():
        assert f"--backend-option {name}={form}" in str(e.value)

