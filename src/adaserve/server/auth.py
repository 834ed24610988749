"""API keys -> tenants.

Keys are stored only as SHA-256 digests and compared with ``hmac.compare_digest``
against every configured key (no early exit); they are never logged or repr'd. With
no keys configured every request is the anonymous tenant (open local mode).
"""

from __future__ import annotations

import hmac

from adaserve.server.config import Tenant, key_digest
from adaserve.server.errors import ApiError

ANONYMOUS = "anonymous"


class TenantRegistry:
    """API key -> tenant, in constant time per configured key."""

    def __init__(self, tenants: tuple[Tenant, ...]):
        self.tenants = {t.name: t for t in tenants}
        self._keys = [(d, t) for t in tenants for d in t.key_digests]
        self.open_mode = not self._keys
        self.anonymous = Tenant(ANONYMOUS, free_targets=True)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header value; raises ``ApiError`` 401."""
        if self.open_mode:
            return self.anonymous
        if not authorization:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="missing_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, key = authorization.strip().partition(" ")
        digest = key_digest(key.strip()) if scheme.lower() == "bearer" else b"\0" * 32
        found = None
        for d, t in self._keys:  # no early exit: the same work whichever key matches
            if hmac.compare_digest(digest, d):
                found = t
        if found is None:
            raise ApiError(
                401,
                "invalid API key",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found
