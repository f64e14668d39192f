"""Tiny sentence-transformers embedding models made in the test (the oracle of every embedding test): a random
bare decoder saved with the Transformer, Pooling and optional Normalize modules, its reference vectors, and the
comparison the tests make."""

from __future__ import annotations

import numpy as np
import torch

from neuron_opt.checkpoint import open_checkpoint

TEXTS = ["The capital of France is Paris.", "Hi", "Embeddings map text to vectors that a retrieval system compares "
         "by cosine similarity, so that similar meanings sit close together.", "tiny", "one two three four five"]


def make_st_model(out, family: str, pooling: str, normalize: bool, seed: int = 0, chat_template: bool = False,
                  template_kwargs: dict | None = None):
    """A tiny random bare decoder (`Qwen3Model` / `LlamaModel`) with the default model's tokenizer, saved as a
    sentence-transformers model: Transformer, Pooling(`pooling`), Normalize when `normalize`. `chat_template`: the
    tokenizer keeps its chat template, so sentence-transformers >= 6 saves the `message` modality and renders every
    text through the template (with `template_kwargs` as its saved chat-template processing kwargs). Returns
    (dir, model)."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    tok = open_checkpoint("default").tokenizer()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not chat_template:  # sentence-transformers >= 6 renders texts through a tokenizer's chat template
        tok.chat_template = None
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = (transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True) if family == "qwen3" else
           transformers.LlamaConfig(**common, tie_word_embeddings=False))
    torch.manual_seed(seed)
    base = transformers.AutoModel.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF initialises norms to ones: randomise them so the oracle sees them
        for name, p in base.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    base.save_pretrained(out / "base")
    tok.save_pretrained(out / "base")
    kwargs = {"processing_kwargs": {"chat_template": template_kwargs}} if template_kwargs else {}
    mods = [models.Transformer(str(out / "base"), max_seq_length=256, **kwargs),
            models.Pooling(64, pooling_mode=pooling)] + ([models.Normalize()] if normalize else [])
    model = SentenceTransformer(modules=mods, device="cpu")
    model.save(str(out / "st"))
    return out / "st", model


def reference(model, texts) -> torch.Tensor:
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


def assert_same(got, ref: torch.Tensor, exact: bool = True) -> None:
    got = torch.as_tensor(np.asarray(got, dtype=np.float32))
    assert got.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert float(cos.min()) >= 0.999, cos
    if exact:  # fp32 eager: the same numbers up to summation order
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
