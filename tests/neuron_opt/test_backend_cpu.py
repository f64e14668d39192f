"""cpu backend (AOTInductor, C++ GEMM template, shared packed weights) against the eager model.

Oracle: the same LlamaForCausalLM run eagerly on its own KV caches. One module-scoped compile of a tiny
2-layer model serves every test (5 graphs: prefill/decode layer graphs with dynamic KV length, heads b1/b2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.llama import LlamaForCausalLM
from neuron_opt.backends.base import StepInputs, allocate_kv
from neuron_opt.backends.cpu.backend import CpuBackend, CpuExecutor, onednn_bf16_supported
from neuron_opt.backends.cpu.constants import pack_weight
from neuron_opt.backends.cpu.graphs import graph_keys
from neuron_opt.buckets import DECODE, PREFILL, Bucket
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.errors import ArtifactError, BackendCompileError, BucketOverflowError, ConfigError
from neuron_opt.parallel import head_layout

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=261, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  max_position_embeddings=1024, rope_parameters=(("rope_theta", 10000.0), ("rope_type", "default")),
                  tie_word_embeddings=True)
MAX_LEN, SLOTS = 1024, 3
CACHE = CacheConfig(max_batch=SLOTS, max_model_len=MAX_LEN)  # 32-position blocks; "slot" s: a fixed block range
BS = CACHE.block_size
BUCKETS = [Bucket(PREFILL, 1, 16), Bucket(PREFILL, 1, 32), Bucket(DECODE, 1, 32), Bucket(DECODE, 1, 1024),
           Bucket(DECODE, 2, 32), Bucket(DECODE, 2, 1024), Bucket(PREFILL, 1, 1024, 16), Bucket(PREFILL, 2, 32)]


def make_model(seed: int, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    m = LlamaForCausalLM(CFG, head_layout(CFG, ParallelConfig()), max_model_len=MAX_LEN)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if name.endswith("norm.weight") else p.normal_(0.0, 0.1)
    return m.to(dtype).eval()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Bucket, list[Path]], CpuBackend]:
    out = tmp_path_factory.mktemp("cpu_art")
    backend = CpuBackend(torch.float32)
    model = make_model(0)
    files = {b: [out / f for f in backend.compile_bucket(model, b, CACHE, out)] for b in BUCKETS}
    # serve different weights than the ones compiled with: graphs must not have baked any in
    backend.save_weights(make_model(7), out / "rank0.safetensors")
    return out, files, backend


@pytest.fixture(scope="module")
def executor(compiled: tuple[Path, dict[Bucket, list[Path]], CpuBackend]) -> CpuExecutor:
    out, files, backend = compiled
    return backend.load(files, out / "rank0.safetensors", lambda: make_model(123), CACHE)


class Eager:
    """The oracle: the model itself with its own caches."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.k, self.v = allocate_kv(model, CACHE, torch.float32)

    @torch.no_grad()
    def run(self, bucket: Bucket, inp: StepInputs) -> torch.Tensor:
        return self.model(*inp.arrays(), self.k, self.v, bucket.kv_len)


def blocks(slot: int) -> list[int]:
    n = CACHE.blocks_per_sequence
    return list(range(1 + slot * n, 1 + (slot + 1) * n))


