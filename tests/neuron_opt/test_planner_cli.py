"""`neuron-opt plan` through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_opt.cli import main
from neuron_opt.planner.latency import HOST_SAMPLE_S_PER_LOGIT, LOGITS_D2H_BYTES_PER_S

LLAMA3_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return tmp_path / "config.json"


def test_json_with_tp(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "plan",
            "--model",
            str(config_path),
            "--instance",
            "inf2.48xlarge",
            "--tp",
            "8",
            "--batch-size",
            "4",
            "--input-len",
            "1024",
            "--output-len",
            "1024",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True and out["tp"] == 8 and out["batch_size"] == 4
    mem = out["memory_bytes"]
    norms = (2 * 32 + 1) * 4096  # RMSNorm weights are replicated; everything else splits exactly 8 ways
    assert mem["weights"] == 2 * (8_030_261_248 - norms) // 8 + 2 * norms
    # 4 sequences of 2048 in blocks of 32, plus the null block, x 16 KiB per token per rank
    assert mem["kv_cache"] == (4 * 2048 + 32) * 16 * 1024
    assert out["per_core_memory_gb"] == pytest.approx(mem["total"] / 1e9, abs=1e-3)
    assert out["per_core_capacity_gb"] == pytest.approx(16 * 2**30 / 1e9, abs=1e-3)
    assert 0 < out["tpot_ms"] < out["ttft_ms"]
    assert out["buckets"]["prefill_lens"][-1] == 1024 and out["buckets"]["decode_kv_lens"][-1] == 2048


def test_directory_and_recommendation(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", str(config_path.parent), "--instance", "inf2.xlarge", "--json"])
    out = json.loads(capsys.readouterr().out)
    # 8B bf16 needs 16 GB: only tp 2 fits on inf2.xlarge's two 16 GiB cores
    assert rc == 0 and out["tp"] == 2 and out["fits"]
    assert [a["tp"] for a in out["alternatives"]] == [1] and not out["alternatives"][0]["fits"]


def test_does_not_fit_exits_1(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--model",
        str(config_path),
        "--instance",
        "trn1.2xlarge",
        "--tp",
        "1",
        "--max-model-len",
        "8192",
        "--json",
    ]
    rc = main(args + ["--dtype", "bfloat16"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["fits"] is False and out["per_core_memory_gb"] > out["per_core_capacity_gb"]
    # without --dtype, a quantized dtype is proposed only because bfloat16 fits nowhere
    rc = main(args)
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] and out["dtype"] == "int8"


def test_bad_instance_and_tp_are_clear_errors(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", str(config_path), "--instance", "p5.48xlarge"]) == 2
    err = capsys.readouterr().err
    assert "unknown instance 'p5.48xlarge'" in err and "trn2.48xlarge" in err and "inf2.xlarge" in err
    assert main(["plan", "--model", str(config_path), "--instance", "inf2.48xlarge", "--tp", "16"]) == 2
    assert "allowed: 1, 2, 4, 8, 24" in capsys.readouterr().err


def test_text_output_lists_alternatives(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "--model", str(config_path), "--instance", "trn1.32xlarge", "--concurrency", "8"]) == 0
    )
    out = capsys.readouterr().out
    assert "fits" in out and "alternatives" in out and "TPOT" in out


def test_format_plan_table_for_compile() -> None:
    from neuron_opt.buckets import BucketConfig
    from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
    from neuron_opt.planner import format_plan_table

    cfg = ModelConfig.from_hf(LLAMA3_8B)
    cache = CacheConfig(max_batch=2, max_model_len=512, dtype="bfloat16")
    buckets = BucketConfig.build(max_prompt_len=256, max_model_len=512, max_batch=2)
    text = format_plan_table(cfg, ParallelConfig(tp=8), cache, buckets, "inf2.48xlarge")
    assert "tp 8" in text and "fits" in text
    offset = sum(b.tokens != b.kv_len for b in buckets.buckets() if b.phase == "prefill")
    assert offset == 3 and f"({len(buckets.buckets())} graphs, {offset} of them offset prefill)" in text
    cpu = format_plan_table(cfg, ParallelConfig(tp=1), cache, buckets, "cpu", dtype="float32")
    assert "per rank (host RAM shared by all ranks)" in cpu and "not modelled on cpu" in cpu
    assert f"{4 * 8_030_261_248 / 2**30:8.2f}" in cpu  # float32 weights, unsharded


def test_json_queue_percentiles(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json: ttft_ms / tpot_ms are the p50 under the arrivals (prompts together by default), with p99s; with
    --rate, seeded Poisson arrivals (the same output twice)."""
    base = ["plan", "--model", str(config_path), "--instance", "inf2.48xlarge", "--tp", "24", "--input-len", "1024",
            "--output-len", "128", "--json"]
    assert main([*base, "--concurrency", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["queue"]["arrival"] == "together" and out["queue"]["requests"] == 8
    # 8 prompts of 1024 with 2048 tokens per step: two prompts per step, so the 4th waits for the 3rd and 4th pair
    assert out["ttft_p99_ms"] > out["ttft_ms"] > 2 * out["step_ttft_ms"]
    assert main([*base, "--concurrency", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["ttft_ms"] == one["ttft_p99_ms"] == one["step_ttft_ms"]
    assert abs(one["tpot_ms"] - one["step_tpot_ms"]) <= 0.25 * one["step_tpot_ms"]
    # what sampling on the host would add to a decode step of batch 1: 128,256 fp32 logits out, sampled on the host
    per_logit = 4 / LOGITS_D2H_BYTES_PER_S + HOST_SAMPLE_S_PER_LOGIT
    assert one["host_sampling_ms"] == pytest.approx(1e3 * 128256 * per_logit, abs=0.01)
    assert main([*base, "--concurrency", "8", "--rate", "1.5"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main([*base, "--concurrency", "8", "--arrival", "poisson", "--rate", "1.5"]) == 0
    assert json.loads(capsys.readouterr().out) == a
    assert a["queue"]["arrival"] == "poisson" and a["queue"]["requests"] == 2000 and not a["queue"]["saturated"]


def test_bad_arrival_flags_are_usage_errors(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", str(config_path), "--instance", "inf2.48xlarge", "--tp", "24"]
    assert main([*base, "--arrival", "poisson"]) == 2
    assert "rate" in capsys.readouterr().err
    assert main([*base, "--arrival", "together", "--rate", "2"]) == 2
    assert "rate" in capsys.readouterr().err


def test_kv_per_token_and_where_a_context_fits(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-3-8B: 128 KiB of KV per token in bf16 (32 layers x K,V x 8 heads x 128 x 2 B), 16 KiB per rank at tp 8;
    its 8K context at batch 1 fits trn1.2xlarge at tp 2 and not tp 1 (AWS's sizing statement, docs/planner.md);
    every Neuron instance is listed."""
    argv = ["plan", "--model", str(config_path), "--instance", "inf2.48xlarge", "--tp", "8", "--input-len", "4096",
            "--output-len", "4096"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "KV per token: 128.0 KiB (32 layers x K,V x 8 kv heads x 128 x bfloat16); 16.0 KiB per rank at tp 8" in out
    assert "context 8192 tokens x batch 1 (bfloat16, KV bfloat16) fits:" in out
    assert "  trn1.2xlarge    tp 2\n" in out
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["kv_bytes_per_token"] == {"model": 131072, "rank": 16384}
    assert got["context_fits"]["trn1.2xlarge"] == 2 and set(got["context_fits"]) >= {"inf2.xlarge", "trn2.48xlarge"}


def test_cp_degree_with_whole_kv_heads_per_rank_says_when_it_pays(config_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-3-8B at tp 8 holds one KV head per rank: context-parallel prefill over all 8 ranks. Its per-layer
    all-gathers (K and V: 2 x 8 heads x 128 per token, the output: 4096 per token, the q/o weights: 2 x 4096 x
    4096 once) move fewer ring bytes than the all-reduce they replace (2 x 4096 per token) once
    7/8 x 33,554,432 < (2 x 7/8 x 4096 - 7/8 x 6144) x S, i.e. S > 16,384; never where each all-gather is an
    all-reduce of 8x its bytes."""
    args = ["plan", "--model", str(config_path), "--instance", "trn1.32xlarge", "--tp", "8", "--cp-degree", "8",
            "--batch-size", "1", "--input-len", "4096", "--output-len", "128"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "context-parallel prefill: cp_degree 8, each rank runs a prefill step's attention for 1/8" in out
    assert "from 16,385 tokens with true all-gathers; never on the neuron backend" in out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cp_degree"] == 8
    assert main([a if a != "8" or i != 8 else "4" for i, a in enumerate(args)]) != 0
    assert "cp_degree: with 8 KV heads at tp 8 every rank holds whole KV heads" in capsys.readouterr().err
