"""The durable usage ledger: one row per finished request, refusals, budgets that
outlive a restart, and the queries that read them back (docs/usage-ledger.md).

Torch-free: ``adaserve usage`` and the tests import it without the engine."""

from adaserve.ledger.budgets import Budget, BudgetBook, OverBudget
from adaserve.ledger.config import UsageConfig, UsageConfigError
from adaserve.ledger.ledger import Ledger, open_store
from adaserve.ledger.rows import Refusal, UsageRow

__all__ = [
    "Budget",
    "BudgetBook",
    "Ledger",
    "OverBudget",
    "Refusal",
    "UsageConfig",
    "UsageConfigError",
    "UsageRow",
    "open_store",
]
