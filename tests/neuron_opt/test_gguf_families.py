"""GGUF files as llama.cpp writes them, for every family we map: a tiny random HF checkpoint converted by llama.cpp's
own converter (tests/llamacpp_gguf.py: the llama-cpp-python sdist's convert_hf_to_gguf.py), then opened by us.

The oracles: the HF checkpoint the file was converted from (at F32 the file holds its exact values: our canonical
tensors equal them bit for bit, Gemma's norms to the rounding of the converter's 1 + w), HF transformers' greedy
tokens on it (fp32), and transformers' own GGUF loader where it reads the family right (Llama, Mistral: the same
weights to the bit at every type). transformers 5.25's GGUF loader misreads the others' files (Gemma 3's rope
scaling and local base, Qwen-MoE's expert widths, Mixtral's experts) or refuses them (OLMo 2, Granite, SmolLM3,
GPT-OSS), so for those the oracle is HF on the source checkpoint. llama-quantize's types (K-quants, IQ4) are in
the slow tier: building llama-quantize takes minutes.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
from llamacpp_gguf import convert, quantize
from tiny import BASE, WITH_TOKENIZER, load_hf, make_tiny

from neuron_opt.api import build_model
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.checkpoint import native_quant, open_checkpoint
from neuron_opt.config import CacheConfig, ModelConfig, QuantConfig
from neuron_opt.errors import CheckpointError
from neuron_opt.runtime.generate import generate_ids
from neuron_opt.runtime.runner import ModelRunner
from neuron_opt.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "olmo2", "granite", "smollm3", "mixtral", "qwen2-moe",
            "qwen3-moe", "gpt-oss"]
HF_READS_GGUF = ("llama", "mistral")  # transformers' GGUF loader maps these files exactly
# converters that read a BPE tokenizer.json (the default model's, 49,152 tokens); the others take a small
# sentencepiece model, so their files' metadata parses fast
BPE_FAMILIES = ("olmo2", "qwen2-moe", "qwen3-moe", "gpt-oss")
MAX_LEN = 64
PROMPT = [1, 17, 42, 99, 5, 123, 7, 300, 11, 250]


@pytest.fixture(autouse=True, scope="module")
def _private_cache(tmp_path_factory):
    """One cache for the module: each file's metadata is parsed and its weights dequantized once."""
    from neuron_opt import envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(envs, "CACHE_DIR", tmp_path_factory.mktemp("cache"))
        yield


def make_with_sentencepiece(config_class: str, overrides: dict, out: Path) -> Path:
    """A tiny random checkpoint beside a sentencepiece `tokenizer.model` trained here (400 pieces, Gemma's special
    ids): Gemma 2's converter reads no other vocabulary, and a small one keeps the files' metadata small."""
    import transformers

    model_file = io.BytesIO()
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "models.md").read_text()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_writer=model_file, vocab_size=400, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", byte_fallback=True, minloglevel=2)
    cfg = getattr(transformers, config_class)(**{**BASE, "vocab_size": 400, "pad_token_id": 0, **overrides},
                                               bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    model.save_pretrained(out)
    (out / "tokenizer.model").write_bytes(model_file.getvalue())
    return out


# Gemma 2 with every option on: soft-caps, a window of 6 on every other layer
GEMMA2 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
              attn_logit_softcapping=4.0, final_logit_softcapping=2.5, sliding_window=6, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (its HF checkpoint, llama.cpp's F32 GGUF of it); also "llama-TYPE" for the converter's other types."""
    root = tmp_path_factory.mktemp("gguf-families")
    dirs = {}
    for f in FAMILIES:
        if f == "gemma2":
            dirs[f] = make_with_sentencepiece("Gemma2Config", GEMMA2, root / f)
        elif f in BPE_FAMILIES:
            dirs[f] = make_tiny(f"gguf-{f}", root / f)
        else:
            config_class, overrides = WITH_TOKENIZER[f"gguf-{f}"]
            dirs[f] = make_with_sentencepiece(config_class, {k: v for k, v in overrides.items() if k != "vocab_size"},
                                              root / f)
    jobs = {f: (d, root / f"{f}.gguf", "f32") for f, d in dirs.items()}
    jobs |= {f"llama-{t}": (dirs["llama"], root / f"llama-{t}.gguf", t) for t in ("f16", "bf16", "q8_0")}
    convert(list(jobs.values()))
    return {name: (d, out) for name, (d, out, _) in jobs.items()}


def eager_greedy(ck, n: int) -> tuple[torch.Tensor, list[int]]:
    """Our eager model of `ck` (fp32): the prompt's last logits and `n` greedy tokens."""
    cfg = ck.config
    cache = CacheConfig(max_batch=1, max_model_len=MAX_LEN)
    buckets = BucketConfig.build(max_prompt_len=MAX_LEN, max_model_len=MAX_LEN, max_batch=1, min_prefill=16,
                                 min_decode=16)
    runner = ModelRunner(EagerExecutor(build_model(cfg, ck.state_dict(), MAX_LEN, torch.float32), cache), buckets,
                         cache, cfg.vocab_size)
    logits = runner.prefill(0, PROMPT)

    class NoTok:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    return logits, generate_ids(runner, NoTok(), PROMPT, SamplingParams(max_tokens=n, min_tokens=n), ()).token_ids


def hf_greedy(hf, n: int) -> tuple[torch.Tensor, list[int]]:
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1]
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return logits, out[0, len(PROMPT):].tolist()


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
    ref_logits, ref = hf_greedy(hf, 12)
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


# llama-quantize type -> `--quantize auto`'s format for a file of it (docs/quantization.md)
QUANT_TYPES = {"Q4_0": ("int4", "group_symmetric"), "Q4_1": ("int4", "group_asymmetric"),
               **{k: ("int8", "per_channel_symmetric") for k in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                                                   "Q6_K", "IQ4_NL", "IQ4_XS", "Q4_K_M")}}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> tuple[Path, Path]:
    """A Llama whose rows are whole K-quant super-blocks (256 values), and its F32 GGUF."""
    root = tmp_path_factory.mktemp("gguf-wide")
    d = make_with_sentencepiece("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                                    num_key_value_heads=2), root / "hf")
    convert([(d, root / "f32.gguf", "f32")])
    return d, root / "f32.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_llama_quantize_types_equal_gguf_reference_and_hf(kind, wide_llama, tmp_path):
    """Each type llama-quantize writes: our tensors equal transformers' GGUF loader's (gguf's reference
    dequantization) exactly, greedy tokens equal HF's on the same file, and `--quantize auto` picks the table's
    format (docs/quantization.md); a Q4_K_M file mixes Q4_K and Q6_K linears, both int8."""
    import transformers

    path = quantize(wide_llama[1], tmp_path / f"{kind}.gguf", kind)
    ck = open_checkpoint(path)
    reader = gguf.GGUFReader(str(path))
    linear_types = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2
                    and "norm" not in t.name}
    if kind == "Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= linear_types
    else:
        assert linear_types == {kind}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ref = hf.state_dict()
    for name, t in ck.state_dict().items():
        assert torch.equal(t, ref[name]), name
    ours_logits, ours = eager_greedy(ck, 12)
    ref_logits, want = hf_greedy(hf, 12)
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=0)
    assert ours == want
    method, qtype = QUANT_TYPES[kind]
    qc = native_quant(ck)
    assert (qc.method, qc.quantization_type, qc.group_size, qc.lm_head) == (method, qtype,
                                                                            32 if method == "int4" else 0, True)
