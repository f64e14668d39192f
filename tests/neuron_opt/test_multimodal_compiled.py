"""Vision-language models compiled into artifacts and at tp 2: the encoder per image-size bucket (padded exactly),
the decoder taking image embeddings (cpu graphs, eager rank processes).

Oracle: HF transformers' `generate` (greedy, fp32) on the same processor outputs, with the tiny random checkpoints
of tests/tiny_vlm.py (Idefics3: 3- and 5-tile images; Qwen2.5-VL and Qwen3-VL: dynamic patch counts, Qwen3-VL's
rows carrying its deepstack features; Gemma 3: one square image per encoder call, bidirectional image blocks) and
PIL-drawn images. Images of other sizes than their bucket run padded: the 3-tile image in the 4-tile bucket, every
Qwen image in a bucket of more patches than it has.
"""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import GREEDY, N, chat, draw, hf_generate, make_gemma3, make_idefics3, make_qwen2_5_vl, make_qwen3_vl

from neuron_opt.api import LLM
from neuron_opt.buckets import encoder_sizes, pick_encoder
from neuron_opt.compiler import CompileRequest, compile_artifact
from neuron_opt.config import ParallelConfig
from neuron_opt.errors import BucketOverflowError, ConfigError
from neuron_opt.multimodal.compiled import BucketedEncoder, check_compilable
from neuron_opt.multimodal.vision import load_processor
from neuron_opt.planner.vision import checkpoint_vision_plan, vision_lines

# wide (2 x 2 tiles + global: 5), small and tall (resized to 64 pixels high: 1 x 2 tiles + global: 3)
CONVS = [("What is in the picture?", (70, 40, 1)), ("Compare", (20, 30, 2), "with", (33, 97, 3))]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Each family's checkpoint directory and HF's greedy tokens for CONVS."""
    from transformers import (
        Gemma3ForConditionalGeneration,
        Idefics3ForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for name, make, cls in (("idefics3", make_idefics3, Idefics3ForConditionalGeneration),
                            ("qwen2_5_vl", make_qwen2_5_vl, Qwen2_5_VLForConditionalGeneration),
                            ("qwen3_vl", make_qwen3_vl, Qwen3VLForConditionalGeneration),
                            ("gemma3", make_gemma3, Gemma3ForConditionalGeneration)):
        path = make(tmp_path_factory.mktemp(name))
        hf = cls.from_pretrained(path, dtype=torch.float32).eval()
        processor = load_processor(path, hf.config)
        out[name] = (path, [hf_generate(hf, processor, messages(c), N) for c in CONVS])
    yield out
    torch.set_num_threads(threads)


def messages(conv) -> list[dict]:
    return chat(*(p if isinstance(p, str) else draw(*p) for p in conv))


def check_greedy(llm: LLM, want: list[list[int]]) -> None:
    assert [llm.chat(messages(c), GREEDY).token_ids for c in CONVS] == want


def test_encoder_buckets_are_the_unit_times_powers_of_two_up_to_the_largest_image():
    assert encoder_sizes(5, 1) == (1, 2, 4, 5)
    assert encoder_sizes(256, 4) == (4, 8, 16, 32, 64, 128, 256)
    assert encoder_sizes(20, 4, (8, 20)) == (8, 20)
    assert pick_encoder(3, (1, 2, 4, 5)) == 4
    with pytest.raises(BucketOverflowError, match="largest compiled encoder bucket"):
        pick_encoder(6, (1, 2, 4, 5))
    with pytest.raises(ConfigError, match="multiples of 4"):
        encoder_sizes(20, 4, (6,))


def test_a_family_without_compiled_buckets_is_refused_naming_what_it_lacks():
    from types import SimpleNamespace

    with pytest.raises(ConfigError, match="missing size_step, graph_size.*run it from its checkpoint"):
        check_compilable(SimpleNamespace(architecture="SomeVLForConditionalGeneration", encoder=torch.nn.Linear(2, 2)))


def test_plan_shows_the_encoder_buckets(families):
    lines = "\n".join(vision_lines(checkpoint_vision_plan(families["idefics3"][0], "float32")))
    assert "encoder buckets (tiles; one graph each on compiling backends): 1, 2, 4, 5" in lines
    lines = "\n".join(vision_lines(checkpoint_vision_plan(families["qwen2_5_vl"][0], "float32")))
    assert "encoder buckets (patches; one graph each on compiling backends): 4, 8, 16, 32, 64, 128, 256" in lines
    lines = "\n".join(vision_lines(checkpoint_vision_plan(families["qwen3_vl"][0], "float32")))
    assert "encoder buckets (patches; one graph each on compiling backends): 4, 8, 16, 32, 64, 128, 256" in lines


def compile_vlm(path, out, backend: str, encoder_buckets=None, **kw):
    return compile_artifact(CompileRequest(model=str(path), out=out, backend=backend, dtype="float32",
                                           max_model_len=256, encoder_buckets=encoder_buckets, use_cache=False, **kw),
                            log=lambda _: None, progress=False)


ARCHITECTURES = {"idefics3": "Idefics3ForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                 "qwen3_vl": "Qwen3VLForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}


@pytest.mark.parametrize("family", ["idefics3", "qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_eager_artifact_runs_images_in_padded_buckets_with_hf_greedy_text(families, family, tmp_path):
    """An artifact of the eager backend: the image side saved with it (processor, config, encoder weights), every
    image run in its bucket's padded shape (eager graphs: the module itself), the same text as HF."""
    path, want = families[family]
    report = compile_vlm(path, tmp_path / "art", "eager")
    assert report.manifest.vision["architecture"] == ARCHITECTURES[family]
    llm = LLM(tmp_path / "art")
    assert llm.loaded.modalities == ("text", "image")
    encoder = llm.runner.vision.encoder
    assert isinstance(encoder, BucketedEncoder)
    check_greedy(llm, want)
    used = {s for s, n in encoder.calls.items() if n}
    if family == "idefics3":
        assert used == {4, 5}  # 5 tiles; the 3-tile images (tall, and small resized up) in the 4-tile bucket
    elif family == "gemma3":
        assert used == {1}  # one square image per call
    else:
        assert used and all(s % 4 == 0 for s in used)


