"""Passes that ran far over their prediction, and why (no torch).

A pass more than ``factor`` times its profiled prediction is a stall. Its cause is the
first of these that the probes saw during the pass:

- ``compile``: a numba kernel was compiled (``adaserve.util.jit.compiles`` moved);
- ``gc``: Python's garbage collector ran for at least half the pass's time over its
  prediction (``gc_ms``, timed by a ``gc.callbacks`` hook: a young collection of a
  tenth of a millisecond during a stall does not name it; in an 80 s overload run of
  the server, 17 collections after start-up took 2.7 ms at most);
- ``slowed_machine``: the engine thread got less than ``cpu_share`` of the pass's
  wall time on a core (``time.thread_time``): another process, or the machine's own
  throttling, took it;
- ``unknown``: none of those.

The probes are injected so that a test can drive every cause without a slow machine.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

CAUSES = ("compile", "gc", "slowed_machine", "unknown")


class _GcClock:
    """The ms Python's garbage collector has spent in this process since installed (a
    ``gc.callbacks`` hook; collections run one at a time, under the GIL)."""

    def __init__(self) -> None:
        self.total_ms = 0.0
        self._t0: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total_ms += (time.perf_counter() - self._t0) * 1000.0
            self._t0 = None


_gc_clock: _GcClock | None = None


def gc_ms() -> float:
    """The ms the garbage collector has spent since the first call (which installs the
    hook; a ``StallDetector`` makes it when built)."""
    global _gc_clock
    if _gc_clock is None:
        _gc_clock = _GcClock()
        gc.callbacks.append(_gc_clock)
    return _gc_clock.total_ms


def numba_compiles() -> int:
    """Compiles of adaserve's numba kernels so far (0 where numba is not loaded)."""
    import sys

    jit = sys.modules.get("adaserve.util.jit")
    return int(jit.compiles()) if jit is not None else 0


@dataclass(frozen=True)
class Probe:
    """The probes' readings at the start of a pass."""

    cpu_s: float
    wall_s: float
    gc_ms: float
    compiles: int


class StallDetector:
    """Classifies passes over ``factor`` x their prediction (see the module docstring)."""

    def __init__(
        self,
        factor: float = 3.0,
        cpu_share: float = 0.6,
        cpu_time: Callable[[], float] = time.thread_time,
        wall_time: Callable[[], float] = time.perf_counter,
        gc_time: Callable[[], float] = gc_ms,
        compiles: Callable[[], int] = numba_compiles,
    ):
        if not factor > 1:
            raise ValueError("stall factor must be > 1")
        if not 0 < cpu_share <= 1:
            raise ValueError("cpu_share must be in (0, 1]")
        self.factor = factor
        self.cpu_share = cpu_share
        self._cpu, self._wall, self._gc, self._compiles = cpu_time, wall_time, gc_time, compiles
        self._gc()  # installs the collector's clock (``gc_ms``) before the first pass
        self.last: str | None = None  # the last pass's cause (None: not a stall)

    def begin(self) -> Probe:
        return Probe(self._cpu(), self._wall(), self._gc(), self._compiles())

    def end(self, probe: Probe, predicted_ms: float, measured_ms: float) -> str | None:
        """The pass's cause when it was a stall (``measured_ms > factor x
        predicted_ms``), else None."""
        self.last = None
        if not (predicted_ms > 0 and measured_ms > self.factor * predicted_ms):
            return None
        if self._compiles() != probe.compiles:
            cause = "compile"
        elif self._gc() - probe.gc_ms >= 0.5 * (measured_ms - predicted_ms):
            cause = "gc"
        else:
            wall = self._wall() - probe.wall_s
            cpu = self._cpu() - probe.cpu_s
            cause = "slowed_machine" if wall > 0 and cpu < self.cpu_share * wall else "unknown"
        self.last = cause
        return cause
