"""`neuron-opt serve ARTIFACT --data-parallel 2 --lora-modules a=PATH` on an `--enable-lora` artifact: the adapters
given at start and those loaded or unloaded through the router's `/v1/load_lora_adapter` / `/v1/unload_lora_adapter`
are served by both replicas, runtime loading gated as in one process (--enable-lora-runtime-loading, the root,
--max-cpu-loras). Oracle: the single-process path (`LLM.generate_ids` under the adapter, itself checked
against PEFT in tests/neuron_opt/test_lora.py) on the same artifact in this process. Runs with `make test-cluster`.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

pytest.importorskip("ray", reason="Ray Serve is the `cluster` extra: pip install 'neuron-opt[cluster]'")
peft = pytest.importorskip("peft")
from cluster_helpers import MODEL, PROMPTS, REPLICA, serve_replicas, wait  # noqa: E402
from peft_adapters import make_adapter  # noqa: E402

from neuron_opt.api import LLM  # noqa: E402
from neuron_opt.lora.config import LoraConfig  # noqa: E402
from neuron_opt.lora.registry import LoRARequest  # noqa: E402
from neuron_opt.runtime.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
N = 8


@pytest.fixture(scope="module")
def lora_cluster(ckpt, tmp_path_factory):
    from neuron_opt.compiler import CompileRequest, compile_artifact

    root = tmp_path_factory.mktemp("lora-cluster")
    art = root / "art"
    compile_artifact(CompileRequest(model=str(ckpt), out=art, backend="eager", dtype="float32", batch_size=4,
                                    max_model_len=128, prefill_buckets=(16,), decode_buckets=(128,), use_cache=False,
                                    lora=LoraConfig(max_loras=2, max_lora_rank=4)), log=lambda s: None, progress=False)
    adapters = {"a": make_adapter(ckpt, root / "a", 4, 8, ["q_proj", "v_proj", "down_proj"], 1),
                "b": make_adapter(ckpt, root / "b", 4, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], 2)}
    llm = LLM(art)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    want = {name: [llm.generate_ids(p, params, LoRARequest(name, str(adapters[name])) if name else None).text
                   for p in PROMPTS] for name in (None, "a", "b")}
    assert want["a"] != want[None] and want["b"] != want[None]  # each adapter changes the text
    args = [str(art), "--max-num-seqs", "4", "--served-model-name", MODEL, "--lora-modules", f"a={adapters['a']}",
            "--enable-lora-runtime-loading", "--lora-runtime-root", str(root), "--max-cpu-loras", "3"]
    with serve_replicas(args, root / "serve.log") as (url, _):
        yield url, adapters, want, root


async def _texts(url: str, model: str) -> list[tuple[int, str, str]]:
    """Every prompt at once under `model`: (status, text or error message, replica)."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(p: list[int]) -> tuple[int, str, str]:
            r = await client.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": N,
                                                                 "temperature": 0, "ignore_eos": True})
            body = r.json()
            text = body["choices"][0]["text"] if r.status_code == 200 else body["error"]["message"]
            return r.status_code, text, r.headers.get(REPLICA, "")
        return await asyncio.gather(*(one(p) for p in PROMPTS))


def _served_by_both(url: str, model: str, want: list[str]) -> None:
    """Concurrent requests under `model` equal `want` until both replicas have answered some (the router's
    replica set follows the controller by long poll, so right after start-up it may list one replica)."""
    seen: set[str] = set()

    def both() -> bool:
        got = asyncio.run(_texts(url, model))
        assert [(s, t) for s, t, _ in got] == [(200, w) for w in want], model
        seen.update(r for _, _, r in got)
        return len(seen) == 2

    wait(both, 90, f"answers under {model!r} from both replicas", every=1.0)


def test_adapters_load_and_unload_on_every_replica(lora_cluster):
    url, adapters, want, root = lora_cluster
    models = lambda: [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]  # noqa: E731
    assert models() == [MODEL, "a"]
    _served_by_both(url, "a", want["a"])  # --lora-modules: on both replicas from the start
    _served_by_both(url, MODEL, want[None])

    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert models() == [MODEL, "a", "b"]
    _served_by_both(url, "b", want["b"])  # loaded through the router: on both replicas once it answered

    bad = root / "bad"
    shutil.copytree(adapters["b"], bad)
    conf = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**conf, "bias": "all"}))
    outside = root.parent / f"outside-{root.name}"
    shutil.copytree(adapters["b"], outside)
    for body, status, text in (({"lora_name": "c", "lora_path": str(bad)}, 400, "bias"),
                               ({"lora_name": "c", "lora_path": str(outside)}, 400, "--lora-runtime-root"),
                               ({"lora_name": "c", "lora_path": f"../{outside.name}"}, 400, "--lora-runtime-root"),
                               ({"lora_name": "b", "lora_path": str(adapters["b"])}, 400, "already loaded"),
                               ({"lora_name": MODEL, "lora_path": str(adapters["b"])}, 400, "base model")):
        r = httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=120)
        assert r.status_code == status and text in r.json()["error"]["message"], r.text
    assert models() == [MODEL, "a", "b"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b2", "lora_path": "b"}, timeout=120)
    assert r.status_code == 200, r.text  # a path relative to the root
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b3", "lora_path": "b"}, timeout=120)
    assert r.status_code == 400 and "--max-cpu-loras" in r.json()["error"]["message"], r.text
    assert models() == [MODEL, "a", "b", "b2"]
    _served_by_both(url, "b2", want["b"])

    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=120)
    assert r.status_code == 200, r.text
    assert models() == [MODEL, "b", "b2"]
    got = asyncio.run(_texts(url, "a"))  # gone from both replicas: every request is a 404
    assert {s for s, _, _ in got} == {404}, got
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    _served_by_both(url, "b", want["b"])
