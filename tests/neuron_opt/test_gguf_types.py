"""Every family at every type llama-quantize writes: GGUF files as users download them, checked against exact oracles.

Each family's tiny HF checkpoint, its rows whole K-quant super-blocks (256 values: tests/llamacpp_gguf.py's
`source_checkpoint(..., wide=True)`), is converted to F32 by llama.cpp's converter and requantized by llama.cpp's
`llama-quantize` to each type (`--pure`: every matrix in the type; Q4_K_M as shipped, a mix). At these widths
llama-quantize writes every type for every family (narrower rows would fall back to other types). Per (family, type):
(a) every tensor of ours equals gguf's reference dequantization of the file's bytes (`gguf.quants.dequantize`),
    undone from llama.cpp's layout here (q/k row permutation, Gemma's 1 + w norms, Phi-3's fused projections,
    stacked experts), and for Llama also transformers' own GGUF loader;
(b) greedy tokens (and the prompt's logits) equal HF transformers' on the source checkpoint with its weights replaced
    by (a)'s reference, fp32: an exact oracle for every family, where transformers' GGUF loader reads only Llama's
    and Mistral's files right (tests/neuron_opt/test_gguf_families.py);
(c) `--quantize auto` picks the format docs/quantization.md states for the type;
and per family, its Q4_K_M file compiles with default flags (the eager backend) and generates HF's greedy tokens.

The families whose converter reads a BPE vocabulary (OLMo 2, the Qwen MoEs, GPT-OSS) get the default model's cut to
1,024 tokens (tests/llamacpp_gguf.py's cut_bpe): gguf's reader parses 49,152 tokens and merges in seconds, several
times per file. Slow: llama-quantize is built once (minutes) into the cache outside the repository.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import checkpoint_greedy
from llamacpp_gguf import convert, quantize, source_checkpoint
from safetensors.torch import save_file
from tiny import load_hf

from neuron_opt.api import LLM
from neuron_opt.checkpoint import native_quant, open_checkpoint
from neuron_opt.checkpoint.gguf import gguf_to_hf_names, name_scheme
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.config import QuantConfig
from neuron_opt.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3", "mixtral",
            "qwen2-moe", "qwen3-moe", "gpt-oss"]
MOE = ("mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss")
PERMUTED = ("llama", "mistral", "mixtral", "granite", "smollm3")  # llama.cpp's converter permutes their q/k rows
# llama-quantize type -> `--quantize auto`'s (method, quantization type) for a file of it (docs/quantization.md)
INT8 = ("int8", "per_channel_symmetric")
GGUF = ("gguf", "")  # K-quant blocks kept as stored (the cpu backend's gguf operators)
TYPES = {"Q4_0": ("int4", "group_symmetric"), "Q4_1": ("int4", "group_asymmetric"), "Q5_0": INT8, "Q5_1": INT8,
         "Q8_0": INT8, "Q2_K": INT8, "Q3_K": INT8, "Q4_K": GGUF, "Q5_K": GGUF, "Q6_K": GGUF, "IQ4_NL": INT8,
         "IQ4_XS": INT8, "MXFP4_MOE": INT8, "Q4_K_M": GGUF}
MAX_LEN = 64
PROMPT = [1, 17, 42, 99, 5, 123, 7, 300, 11, 250]


@pytest.fixture(autouse=True, scope="module")
def _private_cache(files, tmp_path_factory):
    """The files' dequantized tensors cached in the module's own directory; the checkpoints are made before, with the
    shared cache (make_tiny reads the default model's tokenizer from it)."""
    from neuron_opt import envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(envs, "CACHE_DIR", tmp_path_factory.mktemp("cache"))
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """files(family, type) -> (the family's wide HF checkpoint, llama-quantize's file of it in `type`): the
    checkpoints and their F32 files made at once (one converter process), each type's file once."""
    root = tmp_path_factory.mktemp("gguf-types")
    dirs = {f: source_checkpoint(f, root / f, wide=True) for f in FAMILIES}
    convert([(d, root / f"{f}.gguf", "f32") for f, d in dirs.items()], bpe_pre="smollm")
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, kind: str) -> tuple[Path, Path]:
        if (family, kind) not in made:
            made[family, kind] = quantize(root / f"{family}.gguf", root / f"{family}-{kind}.gguf", kind)
        return dirs[family], made[family, kind]

    return get


