"""Noticing that the machine no longer runs at the speed it was profiled at (no torch).

The online correction absorbs moderate drift (a CPU 1.4x slower than profiled), but a
machine whose speed changed for good leaves every prediction off by a large factor.
``DriftMonitor`` keeps the ratio measured / profiled iteration time of the last
``window`` iterations; when their median leaves ``[low, high]`` it reports drift (the
engine logs it, exports it as a metric and shows it on the dashboard), and again when
the median comes back inside. It never re-measures anything: a measurement inside the
serving loop stalls every request for seconds, and one taken while the machine is busy
moves every class target. A fresh profile comes from ``adaserve profile`` or the
explicit admin action (``POST /v1/admin/profile``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from adaserve.core.trace import DraftWork


@dataclass(frozen=True)
class DriftConfig:
    """When to report drift from the hardware profile.

    enabled:        watch for drift at all
    window:         iterations whose median measured / profiled ratio is judged
    low / high:     the median ratio outside [low, high] means the profile is stale
    min_interval_s: at least this long (clock seconds) between two drift reports
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
    """Median measured / profiled iteration time over a sliding window.

    ``drifted`` is True while the window's median is outside ``[low, high]``;
    ``events`` counts the times it went outside; ``reported_at`` is when the last
    report was made (reports are at most one per ``min_interval_s``)."""

    def __init__(self, cfg: DriftConfig | None = None):
        self.cfg = cfg or DriftConfig()
        self.ratios: deque[float] = deque(maxlen=self.cfg.window)
        self.drifted = False
        self.events = 0
        self.reported_at: float | None = None

    def median(self) -> float | None:
        """The window's median ratio (None until the window is full)."""
        if len(self.ratios) < self.cfg.window:
            return None
        return statistics.median(self.ratios)

    def observe(self, predicted_ms: float, measured_ms: float, now: float) -> bool:
        """Fold in one iteration; True when drift should be reported now (the median
        just left the bounds, and no report was made in the last ``min_interval_s``)."""
        if not self.cfg.enabled or not (predicted_ms > 0 and measured_ms > 0):
            return False
        self.ratios.append(measured_ms / predicted_ms)
        m = self.median()
        if m is None:
            return False
        outside = not self.cfg.low <= m <= self.cfg.high
        if outside == self.drifted:
            return False
        self.drifted = outside
        if not outside:
            return False
        self.events += 1
        if self.reported_at is not None and now - self.reported_at < self.cfg.min_interval_s:
            return False
        self.reported_at = now
        return True

    def reset(self) -> None:
        """A new profile was adopted: start a fresh window."""
        self.ratios.clear()
        self.drifted = False

    def as_dict(self) -> dict:
        """What ``/v1/slo/report`` and the dashboard show."""
        m = self.median()
        return {
            "enabled": self.cfg.enabled,
            "median_ratio": None if m is None else round(m, 4),
            "drifted": self.drifted,
            "events": self.events,
            "bounds": [self.cfg.low, self.cfg.high],
            "window": self.cfg.window,
        }


def predicted_pass_ms(
    hw,
    tokens: float,
    kv_tokens: float,
    prefill_pairs: float,
    draft: DraftWork,
    requests: float = 0.0,
    rows: float = 0.0,
) -> float:
    """The profile's prediction (ms, no online correction) of one pass of ``requests``
    requests: the verification of ``tokens`` with its context and prefill pairs and its
    ``rows`` logits rows (every tree node, each completing prefill's last token), the
    host overhead and the draft's passes (``HardwareModel.draft_passes_ms``, the one
    price of draft work)."""
    ms = float(hw.verify_latency(max(tokens, 1), kv_tokens, prefill_pairs)) + hw.host_ms(requests)
    ms += hw.logits_ms_per_row * rows
    if draft.passes:
        ms += hw.draft_passes_ms(
            draft.catchup, draft.steps, draft.request_steps, draft.kv_tokens, draft.requests
        )
    return ms
