"""GGUF files as llama.cpp writes them, for every family we map: a tiny random HF checkpoint converted by llama.cpp's
own converter (tests/llamacpp_gguf.py: the llama-cpp-python sdist's convert_hf_to_gguf.py), then opened by us.

The oracles: the HF checkpoint the file was converted from (at F32 the file holds its exact values: our canonical
tensors equal them bit for bit, Gemma's norms to the rounding of the converter's 1 + w), HF transformers' greedy
tokens on it (fp32), and transformers' own GGUF loader where it reads the family right (Llama, Mistral: the same
weights to the bit at every type). transformers 5.25's GGUF loader misreads the others' files (Gemma 3's rope
scaling and local base, Qwen-MoE's expert widths, Mixtral's experts) or refuses them (OLMo 2, Granite, SmolLM3,
GPT-OSS), so for those the oracle is HF on the source checkpoint. llama-quantize's types (K-quants, IQ4, MXFP4),
for every family, are tests/neuron_opt/test_gguf_types.py's (slow tier: building llama-quantize takes minutes).
Every family runs at tp 1, a subset on two TP rank processes (the XLA tier's: tests/xla/test_device_gguf.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import checkpoint_greedy, hf_greedy, runner_greedy
from llamacpp_gguf import convert, source_checkpoint
from tiny import load_hf

from neuron_opt.api import LLM
from neuron_opt.checkpoint import native_quant, open_checkpoint
from neuron_opt.config import ModelConfig, ParallelConfig, QuantConfig
from neuron_opt.errors import CheckpointError

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3", "mixtral",
            "qwen2-moe", "qwen3-moe", "gpt-oss"]
HF_READS_GGUF = ("llama", "mistral")  # transformers' GGUF loader maps these files exactly
# tp 2's subset (rank processes take ~10 s a model to start): Mixtral (a `llama` file: q/k rows permuted, GQA,
# experts stacked) in the default tier; Llama and Gemma 2 (soft-caps, windows, the norm offset, tied embeddings)
# in the slow one
TP2_FAMILIES = ["mixtral", *(pytest.param(f, marks=pytest.mark.slow) for f in ("llama", "gemma2"))]
MAX_LEN = 64
PROMPT = [1, 17, 42, 99, 5, 123, 7, 300, 11, 250]


@pytest.fixture(autouse=True, scope="module")
def _private_cache(files, tmp_path_factory):
    """One cache for the module: each file's metadata is parsed and its weights dequantized once. The files are made
    before, with the shared cache (make_tiny reads the default model's tokenizer from it)."""
    from neuron_opt import envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(envs, "CACHE_DIR", tmp_path_factory.mktemp("cache"))
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (its HF checkpoint, llama.cpp's F32 GGUF of it); also "llama-TYPE" for the converter's other types."""
    root = tmp_path_factory.mktemp("gguf-families")
    dirs = {f: source_checkpoint(f, root / f) for f in FAMILIES}
    jobs = {f: (d, root / f"{f}.gguf", "f32") for f, d in dirs.items()}
    jobs |= {f"llama-{t}": (dirs["llama"], root / f"llama-{t}.gguf", t) for t in ("f16", "bf16", "q8_0")}
    convert(list(jobs.values()))
    return {name: (d, out) for name, (d, out, _) in jobs.items()}


def eager_greedy(ck, n: int) -> tuple[torch.Tensor, list[int]]:
    """Our eager model of `ck` (fp32): the prompt's last logits and `n` greedy tokens."""
    return checkpoint_greedy(ck, PROMPT, n, MAX_LEN)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_tensors_equal_the_converted_checkpoint(family, files):
    d, path = files[family]
    ck = open_checkpoint(path)
    want = ModelConfig.from_hf(d)
    if family == "mistral":  # a `llama` file: the converter writes no window, llama.cpp runs it as Llama
        want = dataclasses.replace(want, architecture="LlamaForCausalLM", model_type="llama")
    assert ck.config == want
    ours, theirs = ck.state_dict(), open_checkpoint(d).state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        if family.startswith("gemma") and name.endswith("norm.weight"):  # stored as 1 + w: fp32 rounding
            torch.testing.assert_close(ours[name], t, atol=2.4e-7, rtol=0, msg=name)
        else:
            assert torch.equal(ours[name], t), name


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hf(family, files):
    d, path = files[family]
    if family in HF_READS_GGUF:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    else:
        hf = load_hf(d)
    ours_logits, ours = eager_greedy(open_checkpoint(path), 12)
    ref_logits, ref = hf_greedy(hf, PROMPT, 12)
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=0)
    assert ours == ref


@pytest.mark.parametrize("family", TP2_FAMILIES)
def test_tp2_greedy_tokens_equal_hf(family, files):
    """The file on two eager TP rank processes (`LLM(..., parallel=ParallelConfig(tp=2))`): heads, KV heads, the
    MLP and the experts split across ranks. The oracle: HF on the checkpoint the F32 file holds exactly."""
    d, path = files[family]
    llm = LLM(path, max_model_len=MAX_LEN, parallel=ParallelConfig(tp=2))
    try:
        ours_logits, ours = runner_greedy(llm.runner, PROMPT, 12)
    finally:
        llm.runner.executor.close()
    ref_logits, ref = hf_greedy(load_hf(d), PROMPT, 12)
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=0)
    assert ours == ref


