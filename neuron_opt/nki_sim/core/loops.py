"""Loops as the compiler sees them: rolled (`affine_range`, `sequential_range`) or unrolled (`static_range`).

Two rules and one count come from that distinction:

- **A rolled loop runs one instruction sequence.** On hardware the index of an `affine_range` or
  `sequential_range` loop is a runtime register, so what an iteration issues (instructions, their shapes, the
  loops nested in it) cannot depend on it; only addresses can, affinely. The simulator runs loops with Python
  ints, so a kernel could compute a tile extent from the index (`min(128, s - i * 128)`) and get a different
  body per iteration, which would not compile. `LoopTracker` records each iteration's signature (the engine,
  op and cycles of every instruction, the bytes of every DMA, each nested loop as kind, trip count and the
  hash of its body) and raises `RolledLoopError` when an iteration differs from the first. Peel the tail,
  hoist the varying part into a `static_range` loop, or use a mask.
- **`affine_range` iterations are independent** (the legacy compiler's err_unexpected_output_dependencies):
  an iteration may not read a location an earlier iteration wrote, nor write one an earlier iteration read
  or wrote, in a tensor allocated outside the loop. Accumulation (`t += x`, including PSUM matmul
  accumulation) is the exception: accumulating into a location other iterations also accumulate into is
  allowed, reading or overwriting it is not. Accesses are compared as boxes (per storage dim, the lowest and
  highest index touched, masked-out elements excluded), so interleaved strided accesses count as overlapping.
  Violations raise `LoopDependencyError`; use `sequential_range`.
- **Static instruction count**: the instructions the compiled kernel holds, counting a rolled loop's body once
  and an unrolled loop's body once per iteration (`Report.static_instructions`). Dynamic counts grow with
  the work; this one shows whether the program text does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from neuron_opt.nki_sim.core.errors import LoopDependencyError, RolledLoopError

ROLLED = ("affine_range", "sequential_range")
Box = tuple[tuple[int, int], ...]


@dataclass
class _Frame:
    kind: str
    trip: int
    start_serial: int  # storages with a smaller serial were allocated before the loop
    iteration: int = -1
    sig: list[Any] = field(default_factory=list)  # current iteration's signature
    ref_sig: list[Any] | None = None  # iteration 0's (rolled loops)
    count: int = 0  # current iteration's static instructions
    static_total: int = 0  # static instructions of the whole loop so far
    body_hash: int = 0  # running hash of all iterations' signatures (for the parent's signature)
    # affine_range only: storage serial -> {box: (first iteration, every access an accumulation)}
    writes: dict[int, dict[Box, tuple[int, bool]]] = field(default_factory=dict)
    reads: dict[int, dict[Box, int]] = field(default_factory=dict)


def _overlap(a: Box, b: Box) -> bool:
    return all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(a, b, strict=True))


class LoopTracker:
    """Loop nesting of one kernel run: rolled-loop uniformity, affine independence, static instruction count."""

    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.static_instructions = 0

    # ---- loop structure ---------------------------------------------------------------------------------
    def loop(self, kind: str, args: tuple[int, ...], start_serial: int, scope: Any) -> Any:
        """Generator behind `nl.affine_range` & co: yields the indices, one scope and signature per iteration."""
        rng = range(*args)
        frame = _Frame(kind, len(rng), start_serial)
        self.frames.append(frame)
        try:
            for n, i in enumerate(rng):
                frame.iteration = n
                frame.sig, frame.count = [], 0
                with scope():
                    yield i
                self._end_iteration(frame)
        finally:
            self._exit(frame)

    def _end_iteration(self, f: _Frame) -> None:
        if f.kind in ROLLED:
            if f.ref_sig is None:
                f.ref_sig = f.sig
                f.static_total = f.count
            elif f.sig != f.ref_sig:
                raise RolledLoopError(_mismatch(f))
        else:
            f.static_total += f.count
        f.body_hash = hash((f.body_hash, tuple(f.sig)))

    def _exit(self, f: _Frame) -> None:
        if f not in self.frames:  # a generator closed after its kernel ended
            return
        while self.frames and self.frames[-1] is not f:
            self.frames.pop()
        self.frames.pop()
        entry = ("loop", f.kind, f.trip, f.body_hash if f.kind not in ROLLED else hash(tuple(f.ref_sig or ())))
        if self.frames:
            parent = self.frames[-1]
            parent.sig.append(entry)
            parent.count += f.static_total
        else:
            self.static_instructions += f.static_total

    def instruction(self, sig: tuple[Any, ...]) -> None:
        """One issued instruction (or DMA) with its signature."""
        if self.frames:
            f = self.frames[-1]
            f.sig.append(sig)
            f.count += 1
        else:
            self.static_instructions += 1

    # ---- affine_range independence ----------------------------------------------------------------------
    def access(self, serial: int, name: str, box: Box, kind: str) -> None:
        """A read, write or accumulation (`kind`) of `box` of the storage with `serial`."""
        for f in self.frames:
            if f.kind != "affine_range" or serial >= f.start_serial:
                continue
            it = f.iteration
            writes = f.writes.setdefault(serial, {})
            for b, (first, accum) in writes.items():
                if first < it and _overlap(b, box) and not (kind == "accum" and accum):
                    raise LoopDependencyError(_dep_msg(name, box, it, first, kind, "accumulated" if accum else "wrote"))
            if kind == "read":
                reads = f.reads.setdefault(serial, {})
                if box not in reads:
                    reads[box] = it
                continue
            for b, first in f.reads.get(serial, {}).items():
                if first < it and _overlap(b, box):
                    raise LoopDependencyError(_dep_msg(name, box, it, first, kind, "read"))
            prev = writes.get(box)
            accum = kind == "accum"
            writes[box] = (it if prev is None else prev[0], accum if prev is None else prev[1] and accum)


def _dep_msg(name: str, box: Box, it: int, first: int, kind: str, did: str) -> str:
    what = {"read": "reads", "write": "writes", "accum": "accumulates into"}[kind]
    where = ", ".join(f"{lo}:{hi}" for lo, hi in box)
    return (f"loop-carried dependency in nl.affine_range: iteration {it} {what} {name}[{where}], which iteration "
            f"{first} {did} (err_unexpected_output_dependencies); iterations of an affine_range loop must be "
            f"independent except for accumulation (+=): use nl.sequential_range for a loop that carries state")


def _mismatch(f: _Frame) -> str:
    ref, cur = f.ref_sig or [], f.sig
    k = next((i for i, (a, b) in enumerate(itertools.zip_longest(ref, cur)) if a != b), 0)
    a = ref[k] if k < len(ref) else "nothing"
    b = cur[k] if k < len(cur) else "nothing"
    return (f"nl.{f.kind} body differs between iteration 0 and iteration {f.iteration} (instruction {k}: {a} vs "
            f"{b}): a rolled loop issues one instruction sequence, so shapes and nested trip counts cannot depend "
            f"on the loop index; peel the varying iteration, mask it, or use nl.static_range")
