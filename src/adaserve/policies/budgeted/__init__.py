"""The budgeted policies (``adaserve``, ``dyn-tree``, ``smartspec``) as small parts:

* ``config``: ``AdaptiveConfig``, the knobs, and the planner's depth grid
* ``columns``: the decoding requests as arrays
* ``requirements``, ``margin``: A(r) and the margin the plans aim below targets by
* ``widths``, ``exploration``: which beam widths a plan evaluates
* ``evaluation``: the typed core evaluation (``DepthEvaluation``, ``ShapeChoice``)
* ``constraints``: power cap and energy budget
* ``pass_composition``: the ``adaserve`` pass's prefill and who sits it out
* ``phases``: selection's SLO and goodput phases
* ``overload``: infeasible requests and degradation
* ``planner``: ``BudgetedPolicy``, the plan and its hooks
* ``policies``: the three policies and ``make_adaptive``
"""

from adaserve.policies.budgeted.columns import Columns
from adaserve.policies.budgeted.config import DEPTHS, EXTRAS, AdaptiveConfig
from adaserve.policies.budgeted.evaluation import DepthEvaluation, ShapeChoice
from adaserve.policies.budgeted.planner import BudgetedPolicy, BudgetedState
from adaserve.policies.budgeted.policies import (
    ADAPTIVE_POLICIES,
    AdaServePolicy,
    DynTreePolicy,
    SmartSpecPolicy,
    make_adaptive,
)

__all__ = [
    "ADAPTIVE_POLICIES",
    "DEPTHS",
    "EXTRAS",
    "AdaServePolicy",
    "AdaptiveConfig",
    "BudgetedPolicy",
    "BudgetedState",
    "Columns",
    "DepthEvaluation",
    "DynTreePolicy",
    "ShapeChoice",
    "SmartSpecPolicy",
    "make_adaptive",
]
