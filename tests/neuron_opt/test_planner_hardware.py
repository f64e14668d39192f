"""Instance table: published figures in the stated units, lookups, tp validation, ring steps, and the
single-core decode cost built from them (validation against published latencies: test_planner_validation.py)."""

from __future__ import annotations

import pytest

from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.errors import ConfigError
from neuron_opt.parallel.sharding import head_layout
from neuron_opt.planner import INSTANCES, check_tp, get_instance
from neuron_opt.planner.hardware import GiB
from neuron_opt.planner.latency import DEFAULT_EFFICIENCY, decode_time, prefill_time

ALLOWED = {
    "inf2.xlarge": (1, 2),
    "inf2.8xlarge": (1, 2),
    "inf2.24xlarge": (1, 2, 4, 8),
    "inf2.48xlarge": (1, 2, 4, 8, 24),
    "trn1.2xlarge": (1, 2),
    "trn1.32xlarge": (1, 2, 8, 16, 32),
    "trn1n.32xlarge": (1, 2, 8, 16, 32),
    "trn2.48xlarge": (1, 2, 4, 8, 16, 32, 64),
}


def test_table_covers_the_instances_with_allowed_degrees() -> None:
    assert set(INSTANCES) == set(ALLOWED)
    for name, degrees in ALLOWED.items():
        inst = get_instance(name)
        assert inst.tp_degrees == degrees and max(degrees) <= inst.cores
        for tp in degrees:
            assert check_tp(name, tp) is inst


