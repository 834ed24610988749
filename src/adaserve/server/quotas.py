"""Per-tenant quotas: requests and tokens per minute (token buckets), concurrency, and
the hold at the door for tenants that ignore their Retry-After."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

from adaserve.errors import told_wait_s
from adaserve.server.config import Tenant
from adaserve.server.errors import ApiError, retry_after


class TokenBucket:
    """Capacity ``limit`` refilled at ``limit`` per minute; may go into debt."""

    def __init__(self, per_minute: float, clock=time.monotonic):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.clock = clock
        self.t = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now

    def wait_for(self, n: float) -> float:
        """Seconds until ``n`` units are available (0 = now)."""
        self._refill()
        if n > self.capacity:
            return math.inf
        return max(0.0, (n - self.level) / self.rate)

    def take(self, n: float) -> None:
        self._refill()
        self.level -= n

    def give(self, n: float) -> None:
        """Return ``n`` units taken earlier (at most up to the capacity)."""
        self._refill()
        self.level = min(self.capacity, self.level + n)

    def available(self) -> float:
        """Units available now."""
        self._refill()
        return self.level


class QuotaBook:
    """Per-tenant spec_decode/request/token buckets and in-flight counts (thread-safe: ``settle``
    and ``refund`` come from the engine thread).

    A request takes its request-per-minute token and its concurrency slot (``enter``)
    when its headers arrive, before its body is read, parsed or tokenised, and holds the
    slot until its response ends (``release``): a request that fails later (a 400 for
    a prompt too long, a bad field) has cost its quota all the same.

    The tokens-per-minute bucket bounds output as well as prompts: admission reserves
    the prompt plus every choice's ``max_tokens`` up front (a request that does not fit
    is refused, so no request can produce more than the tenant had left), and each
    choice returns its unused part when it ends (``settle``). A request larger than the
    whole tokens-per-minute quota can never fit: 400 ``exceeds_quota``, not a 429."""

    def __init__(self, tenants: tuple[Tenant, ...], clock=time.monotonic):
        self._lock = threading.Lock()
        self._rpm: dict[str, TokenBucket] = {}
        self._tpm: dict[str, TokenBucket] = {}
        self.inflight: dict[str, int] = {}
        for t in tenants:
            if t.requests_per_minute:
                self._rpm[t.name] = TokenBucket(t.requests_per_minute, clock)
            if t.tokens_per_minute:
                self._tpm[t.name] = TokenBucket(t.tokens_per_minute, clock)

    def enter(self, tenant: Tenant) -> None:
        """Take one request from the tenant's request-count quotas (its requests per
        minute and a concurrency slot, given back by ``release``), or raise 429."""
        with self._lock:
            self._check_counts(tenant)
            rpm = self._rpm.get(tenant.name)
            if rpm is not None:
                rpm.take(1)
            self.inflight[tenant.name] = self.inflight.get(tenant.name, 0) + 1

    async def begin(self, tenant: Tenant) -> None:
        """``enter`` as the request path awaits it (a book shared across replicas
        answers from elsewhere: ``adaserve.cluster.shared_quotas``)."""
        self.enter(tenant)

    def _check_counts(self, tenant: Tenant) -> None:
        busy = self.inflight.get(tenant.name, 0)
        if tenant.max_concurrent is not None and busy >= tenant.max_concurrent:
            raise _quota_error(
                "max_concurrent", f"at most {tenant.max_concurrent} concurrent requests", 1
            )
        rpm = self._rpm.get(tenant.name)
        if rpm is not None and (w := rpm.wait_for(1)) > 0:
            raise _quota_error(
                "requests_per_minute", f"{tenant.requests_per_minute:g} requests per minute", w
            )

    def admit(
        self,
        tenant: Tenant,
        prompt_tokens: int,
        outputs: Sequence[int] = (),
        *,
        fit: bool = False,
    ) -> list[int]:
        """Take the prompt tokens and the output reservation (``outputs``: each choice's
        ``max_tokens``) of a request that has ``enter``-ed from the tenant's
        tokens-per-minute quota, or raise 429 (400 when it exceeds the whole quota).
        Returns the reserved ``max_tokens`` per choice: ``outputs`` itself, or with
        ``fit`` (the client set no ``max_tokens``) each shrunk to an equal share of what
        is left."""
        outputs = list(outputs)
        with self._lock:
            tpm = self._tpm.get(tenant.name)
            if tpm is not None:
                if fit and outputs:
                    share = int((tpm.available() - prompt_tokens) // len(outputs))
                    outputs = [min(o, max(share, 1)) for o in outputs]
                need = prompt_tokens + sum(outputs)
                if (w := tpm.wait_for(need)) > 0:
                    raise _tokens_error(tenant, prompt_tokens, outputs, w)
                tpm.take(need)
        return outputs

    async def reserve(
        self,
        tenant: Tenant,
        prompt_tokens: int,
        outputs: Sequence[int] = (),
        *,
        fit: bool = False,
    ) -> list[int]:
        """``admit`` as the request path awaits it (a book shared across replicas
        answers from elsewhere: ``adaserve.cluster.shared_quotas``)."""
        return self.admit(tenant, prompt_tokens, outputs, fit=fit)

    def release(self, tenant: Tenant) -> None:
        """Give back the concurrency slot ``enter`` took (the response has ended)."""
        with self._lock:
            self.inflight[tenant.name] = max(0, self.inflight.get(tenant.name, 0) - 1)

    def settle(self, tenant_name: str, reserved: int, produced: int) -> None:
        """A choice has ended: give back the part of its reservation it did not use
        (take the excess should it ever have produced more)."""
        with self._lock:
            tpm = self._tpm.get(tenant_name)
            if tpm is None or produced == reserved:
                return
            if produced < reserved:
                tpm.give(reserved - produced)
            else:
                tpm.take(produced - reserved)

    def refund(self, tenant_name: str, tokens: int) -> None:
        """Give back a reservation that never reached the engine."""
        self.settle(tenant_name, tokens, 0)

    def requests_wait(self, tenant_name: str) -> float:
        """Seconds until the tenant's requests-per-minute bucket has a request (0: now,
        or no such quota)."""
        with self._lock:
            rpm = self._rpm.get(tenant_name)
            return 0.0 if rpm is None else rpm.wait_for(1)

    def tokens_available(self, tenant_name: str) -> float | None:
        """The tenant's tokens-per-minute bucket level now (None: no such quota)."""
        with self._lock:
            tpm = self._tpm.get(tenant_name)
            return None if tpm is None else tpm.available()


