"""Real clients of vLLM-compatible servers, run as their docs say, against our server on a tiny model.

guidellm (the vLLM project's benchmarking tool) streams with `stream_options: {"include_usage": true,
"continuous_usage_stats": true}`, `ignore_eos`, `max_completion_tokens` / `max_tokens` and chat content as a list
of text parts; every one of its requests must succeed. It is an optional extra (`pip install -e .[clients]`), so
the test skips without it. guidellm runs as a subprocess: importing it would switch this process's asyncio event
loop policy to uvloop where uvloop is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import live_server

from neuron_opt.api import LLM

if importlib.util.find_spec("guidellm") is None:  # pytest.importorskip would import it (see above)
    pytest.skip("guidellm is not installed (pip install -e .[clients])", allow_module_level=True)


@pytest.fixture(scope="module")
def served(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tiny_dir("smollm-tok")
    with live_server(LLM(path, batch_size=2, max_model_len=256), max_num_seqs=2) as (url, _):
        yield url, path
    torch.set_num_threads(threads)


def _guidellm() -> list[str]:
    exe = Path(sys.executable).with_name("guidellm")
    return [str(exe)] if exe.exists() else [shutil.which("guidellm") or "guidellm"]


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_benchmark_every_request_succeeds(served, tmp_path, request_format):
    url, tokenizer_dir = served
    out = tmp_path / "benchmarks.json"
    cmd = [
        *_guidellm(), "run",
        "--backend", f"kind=openai_http,target={url},request_format={request_format}",
        "--profile", "kind=synchronous",
        "--constraint", "kind=max_requests,count=4",
        "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",  # synthetic prompts need a tokenizer
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    errors = [r["info"]["error"] for r in bench["requests"]["errored"]]
    assert bench["metrics"]["request_totals"] == {"successful": 4, "errored": 0, "incomplete": 0, "total": 4}, errors
    for r in bench["requests"]["successful"]:  # usage came back: 8 tokens each (ignore_eos), a 16-token prompt
        assert r["output_metrics"]["text_tokens"] == 8, r
        assert r["input_metrics"]["text_tokens"] >= 16, r
