"""`plan --speculative-method`: the verify step, the proposer's cost and the predicted TPOT (planner/speculative.py).

Oracles: the decode step of the plan itself (a verify step of one token a row is that step, bit for bit), the
tensors of an EAGLE-3 head saved by the `speculators` package (the bytes the planner says a head reads are the
bytes of its weights), a draft model's own plan, and arithmetic identities of the prediction (speedup 1 at the
break-even acceptance length)."""

from __future__ import annotations

import json
import re

import pytest
from safetensors import safe_open

from neuron_opt.cli import main
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner.hardware import get_instance
from neuron_opt.planner.latency import decode_time
from neuron_opt.planner.memory import weight_bytes
from neuron_opt.planner.recommend import Deployment, Traffic, evaluate
from neuron_opt.planner.speculative import Proposer, acceptance_from_bench, draft_time, eagle3_like, predict

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
             max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)


def _plan(cfg: ModelConfig, tp: int = 2, batch: int = 1):
    return evaluate(cfg, get_instance("trn1.32xlarge"), Deployment(tp=tp, batch=batch, max_prompt_len=512,
                                                                   max_model_len=1024), Traffic(512, 256, batch))


def test_a_verify_step_of_one_token_is_the_decode_step_and_more_tokens_cost_compute_not_weights():
    cfg = ModelConfig.from_hf(LLAMA)
    lay = head_layout(cfg, ParallelConfig(tp=2))
    inst = get_instance("trn1.32xlarge")
    kw = dict(batch=4, kv_len=1024, dtype="bfloat16", kv_dtype="bfloat16")
    one = decode_time(cfg, lay, inst, **kw)
    assert decode_time(cfg, lay, inst, tokens_per_row=1, **kw) == one
    five = decode_time(cfg, lay, inst, tokens_per_row=5, **kw)
    assert five.memory == one.memory and five.overhead == one.overhead
    assert five.compute > 4.9 * one.compute - 1e-12 and five.collective > one.collective


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_the_prediction_is_the_step_over_the_acceptance_length(method):
    cfg = ModelConfig.from_hf(LLAMA)
    plan = _plan(cfg)
    draft = ModelConfig.from_hf(dict(LLAMA, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2))
    p = {"ngram": Proposer("ngram", 4), "draft_model": Proposer("draft_model", 4, draft),
         "eagle3": eagle3_like(cfg, 4)}[method]
    s = predict(cfg, plan, p, 2.5)
    assert s.decode == plan.tpot
    assert s.tpot_s == pytest.approx((s.verify.total + s.draft_s) / 2.5)
    assert predict(cfg, plan, p, s.break_even).speedup == pytest.approx(1.0)
    if method == "ngram":
        assert s.draft_s == 0 and s.fused() is None
    if method == "draft_model":  # k decode steps of the draft at the target's tp and bucket
        dec = plan.decode_bucket
        one = decode_time(draft, head_layout(draft, ParallelConfig(tp=2)), plan.instance, batch=dec.batch,
                          kv_len=dec.kv_len, dtype="bfloat16", kv_dtype="bfloat16")
        assert s.draft_s == pytest.approx(4 * one.total)
    if method == "eagle3":  # fusing the chain saves k - 1 graph executions' fixed cost, nothing else
        fused = s.fused()
        assert fused is not None and fused.speedup > s.speedup
        assert s.draft_s - fused.draft_s == pytest.approx(3 * plan.tpot.overhead)


def test_an_eagle3_head_reads_the_bytes_of_its_weights(tmp_path):
    """The head's weights as the `speculators` package saves them (its layer, fc, LM head; the norms are negligible
    and the embedding is a row lookup): the planner's bytes per rank at tp 1 equal theirs."""
    pytest.importorskip("speculators")
    from speculators import Eagle3DraftModel, Eagle3SpeculatorConfig, SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    from neuron_opt.checkpoint.eagle3 import read_head_config

    lc = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512)
    Eagle3DraftModel(Eagle3SpeculatorConfig(
        transformer_layer_config=lc, draft_vocab_size=100, eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))).save_pretrained(
        str(tmp_path))
    head = read_head_config(tmp_path, load=False)[0]
    assert head == read_head_config(tmp_path)[0]  # names from the headers: the same config as loading
    p = Proposer("eagle3", 3, head.layer, head.draft_vocab_size, 3 * head.aux_hidden_size)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        read = sum(f.get_slice(n).get_shape()[0] * f.get_slice(n).get_shape()[1] for n in f.keys()
                   if n.endswith("weight") and "norm" not in n and "embed" not in n)
    assert p.weight_bytes("bfloat16", tp=1) == 2 * read


