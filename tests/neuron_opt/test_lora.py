"""Multi-LoRA serving against HF transformers + PEFT: adapters made with peft in the test (random A, non-zero B,
so each changes the greedy text), run in one mixed batch together with base-model rows (eager, tp=2 ranks, cpu
graphs); bad adapters refused with the field named; slot eviction; prefix-cache isolation between adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import load_hf, make_tiny

from neuron_opt.api import LLM
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.lora.adapter import read_adapter
from neuron_opt.lora.config import LoraConfig
from neuron_opt.lora.registry import LoRARequest
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.server.limits import LoraRuntimeLoading

peft = pytest.importorskip("peft")
from peft_adapters import hf_greedy, make_adapter  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2, 44, 71, 8], [17, 3, 99, 120, 6], [30, 31, 32, 33, 34, 35, 36, 37, 38], [250, 11, 7]]


def peft_model(base: Path, adapter: Path):
    return peft.PeftModel.from_pretrained(load_hf(base), adapter).eval()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) with a tokenizer, and three adapters: all projections at rank 8, attention only
    at rank 4 with rsLoRA, MLP only (by regex) at rank 2."""
    root = tmp_path_factory.mktemp("lora-qwen")
    base = make_tiny("qwen2", root / "base", tokenizer=True)
    adapters = {
        "all8": make_adapter(base, root / "all8", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], 1),
        "attn4": make_adapter(base, root / "attn4", 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], 2, rslora=True),
        "mlp2": make_adapter(base, root / "mlp2", 2, 4, r".*\.mlp\.(gate|up|down)_proj", 3),
    }
    refs = {None: [hf_greedy(load_hf(base).eval(), p, GREEDY.max_tokens) for p in PROMPTS]}
    for name, path in adapters.items():
        pm = peft_model(base, path)
        refs[name] = [hf_greedy(pm, p, GREEDY.max_tokens) for p in PROMPTS]
    return base, adapters, refs


def _mixed(adapters: dict[str, Path]) -> list[str | None]:
    return ["all8", None, "attn4", "mlp2"]


def _check_mixed(llm: LLM, adapters: dict[str, Path], refs: dict) -> None:
    names = _mixed(adapters)
    reqs = [LoRARequest(n, str(adapters[n])) if n else None for n in names]
    outs = llm.generate_batch(PROMPTS, GREEDY, lora_request=reqs)
    for i, (name, out) in enumerate(zip(names, outs, strict=True)):
        assert out.token_ids == refs[name][i], (name, i)


def test_adapters_change_the_greedy_text(qwen):
    _, _, refs = qwen
    for name in ("all8", "attn4", "mlp2"):
        assert refs[name] != refs[None], name  # otherwise the oracle test below could not fail


def test_merged_model_agrees_with_peft(qwen):
    """The oracle's own check: PEFT's unmerged forward and its merged weights give the same greedy tokens."""
    base, adapters, refs = qwen
    merged = peft_model(base, adapters["all8"]).merge_and_unload()
    assert [hf_greedy(merged, p, GREEDY.max_tokens) for p in PROMPTS] == refs["all8"]


def test_mixed_batch_equals_peft_eager(qwen):
    base, adapters, refs = qwen
    llm = LLM(base, batch_size=4, max_model_len=64, lora=LoraConfig(max_loras=3, max_lora_rank=8))
    _check_mixed(llm, adapters, refs)
    # and each row alone gives the same tokens as in the mixed batch
    assert llm.generate_ids(PROMPTS[0], GREEDY, LoRARequest("all8", str(adapters["all8"]))).token_ids == \
        refs["all8"][0]


def test_mixed_batch_equals_peft_on_tp2_ranks(qwen):
    base, adapters, refs = qwen
    llm = LLM(base, batch_size=4, max_model_len=64, parallel=ParallelConfig(tp=2),
              lora=LoraConfig(max_loras=3, max_lora_rank=8))
    try:
        _check_mixed(llm, adapters, refs)
    finally:
        llm.runner.executor.close()


