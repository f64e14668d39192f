"""Instance table: what each AWS Neuron instance offers one NeuronCore, with every number sourced.

Units (one convention for every figure here and in `Instance`):
- Bandwidth in decimal bytes per second (GB/s = 1e9 B/s, TB/s = 1e12 B/s) and compute in decimal FLOP/s
  (TFLOPS = 1e12), as AWS's chip pages and NKI guides publish them.
- Capacities (HBM, host RAM) in binary bytes (GiB = 2**30), as the hardware has them and AWS labels them.
- Where AWS labels a bandwidth "GiB/sec" (the Inferentia2 / Trainium chip pages and the inf2-arch / trn1-arch
  instance tables), the figure is read as decimal: the same "820" of HBM bandwidth is "820 GB/s" in the NKI
  architecture guide and "0.8 TB/sec" in the Trainium2 comparison table, which also gives trn1's NeuronLink
  "384" in "GB/sec/device"; and two HBM2e stacks at 3.2 Gb/s per pin give 819.2e9 B/s, not 880e9. The page
  that publishes each figure is quoted above it.

Design decisions:
- Numbers are per NeuronCore as the runtime sees it (a "rank"): chip figures divided by cores per chip. On
  trn2 a rank is a logical core (LNC=2: two physical cores sharing one 24 GiB HBM bank), the SDK default.
- Every value comes from the AWS Neuron documentation (URLs beside each figure; docs/hardware.md tabulates
  them); derived values say how they are derived. No value here is fitted to benchmark results.
- The allowed tp degrees are the runtime's (feature guide "Tensor-parallelism support"), capped by the
  instance's core count: inf2.24xlarge has 12 cores, so tp 24 is not offered there.
- `cpu` is a pseudo-instance for the CPU backend: capacity is this machine's RAM, shared by all ranks, and no
  latency is modelled (CPU decode is dominated by framework overhead the table cannot predict).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from neuron_opt.errors import ConfigError

GiB = 1 << 30  # capacities
GB = 10**9  # bandwidths
TFLOPS = 10**12


@dataclass(frozen=True)
class Instance:
    """One instance type, described per NeuronCore (rank)."""

    name: str
    family: str  # inf2 | trn1 | trn2 | cpu
    chips: int
    cores: int  # NeuronCores the runtime exposes (logical cores on trn2)
    hbm_per_core: int  # bytes (GiB-sized)
    hbm_bw_per_core: float  # bytes/s, decimal
    bf16_flops_per_core: float  # dense FLOP/s
    fp8_flops_per_core: float  # dense FLOP/s
    link_bw_per_chip: float  # bytes/s between chips (NeuronLink); 0 on single-chip instances
    dma_bw_per_chip: float  # bytes/s of the chip's DMA engines: the path between cores of one chip
    host_ram: int  # bytes
    tp_degrees: tuple[int, ...]
    shared_memory: bool = False  # True for cpu: every rank draws on the same RAM
    chip_grid: tuple[int, ...] = ()  # NeuronLink arrangement of the chips: (n,) ring, (a, b) 2D torus

    def ring_steps(self, chips: int) -> int:
        """Sequential hops of a ring all-reduce over `chips` chips: reduce-scatter then all-gather, (d - 1)
        steps each along every torus dimension in use (a 1D ring of c chips: 2 (c - 1)); 0 on one chip.

        The chips in use fill the first grid dimension first (rank order), e.g. 4 chips of a 4x4 torus form
        one ring of 4, 8 chips a 4x2 torus.
        """
        dims, left = [], chips
        for d in self.chip_grid:
            dims.append(min(d, left))
            left = -(-left // d)
        if left > 1 or not self.chip_grid:  # no grid known (single-chip instances): a plain ring
            dims = [chips]
        return 2 * sum(d - 1 for d in dims)

    @property
    def cores_per_chip(self) -> int:
        return self.cores // self.chips


# --- per-chip figures, each under the page(s) that publish it ---------------------------------------------------
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/guides/architecture/trainium_inferentia2_arch.html
#   "2 HBM stacks with a total device memory capacity of 32GiB and bandwidth of 820 GB/s"
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/inferentia2.html
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium.html
#   the same 32 GiB and 820 (labelled "GiB/sec", read as GB/s: module docstring), "190 FP16/BF16/cFP8/TF32
#   TFLOPS", "1 TB/sec of DMA bandwidth"
_V2_HBM_CHIP = 32 * GiB  # Inferentia2 / Trainium1 chip
_V2_BW_CHIP = 820 * GB
_V2_BF16_CHIP = 190 * TFLOPS  # cFP8 runs at the same rate on NeuronCore-v2
_V2_DMA_CHIP = 1000 * GB  # the collective path between the cores of one chip
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/inf2-arch.html
#   "NeuronLink-v2 device-to-device (GiB/sec/device)": 192 on inf2.24xlarge / 48xlarge. Read as GB/s like
#   trn1's 384 below: Inferentia2 has 2 NeuronLink-v2 ports, Trainium 4 (NKI guide above), 96 GB/s each.
_INF2_LINK_CHIP = 192 * GB
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trn1-arch.html
#   same column: 384 (trn1.32xlarge), 768 (trn1n.32xlarge), labelled GiB/sec/device
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium2.html
#   comparison table: Trainium "Inter-chip Interconnect (GB/sec/device)" 384
_TRN1_LINK_CHIP = 384 * GB
_TRN1N_LINK_CHIP = 768 * GB
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium2.html
#   "96 GiB of device memory with 2.9 TB/sec of bandwidth", "667 BF16/FP16/TF32 TFLOPS", "1,299 FP8 TFLOPS",
#   "3.5 TB/sec of DMA bandwidth"
_TRN2_HBM_CHIP = 96 * GiB
_TRN2_BW_CHIP = 2900 * GB
_TRN2_BF16_CHIP = 667 * TFLOPS
_TRN2_FP8_CHIP = 1299 * TFLOPS
_TRN2_DMA_CHIP = 3500 * GB
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trn2-arch.html
#   "Intra-instance NeuronLink-v3 bandwidth (GB/sec/device)" 1,024
_TRN2_LINK_CHIP = 1024 * GB
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-features/logical-neuroncore-config.html
#   LNC=2 (the default) pairs the 8 physical cores into 4 logical ones, each with a 24 GiB HBM bank
_TRN2_LOGICAL_PER_CHIP = 4
# Chip topology: trn1.32xlarge and trn2.48xlarge are a 4x4 2D torus (trn1-arch, trn2-arch); the inf2 pages show
# the chips of inf2.24xlarge / 48xlarge on one NeuronLink ring (inf2-arch topology figure, not stated in text).
_TORUS_4X4 = (4, 4)

_INF2_TP = (1, 2, 4, 8, 24)
_TRN1_TP = (1, 2, 8, 16, 32)
_TRN2_TP = (1, 2, 4, 8, 16, 32, 64)


def _v2(
    name: str,
    family: str,
    chips: int,
    link_chip: float,
    host_gib: int,
    degrees: tuple[int, ...],
    grid: tuple[int, ...] = (),
) -> Instance:
    cores = 2 * chips
    return Instance(
        name=name,
        family=family,
        chips=chips,
        cores=cores,
        hbm_per_core=_V2_HBM_CHIP // 2,
        hbm_bw_per_core=_V2_BW_CHIP / 2,
        bf16_flops_per_core=_V2_BF16_CHIP / 2,
        fp8_flops_per_core=_V2_BF16_CHIP / 2,
        link_bw_per_chip=link_chip,
        dma_bw_per_chip=_V2_DMA_CHIP,
        host_ram=host_gib * GiB,  # inf2-arch / trn1-arch "Host Memory (GiB)"
        tp_degrees=tuple(d for d in degrees if d <= cores),
        chip_grid=grid,
    )


INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        _v2("inf2.xlarge", "inf2", 1, 0.0, 16, _INF2_TP),
        _v2("inf2.8xlarge", "inf2", 1, 0.0, 128, _INF2_TP),
        _v2("inf2.24xlarge", "inf2", 6, _INF2_LINK_CHIP, 384, _INF2_TP, (6,)),
        _v2("inf2.48xlarge", "inf2", 12, _INF2_LINK_CHIP, 768, _INF2_TP, (12,)),
        _v2("trn1.2xlarge", "trn1", 1, 0.0, 32, _TRN1_TP),
        _v2("trn1.32xlarge", "trn1", 16, _TRN1_LINK_CHIP, 512, _TRN1_TP, _TORUS_4X4),
        _v2("trn1n.32xlarge", "trn1", 16, _TRN1N_LINK_CHIP, 512, _TRN1_TP, _TORUS_4X4),
        Instance(
            name="trn2.48xlarge",
            family="trn2",
            chips=16,
            cores=16 * _TRN2_LOGICAL_PER_CHIP,
            hbm_per_core=_TRN2_HBM_CHIP // _TRN2_LOGICAL_PER_CHIP,
            hbm_bw_per_core=_TRN2_BW_CHIP / _TRN2_LOGICAL_PER_CHIP,
            bf16_flops_per_core=_TRN2_BF16_CHIP / _TRN2_LOGICAL_PER_CHIP,
            fp8_flops_per_core=_TRN2_FP8_CHIP / _TRN2_LOGICAL_PER_CHIP,
            link_bw_per_chip=_TRN2_LINK_CHIP,
            dma_bw_per_chip=_TRN2_DMA_CHIP,
            host_ram=2048 * GiB,  # trn2-arch "Host Memory (GiB)"
            tp_degrees=_TRN2_TP,
            chip_grid=_TORUS_4X4,
        ),
    )
}


def known_instances() -> list[str]:
    return sorted(INSTANCES) + ["cpu"]


def host_ram_bytes() -> int:
    """Physical RAM of this machine (the `cpu` pseudo-instance's capacity)."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def cpu_instance() -> Instance:
    ram = host_ram_bytes()
    return Instance(
        name="cpu",
        family="cpu",
        chips=1,
        cores=os.cpu_count() or 1,
        hbm_per_core=ram,
        hbm_bw_per_core=0.0,
        bf16_flops_per_core=0.0,
        fp8_flops_per_core=0.0,
        link_bw_per_chip=0.0,
        dma_bw_per_chip=0.0,
        host_ram=ram,
        tp_degrees=tuple(2**k for k in range(7)),
        shared_memory=True,
    )


def get_instance(name: str) -> Instance:
    """Look an instance up by name (`cpu` included); unknown names raise ConfigError listing the known
    ones."""
    if name == "cpu":
        return cpu_instance()
    try:
        return INSTANCES[name]
    except KeyError:
        raise ConfigError(
            f"instance: unknown instance {name!r}; known instances: {', '.join(known_instances())}"
        ) from None


def check_tp(instance: str | Instance, tp: int) -> Instance:
    """Validate `--instance NAME --tp N`; return the instance or raise ConfigError listing the allowed
    degrees."""
    inst = get_instance(instance) if isinstance(instance, str) else instance
    if tp not in inst.tp_degrees:
        raise ConfigError(
            f"tp: {tp} is not a tensor-parallel degree the Neuron runtime supports on {inst.name} "
            f"({inst.cores} NeuronCores); allowed: {', '.join(map(str, inst.tp_degrees))}"
        )
    return inst