# Every figure of hardware.py as AWS publishes it, in the units hardware.py states: bandwidth in decimal bytes/s,
# FLOP rates in decimal FLOP/s, capacities in binary bytes (GiB). Per chip, except host RAM (per instance).
# Sources (docs/hardware.md gives the URLs): chip pages inferentia2 / trainium / trainium2 (HBM, FLOPS, DMA),
# the NKI Trainium/Inferentia2 guide ("32GiB and bandwidth of 820 GB/s"), the Trainium2 comparison table
# (Trainium "0.8 TB/sec" HBM, "384 GB/sec/device" interconnect), instance pages inf2-arch / trn1-arch / trn2-arch
# (NeuronLink per chip, host memory, chips).
#             chips cores  HBM       HBM BW   BF16     FP8      NeuronLink DMA    host RAM
PUBLISHED = {
    "inf2.xlarge": (1, 2, 32 * GiB, 820e9, 190e12, 190e12, 0.0, 1e12, 16 * GiB),
    "inf2.8xlarge": (1, 2, 32 * GiB, 820e9, 190e12, 190e12, 0.0, 1e12, 128 * GiB),
    "inf2.24xlarge": (6, 12, 32 * GiB, 820e9, 190e12, 190e12, 192e9, 1e12, 384 * GiB),
    "inf2.48xlarge": (12, 24, 32 * GiB, 820e9, 190e12, 190e12, 192e9, 1e12, 768 * GiB),
    "trn1.2xlarge": (1, 2, 32 * GiB, 820e9, 190e12, 190e12, 0.0, 1e12, 32 * GiB),
    "trn1.32xlarge": (16, 32, 32 * GiB, 820e9, 190e12, 190e12, 384e9, 1e12, 512 * GiB),
    "trn1n.32xlarge": (16, 32, 32 * GiB, 820e9, 190e12, 190e12, 768e9, 1e12, 512 * GiB),
    "trn2.48xlarge": (16, 64, 96 * GiB, 2.9e12, 667e12, 1299e12, 1024e9, 3.5e12, 2048 * GiB),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_figure_is_the_published_one_in_the_stated_unit(name: str) -> None:
    chips, cores, hbm, bw, bf16, fp8, link, dma, host = PUBLISHED[name]
    inst = get_instance(name)
    per = cores // chips  # NeuronCores (logical on trn2) per chip
    assert (inst.chips, inst.cores, inst.cores_per_chip) == (chips, cores, per)
    assert inst.hbm_per_core == hbm // per
    assert inst.hbm_bw_per_core == pytest.approx(bw / per, rel=1e-12)
    assert inst.bf16_flops_per_core == pytest.approx(bf16 / per, rel=1e-12)
    assert inst.fp8_flops_per_core == pytest.approx(fp8 / per, rel=1e-12)
    assert inst.link_bw_per_chip == link and inst.dma_bw_per_chip == dma and inst.host_ram == host


@pytest.mark.parametrize(
    "name,hbm_gib,bw,bf16",
    [  # instance totals as the instance pages print them (inf2-arch, trn1-arch, trn2-arch)
        ("inf2.48xlarge", 384, 9840e9, 2280e12),
        ("inf2.24xlarge", 192, 4920e9, 1140e12),
        ("trn1.32xlarge", 512, 13120e9, 3040e12),
        ("trn2.48xlarge", 1536, 46.4e12, 10.7e15),
    ],
)
def test_per_core_figures_add_up_to_the_published_instance_totals(
    name: str, hbm_gib: int, bw: float, bf16: float
) -> None:
    inst = get_instance(name)
    assert inst.cores * inst.hbm_per_core == hbm_gib * GiB
    assert inst.cores * inst.hbm_bw_per_core == pytest.approx(bw, rel=1e-12)
    assert inst.cores * inst.bf16_flops_per_core == pytest.approx(bf16, rel=0.005)  # 10.7 PFLOPS is rounded


def test_hbm_bandwidth_agrees_with_the_nki_simulator() -> None:
    # neuron_opt.nki_sim states per-core HBM bandwidth in decimal GB/s (820 GB/s / 2 cores on v2)
    from neuron_opt.nki_sim.core.targets import get_target

    for name, target in (("inf2.xlarge", "inf2"), ("trn1.2xlarge", "trn1")):
        assert get_instance(name).hbm_bw_per_core == get_target(target).hbm_gbps_per_core * 1e9


@pytest.mark.parametrize(
    "name,tp",
    [
        ("inf2.48xlarge", 16),
        ("inf2.24xlarge", 24),
        ("trn1.32xlarge", 4),
        ("inf2.xlarge", 4),
        ("trn2.48xlarge", 128),
    ],
)
def test_disallowed_tp_lists_allowed_degrees(name: str, tp: int) -> None:
    with pytest.raises(ConfigError) as e:
        check_tp(name, tp)
    assert f"allowed: {', '.join(map(str, ALLOWED[name]))}" in str(e.value)


def test_unknown_instance_lists_known_names() -> None:
    with pytest.raises(ConfigError) as e:
        get_instance("inf3.xlarge")
    assert "'inf3.xlarge'" in str(e.value)
    for name in ALLOWED:
        assert name in str(e.value)


def test_decode_single_core_is_weight_bandwidth_bound() -> None:
    # tp=1 batch 1: no collectives; time = every weight byte + KV of the bucket over derated HBM + step
    # overhead
    cfg = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        }
    )
    inst, lay = get_instance("trn1.2xlarge"), head_layout(cfg, ParallelConfig(tp=1))
    t = decode_time(cfg, lay, inst, batch=1, kv_len=1024, dtype="bfloat16", kv_dtype="bfloat16")
    kv = 30 * 2 * 3 * 64 * 1024 * 2
    assert t.collective == 0.0 and t.bound in ("memory", "overhead")
    assert t.memory == pytest.approx((2 * 134_515_008 + kv) / (410e9 * DEFAULT_EFFICIENCY.hbm), rel=1e-12)
    longer = decode_time(cfg, lay, inst, batch=1, kv_len=2048, dtype="bfloat16", kv_dtype="bfloat16")
    assert longer.memory - t.memory == pytest.approx(kv / (410e9 * DEFAULT_EFFICIENCY.hbm), rel=1e-9)
    p = prefill_time(cfg, lay, inst, batch=1, seq=1024, dtype="bfloat16")
    assert p.total > t.total


def test_ring_steps_follow_the_chip_grid() -> None:
    # 1D ring of c chips: 2 (c - 1) hops; a torus: 2 (d - 1) per dimension in use, first dimension filled first
    inf2, trn1 = get_instance("inf2.48xlarge"), get_instance("trn1.32xlarge")
    assert [inf2.ring_steps(c) for c in (1, 2, 4, 12)] == [0, 2, 6, 22]
    assert [trn1.ring_steps(c) for c in (1, 4, 8, 16)] == [0, 6, 8, 12]
    assert get_instance("trn1.2xlarge").ring_steps(1) == 0
