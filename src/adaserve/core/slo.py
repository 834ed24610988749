"""Service-level objectives: per-request targets and named classes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaserve.errors import InvalidRequestError

# what admission may do with a request whose class's promise cannot be kept now
ON_OVERLOAD = ("refuse", "degrade")

# the finish reasons of a request that completed (not shed, aborted or failed)
COMPLETE_REASONS = ("stop", "length")


def slo_met(
    completed: bool,
    tpot_ms: float | None,
    ttft_ms: float | None,
    tpot_target_ms: float | None,
    ttft_target_ms: float | None,
) -> bool:
    """SLO attainment, the one definition (the server's report and metrics, the bench
    and simulator reports): the request completed, its mean TPOT within its target and
    its TTFT within its target, each checked where both the target and the measurement
    exist (a one-token answer has no TPOT)."""
    if not completed:
        return False
    if tpot_target_ms is not None and tpot_ms is not None and tpot_ms > tpot_target_ms:
        return False
    return not (ttft_target_ms is not None and ttft_ms is not None and ttft_ms > ttft_target_ms)


def _check_ms(name: str, v: float | None) -> None:
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v <= 0 or v > 1e9:
        raise InvalidRequestError(f"{name} must be a positive number of milliseconds", name)


@dataclass(frozen=True)
class SLO:
    """Latency targets of one request (milliseconds; None = no target).

    ``on_overload``: what admission does when this class's promise cannot be kept now:
    ``"refuse"`` (the request is shed, 429 with Retry-After) or ``"degrade"`` (it is
    admitted in the first looser class along the ``degrade_to`` chain that can keep
    its promise, served and billed there; refused only when none can).
    """

    tpot_ms: float | None = None
    ttft_ms: float | None = None
    max_queue_ms: float | None = None
    deadline_ms: float | None = None
    cls: str = "default"
    on_overload: str = "refuse"

    def __post_init__(self) -> None:
        for n in ("tpot_ms", "ttft_ms", "max_queue_ms", "deadline_ms"):
            _check_ms(n, getattr(self, n))
        if not isinstance(self.cls, str) or not self.cls:
            raise InvalidRequestError("SLO class must be a non-empty string", "slo_class")
        if self.on_overload not in ON_OVERLOAD:
            raise InvalidRequestError(
                f"on_overload must be one of {', '.join(ON_OVERLOAD)}", "on_overload"
            )


@dataclass(frozen=True)
class SLOClass:
    """A named class. TPOT is given in ms, or as a multiple of the unloaded TPOT.

    ``rank`` orders strictness (0 = strictest); ``degrade_to`` names the looser class a
    request moves to under overload; ``min_rate`` is the minimum progress rate
    (tokens/s) the scheduler guarantees under overload.
    """

    name: str
    tpot_ms: float | None = None
    tpot_x: float | None = None
    ttft_ms: float | None = None
    max_queue_ms: float | None = None
    rank: int = 0
    degrade_to: str | None = None
    min_rate: float = 0.0
    price_per_1k: float = 0.0
    priority: int = 0

    def __post_init__(self) -> None:
        if self.tpot_ms is not None and self.tpot_x is not None:
            raise InvalidRequestError(f"class {self.name}: give tpot_ms or tpot_x, not both")
        _check_ms("tpot_ms", self.tpot_ms)
        _check_ms("ttft_ms", self.ttft_ms)
        _check_ms("max_queue_ms", self.max_queue_ms)
        if self.tpot_x is not None and not self.tpot_x > 0:
            raise InvalidRequestError(f"class {self.name}: tpot_x must be positive")

    def resolve(self, unloaded_tpot_ms: float) -> SLO:
        """The concrete SLO of this class given the measured unloaded TPOT."""
        tpot = self.tpot_ms
        if tpot is None and self.tpot_x is not None:
            tpot = self.tpot_x * unloaded_tpot_ms
        return SLO(
            tpot_ms=tpot, ttft_ms=self.ttft_ms, max_queue_ms=self.max_queue_ms, cls=self.name
        )


DEFAULT_CLASSES: tuple[SLOClass, ...] = (
    SLOClass(
        "interactive",
        tpot_x=1.2,
        ttft_ms=2000,
        rank=0,
        degrade_to="chat",
        price_per_1k=4.0,
        priority=0,
    ),
    SLOClass(
        "chat", tpot_x=1.8, ttft_ms=4000, rank=1, degrade_to="batch", price_per_1k=1.0, priority=1
    ),
    SLOClass(
        "batch",
        tpot_x=5.0,
        ttft_ms=30000,
        max_queue_ms=30000,
        rank=2,
        min_rate=2.0,
        price_per_1k=0.25,
        priority=2,
    ),
)


def looser_slo(own: SLO, cls: SLO, looser: SLO) -> SLO:
    """The SLO a request with SLO ``own`` (its class's ``cls``, scaled by the run's
    SLO scale and its own overrides) gets in the looser class ``looser``: each target
    scaled by the looser class's over its own class's, so the scale and the
    request's overrides carry over (a target its class lacks is the looser one's)."""

    def moved(mine: float | None, base: float | None, new: float | None) -> float | None:
        if new is None or mine is None:
            return new if mine is None else mine
        return mine * (new / base) if base else new

    return SLO(
        tpot_ms=moved(own.tpot_ms, cls.tpot_ms, looser.tpot_ms),
        ttft_ms=moved(own.ttft_ms, cls.ttft_ms, looser.ttft_ms),
        max_queue_ms=looser.max_queue_ms if looser.max_queue_ms is not None else own.max_queue_ms,
        deadline_ms=own.deadline_ms,
        cls=looser.cls,
        on_overload=own.on_overload,
    )
