"""Server configuration (TOML), API keys and tenants, quotas, SLO resolution and usage.

Who may ask for what: an API key (``Authorization: Bearer ...``) names a tenant; the
tenant lists the SLO classes it may use, its default class, its quotas (requests and
tokens per minute, concurrent requests) and what happens when it asks for a class it
may not use (403, or a downgrade along the classes' ``degrade_to`` chain). Every class
has a price per 1k output tokens (``SLOClass.price_per_1k``); ``UsageBook`` accounts
usage and charges per tenant and class.

Keys are stored only as SHA-256 digests and compared with ``hmac.compare_digest``
against every configured key (no early exit); they are never logged or repr'd.
With no keys configured the server runs in open local mode (one anonymous tenant, every
class, no quotas).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaserve.errors import AdaServeError, InvalidRequestError
from adaserve.slo import SLO, SLOClass

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ANONYMOUS = "anonymous"
SERVICE_TIERS = ("auto", "default", "flex", "priority")
SLO_HEADERS = {"ttft_ms": "x-slo-ttft-ms", "tpot_ms": "x-slo-tpot-ms"}


class ConfigError(AdaServeError):
    """The server configuration file is invalid (message names the offending key)."""


class ApiError(AdaServeError):
    """An error answered to the client as an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.reason = reason

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.reason is not None:
            err["reason"] = self.reason
        return {"error": err}


