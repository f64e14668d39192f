"""The cpu backend's C++ paged attention (torch.ops.neuron_opt.paged_attention, neuron_opt/backends/cpu/ops.py).

Oracle: fp64 softmax attention written out by hand on the same (cache-rounded) values. Exactness: a query's output
is bitwise the same whatever the number of queries beside it, which is what makes a verify step's rows the decode
step's. Then the graphs: a decode layer graph calls it through AOTInductor's proxy executor (`<key>.json`), and its
logits match the Inductor loop nest's (`decode_attention=fused`).

The operators must build wherever a C++ compiler is (Inductor needs one for every cpu graph): a build error fails
this module, it is never skipped. Only a machine with no compiler at all skips it, saying so. The fallback the
backend takes where they do not build is tested in test_cpu_ops_fallback.py."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import get_cxx_compiler

from neuron_opt.backends.cpu import ops as cpu_ops


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """Every test here needs the operators: a build error fails them all (the error says why); no compiler skips."""
    err = cpu_ops.load()
    if err is not None and shutil.which(get_cxx_compiler()) is None:
        pytest.skip(f"no C++ compiler ({get_cxx_compiler()!r} is not on PATH) to build the operators: {err}")
    assert err is None, f"the cpu backend's C++ operators did not build with {shutil.which(get_cxx_compiler())}: {err}"


def test_the_operators_build_and_compiles_call_them_by_default() -> None:
    from neuron_opt.backends.cpu.backend import CpuBackend

    assert cpu_ops.load() is None
    for op in ("paged_attention", "int8_linear", "int8_linear_widened", "moe_gather", "bf16_linear"):
        assert hasattr(torch.ops.neuron_opt, op), op
    opts = CpuBackend(torch.float32).options
    assert [opts[k] for k in ("decode_attention", "int8_linear", "moe_gather")] == ["kernel"] * 3


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux's /proc/self/maps")
def test_the_operators_share_torchs_openmp_runtime() -> None:
    """The operators link libgomp.so.1 (-fopenmp); the loader resolves that name to the copy torch loaded, so one
    OpenMP runtime (one thread pool, one spin-wait) serves torch, the AOTInductor graphs and the operators. Checked
    in a fresh process holding torch and the operators only: other libraries a test worker has imported may map
    their own private copies (scikit-learn's wheel vendors a renamed libgomp), which our operators cannot bind to."""
    code = (
        "from pathlib import Path\n"
        "from neuron_opt.backends.cpu import ops as cpu_ops\n"
        "assert cpu_ops.load() is None\n"
        "maps = Path('/proc/self/maps').read_text().splitlines()\n"
        "print(sorted({l.split()[-1] for l in maps if 'neuron_opt_cpu_ops' in l}))\n"
        "print(sorted({l.split()[-1] for l in maps if any(n in l for n in ('libgomp', 'libiomp', 'libomp'))}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ours, omp = (ast.literal_eval(line) for line in r.stdout.splitlines()[-2:])
    assert ours, "the operators' library is not mapped"
    assert len(omp) == 1, f"more than one OpenMP runtime mapped: {omp}"


# (query heads, kv heads, head dim, block size, kv_len, queries, sliding window)
SHAPES = [
    (9, 3, 64, 32, 500, 9, None),  # SmolLM2's attention, a k = 8 verify at position ~500
    (9, 3, 64, 32, 300, 1, None),  # its decode step
    (4, 2, 16, 8, 37, 3, None),  # head dim below a vector pair, kv_len not a multiple of the block
    (8, 8, 24, 5, 61, 1, 7),  # MHA, head dim not a multiple of 16, block size 5, sliding window
    (6, 2, 128, 16, 600, 4, None),  # head dim 128, three position chunks
    (4, 1, 32, 64, 64, 2, None),  # MQA, one block bigger than the transposes' tile
]


def _case(shape, dtype: torch.dtype, seed: int = 0):
    H, n_kv, D, per, kv_len, S, window = shape
    g = torch.Generator().manual_seed(seed)
    n_pool = -(-kv_len // per) + 3
    k = torch.randn(n_pool, n_kv, per, D, generator=g).to(dtype)
    v = torch.randn(n_pool, n_kv, per, D, generator=g).to(dtype)
    nb = -(-kv_len // per) + 1  # one table column past kv_len: masked
    tables = (torch.randperm(n_pool - 1, generator=g)[:nb] + 1)[None].repeat(2, 1)
    tables[1] = tables[1].flip(0)  # a second row reading the blocks in another order
    q = torch.randn(2, H, S, D, generator=g)
    positions = torch.stack([torch.arange(kv_len - S, kv_len), torch.arange(kv_len - S - 3, kv_len - 3)])
    key_pos = torch.arange(kv_len)[None, None, :]
    mask = key_pos <= positions[:, :, None]  # [B, S, kv_len]
    if window is not None:
        mask &= key_pos > positions[:, :, None] - window
    return q, k, v, tables, mask


def _reference(q, k, v, tables, mask, scale):
    B, H, S, D = q.shape
    n_kv = k.shape[1]
    kv_len = mask.shape[-1]
    keys = k[tables].double().permute(0, 2, 1, 3, 4).reshape(B, n_kv, -1, D)[:, :, :kv_len]
    vals = v[tables].double().permute(0, 2, 1, 3, 4).reshape(B, n_kv, -1, D)[:, :, :kv_len]
    keys, vals = (t.repeat_interleave(H // n_kv, dim=1) for t in (keys, vals))
    scores = (q.double() @ keys.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
    return scores.softmax(-1) @ vals


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_paged_attention_matches_an_fp64_reference(shape, dtype: torch.dtype) -> None:
    q, k, v, tables, mask = _case(shape, dtype)
    got = cpu_ops.paged_attention(q, k, v, tables, mask, 0.3)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), _reference(q, k, v, tables, mask, 0.3), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_querys_output_does_not_depend_on_the_queries_beside_it(shape, dtype: torch.dtype) -> None:
    q, k, v, tables, mask = _case(shape, dtype, seed=1)
    together = cpu_ops.paged_attention(q, k, v, tables, mask, 0.125)
    for s in range(q.shape[2]):
        alone = cpu_ops.paged_attention(q[:, :, s:s + 1].contiguous(), k, v, tables, mask[:, s:s + 1].contiguous(),
                                        0.125)
        assert torch.equal(alone, together[:, :, s:s + 1]), f"query {s}"


def test_a_row_with_no_visible_position_gets_zeros_not_nan() -> None:
    q, k, v, tables, mask = _case(SHAPES[2], torch.float32)
    mask[1] = False
    got = cpu_ops.paged_attention(q, k, v, tables, mask, 0.3)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got[:1].double(), _reference(q[:1], k, v, tables[:1], mask[:1], 0.3), rtol=1e-5,
                               atol=2e-5)


def test_bad_arguments_are_refused_with_the_argument_named() -> None:
    q, k, v, tables, mask = _case(SHAPES[2], torch.float32)
    bad = [
        ((q.bfloat16(), k, v, tables, mask), "q must be float32"),
        ((q, k, v[:, :1], tables, mask), "k_cache and v_cache"),
        ((q, k.half(), v.half(), tables, mask), "cache dtype"),
        ((q[:, :3], k, v, tables, mask), "do not share"),
        ((q, k, v, tables.int(), mask), "block_tables must be int64"),
        ((q, k, v, tables, mask[:, :1]), "mask must be bool"),
        ((q, k, v, tables + k.shape[0], mask), "out of range"),
    ]
    for args, needle in bad:
        with pytest.raises(RuntimeError, match=needle):
            cpu_ops.paged_attention(*args, 0.3)


def test_decode_graph_calls_the_kernel_and_matches_the_inductor_loop(tmp_path: Path) -> None:
    """A decode bucket compiled with the kernel (the default) lists its operator calls in `<key>.json` for
    AOTInductor's proxy executor and loads from a copy of the artifact; its logits match the same bucket compiled
    with the Inductor loop nest (`decode_attention=fused`)."""
    from test_backend_cpu import CACHE, decode_inputs, make_model

    from neuron_opt.backends.cpu.backend import CpuBackend
    from neuron_opt.buckets import DECODE, Bucket

    bucket = Bucket(DECODE, 2, 32)
    logits = {}
    for mode in ("kernel", "fused"):
        out = tmp_path / mode
        backend = CpuBackend(torch.float32, {"decode_attention": mode})
        rel = backend.compile_bucket(make_model(0), bucket, CACHE, out)
        meta = json.loads((out / "cpu" / "layer_decode_b2.meta.json").read_text())
        assert meta["extern_ops"] == (mode == "kernel")
        assert (out / "cpu" / "layer_decode_b2.json").is_file() == (mode == "kernel")
        if mode == "kernel":
            calls = json.loads((out / "cpu" / "layer_decode_b2.json").read_text())["nodes"]
            assert [n["node"]["target"] for n in calls] == ["neuron_opt::paged_attention"]
            (out / "cpu" / "layer_decode_b2.json").rename(out / "calls.json")  # without it: refused at load
        backend.save_weights(make_model(7), out / "w.safetensors")
        files = {bucket: [out / f for f in rel]}
        if mode == "kernel":
            from neuron_opt.errors import ArtifactError

            with pytest.raises(ArtifactError, match="operator calls"):
                backend.load(files, out / "w.safetensors", lambda: make_model(1), CACHE)
            (out / "calls.json").rename(out / "cpu" / "layer_decode_b2.json")
        ex = backend.load(files, out / "w.safetensors", lambda: make_model(1), CACHE)
        logits[mode] = ex.run(bucket, decode_inputs([17, 11], [6, 3], [1, 2], 32))
    torch.testing.assert_close(logits["kernel"], logits["fused"], rtol=1e-4, atol=1e-4)


# int8_linear: (M, N, K). K not a multiple of the vector width (72, 13) exercises the scalar tail, N not a multiple
# of the 4-feature tile (7, 30) the short last tile, M of 5, 9 and 16 the row tiles of 4 and their remainders
LINEAR_SHAPES = [(1, 960, 576), (1, 7, 13), (3, 30, 72), (4, 64, 128), (5, 33, 1536), (9, 40, 576), (16, 12, 96)]


def _linear_case(shape, x_dtype: torch.dtype, scale_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    M, N, K = shape
    x = torch.randn(M, K, generator=g).to(x_dtype)
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = (torch.rand(N, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    return x, w, scale


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("x_dtype,scale_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                 (torch.float32, torch.bfloat16)])
def test_int8_linear_matches_an_fp64_reference(shape, x_dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    x, w, scale = _linear_case(shape, x_dtype, scale_dtype)
    got = cpu_ops.int8_linear(x, w, scale)
    assert got.dtype == torch.float32 and got.shape == (shape[0], shape[1])
    ref = (x.double() @ w.double().T) * scale.double()
    # fp32 sums of K terms of size |x| * 127 * scale: bound the error by K * eps * the terms' magnitudes
    bound = shape[2] * 2.0 ** -23 * ((x.double().abs() @ w.double().abs().T) * scale.double())
    assert bool(((got.double() - ref).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("shape", [(17, 960, 576), (160, 30, 72), (40, 33, 13), (2, 64, 1536)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_widened_matches_an_fp64_reference(shape, x_dtype: torch.dtype) -> None:
    """The many-row form: the GEMM's fp32 sums, rounded to x's dtype, then scaled in fp32."""
    x, w, scale = _linear_case(shape, x_dtype, torch.bfloat16)
    got = cpu_ops.int8_linear_widened(x, w, scale)
    assert got.dtype == torch.float32 and got.shape == (shape[0], shape[1])
    acc = x.double() @ w.double().T
    rounding = 2.0 ** -8 if x_dtype == torch.bfloat16 else 2.0 ** -23  # of the GEMM's output, in x's dtype
    bound = (shape[2] * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T) + rounding * acc.abs()) * scale.double()
    assert bool(((got.double() - acc * scale.double()).abs() <= 1.01 * bound + 1e-30).all())


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_an_int8_linear_rows_result_does_not_depend_on_the_rows_beside_it(shape) -> None:
    """What keeps int8 verify rows bitwise the decode step's: row m alone equals row m of the M-row call."""
    x, w, scale = _linear_case(shape, torch.bfloat16, torch.bfloat16, seed=1)
    together = cpu_ops.int8_linear(x, w, scale)
    for m in range(x.shape[0]):
        assert torch.equal(cpu_ops.int8_linear(x[m:m + 1], w, scale), together[m:m + 1]), f"row {m}"


def test_int8_linear_with_no_rows_or_features_returns_an_empty_result() -> None:
    x, w, scale = _linear_case((2, 8, 32), torch.float32, torch.float32)
    assert cpu_ops.int8_linear(x[:0], w, scale).shape == (0, 8)
    assert cpu_ops.int8_linear(x, w[:0], scale[:0]).shape == (2, 0)


def test_int8_linear_refuses_bad_arguments_with_the_argument_named() -> None:
    x, w, scale = _linear_case((2, 8, 32), torch.float32, torch.float32)
    bad = [
        ((x.half(), w, scale), "x must be float32 or bfloat16"),
        ((x[None], w, scale), "x must be float32 or bfloat16"),
        ((x, w.to(torch.uint8), scale), "w must be int8"),
        ((x[:, :16], w, scale), "x has 16 input features, w has 32"),
        ((x, w, scale[:4]), "scale must be float32 or bfloat16 \\[N\\] with N = 8"),
        ((x, w, scale.half()), "scale must be float32 or bfloat16"),
    ]
    for op in (cpu_ops.int8_linear, cpu_ops.int8_linear_widened):
        for args, needle in bad:
            with pytest.raises(RuntimeError, match=needle):
                op(*args)


# bf16_linear: (M, K, output features of each weight). K not a multiple of the vector width (13, 72) exercises the
# fma path's scalar tail and the avx512_bf16 path's masked last step (13 < 32, 72 = 2 x 32 + 8), feature counts not
# multiples of the 4-feature tile (7, 30, 1) short tiles at each weight's end
BF16_LINEAR_SHAPES = [(1, 576, (576, 192, 192)), (1, 13, (7,)), (3, 72, (30, 1)), (5, 1536, (33,)), (9, 128, (8, 12)),
                      (16, 96, (12, 4, 5)), (2, 33, (9,))]
# every path of the operator; a test of a path this CPU does not run says so and skips (the fma path runs anywhere)
BF16_LINEAR_PATHS = ["avx512_bf16", "fma"]


def _bf16_linear_case(shape, x_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    M, K, ns = shape
    x = torch.randn(M, K, generator=g).to(x_dtype)
    return x, [torch.randn(n, K, generator=g).to(torch.bfloat16) for n in ns]


def _runs(path: str, x_dtype: torch.dtype) -> None:
    runs = cpu_ops.bf16_linear_paths(torch.empty(0, dtype=x_dtype))
    assert "fma" in runs, runs
    if path not in runs:
        pytest.skip(f"bf16_linear path {path} does not run for {x_dtype} x on this CPU (it runs {runs})")


@pytest.mark.parametrize("path", BF16_LINEAR_PATHS)
@pytest.mark.parametrize("shape", BF16_LINEAR_SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_bf16_linear_matches_an_fp64_reference(shape, x_dtype: torch.dtype, path: str) -> None:
    _runs(path, x_dtype)
    x, ws = _bf16_linear_case(shape, x_dtype)
    got = cpu_ops.bf16_linear_path(x, ws, path)
    assert got.dtype == torch.float32 and got.shape == (shape[0], sum(shape[2]))
    ref = torch.cat([x.double() @ w.double().T for w in ws], dim=1)
    # fp32 sums of K exact products (bf16 x bf16 fits fp32): bound the error by K * eps * the terms' magnitudes
    bound = shape[1] * 2.0 ** -23 * torch.cat([x.double().abs() @ w.double().abs().T for w in ws], dim=1)
    assert bool(((got.double() - ref).abs() <= bound + 1e-30).all())
    # and torch's own product in fp32 (x @ W.T), within fp32 summation error
    torch.testing.assert_close(got, torch.cat([x.float() @ w.float().T for w in ws], dim=1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_bf16_linear_takes_the_first_path_this_cpu_runs(x_dtype: torch.dtype) -> None:
    """avx512_bf16 for a bf16 x wherever the CPU has it, fma otherwise (an fp32 x always: its values are not bf16)."""
    x, ws = _bf16_linear_case((3, 72, (30, 1)), x_dtype)
    paths = cpu_ops.bf16_linear_paths(x)
    assert paths[-1] == "fma" and (x_dtype == torch.bfloat16 or paths == ["fma"]), paths
    assert torch.equal(cpu_ops.bf16_linear(x, ws), cpu_ops.bf16_linear_path(x, ws, paths[0]))


@pytest.mark.parametrize("path", BF16_LINEAR_PATHS)
@pytest.mark.parametrize("shape", BF16_LINEAR_SHAPES)
def test_a_bf16_linear_rows_result_does_not_depend_on_the_rows_or_weights_beside_it(shape, path: str) -> None:
    """Row m alone equals row m of the M-row call (bf16 verify rows are then the decode step's), and each weight's
    columns equal that weight called alone."""
    _runs(path, torch.bfloat16)
    x, ws = _bf16_linear_case(shape, torch.bfloat16, seed=1)
    together = cpu_ops.bf16_linear_path(x, ws, path)
    for m in range(x.shape[0]):
        assert torch.equal(cpu_ops.bf16_linear_path(x[m:m + 1], ws, path), together[m:m + 1]), f"row {m}"
    assert torch.equal(torch.cat([cpu_ops.bf16_linear_path(x, [w], path) for w in ws], dim=1), together)


def test_bf16_linear_refuses_bad_arguments_with_the_argument_named() -> None:
    x, ws = _bf16_linear_case((2, 32, (8,)), torch.float32)
    bad = [
        ((x.half(), ws), "x must be float32 or bfloat16"),
        ((x[None], ws), "x must be float32 or bfloat16"),
        ((x, []), "no weights"),
        ((x, [ws[0].float()]), "weights must be bfloat16"),
        ((x[:, :16], ws), "x has 16 input features, a weight has 32"),
    ]
    for args, needle in bad:
        with pytest.raises(RuntimeError, match=needle):
            cpu_ops.bf16_linear(*args)
    assert cpu_ops.bf16_linear(x[:0], ws).shape == (0, 8)
    with pytest.raises(RuntimeError, match="path must be avx512_bf16 or fma, got 'amx'"):
        cpu_ops.bf16_linear_path(x, ws, "amx")
    with pytest.raises(RuntimeError, match="path avx512_bf16 takes a bfloat16 x, got Float"):
        cpu_ops.bf16_linear_path(x, ws, "avx512_bf16")
    if "avx512_bf16" in cpu_ops.bf16_linear_paths(x.bfloat16()):
        assert cpu_ops.bf16_linear_path(x[:0].bfloat16(), ws, "avx512_bf16").shape == (0, 8)
    else:
        with pytest.raises(RuntimeError, match="does not run on this CPU"):
            cpu_ops.bf16_linear_path(x.bfloat16(), ws, "avx512_bf16")


# moe_gather: (T, H, I, E, k, dtype). H and I not multiples of the vector width (40, 24, 100, 36) exercise the
# scalar tails, 2I and H not multiples of the 4-row tile (2 * 9, 18) the short last tile
MOE_SHAPES = [(1, 512, 1024, 8, 2, torch.bfloat16), (3, 40, 24, 4, 2, torch.float32), (9, 64, 96, 6, 3, torch.bfloat16),
              (2, 100, 36, 5, 1, torch.float32), (4, 18, 9, 3, 2, torch.bfloat16)]


def _moe_case(shape, seed: int = 0):
    T, H, I, E, k, dtype = shape
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.05).to(dtype)
    ids = torch.randint(0, E, (T, k), generator=g)
    weights = torch.rand(T, k, generator=g)
    return t, gate_up, down, ids, weights


@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_moe_gather_matches_an_fp64_reference(shape) -> None:
    """The selected experts as models.moe.Experts.gather computes them, in fp64 (the SwiGLU output rounded to t's
    dtype as there)."""
    t, gate_up, down, ids, weights = _moe_case(shape)
    got = cpu_ops.moe_gather(t, gate_up, down, ids, weights)
    assert got.dtype == torch.float32 and got.shape == t.shape
    I = down.shape[2]
    h = (gate_up[ids].double() * t.double()[:, None, None, :]).sum(-1)  # [T, k, 2I]
    a = (torch.nn.functional.silu(h[..., :I]) * h[..., I:]).to(t.dtype).double()
    ref = ((down[ids].double() * a[:, :, None, :]).sum(-1) * weights.double()[..., None]).sum(1)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_moe_gather_refuses_bad_arguments_with_the_argument_named() -> None:
    t, gate_up, down, ids, weights = _moe_case(MOE_SHAPES[1])
    bad = [
        ((t.half(), gate_up, down, ids, weights), "t must be float32 or bfloat16"),
        ((t, gate_up, down.bfloat16(), ids, weights), "of one dtype"),
        ((t, gate_up[:, :-1], down, ids, weights), "shapes do not fit"),
        ((t, gate_up, down, ids.int(), weights), "ids must be int64"),
        ((t, gate_up, down, ids, weights.double()), "weights must be float32"),
        ((t, gate_up, down, ids + gate_up.shape[0], weights), "expert id out of range"),
    ]
    for args, needle in bad:
        with pytest.raises(RuntimeError, match=needle):
            cpu_ops.moe_gather(*args)


def test_a_tokens_experts_do_not_depend_on_the_tokens_beside_it() -> None:
    """Tokens that select the same expert share one read of it; each token's result is bitwise its result alone."""
    t, gate_up, down, ids, weights = _moe_case((9, 64, 96, 3, 2, torch.bfloat16), seed=2)  # 18 pairs, 3 experts
    together = cpu_ops.moe_gather(t, gate_up, down, ids, weights)
    for i in range(t.shape[0]):
        alone = cpu_ops.moe_gather(t[i:i + 1], gate_up, down, ids[i:i + 1], weights[i:i + 1])
        assert torch.equal(alone, together[i:i + 1]), f"token {i}"