def unpermute(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter permutes rows as `w.reshape(n_heads, 2, D // 2, ...).swapaxes(1, 2)`: applied to the
    row indices, that gives the source row of each stored row, which puts them back."""
    rows = x.shape[0]
    src = np.arange(rows).reshape(n_heads, 2, rows // n_heads // 2).swapaxes(1, 2).reshape(-1)
    out = torch.empty_like(x)
    out[torch.from_numpy(src)] = x
    return out


def reference(path: Path, family: str, cfg) -> dict[str, torch.Tensor]:
    """Every weight of the file dequantized by gguf's reference code, under the canonical (HF, unfused, one tensor
    per expert) names, with llama.cpp's layout undone."""
    reader = gguf.GGUFReader(str(path))
    scheme = name_scheme(reader)
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name.startswith("rope_factors"):  # Phi-3's longrope factors: config values (checked by ck.config)
            continue
        x = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        x = x.reshape(tuple(int(d) for d in reversed(t.shape)))
        names = gguf_to_hf_names(t.name, scheme, cfg.num_experts)
        for name, part in zip(names, x.unbind(0) if len(names) > 1 else (x,), strict=True):
            if family in PERMUTED and ".q_proj." in name:
                part = unpermute(part, heads)
            elif family in PERMUTED and ".k_proj." in name:
                part = unpermute(part, kv)
            elif family.startswith("gemma") and name.endswith("norm.weight"):
                part = part - 1.0  # stored as the factor the norm scales by
            elif name.endswith("shared_expert_gate.weight"):
                part = part.reshape(1, -1)  # [1, H]; llama-quantize writes it as a vector [H]
            if ".qkv_proj." in name:
                q, k, v = part.split([heads * hd, kv * hd, kv * hd])
                out |= {name.replace("qkv_proj", f"{x}_proj"): w for x, w in zip("qkv", (q, k, v), strict=True)}
            elif ".gate_up_proj." in name:
                gate, up = part.chunk(2)
                out |= {name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up}
            else:
                out[name] = part
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def hf_layout(sd: dict[str, torch.Tensor], family: str, cfg) -> dict[str, torch.Tensor]:
    """Canonical tensors as the family's HF checkpoint stores them: Phi-3's projections fused, GPT-OSS's experts
    stacked (gate and up interleaved in gate_up_proj [E, H, 2I], down_proj [E, I, H]); the others as they are."""
    sd = dict(sd)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        if family == "phi3":
            sd[f"{p}.self_attn.qkv_proj.weight"] = torch.cat([sd.pop(f"{p}.self_attn.{x}_proj.weight") for x in "qkv"])
            sd[f"{p}.mlp.gate_up_proj.weight"] = torch.cat([sd.pop(f"{p}.mlp.{x}_proj.weight") for x in ("gate", "up")])
        elif family == "gpt-oss":
            def stack(part: str, suffix: str, p: str = p) -> torch.Tensor:  # [E, out, in] or [E, out]
                return torch.stack([sd.pop(f"{p}.mlp.experts.{e}.{part}_proj.{suffix}")
                                    for e in range(cfg.num_experts)])

            gate, up = stack("gate", "weight").transpose(1, 2), stack("up", "weight").transpose(1, 2)  # [E, H, I]
            sd[f"{p}.mlp.experts.gate_up_proj"] = torch.stack([gate, up], dim=-1).flatten(-2)
            sd[f"{p}.mlp.experts.gate_up_proj_bias"] = torch.stack([stack("gate", "bias"), stack("up", "bias")],
                                                                   dim=-1).flatten(-2)
            sd[f"{p}.mlp.experts.down_proj"] = stack("down", "weight").transpose(1, 2)
            sd[f"{p}.mlp.experts.down_proj_bias"] = stack("down", "bias")
    return {k: v.contiguous() for k, v in sd.items()}


