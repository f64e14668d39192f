"""The EAGLE-3 trainer (neuron_opt/eagle3_train.py, scripts/train_eagle3.py): a head trained on a tiny model's own
answers is accepted far more often than the untrained one, on prompts it never saw; a resumed run ends with the
weights of one that never stopped; what it saves loads as a speculators-layout head; bad prompt files are
refused naming the line.

Oracles: the engine's own acceptance counters (verification is exact, tests/neuron_opt/test_eagle3_engine.py),
and an uninterrupted run for the resumed one (bitwise)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neuron_opt.api import LLM
from neuron_opt.checkpoint.eagle3 import read_head_config
from neuron_opt.eagle3_train import SEED_PROMPTS, TrainConfig, new_head, read_prompts, save_speculators, train
from neuron_opt.errors import ConfigError
from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.speculative import SpeculativeConfig

K = 3
CHATS = [[{"role": "user", "content": t}] for t in SEED_PROMPTS]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny_dir("smollm-tok"), batch_size=4, max_model_len=128, num_speculative_tokens=K)
    torch.set_num_threads(threads)


def _mean_accepted_length(llm: LLM, head: Path, chats) -> float:
    accepted = drafts = 0
    for c in chats:
        _, st = llm.generate_ids_speculative(llm.encode_chat(c), SamplingParams(max_tokens=30),
                                             SpeculativeConfig(K, "eagle3", adaptive=False, model=str(head)))
        accepted, drafts = accepted + st.accepted_tokens, drafts + st.drafts
    return (accepted + drafts) / drafts


def test_a_resumed_run_ends_with_the_weights_of_one_that_never_stopped(llm, tmp_path):
    cfg = dict(max_new_tokens=16, aux_layers=(0, 1, 2), lr=1e-3)
    straight = train(llm, CHATS[:4], TrainConfig(out=tmp_path / "a", steps=6, **cfg), "tiny", progress=False)
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "data.pt", tmp_path / "b" / "data.pt")  # the same captured states
    train(llm, CHATS[:4], TrainConfig(out=tmp_path / "b", steps=3, checkpoint_every=3, **cfg), "tiny",
          progress=False)
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["step"] == 3
    lines: list[str] = []
    resumed = train(llm, CHATS[:4], TrainConfig(out=tmp_path / "b", steps=6, **cfg), "tiny", progress=False,
                    log=lines.append)
    assert any("resumed at step 3" in line for line in lines)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    cfg_, layout, _ = read_head_config(tmp_path / "b")  # the speculators layout, our names after loading
    assert layout == "speculators" and cfg_.aux_layer_ids == (0, 1, 2) and not cfg_.has_embed
    saved = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in saved and torch.equal(saved["fc.weight"], resumed.fc.weight)


@pytest.mark.slow  # ~150 training steps on 2 cores: about 2 minutes
def test_a_trained_head_is_accepted_more_than_the_untrained_one_on_unseen_prompts(llm, tmp_path):
    """The untrained head (the model's norm and LM head over an untrained layer) is accepted about never; after
    150 steps on 16 of the seed prompts its mean accepted length on the other 8 is well above it."""
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    save_speculators(new_head(llm, (0, 1, 2)), untrained, "tiny")
    train(llm, CHATS[:16], TrainConfig(out=tmp_path / "trained", steps=150, max_new_tokens=40, aux_layers=(0, 1, 2)),
          "tiny", progress=False)
    before = _mean_accepted_length(llm, untrained, CHATS[16:])
    after = _mean_accepted_length(llm, tmp_path / "trained", CHATS[16:])
    assert after > before + 0.8, (before, after)


def test_bad_prompts_and_layer_ids_are_refused(llm, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n\n[{"role": "user", "content": "yo"}]\n'
                    '{"prompt": "hey"}\n')
    assert [c[0]["content"] for c in read_prompts(good)] == ["hi", "yo", "hey"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ConfigError, match="line 2 is not a chat"):
        read_prompts(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        read_prompts(bad)
    with pytest.raises(ConfigError, match=r"three layer ids within 0..2, got \[2, 1, -1\]"):
        train(llm, CHATS[:1], TrainConfig(out=tmp_path / "x", steps=1), "tiny", progress=False)


def test_the_script_parses_its_flags():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "scripts" / "train_eagle3.py"), "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--prompts" in out and "--aux-layers" in out


def test_a_reduced_draft_vocabulary_holds_the_datas_most_frequent_tokens(llm, tmp_path):
    """--draft-vocab-size N: the head proposes among the N tokens most frequent in the captured data, mapped back
    by d2t (and t2d saved beside it, as speculators does); the saved head loads, and speculation with it stays
    exact."""
    from collections import Counter

    from helpers import reference_generate

    from neuron_opt.api import load_eagle3

    N = 32
    train(llm, CHATS[:4], TrainConfig(out=tmp_path, steps=2, max_new_tokens=16, aux_layers=(0, 1, 2),
                                      draft_vocab_size=N), "tiny", progress=False)
    data = torch.load(tmp_path / "data.pt", weights_only=True)
    counts = Counter(int(t) for d in data for t in d["ids"])
    assert len(counts) > N
    want = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:N])
    head = load_eagle3(tmp_path, llm.loaded)
    assert head.cfg.draft_vocab_size == N
    assert head.to_target(torch.arange(N)).tolist() == want
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved["t2d"].nonzero().flatten().tolist() == want
    prompt = llm.encode_chat(CHATS[20])
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    out, st = llm.generate_ids_speculative(prompt, params, SpeculativeConfig(K, "eagle3", adaptive=False,
                                                                             model=str(tmp_path)))
    assert out.token_ids == reference_generate(llm, prompt, params).token_ids and st.draft_tokens > 0
