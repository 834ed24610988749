"""API keys -> tenants, and the throttle on failed authentication.

Keys are stored only as SHA-256 digests and compared with ``hmac.compare_digest``
against every configured key (no early exit); they are never logged or repr'd. With
no keys configured every request is the anonymous tenant (open local mode).

The key is what follows ``Bearer `` exactly: only ASCII spaces and tabs around it are
dropped (HTTP's optional whitespace), never other whitespace (a trailing non-breaking
space is part of what was sent, so no key matches), and a key with a character outside
printable ASCII is refused as invalid without being compared.

Guessing is throttled per client address (``AuthThrottle``): after
``auth_max_failures`` wrong keys within ``auth_failure_window_s`` the address is
locked for a while (1 s, doubling with each lock in a row, at most
``MAX_LOCK_S``), and during a lock every wrong key is answered 429
``too_many_failed_auth`` with ``Retry-After``, without saying whether it was right.
Valid keys are not slowed: a key that has authenticated from the address before its
lock keeps being served during the lock (another key then gets the same 429 as a wrong
one, so a lock gives no way to tell a right guess from a wrong one). A success does not
clear the failures (a tenant's own key would otherwise reset the count between
guesses at another one). A request without a key guesses nothing: it is not counted
and still gets 401 ``missing_api_key``.
"""

from __future__ import annotations

import hmac
import ipaddress
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from adaserve.server.config import Tenant, key_digest
from adaserve.server.errors import ApiError, retry_after

if TYPE_CHECKING:
    from adaserve.server.config import ServerConfig

ANONYMOUS = "anonymous"

# outside /v1/, the paths that need a key as /v1/* does (model access); /health,
# /ping, /version and /metrics (which filters by key itself) do not
AUTH_PATHS = frozenset({"/tokenize", "/detokenize", "/reset_prefix_cache"})

# the throttle's bounds: the longest lock, how many client addresses it remembers (the
# least recently seen go first) and how many good keys per address
FIRST_LOCK_S = 1.0
MAX_LOCK_S = 300.0
MAX_CLIENTS = 10_000
GOOD_KEYS_PER_CLIENT = 8

_OWS = " \t"  # HTTP's optional whitespace: the only characters stripped around a key
_NO_DIGEST = b"\0" * 32


def _key_of(authorization: str) -> str | None:
    """The key of an ``Authorization`` value, or None when it is not ``Bearer <key>``
    with a key of printable ASCII (no control characters, nothing past 0x7E)."""
    scheme, _, key = authorization.strip(_OWS).partition(" ")
    key = key.strip(_OWS)
    if scheme.lower() != "bearer" or not key:
        return None
    if not (key.isascii() and key.isprintable()) or " " in key:
        return None
    return key


def client_of(scope) -> str | None:
    """The address a request is throttled by: the client's IP (an IPv6 one by its /64,
    which one host usually holds whole); None when unknown."""
    client = scope.get("client") if isinstance(scope, dict) else None
    host = client[0] if client else None
    if not host:
        return None
    if ":" in host:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:
                return str(ip.ipv4_mapped)
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return host


class _Client:
    __slots__ = ("failures", "since", "last", "locked_until", "strikes", "good")

    def __init__(self) -> None:
        self.failures = 0  # wrong keys in the window starting at ``since``
        self.since = 0.0
        self.last = -float("inf")  # the last wrong key
        self.locked_until = 0.0
        self.strikes = 0  # locks in a row
        self.good: list[bytes] = []  # digests that authenticated from here


