"""`--backend neuron` on torch-xla's CPU device: the same graphs a NeuronCore runs, checked against eager fp32.

Oracles: the eager torch model (itself tested against HF transformers) for logits; torch-xla's own metrics for
host<->device traffic and compilations; the HLO text XLA compiled for each bucket (kept in the artifact).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch_xla.debug.metrics as met
from helpers import eager_runner
from tiny import make_tiny

from neuron_opt.artifact import read_manifest
from neuron_opt.backends.neuron.backend import hlo_summary
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.config import ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.executors import load_model
from neuron_opt.runtime.runner import DecodeRow

pytestmark = pytest.mark.xla
HERE = Path(__file__).parent
VARIANTS = ["llama-gqa2", "llama-mha", "mistral-window", "qwen2",  # GQA, MHA, sliding window, q/k/v biases
            "mixtral", "qwen2-moe", "qwen3-moe"]  # MoE: decode gathers 2 of 8 experts, prefill runs all 8
SMALL = dict(max_model_len=32, prefill_buckets=(16, 32), decode_buckets=(16, 32))


def compile_tiny(ckpt: Path, out: Path, **kw) -> Path:
    compile_artifact(CompileRequest(model=str(ckpt), out=out, backend="neuron", dtype="float32", use_cache=False,
                                    **{**SMALL, **kw}), log=lambda s: None, progress=False)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_tiny(variant, tmp_path_factory.mktemp(variant), tokenizer=True)
        return made[variant]

    return get


def planned_bytes(m) -> dict[str, int]:
    """The planner's per-rank weight and KV bytes for an artifact's deployment."""
    from neuron_opt.parallel import head_layout
    from neuron_opt.planner.hardware import INSTANCES
    from neuron_opt.planner.memory import plan_memory

    lay = head_layout(m.model, m.parallel)
    plan = plan_memory(m.model, lay, INSTANCES["inf2.xlarge"], m.buckets, batch=m.cache.max_batch,
                       max_model_len=m.cache.max_model_len, dtype=m.dtype, kv_dtype=m.cache.dtype,
                       block_size=m.cache.block_size, window_kv=m.cache.sliding_window > 0)
    return {"weights": plan.weights, "kv": plan.kv_cache}


def teacher_forced(runner, ref, steps: int = 16) -> tuple[list[float], list[str]]:
    prompt = [(7 * i + 3) % 200 + 3 for i in range(12)]
    a, b = runner.prefill(0, prompt), ref.prefill(0, prompt)
    diffs, buckets = [(a - b).abs().max().item()], [runner.last_bucket.key]
    tok, pos = int(b.argmax()), len(prompt)
    for _ in range(steps):
        a, b = runner.decode([DecodeRow(0, tok, pos)]), ref.decode([DecodeRow(0, tok, pos)])
        diffs.append((a - b).abs().max().item())
        buckets.append(runner.last_bucket.key)
        tok, pos = int(b[0].argmax()), pos + 1
    return diffs, buckets


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp1_logits_equal_eager_through_prefill_and_16_decode_steps(variant, ckpt, tmp_path):
    art = compile_tiny(ckpt(variant), tmp_path / "art")
    runner = load_model(art).runner
    diffs, buckets = teacher_forced(runner, eager_runner(ckpt(variant), max_model_len=32, prefill_lens=[16, 32],
                                                         decode_kv_lens=[16, 32]))
    assert buckets[0] == "prefill_b1_s16" and "decode_b1_s16" in buckets and buckets[-1] == "decode_b1_s32"
    assert max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("variant", ["llama-gqa2", "mistral-window"])
def test_block_tables_and_a_prefill_after_a_shared_prefix_equal_eager(variant, ckpt, tmp_path):
    """Blocks of 8: sequence B reuses A's first two blocks (a cached prefix) and prefills only its own 8 tokens
    from position 16 in an offset bucket (16 tokens over 32 positions), then decodes through its block table.
    Oracles: the eager model doing the same steps, and B computed from scratch in eager (prefix reuse changes
    nothing)."""
    art = compile_tiny(ckpt(variant), tmp_path / "art", block_size=8, batch_size=2)
    runner = load_model(art).runner
    kw = dict(max_model_len=32, max_batch=2, block_size=8, prefill_lens=[16, 32], decode_kv_lens=[16, 32])
    ref, scratch = eager_runner(ckpt(variant), **kw), eager_runner(ckpt(variant), **kw)
    a_prompt = [(7 * i + 3) % 200 + 3 for i in range(20)]
    b_prompt = a_prompt[:16] + [(5 * i + 11) % 200 + 3 for i in range(8)]
    a_blocks, b_blocks = [1, 2, 3, 4], [1, 2, 6, 7]  # B shares A's blocks 1, 2 (positions 0..15)
    for r in (runner, ref):
        r.prefill(a_blocks, a_prompt)
    a, b = runner.prefill(b_blocks, b_prompt[16:], start=16), ref.prefill(b_blocks, b_prompt[16:], start=16)
    assert runner.last_bucket.key == "prefill_b1_q16_s32"
    diffs = [(a - b).abs().max().item(), (a - scratch.prefill(0, b_prompt)).abs().max().item()]
    tok, pos = int(b.argmax()), len(b_prompt)
    for _ in range(6):
        rows = [DecodeRow(b_blocks, tok, pos), DecodeRow(a_blocks, 9, 20)]  # A keeps writing its own block 3
        a, b = runner.decode(rows), ref.decode(rows)
        diffs += [(a - b).abs().max().item(), (a[0] - scratch.decode([DecodeRow(0, tok, pos)])[0]).abs().max().item()]
        tok, pos = int(b[0].argmax()), pos + 1
    assert runner.last_bucket.key == "decode_b2_s32"
    assert max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("variant", ["llama-gqa2", "qwen2", "llama-odd-mlp"])  # llama-odd-mlp: MLP 101 -> 102
def test_tp2_one_spmd_program_equals_eager(variant, ckpt, tmp_path):
    """tp=2 runs for real: one SPMD program over two XLA CPU devices, all-reduces inside the HLO (and widths tp
    does not divide are zero-padded exactly as on the eager ranks)."""
    out = subprocess.run([sys.executable, str(HERE / "device_parity.py"), str(ckpt(variant)), str(tmp_path / "art"),
                          "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["buckets"][-1] == "decode_b1_s32" and "decode_b1_s16" in res["buckets"]
    assert max(res["diffs"]) < 1e-4, res["diffs"]
    m = read_manifest(tmp_path / "art")
    assert res["device_bytes"] == planned_bytes(m)  # the planner's per-rank weights and KV are what is held
    L = m.model.num_hidden_layers
    for key, files in m.graphs.items():
        assert all(f.startswith("graphs/spmd/") for f in files), files  # one program for both ranks
        text = (tmp_path / "art" / next(f for f in files if f.endswith(".hlo.txt"))).read_text()
        all_reduces = re.findall(r"all-reduce\(.*replica_groups=\{\{0,1\}\}", text)
        # Megatron TP: one all-reduce after each row-parallel layer (o_proj, down_proj) plus the embedding's
        assert len(all_reduces) == 2 * L + 1, key
        assert hlo_summary(text)["collectives"] == {"all-reduce": 2 * L + 1}
        assert hlo_summary(text)["donated"] == 2 * L


@pytest.mark.parametrize("variant, ep, ep_decode, k", [("mixtral", 1, 0, 0), ("qwen2-moe", 2, 0, 0),
                                                       ("qwen2-moe", 2, 1, 2), ("gpt-oss", 2, 1, 2)])
def test_moe_tp2_one_spmd_program_equals_eager(variant, ep, ep_decode, k, ckpt, tmp_path):
    """MoE at tp=2 as one SPMD program: every expert split over both cores (ep 1), or four whole experts per core
    (ep 2: each core's expert range from its rank id inside the program). Still one all-reduce per attention and
    per sparse block: the partial expert sums meet in the all-reduce the dense MLP has.

    Hybrid (ep 2 prefill, `ep_decode` 1): the device holds both copies of the experts (the planner's bytes), and
    each graph reads one: prefill graphs the [4, 2I, H] whole experts, decode and verify graphs the [8, 2I/2, H]
    split ones (per core; the program's parameters stack them over the cores), seen in the graphs' HLO
    parameters. GPT-OSS in that layout: each expert's down bias added once per layout (the ep 2 copy: on the core
    holding the expert; the ep 1 copy: on the first of the two cores splitting it)."""
    out = subprocess.run([sys.executable, str(HERE / "device_parity.py"), str(ckpt(variant)), str(tmp_path / "art"),
                          "2", str(k), str(ep), str(ep_decode)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(res["diffs"]) < 1e-4, res["diffs"]
    m = read_manifest(tmp_path / "art")
    assert m.parallel.ep == ep and m.parallel.decode_ep == (ep_decode or ep)
    assert res["device_bytes"] == planned_bytes(m)
    L = m.model.num_hidden_layers
    H, I = m.model.hidden_size, m.model.moe_intermediate_size
    for key, files in m.graphs.items():
        text = (tmp_path / "art" / next(f for f in files if f.endswith(".hlo.txt"))).read_text()
        assert hlo_summary(text)["collectives"] == {"all-reduce": 2 * L + 1}
        if ep_decode:
            # gate_up_proj stacked over the 2 cores ([tp, ...] in the SPMD program): ep 2 copy, ep 1 copy
            whole, split = f"f32[2,4,{2 * I},{H}]", f"f32[2,8,{I},{H}]"
            reads = (split, whole) if key.startswith(("decode", "verify")) else (whole, split)
            header = text.splitlines()[0]
            assert reads[0] in header and reads[1] not in header, (key, header[:400])
    if k:
        assert any(key.startswith("verify") for key in m.graphs)


def test_every_bucket_hlo_is_static_donates_every_kv_buffer_and_never_calls_the_host(ckpt, tmp_path):
    art = compile_tiny(ckpt("llama-gqa2"), tmp_path / "art")
    m = read_manifest(art)
    L = m.model.num_hidden_layers
    assert sorted(m.graphs) == sorted(b.key for b in m.buckets.buckets())
    for key, files in m.graphs.items():
        names = sorted(Path(f).name for f in files)
        assert names == [f"{key}.hlo.pb", f"{key}.hlo.txt"], names
        text = (art / f"graphs/rank0/{key}.hlo.txt").read_text()
        header = text.splitlines()[0]
        assert header.startswith("HloModule neuron_opt_"), header[:80]
        donors = re.findall(r"\((\d+), \{\}\)", re.search(r"buffer_donor=\{(.*?)\}, entry", header).group(1))
        assert len(donors) == 2 * L  # every K and V cache buffer
        kv = f"f32[{m.cache.num_blocks},2,{m.cache.block_size},16]"  # [num_blocks, n_kv, block_size, D]
        layout = re.search(r"entry_computation_layout=\{\((.*)\)->\((.*)\)\}", header)
        params = re.findall(r"[a-z0-9]+\[[^\]]*\]", layout.group(1))
        assert [i for i, p in enumerate(params) if p == kv] == sorted(int(d) for d in donors)
        assert "<=" not in text  # no bounded-dynamic shapes
        assert not re.search(r"\b(infeed|outfeed|send|recv)\(", text)
        assert "custom-call" not in text  # nothing for the host or an unknown target
        assert (art / f"graphs/rank0/{key}.hlo.pb").stat().st_size > 1000
        # weights are parameters, not constants: no constant as large as a weight matrix
        assert not re.search(r"constant\(\{\s*\{", text)


def _traffic() -> tuple[float, float]:
    out, inn = met.metric_data("OutboundData"), met.metric_data("InboundData")
    return (out[1] if out else 0.0), (inn[1] if inn else 0.0)


@pytest.mark.parametrize("replay", [True, False])
def test_a_decode_step_moves_only_ids_in_and_logits_out_at_any_kv_length(replay, ckpt, tmp_path):
    art = compile_tiny(ckpt("llama-gqa2"), tmp_path / "art", max_model_len=256, prefill_buckets=(16,),
                       decode_buckets=(16, 256), backend_options={"replay": replay})
    runner = load_model(art).runner
    V = runner.vocab_size
    runner.prefill(0, list(range(3, 15)))
    moved = {}
    for pos in (12, 200):  # KV bucket 16, then 256: 16x the KV a step attends over
        o0, i0 = _traffic()
        runner.decode([DecodeRow(0, 5, pos)])
        o1, i1 = _traffic()
        moved[runner.last_bucket.key] = (o1 - o0, i1 - i0)
    assert set(moved) == {"decode_b1_s16", "decode_b1_s256"}
    (out16, in16), (out256, in256) = moved["decode_b1_s16"], moved["decode_b1_s256"]
    # in: ids, position, slot mapping, last index (one int32 each) and the block table, one int32 per 32-position
    # block of the bucket (1 at KV 16, 8 at KV 256); out: the logits, independent of the KV length
    assert out16 <= 4 * 5 and out256 - out16 == 4 * 7 and in16 == in256, moved
    assert in16 <= 4 * (V + 1)  # [1, V] fp32 logits (V padded to the rank's vocabulary)
    kv_bytes = 2 * 2 * 2 * 256 * 16 * 4  # one slot's K+V for 2 layers at 256 positions
    assert in16 + out16 < kv_bytes / 10


@pytest.mark.parametrize("replay", [True, False])
def test_no_recompilation_after_warm_up_over_a_64_token_generation(replay, ckpt, tmp_path):
    art = compile_tiny(ckpt("llama-gqa2"), tmp_path / "art", max_model_len=128, prefill_buckets=(16,),
                       decode_buckets=(32, 64, 128), backend_options={"replay": replay})
    runner = load_model(art).runner  # load compiles (on a NeuronCore: loads) every bucket's graph
    compiles = met.metric_data("CompileTime")[0]
    uncached = met.counter_value("UncachedCompile")
    seen = set()
    logits = runner.prefill(0, list(range(3, 15)))
    tok = int(logits.argmax())
    for pos in range(12, 12 + 64):  # crosses the decode buckets 32 -> 64 -> 128
        tok = int(runner.decode([DecodeRow(0, tok, pos)])[0].argmax())
        seen.add(runner.last_bucket.key)
    assert seen == {"decode_b1_s32", "decode_b1_s64", "decode_b1_s128"}
    assert met.metric_data("CompileTime")[0] == compiles
    assert met.counter_value("UncachedCompile") == uncached


@pytest.mark.parametrize("variant", ["llama-gqa2", "smollm-like-9-3"])  # untied, tied embeddings
def test_weights_are_placed_on_the_device_once_and_the_planner_counts_what_is_held(variant, ckpt, tmp_path):
    art = compile_tiny(ckpt(variant), tmp_path / "art", batch_size=2)
    o0, _ = _traffic()
    loaded = load_model(art)  # places the weights and compiles every bucket (3 prefill incl. the offset one
    # of 16 tokens over 32, decode b1 and b2 at 16 and 32)
    o1, _ = _traffic()
    ranks = loaded.runner.executor.ranks
    weights = sum(p.numel() * p.element_size() for p in ranks.model.parameters())  # tied: counted once
    kv = sum(c.numel() * c.element_size() for c in [*ranks.k_caches, *ranks.v_caches])
    assert len(loaded.manifest.graphs) == 7
    assert weights <= o1 - o0 < 1.1 * weights, (o1 - o0, weights)  # once, not once per bucket
    assert {"weights": weights, "kv": kv} == planned_bytes(loaded.manifest)


@pytest.mark.parametrize("variant", ["mistral-window", "smollm-like-9-3"])
def test_replayed_steps_equal_traced_steps_bit_for_bit(variant, ckpt, tmp_path):
    """The fast path (each bucket's executable replayed by hash, caches donated) against the reference (the model's
    ops recorded every step), on the same compiled shapes: identical logits, prefill and 16 decode steps."""
    runners = [load_model(compile_tiny(ckpt(variant), tmp_path / f"art-{r}", backend_options={"replay": r})).runner
               for r in (True, False)]
    assert isinstance(runners[0].executor.buckets[runners[0].buckets.buckets()[0]], object)
    assert all(v is not None for v in runners[0].executor.buckets.values())  # replayed
    assert all(v is None for v in runners[1].executor.buckets.values())  # traced
    prompt = [(3 * i + 1) % 200 + 3 for i in range(10)]
    a, b = (r.prefill(0, prompt) for r in runners)
    assert torch.equal(a, b)
    tok, pos = int(b.argmax()), len(prompt)
    for _ in range(16):
        a, b = (r.decode([DecodeRow(0, tok, pos)]) for r in runners)
        assert torch.equal(a, b), pos
        tok, pos = int(b[0].argmax()), pos + 1


def test_replay_at_tp2_is_refused_with_the_reason(ckpt, tmp_path):
    from neuron_opt.backends.neuron.backend import NeuronOptions

    assert NeuronOptions.from_dict({}).replay is None  # auto: replay at tp=1, trace at tp > 1
    out = subprocess.run([sys.executable, "-m", "neuron_opt.cli", "compile", "--model", str(ckpt("llama-gqa2")),
                          "--out", str(tmp_path / "art"), "--backend", "neuron", "--tp", "2",
                          "--backend-option", "replay=true"], capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "replay is available at tp=1 only" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "art").exists()


def test_sequence_parallel_at_tp2_is_refused_before_anything_runs(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="no SPMD form"):
        compile_tiny(ckpt("llama-gqa2"), tmp_path / "art", parallel=ParallelConfig(tp=2, sequence_parallel=True))
    assert not (tmp_path / "art").exists()


def test_a_tp2_artifact_cannot_load_into_a_one_device_process(ckpt, tmp_path):
    out = subprocess.run([sys.executable, "-m", "neuron_opt.cli", "compile", "--model", str(ckpt("llama-gqa2")),
                          "--out", str(tmp_path / "art"), "--backend", "neuron", "--dtype", "float32", "--tp", "2",
                          "--max-model-len", "32", "--prefill-buckets", "16", "--decode-buckets", "16,32"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    with pytest.raises(ConfigError, match="one SPMD program over 2 XLA devices.*fresh process"):
        load_model(tmp_path / "art")


def test_torch_and_device_logits_agree_through_the_api(ckpt, tmp_path):
    """The Python API over a neuron artifact generates what the eager reference generates (greedy), with async
    scheduling on (host sampling in the pipelined step; the server test below samples in the graphs)."""
    from neuron_opt.api import LLM
    from neuron_opt.runtime.sampling import SamplingParams

    art = compile_tiny(ckpt("qwen2"), tmp_path / "art")
    ids = [(5 * i + 4) % 200 + 3 for i in range(10)]
    got = LLM(art, async_scheduling=True).generate_ids(ids, SamplingParams(max_tokens=20, min_tokens=20)).token_ids
    ref_llm = LLM(str(ckpt("qwen2")), max_model_len=64)
    want = ref_llm.generate_ids(ids, SamplingParams(max_tokens=20, min_tokens=20)).token_ids
    assert got == want
    assert torch.is_tensor(torch.tensor(got))


def test_default_model_compiles_and_answers_paris_with_hf_greedy_tokens(tmp_path, capsys):
    """SmolLM2-135M (the embedded GGUF) through `neuron-opt compile --backend neuron` and `generate` on the XLA
    CPU device; the greedy tokens equal HF transformers loading the same file (fp32)."""
    import transformers

    from neuron_opt.checkpoint import default_model_path
    from neuron_opt.cli import main

    art = tmp_path / "art"
    assert main(["compile", "--model", "default", "--out", str(art), "--backend", "neuron", "--dtype", "float32",
                 "--max-model-len", "256", "--prefill-buckets", "64,128", "--decode-buckets", "128,256"]) == 0
    capsys.readouterr()
    assert main(["generate", str(art), "--chat", "--prompt", "What is the capital of France?",
                 "--max-new-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([out["prompt_token_ids"]]), max_new_tokens=24, do_sample=False,
                          pad_token_id=0)[0, len(out["prompt_token_ids"]):].tolist()
    assert out["token_ids"] == ref


def test_server_on_a_neuron_artifact_batches_streams_like_the_reference(tmp_path):
    """The official openai client, 6 concurrent greedy chats through `serve`'s engine over a batch-4 device
    artifact (decode buckets b1/b2/b4, padded rows on the null block): each equals the eager batch-1 answer."""
    import asyncio

    import openai
    from helpers import live_server

    from neuron_opt.api import LLM
    from neuron_opt.runtime.sampling import SamplingParams

    tiny = make_tiny("smollm-tok", tmp_path / "ckpt")
    art = compile_tiny(tiny, tmp_path / "art", batch_size=4, max_model_len=128, prefill_buckets=(32, 64),
                       decode_buckets=(64, 128))
    ref = LLM(tiny, max_model_len=128)
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    want = [ref.chat([{"role": "user", "content": q}], SamplingParams(max_tokens=12, min_tokens=12)).text
            for q in questions]

    with live_server(LLM(art), max_num_seqs=4) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def one(q: str) -> str:
            r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                                     max_tokens=12, temperature=0,
                                                     extra_body={"min_tokens": 12})
            return r.choices[0].message.content

        async def together() -> list[str]:
            return list(await asyncio.gather(*(one(q) for q in questions)))

        got = asyncio.run(together())
    assert got == want


def test_ops_nki_on_the_xla_cpu_device_uses_the_torch_op_at_every_call_site_and_records_why(ckpt, tmp_path, capsys):
    """The same call sites as on a NeuronCore; here every one is the torch op (no NKI runtime), recorded per
    bucket in the artifact and printed by inspect; the logits are those of ops=torch."""
    from neuron_opt.cli import main

    arts = {o: compile_tiny(ckpt("llama-gqa2"), tmp_path / o, backend_options={"ops": o}) for o in ("nki", "torch")}
    m = read_manifest(arts["nki"])
    for files in m.graphs.values():
        (kf,) = [f for f in files if f.endswith(".kernels.json")]
        choices = json.loads((arts["nki"] / kf).read_text())
        assert {c["op"] for c in choices} == {"attention", "rms_norm"}
        assert all(c["kernel"] is None and c["reason"] == "the CPU device has no NKI runtime" for c in choices)
    assert not any(f.endswith(".kernels.json") for fs in read_manifest(arts["torch"]).graphs.values() for f in fs)
    runners = [load_model(arts[o]).runner for o in ("nki", "torch")]
    prompt = list(range(3, 15))
    assert torch.equal(runners[0].prefill(0, prompt), runners[1].prefill(0, prompt))
    assert main(["inspect", str(arts["nki"])]) == 0
    assert "attention q [1, 4, 16, 16], kv [1, 2, 16, 16], float32: torch (the CPU device has no NKI runtime)" \
        in capsys.readouterr().out


@pytest.mark.parametrize("tp", [1, 2])
def test_verify_buckets_score_every_position_like_eager(tp, ckpt, tmp_path):
    """Speculative decoding's verify graphs (k + 1 = 3 tokens per row, logits at each) on the device path: one
    HLO per verify bucket, logits equal eager fp32; at tp=2 inside the one SPMD program."""
    out = subprocess.run([sys.executable, str(HERE / "device_parity.py"), str(ckpt("llama-gqa2")),
                          str(tmp_path / "art"), str(tp), "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["buckets"][-1] == "verify_b1_q3_s32"
    assert max(res["diffs"]) < 1e-4, res["diffs"]
    m = read_manifest(tmp_path / "art")
    assert sorted(k for k in m.graphs if k.startswith("verify")) == ["verify_b1_q3_s16", "verify_b1_q3_s32"]


def test_speculative_greedy_through_a_neuron_artifact_equals_eager(ckpt, tmp_path):
    from neuron_opt.api import LLM
    from neuron_opt.runtime.sampling import SamplingParams
    from neuron_opt.runtime.speculative import SpeculativeConfig

    art = compile_tiny(ckpt("llama-gqa2"), tmp_path / "art", num_speculative_tokens=2)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    out, stats = LLM(art).generate_ids_speculative(prompt, params, SpeculativeConfig(2, adaptive=False))
    want = LLM(str(ckpt("llama-gqa2")), max_model_len=32).generate_ids(prompt, params).token_ids
    assert out.token_ids == want and stats.verify_steps > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_logprobs_from_every_position_prefill_graphs_match_hf(tp, ckpt, tmp_path):
    """Prompt logprobs on the device path: two prompts (of 12 and 20 tokens) prefilled on their buckets'
    every-position graphs (compiled on demand; replayed at tp=1, one SPMD program at tp=2) equal HF transformers'
    log-softmax over each prompt (1e-3), and the tokens generated after them equal those of requests that do not
    score."""
    from transformers import AutoModelForCausalLM

    out = subprocess.run([sys.executable, str(HERE / "device_scoring.py"), str(ckpt("llama-gqa2")),
                          str(tmp_path / "art"), str(tp)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["every"] == ["prefill_b1_s16", "prefill_b1_s32"]  # the two prompts' buckets, each compiled once
    hf = AutoModelForCausalLM.from_pretrained(ckpt("llama-gqa2"), dtype=torch.float32).eval()
    for p in res["prompts"]:
        ids = p["ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        assert p["first"] is None and len(p["scored"]) == len(ids) - 1
        for j, (tok, lp, best) in enumerate(p["scored"]):
            assert tok == ids[j + 1] and best == int(ref[j].argmax())
            assert abs(lp - ref[j, tok].item()) < 1e-3, (j, lp, ref[j, tok].item())
        assert p["tokens"] == p["plain_tokens"] and len(p["tokens"]) == 4
