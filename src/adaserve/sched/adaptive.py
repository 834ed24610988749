"""The budgeted policies' former home: they live in ``sched/budgeted/`` now, one small
module per part; this module re-exports the names callers import from here."""

from adaserve.sched.budgeted import (
    ADAPTIVE_POLICIES,
    DEPTHS,
    AdaptiveConfig,
    AdaServePolicy,
    BudgetedPolicy,
    BudgetedState,
    DepthEvaluation,
    DynTreePolicy,
    ShapeChoice,
    SmartSpecPolicy,
    make_adaptive,
)
from adaserve.sched.budgeted.columns import Columns as _Arrays
from adaserve.sched.budgeted.config import EXTRAS as _EXTRAS

__all__ = [
    "ADAPTIVE_POLICIES",
    "DEPTHS",
    "AdaServePolicy",
    "AdaptiveConfig",
    "BudgetedPolicy",
    "BudgetedState",
    "DepthEvaluation",
    "DynTreePolicy",
    "ShapeChoice",
    "SmartSpecPolicy",
    "_EXTRAS",
    "_Arrays",
    "make_adaptive",
]
