"""`scripts/bench_serve.py --scenario image` end to end on a tiny random Idefics3 checkpoint (--make-tiny-vlm): a
real `neuron-opt serve` subprocess gets base64 PNG images through the chat endpoint at two stream counts, HF
transformers' `generate` serves the same requests; the served greedy answers must be HF's (the scenario's own
check, whose oracle is HF), with the machine recorded, and the plot written."""

from __future__ import annotations

import json

import pytest

from neuron_opt.bench.serve.cli import main
from neuron_opt.bench.serve.image import greedy_check, image_requests


@pytest.mark.slow  # a real server, HF generate and rounds (the default suite's budget)
def test_image_scenario_serves_hf_greedy_answers_at_each_stream_count(tmp_path):
    out, png = tmp_path / "image.json", tmp_path / "image.png"
    rc = main(["--scenario", "image", "--make-tiny-vlm", str(tmp_path / "vlm"), "--num-prompts", "2",
               "--output-len", "3", "--concurrency", "1,2", "--hf-attn", "eager", "--out", str(out),
               "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 0
    rep = json.loads(out.read_text())
    assert rep["scenario"] == "image" and rep["served_fp32"] and rep["machine"]["cpu"]
    _, sizes, _ = image_requests(2, 0)
    assert [(r["width"], r["height"]) for r in rep["requests"]] == sizes
    assert [s["concurrency"] for s in rep["engine"]] == [1, 2]
    for s in rep["engine"]:
        assert (s["completed"], s["failed"], s["short"]) == (2, 0, 0), s["errors"]
        assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p50"] > 0 and s["speedup_vs_hf"] > 0
    assert rep["hf"]["completed"] == 2 and rep["hf"]["attn"] == "eager"
    check = rep["greedy_check"]
    assert any(check["hf_texts"]), "HF's answers are all empty: the check would compare nothing"
    assert all(check[c] == {"compared": 2, "mismatched": 0, "mismatched_indices": []} for c in ("1", "2")), check


def test_the_greedy_check_counts_a_wrong_or_failed_answer():
    from neuron_opt.checkpoint import open_checkpoint

    tok = open_checkpoint("default").tokenizer()
    ids = tok.encode("a red circle")
    got = greedy_check({1: [["a red circle", "a red circle"]], 8: [["a blue circle", None]]}, [ids, ids], tok)
    assert got["1"]["mismatched"] == 0
    assert got["8"] == {"compared": 2, "mismatched": 2, "mismatched_indices": [0, 1]}


@pytest.mark.parametrize("argv, message", [
    (["--scenario", "image"], "give --model"),
    (["--scenario", "load", "--make-tiny-vlm", "x"], "only with --scenario image"),
    (["--scenario", "image", "--model", "m", "--make-tiny-vlm", "x"], "not both"),
    (["--scenario", "image", "--model", "m", "--tiny-vlm-shape", "256m"], "only with --make-tiny-vlm"),
])
def test_image_scenario_arguments_are_checked_before_running(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