class RetryHold:
    """Who was told to wait: a tenant refused by a request-count quota was told to come
    back after ``Retry-After``. One that sends again before then ignored it: its next
    refusal is held at the door (``hold_s``: what is left of the wait, at most
    ``max_hold_s``) before it is tried again and answered, so a client that loops on
    429s gets about one answer per connection per wait, and the server spends on it
    no more than that. A held request has not had its body read (flow control stops
    the upload), so holding costs a suspended coroutine. At most ``max_held`` of a
    tenant's requests wait at once; the rest are answered at once, as before.
    Event-loop only (not thread-safe)."""

    def __init__(self, max_hold_s: float = 1.0, max_held: int = 256, clock=time.monotonic):
        self.max_hold_s = float(max_hold_s)
        self.max_held = max_held
        self.clock = clock
        self._until: dict[str, float] = {}  # tenant -> end of the wait it was told
        self.held: dict[str, int] = {}  # tenant -> its requests held now
        self.total_held = 0  # requests held so far

    def hold_s(self, tenant_name: str) -> float:
        """How long to hold a refused request of the tenant (0: answer at once)."""
        if self.max_hold_s <= 0 or self.held.get(tenant_name, 0) >= self.max_held:
            return 0.0
        left = self._until.get(tenant_name, 0.0) - self.clock()
        return min(left, self.max_hold_s) if left > 0 else 0.0

    def told(self, tenant_name: str, wait_s: float) -> None:
        """The tenant was answered 429 with ``Retry-After: wait_s``."""
        self._until[tenant_name] = max(self._until.get(tenant_name, 0.0), self.clock() + wait_s)
        if len(self._until) > 4 * self.max_held:  # forget waits long over
            now = self.clock()
            self._until = {k: v for k, v in self._until.items() if v > now}

    def enter(self, tenant_name: str) -> None:
        self.held[tenant_name] = self.held.get(tenant_name, 0) + 1
        self.total_held += 1

    def leave(self, tenant_name: str) -> None:
        n = self.held.get(tenant_name, 0) - 1
        if n > 0:
            self.held[tenant_name] = n
        else:
            self.held.pop(tenant_name, None)


def retry_after_s(e: ApiError) -> float:
    """The wait an answer told, in seconds (``told_wait_s``; 0 without one)."""
    return told_wait_s(e.headers or {}) or 0.0


def _tokens_error(tenant: Tenant, prompt_tokens: int, outputs: list[int], wait_s: float):
    """429 (with ``Retry-After``) for a request that fits the quota once it has
    refilled; 400 ``exceeds_quota`` (no ``Retry-After``: waiting cannot help) for one
    larger than the whole per-minute quota."""
    quota = f"{tenant.tokens_per_minute:g} tokens per minute"
    if not math.isinf(wait_s):
        return _quota_error("tokens_per_minute", quota, wait_s)
    if outputs:
        what = (
            f"the request ({prompt_tokens} prompt tokens + {sum(outputs)} for "
            f"{len(outputs)} choice(s) x max_tokens) exceeds the whole quota of {quota}"
        )
    else:
        what = f"the prompt ({prompt_tokens} tokens) exceeds the whole quota of {quota}"
    return ApiError(
        400,
        f"{what}: it can never be admitted; send a smaller request",
        code="exceeds_quota",
        reason="tokens_per_minute",
    )


def _quota_error(reason: str, what: str, wait_s: float) -> ApiError:
    return ApiError(
        429,
        f"quota exceeded ({what}); retry later",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers=retry_after(wait_s),
        reason=reason,
    )
