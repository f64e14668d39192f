"""cpu backend (AOTInductor, C++ GEMM template, shared packed weights) against the eager model.

Oracle: the same LlamaForCausalLM run eagerly on its own KV caches. One module-scoped compile of a tiny
2-layer model serves every test (5 graphs: prefill/decode layer graphs with dynamic KV length, heads b1/b2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.llama import LlamaForCausalLM
from neuron_opt.backends.base import StepInputs, allocate_kv
from neuron_opt.backends.cpu import CpuBackend, CpuExecutor
from neuron_opt.backends.cpu_constants import pack_weight
from neuron_opt.buckets import DECODE, PREFILL, Bucket
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ArtifactError, ConfigError
from neuron_opt.parallel import head_layout

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=261, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  max_position_embeddings=1024, rope_parameters=(("rope_theta", 10000.0), ("rope_type", "default")),
                  tie_word_embeddings=True)
MAX_LEN, SLOTS = 1024, 3
BUCKETS = [Bucket(PREFILL, 1, 16), Bucket(PREFILL, 1, 32), Bucket(DECODE, 1, 32), Bucket(DECODE, 1, 1024),
           Bucket(DECODE, 2, 32), Bucket(DECODE, 2, 1024)]


def make_model(seed: int, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    m = LlamaForCausalLM(CFG, head_layout(CFG, ParallelConfig()), max_length=MAX_LEN)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.1) if name.endswith("norm.weight") else p.normal_(0.0, 0.1)
    return m.to(dtype).eval()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Bucket, list[Path]], CpuBackend]:
    out = tmp_path_factory.mktemp("cpu_art")
    backend = CpuBackend(torch.float32)
    model = make_model(0)
    files = {b: [out / f for f in backend.compile_bucket(model, b, SLOTS, out)] for b in BUCKETS}
    # serve different weights than the ones compiled with: graphs must not have baked any in
    backend.save_weights(make_model(7), out / "rank0.safetensors")
    return out, files, backend


@pytest.fixture(scope="module")
def executor(compiled: tuple[Path, dict[Bucket, list[Path]], CpuBackend]) -> CpuExecutor:
    out, files, backend = compiled
    return backend.load(files, out / "rank0.safetensors", lambda: make_model(123), SLOTS)


class Eager:
    """The oracle: the model itself with its own caches."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.k, self.v = allocate_kv(model, SLOTS, torch.float32)

    @torch.no_grad()
    def run(self, bucket: Bucket, inp: StepInputs) -> torch.Tensor:
        return self.model(inp.input_ids, inp.positions, inp.slot_ids, inp.last_index, self.k, self.v, bucket.kv_len)


def prefill_inputs(prompt: list[int], bucket: Bucket, slot: int) -> StepInputs:
    ids = torch.zeros(1, bucket.seq, dtype=torch.int64)
    ids[0, :len(prompt)] = torch.tensor(prompt)
    return StepInputs(ids, torch.arange(bucket.seq)[None].clone(), torch.tensor([slot]), torch.tensor([len(prompt) - 1]))


def decode_inputs(tokens: list[int], positions: list[int], slots: list[int]) -> StepInputs:
    return StepInputs(torch.tensor(tokens)[:, None], torch.tensor(positions)[:, None], torch.tensor(slots),
                      torch.zeros(len(tokens), dtype=torch.int64))


def reset(ex: CpuExecutor) -> None:
    for c in ex.k_caches + ex.v_caches:
        c.zero_()


def assert_kv_equal(ex: CpuExecutor, ref: Eager) -> None:
    for a, b in zip(ex.k_caches + ex.v_caches, ref.k + ref.v):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [15, 16, 17])  # one below, at and one above the 16-token prefill bucket
