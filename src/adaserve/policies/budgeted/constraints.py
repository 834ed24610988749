"""Power as a constraint on the budgeted plans (``hardware/power.py``): the limits a plan
observes and the fallback it notes when even depth 0 breaks them."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from adaserve.core.policy import BatchView
from adaserve.policies.budgeted.config import AdaptiveConfig

if TYPE_CHECKING:
    from adaserve.hardware.power import PowerModel


class PowerLimits:
    """The power cap and energy budget of one policy's plans (``AdaptiveConfig``'s
    ``power_cap_w`` / ``energy_per_token_j``); warns once when they are set but a view
    carries no power model."""

    __slots__ = ("cfg", "name", "warned")

    def __init__(self, cfg: AdaptiveConfig, name: str) -> None:
        self.cfg, self.name, self.warned = cfg, name, False

    def of(self, view: BatchView) -> tuple[PowerModel | None, float, float]:
        """(the view's PowerModel or None, power cap W, energy per token J): the
        constraints off (0) without a power model, with a warning once."""
        c = self.cfg
        pm = view.power
        if pm is None:
            if (c.power_cap_w or c.energy_per_token_j) and not self.warned:
                self.warned = True
                warnings.warn(
                    f"{self.name}: power_cap_w / energy_per_token_j set but the view carries "
                    "no PowerModel (no FLOPs/bytes/energy figures for this deployment): "
                    "the power constraints are off",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return None, 0.0, 0.0
        return pm, float(c.power_cap_w), float(c.energy_per_token_j)


def power_fallback(
    cfg: AdaptiveConfig, energy: float | None, t_ms: float, n: int, depth: int
) -> str | None:
    """ "power_cap" / "energy_budget" when the chosen shape is depth 0 and breaks
    that constraint anyway (nothing cheaper to plan: the prefill is not trimmed, so
    TTFT is not traded for watts), else None."""
    c = cfg
    if energy is None or depth > 0:
        return None
    if c.power_cap_w > 0 and energy * 1000.0 > c.power_cap_w * t_ms * (1 + 1e-9):
        return "power_cap"
    if c.energy_per_token_j > 0 and energy > c.energy_per_token_j * n * (1 + 1e-9):
        return "energy_budget"
    return None
