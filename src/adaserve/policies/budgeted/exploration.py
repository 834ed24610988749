"""Exploration: some plans draft width-2 trees so the calibrator keeps learning.

Chains alone teach the calibrator nothing about how often a second-ranked child is
accepted; once that estimate falls below ``min_sibling_acceptance`` the planner would
consider chains only for good. So every ``explore_every``-th plan that would consider
chains only drafts width-2 trees instead (``adaserve``; 0 = never).
"""

from __future__ import annotations

from adaserve.policies.budgeted.config import AdaptiveConfig


def explored_widths(widths: tuple[int, ...], plans: int, cfg: AdaptiveConfig) -> tuple[int, ...]:
    """The widths plan number ``plans`` (1-based) evaluates: width 2 (at most
    ``max_width``) in place of a chain-only plan on every ``explore_every``-th plan,
    else ``widths``. Call only where the policy explores (``explore_every`` > 0)."""
    if widths == (1,) and plans % cfg.explore_every == 0:
        return (min(2, cfg.max_width),)  # an exploration plan
    return widths
