"""The state of one simulated kernel run: target, mode, allocator, cost recorder, SPMD ids, loop scopes.

It is carried in a ContextVar so that API functions (which, in NKI, take no context argument) find the run
they belong to; nothing else in the simulator is global.
"""

from __future__ import annotations

import contextvars
import os
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from neuron_opt.nki_sim.core.cost import CostRecorder
from neuron_opt.nki_sim.core.errors import SimulatorError
from neuron_opt.nki_sim.core.loops import LoopTracker
from neuron_opt.nki_sim.core.memory import OnChipAllocator, Storage, next_serial
from neuron_opt.nki_sim.core.targets import Target


@dataclass
class SimContext:
    """Everything one kernel run needs besides the tensors themselves."""

    target: Target
    count_only: bool
    program_ids: tuple[int, ...] = ()
    grid: tuple[int, ...] = ()
    allocator: OnChipAllocator = field(init=False)
    cost: CostRecorder = field(init=False)
    loops: LoopTracker = field(init=False)
    scopes: list[list[weakref.ref[Storage]]] = field(default_factory=list)
    # shared_hbm tensors are shared by all SPMD programs: the i-th allocation of each program is one tensor.
    shared_hbm: list[object] = field(default_factory=list)
    shared_index: int = 0
    # Storage serial being accumulated into by `t += x`: its reads and writes inside that instruction are the
    # accumulation itself, recorded once as `accum`.
    accum_serial: int | None = None
    # Buffers per allocation site of loop-local tiles (1 or 2, decided when the site allocates again, so
    # that the innermost, most repeated tiles are served first) and the extra copies granted so far per memory
    # (core/timeline.py, "double-buffered where memory allows").
    site_depth: dict[object, int | None] = field(default_factory=dict)
    granted: dict[str, int] = field(default_factory=lambda: {"sbuf": 0, "psum": 0})

    def __post_init__(self) -> None:
        self.allocator = OnChipAllocator(self.target)
        self.loops = LoopTracker()
        self.cost = CostRecorder(self.target, self.loops)

    def register(self, storage: Storage) -> None:
        """Account an on-chip allocation and tie its lifetime to the innermost loop scope."""
        self.allocator.allocate(storage)
        if self.scopes:
            self.scopes[-1].append(weakref.ref(storage))
            site = (storage.buffer.value, _kernel_site())
            self.cost.timeline.allocated(storage.serial, site, self._buffer_depth(storage, site))

    def _buffer_depth(self, storage: Storage, site: object) -> int:
        """Buffers of a loop-local tile's site. The first allocation waits for nothing, so the choice is made
        at the second; a site of results written straight into other tiles holds no buffer and takes none."""
        if site not in self.site_depth:
            self.site_depth[site] = None
            return 2
        depth = self.site_depth[site]
        if depth is None:
            mem = storage.buffer.value
            depth = 2
            if site not in self.cost.timeline.temp_sites:
                if self.allocator.has_room_for_copy(storage, self.granted[mem]):
                    self.granted[mem] += self.allocator.copy_units(storage)
                else:
                    depth = 1
            self.site_depth[site] = depth
        return depth

    def loop(self, kind: str, args: tuple[int, ...]) -> Iterator[int]:
        """An `nl` range of `kind` (affine_range, sequential_range, static_range): one scope per iteration."""
        return self.loops.loop(kind, args, next_serial(), self.scope)

    def access(self, tile: Any, kind: str, mask: Any = None) -> None:
        """Record a `read`, `write` or `accum` of a tile view for the affine_range independence rule."""
        st = tile.storage
        if st.serial == self.accum_serial:
            return
        box = tile.box(mask)
        self.cost.timeline.access(st.serial, box, kind, st.buffer.value)
        if any(f.kind == "affine_range" for f in self.loops.frames):
            self.loops.access(st.serial, st.name, box, kind)

    @contextmanager
    def scope(self) -> Iterator[None]:
        """One loop iteration: tiles allocated inside die when it ends."""
        self.scopes.append([])
        try:
            yield
        finally:
            for ref in self.scopes.pop():
                st = ref()
                if st is not None and st.alive:
                    st.freed_by_scope = True
                    st.release()


_SIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kernel_site() -> tuple[tuple[str, int], ...]:
    """Where the kernel allocated a tile: its chain of source lines (the kernel function and the helpers it
    called), so that one helper called twice per iteration gives two sites."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SIM_DIR):
        f = f.f_back
    chain = []
    while f is not None and not f.f_code.co_filename.startswith(_SIM_DIR) and len(chain) < 8:
        chain.append((f.f_code.co_filename, f.f_lineno))
        f = f.f_back
    return tuple(chain)


_CURRENT: contextvars.ContextVar[SimContext | None] = contextvars.ContextVar("nki_sim_context", default=None)


def current() -> SimContext:
    """The running kernel's context; NKI API calls outside a kernel are an error."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise SimulatorError(
            "NKI API called outside a kernel: run the kernel through simulate_kernel or @jit"
        )
    return ctx


def maybe_current() -> SimContext | None:
    return _CURRENT.get()


@contextmanager
def activate(ctx: SimContext) -> Iterator[SimContext]:
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
