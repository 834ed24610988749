"""Passes that ran far over their prediction, and why (no torch).

A pass more than ``factor`` times its profiled prediction is a stall. Its cause is the
first of these that the probes saw during the pass:

- ``compile``: a numba kernel was compiled (``adaserve.util.jit.compiles`` moved);
- ``gc``: Python's garbage collector ran a collection (``gc.get_stats`` moved);
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


def gc_collections() -> int:
    """Collections Python's garbage collector has run in this process, all generations."""
    return sum(s.get("collections", 0) for s in gc.get_stats())


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
    gcs: int
    compiles: int


class StallDetector:
    """Classifies passes over ``factor`` x their prediction (see the module docstring)."""

    def __init__(
        self,
        factor: float = 3.0,
        cpu_share: float = 0.6,
        cpu_time: Callable[[], float] = time.thread_time,
        wall_time: Callable[[], float] = time.perf_counter,
        gcs: Callable[[], int] = gc_collections,
        compiles: Callable[[], int] = numba_compiles,
    ):
        if not factor > 1:
            raise ValueError("stall factor must be > 1")
        if not 0 < cpu_share <= 1:
            raise ValueError("cpu_share must be in (0, 1]")
        self.factor = factor
        self.cpu_share = cpu_share
        self._cpu, self._wall, self._gcs, self._compiles = cpu_time, wall_time, gcs, compiles
        self.last: str | None = None  # the last pass's cause (None: not a stall)

    def begin(self) -> Probe:
        return Probe(self._cpu(), self._wall(), self._gcs(), self._compiles())

    def end(self, probe: Probe, predicted_ms: float, measured_ms: float) -> str | None:
        """The pass's cause when it was a stall (``measured_ms > factor x
        predicted_ms``), else None."""
        self.last = None
        if not (predicted_ms > 0 and measured_ms > self.factor * predicted_ms):
            return None
        if self._compiles() != probe.compiles:
            cause = "compile"
        elif self._gcs() != probe.gcs:
            cause = "gc"
        else:
            wall = self._wall() - probe.wall_s
            cpu = self._cpu() - probe.cpu_s
            cause = "slowed_machine" if wall > 0 and cpu < self.cpu_share * wall else "unknown"
        self.last = cause
        return cause