@pytest.mark.slow
def test_mixed_batch_equals_peft_on_cpu_graphs(qwen, tmp_path):
    """The cpu backend's compiled layer graphs take the stacks and slots as inputs; the manifest records the
    capacity, and the loaded artifact serves every adapter with no recompile."""
    from neuron_opt.artifact import read_verified
    from neuron_opt.compiler import CompileRequest, compile_artifact

    base, adapters, refs = qwen
    req = CompileRequest(model=str(base), out=tmp_path / "art", backend="cpu", dtype="float32", batch_size=4,
                         max_model_len=64, prefill_buckets=(16,), decode_buckets=(64,), decode_batches=(4,),
                         offset_prefill=False, use_cache=False, lora=LoraConfig(max_loras=3, max_lora_rank=8))
    compile_artifact(req, log=lambda s: None, progress=False)
    assert read_verified(tmp_path / "art").manifest.lora == LoraConfig(3, 8)
    llm = LLM(tmp_path / "art")
    _check_mixed(llm, adapters, refs)
    with pytest.raises(ConfigError, match="lora: this artifact was compiled with"):
        LLM(tmp_path / "art", lora=LoraConfig(3, 16))


def test_head_padding_tp2_smollm_shape(tmp_path):
    """9 query / 3 KV heads at tp=2: query heads padded with zero heads, KV heads expanded (mha): the adapter's B
    rows are picked head by head, the padding heads' rows zero."""
    base = make_tiny("smollm-tok-1layer", tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "a", 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], 5)
    ref = hf_greedy(peft_model(base, adapter), PROMPTS[0], GREEDY.max_tokens)
    llm = LLM(base, batch_size=2, max_model_len=64, parallel=ParallelConfig(tp=2),
              lora=LoraConfig(max_loras=1, max_lora_rank=4))
    try:
        outs = llm.generate_batch(PROMPTS[:2], GREEDY, lora_request=[LoRARequest("a", str(adapter)), None])
        assert outs[0].token_ids == ref
        assert outs[1].token_ids == hf_greedy(load_hf(base).eval(), PROMPTS[1], GREEDY.max_tokens)
    finally:
        llm.runner.executor.close()


def test_more_adapters_than_slots_evicts_least_recently_used(qwen):
    """One slot, three adapters and the base in one call: rows under another adapter wait until the slot's
    sequence finishes, and every row still equals PEFT."""
    base, adapters, refs = qwen
    llm = LLM(base, batch_size=4, max_model_len=64, lora=LoraConfig(max_loras=1, max_lora_rank=8))
    _check_mixed(llm, adapters, refs)
    assert llm.loras.stats.loads == 3 and llm.loras.stats.evictions == 2
    assert llm.loras.num_resident == 1
    # the resident adapter is reused without a load
    llm.generate_ids(PROMPTS[3], GREEDY, LoRARequest("mlp2", str(adapters["mlp2"])))
    assert llm.loras.stats.loads == 3


def test_slot_manager_never_evicts_a_slot_in_use(qwen):
    base, adapters, _ = qwen
    llm = LLM(base, max_model_len=64, lora=LoraConfig(max_loras=2, max_lora_rank=8))
    m = llm.loras
    for name in ("all8", "attn4", "mlp2"):
        m.register(name, adapters[name])
    a, b = m.acquire("all8"), m.acquire("attn4")
    assert {a, b} == {1, 2}
    assert m.acquire("mlp2") is None  # both slots run sequences
    m.release(a)
    assert m.acquire("mlp2") == a  # the free one, all8's
    assert m.acquire("attn4") == b  # still resident
    with pytest.raises(ConfigError, match="already loaded"):
        m.register("mlp2", adapters["mlp2"])
    m.begin_request("attn4")
    with pytest.raises(ConfigError, match="in use"):
        m.unregister("attn4")


def test_prefix_cache_is_keyed_by_adapter(qwen):
    """The same 40-token prompt under the base, adapter A, A again, and B: only A's second run finds cached
    blocks, and every output equals PEFT's."""
    from neuron_opt.runtime.engine import Engine

    base, adapters, _ = qwen
    llm = LLM(base, batch_size=4, max_model_len=64, lora=LoraConfig(max_loras=2, max_lora_rank=8))
    llm.add_lora(LoRARequest("all8", str(adapters["all8"])))
    llm.add_lora(LoRARequest("attn4", str(adapters["attn4"])))
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, loras=llm.loras, enable_prefix_caching=True)
    prompt = [(7 * i + 3) % 250 + 3 for i in range(40)]
    refs = {None: hf_greedy(load_hf(base).eval(), prompt, 4)}
    for name in ("all8", "attn4"):
        refs[name] = hf_greedy(peft_model(base, adapters[name]), prompt, 4)
    hits = []
    for i, name in enumerate([None, "all8", "all8", "attn4", None]):
        before = engine.prefix_cache_stats.hits
        out: list = []
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, ignore_eos=True), out.append, lora=name)
        while engine.num_unfinished:
            engine.step()
        assert [t for o in out for t in o.new_token_ids] == refs[name], name
        hits.append(engine.prefix_cache_stats.hits - before)
    assert hits[0] == 0 and hits[1] == 0 and hits[2] > 0 and hits[3] == 0 and hits[4] > 0


