"""When each instruction of one kernel run starts and ends: a dependency-aware schedule over engine queues.

The estimate is a list schedule in program order (documented in docs/nki_simulator.md, "Cost model"):

- **Engines.** TensorE, VectorE, ScalarE and GpSimdE each run one instruction at a time. An instruction is
  placed at the earliest time, at or after its operands are ready, at which its engine is idle for its whole
  duration. That may be in an idle gap left before work placed earlier (the compiler's scheduler moves
  independent instructions ahead within an engine's stream); the last `GAP_WINDOW` gaps of each engine are
  kept, which bounds how far ahead an instruction can move.
- **Shared ports (NeuronCore-v2).** VectorE and GpSimdE cannot access SBUF in parallel, and VectorE and ScalarE
  cannot access PSUM in parallel (the compiler serializes such instructions). An engine instruction that has an
  operand or result in that memory holds the port (`SBUF_PORT`, `PSUM_PORT`, each one more lane) for its whole
  duration, and starts at the earliest time at which its engine and its ports are all idle. The memories come
  from the recorded operands and results (a result assigned into a tile is in that tile's memory) plus what the
  instruction names as `touches`. Targets without `shared_ports` (trn2) skip this.
- **Dependencies through storage.** An instruction starts after the instructions that wrote what it reads have
  finished (read after write), and, for what it writes, after earlier readers and writers of the same elements
  (write after read, write after write). Elements are compared as boxes per storage dim (as the affine_range
  rule does); each storage keeps its last `HISTORY` read and write boxes, older ones fold into one
  whole-storage time (a conservative bound). `t += x` both reads and writes.
- **Loop-local tiles are double-buffered where memory allows.** A tile allocated inside a loop at one place
  in the kernel source takes its first write only after the tile allocated at the same place two allocations
  earlier was last accessed: the DMA of block j+1 can overlap compute on block j, not run arbitrarily far
  ahead. It gets that second buffer only if the run's SBUF (bytes per partition) or PSUM (banks) peak so far
  plus one more copy fits; otherwise it waits for the previous one (single buffer). Four PSUM banks of scores
  next to two more banks in use cannot be double-buffered, for instance.
- **DMA.** A transfer of R partition rows is split evenly over min(R, 16) of the 16 DMA queues; each piece
  needs its bytes at the per-queue bandwidth plus `dma_descriptor_ns` per descriptor (a descriptor is one
  contiguous run of HBM that lands in one partition). It starts `dma_fixed_ns` after its operands are ready
  (descriptor setup and semaphore wait: latency, not queue time). The queues are pooled into one resource
  that transfers interleave on at descriptor granularity: a transfer's queue time fills the pool's idle time
  from its start on, gaps first (it is triggered when its data is ready, not queued behind one that waits),
  and it ends no earlier than one piece's time after it starts.
- An instruction with no recorded operands issued right after one that recorded no result (the second
  instruction of one API call, such as the copy of a PSUM transpose to SBUF) depends on it.
- A fresh result assigned into a tile (`t[...] = nl.exp(x)`) is written there by the instruction that made
  it, and never held a buffer of its own (no double-buffer gate). If that instruction was already scheduled
  (the result was assigned later), the destination is written when both it and the destination's earlier
  accesses are done; the instruction itself is not delayed (a small optimism).

The latency is the end of the last instruction. Busy time per engine (the sum of its instructions) gives the
throughput bound and the per-engine utilisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron_opt.nki_sim.core.targets import Target

SBUF_PORT = "sbuf_port"  # NeuronCore-v2: VectorE and GpSimdE cannot access SBUF in parallel
PSUM_PORT = "psum_port"  # NeuronCore-v2: VectorE and ScalarE cannot access PSUM in parallel
GAP_WINDOW = 24  # idle gaps kept per engine queue for backfilling
HISTORY = 16  # read/write boxes kept per storage before they fold into a whole-storage time
_EPS = 1e-9

Box = tuple[tuple[int, int], ...]


class Lane:
    """One engine or DMA queue: busy intervals in time order, the idle gaps between the recent ones."""

    __slots__ = ("tail", "gaps", "busy")

    def __init__(self) -> None:
        self.tail = 0.0
        self.gaps: list[tuple[float, float]] = []
        self.busy = 0.0

    def earliest(self, ready: float, dur: float) -> float:
        """The earliest start >= ready with `dur` of idle time (a kept gap, else after the tail)."""
        for a, b in self.gaps:
            if b - dur < ready:
                continue
            s = a if a > ready else ready
            if s + dur <= b + _EPS:
                return s
        return self.tail if self.tail > ready else ready

    def reserve(self, s: float, dur: float) -> None:
        """Mark [s, s + dur) busy; `s` came from `earliest` (inside a kept gap or at/after the tail)."""
        self.busy += dur
        if s >= self.tail - _EPS:
            if s - self.tail > _EPS:
                self.gaps.append((self.tail, s))
                self._trim()
            self.tail = max(self.tail, s + dur)
            return
        for i, (a, b) in enumerate(self.gaps):
            if a - _EPS <= s and s + dur <= b + _EPS:
                self.gaps[i:i + 1] = [g for g in ((a, s), (s + dur, b)) if g[1] - g[0] > _EPS]
                self._trim()
                return
        raise AssertionError("Lane.reserve: the interval is not idle")  # pragma: no cover

    def place(self, ready: float, dur: float) -> float:
        """Run `dur` at the earliest start >= ready with that much idle time (a gap, else after the tail)."""
        s = self.earliest(ready, dur)
        self.reserve(s, dur)
        return s

    def _trim(self) -> None:
        if len(self.gaps) > GAP_WINDOW:
            del self.gaps[:len(self.gaps) - GAP_WINDOW]

    def fill(self, ready: float, work: float) -> float:
        """Preemptible placement: `work` spread over the idle time from `ready` on, gaps first; returns its end."""
        self.busy += work
        end = ready
        kept: list[tuple[float, float]] = []
        for a, b in self.gaps:
            s = a if a > ready else ready
            if work <= _EPS or b - s <= _EPS:
                kept.append((a, b))
                continue
            use = min(b - s, work)
            if s - a > _EPS:
                kept.append((a, s))
            if b - (s + use) > _EPS:
                kept.append((s + use, b))
            work -= use
            end = s + use
        self.gaps = kept
        self._trim()
        if work > _EPS:
            s = self.tail if self.tail > ready else ready
            if s - self.tail > _EPS:
                self.gaps.append((self.tail, s))
                self._trim()
            self.tail = s + work
            end = self.tail
        return end


def _place_all(lanes: list[Lane], ready: float, dur: float) -> float:
    """Reserve `dur` at the earliest start >= ready at which every lane is idle for that long."""
    s = ready
    while True:
        t = s
        for lane in lanes:
            t = lane.earliest(t, dur)
        if t <= s + _EPS:
            break
        s = t
    for lane in lanes:
        lane.reserve(s, dur)
    return s


def _overlap(a: Box, b: Box) -> bool:
    return all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(a, b, strict=True))


@dataclass
class _History:
    """Recent accesses of one storage: (box, end time) lists and the folded whole-storage bound."""

    writes: list[tuple[Box, float]] = field(default_factory=list)
    reads: list[tuple[Box, float]] = field(default_factory=list)
    write_floor: float = 0.0
    read_floor: float = 0.0
    gate: _History | None = None  # the storage whose buffer this one reuses (double buffering)
    last: float = 0.0  # end of its last access

    def ready(self, box: Box) -> float:
        t = self.write_floor
        for b, e in self.writes:
            if e > t and _overlap(b, box):
                t = e
        return t

    def free(self, box: Box) -> float:
        t = max(self.ready(box), self.read_floor, self.gate.last if self.gate is not None else 0.0)
        for b, e in self.reads:
            if e > t and _overlap(b, box):
                t = e
        return t

    @staticmethod
    def _add(lst: list[tuple[Box, float]], box: Box, end: float) -> float:
        for i, (b, e) in enumerate(lst):
            if b == box:  # moved to the end: the oldest entries are the ones folded
                del lst[i]
                end = max(e, end)
                break
        lst.append((box, end))
        if len(lst) > HISTORY:
            return lst.pop(0)[1]
        return 0.0

    def wrote(self, box: Box, end: float) -> None:
        self.write_floor = max(self.write_floor, self._add(self.writes, box, end))
        self.last = max(self.last, end)

    def read(self, box: Box, end: float) -> None:
        self.read_floor = max(self.read_floor, self._add(self.reads, box, end))
        self.last = max(self.last, end)


@dataclass
class _Open:
    """The instruction placed most recently, still collecting the results it writes."""

    lane: str
    dur: float
    reads: list[tuple[int, Box]]
    writes: list[tuple[int, Box]] = field(default_factory=list)
    after: float = 0.0  # extra ready time (chained to the previous instruction)
    pieces: int = 0  # DMA: queues the transfer is split over (0: an engine instruction)
    touches: tuple[str, ...] = ()  # memories accessed beyond the recorded operands


class Timeline:
    """Schedule of one kernel run; fed by CostRecorder (instructions, DMAs) and SimContext (accesses)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.engines: dict[str, Lane] = {}
        self.dma_lane = Lane()  # the 16 queues as one preemptible resource of their summed bandwidth
        self.storages: dict[int, _History] = {}
        self.sites: dict[object, list[int]] = {}
        self.site_of: dict[int, object] = {}
        self.temp_sites: set[object] = set()  # sites whose tiles are results written straight into another
        self.pending: list[tuple[int, Box]] = []
        self.open: _Open | None = None
        self.alias: int | None = None
        self.makespan = 0.0
        self.memory: dict[int, str] = {}  # storage serial -> the memory it lives in
        # NeuronCore-v2 shares one SBUF port between VectorE and GpSimdE and one PSUM port between VectorE and
        # ScalarE: instructions of the two engines that access that memory are serialized (module docstring).
        self.ports: dict[str, Lane] = {}

    # ---- feed -------------------------------------------------------------------------------------------
    def access(self, serial: int, box: Box, kind: str, memory: str = "sbuf") -> None:
        """A read (operand of the next instruction), or a write / accumulation (result of the last one), of a
        storage in `memory` (`sbuf`, `psum` or `hbm`)."""
        self.memory[serial] = memory
        if kind == "read":
            self.pending.append((serial, box))
            return
        alias, self.alias = self.alias, None
        op = self.open
        if alias is not None and (op is None or all(s != alias for s, _ in op.writes)):
            # written by an instruction already scheduled: the destination holds the value when it finished
            src = self.storages.get(alias)
            end = src.last if src is not None else 0.0
            h = self._hist(serial)
            end = max(end, h.free(box))
            h.wrote(box, end)
            return
        if op is None:
            return
        if alias is not None:
            self._unbuffer(alias)
            self.memory[alias] = memory  # the result is made where it is assigned, not in a tile of its own
        op.writes.append((serial, box))
        if kind == "accum":
            op.reads.append((serial, box))

    def written_by(self, serial: int) -> None:
        """The next write holds the value of storage `serial` (a fresh result assigned into a tile)."""
        self.alias = serial

    def allocated(self, serial: int, site: object, depth: int = 2) -> None:
        """A tile allocated inside a loop at `site`, with `depth` buffers (2 when memory has room for a second
        copy, else 1): its first write waits for the tile allocated there `depth` allocations earlier."""
        prev = self.sites.setdefault(site, [])
        if len(prev) >= depth:
            # resolved when the first write is scheduled: the old tile's last access may still be open now
            self._hist(serial).gate = self._hist(prev[-depth])
        prev.append(serial)
        self.site_of[serial] = site
        if len(prev) > 2:
            del prev[0]

    def _unbuffer(self, serial: int) -> None:
        """A fresh result written straight into its destination never held a buffer of its own."""
        h = self.storages.get(serial)
        if h is not None:
            h.gate = None
        site = self.site_of.pop(serial, None)
        if site is not None:
            self.temp_sites.add(site)
            if serial in self.sites.get(site, ()):
                self.sites[site].remove(serial)

    def instruction(self, engine: str, us: float, touches: tuple[str, ...] = ()) -> None:
        """An engine instruction of `us`; `touches` names memories it accesses beyond its recorded operands
        (the PSUM side of a copy issued as the second instruction of an API call)."""
        self._next(_Open(engine, us, self.pending, touches=touches))

    def dma(self, rows: int, nbytes: int, descriptors: int) -> None:
        t = self.target
        pieces = max(1, min(t.dma_engines, rows))
        per_bw = t.dma_gbps / t.dma_engines  # bytes per ns per queue
        dur = (nbytes / pieces / per_bw + descriptors / pieces * t.dma_descriptor_ns) / 1e3
        self._next(_Open("dma", dur, self.pending, pieces=pieces))

    def finish(self) -> float:
        """Schedule what is still open; the latency in us."""
        self._flush()
        return self.makespan

    @property
    def dma_queue_us(self) -> float:
        """Queue time of all DMAs divided by the number of queues."""
        return self.dma_lane.busy

    # ---- scheduling -------------------------------------------------------------------------------------
    def _hist(self, serial: int) -> _History:
        h = self.storages.get(serial)
        if h is None:
            h = self.storages[serial] = _History()
        return h

    def _next(self, op: _Open) -> None:
        prev = self.open
        self.pending = []
        chained = not op.reads and prev is not None and not prev.writes
        end = self._flush()
        if chained:
            op.after = end
        self.open = op

    def _flush(self) -> float:
        op, self.open = self.open, None
        if op is None:
            return 0.0
        ready = op.after
        for s, box in op.reads:
            h = self.storages.get(s)
            if h is not None:
                ready = max(ready, h.ready(box))
        for s, box in op.writes:
            ready = max(ready, self._hist(s).free(box))
        if not op.pieces:
            lane = self.engines.get(op.lane)
            if lane is None:
                lane = self.engines[op.lane] = Lane()
            lanes = [lane] + [self._port(p) for p in self._ports_of(op)]
            start = _place_all(lanes, ready, op.dur)
            end = start + op.dur
        else:
            end = self._place_dma(ready + self.target.dma_fixed_ns / 1e3, op.pieces, op.dur)
        for s, box in op.reads:
            self._hist(s).read(box, end)
        for s, box in op.writes:
            self._hist(s).wrote(box, end)
        self.makespan = max(self.makespan, end)
        return end

    def _ports_of(self, op: _Open) -> list[str]:
        """The shared memory ports an engine instruction holds for its duration (none on NeuronCore-v3)."""
        if not self.target.shared_ports:
            return []
        mems = set(op.touches)
        mems.update(self.memory.get(s, "sbuf") for s, _ in op.reads)
        mems.update(self.memory.get(s, "sbuf") for s, _ in op.writes)
        ports = []
        if op.lane in ("vector", "gpsimd") and "sbuf" in mems:
            ports.append(SBUF_PORT)
        if op.lane in ("vector", "scalar") and "psum" in mems:
            ports.append(PSUM_PORT)
        return ports

    def _port(self, name: str) -> Lane:
        lane = self.ports.get(name)
        if lane is None:
            lane = self.ports[name] = Lane()
        return lane

    @property
    def port_busy_us(self) -> dict[str, float]:
        """Time each shared port was held (instructions of either engine that access its memory)."""
        return {name: lane.busy for name, lane in self.ports.items()}

    def _place_dma(self, ready: float, pieces: int, dur: float) -> float:
        """`pieces` queues busy `dur` each: that much work on the pooled queues, no faster than `dur`."""
        return max(self.dma_lane.fill(ready, dur * pieces / self.target.dma_engines), ready + dur)
