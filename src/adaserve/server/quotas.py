"""Per-tenant quotas: requests and tokens per minute (token buckets), concurrency."""

from __future__ import annotations

import math
import threading
import time

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


class QuotaBook:
    """Per-tenant request/token buckets and in-flight counts (event-loop thread only;
    ``charge_output`` may come from the engine thread and takes the lock)."""

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

    def admit(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Take one request and the prompt tokens from the tenant's quotas, or raise 429."""
        with self._lock:
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
            tpm = self._tpm.get(tenant.name)
            if tpm is not None and (w := tpm.wait_for(prompt_tokens)) > 0:
                if math.isinf(w):
                    raise _quota_error(
                        "tokens_per_minute",
                        f"the prompt ({prompt_tokens} tokens) exceeds the quota of "
                        f"{tenant.tokens_per_minute:g} tokens per minute",
                        60,
                    )
                raise _quota_error(
                    "tokens_per_minute", f"{tenant.tokens_per_minute:g} tokens per minute", w
                )
            if rpm is not None:
                rpm.take(1)
            if tpm is not None:
                tpm.take(prompt_tokens)
            self.inflight[tenant.name] = self.inflight.get(tenant.name, 0) + 1

    def release(self, tenant: Tenant) -> None:
        with self._lock:
            self.inflight[tenant.name] = max(0, self.inflight.get(tenant.name, 0) - 1)

    def charge_output(self, tenant_name: str, tokens: int) -> None:
        """Output tokens count against the token quota when they are produced (may go
        into debt, which later requests wait out)."""
        with self._lock:
            tpm = self._tpm.get(tenant_name)
            if tpm is not None:
                tpm.take(tokens)


def _quota_error(reason: str, what: str, wait_s: float) -> ApiError:
    return ApiError(
        429,
        f"quota exceeded ({what}); retry later",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers=retry_after(wait_s),
        reason=reason,
    )