def where(slot: int, pos: int) -> tuple[int, int]:
    """(block, offset) of a slot's position."""
    return blocks(slot)[pos // BS], pos % BS


def tables(slots: list[int], kv_len: int) -> torch.Tensor:
    return torch.tensor([blocks(s)[: -(-kv_len // BS)] for s in slots])


def prefill_inputs(prompt: list[int], bucket: Bucket, slot: int) -> StepInputs:
    ids = torch.zeros(1, bucket.tokens, dtype=torch.int64)
    ids[0, :len(prompt)] = torch.tensor(prompt)
    flat = torch.zeros(1, bucket.tokens, dtype=torch.int64)  # pads: the null block
    flat[0, :len(prompt)] = torch.tensor([b * BS + o for b, o in (where(slot, p) for p in range(len(prompt)))])
    return StepInputs(ids, torch.arange(bucket.tokens)[None].clone(), flat, tables([slot], bucket.kv_len),
                      torch.tensor([len(prompt) - 1]))


def decode_inputs(tokens: list[int], positions: list[int], slots: list[int], kv_len: int) -> StepInputs:
    flat = [b * BS + o for b, o in (where(s, p) for s, p in zip(slots, positions, strict=True))]
    return StepInputs(torch.tensor(tokens)[:, None], torch.tensor(positions)[:, None], torch.tensor(flat)[:, None],
                      tables(slots, kv_len), torch.zeros(len(tokens), dtype=torch.int64))


def reset(ex: CpuExecutor) -> None:
    for c in ex.k_caches + ex.v_caches:
        c.zero_()


def assert_kv_equal(ex: CpuExecutor, ref: Eager) -> None:
    """Every block but the null block (padding's writes land there, in any order)."""
    for a, b in zip(ex.k_caches + ex.v_caches, ref.k + ref.v, strict=True):
        torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [15, 16, 17])  # one below, at and one above the 16-token prefill bucket
def test_prefill_then_decode_matches_eager_step_by_step(executor: CpuExecutor, n: int) -> None:
    reset(executor)
    ref = Eager(make_model(7))
    prompt = torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    bucket = Bucket(PREFILL, 1, 16 if n <= 16 else 32)
    inp = prefill_inputs(prompt, bucket, 1)
    got, want = executor.run(bucket, inp), ref.run(bucket, inp)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_kv_equal(executor, ref)
    tok_c, tok_e = [int(got.argmax())], [int(want.argmax())]
    for step in range(8):  # the KV cache must advance in the compiled graph at every step (pytorch#165444)
        pos = n + step
        bucket = Bucket(DECODE, 1, 32)
        got = executor.run(bucket, decode_inputs(tok_c[-1:], [pos], [1], 32))
        want = ref.run(bucket, decode_inputs(tok_e[-1:], [pos], [1], 32))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert_kv_equal(executor, ref)
        assert executor.k_caches[0][where(1, pos)[0], :, where(1, pos)[1]].abs().sum() > 0
        tok_c.append(int(got.argmax()))
        tok_e.append(int(want.argmax()))
    assert tok_c == tok_e


def test_batched_decode_past_512_in_the_large_kv_bucket(executor: CpuExecutor) -> None:
    """One dynamic-KV graph serves kv_len 32 and 1024; rows at different positions, one of them > 512."""
    reset(executor)
    ref = Eager(make_model(7))
    for step in range(4):
        tokens, positions, slots = [5 + step, 9 + step], [600 + step, 3 + step], [2, 0]
        bucket = Bucket(DECODE, 2, 1024)
        got = executor.run(bucket, decode_inputs(tokens, positions, slots, 1024))
        want = ref.run(bucket, decode_inputs(tokens, positions, slots, 1024))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert_kv_equal(executor, ref)
    got = executor.run(Bucket(DECODE, 2, 32), decode_inputs([7, 8], [7, 4], [0, 1], 32))
    want = ref.run(Bucket(DECODE, 2, 32), decode_inputs([7, 8], [7, 4], [0, 1], 32))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [2, 7, 23, 45])
def test_prefills_of_lengths_never_compiled_run_on_the_dynamic_graph_and_match_eager(executor: CpuExecutor,
                                                                                     n: int) -> None:
    """The executor runs a prefill of any token count >= 2 (the runner's prefill_granularity relies on it): a prompt
    of n tokens in a bucket of exactly n (none compiled: 16 and 32 are), logits and K/V against eager."""
    assert executor.prefill_granularity > 0
    reset(executor)
    ref = Eager(make_model(7))
    prompt = torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(100 + n)).tolist()
    bucket = Bucket(PREFILL, 1, n)
    inp = prefill_inputs(prompt, bucket, 1)
    torch.testing.assert_close(executor.run(bucket, inp), ref.run(bucket, inp), rtol=1e-4, atol=1e-4)
    assert_kv_equal(executor, ref)


def test_prefill_logits_at_every_position_match_eager(executor: CpuExecutor) -> None:
    """A prefill asked for every position's logits ([1, S] last_index: prompt logprobs) runs the head outside the
    layer graph, in chunks of a head graph's rows: [1, S, V] against eager, its last row the usual prefill's."""
    ref = Eager(make_model(7))
    prompt = torch.randint(3, CFG.vocab_size, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    bucket = Bucket(PREFILL, 1, 32)
    inp = prefill_inputs(prompt, bucket, 1)
    every = StepInputs(inp.input_ids, inp.positions, inp.slot_mapping, inp.block_tables,
                       torch.arange(bucket.tokens)[None].clone())
    reset(executor)
    got = executor.run(bucket, every)
    assert got.shape == (1, bucket.tokens, CFG.vocab_size)
    torch.testing.assert_close(got[0, :21], ref.run(bucket, every)[0, :21], rtol=1e-4, atol=1e-4)
    reset(executor)
    torch.testing.assert_close(got[0, 20], executor.run(bucket, inp)[0], rtol=1e-5, atol=1e-5)


def test_a_bucket_without_graphs_is_refused_by_name(executor: CpuExecutor) -> None:
    with pytest.raises(BucketOverflowError, match="prefill_b4_s32: this artifact has no cpu graphs"):
        executor.run(Bucket(PREFILL, 4, 32), prefill_inputs([5, 6], Bucket(PREFILL, 1, 32), 1))


def test_offset_and_two_row_prefills_match_eager(executor: CpuExecutor) -> None:
    """The prefill graph with its token count and KV length both dynamic: a prefill of 10 tokens from position 32
    over a table whose first block another sequence wrote (an offset bucket: 16 tokens over 1024 positions), and a
    two-row prefill of prompts of different lengths (its own graph, batch 2)."""
    reset(executor)
    ref = Eager(make_model(7))
    a = torch.randint(3, CFG.vocab_size, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    inp = prefill_inputs(a, Bucket(PREFILL, 1, 32), 1)
    torch.testing.assert_close(executor.run(Bucket(PREFILL, 1, 32), inp), ref.run(Bucket(PREFILL, 1, 32), inp),
                               rtol=1e-4, atol=1e-4)
    b_table = [blocks(1)[0], *blocks(2)[1:]]  # shares slot 1's first block (positions 0..31)
    bucket = Bucket(PREFILL, 1, 1024, 16)
    ids = torch.zeros(1, 16, dtype=torch.int64)
    ids[0, :10] = torch.arange(40, 50)
    flat = torch.zeros(1, 16, dtype=torch.int64)
    flat[0, :10] = torch.tensor([b_table[p // BS] * BS + p % BS for p in range(32, 42)])
    inp = StepInputs(ids, torch.arange(32, 48)[None], flat, torch.tensor([b_table]), torch.tensor([9]))
    torch.testing.assert_close(executor.run(bucket, inp), ref.run(bucket, inp), rtol=1e-4, atol=1e-4)
    assert_kv_equal(executor, ref)
    bucket = Bucket(PREFILL, 2, 32)
    ids = torch.zeros(2, 32, dtype=torch.int64)
    ids[0, :12], ids[1, :20] = torch.arange(60, 72), torch.arange(80, 100)
    flat = torch.zeros(2, 32, dtype=torch.int64)
    flat[0, :12] = torch.tensor([b * BS + o for b, o in (where(0, p) for p in range(12))])
    flat[1, :20] = torch.tensor([b * BS + o for b, o in (where(2, p) for p in range(20))])
    inp = StepInputs(ids, torch.arange(32).expand(2, 32).contiguous(), flat, tables([0, 2], 32),
                     torch.tensor([11, 19]))
    torch.testing.assert_close(executor.run(bucket, inp), ref.run(bucket, inp), rtol=1e-4, atol=1e-4)
    assert_kv_equal(executor, ref)


def test_batch1_prefills_attend_in_parts_even_with_a_tail_past_max_model_len(
        compiled: tuple[Path, dict[Bucket, list[Path]], CpuBackend], executor: CpuExecutor) -> None:
    """Prefill graphs attend in parts (cpu_graphs.PrefillAttention), batched ones too, each row on its own. A
    prefill of 5 tokens ending at the last position, padded to 16 as the runner pads (positions capped at
    max_model_len - 1): the executor extends its table with a null block so every part sees its keys. Then two rows
    of different lengths and starts in one batch-2 prefill (that tail again beside a 14-token prompt from position
    0): logits and K/V against eager."""
    out, _, _ = compiled
    metas = {m["key"]: m for m in (json.loads(f.read_text()) for f in out.rglob("*.json")) if "key" in m}
    assert metas["layer_prefill_b1_dyn"]["prefill_parts"] == 4
    assert metas["layer_prefill_b2_dyn"]["prefill_parts"] == 4
    reset(executor)
    ref = Eager(make_model(7))
    start, n, bucket = MAX_LEN - 5, 5, Bucket(PREFILL, 1, 1024, 16)
    ids = torch.zeros(1, 16, dtype=torch.int64)
    ids[0, :n] = torch.arange(20, 20 + n)
    flat = torch.zeros(1, 16, dtype=torch.int64)
    flat[0, :n] = torch.tensor([b * BS + o for b, o in (where(2, p) for p in range(start, start + n))])
    pos = torch.arange(start, start + 16).clamp(max=MAX_LEN - 1)[None]
    inp = StepInputs(ids, pos, flat, tables([2], MAX_LEN), torch.tensor([n - 1]))
    torch.testing.assert_close(executor.run(bucket, inp), ref.run(bucket, inp), rtol=1e-4, atol=1e-4)
    assert_kv_equal(executor, ref)
    bucket, m = Bucket(PREFILL, 2, 1024, 16), 14
    ids = torch.zeros(2, 16, dtype=torch.int64)
    ids[0, :n], ids[1, :m] = torch.arange(30, 30 + n), torch.arange(100, 100 + m)
    flat = torch.zeros(2, 16, dtype=torch.int64)
    flat[0, :n] = torch.tensor([b * BS + o for b, o in (where(2, p) for p in range(start, start + n))])
    flat[1, :m] = torch.tensor([b * BS + o for b, o in (where(0, p) for p in range(m))])
    pos = torch.stack([torch.arange(start, start + 16).clamp(max=MAX_LEN - 1), torch.arange(16)])
    inp = StepInputs(ids, pos, flat, tables([2, 0], MAX_LEN), torch.tensor([n - 1, m - 1]))
    torch.testing.assert_close(executor.run(bucket, inp), ref.run(bucket, inp), rtol=1e-4, atol=1e-4)
    assert_kv_equal(executor, ref)


def test_weights_are_bound_at_load_and_held_once(compiled: tuple[Path, dict[Bucket, list[Path]], CpuBackend],
                                                 executor: CpuExecutor) -> None:
    out, files, _ = compiled
    # graphs shared between buckets are compiled once and hold no weights
    so_files = {f for fs in files.values() for f in fs if f.suffix == ".so"}
    assert {f.stem for f in so_files} == {"layer_prefill_b1_dyn", "layer_prefill_b2_dyn", "layer_decode_b1",
                                          "layer_decode_b2",
                                          "head_b1", "head_b2"}
    # every GEMM weight packed once and shared by all graphs; tied embedding read from the packed head
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in executor.constants.values()}
    param_bytes = sum(p.numel() * 4 for p in make_model(0).parameters())
    assert sum(storages.values()) <= 1.1 * param_bytes
    # each linear weight in exactly one packed constant; q/k/v and gate/up fused (concat-linear): 4 GEMMs a layer
    packed = [k[0] for k in executor.constants if k[1].op == "pack"]
    linear = [n for n, p in make_model(0).named_parameters() if p.dim() == 2 and "embed" not in n]
    assert sorted(n for srcs in packed for n in srcs) == sorted([*linear, "lm_head.weight"])  # the tied head
    assert len(packed) == 4 * CFG.num_hidden_layers + 1
    assert any(len(srcs) == 3 and srcs[0].endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
               for srcs in packed)


def test_pack_weight_layout() -> None:
    w = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)  # [N=5, K=4]
    b = pack_weight(w, block_n=2, vnni=0)  # [3, 4, 2], N padded to 6
    assert b.shape == (3, 4, 2)
    for n in range(5):
        for k in range(4):
            assert b[n // 2, k, n % 2] == w[n, k]
    assert b[2, :, 1].abs().sum() == 0
    v = pack_weight(w, block_n=2, vnni=2)  # pairs of K rows interleaved inside each block
    for n in range(5):
        for k in range(4):
            assert v.view(3, 2, 2, 2)[n // 2, k // 2, n % 2, k % 2] == w[n, k]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, 2, 4]),
       st.integers(0, 2**16))
def test_constants_matched_to_concatenated_and_packed_sources(rows: list[int], block_n: int, vnni: int,
                                                              seed: int) -> None:
    """A graph constant built as the C++ template's packing of several projections concatenated (Inductor's
    concat-linear) is traced back to those sources in order, and rebuilt identically at load."""
    from neuron_opt.backends.cpu.constants import build_constant, match_constants, unpack_weight

    g = torch.Generator().manual_seed(seed)
    named = {f"p{i}.weight": torch.randn(n, 8, generator=g) for i, n in enumerate(rows)}
    named["other.weight"] = torch.randn(4, 8, generator=g)
    named["p.bias"] = torch.randn(sum(rows), generator=g)
    order = list(reversed(named))[2:]  # the sources in a different order than the module's
    fused = torch.cat([named[n] for n in order])
    packed = pack_weight(fused, block_n, vnni)
    assert torch.equal(unpack_weight(packed, vnni)[:sum(rows)], fused)
    consts = {"c0": packed, "c1": torch.cat([named["p.bias"]]), "c2": named["other.weight"].clone()}
    recipes = match_constants(consts, named, "test")
    assert recipes["c0"].sources == tuple(order) and (recipes["c0"].op, recipes["c0"].block_n) == ("pack", block_n)
    assert recipes["c1"].sources == ("p.bias",) and recipes["c2"].sources == ("other.weight",)
    for c, r in recipes.items():
        assert torch.equal(build_constant([named[n] for n in r.sources], r), consts[c])
    with pytest.raises(BackendCompileError, match="not derived from any model tensor"):
        match_constants({"bad": packed + 1}, named, "test")


@pytest.mark.parametrize("gemm", ["aten", "cpp"])
def test_small_parameters_are_bound_at_load_not_written_into_the_code(gemm: str, tmp_path: Path) -> None:
    """Inductor writes a one-dimensional constant of up to 8 values into the generated code unless it is told to
    keep it: compiled on the placeholder copy, the graph would carry random values where such a tensor belongs
    (GPT-OSS's sinks and router bias in small models). Every parameter gets a recipe, and the graph run on
    other weights than the ones it was compiled with equals the module."""
    from neuron_opt.backends.cpu.backend import _runner
    from neuron_opt.backends.cpu.constants import build_constant
    from neuron_opt.backends.cpu.graphs import compile_graph

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 8)  # a bias of 8 values
            self.gain = torch.nn.Parameter(torch.randn(8), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.gain

    torch.manual_seed(0)
    module = Small().eval()
    recipes = compile_graph(module, (torch.randn(3, 16),), None, gemm, tmp_path / "g.so", "test")
    assert {s for r in recipes.values() for s in r.sources} == {"lin.weight", "lin.bias", "gain"}
    tensors = dict(module.state_dict())
    runner = _runner(tmp_path / "g.so", {c: build_constant([tensors[s] for s in r.sources], r)
                                         for c, r in recipes.items()})
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(runner.run([x])[0], module(x))


def test_load_rejects_mismatched_setup(compiled: tuple[Path, dict[Bucket, list[Path]], CpuBackend]) -> None:
    out, files, backend = compiled
    with pytest.raises(ArtifactError, match="num_blocks"):
        backend.load(files, out / "rank0.safetensors", lambda: make_model(1), CacheConfig(max_batch=SLOTS + 1,
                                                                                          max_model_len=MAX_LEN))
    # a graph written by an older cpu backend (format 1: one source per constant) is refused, not misread
    old = out.parent / (out.name + "_old")
    shutil.copytree(out, old)
    meta_path = old / "cpu" / "head_b1.meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "format": 1}))
    old_files = {b: [old / f.relative_to(out) for f in fs] for b, fs in files.items()}
    with pytest.raises(ArtifactError, match="format"):
        backend.load(old_files, old / "rank0.safetensors", lambda: make_model(1), CACHE)
    with pytest.raises(ConfigError, match="unknown cpu option"):
        CpuBackend(torch.float32, {"fast": True})


NEEDS_ONEDNN_BF16 = pytest.mark.skipif(
    not onednn_bf16_supported(),
    reason="this CPU has no oneDNN bf16 (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT); the cpu backend refuses bf16 here",
)


def test_bf16_is_refused_clearly_where_onednn_has_no_bf16(monkeypatch, tmp_path: Path) -> None:
    """An AVX2-only CPU (simulated: torch's own check answers no) gets a ConfigError naming the fix, at
    construction and from `compile` before anything is written; fp32 is unaffected."""
    import neuron_opt.backends.cpu.backend as cpu
    from neuron_opt.compiler import CompileRequest, compile_artifact

    monkeypatch.setattr(cpu, "onednn_bf16_supported", lambda: False)
    with pytest.raises(ConfigError, match="--dtype float32"):
        CpuBackend(torch.bfloat16)
    CpuBackend(torch.float32)
    from tiny import make_tiny

    ckpt = make_tiny("llama-gqa2", tmp_path / "ckpt", tokenizer=True)
    with pytest.raises(ConfigError, match="AVX-512"):
        compile_artifact(CompileRequest(model=str(ckpt), out=tmp_path / "art", backend="cpu", dtype="bfloat16",
                                        max_model_len=64, use_cache=False), log=lambda s: None, progress=False)
    assert not (tmp_path / "art").exists()


@NEEDS_ONEDNN_BF16
def test_onednn_weights_packed_once_for_every_m_hint() -> None:
    from neuron_opt.backends.cpu.backend import _WeightStore
    from neuron_opt.backends.cpu.constants import ConstantRecipe

    w = torch.randn(48, 32).bfloat16()
    store = _WeightStore({"w": w})
    a = store.get(("w",), ConstantRecipe(("x.w",), "onednn", batch=16))
    b = store.get(("w",), ConstantRecipe(("x.w",), "onednn", batch=1))
    assert a is b and len(store.built) == 1
    x = torch.randn(16, 32).bfloat16()
    torch.testing.assert_close(torch.ops.mkldnn._linear_pointwise(x, a, None, "none", [], ""), x @ w.t())


@NEEDS_ONEDNN_BF16
@pytest.mark.parametrize("options", [
    pytest.param({}, id="default"),  # cpu_ops' bf16_linear for the batch-1 graph and every head, oneDNN elsewhere
    # oneDNN for every layer graph, the C++ template for the heads (~80 s of compile: make test-slow)
    pytest.param({"one_row_gemm": "same", "head_gemm": "cpp"}, id="onednn_template", marks=pytest.mark.slow),
    pytest.param({"one_row_gemm": "cpp"}, id="one_row_cpp", marks=pytest.mark.slow),  # the C++ template there
    pytest.param({"gemm": "cpp"}, id="cpp", marks=pytest.mark.slow)])
def test_bf16_decode_matches_eager(tmp_path: Path, options: dict[str, str]) -> None:
    """bf16 graphs (oneDNN-reordered or template-packed weights) vs the bf16 eager model: teacher-forced decode,
    logits within bf16 rounding and the KV caches advancing."""
    backend = CpuBackend(torch.bfloat16, options)
    bucket = Bucket(DECODE, 1, 32)
    # prefill and batch-2 graphs loaded too: oneDNN packs for each graph's M, the executor holds one packing
    files = {b: [tmp_path / f for f in backend.compile_bucket(make_model(0, torch.bfloat16), b, CACHE, tmp_path)]
             for b in (bucket, Bucket(PREFILL, 1, 16), Bucket(DECODE, 2, 32))}
    backend.save_weights(make_model(7, torch.bfloat16), tmp_path / "w.safetensors")
    ex = backend.load(files, tmp_path / "w.safetensors", lambda: make_model(1, torch.bfloat16), CACHE)
    gemm_constants = [k for k in ex.constants if k[1].op in ("onednn", "pack")]
    head_constants = [k for k in ex.constants if k[0] == ("lm_head.weight",)]
    # fused projections (4 per layer) in each packing the graphs use; bf16_linear reads the weights as held
    packings = 1 if backend.options["one_row_gemm"] in ("same", "kernel", backend.options["gemm"]) else 2
    if backend.options["one_row_gemm"] == "kernel":  # q/k/v, o, gate/up and down: one operator call each
        calls = json.loads((tmp_path / "cpu" / "layer_decode_b1.json").read_text())["nodes"]
        assert sorted(n["node"]["target"] for n in calls) == ["neuron_opt::bf16_linear"] * 4 + [
            "neuron_opt::paged_attention"]
    head_packed = [k for k in head_constants if k[1].op in ("onednn", "pack")]
    assert len(gemm_constants) - len(head_packed) == 4 * CFG.num_hidden_layers * packings
    # every head computes fp32 logits: on bf16_linear over the weight as held, or on the C++ template with one
    # packing shared by the batch-1 and batch-2 heads
    assert [k[1].op for k in head_constants] == ["identity" if backend.options["head_gemm"] == "kernel" else "pack"]
    model = make_model(7, torch.bfloat16)
    k, v = allocate_kv(model, CACHE, torch.bfloat16)
    for pos in range(6):
        inp = decode_inputs([11 + pos], [pos], [1], 32)
        got = ex.run(bucket, inp)
        with torch.no_grad():
            want = model(*inp.arrays(), k, v, bucket.kv_len)
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
        assert (got != got.bfloat16().float()).any()  # fp32 logits, not widened bf16 (HeadGraph)
        torch.testing.assert_close(ex.k_caches[0].float(), k[0].float(), rtol=0.05, atol=0.05)
        assert ex.k_caches[0][where(1, pos)[0], :, where(1, pos)[1]].abs().sum() > 0
    # a batch-2 step (sequence 1 again, and sequence 2 at position 0): its head keeps fp32 logits too
    got2 = ex.run(Bucket(DECODE, 2, 32), decode_inputs([17, 11], [6, 0], [1, 2], 32))
    with torch.no_grad():
        want1 = model(*decode_inputs([17], [6], [1], 32).arrays(), k, v, bucket.kv_len)
    torch.testing.assert_close(got2[:1], want1, rtol=0.05, atol=0.05)
    assert (got2 != got2.bfloat16().float()).any()


@NEEDS_ONEDNN_BF16
@pytest.mark.slow  # a non-default option; ~25 s of compile
def test_bf16_logits_dtype_option_keeps_the_gemm_kernels_rounded_logits(tmp_path: Path) -> None:
    """`logits=dtype`: the head is the `gemm` kernel's (oneDNN) GEMM, its logits bf16 values widened, and no
    template packing of the head is built; the default (fp32) is the previous test."""
    backend = CpuBackend(torch.bfloat16, {"logits": "dtype"})
    bucket = Bucket(DECODE, 1, 32)
    files = {bucket: [tmp_path / f for f in backend.compile_bucket(make_model(0, torch.bfloat16), bucket, CACHE,
                                                                    tmp_path)]}
    backend.save_weights(make_model(7, torch.bfloat16), tmp_path / "w.safetensors")
    ex = backend.load(files, tmp_path / "w.safetensors", lambda: make_model(1, torch.bfloat16), CACHE)
    assert [k[1].op for k in ex.constants if k[0] == ("lm_head.weight",)] == ["onednn"]
    got = ex.run(bucket, decode_inputs([11], [0], [1], 32))
    assert torch.equal(got, got.bfloat16().float())


@NEEDS_ONEDNN_BF16
@pytest.mark.slow  # a non-default option; ~65 s of compile
def test_bf16_head_gemm_kernel_keeps_fp32_logits_on_the_operator(tmp_path: Path) -> None:
    """`head_gemm=kernel` (with `one_row_gemm=kernel`): every head calls cpu_ops' bf16_linear on the head weight as
    held (no template packing; the tied embedding reads the table itself), its logits fp32 sums (not widened bf16)
    within bf16 rounding of the eager model, a row's logits the same at batch 1 and 2; other dtypes and
    `logits=dtype` refuse it."""
    backend = CpuBackend(torch.bfloat16, {"one_row_gemm": "kernel", "head_gemm": "kernel"})
    buckets = (Bucket(DECODE, 1, 32), Bucket(PREFILL, 1, 16), Bucket(DECODE, 2, 32))
    files = {b: [tmp_path / f for f in backend.compile_bucket(make_model(0, torch.bfloat16), b, CACHE, tmp_path)]
             for b in buckets}
    backend.save_weights(make_model(7, torch.bfloat16), tmp_path / "w.safetensors")
    ex = backend.load(files, tmp_path / "w.safetensors", lambda: make_model(1, torch.bfloat16), CACHE)
    assert [k[1].op for k in ex.constants if k[0] == ("lm_head.weight",)] == ["identity"]  # bound as held
    for rows in (1, 2):
        calls = json.loads((tmp_path / "cpu" / f"head_b{rows}.json").read_text())["nodes"]
        assert [n["node"]["target"] for n in calls] == ["neuron_opt::bf16_linear"]
    model = make_model(7, torch.bfloat16)
    k, v = allocate_kv(model, CACHE, torch.bfloat16)
    for pos in range(4):
        inp = decode_inputs([11 + pos], [pos], [1], 32)
        got = ex.run(buckets[0], inp)
        with torch.no_grad():
            want = model(*inp.arrays(), k, v, 32)
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
        assert (got != got.bfloat16().float()).any()
    # the head alone at 1 and 2 rows: the row's logits bitwise the same
    head1, head2 = (ex._routes[graph_keys(b)][1] for b in (buckets[0], buckets[2]))
    x = torch.randn(2, CFG.hidden_size)
    assert torch.equal(head1(x[:1]), head2(x)[:1])
    with pytest.raises(ConfigError, match="head_gemm=kernel computes bf16 weights only"):
        CpuBackend(torch.float32, {"head_gemm": "kernel"})
    with pytest.raises(ConfigError, match="head_gemm=kernel computes fp32 logits"):
        CpuBackend(torch.bfloat16, {"head_gemm": "kernel", "logits": "dtype"})


@pytest.mark.parametrize("n_heads,n_kv,window", [(4, 2, None), (6, 2, 5), (3, 3, None), (4, 1, 7)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_ops_match_an_fp64_reference(n_heads: int, n_kv: int, window: int | None,
                                                      kv_dtype: torch.dtype) -> None:
    """cpu_graphs.DecodeAttention (decode layer graphs): fp32 queries (out of fp32 rope) over a bf16 or fp32 KV
    cache (upcast, as the model does), GQA/MHA, causal and sliding-window masks. Oracle: fp64 softmax attention
    written out by hand on the same inputs. Queries longer than 1 go to the inner ops (SDPA), checked against the
    same oracle."""
    from models.llama import TORCH_OPS
    from neuron_opt.backends.cpu.graphs import DecodeAttention

    g = torch.Generator().manual_seed(n_heads * 10 + n_kv)
    kv_len = 40
    k = torch.randn(2, n_kv, kv_len, 16, generator=g).to(kv_dtype)  # [B, n_kv, kv_len, D]
    v = torch.randn(2, n_kv, kv_len, 16, generator=g).to(kv_dtype)
    for positions in (torch.tensor([[20], [39]]), torch.tensor([[20, 21, 22], [37, 38, 39]])):
        q = torch.randn(2, n_heads, positions.shape[1], 16, generator=g)  # [B, n_heads, S, D]
        key_pos = torch.arange(kv_len)[None, None, :]
        mask = key_pos <= positions[:, :, None]  # [B, S, kv_len]
        if window is not None:
            mask &= key_pos > positions[:, :, None] - window
        kd, vd = (t.double().repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))  # [B, n_heads, kv, D]
        scores = (q.double() @ kd.transpose(-1, -2) * 0.25).masked_fill(~mask[:, None], float("-inf"))
        want = scores.softmax(-1) @ vd  # [B, n_heads, S, D]
        # the K/V scattered into blocks of 8 (rows' tables in shuffled pool order, the last block partly
        # beyond kv_len), read in place through the tables
        order = torch.randperm(2 * 6, generator=g) + 1
        pool_k = torch.zeros(13, n_kv, 8, 16, dtype=kv_dtype)
        pool_v = torch.zeros_like(pool_k)
        tables = order.view(2, 6)
        for b in range(2):
            for i in range(5):
                pool_k[tables[b, i]] = k[b, :, 8 * i:8 * i + 8]
                pool_v[tables[b, i]] = v[b, :, 8 * i:8 * i + 8]
        pool_k[tables[:, 5]] = 7.0  # a block past kv_len: its scores must stay masked
        got = DecodeAttention(TORCH_OPS).attention_blocks(q, pool_k, pool_v, tables, positions, mask, 0.25)
        assert got.dtype == torch.float32  # the pool's bf16 rows are read in q's dtype, as the model reads them
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="attention must be one of"):
        CpuBackend(torch.float32, {"attention": "fp16"})
    with pytest.raises(ConfigError, match="decode_attention must be one of"):
        CpuBackend(torch.float32, {"decode_attention": "flash"})


def test_head_graph_logits_against_fp64() -> None:
    """HeadGraph in bf16 on an fp32 residual, eager: the oneDNN/aten GEMM rounds the logits to bf16 before they
    widen (oracle: fp64 of the same values). Compiled on the C++ template the head keeps them in fp32:
    test_bf16_decode_matches_eager."""
    from neuron_opt.backends.cpu.graphs import HeadGraph

    m = make_model(3, torch.bfloat16)
    head = HeadGraph(m.model.norm, m.lm_head, torch.bfloat16)
    x = torch.randn(1, CFG.hidden_size) * 3
    got = head(x)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * m.model.norm.weight.double()
    want = normed @ m.lm_head.weight.double().t()  # [1, V]
    assert got.dtype == torch.float32 and got.shape == (1, CFG.vocab_size)
    torch.testing.assert_close(got.double(), want, rtol=2**-6, atol=2**-6)
    assert torch.equal(got, got.bfloat16().float())


def test_cpu_tp2_compile_is_refused_before_the_checkpoint_is_read(tmp_path: Path) -> None:
    from neuron_opt.compiler import CompileRequest, compile_artifact

    with pytest.raises(ConfigError, match="cpu backend compiles tp=1 only, got --tp 2; use --backend eager"):
        compile_artifact(CompileRequest(model=str(tmp_path / "no-such-checkpoint"), out=tmp_path / "art",
                                        backend="cpu", parallel=ParallelConfig(tp=2)), log=lambda s: None)
