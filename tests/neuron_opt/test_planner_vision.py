"""The plan of a vision-language model's image side: the encoder's parameters equal transformers' own modules built
from the same config, and `neuron-opt plan` on a vision-language config.json counts the encoder on each rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_opt.cli import main
from neuron_opt.planner.vision import vision_plan

IDEFICS3 = dict(
    model_type="idefics3", architectures=["Idefics3ForConditionalGeneration"], scale_factor=2, image_token_id=7,
    text_config=dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                       image_size=32, patch_size=8))
QWEN2_5_VL = dict(
    model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], image_token_id=7,
    text_config=dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=16, fullatt_block_indexes=[2], out_hidden_size=64))

QWEN3_VL = dict(
    model_type="qwen3_vl", architectures=["Qwen3VLForConditionalGeneration"], image_token_id=7,
    text_config=dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                       deepstack_visual_indexes=[0, 2]))


@pytest.mark.parametrize("config", [IDEFICS3, QWEN2_5_VL, QWEN3_VL], ids=["idefics3", "qwen2_5_vl", "qwen3_vl"])
def test_encoder_parameters_equal_transformers(config):
    import transformers

    d = dict(config)
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    model = getattr(transformers, config["architectures"][0])(hf_cfg)
    inner = model.model
    vision = ([inner.vision_model, inner.connector] if hasattr(inner, "connector") else [inner.visual])
    want = sum(p.numel() for m in vision for p in m.parameters())
    pre = {"max_image_size": {"longest_edge": 32}, "size": {"longest_edge": 64}, "max_pixels": 64 * 64}
    vp = vision_plan(config, pre, "bfloat16")
    assert vp.parameters == want and vp.weight_bytes == 2 * want
    # Idefics3: 2 x 2 tiles and the global one, 4 tokens each; Qwen2.5-VL and Qwen3-VL: 64 x 64 pixels in 4-pixel
    # patches, 2 x 2 merged
    assert vp.max_image_tokens == (5 * 4 if "scale_factor" in config else 16 * 16 // 4)


def test_plan_counts_the_encoder_on_each_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(IDEFICS3))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_image_size": {"longest_edge": 32},
                                                                   "size": {"longest_edge": 64}}))
    assert main(["plan", "--model", str(tmp_path), "--instance", "inf2.xlarge", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mem = out["memory_bytes"]
    vp = out["vision"]
    assert mem["vision"] == vp["weight_bytes"] + vp["activation_bytes"] > 0
    assert mem["total"] == mem["weights"] + mem["kv_cache"] + mem["scratch"] + mem["lora"] + mem["reserve"] + \
        mem["vision"]
    assert main(["plan", "--model", str(tmp_path), "--instance", "inf2.xlarge"]) == 0
    assert "vision encoder (Idefics3ForConditionalGeneration" in capsys.readouterr().out


def test_gemma3_encoder_parameters_equal_transformers():
    import transformers

    config = dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], mm_tokens_per_image=16,
                  text_config=dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=2, image_size=32, patch_size=4, vision_use_head=False))
    d = dict(config)
    model = transformers.Gemma3ForConditionalGeneration(transformers.AutoConfig.for_model(d.pop("model_type"), **d))
    want = sum(p.numel() for m in (model.model.vision_tower, model.model.multi_modal_projector)
               for p in m.parameters())
    vp = vision_plan(config, {}, "bfloat16")
    assert vp.parameters == want and vp.weight_bytes == 2 * want and vp.max_image_tokens == 16
    assert vision_plan(config, {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 3},
                       "bfloat16").max_image_tokens == 4 * 16  # the image and three crops