def retry_after(seconds: float) -> dict[str, str]:
    """A ``Retry-After`` header (whole seconds, at least 1)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


# ---------------------------------------------------------------------- config


@dataclass(frozen=True)
class Tenant:
    """One customer: its key digests, allowed classes and quotas (None = unlimited)."""

    name: str
    key_digests: tuple[bytes, ...] = field(default=(), repr=False)
    classes: tuple[str, ...] | None = None  # None = every class
    default_class: str | None = None
    on_forbidden_class: str = "reject"  # or "downgrade"
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    admin: bool = False
    free_targets: bool = False  # explicit targets may be stricter than the class's

    def may_use(self, cls: str) -> bool:
        return self.classes is None or cls in self.classes


@dataclass(frozen=True)
class ServerConfig:
    """Everything the HTTP layer needs (the engine has its own ``EngineConfig``).

    model_name:          id served in /v1/models and responses (None = derived from the model)
    strict_fields:       reject unknown top-level request fields (400)
    max_body_bytes:      larger request bodies get 413
    max_waiting:         requests queued in the engine beyond this are shed (429)
    shutdown_grace_s:    on SIGINT/SIGTERM, in-flight requests get this long to finish
    default_max_tokens:  chat default when max_tokens is omitted (None = rest of context)
    max_choices:         prompts x n per HTTP request
    step_delay_s:        sleep after every engine step (testing and demos only)
    default_class:       class of requests that name none (None = the engine's default)
    """

    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    strict_fields: bool = True
    max_body_bytes: int = 8 << 20
    max_waiting: int | None = None
    shutdown_grace_s: float = 30.0
    default_max_tokens: int | None = None
    max_choices: int = 64
    step_delay_s: float = 0.0
    default_class: str | None = None
    service_tiers: Mapping[str, str] = field(default_factory=dict)
    tenants: tuple[Tenant, ...] = ()
    classes: tuple[SLOClass, ...] | None = None  # None = the engine's classes
    engine: Mapping[str, Any] = field(default_factory=dict)  # EngineConfig overrides

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ConfigError("server.max_body_bytes must be positive")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ConfigError("server.max_waiting must be >= 0")
        if self.shutdown_grace_s < 0:
            raise ConfigError("server.shutdown_grace_s must be >= 0")
        if self.max_choices < 1:
            raise ConfigError("server.max_choices must be >= 1")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ConfigError("server.default_max_tokens must be >= 1")
        if self.step_delay_s < 0:
            raise ConfigError("server.step_delay_s must be >= 0")
        for tier in self.service_tiers:
            if tier not in SERVICE_TIERS:
                raise ConfigError(f"service_tiers: unknown tier {tier!r}")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError("tenant names must be unique")
        digests = [d for t in self.tenants for d in t.key_digests]
        if len(set(digests)) != len(digests):
            raise ConfigError("an API key is configured twice")

    @property
    def open_mode(self) -> bool:
        """No API keys configured: every request is the anonymous tenant."""
        return not any(t.key_digests for t in self.tenants)


_SERVER_KEYS = {f.name for f in dataclasses.fields(ServerConfig)} - {
    "service_tiers",
    "tenants",
    "classes",
    "engine",
}
_CLASS_KEYS = {f.name for f in dataclasses.fields(SLOClass)} - {"name"}
_TENANT_KEYS = {
    "keys",
    "key_sha256",
    "keys_env",
    "classes",
    "default_class",
    "on_forbidden_class",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "admin",
    "free_targets",
}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _check_keys(where: str, table: Mapping, allowed: set[str]) -> None:
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")


def _str_list(where: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ConfigError(f"{where} must be a list of non-empty strings")
    return v


def _parse_tenant(name: str, t: Mapping) -> Tenant:
    where = f"tenants.{name}"
    _check_keys(where, t, _TENANT_KEYS)
    digests = [_digest(k) for k in _str_list(f"{where}.keys", t.get("keys", []))]
    for h in _str_list(f"{where}.key_sha256", t.get("key_sha256", [])):
        try:
            b = bytes.fromhex(h)
        except ValueError:
            b = b""
        if len(b) != 32:
            raise ConfigError(f"{where}.key_sha256: {h[:8]}... is not a SHA-256 hex digest")
        digests.append(b)
    env = t.get("keys_env")
    if env is not None:
        if not isinstance(env, str):
            raise ConfigError(f"{where}.keys_env must name an environment variable")
        val = os.environ.get(env)
        if not val:
            raise ConfigError(f"{where}.keys_env: environment variable {env} is not set")
        digests.extend(_digest(k.strip()) for k in val.split(",") if k.strip())
    classes = t.get("classes")
    if classes is not None:
        classes = tuple(_str_list(f"{where}.classes", classes))
    forbid = t.get("on_forbidden_class", "reject")
    if forbid not in ("reject", "downgrade"):
        raise ConfigError(f"{where}.on_forbidden_class must be 'reject' or 'downgrade'")
    limits = {}
    for k in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
        v = t.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"{where}.{k} must be a positive number")
        limits[k] = v
    if limits["max_concurrent"] is not None:
        limits["max_concurrent"] = int(limits["max_concurrent"])
    default = t.get("default_class")
    if default is not None and not isinstance(default, str):
        raise ConfigError(f"{where}.default_class must be a string")
    flags = {}
    for k in ("admin", "free_targets"):
        flags[k] = t.get(k, False)
        if not isinstance(flags[k], bool):
            raise ConfigError(f"{where}.{k} must be true or false")
    return Tenant(
        name=name,
        key_digests=tuple(digests),
        classes=classes,
        default_class=default,
        on_forbidden_class=forbid,
        **flags,
        **limits,
    )


def parse_config(data: Mapping) -> ServerConfig:
    """A ``ServerConfig`` from a parsed TOML document (see docs/server.md)."""
    _check_keys("config", data, {"server", "engine", "classes", "tenants", "service_tiers"})
    server = dict(data.get("server", {}))
    _check_keys("server", server, _SERVER_KEYS)
    tiers = data.get("service_tiers", {})
    _check_keys("service_tiers", tiers, set(SERVICE_TIERS))
    classes = None
    if "classes" in data:
        _check_keys("classes", data["classes"], set(data["classes"]))
        classes = []
        for name, c in data["classes"].items():
            _check_keys(f"classes.{name}", c, _CLASS_KEYS)
            try:
                classes.append(SLOClass(name=name, **c))
            except (InvalidRequestError, TypeError) as e:
                raise ConfigError(f"classes.{name}: {e}") from None
        classes = tuple(classes)
        if not classes:
            raise ConfigError("classes: at least one class is needed")
    tenants = tuple(_parse_tenant(n, t) for n, t in data.get("tenants", {}).items())
    engine = data.get("engine", {})
    _check_keys("engine", engine, set(engine))
    try:
        return ServerConfig(
            service_tiers=dict(tiers),
            tenants=tenants,
            classes=classes,
            engine=dict(engine),
            **server,
        )
    except TypeError as e:
        raise ConfigError(f"server: {e}") from None


def load_config(path: str | Path) -> ServerConfig:
    """Read and validate a TOML server configuration file."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: {e}") from None
    return parse_config(data)