class AuthThrottle:
    """Failed authentications per client address (see the module docstring); bounded
    to ``max_clients`` addresses (least recently seen dropped first); thread-safe."""

    def __init__(
        self,
        max_failures: int = 5,
        window_s: float = 60.0,
        *,
        max_lock_s: float = MAX_LOCK_S,
        max_clients: int = MAX_CLIENTS,
        clock=time.monotonic,
    ):
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_lock_s = max_lock_s
        self.max_clients = max_clients
        self.clock = clock
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, _Client] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def _get(self, addr: str) -> _Client | None:
        c = self._clients.get(addr)
        if c is not None:
            self._clients.move_to_end(addr)
        return c

    def _get_or_create(self, addr: str) -> _Client:
        c = self._get(addr)
        if c is None:
            c = self._clients[addr] = _Client()
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        return c

    def refused(self, addr: str, digest: bytes, valid: bool) -> float:
        """Seconds left of ``addr``'s lock when this key must be refused by it (0: let
        it through): never for a valid key that authenticated from here before."""
        with self._lock:
            c = self._get(addr)
            if c is None:
                return 0.0
            left = c.locked_until - self.clock()
            if left <= 0 or (valid and digest in c.good):
                return 0.0
            return left

    def failed(self, addr: str) -> None:
        """Count a wrong key from ``addr``; the ``max_failures``-th in the window locks
        the address."""
        now = self.clock()
        with self._lock:
            c = self._get_or_create(addr)
            if now - c.last > self.max_lock_s:  # quiet for long: locks start over
                c.strikes = 0
            c.last = now
            if c.failures == 0 or now - c.since > self.window_s:
                c.failures, c.since = 0, now
            c.failures += 1
            if c.failures >= self.max_failures:
                c.locked_until = now + min(self.max_lock_s, FIRST_LOCK_S * 2**c.strikes)
                c.strikes += 1
                c.failures = 0

    def succeeded(self, addr: str, digest: bytes) -> None:
        """Remember that ``digest`` authenticated from ``addr`` (served during a lock)."""
        with self._lock:
            c = self._get_or_create(addr)
            if digest in c.good:
                return
            c.good.append(digest)
            if len(c.good) > GOOD_KEYS_PER_CLIENT:
                del c.good[0]


def too_many_failures(wait_s: float) -> ApiError:
    return ApiError(
        429,
        "too many failed authentication attempts from this address; retry later",
        type="rate_limit_error",
        code="too_many_failed_auth",
        headers=retry_after(wait_s),
        reason="failed_auth",
    )


class TenantRegistry:
    """API key -> tenant, in constant time per configured key; failed attempts
    throttled per client address (``AuthThrottle``)."""

    def __init__(self, tenants: tuple[Tenant, ...], throttle: AuthThrottle | None = None):
        self.tenants = {t.name: t for t in tenants}
        self._keys = [(d, t) for t in tenants for d in t.key_digests]
        self.open_mode = not self._keys
        self.anonymous = Tenant(ANONYMOUS, free_targets=True)
        self.throttle = throttle if throttle is not None else AuthThrottle()

    @classmethod
    def for_config(cls, cfg: ServerConfig) -> TenantRegistry:
        """The registry of a server's configuration (its tenants, its throttle)."""
        throttle = AuthThrottle(cfg.auth_max_failures, cfg.auth_failure_window_s)
        return cls(cfg.tenants, throttle)

    def authenticate(self, authorization: str | None, client: str | None = None) -> Tenant:
        """The tenant of an ``Authorization`` header value; raises ``ApiError`` 401 (or
        429 while ``client``, from ``client_of``, is locked for wrong keys)."""
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
        key = _key_of(authorization)
        digest = key_digest(key) if key is not None else _NO_DIGEST
        found = None
        for d, t in self._keys:  # no early exit: the same work whichever key matches
            if hmac.compare_digest(digest, d):
                found = t
        if key is None:
            found = None
        if client is not None:
            wait = self.throttle.refused(client, digest, found is not None)
            if wait > 0:
                raise too_many_failures(wait)
        if found is None:
            if client is not None:
                self.throttle.failed(client)
            raise ApiError(
                401,
                "invalid API key",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if client is not None:
            self.throttle.succeeded(client, digest)
        return found