def test_unknown_adapter_is_refused_at_add_request(qwen):
    from neuron_opt.runtime.engine import Engine

    base, _, _ = qwen
    llm = LLM(base, max_model_len=64, lora=LoraConfig(max_loras=1, max_lora_rank=8))
    engine = Engine(llm.runner, llm.tokenizer, llm.eos_token_ids, loras=llm.loras)
    with pytest.raises(ConfigError, match="no adapter named 'nope'"):
        engine.add_request("0", [1, 2, 3], GREEDY, lambda o: None, lora="nope")
    assert engine.num_unfinished == 0


# ---- bad adapters ------------------------------------------------------------------------------------------


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    conf = json.loads((dst / "adapter_config.json").read_text())
    conf.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    return dst


@pytest.mark.parametrize("changes, match", [
    (dict(bias="all"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(use_dora=True), "use_dora"),
    (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
    (dict(peft_type="IA3"), "peft_type"),
    (dict(r="8"), "r: must be a positive integer"),
    (dict(lora_alpha=None), "lora_alpha"),
    (dict(target_modules=["q_proj"]), "target_modules"),  # the file holds more modules than the config names
])
def test_bad_adapter_configs_are_refused_naming_the_field(qwen, tmp_path, changes, match):
    base, adapters, _ = qwen
    bad = _edit_config(adapters["all8"], tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=match):
        read_adapter(bad, ModelConfig.from_hf(base), LoraConfig(2, 8))


def test_rank_above_the_compiled_maximum_is_refused(qwen):
    base, adapters, _ = qwen
    with pytest.raises(ConfigError, match="rank 8 exceeds .*--max-lora-rank 4"):
        read_adapter(adapters["all8"], ModelConfig.from_hf(base), LoraConfig(2, 4))


def test_target_module_not_compiled_is_refused(qwen):
    base, adapters, _ = qwen
    lc = LoraConfig(2, 8, ("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match="targets k_proj, which this artifact was not compiled for"):
        read_adapter(adapters["attn4"], ModelConfig.from_hf(base), lc)


def test_adapter_of_another_base_shape_is_refused(qwen, tmp_path):
    base, _, _ = qwen
    other = make_tiny("llama-mqa", tmp_path / "other")  # one KV head: k/v projections of another width
    adapter = make_adapter(other, tmp_path / "a", 4, 8, ["k_proj"], 0)
    with pytest.raises(ConfigError, match=r"shape \[16, 4\].*needs \[32, 4\]"):
        read_adapter(adapter, ModelConfig.from_hf(base), LoraConfig(2, 8))


def test_missing_or_pickled_weights_are_refused(qwen, tmp_path):
    base, adapters, _ = qwen
    cfg = ModelConfig.from_hf(base)
    bad = _edit_config(adapters["all8"], tmp_path / "bad")
    (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    with pytest.raises(ConfigError, match="adapter_model.bin is a pickle"):
        read_adapter(bad, cfg, LoraConfig(2, 8))
    with pytest.raises(ConfigError, match="not a directory"):
        read_adapter(tmp_path / "nowhere", cfg, LoraConfig(2, 8))


def test_a_bad_adapter_leaves_nothing_registered(qwen, tmp_path):
    base, adapters, _ = qwen
    llm = LLM(base, max_model_len=64, lora=LoraConfig(max_loras=1, max_lora_rank=4))
    with pytest.raises(ConfigError, match="exceeds"):
        llm.add_lora(LoRARequest("big", str(adapters["all8"])))
    assert llm.loras.names() == [] and llm.loras.num_resident == 0


def test_lora_config_is_validated():
    with pytest.raises(ConfigError, match="max_loras"):
        LoraConfig(0, 8)
    with pytest.raises(ConfigError, match="max_lora_rank"):
        LoraConfig(1, 0)
    with pytest.raises(ConfigError, match="lora_target_modules"):
        LoraConfig(1, 8, ("q_proj", "lm_head"))


def test_a_model_without_lora_refuses_adapters(qwen):
    base, adapters, _ = qwen
    llm = LLM(base, max_model_len=64)
    with pytest.raises(ConfigError, match="takes no LoRA adapters"):
        llm.generate_ids(PROMPTS[0], GREEDY, LoRARequest("a", str(adapters["all8"])))


# ---- server ------------------------------------------------------------------------------------------------


def test_openai_client_selects_adapters_by_model_and_loads_at_run_time(qwen, tmp_path):
    import httpx
    import openai
    from helpers import live_server

    base, adapters, _ = qwen
    llm = LLM(base, batch_size=4, max_model_len=64, lora=LoraConfig(max_loras=1, max_lora_rank=8))
    want = {n: llm.generate_ids(PROMPTS[0], GREEDY, LoRARequest(n, str(adapters[n])) if n else None).text
            for n in (None, "all8", "mlp2")}
    assert len(set(want.values())) == 3
    root = adapters["all8"].parent  # runtime loading reads only under it
    bad = _edit_config(adapters["all8"], root / "bad-bias", bias="all")
    with live_server(llm, 4) as (url, engine):  # runtime loading off (the default): both routes are 404
        for route in ("load", "unload"):
            r = httpx.post(url + f"/v1/{route}_lora_adapter", json={"lora_name": "all8", "lora_path": "all8"})
            assert r.status_code == 404 and "--enable-lora-runtime-loading" in r.json()["error"]["message"], r.text
    with live_server(llm, 4, lora_runtime=LoraRuntimeLoading(root, max_cpu_loras=2)) as (url, engine):
        engine.loras.register("mlp2", adapters["mlp2"])  # as `serve --lora-modules mlp2=...` does
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "mlp2"]
        outside = [tmp_path, tmp_path / "no-such-dir", root / ".." / "elsewhere", "/etc", "../../../../etc/passwd"]
        answers = {httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(p)}).text
                   for p in outside}  # one answer, whether or not the path exists: nothing learnt outside the root
        assert len(answers) == 1 and "under the server's --lora-runtime-root" in answers.pop()
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(bad)})
        assert r.status_code == 400 and "bias" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "all8", "lora_path": "all8"})
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "attn4", "lora_path": str(adapters["attn4"])})
        assert r.status_code == 400 and "--max-cpu-loras" in r.json()["error"]["message"], r.text

        cards = client.models.list().data
        assert [m.id for m in cards] == ["tiny", "mlp2", "all8"]
        assert cards[2].model_dump()["parent"] == "tiny"

        def text(model: str) -> str:
            return client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        assert text("all8") == want["all8"]  # one slot: the two adapters take turns in it
        assert text("mlp2") == want["mlp2"]
        assert text("tiny") == want[None]
        with pytest.raises(openai.NotFoundError):
            text("broken")
        metrics = httpx.get(url + "/metrics").text
        assert 'neuron_opt:lora_requests_total{lora_name="all8",model_name="tiny"} 1.0' in metrics
        assert "neuron_opt:lora_adapters_loaded" in metrics
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "all8"})
        assert r.status_code == 200
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "all8"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            text("all8")


