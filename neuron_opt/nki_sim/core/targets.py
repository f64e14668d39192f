"""Per-target hardware constants (one frozen record per chip generation), all from nki.md.

Sources: engine clocks and widths nki.md 4.1 (NKI architecture guides); SBUF/PSUM sizes nki.md 2.1; usable SBUF
per partition (`total_available_sbuf_size`) from the NKI front end's per-architecture constants,
https://github.com/leanprover/KLR/blob/7ccd18c174b2f4bd896bb6025eae7ded1386fa7d/KLR/Trace.lean#L52-L54;
DMA engines and per-engine bandwidth nki.md 4.1 "DMA" (nki-dma-bandwidth-guide); HBM per NeuronCore is chip
bandwidth divided by cores per chip (nki.md 4.1, marked ANALYSIS there).
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_opt.errors import ConfigError


@dataclass(frozen=True)
class Target:
    """Constants of one NeuronCore generation as seen by one kernel.

    Attributes:
        name: target name (`trn1`, `inf2`, `trn2`).
        nc_version: NeuronCore version (2 for trn1/inf2, 3 for trn2).
        tensor_ghz / vector_ghz / scalar_ghz / gpsimd_ghz: engine clocks.
        sbuf_bytes_per_partition: physical SBUF bytes per partition.
        sbuf_usable_bytes_per_partition: what the compiler lets a kernel use (`total_available_sbuf_size`);
            the SBUF capacity rule checks this one.
        psum_banks / psum_bank_bytes: PSUM banks per partition and bytes per bank.
        dma_engines: DMA queues per NeuronCore.
        dma_engine_gbps: bytes/ns (= GB/s) per DMA engine.
        hbm_gbps_per_core: HBM bandwidth available to one NeuronCore.
        dma_fixed_ns: fixed cost of one DMA (descriptor setup + semaphore wait), a latency before it moves data.
        dma_descriptor_ns: queue time per DMA descriptor (one contiguous HBM run landing in one partition), on
            top of bytes / bandwidth; fitted (see `DMA_DESCRIPTOR_NS`).
        peak_bf16_tflops: documented TensorE peak for bf16.
        shared_ports: NeuronCore-v2's shared memory ports: VectorE and GpSimdE cannot access SBUF in parallel,
            VectorE and ScalarE cannot access PSUM in parallel; the compiler serializes such instructions (the
            Trainium/Inferentia2 architecture guide, "Memory hierarchy"). Lifted on NeuronCore-v3.
    """

    name: str
    nc_version: int
    tensor_ghz: float
    vector_ghz: float
    scalar_ghz: float
    gpsimd_ghz: float
    sbuf_bytes_per_partition: int
    sbuf_usable_bytes_per_partition: int
    psum_banks: int
    psum_bank_bytes: int
    dma_engines: int
    dma_engine_gbps: float
    hbm_gbps_per_core: float
    dma_fixed_ns: float
    dma_descriptor_ns: float
    peak_bf16_tflops: float
    shared_ports: bool = False

    @property
    def dma_gbps(self) -> float:
        """Sustained DMA bandwidth of one NeuronCore: all queues, capped by the core's HBM share."""
        return min(self.dma_engines * self.dma_engine_gbps, self.hbm_gbps_per_core)

    def clock_ghz(self, engine: str) -> float:
        return {
            "tensor": self.tensor_ghz,
            "vector": self.vector_ghz,
            "scalar": self.scalar_ghz,
            "gpsimd": self.gpsimd_ghz,
        }[engine]


# Queue time per DMA descriptor, fitted on ONE published timing: the nki-samples tiled matmul (every load a
# [128, 128] or [128, 512] bf16 tile, i.e. 256 B or 1 KiB per descriptor) at [4096, 8192] @ [8192, 8192] on trn1,
# 51.80 ms (nki.md 4.4). `python scripts/calibrate_nki_cost.py` reruns the fit and checks the three other
# published versions of that tutorial, which the fit did not see. The same value serves trn2 (no trn2 timing to
# fit on). It makes a 256 B/partition DMA overhead-bound and one of >= 4 KiB/partition run near the bandwidth,
# which is what the DMA guide says (nki.md 4.1).
DMA_DESCRIPTOR_NS = 60.3

_V2 = dict(
    nc_version=2,
    tensor_ghz=2.8,
    vector_ghz=1.12,
    scalar_ghz=1.4,
    gpsimd_ghz=1.4,
    sbuf_bytes_per_partition=192 * 1024,
    sbuf_usable_bytes_per_partition=180224,
    psum_banks=8,
    psum_bank_bytes=2048,
    dma_engines=16,
    dma_engine_gbps=17.0,
    dma_fixed_ns=1300.0,
    dma_descriptor_ns=DMA_DESCRIPTOR_NS,
    peak_bf16_tflops=92.0,
    shared_ports=True,
)

TARGETS: dict[str, Target] = {
    # trn1: 820 GB/s HBM per chip, 2 NeuronCores.
    "trn1": Target(name="trn1", hbm_gbps_per_core=410.0, **_V2),  # type: ignore[arg-type]
    # inf2: same NeuronCore-v2 and the same 820 GB/s / 2 cores.
    "inf2": Target(name="inf2", hbm_gbps_per_core=410.0, **_V2),  # type: ignore[arg-type]
    "trn2": Target(
        name="trn2",
        nc_version=3,
        tensor_ghz=2.4,
        vector_ghz=0.96,
        scalar_ghz=1.2,
        gpsimd_ghz=1.2,
        sbuf_bytes_per_partition=224 * 1024,
        sbuf_usable_bytes_per_partition=212984,
        psum_banks=8,
        psum_bank_bytes=2048,
        dma_engines=16,
        dma_engine_gbps=23.0,
        hbm_gbps_per_core=362.0,
        dma_fixed_ns=1300.0,
        dma_descriptor_ns=DMA_DESCRIPTOR_NS,
        peak_bf16_tflops=79.0,
    ),
}


def get_target(name: str) -> Target:
    """Look a target up by name; raises ConfigError listing the known names."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ConfigError(f"target: unknown NKI target {name!r}; known: {sorted(TARGETS)}") from None