def test_the_cli_predicts_from_a_number_and_from_a_benchmark_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"results": [
        {"workload": "grounded", "mode": "spec-always", "k": 4, "mean_accepted_length": 3.5},
        {"workload": "open-ended", "mode": "spec-always", "k": 4, "mean_accepted_length": 1.5},
        {"workload": "grounded", "mode": "spec-adaptive", "k": 4, "mean_accepted_length": 4.5},
        {"workload": "grounded", "mode": "plain", "k": 4, "mean_accepted_length": None}]}))
    base = ["plan", "--model", str(tmp_path / "config.json"), "--instance", "trn1.32xlarge", "--tp", "2", "--json"]
    assert main([*base, "--speculative-method", "ngram", "--num-speculative-tokens", "4",
                 "--acceptance-length", str(bench)]) == 0
    out = json.loads(capsys.readouterr().out)["speculative"]
    assert [(r["source"], r["acceptance_length"]) for r in out["predictions"]] == [("grounded", 3.5),
                                                                                   ("open-ended", 1.5)]
    assert out["predictions"][0]["speedup"] > out["predictions"][1]["speedup"] > 1
    assert main([*base[:-1], "--speculative-method", "eagle3", "--num-speculative-tokens", "3",
                 "--acceptance-length", "2.4"]) == 0
    text = capsys.readouterr().out
    assert "speculative decoding: eagle3, k 3" in text and "2.40 (given)" in text and "fused into one graph" in text


@pytest.mark.parametrize("flags, words", [
    (["--speculative-method", "ngram", "--num-speculative-tokens", "4", "--acceptance-length", "6"],
     r"outside \[1, k \+ 1\]"),
    (["--speculative-method", "ngram", "--acceptance-length", "2"], "needs --num-speculative-tokens"),
    (["--num-speculative-tokens", "4"], "needs --speculative-method"),
    (["--speculative-method", "draft_model", "--num-speculative-tokens", "4", "--acceptance-length", "2"],
     "needs --speculative-model"),
    (["--speculative-method", "eagle3", "--num-speculative-tokens", "4", "--acceptance-length", "nope"],
     "neither a number nor a benchmark JSON"),
])
def test_bad_speculative_flags_are_refused_naming_the_flag(tmp_path, capsys, flags, words):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--instance", "trn1.32xlarge", *flags]) == 2
    assert re.search(words, capsys.readouterr().err)


def test_a_benchmark_json_without_the_method_at_k_names_what_it_has():
    data = {"results": [{"mode": "spec-always", "k": 8, "mean_accepted_length": 2.0}]}
    with pytest.raises(ConfigError, match=r"no row of mode eagle3-always at k 8.*\('spec-always', 8\)"):
        acceptance_from_bench(data, "eagle3", 8, "b.json")
    with pytest.raises(ConfigError, match="not a benchmark JSON"):
        acceptance_from_bench([1, 2], "eagle3", 8, "b.json")


def test_cpu_plans_refuse_a_speculative_prediction(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--instance", "cpu", "--speculative-method",
                 "ngram", "--num-speculative-tokens", "2", "--acceptance-length", "2"]) == 2
    assert "modelled on Neuron instances" in capsys.readouterr().err


def test_draft_time_grows_with_k_and_a_draft_holds_its_weights():
    cfg = ModelConfig.from_hf(LLAMA)
    inst = get_instance("inf2.48xlarge")
    kw = dict(tp=8, batch=1, kv_len=1024, dtype="bfloat16", kv_dtype="bfloat16")
    e2, e4 = (draft_time(eagle3_like(cfg, k), inst, **kw) for k in (2, 4))
    assert e4 > e2 > 0
    d = Proposer("draft_model", 2, cfg)
    assert d.weight_bytes("bfloat16", 8) == weight_bytes(cfg, head_layout(cfg, ParallelConfig(tp=8)), "bfloat16")