def check_against_classes(cfg: ServerConfig, classes: tuple[SLOClass, ...]) -> None:
    """Every class name the config mentions must exist among the engine's classes."""
    names = {c.name for c in classes}

    def need(where: str, name: str | None) -> None:
        if name is not None and name not in names:
            raise ConfigError(f"{where}: unknown SLO class {name!r} (known: {sorted(names)})")

    need("server.default_class", cfg.default_class)
    for tier, cls in cfg.service_tiers.items():
        need(f"service_tiers.{tier}", cls)
    for t in cfg.tenants:
        need(f"tenants.{t.name}.default_class", t.default_class)
        for c in t.classes or ():
            need(f"tenants.{t.name}.classes", c)
        if t.default_class and not t.may_use(t.default_class):
            raise ConfigError(f"tenants.{t.name}: default_class is not among its classes")
    for c in classes:
        need(f"classes.{c.name}.degrade_to", c.degrade_to)


# ---------------------------------------------------------------------- auth


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
        digest = _digest(key.strip()) if scheme.lower() == "bearer" else b"\0" * 32
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


# ---------------------------------------------------------------------- quotas


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


# ---------------------------------------------------------------------- SLO resolution


@dataclass(frozen=True)
class SLOChoice:
    """The outcome of SLO resolution for one request."""

    slo: SLO
    cls: SLOClass
    degraded_from: str | None = None
    source: str = "default"  # which input decided the class


def _parse_header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        v = float(raw.strip())
    except ValueError:
        v = math.nan
    if not (0 < v <= 1e9):  # also rejects nan and inf
        raise ApiError(400, f"header {name} must be a positive number of milliseconds", param=name)
    return v


def _satisfies(target: SLO, want: Mapping[str, float]) -> bool:
    """Whether a class's targets are at least as strict as every explicit target."""
    for k in ("tpot_ms", "ttft_ms"):
        w = want.get(k)
        if w is None:
            continue
        have = getattr(target, k)
        if have is None or have > w:
            return False
    return True


