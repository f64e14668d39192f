"""The cpu backend's operators on GGUF blocks kept as stored (csrc/gguf_linear.cpp, neuron_opt.quant.gguf_blocks)
against gguf's own reference dequantizer (`gguf.quants.dequantize`): every value decoded to the same fp32 bits on
every code path this CPU runs (AVX-512, AVX2, scalar); the exact products (fp32 activations) equal to
dequantize-then-matmul in fp64 up to fp32 summation; the default products (activations rounded to llama.cpp's Q8_K /
Q8_0 blocks, integer dot products: VNNI, AVX2, scalar) equal to that rounding of x, written here in numpy from
ggml's reference quantizers, times gguf's dequantized weights, and within the rounding's bound of the exact ones;
a row's result independent of the rows beside it; then a tiny Llama whose linears are Q4_K, Q5_K, Q6_K, Q5_0 and
Q8_0 blocks (the LM head Q6_K) generates HF's greedy tokens on HF holding gguf's dequantization of the same blocks,
both on gguf's reference (eager) and on the operators.

Blocks: K-quant blocks have no quantizer in gguf's Python package, so they are random bytes (every bit of the
scales, minimums and values exercised) with their fp16 scales set to finite values; Q8_0 and Q5_0 blocks also come
from gguf's own quantizer. The operators must build here: a build failure fails this file (no fallback)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from helpers import hf_greedy, runner_greedy
from tiny import BASE

from models.build import rank_model_factory
from neuron_opt.backends.cpu import ops as cpu_ops
from neuron_opt.backends.cpu.graphs import use_cpu_layout
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig, ParallelConfig, QuantConfig
from neuron_opt.quant import gguf_blocks
from neuron_opt.quant.gguf import native_config
from neuron_opt.quant.weights import QuantizedWeight, QuantTensor, quantized_modules
from neuron_opt.runtime.runner import ModelRunner
from neuron_opt.weights import load_weights

KINDS = tuple(gguf_blocks.KERNEL_TYPES)  # Q5_0, Q8_0, Q4_K, Q5_K, Q6_K
# where each type keeps its fp16 scales (byte offsets in a block), and the scale bound giving |w| <= about amax
_SCALES = {"Q5_0": ((0,), 1 / 16), "Q8_0": ((0,), 1 / 127), "Q4_K": ((0, 2), 1 / (63 * 15)),
           "Q5_K": ((0, 2), 1 / (63 * 31)), "Q6_K": ((208,), 1 / (127 * 32))}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_ops.load() is None  # the operators build on this machine: no fallback form exists for GGUF blocks


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, amax: float = 0.1) -> np.ndarray:
    """uint8 [rows, row bytes]: random `kind` blocks, every byte random except the fp16 scales (finite, signed
    where the type's scale is signed)."""
    rng = np.random.default_rng(seed)
    _, size, nbytes = gguf_blocks.KERNEL_TYPES[kind]
    b = rng.integers(0, 256, size=(rows, cols // size, nbytes), dtype=np.uint8)
    offsets, bound = _SCALES[kind]
    for i, off in enumerate(offsets):
        lo = 0.0 if kind in ("Q4_K", "Q5_K") else -1.0  # Q4_K/Q5_K: d and dmin are >= 0
        d = (rng.uniform(lo, 1.0, size=(rows, cols // size)) * amax * (bound if i == 0 else 1 / 63))
        b[..., off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // size, 2)
    return b.reshape(rows, -1)


def reference(blocks: np.ndarray, kind: str, rows: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(rows, cols))


def as_rows(blocks: np.ndarray, kind: str, cols: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rows = blocks.shape[0]
    return gguf_blocks.to_rows(blocks, kind, rows, cols, width or blocks.shape[1])


def check_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y against x @ w.T in fp64, within fp32 summation error: 1e-5 of the sum of |x| |w| (K up to 768 here)."""
    want = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert y.dtype == torch.float32 and y.shape == want.shape
    assert bool(((y.double() - want).abs() <= bound).all()), float(((y.double() - want).abs() / bound).max())


def paths(activations: str = "fp32") -> list[str]:
    return cpu_ops.gguf_linear_paths(activations)


def act_block(kind: str) -> int:
    """Values per activation block for weights of `kind`: Q8_K's 256 for K-quants, Q8_0's 32 for the others."""
    return 256 if kind.endswith("_K") else 32


def q8_activations(x: torch.Tensor, size: int) -> torch.Tensor:
    """x rounded as llama.cpp rounds activations (fp64 [M, K], the values d * q), from ggml's reference quantizers:
    size 256 (quantize_row_q8_K_ref): mx the value of largest magnitude, iscale = -127 / mx, q = min(127,
    nearest(iscale x)), d = 1 / iscale; size 32 (quantize_row_q8_0, x86): d = fp16(amax / 127), q = nearest(x * 127
    / amax). fp32 arithmetic, ties to even; an all-zero block is zeros."""
    xb = x.float().numpy().reshape(x.shape[0], -1, size)
    if size == 256:
        mx = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)  # [M, blocks, 1]
        with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero block: replaced by zeros below
            iscale = np.float32(-127.0) / mx
            q = np.minimum(127, np.rint(iscale * xb))
        d = np.where(mx == 0, np.float32(0), np.float32(1.0) / iscale)
        q = np.where(mx == 0, 0, q)
    else:
        amax = np.abs(xb).max(-1, keepdims=True)
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.rint(xb * inv)
    return torch.from_numpy(q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_every_value_decodes_to_ggufs_fp32_bits(kind: str) -> None:
    cols = 512
    blocks = random_blocks(kind, 37, cols, seed=1)
    want = reference(blocks, kind, 37, cols)
    w, kinds = as_rows(blocks, kind, cols)
    for path in paths():
        got = cpu_ops.gguf_dequantize(w, kinds, cols, path)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), path


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0"])
def test_blocks_of_ggufs_own_quantizer_decode_to_its_values(kind: str) -> None:
    w = torch.randn(19, 96)
    blocks = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, kind))
    want = reference(blocks, kind, 19, 96)
    q, kinds = as_rows(blocks, kind, 96)
    for path in paths():
        assert torch.equal(cpu_ops.gguf_dequantize(q, kinds, 96, path), want), path


# (rows of x, output features, input features): one row and many, features not a multiple of any tile
SHAPES = [(1, 37, 512), (3, 5, 256), (7, 130, 768), (16, 9, 256)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gguf_linear_matches_the_dequantized_product_on_every_path(kind: str, shape) -> None:
    """Exact (fp32 x): x times gguf's values. q8 (the default): x rounded to llama.cpp's blocks times gguf's values,
    and within that rounding's bound of the exact product (each x value moves by at most 0.6 of its block's step
    amax / 127: half a step, and Q8_0's fp16 scale)."""
    m, n, k = shape
    blocks = random_blocks(kind, n, k, seed=m)
    w, kinds = as_rows(blocks, kind, k)
    ref = reference(blocks, kind, n, k)
    x = torch.randn(m, k)
    x[0, : act_block(kind)] = 0  # an all-zero activation block
    for path in paths("fp32"):
        check_product(cpu_ops.gguf_linear_path(x, w, kinds, path, "fp32"), x, ref)
    xb = x.bfloat16()  # widened exactly: the product of the bf16 values
    check_product(cpu_ops.gguf_linear_exact(xb, w, kinds), xb.float(), ref)
    assert torch.equal(cpu_ops.gguf_linear_exact(x, w, kinds),
                       cpu_ops.gguf_linear_path(x, w, kinds, paths("fp32")[0], "fp32"))
    xq = q8_activations(x, act_block(kind))
    exact = x.double() @ ref.double().T
    step = x.double().abs().reshape(m, -1, act_block(kind)).amax(-1, keepdim=True) / 127  # [M, blocks, 1]
    moved = (0.6 * step).expand(m, -1, act_block(kind)).reshape(m, k)  # the bound on |xq - x| per value
    for path in paths("q8"):
        y = cpu_ops.gguf_linear_path(x, w, kinds, path, "q8")
        check_product(y, xq, ref)
        assert bool(((y.double() - exact).abs() <= moved @ ref.double().abs().T + 1e-5 * (x.double().abs() @
                                                                                            ref.double().abs().T)).all())
    assert torch.equal(cpu_ops.gguf_linear(x, w, kinds), cpu_ops.gguf_linear_path(x, w, kinds, paths("q8")[0], "q8"))
    check_product(cpu_ops.gguf_linear(xb, w, kinds), q8_activations(xb.float(), act_block(kind)), ref)


@pytest.mark.parametrize("m", [1, 17, 70])
def test_gguf_linear_widened_matches_the_dequantized_product(m: int) -> None:
    blocks = random_blocks("Q4_K", 45, 512, seed=m)
    w, kinds = as_rows(blocks, "Q4_K", 512)
    x = torch.randn(m, 512)
    check_product(cpu_ops.gguf_linear_widened(x, w, kinds), x, reference(blocks, "Q4_K", 45, 512))


def mixed(k: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of every type in one tensor, padded to the widest (as fused q/k/v, or a projection whose type
    differs between layers): (qweight, kinds, the reference values)."""
    width = max(gguf_blocks.row_bytes(kind, k) for kind in KINDS)
    parts = [(as_rows(random_blocks(kind, 3 + i, k, seed=i), kind, k, width),
              reference(random_blocks(kind, 3 + i, k, seed=i), kind, 3 + i, k)) for i, kind in enumerate(KINDS)]
    return (torch.cat([p[0][0] for p in parts]), torch.cat([p[0][1] for p in parts]),
            torch.cat([p[1] for p in parts]))


def test_rows_of_every_type_padded_to_one_width_share_a_call() -> None:
    w, kinds, ref = mixed()
    x = torch.randn(5, 512)
    for path in paths("fp32"):
        check_product(cpu_ops.gguf_linear_path(x, w, kinds, path, "fp32"), x, ref)
        assert torch.equal(cpu_ops.gguf_dequantize(w, kinds, 512, path), ref), path
    check_product(cpu_ops.gguf_linear_widened(x, w, kinds), x, ref)
    k_rows = torch.tensor([int(k) in (12, 13, 14) for k in kinds])  # each row multiplies its own type's x blocks
    for path in paths("q8"):
        y = cpu_ops.gguf_linear_path(x, w, kinds, path, "q8")
        check_product(y[:, k_rows], q8_activations(x, 256), ref[k_rows])
        check_product(y[:, ~k_rows], q8_activations(x, 32), ref[~k_rows])


@pytest.mark.parametrize("activations", ["fp32", "q8"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(activations: str) -> None:
    w, kinds, _ = mixed()
    x = torch.randn(11, 512)
    for path in paths(activations):
        together = cpu_ops.gguf_linear_path(x, w, kinds, path, activations)
        for m in range(x.shape[0]):
            one = cpu_ops.gguf_linear_path(x[m:m + 1], w, kinds, path, activations)
            assert torch.equal(one, together[m:m + 1]), (path, m)


def test_bad_arguments_are_refused_with_the_argument_named() -> None:
    w, kinds = as_rows(random_blocks("Q4_K", 4, 256), "Q4_K", 256)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="GGML type id 2"):
        cpu_ops.gguf_linear(x, w, torch.full((4,), 2, dtype=torch.int8))  # Q4_0: no kernel here
    with pytest.raises(RuntimeError, match="are not a whole number"):
        cpu_ops.gguf_linear(torch.randn(2, 96), w, kinds)
    with pytest.raises(RuntimeError, match="needs 288 bytes"):
        cpu_ops.gguf_linear(torch.randn(2, 512), w, kinds)
    with pytest.raises(RuntimeError, match="kinds must be int8"):
        cpu_ops.gguf_linear(x, w, kinds.long())
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        cpu_ops.gguf_linear(x.double(), w, kinds)
    with pytest.raises(RuntimeError, match="path must be avx512, avx2 or generic for fp32"):
        cpu_ops.gguf_linear_path(x, w, kinds, "amx", "fp32")
    with pytest.raises(RuntimeError, match="path must be avx512_vnni, avx2 or generic for q8"):
        cpu_ops.gguf_linear_path(x, w, kinds, "avx512", "q8")
    with pytest.raises(RuntimeError, match="activations must be q8 or fp32, got 'int4'"):
        cpu_ops.gguf_linear_path(x, w, kinds, "generic", "int4")
    assert cpu_ops.gguf_linear(x[:0], w, kinds).shape == (0, 4)


def test_the_avx2_path_runs_where_the_cpu_has_it() -> None:
    """CI machines and users may have AVX2 only: that path is tested on every machine that has AVX2 (this one
    has AVX-512 and VNNI too, and runs every path)."""
    flags = set(open("/proc/cpuinfo").read().split())
    want = [p for p, f in (("avx512", {"avx512bw"}), ("avx2", {"avx2"})) if f <= flags] + ["generic"]
    assert paths("fp32") == want
    want = [p for p, f in (("avx512_vnni", {"avx512bw", "avx512_vnni"}), ("avx2", {"avx2"})) if f <= flags]
    assert paths("q8") == [*want, "generic"]


# --- a tiny model on the blocks ------------------------------------------------------------------------------
# each linear's type per layer: v_proj and down_proj change type between layers (as llama-quantize's Q4_K_M
# gives some layers Q6_K), so their rows are padded to the widest
LAYER_TYPES = [{"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_0", "gate_proj": "Q8_0",
                "up_proj": "Q4_K", "down_proj": "Q6_K"},
               {"q_proj": "Q4_K", "k_proj": "Q5_K", "v_proj": "Q4_K", "o_proj": "Q5_0", "gate_proj": "Q8_0",
                "up_proj": "Q4_K", "down_proj": "Q4_K"}]
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64, 128, 11, 5, 200, 31, 77, 8, 19, 2, 150, 33, 90]


@pytest.fixture(scope="module")
def blocks_model(tmp_path_factory):
    """(the HF oracle holding gguf's dequantization of the blocks, our config, the canonical tensors with every
    decoder linear and the LM head as gguf QuantTensors, the QuantConfig `--quantize auto` would give)."""
    import transformers

    from neuron_opt.checkpoint import open_checkpoint

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**{**BASE, "hidden_size": 256, "intermediate_size": 512},
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    quant: dict[str, QuantTensor] = {}
    widths: dict[str, int] = {}
    seed = 0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
                continue
            module = name.removesuffix(".weight")
            if module == "lm_head":
                kind, key = "Q6_K", "lm_head"
            elif module.startswith("model.layers."):
                layer, key = int(module.split(".")[2]), module.split(".", 3)[3]
                kind = LAYER_TYPES[layer][key.rsplit(".", 1)[-1]]
            else:
                continue
            rows, cols = p.shape
            seed += 1
            blocks = random_blocks(kind, rows, cols, seed=seed, amax=0.12)
            p.copy_(reference(blocks, kind, rows, cols))
            widths[key] = max(widths.get(key, 0), gguf_blocks.row_bytes(kind, cols))
            qweight, kinds = as_rows(blocks, kind, cols)
            quant[name] = QuantTensor("gguf", qweight, None, kinds=kinds, cols=cols)
    d = tmp_path_factory.mktemp("kquant") / "hf"
    hf.save_pretrained(d)
    ck = open_checkpoint(d)
    tensors = {**{k: v for k, v in ck.state_dict().items() if k not in quant}, **quant}
    qc = QuantConfig("gguf", source="gguf", lm_head=True, gguf_widths=tuple(sorted(widths.items())))
    return hf, ck.config, tensors, qc


def runner_for(cfg, tensors, qc, cpu: bool, gguf_exact: bool = False) -> ModelRunner:
    cache = CacheConfig(max_batch=1, max_model_len=64, block_size=16)
    model = rank_model_factory(cfg, ParallelConfig(), cache, 0, torch.float32, quant=qc)()
    load_weights(model, tensors, "blocks")
    if cpu:  # q/k/v and gate/up fused (rows of several types), every product on the operators
        use_cpu_layout(model, gguf_exact=gguf_exact)  # gguf_exact: the cpu backend's gguf_linear=exact
    buckets = BucketConfig.build(max_prompt_len=64, max_model_len=64, max_batch=1, min_prefill=16, min_decode=16)
    return ModelRunner(EagerExecutor(model.eval(), cache), buckets, cache, cfg.vocab_size)


def test_the_blocks_load_as_stored_padded_to_each_linears_width(blocks_model) -> None:
    _, cfg, tensors, qc = blocks_model
    model = rank_model_factory(cfg, ParallelConfig(), CacheConfig(max_batch=1, max_model_len=64), 0,
                               torch.float32, quant=qc)()
    load_weights(model, tensors, "blocks")
    mods = quantized_modules(model)
    assert set(mods) == {n.removesuffix(".weight") for n in tensors if isinstance(tensors[n], QuantTensor)}
    for name, m in mods.items():
        t = tensors[name + ".weight"]
        assert m.qweight.shape[1] == qc.gguf_width(name) >= t.qweight.shape[1]
        used = t.qweight.shape[1]
        assert torch.equal(m.qweight[:, :used], t.qweight) and not m.qweight[:, used:].any()
        assert torch.equal(m.kinds, t.kinds)


@pytest.mark.parametrize(("cpu", "exact"), [(False, True), (True, False), (True, True)],
                         ids=["gguf-reference", "operators", "operators-exact"])
def test_greedy_tokens_equal_hf_on_the_dequantized_blocks(blocks_model, cpu: bool, exact: bool) -> None:
    """Prefill (20 rows: gguf_linear_widened, exact) and decode steps and the head's row (one row: gguf_linear, x
    rounded to Q8_K / Q8_0 as llama.cpp rounds it, or gguf_linear_exact) on the operators, or gguf's reference
    dequantization in every product: HF's greedy tokens; the prompt's logits within fp32 summation error on the
    reference and the exact operators, within the head's activation rounding on the default ones (measured
    0.01)."""
    hf, cfg, tensors, qc = blocks_model
    ours_logits, ours = runner_greedy(runner_for(cfg, tensors, qc, cpu, gguf_exact=exact), PROMPT, 8)
    ref_logits, want = hf_greedy(hf, PROMPT, 8)
    tol = 1e-4 if exact else 3e-2
    torch.testing.assert_close(ours_logits, ref_logits, atol=tol, rtol=tol)
    assert ours == want


def test_a_float_weight_in_a_blocks_model_is_quantized_into_q8_0_by_gguf() -> None:
    qc = QuantConfig("gguf", source="gguf", gguf_widths=(("mlp.up_proj", 272),))
    q = QuantizedWeight(qc, 6, 256, qc.gguf_width("model.layers.0.mlp.up_proj"))
    w = torch.randn(6, 256)
    q.load(w)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(q.qweight, torch.from_numpy(want)) and bool((q.kinds == 8).all())


def test_auto_keeps_k_quant_files_as_stored_and_q8_0_files_int8() -> None:
    widths = (("mlp.down_proj", 210), ("self_attn.q_proj", 144))
    qc = native_config({"Q4_K": 1000, "Q6_K": 300, "Q5_0": 50, "Q8_0": 20}, "Q6_K", widths)
    assert (qc.method, qc.quantization_type, qc.source, qc.lm_head, qc.gguf_widths) == \
        ("gguf", "blocks", "gguf", True, widths)
    assert native_config({"Q8_0": 1000}, "Q8_0").method == "int8"
    assert native_config({"Q5_0": 1000, "Q4_K": 10}, None).method == "int8"
    with pytest.raises(Exception, match="--quantize auto chooses it"):
        QuantConfig("gguf", gguf_widths=widths)


@pytest.mark.slow
@pytest.mark.parametrize("gguf_linear", ["q8", "exact"])
def test_a_q4_k_m_file_compiles_with_auto_and_runs_every_linear_as_stored_on_cpu(tmp_path, gguf_linear: str) -> None:
    """llama-quantize's Q4_K_M of a tiny Llama (rows of 256 values: Q4_K and Q6_K linears, a Q6_K head):
    `compile --quantize auto` on the cpu backend keeps every linear's blocks (the artifact's kinds are the file's
    types, nothing converted), and the compiled graphs generate HF's greedy tokens on transformers' GGUF loader
    (gguf's reference dequantization of the same file), logits within the few-row products' Q8_K rounding
    (`gguf_linear=q8`, the default) or fp32 summation error (`gguf_linear=exact`)."""
    import transformers
    from llamacpp_gguf import convert, make_with_sentencepiece, quantize
    from safetensors import safe_open

    from neuron_opt.artifact import read_manifest
    from neuron_opt.checkpoint.gguf import gguf_to_hf_names
    from neuron_opt.compiler import CompileRequest, compile_artifact
    from neuron_opt.executors import load_model

    d = make_with_sentencepiece("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                                    num_key_value_heads=2), tmp_path / "hf")
    convert([(d, tmp_path / "f32.gguf", "f32")])
    path = quantize(tmp_path / "f32.gguf", tmp_path / "q4_k_m.gguf", "Q4_K_M")
    reader = gguf.GGUFReader(str(path))
    types = {gguf_to_hf_names(t.name)[0]: t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    assert {"Q4_K", "Q6_K"} <= set(types.values())
    out = tmp_path / "art"
    compile_artifact(CompileRequest(model=str(path), out=out, backend="cpu", dtype="float32", max_model_len=64,
                                    prefill_buckets=(32,), decode_buckets=(64,), quantize="auto",
                                    cache_dir=tmp_path / "cache", backend_options={"gguf_linear": gguf_linear}),
                     log=lambda s: None, progress=False)
    assert read_manifest(out).quant.method == "gguf"
    ids = {v: k for k, v in ((k, v[0]) for k, v in gguf_blocks.KERNEL_TYPES.items())}
    with safe_open(str(out / "weights" / "rank0.safetensors"), framework="pt") as f:
        stored = {k.removesuffix(".quant.kinds") + ".weight": f.get_tensor(k) for k in f.keys()
                  if k.endswith(".quant.kinds")}
    assert set(stored) == {n for n in types if n != "model.embed_tokens.weight"}
    for name, kinds in stored.items():
        assert {ids[int(k)] for k in kinds.unique()} == {types[name]}, name
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    prompt = [p % 400 for p in PROMPT]
    ours_logits, ours = runner_greedy(load_model(out).runner, prompt, 12)
    ref_logits, want = hf_greedy(hf, prompt, 12)
    # q8: the head's one row takes x rounded to Q8_K, as llama.cpp computes it (test_greedy_tokens_equal_hf_on_...)
    tol = 1e-4 if gguf_linear == "exact" else 3e-2
    torch.testing.assert_close(ours_logits, ref_logits, atol=tol, rtol=tol)
    assert ours == want