def test_the_files_tokenizer_and_chat_template(files):
    from transformers import AutoTokenizer

    d, path = files["olmo2"]  # a BPE vocabulary, in a family transformers' AutoTokenizer refuses from GGUF
    tok, ref = open_checkpoint(path).tokenizer(), AutoTokenizer.from_pretrained(d)
    text = "GGUF files carry their own tokenizer: naïve café, 12345 tokens!"
    assert tok.encode(text) == ref.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("kind, auto", [
    ("f16", QuantConfig()), ("bf16", QuantConfig()),
    ("q8_0", QuantConfig("int8", "per_channel_symmetric", 0, lm_head=True))])
def test_converter_types_read_and_pick_auto(kind, auto, files):
    """F16 / BF16 / Q8_0 as the converter writes them (norms stay F32): F16 and BF16 weights are the HF ones
    rounded (to nearest even, as numpy and torch round), Q8_0 ones within half a step (amax / 127 over the 32
    values of their block; d is stored in fp16, q computed before that rounding); `--quantize auto`'s choice.
    Exactness against gguf's reference dequantization at every type is the slow tier's (transformers' GGUF loader
    takes half a minute on this vocabulary)."""
    d, path = files[f"llama-{kind}"]
    ck = open_checkpoint(path)
    ours, theirs = ck.state_dict(), open_checkpoint(d).state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        if t.dim() == 1:
            assert torch.equal(ours[name], t), name
        elif kind == "q8_0":
            step = t.view(t.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127  # [N, blocks, 1]
            err = (ours[name] - t).view(t.shape[0], -1, 32).abs()
            assert bool((err <= 0.57 * step).all()), name  # half a step, + 127 times d's fp16 rounding (2^-11)
        else:
            assert torch.equal(ours[name], t.to(torch.float16 if kind == "f16" else torch.bfloat16).float()), name
    assert native_quant(ck) == auto


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_f16_and_bf16_files_generate_as_hf_on_their_weights(kind, files):
    """An F16 / BF16 file runs as HF does with the weights it holds: the checkpoint's matrices rounded to the type
    (vectors stay F32 in the file; the rounding is checked above)."""
    d, path = files[f"llama-{kind}"]
    hf = load_hf(d)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.float16 if kind == "f16" else torch.bfloat16).float())
    ours_logits, ours = eager_greedy(open_checkpoint(path), 12)
    ref_logits, ref = hf_greedy(hf, PROMPT, 12)
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=0)
    assert ours == ref


def test_a_type_we_do_not_read_is_refused_from_the_header(tmp_path):
    """IQ2_XXS (gguf can dequantize it; we do not convert it): refused naming the tensor and the type, before any
    tensor is read (the tensor's bytes are garbage, and the file has no config at all)."""
    path = tmp_path / "iq2.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 66), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"token_embd\.weight has GGUF type IQ2_XXS.*supported types: F32"):
        open_checkpoint(path)