def resolve_slo(
    *,
    classes: tuple[SLOClass, ...],
    class_slos: Mapping[str, SLO],
    tenant: Tenant,
    default_class: str,
    service_tiers: Mapping[str, str],
    slo: Mapping[str, float | None] | None = None,
    slo_class: str | None = None,
    priority: int | None = None,
    service_tier: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> SLOChoice:
    """Decide a request's class and targets (precedence in docs/server.md).

    Class: ``slo_class`` > ``priority`` > ``service_tier`` > (when none of these is
    given) the loosest class that meets the explicit targets, if the default does not >
    the tenant's default > the server's default. Targets: body ``slo`` > ``x-slo-*``
    headers > the class's own, capped at the class's strictness unless the tenant has
    ``free_targets`` (open mode does). A class the tenant may not use is refused (403)
    or downgraded (targets then capped at the new class).
    """
    by_name = {c.name: c for c in classes}
    explicit: dict[str, float] = {}
    for key, header in SLO_HEADERS.items():
        v = _parse_header_ms(headers or {}, header)
        if v is not None:
            explicit[key] = v
    for k, v in (slo or {}).items():
        if v is not None:
            explicit[k] = float(v)

    source = "default"
    if slo_class is not None:
        if slo_class not in by_name:
            raise ApiError(
                400,
                f"unknown slo_class {slo_class!r}; known: {', '.join(by_name)}",
                param="slo_class",
                code="invalid_slo_class",
            )
        cls, source = by_name[slo_class], "slo_class"
    elif priority is not None:
        ordered = sorted(classes, key=lambda c: (c.priority, c.rank))
        cls = next((c for c in ordered if c.priority >= priority), ordered[-1])
        source = "priority"
    elif service_tier is not None:
        name = service_tiers.get(service_tier) or _default_tier(
            service_tier, classes, tenant, default_class
        )
        cls, source = by_name[name], "service_tier"
    else:
        cls = by_name[tenant.default_class or default_class]
        if tenant.default_class:
            source = "tenant_default"

    # no class named, explicit targets stricter than the default promises: the class is
    # the loosest one that is strict enough (the strictest when none is)
    named = slo_class is not None or priority is not None or service_tier is not None
    if explicit and not named and not _satisfies(class_slos[cls.name], explicit):
        ok = [c for c in classes if _satisfies(class_slos[c.name], explicit)]
        best = (
            max(ok, key=lambda c: (c.rank, -c.price_per_1k))
            if ok
            else min(classes, key=lambda c: c.rank)
        )
        if best.rank < cls.rank:
            cls, source = best, "slo"

    degraded_from = None
    if not tenant.may_use(cls.name):
        if tenant.on_forbidden_class != "downgrade":
            raise ApiError(
                403,
                f"tenant {tenant.name!r} may not use SLO class {cls.name!r}; "
                f"allowed: {', '.join(tenant.classes or ())}",
                type="permission_error",
                param="slo_class",
                code="slo_class_not_allowed",
            )
        target = _downgrade(cls, by_name, tenant)
        if target is None:
            raise ApiError(
                403,
                f"tenant {tenant.name!r} may not use SLO class {cls.name!r} "
                "and no allowed class to downgrade to",
                type="permission_error",
                param="slo_class",
                code="slo_class_not_allowed",
            )
        degraded_from, cls = cls.name, target

    # a tenant gets at most its class's strictness, unless it may set free targets
    if degraded_from is not None or not tenant.free_targets:
        base = class_slos[cls.name]
        for k in ("tpot_ms", "ttft_ms"):
            have = getattr(base, k)
            if k in explicit and have is not None:
                explicit[k] = max(explicit[k], have)

    base = class_slos[cls.name]
    try:
        final = SLO(
            tpot_ms=explicit.get("tpot_ms", base.tpot_ms),
            ttft_ms=explicit.get("ttft_ms", base.ttft_ms),
            max_queue_ms=explicit.get("max_queue_ms", base.max_queue_ms),
            deadline_ms=explicit.get("deadline_ms", base.deadline_ms),
            cls=cls.name,
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=f"slo.{e.param}" if e.param else "slo") from None
    return SLOChoice(final, cls, degraded_from, source)


def _default_tier(
    tier: str, classes: tuple[SLOClass, ...], tenant: Tenant, default_class: str
) -> str:
    """OpenAI service tiers: priority -> strictest, flex -> loosest, else the default."""
    if tier == "priority":
        return min(classes, key=lambda c: c.rank).name
    if tier == "flex":
        return max(classes, key=lambda c: c.rank).name
    return tenant.default_class or default_class


def _downgrade(cls: SLOClass, by_name: Mapping[str, SLOClass], tenant: Tenant) -> SLOClass | None:
    seen = {cls.name}
    c = cls
    while c.degrade_to and c.degrade_to not in seen and c.degrade_to in by_name:
        c = by_name[c.degrade_to]
        seen.add(c.name)
        if tenant.may_use(c.name):
            return c
    if tenant.default_class and tenant.may_use(tenant.default_class):
        return by_name.get(tenant.default_class)
    return None


# ---------------------------------------------------------------------- usage


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    charge: float = 0.0


class UsageBook:
    """Usage and charges per (tenant, class); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._u: dict[tuple[str, str], Usage] = {}

    def record(
        self, tenant: str, cls: str, prompt_tokens: int, completion_tokens: int, price_per_1k: float
    ) -> float:
        """Account one finished request; returns its charge."""
        charge = completion_tokens * price_per_1k / 1000.0
        with self._lock:
            u = self._u.setdefault((tenant, cls), Usage())
            u.requests += 1
            u.prompt_tokens += prompt_tokens
            u.completion_tokens += completion_tokens
            u.charge += charge
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
        for t in out.values():
            t["total"] = dataclasses.asdict(t["total"])
        return out
