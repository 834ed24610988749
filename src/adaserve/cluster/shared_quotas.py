"""A replica's view of the service's quotas: the ``QuotaBook`` interface the request
path uses, answered by the shared ``Ledger`` actor.

``begin`` (at a request's headers: its request and concurrency slot) and ``reserve``
(once its prompt is tokenised: the prompt and the output reservation) ask the ledger
and carry along every settlement queued since the last call;
``release``, ``settle`` and ``refund`` (when requests end, some on the engine thread)
only queue, and the replica's sync thread flushes the queue a few times a second
(``take_pending``). So a tenant's quotas hold across replicas, and tokens are never
charged one by one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from adaserve.cluster.ledger import error_of
from adaserve.server.config import Tenant


class SharedQuotaBook:
    """``QuotaBook``'s interface over a ``Ledger`` actor handle."""

    def __init__(self, ledger, replica_id: str):
        self.ledger = ledger
        self.replica_id = replica_id
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        # tenant -> (monotonic time its requests-per-minute refusal lasts until, error)
        self._blocked: dict[str, tuple[float, tuple]] = {}

    async def begin(self, tenant: Tenant) -> None:
        """The request-count quotas before any work on the request: refused here while
        the service's last requests-per-minute refusal of the tenant lasts (its bucket
        only refills with time), else asked of the ledger."""
        b = self._blocked.get(tenant.name)
        if b is not None:
            if time.monotonic() < b[0]:
                raise error_of(b[1])
            self._blocked.pop(tenant.name, None)
        res = await self.ledger.enter.remote(self.replica_id, tenant.name, self.take_pending())
        if res[0] == "error":
            err = error_of(res[1])
            if err.reason == "requests_per_minute" and res[2] > 0:
                self._blocked[tenant.name] = (time.monotonic() + res[2], res[1])
            raise err

    async def reserve(
        self,
        tenant: Tenant,
        prompt_tokens: int,
        outputs: Sequence[int] = (),
        *,
        fit: bool = False,
    ) -> list[int]:
        res = await self.ledger.admit.remote(
            self.replica_id, tenant.name, prompt_tokens, list(outputs), fit, self.take_pending()
        )
        if res[0] == "error":
            raise error_of(res[1])
        return list(res[1])

    def admit(self, *args, **kwargs):
        raise RuntimeError("a replica's quotas are shared: use `await reserve(...)`")

    def enter(self, *args, **kwargs):
        raise RuntimeError("a replica's quotas are shared: use `await begin(...)`")

    def _queue(self, item: tuple) -> None:
        with self._lock:
            self._pending.append(item)

    def release(self, tenant: Tenant) -> None:
        self._queue(("release", tenant.name))

    def settle(self, tenant_name: str, reserved: int, produced: int) -> None:
        # queued even when nothing is given back: the ledger counts what is still
        # reserved on this replica (given back should the replica die)
        if reserved:
            self._queue(("settle", tenant_name, reserved, produced))

    def refund(self, tenant_name: str, tokens: int) -> None:
        self.settle(tenant_name, tokens, 0)

    def take_pending(self) -> list[tuple]:
        """The queued settlements, emptied (the caller sends them to the ledger)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def tokens_available(self, tenant_name: str) -> float | None:
        return None