def test_prefill_then_decode_matches_eager_step_by_step(executor: CpuExecutor, n: int) -> None:
    reset(executor)
    ref = Eager(make_model(7))
    prompt = torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    bucket = Bucket(PREFILL, 1, 16 if n <= 16 else 32)
    got, want = executor.run(bucket, prefill_inputs(prompt, bucket, 1)), ref.run(bucket, prefill_inputs(prompt, bucket, 1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_kv_equal(executor, ref)
    tok_c, tok_e = [int(got.argmax())], [int(want.argmax())]
    for step in range(8):  # the KV cache must advance in the compiled graph at every step (pytorch#165444)
        pos = n + step
        bucket = Bucket(DECODE, 1, 32)
        got = executor.run(bucket, decode_inputs(tok_c[-1:], [pos], [1]))
        want = ref.run(bucket, decode_inputs(tok_e[-1:], [pos], [1]))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert_kv_equal(executor, ref)
        assert executor.k_caches[0][1, :, pos].abs().sum() > 0
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
        got = executor.run(bucket, decode_inputs(tokens, positions, slots))
        want = ref.run(bucket, decode_inputs(tokens, positions, slots))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert_kv_equal(executor, ref)
    got = executor.run(Bucket(DECODE, 2, 32), decode_inputs([7, 8], [7, 4], [0, 1]))
    want = ref.run(Bucket(DECODE, 2, 32), decode_inputs([7, 8], [7, 4], [0, 1]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_weights_are_bound_at_load_and_held_once(compiled: tuple[Path, dict[Bucket, list[Path]], CpuBackend],
                                                 executor: CpuExecutor) -> None:
    out, files, _ = compiled
    # graphs shared between buckets are compiled once and hold no weights
    so_files = {f for fs in files.values() for f in fs if f.suffix == ".so"}
    assert {f.stem for f in so_files} == {"layer_prefill_b1_dyn", "layer_decode_b1_dyn", "layer_decode_b2_dyn",
                                          "head_b1", "head_b2"}
    # every GEMM weight packed once and shared by all graphs; tied embedding read from the packed head
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in executor.constants.values()}
    param_bytes = sum(p.numel() * 4 for p in make_model(0).parameters())
    assert sum(storages.values()) <= 1.1 * param_bytes
    n_linear = 7 * CFG.num_hidden_layers + 1
    assert sum(1 for k in executor.constants if k[1].op == "pack") == n_linear


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


def test_load_rejects_mismatched_setup(compiled: tuple[Path, dict[Bucket, list[Path]], CpuBackend]) -> None:
    out, files, backend = compiled
    with pytest.raises(ArtifactError, match="num_slots"):
        backend.load(files, out / "rank0.safetensors", lambda: make_model(1), SLOTS + 1)
    with pytest.raises(ConfigError, match="unknown cpu option"):
        CpuBackend(torch.float32, {"fast": True})


@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["onednn", "cpp"])
def test_bf16_decode_matches_eager(tmp_path: Path, gemm: str) -> None:
    """bf16 graphs (oneDNN-reordered or template-packed weights) vs the bf16 eager model: teacher-forced decode,
    logits within bf16 rounding and the KV caches advancing."""
    backend = CpuBackend(torch.bfloat16, {"gemm": gemm})
    bucket = Bucket(DECODE, 1, 32)
    files = {bucket: [tmp_path / f for f in backend.compile_bucket(make_model(0, torch.bfloat16), bucket, SLOTS,
                                                                     tmp_path)]}
    backend.save_weights(make_model(7, torch.bfloat16), tmp_path / "w.safetensors")
    ex = backend.load(files, tmp_path / "w.safetensors", lambda: make_model(1, torch.bfloat16), SLOTS)
    model = make_model(7, torch.bfloat16)
    k, v = allocate_kv(model, SLOTS, torch.bfloat16)
    for pos in range(6):
        inp = decode_inputs([11 + pos], [pos], [1])
        got = ex.run(bucket, inp)
        with torch.no_grad():
            want = model(inp.input_ids, inp.positions, inp.slot_ids, inp.last_index, k, v, bucket.kv_len)
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
        torch.testing.assert_close(ex.k_caches[0].float(), k[0].float(), rtol=0.05, atol=0.05)
        assert ex.k_caches[0][1, :, pos].abs().sum() > 0


def test_fp32_attention_ops_match_an_fp64_reference() -> None:
    """cpu_graphs.Fp32Attention (used by bf16 layer graphs): bf16 in, bf16 out, fp32 math. Oracle: fp64 softmax
    attention written out by hand on the same bf16 inputs; the only error left is the final bf16 rounding."""
    from models.llama import TORCH_OPS
    from neuron_opt.backends.cpu_graphs import Fp32Attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 16, generator=g).bfloat16()  # [B, n_heads, S, D]
    k = torch.randn(2, 2, 40, 16, generator=g).bfloat16()  # [B, n_kv, kv_len, D]
    v = torch.randn(2, 2, 40, 16, generator=g).bfloat16()
    positions = torch.tensor([[20, 21, 22], [37, 38, 39]])
    mask = torch.arange(40)[None, None, :] <= positions[:, :, None]  # [B, S, kv_len]
    got = Fp32Attention(TORCH_OPS).attention(q, k, v, positions, mask, 0.25)
    assert got.dtype == torch.bfloat16
    kd, vd = (t.double().repeat_interleave(2, dim=1) for t in (k, v))  # [B, n_heads, kv_len, D]
    scores = (q.double() @ kd.transpose(-1, -2) * 0.25).masked_fill(~mask[:, None], float("-inf"))
    want = scores.softmax(-1) @ vd  # [B, n_heads, S, D]
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-6)
    with pytest.raises(ConfigError, match="attention must be one of"):
        CpuBackend(torch.bfloat16, {"attention": "fp16"})
