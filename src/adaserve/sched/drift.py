"""Noticing that the machine no longer runs at the speed it was profiled at (no torch).

The online correction absorbs moderate drift (a CPU 1.4x slower than profiled), but a
profile measured under load, or a machine whose speed changed for good, leaves every
prediction off by a large factor. ``DriftMonitor`` keeps the ratio measured / profiled
iteration time of the last ``window`` iterations; when their median leaves
``[low, high]`` it asks for the profile to be measured again (at an idle moment, at
most once per ``min_interval_s``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class DriftConfig:
    """When to re-measure the hardware profile.

    enabled:        watch for drift at all
    window:         iterations whose median measured / profiled ratio is judged
    low / high:     the median ratio outside [low, high] means the profile is stale
    min_interval_s: at least this long (clock seconds) between two re-measurements
    """

    enabled: bool = True
    window: int = 64
    low: float = 0.5
    high: float = 2.0
    min_interval_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError("drift window must be a positive integer")
        if not (0 < self.low < 1 < self.high and math.isfinite(self.high)):
            raise ValueError("drift bounds must satisfy 0 < low < 1 < high")
        if not self.min_interval_s >= 0:
            raise ValueError("drift min_interval_s must be >= 0")


class DriftMonitor:
    """Median measured / profiled iteration time over a sliding window."""

    def __init__(self, cfg: DriftConfig | None = None):
        self.cfg = cfg or DriftConfig()
        self.ratios: deque[float] = deque(maxlen=self.cfg.window)
        self.pending = False  # a re-measurement is due
        self.last_remeasure: float | None = None
        self.remeasures = 0

    def median(self) -> float | None:
        """The window's median ratio (None until the window is full)."""
        if len(self.ratios) < self.cfg.window:
            return None
        return statistics.median(self.ratios)

    def observe(self, predicted_ms: float, measured_ms: float, now: float) -> bool:
        """Fold in one iteration; True when this one makes a re-measurement due."""
        if not self.cfg.enabled or self.pending or not (predicted_ms > 0 and measured_ms > 0):
            return False
        if self.last_remeasure is not None and now - self.last_remeasure < self.cfg.min_interval_s:
            return False
        self.ratios.append(measured_ms / predicted_ms)
        m = self.median()
        if m is not None and not self.cfg.low <= m <= self.cfg.high:
            self.pending = True
            return True
        return False

    def remeasured(self, now: float) -> None:
        """The profile was measured again at ``now``: start a fresh window."""
        self.pending = False
        self.ratios.clear()
        self.last_remeasure = now
        self.remeasures += 1


def predicted_step_ms(hw, trace) -> float:
    """The profile's prediction (ms, no online correction) of the iteration a
    ``StepTrace`` describes, priced as the planner prices it: the verification pass
    and its KV, ``depth`` draft steps (the engine's trace records ``draft_passes`` as depth + 1) with the drafted candidates
    spread over them, host overhead."""
    ms = float(hw.verify_latency(max(trace.tokens, 1), trace.kv_tokens)) + hw.overhead_ms
    depth = trace.draft_passes - 1
    if depth > 0:
        ms += hw.drafting_ms(depth, trace.drafted / depth, trace.draft_catchup, len(trace.spec))
    return ms
