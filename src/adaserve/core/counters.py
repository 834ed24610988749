"""Run-wide counters (monotonic), shared by the scheduler and what executes its passes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Counters:
    """Engine-wide counters read by metrics exporters and run reports.

    The scheduler keeps iterations, preemptions, degradations, sheds and fallbacks;
    the executor (the engine's model runner or the simulator) keeps the token counts.
    """

    iterations: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0  # request-iterations that verified at least one candidate
    spec_draft_tokens: int = 0  # candidate nodes verified
    spec_accepted_tokens: int = 0
    accepted_per_pos: dict[int, int] = field(default_factory=dict)
    drafted_tokens: int = 0  # nodes the draft produced (before selection)
    fallback_iterations: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    degraded: int = 0
    # admitted in a looser class instead of refused (``on_overload="degrade"``), by the
    # reason the asked-for class was refused for
    degraded_on_admission: dict[str, int] = field(default_factory=dict)
    shed: dict[str, int] = field(default_factory=dict)
    shed_by_class: dict[str, dict[str, int]] = field(default_factory=dict)  # cls -> reason -> n
    # per class, of the admitted requests that finished with a promise: the sum of
    # their predicted chances of meeting the SLO, how many, and how many met it
    promised: dict[str, list[float]] = field(default_factory=dict)
    stalls: dict[str, int] = field(default_factory=dict)  # cause -> passes > 3x predicted
    model_time_s: float = 0.0
    step_time_s: float = 0.0

    def count_fallback(self, reason: str) -> None:
        """One more iteration (or request-iteration) that fell back for ``reason``."""
        self.fallback_iterations[reason] = self.fallback_iterations.get(reason, 0) + 1

    def count_shed(self, reason: str, cls: str | None = None) -> None:
        """One more request (of class ``cls``) shed for ``reason``."""
        self.shed[reason] = self.shed.get(reason, 0) + 1
        if cls is not None:
            by = self.shed_by_class.setdefault(cls, {})
            by[reason] = by.get(reason, 0) + 1

    def count_promise(self, cls: str, chance: float, met: bool) -> None:
        """An admitted request of ``cls`` promised ``chance`` finished, ``met`` or not."""
        p = self.promised.setdefault(cls, [0.0, 0, 0])
        p[0] += chance
        p[1] += 1
        p[2] += int(met)

    def count_degraded_on_admission(self, reason: str) -> None:
        """One more request admitted in a looser class instead of shed for ``reason``."""
        self.degraded_on_admission[reason] = self.degraded_on_admission.get(reason, 0) + 1

    def count_stall(self, cause: str) -> None:
        """One more pass far over its prediction, for ``cause`` (``core.stalls``)."""
        self.stalls[cause] = self.stalls.get(cause, 0) + 1


def admission_summary(
    shed_by_class: dict[str, dict[str, int]] | None,
    promised: dict[str, list[float]] | None,
) -> dict[str, dict[str, Any]]:
    """What admission did, per class: the refusals by reason and, of its admitted
    requests that finished with a promise, how many (``promised_n``), the mean
    predicted chance of meeting the SLO (``predicted_attainment``) and the share that
    met it (``realised_attainment``). Takes ``Counters.shed_by_class`` and
    ``Counters.promised`` (or their copies)."""
    out: dict[str, dict[str, Any]] = {}
    for cls, by in (shed_by_class or {}).items():
        out.setdefault(cls, {})["refused"] = dict(by)
    for cls, (chance, n, met) in (promised or {}).items():
        if n:
            out.setdefault(cls, {}).update(
                promised_n=int(n),
                predicted_attainment=round(chance / n, 4),
                realised_attainment=round(met / n, 4),
            )
    return dict(sorted(out.items()))