def hf_with_weights(src: Path, sd: dict[str, torch.Tensor], out: Path):
    """HF transformers' model of the checkpoint `src` (its config and code), with the weights `sd`."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(sd, str(out / "model.safetensors"))
    return load_hf(out)


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """HF's prompt logits and greedy tokens, each from a full forward over the text so far: HF's cached decode (its
    `generate`) can flip a near-tied top-k expert choice its own full forward does not (Qwen3-MoE at Q5_0 here)."""
    ids = list(prompt)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
        for _ in range(n - 1):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return logits, ids[len(prompt):]


def eager_greedy(ck, n: int) -> tuple[torch.Tensor, list[int]]:
    """Our eager model of `ck` (fp32): the prompt's last logits and `n` greedy tokens."""
    return checkpoint_greedy(ck, PROMPT, n, MAX_LEN)


def stored_type(kind: str) -> str:
    return "MXFP4" if kind == "MXFP4_MOE" else kind


def auto_format(family: str, kind: str, head_type: str) -> QuantConfig | tuple:
    """docs/quantization.md's `--quantize auto`: Q4_0/Q4_1 int4 (groups of 32) read as stored, except Phi-3's fused
    linears, requantized; K-quant files (Q4_K, Q5_K, Q6_K, Q4_K_M) as stored in the `gguf` format, except Phi-3's
    fused linears, int8; every other quantized type int8 per channel; the LM head quantized when the file ships it
    so; mixtures of experts in the compute dtype. (The `gguf` format's row widths are left out of the comparison.)"""
    if family in MOE:
        return QuantConfig()
    method, qtype = TYPES[kind]
    head = head_type not in ("F32", "F16", "BF16")
    if method == "gguf" and family == "phi3":
        return QuantConfig(*INT8, 0, lm_head=head)
    if method == "gguf":  # the same fields as a gguf QuantConfig (which needs its widths to be built)
        return ("gguf", "blocks", 0, "gguf", head)
    int4 = method == "int4"
    return QuantConfig(method, qtype, 32 if int4 else 0, source="gguf" if int4 and family != "phi3" else "",
                       lm_head=head_type not in ("F32", "F16", "BF16"))


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_type_equals_gguf_reference_and_hf(family, kind, files, tmp_path):
    d, path = files(family, kind)
    reader = gguf.GGUFReader(str(path))
    matrices = {t.name: t.tensor_type.name for t in reader.tensors
                if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) >= 2
                and "ffn_gate_inp" not in t.name}
    if kind == "Q4_K_M":  # Q4_K and Q6_K linears
        assert {"Q4_K", "Q6_K"} <= set(matrices.values()), matrices
    else:  # every matrix in the type; the routers llama-quantize keeps F32
        assert set(matrices.values()) == {stored_type(kind)}, matrices
    ck = open_checkpoint(path)
    ours, ref = ck.state_dict(), reference(path, family, ck.config)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name
    if family == "llama":  # transformers' GGUF loader: the same tensors, its own layout code
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32)
        theirs = hf.state_dict()
        for name, t in ref.items():
            assert torch.equal(theirs[name], t), name
    ours_logits, ours_ids = eager_greedy(ck, 12)
    ref_logits, ref_ids = hf_greedy(hf_with_weights(d, hf_layout(ref, family, ck.config), tmp_path / "hf"), PROMPT,
                                    12)
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=0)
    assert ours_ids == ref_ids
    head = next(t.tensor_type.name for name in ("output.weight", "token_embd.weight") for t in reader.tensors
                if t.name == name)
    qc = native_quant(ck)
    assert (qc.method != "gguf") == (qc.gguf_widths == ())  # the gguf format records every linear's row width
    want = auto_format(family, kind, head)
    if isinstance(want, tuple):
        assert (qc.method, qc.quantization_type, qc.group_size, qc.source, qc.lm_head) == want
    else:
        assert qc == want


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_k_m_compiles_with_default_flags(family, files, tmp_path):
    """The most downloaded kind, compiled as a user would (`neuron-opt compile --model FILE`, on the eager backend),
    generates the greedy tokens of HF transformers on the file's weights."""
    d, path = files(family, "Q4_K_M")
    compile_artifact(CompileRequest(model=str(path), out=tmp_path / "art", backend="eager"), log=lambda s: None,
                     progress=False)
    llm = LLM(tmp_path / "art")
    got = llm.generate_ids(PROMPT, SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)).token_ids
    ck = open_checkpoint(path)
    _, want = hf_greedy(hf_with_weights(d, hf_layout(reference(path, family, ck.config), family, ck.config),
                                        tmp_path / "hf"), PROMPT, 8)
    assert got == want
