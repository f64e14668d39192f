"""EAGLE-3 draft heads (models/eagle3.py, neuron_opt/checkpoint/eagle3.py) against the `speculators` package's
Eagle3DraftModel: a tiny random head built and saved by speculators loads into ours, whose first-step logits and
tokens equal its output on the same hidden states (fp32), and whose chain equals one built from its submodules
(its decoder layer with transformers' KV cache) for K steps. The same tensors saved in the EAGLE/SpecForge layout
load to the same numbers. Heads that do not fit the target, or are no EAGLE-3 head, are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.eagle3 import Eagle3Head
from neuron_opt.checkpoint.eagle3 import check_head, load_head, read_head_config
from neuron_opt.config import ModelConfig
from neuron_opt.errors import CheckpointError, ConfigError

speculators = pytest.importorskip("speculators")

T, K, V, VD, H = 7, 4, 300, 100, 64


def _speculators_head(out: Path, norm_before_residual: bool, draft_vocab: int = VD, seed: int = 0):
    from speculators import Eagle3DraftModel, Eagle3SpeculatorConfig, SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    lc = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512)
    lc._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=lc, draft_vocab_size=draft_vocab, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    m = Eagle3DraftModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if m.d2t is not None:
            m.d2t.copy_(torch.randint(0, V - draft_vocab, (draft_vocab,), generator=g))
    m.save_pretrained(str(out))
    return m


@pytest.fixture(scope="module", params=[False, True], ids=["residual", "norm-before-residual"])
def head(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("spec")
    return _speculators_head(out, request.param), out


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, 3 * H, generator=g), torch.randint(0, V, (1, T), generator=g)


def _reference(m, aux: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """speculators' modules: the first step's logits [T, VD] over the sequence, then a K-step chain (each step its
    own proposal, mapped to the target vocabulary, and its layer output) through its layer and a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    layer = m.layers[0]

    def run(tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None):
        x = torch.cat([m.embed_tokens(tokens), hidden], dim=-1)
        h = layer(x, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                  cache_position=pos[0], position_embeddings=m.rotary_emb(x, pos))
        return m.lm_head(m.norm(h)), h

    n = ids.shape[1]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    logits, h = run(ids, m.fc(aux), torch.arange(n)[None], causal)
    first = logits[0]
    chain = []
    for step in range(K):
        d = int(logits[0, -1].argmax())
        t = d + (int(m.d2t[d]) if m.d2t is not None else 0)
        chain.append(t)
        if step < K - 1:
            logits, h = run(torch.tensor([[t]]), h[:, -1:], torch.tensor([[n + step]]), None)
    return first, chain


def _ours(head: Eagle3Head, aux: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    k, v = head.kv_cache(2, torch.float32)
    slot = torch.tensor([1])
    n = ids.shape[1]
    logits, h = head.logits(head.forward_layer(ids, head.project(aux), torch.arange(n)[None], slot, k, v))
    first, chain = logits[0], []
    for step in range(K):
        t = int(head.to_target(logits[0, -1].argmax()))
        chain.append(t)
        if step < K - 1:
            logits, h = head.logits(head.forward_layer(torch.tensor([[t]]), h[:, -1:], torch.tensor([[n + step]]),
                                                       slot, k, v))
    return first, chain


@torch.no_grad()
def test_first_step_and_chain_equal_speculators(head):
    m, path = head
    ours = load_head(path, 64, torch.float32)
    assert ours.cfg.aux_layer_ids == (0, 1, 2) and ours.cfg.draft_vocab_size == VD and ours.cfg.has_vocab_map
    aux, ids = _inputs()
    want_first, want_chain = _reference(m, aux, ids)
    got_first, got_chain = _ours(ours, aux, ids)
    torch.testing.assert_close(got_first, want_first, rtol=1e-5, atol=1e-5)
    # speculators' own forward (its training-time graph, one step) proposes the same draft tokens
    tokens = m(aux, ids, torch.zeros_like(ids), ttt_steps=1, position_ids=torch.arange(T)[None])[0]
    assert torch.equal(got_first.argmax(-1), tokens[0])
    assert got_chain == want_chain
    assert any(t >= VD for t in got_chain)  # d2t moved them


@torch.no_grad()
def test_the_same_head_in_the_eagle_layout_loads_to_the_same_numbers(head, tmp_path):
    """EAGLE/SpecForge layout: midlayer.* names, a Llama config.json with draft_vocab_size and the aux ids in
    eagle_config, t2d beside d2t, no embed_tokens (the target's table is shared)."""
    m, path = head
    tensors = load_file(str(path / "model.safetensors"))
    embed = tensors.pop("embed_tokens.weight")
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    spec_cfg = json.loads((path / "config.json").read_text())
    cfg = dict(spec_cfg["transformer_layer_config"], architectures=["LlamaForCausalLMEagle3"],
               draft_vocab_size=VD, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
               norm_before_residual=spec_cfg["norm_before_residual"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_head_config(tmp_path)[1] == "eagle"
    ours = load_head(tmp_path, 64, torch.float32)
    assert ours.embed_tokens is None
    ours.share_embedding(lambda ids: torch.nn.functional.embedding(ids, embed))
    ref = load_head(path, 64, torch.float32)
    aux, ids = _inputs(2)
    a, b = _ours(ours, aux, ids), _ours(ref, aux, ids)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def _target(**over) -> ModelConfig:
    base = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=H,
                intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-5, max_position_embeddings=512)
    return ModelConfig.from_hf(base | over)


def test_heads_that_do_not_fit_the_target_are_refused_naming_the_field(head):
    _, path = head
    cfg = read_head_config(path)[0]
    assert check_head(cfg, _target(), "h") == (0, 1, 2)
    for over, words in [(dict(vocab_size=V + 1), "vocabulary of 300"), (dict(hidden_size=128), "hidden size"),
                        (dict(num_hidden_layers=1), r"reads layers \[0, 1, 2\]")]:
        with pytest.raises(ConfigError, match=words) as e:
            check_head(cfg, _target(**over), "h")
        assert e.value.param == "speculative_model"
    from dataclasses import replace

    with pytest.raises(ConfigError, match=r"\(the default: it names none\)"):  # (2, 1, -1) for 2 layers
        check_head(replace(cfg, aux_layer_ids=None), _target(), "h")


def test_what_is_no_eagle3_head_is_refused(head, tiny_dir, tmp_path):
    _, path = head
    with pytest.raises(CheckpointError, match="neither a speculators eagle3 config"):
        load_head(tiny_dir("llama-gqa2"), 64, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "mtp"}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="a speculators 'mtp' model, not eagle3"):
        load_head(tmp_path, 64, torch.float32)
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text((path / "config.json").read_text())
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pickled weights"):
        load_head(bin_only, 64, torch.float32)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text((path / "config.json").read_text())
    t = load_file(str(path / "model.safetensors"))
    t.pop("fc.weight")
    save_file(t, str(cut / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['fc.weight'\]"):
        load_head(cut, 64, torch.float32)