def test_vllm_lora_requests_info_names_running_and_waiting_adapters(qwen):
    """vLLM's `vllm:lora_requests_info` on a served model with one adapter slot: while a request under all8 runs, one
    under mlp2 waits for the slot (running_lora_adapters="all8", waiting_lora_adapters="mlp2", max_lora="1", the
    value the current time); idle, both are empty."""
    import re
    import threading
    import time

    import httpx
    from helpers import live_server

    base, adapters, _ = qwen
    llm = LLM(base, batch_size=4, max_model_len=256, lora=LoraConfig(max_loras=1, max_lora_rank=8))

    def info(url: str) -> tuple[dict[str, str], float]:
        (labels, value), = re.findall(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", httpx.get(url + "/metrics").text,
                                      re.M)
        return dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)

    with live_server(llm, 4) as (url, engine):
        for name in ("all8", "mlp2"):
            engine.loras.register(name, adapters[name])
        idle = {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        labels, value = info(url)
        assert labels == idle and abs(value - time.time()) < 60

        def complete(model: str, n: int) -> None:
            httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": n,
                                                      "ignore_eos": True}, timeout=120)

        long = threading.Thread(target=complete, args=("all8", 240))
        long.start()
        while engine.num_running == 0 and long.is_alive():
            time.sleep(0.005)
        short = threading.Thread(target=complete, args=("mlp2", 4))
        short.start()
        seen = []
        while long.is_alive():
            seen.append(info(url)[0])
        long.join()
        short.join()
        assert {"max_lora": "1", "running_lora_adapters": "all8", "waiting_lora_adapters": "mlp2"} in seen, seen
        assert info(url)[0] == idle


