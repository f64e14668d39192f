"""The neuron backend where torch-xla is absent (the default venv): clear errors, validated options.

The device path itself (compile, HLO, device-resident KV, SPMD tp=2) is tested in tests/xla, which runs in the
torch 2.9 + torch-xla 2.9 environment (`make test-xla`).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from neuron_opt.errors import BackendUnavailableError, ConfigError

NO_XLA = importlib.util.find_spec("torch_xla") is None


def test_importing_the_module_does_not_import_torch_xla():
    code = ("import sys, neuron_opt.backends.neuron.backend; "
            "assert 'torch_xla' not in sys.modules and 'torch_neuronx' not in sys.modules, 'runtime imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_torch_xla_a_clear_error_names_the_fix(monkeypatch):
    from neuron_opt.backends import get_backend

    monkeypatch.setitem(sys.modules, "torch_xla", None)  # import fails like an absent package
    with pytest.raises(BackendUnavailableError) as e:
        get_backend("neuron", torch.bfloat16)
    msg = str(e.value)
    for needle in ("torch-xla 2.9", "torch-neuronx", "pip.repos.neuron.amazonaws.com", "WRONG PACKAGE",
                   "make setup-xla", "PJRT_DEVICE=CPU", "--backend cpu"):
        assert needle in msg, needle


@pytest.mark.skipif(not NO_XLA, reason="checks the error of an environment without torch-xla")
def test_compile_without_torch_xla_fails_before_writing_anything(tiny_dir, tmp_path):
    from neuron_opt.compiler import CompileRequest, compile_artifact

    with pytest.raises(BackendUnavailableError):
        compile_artifact(CompileRequest(model=str(tiny_dir("smollm-tok")), out=tmp_path / "art", backend="neuron"),
                         log=lambda s: None, progress=False)
    assert not (tmp_path / "art").exists()
    assert list(tmp_path.iterdir()) == []  # not even the temporary sibling directory


@pytest.mark.parametrize("options, needle", [
    ({"target": "inf2"}, "cross-compiling"),
    ({"ops": "triton"}, "backend_options.ops"),
    ({"compiler_workdir": "/tmp/x"}, "unknown neuron option"),
])
def test_bad_options_are_refused_before_the_runtime_is_looked_for(options, needle, monkeypatch):
    from neuron_opt.backends import get_backend

    monkeypatch.setitem(sys.modules, "torch_xla", None)
    with pytest.raises(ConfigError, match=needle):
        get_backend("neuron", torch.bfloat16, options)


def test_compiler_args_are_parsed_from_a_string():
    from neuron_opt.backends.neuron.backend import NeuronOptions

    assert NeuronOptions.from_dict({"compiler_args": "-O2 --lnc=2"}).compiler_args == ("-O2", "--lnc=2")
