"""Checkpoint loading: HF dirs and GGUF files -> canonical state dict, checked against HF transformers.

GGUF files are written here with `gguf.GGUFWriter`, applying llama.cpp's q/k row permutation in the forward
direction (written independently of the inverse in neuron_opt/checkpoint/gguf.py), then read back by us.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny import load_hf

from models.llama import LlamaForCausalLM
from neuron_opt import envs
from neuron_opt.checkpoint import (
    default_model_path,
    gguf_state_dict,
    open_checkpoint,
)
from neuron_opt.checkpoint.cache import gguf_state_dict_cached
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import CheckpointError, UnsupportedModelError
from neuron_opt.parallel.sharding import head_layout

# HF -> GGUF tensor names, as llama.cpp's convert_hf_to_gguf.py writes them
_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm"}


REAL_CACHE_DIR = envs.CACHE_DIR


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(envs, "CACHE_DIR", tmp_path / "cache")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (forward): interleave the two rotary halves of each head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def write_gguf(hf_dir: Path, out: Path, arch: str = "llama", qtype: gguf.GGMLQuantizationType | None = None
               ) -> Path:
    """Convert a tiny HF checkpoint to GGUF the way llama.cpp does (F32, or `qtype` for 2-D weights)."""
    c = json.loads((hf_dir / "config.json").read_text())
    n_head, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    head_dim = c.get("head_dim") or c["hidden_size"] // n_head
    w.add_rope_dimension_count(head_dim)
    if head_dim != c["hidden_size"] // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(c["vocab_size"])])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        x = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            x = llama_cpp_permute(x, n_head)
        elif arch == "llama" and ".k_proj." in name:
            x = llama_cpp_permute(x, n_kv)
        if qtype is not None and x.ndim == 2:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def our_logits(cfg: ModelConfig, sd: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Prefill `ids` [1, S] with models/llama.py; returns logits at the last position [V]."""
    S = ids.shape[1]
    model = LlamaForCausalLM(cfg, head_layout(cfg, ParallelConfig()), max_model_len=32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    shape = model.kv_shape(2, 32)  # the null block and one block of 32 positions
    k = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    v = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    with torch.no_grad():
        return model(ids, torch.arange(S)[None], 32 + torch.arange(S)[None], torch.tensor([[1]]),
                     torch.tensor([S - 1]), k, v, S)[0]


ROUNDTRIP = ["llama-gqa2", "smollm-like-9-3", "llama-bias", "llama-gqa4", "llama-linear-rope", "qwen2"]


@pytest.mark.parametrize("variant", ROUNDTRIP)
def test_gguf_roundtrip_equals_hf_tensors_and_logits(variant, tiny_dir, tmp_path):
    d = tiny_dir(variant)
    arch = "qwen2" if variant == "qwen2" else "llama"
    ck = open_checkpoint(write_gguf(d, tmp_path / "m.gguf", arch))
    assert ck.format == "gguf"
    assert ck.config == ModelConfig.from_hf(d)
    ref = load_file(str(d / "model.safetensors"))
    if ck.config.tie_word_embeddings:
        ref.pop("lm_head.weight", None)
    sd = ck.state_dict()
    assert sorted(sd) == sorted(ref)
    for name, t in ref.items():
        assert torch.equal(sd[name], t.float()), name
    # the writer really permuted: reading q raw would differ (guards against a no-op permutation pair)
    raw = gguf.GGUFReader(str(ck.source))
    q_raw = next(t for t in raw.tensors if t.name == "blk.0.attn_q.weight")
    assert arch == "qwen2" or not np.array_equal(np.asarray(q_raw.data), ref[
        "model.layers.0.self_attn.q_proj.weight"].numpy())

    hf = load_hf(d)
    ids = torch.tensor([[1, 17, 42, 99, 5, 123, 7]])
    with torch.no_grad():
        expected = hf(ids).logits[0, -1]
    torch.testing.assert_close(our_logits(ck.config, sd, ids), expected, atol=1e-4, rtol=0)


def test_gguf_q8_0_dequantized_within_quantization_error(tiny_dir, tmp_path):
    d = tiny_dir("llama-gqa2")
    ck = open_checkpoint(write_gguf(d, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0))
    sd, ref = ck.state_dict(), load_file(str(d / "model.safetensors"))
    for name, t in ref.items():
        # Q8_0: blocks of 32 along a row, scale = absmax / 127 stored in fp16, so error <= scale / 2 plus
        # 127 * the scale's fp16 rounding (<= 0.06 scale). A wrong row order would miss by ~absmax.
        tol = t.abs().max().item() / 127 * 0.6 if t.ndim == 2 else 0.0
        assert sd[name].shape == t.shape, name
        assert (sd[name] - t).abs().max().item() <= tol, name


def test_hf_dir_single_and_sharded_and_dtype(tiny_dir, tmp_path):
    d = tiny_dir("llama-gqa2")
    ref = load_file(str(d / "model.safetensors"))
    single = open_checkpoint(d)
    assert single.format == "hf" and single.source == d
    sharded_dir = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(d).save_pretrained(sharded_dir, max_shard_size="100KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    for sd in (single.state_dict(), open_checkpoint(sharded_dir).state_dict()):
        assert sorted(sd) == sorted(ref)
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
    bf = single.state_dict(torch.bfloat16)
    assert all(bf[k].dtype == torch.bfloat16 and torch.equal(bf[k], ref[k].bfloat16()) for k in ref)


def _copy(d: Path, dst: Path) -> Path:
    shutil.copytree(d, dst)
    return dst


def test_tied_checkpoint_with_lm_head_keeps_only_embed(tiny_dir, tmp_path):
    d = _copy(tiny_dir("smollm-like-9-3"), tmp_path / "tied")
    sd = load_file(str(d / "model.safetensors"))
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, str(d / "model.safetensors"))
    got = open_checkpoint(d).state_dict()
    assert "lm_head.weight" not in got and torch.equal(got["model.embed_tokens.weight"],
                                                        sd["model.embed_tokens.weight"])


def test_missing_and_extra_weights_name_file_and_tensors(tiny_dir, tmp_path):
    d = _copy(tiny_dir("llama-gqa2"), tmp_path / "bad")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"bad.*model\.layers\.1\.mlp\.up_proj\.weight"):
        open_checkpoint(d)
    save_file({**load_file(str(tiny_dir("llama-gqa2") / "model.safetensors")), "model.extra.weight":
               torch.zeros(2)}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.extra\.weight"):
        open_checkpoint(d)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(damage, tiny_dir, tmp_path):
    d = _copy(tiny_dir("llama-gqa2"), tmp_path / "corrupt")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        open_checkpoint(d)


def test_missing_shard_names_the_file(tiny_dir, tmp_path):
    d = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(tiny_dir("llama-gqa2")).save_pretrained(
        d, max_shard_size="100KB")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        open_checkpoint(d)


def test_directory_errors(tiny_dir, tmp_path):
    d = _copy(tiny_dir("llama-gqa2"), tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        open_checkpoint(d)
    b = tmp_path / "bin"
    b.mkdir()
    shutil.copy(tiny_dir("llama-gqa2") / "config.json", b)
    (b / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="safetensors"):
        open_checkpoint(b)
    with pytest.raises(CheckpointError, match="nowhere"):
        open_checkpoint(tmp_path / "nowhere")
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(CheckpointError, match="x.gguf"):
        open_checkpoint(tmp_path / "x.gguf")


def test_gguf_qwen3_roundtrip_reads_the_qk_norms(tiny_dir, tmp_path):
    """llama.cpp's qwen3 architecture: unpermuted q/k rows and per-head q/k norms. Its files carry no sliding
    window, so the config is the checkpoint's without one and the logits are compared on a prompt shorter than the
    window."""
    import dataclasses

    d = tiny_dir("qwen3")
    ck = open_checkpoint(write_gguf(d, tmp_path / "m.gguf", "qwen3"))
    assert ck.config == dataclasses.replace(ModelConfig.from_hf(d), sliding_window=None, layer_types=())
    sd = ck.state_dict()
    ref = load_file(str(d / "model.safetensors"))
    ref.pop("lm_head.weight", None)  # tied
    assert sorted(sd) == sorted(ref) and "model.layers.0.self_attn.q_norm.weight" in sd
    for name, t in ref.items():
        assert torch.equal(sd[name], t.float()), name
    ids = torch.tensor([[1, 17, 42, 99, 5]])  # within the window (6)
    with torch.no_grad():
        expected = load_hf(d)(ids).logits[0, -1]
    torch.testing.assert_close(our_logits(ck.config, sd, ids), expected, atol=1e-4, rtol=0)


def test_unknown_architecture_lists_supported(tiny_dir, tmp_path):
    d = _copy(tiny_dir("llama-gqa2"), tmp_path / "gpt2")
    c = json.loads((d / "config.json").read_text())
    c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        open_checkpoint(d)
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gemma.*llama"):
        open_checkpoint(tmp_path / "g.gguf")


def test_fingerprint_and_dequant_cache(tiny_dir, tmp_path):
    d = tiny_dir("llama-gqa2")
    assert open_checkpoint(d).weights_fingerprint() == hashlib.sha256(
        (d / "model.safetensors").read_bytes()).hexdigest()
    path = write_gguf(d, tmp_path / "c.gguf")
    ck = open_checkpoint(path)
    assert ck.weights_fingerprint() == hashlib.sha256(path.read_bytes()).hexdigest()
    cache = tmp_path / "c"
    first = gguf_state_dict_cached(path, ck.config, cache)
    (entry,) = (cache / "gguf").glob("*.safetensors")
    assert entry.name.startswith(ck.weights_fingerprint()[:40])
    second = gguf_state_dict_cached(path, ck.config, cache)
    assert all(torch.equal(first[k], second[k]) for k in first)
    entry.write_bytes(b"damaged")  # a broken cache entry is rebuilt, not trusted
    third = gguf_state_dict_cached(path, ck.config, cache)
    assert all(torch.equal(first[k], third[k]) for k in first)


@pytest.fixture
def real_cache(monkeypatch):
    """The default model uses the real cache: the dequantized 135M model is reused across runs."""
    monkeypatch.setattr(envs, "CACHE_DIR", REAL_CACHE_DIR)


def test_default_model_path_is_the_smollm2_gguf(real_cache):
    p = default_model_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.read_bytes()[:4] == b"GGUF"
    assert open_checkpoint("default").source == p


def test_default_model_sampled_tensors_match_transformers_processing(real_cache):
    """Fast check of the default model (cached path): q/k of a few layers, embeddings and a norm, against
    gguf's dequantize followed by transformers' own Llama GGUF q/k un-permutation."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    ck = open_checkpoint("default")
    sd = ck.state_dict()
    c = ck.config
    proc = LlamaTensorProcessor(config={"num_attention_heads": c.num_attention_heads,
                                        "num_key_value_heads": c.num_key_value_heads})
    tensors = {t.name: t for t in gguf.GGUFReader(str(ck.source)).tensors}
    picks = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in (0, 17, c.num_hidden_layers - 1):
        picks[f"blk.{i}.attn_q.weight"] = f"model.layers.{i}.self_attn.q_proj.weight"
        picks[f"blk.{i}.attn_k.weight"] = f"model.layers.{i}.self_attn.k_proj.weight"
        picks[f"blk.{i}.ffn_down.weight"] = f"model.layers.{i}.mlp.down_proj.weight"
    for g, h in picks.items():
        t = tensors[g]
        ref = proc.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=g).weights
        assert torch.equal(sd[h], torch.from_numpy(np.array(ref, dtype=np.float32))), h


@pytest.mark.slow
def test_default_model_equals_transformers_gguf_loader(real_cache):
    """Every tensor of our (uncached) GGUF conversion vs transformers' GGUF loader.

    `AutoModelForCausalLM.from_pretrained(gguf_file=...)` needs `accelerate`, which is not installed, so the
    oracle is the function it falls back to, `load_gguf_checkpoint`, with a meta-device model for names.
    Slow (~20-25 s here): both sides dequantize 135M parameters in numpy.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    ck = open_checkpoint("default")
    hf_cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    ours_cfg = ModelConfig.from_hf(hf_cfg)
    # transformers keeps the float32 epsilon (9.99999975e-06); we print it back as 1e-05 (same float32)
    assert np.float32(ours_cfg.rms_norm_eps) == np.float32(ck.config.rms_norm_eps)
    assert dataclasses.replace(ours_cfg, rms_norm_eps=ck.config.rms_norm_eps) == ck.config
    with torch.device("meta"):
        names_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names_model)["tensors"]
    ours = gguf_state_dict(path, ck.config)  # the uncached conversion
    assert sorted(ours) == sorted(k for k in ref if k != "lm_head.weight")  # tied: the model reuses embed
    diffs = {k: (ours[k] - ref[k]).abs().max().item() for k in ours}
    assert max(diffs.values()) == 0.0, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


def test_default_tokenizer_has_chat_template(real_cache):
    tok = open_checkpoint("default").tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") in open_checkpoint("default").config.eos_token_ids
    # second call comes from the on-disk tokenizer cache and must behave the same
    again = open_checkpoint("default").tokenizer()
    assert again.chat_template == tok.chat_template and again("Hello world").input_ids == tok(
        "Hello world").input_ids


def test_hf_tokenizer_keeps_chat_template_and_missing_one_is_an_error(tiny_dir, tmp_path, monkeypatch):
    d = _copy(tiny_dir("smollm-like-9-3"), tmp_path / "with_tok")
    with pytest.raises(CheckpointError, match="with_tok"):
        open_checkpoint(d).tokenizer()
    monkeypatch.setattr(envs, "CACHE_DIR", REAL_CACHE_DIR)
    src = open_checkpoint("default").tokenizer()
    src.save_pretrained(str(d))
    tok = open_checkpoint(d).tokenizer()
    assert tok.chat_template == src.chat_template
    assert tok("Hello world").input_ids == src("Hello world").input_ids


def test_gguf_with_unknown_tensor_names_the_file(tiny_dir, tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("embedding_length", 8), ("block_count", 1), ("feed_forward_length", 16)):
        getattr(w, f"add_{k}")(v)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("blk.0.attn_qkv.weight", np.zeros((24, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"odd\.gguf.*attn_qkv"):
        open_checkpoint(path)
