"""What the ledger stores: a finished request (``UsageRow``) and a refusal
(``Refusal``), and how they travel through the spool file (JSON lines)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

# the finish reasons of a request that ended as asked (anything else counts as aborted)
NORMAL_FINISH = ("stop", "length")


@dataclass(frozen=True)
class UsageRow:
    """One finished request (all its choices): what it cost and how it was served.

    ``id`` is the response's ``id`` (``cmpl-...``/``chatcmpl-...``): unique, so a row
    written twice (a replayed spool) is stored once. ``class_asked`` is the class the
    request asked for, ``cls`` the one it was delivered (and billed) in. ``ttft_ms``
    and ``tpot_ms`` are its first choice's; ``slo_met`` whether every choice met its
    class's targets. Times are UTC seconds since the epoch."""

    id: str
    tenant: str
    key_id: str | None
    class_asked: str
    cls: str
    prompt_tokens: int
    completion_tokens: int
    charge: float
    ttft_ms: float | None
    tpot_ms: float | None
    slo_met: bool
    finish_reason: str
    arrival: float
    finished: float
    replica: str
    choices: int = 1

    @property
    def hour(self) -> int:
        return int(self.finished // 3600)

    @property
    def degraded(self) -> bool:
        return self.cls != self.class_asked

    @property
    def aborted(self) -> bool:
        return self.finish_reason not in NORMAL_FINISH


@dataclass(frozen=True)
class Refusal:
    """A refused request: 429 (quotas, budgets, admission) or 403 (class not allowed).
    ``id`` is unique per refusal (a replayed spool stores it once)."""

    id: str
    at: float
    tenant: str
    cls: str
    reason: str
    status: int

    @property
    def hour(self) -> int:
        return int(self.at // 3600)


def to_line(item: UsageRow | Refusal) -> str:
    kind = "row" if isinstance(item, UsageRow) else "refusal"
    return json.dumps({"kind": kind, **dataclasses.asdict(item)}, separators=(",", ":"))


def from_line(line: str) -> UsageRow | Refusal:
    d = json.loads(line)
    kind = d.pop("kind")
    return UsageRow(**d) if kind == "row" else Refusal(**d)
