"""Run-wide counters (monotonic), shared by the scheduler and what executes its passes."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    stalls: dict[str, int] = field(default_factory=dict)  # cause -> passes > 3x predicted
    model_time_s: float = 0.0
    step_time_s: float = 0.0

    def count_fallback(self, reason: str) -> None:
        """One more iteration (or request-iteration) that fell back for ``reason``."""
        self.fallback_iterations[reason] = self.fallback_iterations.get(reason, 0) + 1

    def count_shed(self, reason: str) -> None:
        """One more request shed for ``reason``."""
        self.shed[reason] = self.shed.get(reason, 0) + 1

    def count_degraded_on_admission(self, reason: str) -> None:
        """One more request admitted in a looser class instead of shed for ``reason``."""
        self.degraded_on_admission[reason] = self.degraded_on_admission.get(reason, 0) + 1

    def count_stall(self, cause: str) -> None:
        """One more pass far over its prediction, for ``cause`` (``core.stalls``)."""
        self.stalls[cause] = self.stalls.get(cause, 0) + 1
