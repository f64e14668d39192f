"""GGUF files written by llama.cpp's own tools, for the GGUF tests: its converter (`convert_hf_to_gguf.py`, with the
gguf-py it pins) from the llama-cpp-python sdist, unpacked once into the cache directory outside the repository
(neuron_opt.bench.llamacpp_server.ensure_sources), and its `llama-quantize` (built once there: ensure_built); and the
tiny HF checkpoints of each family they are converted from (`source_checkpoint`)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from tiny import BASE, WITH_TOKENIZER, make_tiny

from neuron_opt import envs
from neuron_opt.bench import llamacpp_server as peer

LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python whose vendored llama.cpp writes the test files
CACHE = envs.CACHE_DIR  # read once: tests that point envs.CACHE_DIR at a private directory still share this one
ROOT = Path(__file__).resolve().parents[1]
# converters that read a BPE tokenizer.json (the default model's, 49,152 tokens); the others take a small
# sentencepiece model, so their files' metadata parses fast
BPE_FAMILIES = ("olmo2", "qwen2-moe", "qwen3-moe", "gpt-oss")
SMALL_BPE = 1024  # the wide checkpoints' BPE vocabulary (cut_bpe): parsing 49,152 tokens' metadata takes seconds
# Gemma 2 with every option on: soft-caps, a window of 6 on every other layer
GEMMA2 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
              attn_logit_softcapping=4.0, final_logit_softcapping=2.5, sliding_window=6, tie_word_embeddings=True)


def _wide(family: str) -> dict:
    """Config overrides that make every matrix row of `family` whole K-quant super-blocks (256 values): hidden
    256 in 4 heads of 64, MLP and expert widths of 256 or 512; Gemma's softmax scale at llama.cpp's head_dim;
    Phi-3's longrope factors one per rotary pair (48 of 64 features rotate)."""
    over: dict = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    if family in ("gemma2", "gemma3"):
        over |= dict(head_dim=64, query_pre_attn_scalar=64)
    elif family in ("qwen3", "qwen3-moe", "gpt-oss"):
        over |= dict(head_dim=64)
    if family in ("mixtral", "gpt-oss"):
        over |= dict(intermediate_size=256)
    elif family == "qwen2-moe":
        over |= dict(moe_intermediate_size=256, shared_expert_intermediate_size=256)
    elif family == "qwen3-moe":
        over |= dict(moe_intermediate_size=256)
    elif family == "phi3":
        rope = dict(WITH_TOKENIZER["gguf-phi3"][1]["rope_parameters"])
        over |= dict(rope_parameters={**rope, "short_factor": [1.0 + i / 24 for i in range(24)],
                                      "long_factor": [1.0 + i / 4 for i in range(24)]})
    return over


def cut_bpe(d: Path, n: int) -> Path:
    """The BPE tokenizer saved in `d` (the default model's) cut to its first `n` tokens: its special tokens, its
    byte alphabet and the first merges, each of which makes the next token (a BPE vocabulary's order), so the cut
    one is a complete BPE tokenizer. llama.cpp's converter recognises a tokenizer by the hash of its encoding of a
    test text, which the cut one changes: `convert(..., bpe_pre=...)` names its pre-tokenizer."""
    f = d / "tokenizer.json"
    tok = json.loads(f.read_text())
    model = tok["model"]
    first = model["vocab"]["".join(model["merges"][0])]  # the token the first merge makes (merges: [a, b] pairs)
    model["vocab"] = {t: i for t, i in model["vocab"].items() if i < n}
    model["merges"] = model["merges"][: n - first]
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < n]
    f.write_text(json.dumps(tok))
    return d


def make_with_sentencepiece(config_class: str, overrides: dict, out: Path) -> Path:
    """A tiny random checkpoint beside a sentencepiece `tokenizer.model` trained here (400 pieces, Gemma's special
    ids): Gemma 2's converter reads no other vocabulary, and a small one keeps the files' metadata small."""
    import sentencepiece as spm
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
            elif name.endswith("bias"):  # HF initialises them to zeros
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    (out / "tokenizer.model").write_bytes(model_file.getvalue())
    return out


def source_checkpoint(family: str, out: Path, wide: bool = False) -> Path:
    """The tiny random HF checkpoint of `family` (a `gguf-FAMILY` variant of tests/tiny.py, or Gemma 2 with every
    option on) that the GGUF tests convert, with the vocabulary its converter reads; `wide`: its rows whole K-quant
    super-blocks, for llama-quantize's types."""
    widths = _wide(family) if wide else {}
    if family == "gemma2":
        return make_with_sentencepiece("Gemma2Config", {**GEMMA2, **widths}, out)
    if family in BPE_FAMILIES and wide:
        return cut_bpe(make_tiny(f"gguf-{family}", out, vocab_size=SMALL_BPE, **widths), SMALL_BPE)
    if family in BPE_FAMILIES:
        return make_tiny(f"gguf-{family}", out)
    config_class, overrides = WITH_TOKENIZER[f"gguf-{family}"]
    return make_with_sentencepiece(config_class, {**{k: v for k, v in overrides.items() if k != "vocab_size"},
                                                  **widths}, out)


# one process converts every file: the converter's imports (torch, transformers) cost more than a tiny model
_DRIVER = """
import os, runpy, sys
script, pre, jobs = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[:0] = [os.path.dirname(script), os.path.join(os.path.dirname(script), "gguf-py")]
if pre:  # a BPE tokenizer the converter does not know by its hash: its pre-tokenizer by name
    from conversion.base import TextModel
    known = TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return pre
    TextModel.get_vocab_base_pre = get_vocab_base_pre
for i in range(0, len(jobs), 3):
    sys.argv = [script, "--outtype", jobs[i + 2], "--outfile", jobs[i + 1], jobs[i]]
    runpy.run_path(script, run_name="__main__")
"""


def convert(jobs: list[tuple[Path, Path, str]], bpe_pre: str = "") -> None:
    """Each (HF directory, out file, outtype: f32, f16, bf16 or q8_0) converted by llama.cpp's converter;
    `bpe_pre`: the pre-tokenizer of a BPE vocabulary it does not recognise (a `cut_bpe` one: "smollm")."""
    script = peer.ensure_sources(CACHE, LLAMACPP_VERSION) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converter's own gguf-py
    args = [str(x) for job in jobs for x in job]
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(script), bpe_pre, *args], capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0, f"convert_hf_to_gguf.py failed:\n{r.stderr[-3000:]}"


def quantize(src: Path, out: Path, kind: str) -> Path:
    """`src` requantized by llama.cpp's `llama-quantize` to `kind` (a llama-quantize type name: Q4_K_M, Q6_K, ...),
    every tensor in `kind` where its row length allows (`--pure`) unless `kind` is a mix (Q4_K_M, Q5_K_M)."""
    build = peer.ensure_built(CACHE, LLAMACPP_VERSION, peer.default_cmake_args())
    pure = [] if kind.endswith(("_M", "_S", "_L")) else ["--pure"]
    r = subprocess.run([str(build.quantize), "--allow-requantize", *pure, str(src), str(out), kind],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"llama-quantize {kind} failed:\n{(r.stdout + r.stderr)[-3000:]}"
    return out
