"""The planner on mixture-of-experts models: exact memory (all experts resident), the bytes a decode step reads
(the selected experts below the gather batch, all local ones from it), the expert-parallel choice and the plan's
output. Published parameter counts: Mixtral-8x7B's safetensors index (total_size 93,405,585,408 bytes in bf16),
Qwen3-30B-A3B's model card (30.5 B, 3.3 B activated)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner.hardware import get_instance
from neuron_opt.planner.latency import decode_time
from neuron_opt.planner.memory import weight_bytes, weight_count
from neuron_opt.planner.moe import ep_choices, expert_step, gather_until
from neuron_opt.planner.recommend import HYBRID_MIN_GAIN, Deployment, Traffic, candidates, evaluate

CONFIGS = Path(__file__).resolve().parents[2] / "docs" / "configs"  # the published config.json files
MIXTRAL_8X7B = json.loads((CONFIGS / "mixtral-8x7b.json").read_text())
QWEN3_30B_A3B = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())


@pytest.mark.parametrize("hf, total, active", [(MIXTRAL_8X7B, 46_702_792_704, 12_879_925_248),
                                                (QWEN3_30B_A3B, 30_532_122_624, 3_353_032_704)])
def test_published_parameter_counts_and_resident_bytes(hf, total, active):
    cfg = ModelConfig.from_hf(hf)
    assert cfg.num_parameters() == total
    assert round(cfg.active_parameters() / 1e8) == round(active / 1e8)  # 12.9 B and 3.4 B (card: "3.3B")
    assert weight_bytes(cfg, head_layout(cfg, ParallelConfig()), "bfloat16") == 2 * total  # all experts resident


@pytest.mark.parametrize("tp, ep", [(8, 1), (8, 2), (8, 8), (24, 4)])
def test_per_rank_experts_split_the_model(tp, ep):
    """Every (tp, ep) holds the same expert bytes per rank, 1/tp of them (plus padding where tp / ep does not
    divide the expert width: 14336 / 6 -> 2390 features)."""
    cfg = ModelConfig.from_hf(MIXTRAL_8X7B)
    lay = head_layout(cfg, ParallelConfig(tp=tp, ep=ep))
    per_rank = weight_count(cfg, lay).experts
    exact = 32 * 8 * 3 * 4096 * 14336 // tp
    assert exact <= per_rank <= exact * 1.001
    assert lay.experts_local * ep == 8


def test_decode_reads_the_selected_experts_until_the_gather_batch():
    """Mixtral at tp 8: top 2 of 8 local experts. Batch 1-3 reads 2, 4, 6 experts per layer; from batch 4 all 8,
    and the TPOT memory term grows by exactly those bytes."""
    cfg = ModelConfig.from_hf(MIXTRAL_8X7B)
    lay = head_layout(cfg, ParallelConfig(tp=8))
    assert gather_until(cfg, lay) == 4
    per_expert = 3 * 4096 * lay.moe_intermediate_local * 32  # every layer
    reads = [expert_step(cfg, lay, b)[0] / per_expert for b in (1, 2, 3, 4, 16)]
    assert reads == [2, 4, 6, 8, 8]
    inst = get_instance("inf2.48xlarge")
    t1, t2 = (decode_time(cfg, lay, inst, batch=b, kv_len=128, dtype="bfloat16", kv_dtype="bfloat16")
              for b in (1, 2))
    kv_step = 2 * 32 * 128 * lay.n_kv_local * 128 * 2  # one more row's K and V
    bw = inst.hbm_bw_per_core * 0.6
    assert t2.memory - t1.memory == pytest.approx((2 * per_expert * 2 + kv_step) / bw, rel=1e-9)
    # prefill reads and computes every local expert
    assert expert_step(cfg, lay, 1, dense=True)[0] == 8 * per_expert


def test_automatic_ep_is_the_fastest_layout_hybrid_where_it_pays():
    """Qwen3-30B-A3B at tp 32, 512 in / 256 out: prefill is fastest at a wide ep (whole 384-feature experts fill
    TensorE tiles), decode at ep 1 (small batches gather fewer experts per rank). The automatic choice evaluates
    every (prefill ep, decode ep) and takes the hybrid, which beats every single layout by more than
    HYBRID_MIN_GAIN; it holds the experts twice."""
    cfg = ModelConfig.from_hf(QWEN3_30B_A3B)
    inst = get_instance("trn1.32xlarge")
    traffic = Traffic(512, 256, 8)
    dep = Deployment(32, 8, 512, 768)
    assert ep_choices(cfg, 32) == [1, 2, 4, 8, 16, 32]
    plans = {e: evaluate(cfg, inst, replace(dep, ep=e), traffic) for e in ep_choices(cfg, 32)}  # --ep E: uniform
    assert not any(p.layout.hybrid for p in plans.values())
    # wider expert slices cut prefill FLOPs (128-row TensorE tiles); small-batch decode reads more under ep
    assert plans[32].ttft.total < plans[1].ttft.total and plans[32].tpot.total > plans[1].tpot.total
    auto = evaluate(cfg, inst, dep, traffic)
    fastest_prefill = min((p.ttft.total, e) for e, p in plans.items())
    fastest_decode = min((p.tpot.total, e) for e, p in plans.items())
    assert (auto.layout.ep, auto.layout.decode_layout().ep) == (fastest_prefill[1], fastest_decode[1]) == (16, 1)
    assert auto.layout.hybrid and auto.ttft.total == fastest_prefill[0] and auto.tpot.total == fastest_decode[0]
    best_single = min(p.e2e_s(256) for p in plans.values())
    assert auto.e2e_s(256) < (1 - HYBRID_MIN_GAIN) * best_single
    # the second copy: exactly ep 1's experts on top of ep 16's
    assert weight_count(cfg, auto.layout).experts == \
        weight_count(cfg, plans[16].layout).experts + weight_count(cfg, plans[1].layout).experts
    assert auto.memory.weights > plans[16].memory.weights
    # a fixed decode degree: the prefill degree is still chosen; ep_decode equal to ep is one layout
    assert evaluate(cfg, inst, replace(dep, ep_decode=32), traffic).layout.ep == 16
    assert not evaluate(cfg, inst, replace(dep, ep=4, ep_decode=4), traffic).layout.hybrid
    long_prompts = Traffic(8192, 16, 1)
    dep_long = Deployment(32, 1, 8192, 8208)
    assert evaluate(cfg, inst, dep_long, long_prompts).layout.ep > 1  # prefill-dominated: ep wins


def test_hybrid_is_not_taken_where_it_buys_little():
    """Mixtral-8x7B on inf2.48xlarge at tp 24, 2048 in / 256 out: ep 4 and 8 prefill fastest, decode is within
    0.1% at every ep, so the single layout is kept (the hybrid would hold 93 GB of experts twice for nothing)."""
    cfg = ModelConfig.from_hf(MIXTRAL_8X7B)
    inst = get_instance("inf2.48xlarge")
    traffic = Traffic(2048, 256, 16)
    dep = Deployment(24, 16, 2048, 2304)
    auto = evaluate(cfg, inst, dep, traffic)
    assert not auto.layout.hybrid
    every = [evaluate(cfg, inst, replace(dep, ep=p, ep_decode=d), traffic)
             for p in ep_choices(cfg, 24) for d in ep_choices(cfg, 24)]
    assert min(p.e2e_s(256) for p in every) > (1 - HYBRID_MIN_GAIN) * auto.e2e_s(256)


def test_no_quantized_moe_plans():
    cfg = ModelConfig.from_hf(MIXTRAL_8X7B)
    inst = get_instance("inf2.48xlarge")
    plans = candidates(cfg, inst, Traffic(128, 128), batch=1, max_prompt_len=128, max_model_len=256)
    assert {p.deployment.dtype for p in plans} == {"bfloat16"}
    with pytest.raises(ConfigError, match="int8 weights are not built for mixture-of-experts models"):
        evaluate(cfg, inst, Deployment(8, 1, 128, 256, dtype="int8"))


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_opt.cli", "plan", "--model",
                           str(CONFIGS / "mixtral-8x7b.json"), *args], capture_output=True, text=True, timeout=120)


def test_plan_cli_prints_the_expert_layout_and_the_ep_table(capsys):
    from neuron_opt.cli import main

    out = _plan("--instance", "inf2.48xlarge", "--tp", "8", "--input-len", "2048", "--output-len", "64")
    assert out.returncode == 0, out.stderr
    assert "experts: 8 x 14336, top 2; ep " in out.stdout
    assert "active parameters 12.88 B of 46.70 B" in out.stdout
    assert "expert parallelism at tp 8" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:2].strip() in ("1", "2", "4", "8")
            and len(line.split()) == 7]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8]
    mixtral = ["plan", "--model", str(CONFIGS / "mixtral-8x7b.json"), "--instance", "inf2.48xlarge", "--tp", "8"]
    assert main([*mixtral, "--ep", "2", "--json"]) == 0  # in process from here (the entry point ran above)
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["ep"] == 2 and fixed["moe"]["experts_per_rank"] == 4
    assert main([*mixtral, "--ep", "3"]) == 2
    assert "ep: must be an integer >= 1 that divides tp=8" in capsys.readouterr().err


def test_plan_cli_hybrid_layout(capsys):
    """`plan` on Qwen3-30B-A3B picks and prints the hybrid layout, and its compile command carries it; --ep-decode
    overrides; a degree that does not divide the experts is refused with the degrees that do (in process: the
    test above runs the entry point)."""
    from neuron_opt.cli import main

    qwen = ["plan", "--model", str(CONFIGS / "qwen3-30b-a3b.json"), "--instance", "trn1.32xlarge"]
    assert main([*qwen, "--tp", "32", "--input-len", "512", "--output-len", "256", "--concurrency", "8"]) == 0
    out = capsys.readouterr().out
    assert "chosen: ep 16 for prefill, ep 1 for decode (hybrid: the experts held twice" in out
    assert "prefill ep 16 x moe tp 2: 8 experts x 384 features per rank; decode and verify ep 1 x moe tp 32" in out
    assert "compile --tp 32 --ep 16 --ep-decode 1 --batch-size 8" in out
    assert main([*qwen, "--tp", "32", "--ep", "4", "--ep-decode", "2", "--json"]) == 0
    forced = json.loads(capsys.readouterr().out)
    assert (forced["ep"], forced["ep_decode"]) == (4, 2)
    assert main([*qwen, "--tp", "32", "--ep", "4", "--json"]) == 0
    uniform = json.loads(capsys.readouterr().out)
    assert (uniform["ep"], uniform["ep_decode"]) == (4, 4)
    mixtral = ["plan", "--model", str(CONFIGS / "mixtral-8x7b.json"), "--instance", "inf2.48xlarge"]
    assert main([*mixtral, "--tp", "24", "--ep-decode", "3"]) == 2
    assert "ep_decode: 3 does not divide num_experts=8; use one of [1, 2, 4, 8]" in capsys.readouterr().err
