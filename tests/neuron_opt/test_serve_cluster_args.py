"""`serve --data-parallel` / `--ray-address` at the boundary, without Ray running: what each replica asks Ray for,
and the errors that come before any Ray process starts (Ray missing, bad counts, bad paths). The cluster itself
runs in tests/cluster (`make test-cluster`)."""

from __future__ import annotations

import os
import sys

import pytest

from neuron_opt.cli import main
from neuron_opt.commands.serve_cluster import replica_resources
from neuron_opt.errors import ConfigError

CORES = len(os.sched_getaffinity(0))


def test_a_neuron_replica_asks_for_its_tp_neuron_cores() -> None:
    assert replica_resources("neuron", 8, 3, None) == ({"num_cpus": 1, "resources": {"neuron_cores": 8}}, None)
    assert replica_resources("neuron", 2, 12, 4.0) == ({"num_cpus": 4.0, "resources": {"neuron_cores": 2}}, None)


def test_a_cpu_replica_asks_for_its_share_of_the_cores_and_runs_as_many_threads() -> None:
    assert replica_resources("cpu", 1, 1, None) == ({"num_cpus": CORES}, CORES)
    assert replica_resources("eager", 1, 2 * CORES, None) == ({"num_cpus": 1}, 1)  # never below one CPU
    assert replica_resources("cpu", 1, 2, 1.5) == ({"num_cpus": 1.5}, 1)
    with pytest.raises(ConfigError, match="--replica-cpus: must be > 0"):
        replica_resources("cpu", 1, 2, 0.0)


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process cannot import Ray (whether or not the `cluster` extra is installed)."""
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)


def test_without_ray_the_flags_say_what_to_install(tiny_dir, no_ray, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(tiny_dir("smollm-tok"))
    for flags in (["--data-parallel", "2"], ["--ray-address", "auto"]):
        assert main(["serve", "--model", ckpt, *flags]) == 2
        err = capsys.readouterr().err
        assert "Ray Serve, which is not installed" in err and "pip install 'neuron-opt[cluster]'" in err


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel", "0"], "--data-parallel: must be >= 1, got 0"),
    (["--data-parallel", "2", "--replica-cpus", "-1"], "--replica-cpus: must be > 0"),
    (["--data-parallel", "2", "--num-speculative-tokens", "3"], "--num-speculative-tokens needs"),
    (["--data-parallel", "2", "--enable-docs"], "--enable-docs: the data-parallel router serves no API docs"),
    (["--data-parallel", "2", "--max-body-bytes", "0"], "max_body_bytes: must be >= 1, got 0"),
])
def test_bad_flags_fail_before_ray_starts(tiny_dir, no_ray, capsys: pytest.CaptureFixture[str], flags, message) -> None:
    assert main(["serve", "--model", str(tiny_dir("smollm-tok")), *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_checkpoint_fails_before_ray_starts(tmp_path, no_ray, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "nothing"), "--data-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert "nothing" in err and "Ray Serve" not in err
