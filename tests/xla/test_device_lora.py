"""Multi-LoRA on `--backend neuron` (torch-xla's CPU device): the adapter stacks as device state, the rows' slots as
a step input. Oracle: HF transformers + PEFT greedy tokens, adapters made with peft in the test (random A, non-zero
B, so each changes the text); torch-xla's own metrics count the compilations; the HLO XLA compiled for each bucket
(kept in the artifact) shows the stacks as parameters and no all-reduce beyond the base model's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import load_hf, make_tiny

pytestmark = pytest.mark.xla
peft = pytest.importorskip("peft")
from peft_adapters import hf_greedy, make_adapter  # noqa: E402

HERE = Path(__file__).parent
sys.path.append(str(HERE))
import device_lora  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (GQA) with three adapters: every projection at rank 8, attention only at rank 4, the MLP
    only (a regex) at rank 2; the PEFT greedy tokens of each prompt under each (None: the base model)."""
    root = tmp_path_factory.mktemp("lora-llama")
    base = make_tiny("llama-gqa2", root / "base", tokenizer=True)
    adapters = [make_adapter(base, root / "all8", 8, 16, TARGETS, 1),
                make_adapter(base, root / "attn4", 4, 8, TARGETS[:4], 2),
                make_adapter(base, root / "mlp2", 2, 4, r".*\.mlp\.(gate|up|down)_proj", 3)]
    n = device_lora.MAX_TOKENS
    refs = {None: [hf_greedy(load_hf(base).eval(), p, n) for p in device_lora.PROMPTS]}
    for i, path in enumerate(adapters):
        pm = peft.PeftModel.from_pretrained(load_hf(base), path).eval()
        refs[f"a{i}"] = [hf_greedy(pm, p, n) for p in device_lora.PROMPTS]
    for i in range(len(adapters)):
        assert refs[f"a{i}"] != refs[None]  # each adapter changes the text: the tests below can fail
    return base, adapters, refs


def check(res: dict, refs: dict, tp: int) -> None:
    for run in res["tokens"]:
        for row, (name, toks) in enumerate(run):
            assert toks == refs[name][row], (name, row, run)
    assert res["new_uncached"] == 0  # adapter loads and evictions compile nothing
    if tp == 1:  # traced SPMD steps (tp > 1) time each cache lookup as a compile too: only the count above tells
        assert res["new_compiles"] == 0
    assert res["loads"] == 4 and res["evictions"] == 2
    assert res["lora"] == {"max_loras": 2, "max_lora_rank": 8, "target_modules": TARGETS}


@pytest.fixture(scope="module")
def tp1(llama, tmp_path_factory):
    """The tp=1 run of device_lora.py in this process, and its artifact."""
    base, adapters, _ = llama
    art = tmp_path_factory.mktemp("lora-art") / "art"
    return device_lora.main(base, art, 1, adapters), art


def test_tp1_mixed_batch_equals_peft_and_slot_writes_compile_nothing(llama, tp1):
    base, _, refs = llama
    res, _ = tp1
    check(res, refs, 1)
    cfg = json.loads((base / "config.json").read_text())
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    for key, facts in res["hlo"].items():
        assert facts["donated"] == 2 * L, key  # the KV caches only: the stacks are read, never written by a step
        assert not facts["host_ops"] and not facts["dynamic_shapes"], key
        # the stacks are parameters (A of q_proj: [N + 1, R, H]), not constants folded into the graph
        assert f"f32[3,8,{H}]" in res["headers"][key], key


def test_serve_on_a_neuron_lora_artifact_selects_adapters_by_model(llama, tp1):
    """`serve`'s engine and routes over the device artifact: adapters registered as --lora-modules does and
    through POST /v1/load_lora_adapter, picked by `model` with the official openai client."""
    import httpx
    import openai
    from helpers import live_server

    from neuron_opt.api import LLM
    from neuron_opt.lora.registry import LoRARequest
    from neuron_opt.runtime.sampling import SamplingParams
    from neuron_opt.server.limits import LoraRuntimeLoading

    _, adapters, refs = llama
    llm = LLM(tp1[1])
    greedy = SamplingParams(max_tokens=device_lora.MAX_TOKENS, ignore_eos=True)
    prompt = device_lora.PROMPTS[0]
    want = {}
    for name, req in (("tiny", None), ("a0", LoRARequest("a0", str(adapters[0]))),
                      ("a2", LoRARequest("a2", str(adapters[2])))):
        out = llm.generate_ids(prompt, greedy, req)
        assert out.token_ids == refs[None if req is None else name][0], name
        want[name] = out.text
    runtime = LoraRuntimeLoading(Path(adapters[0]).parent)  # runtime loading on, from the adapters' directory
    with live_server(llm, 4, lora_runtime=runtime) as (url, engine):  # the engine's registry over the device stacks
        engine.loras.register("a2", adapters[2])  # as `serve --lora-modules a2=...` does
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a0", "lora_path": str(adapters[0])})
        assert r.status_code == 200, r.text
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "a2", "a0"]
        for name in ("a0", "tiny", "a2"):
            got = client.completions.create(model=name, prompt=prompt, max_tokens=device_lora.MAX_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True}).choices[0].text
            assert got == want[name], name


def test_tp2_one_spmd_program_serves_adapters_like_peft(llama, tmp_path):
    """tp=2: A/B sharded like their base layers; the row-parallel adapter terms join the base layer's all-reduce
    (no all-reduce of their own)."""
    base, adapters, refs = llama
    out = subprocess.run([sys.executable, str(HERE / "device_lora.py"), str(base), str(tmp_path / "art"), "2",
                          *map(str, adapters)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    check(res, refs, 2)
    assert res["stack_shardings"] == ["{devices=[2,1,1,1]0,1}"]  # rank r's shard on device r, after every write
    L = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    for key, facts in res["hlo"].items():
        assert facts["collectives"] == {"all-reduce": 2 * L + 1}, key
        assert facts["donated"] == 2 * L, key  # the KV caches
