"""The opt-in selection log (``EngineConfig.selection_log``): one JSON line per
speculating request per step, with no prompt or output text and the request id only
as a salted hash."""

from __future__ import annotations

import hashlib
import json
import os
import time

from adaserve.core.policy import BatchView, Plan, Policy
from adaserve.core.tree import CandidateTree


class SelectionLog:
    """Appends decisions to ``path``."""

    def __init__(self, path: str):
        self._f = open(path, "a")  # noqa: SIM115  (held open for the engine's life)
        self._salt = os.urandom(8).hex()

    def write(
        self,
        policy: Policy,
        view: BatchView,
        plan: Plan,
        trees: dict[int, CandidateTree],
        accepted: dict[int, int],
    ) -> None:
        """One line per request that verified candidates (or every one on a fallback)."""
        by_id = {r.rid: r for r in view.requests}
        now = time.time()
        for rid, t in trees.items():
            rv = by_id.get(rid)
            if rv is None or (len(t.tokens) == 1 and not plan.fallback):
                continue
            line = {
                "ts": round(now, 4),
                "request": hashlib.sha1(f"{self._salt}:{rid}".encode()).hexdigest()[:12],
                "class": rv.cls,
                "policy": policy.name,
                "requirement": policy.explain(rv, plan).get("requirement"),
                "nodes": len(t.tokens) - 1,
                "expected_accepted": round(float(t.f[1:].sum()), 3),
                "accepted": accepted.get(rid, 0),
                "budget": plan.bounded_budget,
                "fallback": plan.fallback,
            }
            self._f.write(json.dumps(line) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
