"""tp x data-parallel splits (`plan --target`, neuron_opt.planner.scale_out): each split is the single-replica plan
evaluated at its share of the streams, combined by the closed-loop formulas; the recommendation is checked against
every other split, not against a pinned answer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_planner_cli import LLAMA3_8B

from neuron_opt.cli import main
from neuron_opt.config import ModelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.planner.hardware import get_instance
from neuron_opt.planner.recommend import RECOMMEND_SLACK, Deployment, Traffic, evaluate
from neuron_opt.planner.scale_out import recommend_split, splits

CFG = ModelConfig.from_hf(LLAMA3_8B)
INST = get_instance("inf2.48xlarge")


def _splits(concurrency: int, **kw) -> list:
    return splits(CFG, INST, Traffic(512, 256, concurrency), max_prompt_len=512, max_model_len=768, **kw)


@pytest.mark.parametrize("concurrency", [1, 5, 64])
def test_each_split_is_the_replica_plan_at_its_share(concurrency: int) -> None:
    got = _splits(concurrency)
    assert [s.tp for s in got] == list(INST.tp_degrees)
    for s in got:
        assert s.replicas == INST.cores // s.tp and s.cores <= INST.cores
        streams = math.ceil(concurrency / s.replicas)
        assert s.streams == streams and s.busy == min(s.replicas, concurrency)
        ref = evaluate(CFG, INST, Deployment(s.tp, streams, 512, 768), Traffic(512, 256, streams))
        assert s.plan.fits == ref.fits and s.plan.tpot.total == ref.tpot.total
        round_s = math.ceil(streams / ref.prefill_bucket.batch) * ref.ttft.total + 256 * ref.tpot.total
        assert s.round_s(256) == pytest.approx(round_s)
        assert s.throughput(256) == pytest.approx(s.busy * streams * 256 / round_s)
        if streams == 1:  # one stream per replica: the request latency is the planner's own e2e
            assert s.round_s(256) == pytest.approx(ref.e2e_s(256))


@pytest.mark.parametrize("concurrency", [1, 8, 64, 256])
def test_recommendation_wins_its_target_and_is_not_dominated(concurrency: int) -> None:
    got = _splits(concurrency)
    fit = [s for s in got if s.plan.fits]
    assert any(not s.plan.fits for s in got)  # tp 1 cannot hold 8B in bf16: never recommended
    for target in ("throughput", "latency"):
        pick = recommend_split(got, 256, target)
        assert pick in fit
        if target == "throughput":
            assert pick.throughput(256) * (1 + RECOMMEND_SLACK) >= max(s.throughput(256) for s in fit)
        else:
            assert pick.round_s(256) <= min(s.round_s(256) for s in fit) * (1 + RECOMMEND_SLACK)
        # no fitting split is both faster per request and higher in throughput
        assert not [s for s in fit if s.round_s(256) < pick.round_s(256) and s.throughput(256) > pick.throughput(256)]


def test_many_streams_favour_replicas_one_stream_favours_tp() -> None:
    """The shape AWS's data-parallel tutorial reports (several smaller-tp replicas beat one large one on throughput
    under load), from the model's own terms: at 1 stream the widest tp is fastest; at 64, replicas win."""
    assert recommend_split(_splits(1), 256, "latency").tp == max(INST.tp_degrees)
    busy = recommend_split(_splits(64), 256, "throughput")
    assert busy.replicas > 1
    single = next(s for s in _splits(64) if s.replicas == 1)
    assert busy.throughput(256) > single.throughput(256)


def test_fixed_replica_count_and_its_errors() -> None:
    got = _splits(16, replicas=3)
    assert {s.replicas for s in got} == {3} and [s.tp for s in got] == [1, 2, 4, 8]  # 3 x 24 > 24 cores
    with pytest.raises(ConfigError, match="24 NeuronCores, fewer than 25 replicas"):
        _splits(16, replicas=25)
    with pytest.raises(ConfigError, match="must be >= 1"):
        _splits(16, replicas=0)
    with pytest.raises(ConfigError, match="--target"):
        recommend_split(got, 256, "cost")


def test_plan_cli_prints_and_returns_the_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ["plan", "--model", str(tmp_path), "--instance", "inf2.48xlarge", "--concurrency", "64",
            "--input-len", "512", "--output-len", "256", "--target", "throughput"]
    assert main([*args, "--json"]) == 0
    dp = json.loads(capsys.readouterr().out)["data_parallel"]
    pick = recommend_split(_splits(64), 256, "throughput")
    assert dp["target"] == "throughput" and len(dp["splits"]) == len(INST.tp_degrees)
    assert (dp["recommended"]["tp"], dp["recommended"]["replicas"]) == (pick.tp, pick.replicas)
    assert dp["recommended"]["output_throughput"] == pytest.approx(pick.throughput(256))
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"recommended for throughput: tp {pick.tp} x {pick.replicas} replica(s)" in text
    assert f"serve ARTIFACT --data-parallel {pick.replicas}" in text and "for latency:" in text
    assert main(["plan", "--model", str(tmp_path), "--instance", "cpu", "--data-parallel", "2"]) == 2
    assert "--data-parallel" in capsys.readouterr().err
