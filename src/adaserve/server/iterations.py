"""The server's recent iterations: one timeline sample per engine step (bounded).

The engine thread hands every step's ``StepTrace`` to ``IterationLog.record``, which
keeps ``core.trace.sample`` of it (running / waiting, KV use, the chosen depth and
budget B, tree nodes, accepted tokens and budget share per class) stamped in seconds
from the log's start. ``series`` turns the newest samples into the column arrays the
dashboard charts (``adaserve.util.dashboard_page``).
"""

from __future__ import annotations

import threading
from collections import deque

from adaserve.core.trace import StepTrace, sample
from adaserve.util.dashboard_page import timeline_series


class IterationLog:
    """The newest ``max_samples`` iteration samples; thread-safe."""

    def __init__(self, t0: float, max_samples: int = 600):
        self.t0 = t0
        self._lock = threading.Lock()
        self._samples: deque[dict] = deque(maxlen=max_samples)
        self.recorded = 0  # samples recorded in all (kept or not)

    def record(self, tr: StepTrace) -> None:
        """Keep one iteration (called on the engine thread)."""
        s = sample(tr, tr.t_end - self.t0)
        with self._lock:
            self._samples.append(s)
            self.recorded += 1

    def samples(self) -> list[dict]:
        with self._lock:
            return list(self._samples)

    def since(self, seen: int) -> tuple[list[dict], int]:
        """The samples recorded after the first ``seen`` (those still kept), and how
        many have been recorded in all (a cluster replica pushes its new ones)."""
        with self._lock:
            n = min(self.recorded - seen, len(self._samples))
            return (list(self._samples)[len(self._samples) - n :] if n > 0 else []), self.recorded

    def series(self, classes, last: int | None = None) -> dict:
        """Column arrays of the newest ``last`` samples (all kept when None): the
        overall series (``dashboard_page.SERIES_KEYS``) and, per class, its mean tree nodes and
        accepted tokens per request and its share of B in each iteration (None where
        the class had no request in that pass, or the plan set no budget)."""
        return timeline_series(self.samples()[-last if last else 0 :], classes)
