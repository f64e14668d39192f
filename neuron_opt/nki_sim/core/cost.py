"""Cost model: per-instruction engine cycles, DMA time, and the per-run Report.

Model (documented in docs/nki_simulator.md):
- Each instruction costs the documented "estimated instruction cost" of its engine (nki.md 4.2, legacy NKI
  ISA docstrings), in cycles of that engine, converted to time with the engine clock of the target.
- A DMA costs bytes / per-queue bandwidth plus a fitted time per descriptor on each of the queues it is split
  over, after a fixed latency (1.3 us); see core/timeline.py.
- The latency is a schedule of every instruction over the engine and DMA queues (and, on NeuronCore-v2, the
  SBUF and PSUM ports two engines share) with the dependencies the kernel's tiles impose (core/timeline.py),
  not a max over engines: an engine waits for the data it needs.
  Busy time per engine is still reported; the largest is the throughput bound.
No efficiency factor is applied.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from neuron_opt.nki_sim.core.loops import LoopTracker
from neuron_opt.nki_sim.core.targets import Target
from neuron_opt.nki_sim.core.timeline import Timeline

MIN_II = 64  # minimum initiation interval of Vector/Scalar/GpSimd instructions, cycles (nki.md 4.2)
MM_INIT = 64  # TensorE matmul turnaround, cycles
GPSIMD_START = 150  # GpSimd iota/affine_select start cost, cycles
RED_RES_READOUT = 64  # extra ScalarE instruction reading the reduce registers out

ENGINES = ("tensor", "vector", "scalar", "gpsimd")


def matmul_cycles(stationary_free: int, moving_free: int, fp32: bool) -> float:
    """`nc_matmul`: max(min(64, N_stationary), N_moving), 4x for fp32 operands."""
    cyc = max(min(MM_INIT, stationary_free), moving_free)
    return float(cyc * (4 if fp32 else 1))


def pe_transpose_cycles(partitions: int, free: int) -> float:
    """TensorE `nc_transpose`: max(P, min(64, F))."""
    return float(max(partitions, min(MM_INIT, free)))


def streaming_cycles(n: float, per_elem: float = 1.0, extra: float = 0.0) -> float:
    """Vector/Scalar streaming instruction: max(MIN_II, per_elem*N) + extra."""
    return float(max(MIN_II, per_elem * n) + extra)


def gpsimd_cycles(n: float) -> float:
    return float(GPSIMD_START + n)


@dataclass(frozen=True)
class EngineStats:
    """Work of one engine in one kernel run."""

    instructions: int
    cycles: float
    busy_us: float


@dataclass(frozen=True)
class Report:
    """What one simulated kernel run cost, as estimated from the documented per-instruction formulas.

    Attributes:
        target: target name.
        engines: per engine (`tensor`, `vector`, `scalar`, `gpsimd`) instruction count, cycles, busy time.
        ops: instruction counts by `engine.op`.
        dma_transfers / dma_bytes / dma_descriptors: DMA instructions, bytes moved, descriptors (contiguous HBM
            runs per partition).
        dma_busy_us: queue time of all DMAs divided by the number of queues (the DMA throughput bound).
        latency_us: estimated kernel latency: the end of the last instruction in the dependency-aware schedule.
        throughput_bound_us: the largest busy time over engines, DMA and shared ports (what perfect overlap would
            reach).
        utilization: per engine, `dma` and shared port (`sbuf_port`, `psum_port`; NeuronCore-v2), busy time /
            latency.
        matmul_flops: 2*K*M*N summed over matmuls (transposes excluded).
        tensor_utilization: matmul_flops / (latency * peak bf16 FLOP/s of the target).
        bound_by: the engine, `dma` or shared port with the largest busy time.
        sbuf_peak_bytes_per_partition / psum_peak_banks: allocator high-water marks.
        static_instructions: instructions (DMAs included) of one SPMD program as compiled: a rolled loop's
            body counted once, an unrolled one once per iteration (core/loops.py); the largest over programs.
        port_busy_us: per shared port (NeuronCore-v2), the time the instructions that hold it take.
    """

    target: str
    engines: dict[str, EngineStats]
    ops: dict[str, int]
    dma_transfers: int
    dma_bytes: int
    dma_descriptors: int
    dma_busy_us: float
    latency_us: float
    throughput_bound_us: float
    utilization: dict[str, float]
    matmul_flops: int
    tensor_utilization: float
    bound_by: str
    sbuf_peak_bytes_per_partition: int
    psum_peak_banks: int
    static_instructions: int = 0
    port_busy_us: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["engines"] = {k: dict(v.__dict__) for k, v in self.engines.items()}
        d["ops"] = dict(self.ops)
        d["utilization"] = dict(self.utilization)
        d["port_busy_us"] = dict(self.port_busy_us)
        return d

    def __str__(self) -> str:
        lines = [
            f"NKI simulator report ({self.target}): latency {self.latency_us:.2f} us (throughput bound "
            f"{self.throughput_bound_us:.2f} us, {self.bound_by})",
            f"  TensorE utilisation {self.tensor_utilization * 100:.1f}% "
            f"({self.matmul_flops / 1e9:.3f} GFLOP of matmul)",
        ]
        for name, st in self.engines.items():
            lines.append(
                f"  {name:<7} {st.instructions:>9} instr {st.cycles:>14.0f} cycles {st.busy_us:>12.2f} us "
                f"{self.utilization[name] * 100:5.1f}% busy"
            )
        lines.append(
            f"  dma     {self.dma_transfers:>9} xfers {self.dma_bytes / 2**20:>12.2f} MiB  "
            f"{self.dma_busy_us:>12.2f} us {self.utilization['dma'] * 100:5.1f}% busy "
            f"({self.dma_descriptors} descriptors)"
        )
        for name, us in self.port_busy_us.items():
            lines.append(f"  {name:<9} {us:>44.2f} us {self.utilization[name] * 100:5.1f}% busy")
        lines.append(
            f"  SBUF peak {self.sbuf_peak_bytes_per_partition} "
            f"B/partition; PSUM peak {self.psum_peak_banks} banks; {self.static_instructions} static instructions"
        )
        return "\n".join(lines)


@dataclass
class CostRecorder:
    """Accumulates instruction and DMA costs during one kernel run."""

    target: Target
    loops: LoopTracker = field(default_factory=LoopTracker)
    counts: Counter[str] = field(default_factory=Counter)
    cycles: dict[str, float] = field(default_factory=lambda: {e: 0.0 for e in ENGINES})
    ops: Counter[str] = field(default_factory=Counter)
    timeline: Timeline = field(init=False)
    dma_transfers: int = 0
    dma_bytes: int = 0
    dma_descriptors: int = 0
    matmul_flops: int = 0

    def __post_init__(self) -> None:
        self.timeline = Timeline(self.target)

    def instr(self, engine: str, op: str, cycles: float, touches: tuple[str, ...] = ()) -> None:
        """One instruction of `cycles` on `engine`; `touches` names memories it accesses that are not recorded
        as its operands (core/timeline.py, shared ports)."""
        self.counts[engine] += 1
        self.cycles[engine] += cycles
        self.ops[f"{engine}.{op}"] += 1
        self.loops.instruction((engine, op, cycles))
        self.timeline.instruction(engine, cycles / (self.target.clock_ghz(engine) * 1e3), touches)

    def dma(
        self, nbytes: int, to_hbm: bool, access_bytes: int | None = None, rows: int = 1, descriptors: int = 1
    ) -> None:
        """One DMA of `nbytes` (masked-out elements excluded) over an access of `access_bytes` (default the same),
        moving `rows` partition rows as `descriptors` contiguous HBM runs."""
        self.loops.instruction(("dma", "store" if to_hbm else "load", nbytes if access_bytes is None else access_bytes))
        self.dma_transfers += 1
        self.dma_bytes += int(nbytes)
        self.dma_descriptors += int(descriptors)
        self.ops["dma.store" if to_hbm else "dma.load"] += 1
        self.timeline.dma(rows, int(nbytes), int(descriptors))

    def report(self, sbuf_peak: int, psum_peak: int, static_instructions: int = 0) -> Report:
        t = self.target
        engines = {
            e: EngineStats(self.counts[e], self.cycles[e], self.cycles[e] / (t.clock_ghz(e) * 1e3))
            for e in ENGINES
        }
        latency = self.timeline.finish()
        dma_us = self.timeline.dma_queue_us
        busy = {e: s.busy_us for e, s in engines.items()}
        busy["dma"] = dma_us
        ports = self.timeline.port_busy_us
        busy.update(ports)
        bound = max(busy, key=lambda k: busy[k])
        utilization = {k: (v / latency if latency > 0 else 0.0) for k, v in busy.items()}
        peak_flops_per_us = t.peak_bf16_tflops * 1e6
        util = self.matmul_flops / (latency * peak_flops_per_us) if latency > 0 else 0.0
        return Report(
            target=t.name,
            engines=engines,
            ops=dict(sorted(self.ops.items())),
            dma_transfers=self.dma_transfers,
            dma_bytes=self.dma_bytes,
            dma_descriptors=self.dma_descriptors,
            dma_busy_us=dma_us,
            latency_us=latency,
            throughput_bound_us=busy[bound],
            utilization=utilization,
            matmul_flops=self.matmul_flops,
            tensor_utilization=util if math.isfinite(util) else 0.0,
            bound_by=bound,
            sbuf_peak_bytes_per_partition=sbuf_peak,
            psum_peak_banks=psum_peak,
            static_instructions=static_instructions,
            port_busy_us=dict(sorted(ports.items())),
        )
