"""Usage and charges per tenant and SLO class (price per 1k output tokens)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    charge: float = 0.0
    degraded: int = 0  # requests delivered (and billed) here that asked for a stricter class


class UsageBook:
    """Usage and charges per (tenant, class); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._u: dict[tuple[str, str], Usage] = {}

    def record(
        self,
        tenant: str,
        cls: str,
        prompt_tokens: int,
        completion_tokens: int,
        price_per_1k: float,
        degraded: bool = False,
    ) -> float:
        """Account one finished request in the class it was delivered in (``degraded``:
        it asked for a stricter one); returns its charge."""
        charge = completion_tokens * price_per_1k / 1000.0
        with self._lock:
            u = self._u.setdefault((tenant, cls), Usage())
            u.requests += 1
            u.prompt_tokens += prompt_tokens
            u.completion_tokens += completion_tokens
            u.charge += charge
            u.degraded += int(degraded)
        return charge

    def by_tenant(self, only: str | None = None) -> dict[str, dict]:
        """{tenant: {"classes": {cls: usage}, "total": usage}} (optionally one tenant)."""
        with self._lock:
            items = [(k, dataclasses.replace(v)) for k, v in self._u.items()]
        out: dict[str, dict] = {}
        for (tenant, cls), u in sorted(items):
            if only is not None and tenant != only:
                continue
            t = out.setdefault(tenant, {"classes": {}, "total": Usage()})
            t["classes"][cls] = dataclasses.asdict(u)
            tot = t["total"]
            tot.requests += u.requests
            tot.prompt_tokens += u.prompt_tokens
            tot.completion_tokens += u.completion_tokens
            tot.charge += u.charge
            tot.degraded += u.degraded
        for t in out.values():
            t["total"] = dataclasses.asdict(t["total"])
        return out