def test_vision_language_compile_refusals(families, tmp_path):
    path = families["idefics3"][0]
    with pytest.raises(ConfigError, match="does not build vision encoder graphs"):
        compile_vlm(path, tmp_path / "a", "neuron")
    with pytest.raises(ConfigError, match="bidirectionally within each image.*--backend eager"):
        compile_vlm(families["gemma3"][0], tmp_path / "g", "cpu")
    with pytest.raises(ConfigError, match="multiples of 1|largest image"):
        compile_vlm(path, tmp_path / "b", "eager", encoder_buckets=(0,))
    with pytest.raises(ConfigError, match="sequence parallelism"):
        compile_vlm(path, tmp_path / "c", "eager", parallel=ParallelConfig(tp=2, sequence_parallel=True))
    with pytest.raises(ConfigError, match="only a vision-language model"):
        compile_artifact(CompileRequest(model="default", out=tmp_path / "d", backend="eager", encoder_buckets=(2,)),
                         log=lambda _: None, progress=False)


@pytest.mark.parametrize("family", [pytest.param("idefics3", marks=pytest.mark.slow),
                                    pytest.param("qwen2_5_vl", marks=pytest.mark.slow),
                                    pytest.param("qwen3_vl", marks=pytest.mark.slow),
                                    pytest.param("gemma3", marks=pytest.mark.slow)])
def test_tp2_decoder_on_ranks_gives_hf_greedy_text(families, family):
    """The decoder sharded over two eager rank processes (the text families' layout), the encoder whole in this
    process; image rows and M-RoPE positions go to the ranks with each step. Qwen2.5-VL (image rows and 3-D
    positions) in the default tier, Idefics3, Qwen3-VL (deepstack rows) and Gemma 3 (bidirectional image blocks'
    last keys) in the slow one: each starts two rank processes."""
    path, want = families[family]
    llm = LLM(path, max_model_len=256, parallel=ParallelConfig(tp=2))
    try:
        check_greedy(llm, want)
    finally:
        llm.runner.executor.close()


@pytest.mark.slow
@pytest.mark.parametrize("family,buckets", [("idefics3", (4, 5)), ("qwen2_5_vl", (256,)), ("qwen3_vl", (256,))])
def test_cpu_artifact_gives_hf_greedy_text(families, family, buckets, tmp_path):
    """The cpu backend: the encoder's AOTInductor graph per bucket beside the decoder's graphs in one artifact, the
    decoder's prefill merging image rows (and M-RoPE rows) after its embedding lookup, and adding Qwen3-VL's
    deepstack rows between its layer graphs."""
    path, want = families[family]
    report = compile_vlm(path, tmp_path / "art", "cpu", encoder_buckets=buckets, prefill_buckets=(128,),
                         decode_buckets=(256,))
    assert sorted(report.manifest.vision["graphs"]) == sorted(str(b) for b in buckets)
    assert all(f.endswith((".so", ".meta.json")) for fs in report.manifest.vision["graphs"].values() for f in fs)
    llm = LLM(tmp_path / "art")
    check_greedy(llm, want)
    assert sum(llm.runner.vision.encoder.calls.values()) == 3


@pytest.mark.slow
def test_qwen3_vl_moe_eager_artifact_gives_hf_greedy_text(tmp_path):
    """Qwen3-VL-MoE compiles as Qwen3-VL (the same encoder buckets, planned alike) beside its MoE decoder."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    path = make_qwen3_vl(tmp_path / "moe", moe=True)
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = load_processor(path, hf.config)
    want = [hf_generate(hf, processor, messages(c), N) for c in CONVS]
    compile_vlm(path, tmp_path / "art", "eager")
    check_greedy(LLM(tmp_path / "art"), want)