def test_lora_flags():
    import argparse

    from neuron_opt.commands.lora_flags import add_compile_flags, lora_config_from_args, parse_lora_modules

    p = argparse.ArgumentParser()
    add_compile_flags(p)
    assert lora_config_from_args(p.parse_args([])) is None
    assert lora_config_from_args(p.parse_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
                                               "--lora-target-modules", "v_proj", "q_proj"])) == \
        LoraConfig(4, 32, ("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match="--max-loras: needs --enable-lora"):
        lora_config_from_args(p.parse_args(["--max-loras", "2"]))
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    with pytest.raises(ConfigError, match="expected name=path"):
        parse_lora_modules(["a"])


# ---- per-module ranks and alphas, quantized bases, speculative decoding -------------------------------------


def test_rank_and_alpha_patterns_equal_peft(qwen, tmp_path):
    """PEFT's rank_pattern / alpha_pattern (by module name, and by one layer's module as a regex): each module's own
    rank zero-padded to the compiled rank, its own alpha in its scale; greedy tokens equal PEFT's."""
    base, _, refs = qwen
    adapter = make_adapter(base, tmp_path / "pat", 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"], 7,
                           rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.down_proj": 6},
                           alpha_pattern={"v_proj": 3.0, "gate_proj": 32})
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["rank_pattern"] and conf["alpha_pattern"]  # PEFT saved them: the oracle runs them
    pm = peft_model(base, adapter)
    refs_pat = [hf_greedy(pm, p, GREEDY.max_tokens) for p in PROMPTS[:2]]
    assert refs_pat[0] != refs[None][0]
    a = read_adapter(adapter, ModelConfig.from_hf(base), LoraConfig(1, 8))
    assert a.rank == 6 and a.weights[(0, "q_proj")][0].shape[0] == 2 and a.weights[(1, "down_proj")][0].shape[0] == 6
    assert a.weights[(0, "down_proj")][0].shape[0] == 4
    llm = LLM(base, batch_size=2, max_model_len=64, lora=LoraConfig(max_loras=1, max_lora_rank=8))
    outs = llm.generate_batch(PROMPTS[:2], GREEDY, lora_request=LoRARequest("pat", str(adapter)))
    assert [o.token_ids for o in outs] == refs_pat
    # a pattern's rank above the compiled maximum is refused naming the field, though r itself fits
    with pytest.raises(ConfigError, match=r"rank_pattern: model\.layers\.1\.mlp\.down_proj: rank 6 .*exceeds"):
        read_adapter(adapter, ModelConfig.from_hf(base), LoraConfig(1, 4))


@pytest.mark.parametrize("changes, match", [
    (dict(rank_pattern={"q_proj": 0}), "rank_pattern: 'q_proj': a rank must be a positive integer"),
    (dict(rank_pattern=["q_proj"]), "rank_pattern: must be an object"),
    (dict(alpha_pattern={"q_proj": "x"}), "alpha_pattern: 'q_proj': an alpha must be a finite number"),
    (dict(alpha_pattern={"(q_proj": 2}), "alpha_pattern: key '\\(q_proj' is not a valid regex"),
])
def test_bad_patterns_are_refused_naming_the_field(qwen, tmp_path, changes, match):
    base, adapters, _ = qwen
    bad = _edit_config(adapters["all8"], tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=match):
        read_adapter(bad, ModelConfig.from_hf(base), LoraConfig(2, 8))


def _dequantized_hf(base: Path, art: Path):
    """The oracle's base model: HF's model of `base` with each linear the artifact stores quantized replaced by its
    dequantized weight (neuron_opt.quant.dequantize of the stored parts)."""
    from safetensors import safe_open

    from neuron_opt.artifact import read_manifest
    from neuron_opt.quant.weights import QuantTensor, dequantize

    method = read_manifest(art).quant.method
    hf = load_hf(base).eval()
    sd = hf.state_dict()
    replaced = 0
    with safe_open(str(art / "weights" / "rank0.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for key in sorted(k for k in keys if k.endswith(".quant.qweight")):
            prefix = key.removesuffix(".quant.qweight")
            offset = f.get_tensor(prefix + ".quant.offset") if prefix + ".quant.offset" in keys else None
            w = dequantize(QuantTensor(method, f.get_tensor(key), f.get_tensor(prefix + ".quant.scale"), offset))
            assert sd[prefix + ".weight"].shape == w.shape, prefix
            sd[prefix + ".weight"] = w
            replaced += 1
    assert replaced == 7 * hf.config.num_hidden_layers  # every projection of every layer is quantized
    hf.load_state_dict(sd)
    return hf


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_base_with_float_adapters_equals_peft_on_the_dequantized_base(qwen, tmp_path, method):
    """An artifact compiled with --quantize and --enable-lora serves fp32 adapters: greedy tokens of every row of a
    mixed batch equal PEFT's over HF's model holding the artifact's dequantized weights."""
    from neuron_opt.compiler import CompileRequest, compile_artifact

    base, adapters, _ = qwen
    art = tmp_path / "art"
    compile_artifact(CompileRequest(model=str(base), out=art, backend="eager", dtype="float32", batch_size=4,
                                    max_model_len=64, prefill_buckets=(16,), decode_buckets=(64,), quantize=method,
                                    use_cache=False, lora=LoraConfig(max_loras=3, max_lora_rank=8)),
                     log=lambda s: None, progress=False)
    deq = _dequantized_hf(base, art)
    refs = {None: [hf_greedy(deq, p, GREEDY.max_tokens) for p in PROMPTS]}
    for name in ("all8", "attn4", "mlp2"):
        pm = peft.PeftModel.from_pretrained(_dequantized_hf(base, art), adapters[name]).eval()
        refs[name] = [hf_greedy(pm, p, GREEDY.max_tokens) for p in PROMPTS]
        assert refs[name] != refs[None], name  # the adapter changes the quantized model's text
    _check_mixed(LLM(art), adapters, refs)


def test_speculative_decoding_under_adapters_equals_plain_greedy(qwen):
    """Prompt lookup and a draft model (the base checkpoint, which runs without adapters) propose; the target
    verifies under each row's adapter: greedy tokens equal PEFT's, in a mixed batch and one sequence at a time,
    with verify steps taken."""
    from neuron_opt.runtime.speculative import SpeculativeConfig

    base, adapters, _ = qwen
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9, 13, 5], [17, 3, 17, 3, 17, 3, 17], [30, 31, 32, 30, 31, 32, 30, 31],
               [250, 11, 7, 250, 11, 7, 250]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    names = _mixed(adapters)
    refs = [hf_greedy(peft_model(base, adapters[n]) if n else load_hf(base).eval(), p, params.max_tokens)
            for n, p in zip(names, prompts, strict=True)]
    reqs = [LoRARequest(n, str(adapters[n])) if n else None for n in names]
    llm = LLM(base, batch_size=4, max_model_len=64, num_speculative_tokens=3,
              lora=LoraConfig(max_loras=3, max_lora_rank=8))
    for spec in (SpeculativeConfig(3, "ngram", adaptive=False),
                 SpeculativeConfig(3, "draft_model", adaptive=False, model=str(base))):
        outs = llm.generate_batch(prompts, params, speculative=spec, lora_request=reqs)
        assert [o.token_ids for o in outs] == refs, spec.method
        verified = 0
        for p, r, ref in zip(prompts, reqs, refs, strict=True):
            out, stats = llm.generate_ids_speculative(p, params, spec, r)
            assert out.token_ids == ref, (spec.method, r)
            verified += stats.verify_steps
        assert verified > 0, spec.method  # the verify graphs ran under the adapters


# ---- plan --max-loras --max-lora-rank ----------------------------------------------------------------------


def test_plan_counts_the_adapter_stacks_an_artifact_holds(qwen, tmp_path):
    """The planner's adapter bytes (and plan_memory's share of them) equal the bytes of the stacks the loaded
    artifact's executor holds: bf16, three slots, three target modules."""
    from neuron_opt.artifact import read_manifest
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.parallel import head_layout
    from neuron_opt.planner.hardware import get_instance
    from neuron_opt.planner.lora import adapter_bytes
    from neuron_opt.planner.memory import plan_memory

    base, _, _ = qwen
    art = tmp_path / "art"
    compile_artifact(CompileRequest(model=str(base), out=art, backend="eager", dtype="bfloat16", batch_size=2,
                                    max_model_len=64, prefill_buckets=(16,), decode_buckets=(64,), use_cache=False,
                                    lora=LoraConfig(3, 8, ("q_proj", "v_proj", "down_proj"))),
                     log=lambda s: None, progress=False)
    m = read_manifest(art)
    stacks = LLM(art).runner.executor.lora_stacks
    held = sum(t.numel() * t.element_size() for i in range(m.model.num_hidden_layers)
               for t in stacks.layer_tensors(i))
    lay = head_layout(m.model, ParallelConfig())
    assert held > 0 and adapter_bytes(m.model, lay, m.lora, 2) == held
    buckets = LLM(art).runner.buckets
    with_lora = plan_memory(m.model, lay, get_instance("cpu"), buckets, batch=2, max_model_len=64, dtype="bfloat16",
                            kv_dtype="bfloat16", lora=m.lora)
    without = plan_memory(m.model, lay, get_instance("cpu"), buckets, batch=2, max_model_len=64, dtype="bfloat16",
                          kv_dtype="bfloat16")
    assert with_lora.lora == held and with_lora.total - without.total == held


def test_plan_flags_add_adapter_memory_and_step_time(tmp_path, capsys):
    """`plan --max-loras 4 --max-lora-rank 16` on Llama-3-8B's shape at tp 2: the stacks (counted here by hand: 5
    slots x 32 layers x rank 16 x the seven projections' in + out features per rank) join the memory total, and
    the adapter product makes both steps slower."""
    from neuron_opt.cli import main

    conf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    args = ["plan", "--model", str(tmp_path / "config.json"), "--instance", "inf2.xlarge", "--tp", "2",
            "--batch-size", "8", "--input-len", "256", "--output-len", "256", "--json"]
    assert main(args) in (0, 1)
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--max-loras", "4", "--max-lora-rank", "16"]) in (0, 1)
    lora = json.loads(capsys.readouterr().out)
    # per rank: q 4096 -> 2048, k and v 4096 -> 512, o 2048 -> 4096, gate and up 4096 -> 7168, down 7168 -> 4096
    per_layer = (4096 + 2048) + 2 * (4096 + 512) + (2048 + 4096) + 2 * (4096 + 7168) + (7168 + 4096)
    want = 5 * 32 * 16 * per_layer * 2
    assert plain["memory_bytes"]["lora"] == 0 and plain["lora"] is None
    assert lora["memory_bytes"]["lora"] == want
    assert lora["memory_bytes"]["total"] - plain["memory_bytes"]["total"] == want
    assert lora["lora"] == {"max_loras": 4, "max_lora_rank": 16,
                            "target_modules": list(LoraConfig(1, 1).target_modules)}
    assert lora["step_tpot_ms"] > plain["step_tpot_ms"] and lora["step_ttft_ms"] > plain["step_ttft_ms"]
    assert main([*args[:-1], "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj"]) in (0, 1)
    assert "LoRA stacks (1 x rank 16)" in capsys.readouterr().out


def test_cli_generate_lora_with_speculative_decoding_matches_plain(tiny_dir, tmp_path, capsys):
    """`generate --model DIR --lora PATH --speculative-method ngram`: the adapter's plain greedy tokens (PEFT's),
    with verify steps taken (a tiny model with the default model's vocabulary: the prompt is text)."""
    from neuron_opt.cli import main

    base = tiny_dir("smollm-tok")
    adapter = make_adapter(base, tmp_path / "a", 4, 8, ["q_proj", "v_proj", "o_proj", "up_proj"], 9)
    prompt = "abc abc abc abc abc abc"
    cmd = ["generate", "--model", str(base), "--lora", str(adapter), "--prompt", prompt,
           "--max-new-tokens", "12", "--temperature", "0", "--json"]
    assert main(cmd) == 0
    plain = json.loads(capsys.readouterr().out)
    n = len(plain["token_ids"])  # up to 12: the text may end at EOS
    assert n and plain["token_ids"] == hf_greedy(peft_model(base, adapter), plain["prompt_token_ids"], n)
    assert plain["token_ids"] != hf_greedy(load_hf(base), plain["prompt_token_ids"], n)
    assert main([*cmd, "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                 "--no-speculative-adaptive"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["speculative"]["verify_steps"] > 0
