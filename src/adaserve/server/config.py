"""Server configuration (TOML): server settings, SLO classes, tenants and service tiers.

An API key (``Authorization: Bearer ...``) names a tenant; the tenant lists the SLO
classes it may use, its default class, its quotas (requests and tokens per minute,
concurrent requests) and what happens when it asks for a class it may not use (403, or
a downgrade along the classes' ``degrade_to`` chain). Every class has a price per 1k
output tokens (``SLOClass.price_per_1k``). Keys are kept only as SHA-256 digests
(``key_digest``); see ``adaserve.server.auth``. With no keys configured the server runs
in open local mode (one anonymous tenant, every class, no quotas).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaserve.config import EngineConfig
from adaserve.core.slo import ON_OVERLOAD, SLOClass
from adaserve.errors import AdaServeError, InvalidRequestError
from adaserve.ledger.config import UsageConfig, UsageConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

SERVICE_TIERS = ("auto", "default", "flex", "priority")


class ConfigError(AdaServeError):
    """The server configuration file is invalid (message names the offending key)."""


@dataclass(frozen=True)
class Tenant:
    """One customer: its key digests, allowed classes and quotas (None = unlimited)."""

    name: str
    key_digests: tuple[bytes, ...] = field(default=(), repr=False)
    classes: tuple[str, ...] | None = None  # None = every class
    default_class: str | None = None
    on_forbidden_class: str = "reject"  # or "downgrade"
    # its requests' default when admission cannot keep their class's promise now:
    # "refuse" (429) or "degrade" (served in the looser class, billed there)
    on_overload: str = "refuse"
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    # budgets longer than a minute, kept in the usage ledger (UTC days and months)
    tokens_per_day: float | None = None
    requests_per_day: float | None = None
    charge_per_month: float | None = None
    admin: bool = False
    free_targets: bool = False  # explicit targets may be stricter than the class's
    # tenants of one group share cached prompt prefixes (None: the tenant's own name,
    # so no other tenant's request is ever served from its KV blocks)
    prefix_cache_group: str | None = None

    def cache_salt(self, salt: str | None) -> str:
        """The salt of a request's prefix-cache blocks: its tenant's group, then the
        request's own ``cache_salt`` (vLLM's field), if any."""
        group = self.prefix_cache_group or self.name
        return group if salt is None else f"{group}\0{salt}"

    def may_use(self, cls: str) -> bool:
        return self.classes is None or cls in self.classes


@dataclass(frozen=True)
class ServerConfig:
    """Everything the HTTP layer needs (the engine has its own ``EngineConfig``).

    model_name:          id served in /v1/models and responses (None = derived from the model)
    strict_fields:       reject unknown top-level request fields (400); off (the default,
                         as vLLM): they are ignored, with one warning per field name
    chat_template:       a Jinja chat template file (or the template text) replacing the
                         model's (``--chat-template``)
    enable_auto_tool_choice: serve ``tool_choice: "auto"`` (``--enable-auto-tool-choice``);
                         the calls are read from the text by ``tool_call_parser``
    tool_call_parser:    hermes, qwen, llama3_json or mistral (``--tool-call-parser``)
    max_body_bytes:      larger request bodies get 413 at their headers (None: derived
                         from the context, ``state.body_limit``)
    admission:           admission control (``core.admission``): a request whose class's
                         TTFT or TPOT promise the server cannot keep gets 429 at once,
                         and a queued one past its TTFT deadline gets 429 then
    max_waiting:         requests queued in the engine beyond this are shed (429)
    shutdown_grace_s:    on SIGINT/SIGTERM, in-flight requests get this long to finish
    default_max_tokens:  chat default when max_tokens is omitted (None = rest of context)
    max_choices:         prompts x n per HTTP request
    step_delay_s:        sleep after every engine step (testing and demos only)
    step_pace_ms:        ``(A, B)``: every engine step lasts at least A + B x (tokens of
                         its verification pass) ms, the rest slept after it (testing and
                         demos only). Passes then take a modelled time, the same on any
                         machine while the real pass is shorter (``EngineLoop``)
    confine_threads:     once the engine's thread is pinned to its cores, the rest of
                         the process (HTTP loop, tokenisers, the threads they start) is
                         confined to the reserve (``util.threads.confine_rest``). None:
                         ``adaserve serve``, which owns its process, does; an app
                         embedded in another program's process does not
    default_class:       class of requests that name none (None = the engine's default)
    timeout_keep_alive_s: an idle keep-alive connection is closed after this long
    header_timeout_s:    a request's line and headers must arrive within this long of the
                         connection opening (or of its first byte on a kept-alive one)
    body_timeout_s:      a request's body must arrive within this long of its headers
                         (408, and the connection is closed)
    max_connections:     open connections beyond this: an idle one (no request in
                         flight) is closed to make room, else the new one gets 503
                         (None = no cap)
    max_idle_connections_per_client: connections one client address may hold with no
                         request in flight (opening, sending headers, idle between
                         requests); beyond it its oldest idle one is closed (None = no
                         cap). Silent sockets cannot take the server's connections
    http:                the HTTP/1.1 parser: ``h11`` (default; pure Python, always
                         installed), ``httptools`` or ``auto`` (httptools if installed)
    max_request_line_bytes: a longer request line (method, URL, version) gets 414
    max_header_bytes:    request headers larger than this get 431 (whatever the parser)
    log_stats:           log a stats line (throughput, queue, KV use, per-class
                         attainment and acceptance) every ``log_stats_interval_s``
    log_stats_interval_s: seconds between two stats lines (vLLM's default: 10)
    auth_max_failures:   wrong API keys from one client address within
                         ``auth_failure_window_s`` before it is locked: during a lock
                         (1 s, doubling with each lock in a row, at most 5 min) its
                         wrong keys get 429 ``too_many_failed_auth`` (``server.auth``)
    auth_failure_window_s: the window those failures are counted in
    quota_hold_s:        a tenant that sends again before the Retry-After of its last
                         quota refusal has its next refusal held at the door for what
                         is left of that wait (at most this long), tried once more, and
                         only then answered 429: a client that ignores Retry-After gets
                         about one answer per connection per wait, and costs the
                         server no more (0 = answer at once)
    """

    model_name: str | None = None
    model_aliases: tuple[str, ...] = ()  # more ids requests may name (--served-model-name a b)
    host: str = "127.0.0.1"
    port: int = 8000
    strict_fields: bool = False
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    max_body_bytes: int | None = None
    admission: bool = True
    max_waiting: int | None = None
    shutdown_grace_s: float = 30.0
    default_max_tokens: int | None = None
    max_choices: int = 64
    step_delay_s: float = 0.0
    step_pace_ms: tuple[float, float] | None = None
    confine_threads: bool | None = None
    default_class: str | None = None
    timeout_keep_alive_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int | None = 1000
    max_idle_connections_per_client: int | None = 64
    http: str = "h11"
    max_request_line_bytes: int = 8192
    max_header_bytes: int = 16384
    log_stats: bool = True
    log_stats_interval_s: float = 10.0
    auth_max_failures: int = 5
    auth_failure_window_s: float = 60.0
    quota_hold_s: float = 1.0
    service_tiers: Mapping[str, str] = field(default_factory=dict)
    tenants: tuple[Tenant, ...] = ()
    classes: tuple[SLOClass, ...] | None = None  # None = the engine's classes
    engine: Mapping[str, Any] = field(default_factory=dict)  # EngineConfig overrides
    usage: UsageConfig = field(default_factory=UsageConfig)  # the usage ledger ([usage])

    def __post_init__(self) -> None:
        if self.max_body_bytes is not None and self.max_body_bytes <= 0:
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
        if self.step_pace_ms is not None:
            pace = self.step_pace_ms
            ok = isinstance(pace, (list, tuple)) and len(pace) == 2
            ok = ok and all(
                not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v < math.inf
                for v in pace
            )
            if not ok:
                raise ConfigError(
                    "server.step_pace_ms must be [A, B]: two numbers >= 0 (ms per step, "
                    "ms per token of its pass)"
                )
            object.__setattr__(self, "step_pace_ms", (float(pace[0]), float(pace[1])))
        for k in ("timeout_keep_alive_s", "header_timeout_s", "body_timeout_s"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ConfigError(f"server.{k} must be a positive number of seconds")
        v = self.log_stats_interval_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ConfigError("server.log_stats_interval_s must be a positive number of seconds")
        if not isinstance(self.log_stats, bool):
            raise ConfigError("server.log_stats must be true or false")
        for k in ("max_connections", "max_idle_connections_per_client"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"server.{k} must be a positive integer")
        for k in ("max_request_line_bytes", "max_header_bytes"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or not 256 <= v <= 1 << 20:
                raise ConfigError(f"server.{k} must be an integer from 256 to 1048576")
        if self.tool_call_parser not in (None, "hermes", "qwen", "llama3_json", "mistral"):
            raise ConfigError(
                "server.tool_call_parser must be hermes, qwen, llama3_json or mistral"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("server.enable_auto_tool_choice needs server.tool_call_parser")
        if self.http not in ("h11", "httptools", "auto"):
            raise ConfigError(
                f"server.http must be 'h11', 'httptools' or 'auto', not {self.http!r}"
            )
        for tier in self.service_tiers:
            if tier not in SERVICE_TIERS:
                raise ConfigError(f"service_tiers: unknown tier {tier!r}")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError("tenant names must be unique")
        digests = [d for t in self.tenants for d in t.key_digests]
        if len(set(digests)) != len(digests):
            raise ConfigError("an API key is configured twice")
        v = self.auth_max_failures
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1000:
            raise ConfigError("server.auth_max_failures must be an integer from 1 to 1000")
        v = self.auth_failure_window_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
            raise ConfigError(
                "server.auth_failure_window_s must be a number of seconds in (0, 86400]"
            )
        v = self.quota_hold_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 60:
            raise ConfigError("server.quota_hold_s must be a number of seconds in [0, 60]")
        folded: dict[str, str] = {}
        for t in self.tenants:
            check_name("tenant", t.name)
            if t.name.lower() in folded:
                raise ConfigError(
                    f"tenants.{t.name}: the name differs only in case from "
                    f"tenants.{folded[t.name.lower()]}"
                )
            folded[t.name.lower()] = t.name
            for d in t.key_digests:
                if d in EXAMPLE_KEY_DIGESTS:
                    raise ConfigError(
                        f"tenants.{t.name}: a key of the shipped examples is configured; "
                        "set a secret key of your own"
                    )
        for c in self.classes or ():
            check_name("class", c.name)

    @property
    def open_mode(self) -> bool:
        """No API keys configured: every request is the anonymous tenant."""
        return not any(t.key_digests for t in self.tenants)


_SERVER_KEYS = {f.name for f in dataclasses.fields(ServerConfig)} - {
    "service_tiers",
    "tenants",
    "classes",
    "engine",
    "usage",
}
_USAGE_KEYS = {f.name for f in dataclasses.fields(UsageConfig)}
_CLASS_KEYS = {f.name for f in dataclasses.fields(SLOClass)} - {"name"}
_TENANT_KEYS = {
    "keys",
    "key_sha256",
    "keys_env",
    "classes",
    "default_class",
    "on_forbidden_class",
    "on_overload",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "tokens_per_day",
    "requests_per_day",
    "charge_per_month",
    "admin",
    "free_targets",
    "prefix_cache_group",
}


def key_digest(key: str) -> bytes:
    """The SHA-256 digest an API key is kept (and compared) as."""
    return hashlib.sha256(key.encode("utf-8")).digest()


# keys that have appeared in the shipped examples and docs: known to everyone, so never
# accepted (as a plain key, from an environment variable or as a digest), nor is any
# key starting with "change-me"
EXAMPLE_KEYS = ("change-me-ops-key", "example-key", "plain-text-key")
EXAMPLE_KEY_DIGESTS = frozenset(key_digest(k) for k in EXAMPLE_KEYS)
_PLACEHOLDER_PREFIX = "change-me"

# tenant and class names: ASCII letters, digits, "_", "-" and "." (no look-alikes from
# other scripts, no spaces or control characters); they name metrics labels and rows
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
MAX_NAME_LEN = 64


def check_name(kind: str, name: str) -> None:
    """A ``ConfigError`` naming a tenant or class name (``kind``) that is not 1-64 ASCII
    letters, digits, ``_``, ``-`` or ``.`` starting with a letter or digit."""
    where = "tenants" if kind == "tenant" else "classes"
    ok = (
        isinstance(name, str)
        and 0 < len(name) <= MAX_NAME_LEN
        and set(name) <= _NAME_CHARS
        and name[0].isalnum()
    )
    if not ok:
        raise ConfigError(
            f"{where}.{name!a}: a {kind} name must be 1-{MAX_NAME_LEN} ASCII letters, "
            "digits, '_', '-' or '.' (starting with a letter or digit)"
        )


def check_key(where: str, key: str) -> None:
    """A ``ConfigError`` (naming ``where``, never the key) for a key no request could
    present (anything but printable ASCII without spaces) or one from the examples."""
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise ConfigError(
            f"{where}: a key must be printable ASCII without spaces (as sent in an "
            "Authorization header)"
        )
    if key.startswith(_PLACEHOLDER_PREFIX) or key_digest(key) in EXAMPLE_KEY_DIGESTS:
        raise ConfigError(
            f"{where}: a key of the shipped examples (or a 'change-me' placeholder) is "
            "configured; set a secret key of your own"
        )


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
    check_name("tenant", name)
    where = f"tenants.{name}"
    _check_keys(where, t, _TENANT_KEYS)
    keys = _str_list(f"{where}.keys", t.get("keys", []))
    for k in keys:
        check_key(f"{where}.keys", k)
    digests = [key_digest(k) for k in keys]
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
        for k in val.split(","):
            k = k.strip(" \t")
            if k:
                check_key(f"{where}.keys_env ({env})", k)
                digests.append(key_digest(k))
    classes = t.get("classes")
    if classes is not None:
        classes = tuple(_str_list(f"{where}.classes", classes))
    forbid = t.get("on_forbidden_class", "reject")
    if forbid not in ("reject", "downgrade"):
        raise ConfigError(f"{where}.on_forbidden_class must be 'reject' or 'downgrade'")
    on_overload = t.get("on_overload", "refuse")
    if on_overload not in ON_OVERLOAD:
        raise ConfigError(f"{where}.on_overload must be 'refuse' or 'degrade'")
    limits: dict[str, Any] = {}
    for k in (
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent",
        "tokens_per_day",
        "requests_per_day",
        "charge_per_month",
    ):
        v = t.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"{where}.{k} must be a positive number")
        limits[k] = v
    if limits["max_concurrent"] is not None:
        limits["max_concurrent"] = int(limits["max_concurrent"])
    default = t.get("default_class")
    if default is not None and not isinstance(default, str):
        raise ConfigError(f"{where}.default_class must be a string")
    group = t.get("prefix_cache_group")
    if group is not None and (not isinstance(group, str) or not group):
        raise ConfigError(f"{where}.prefix_cache_group must be a non-empty string")
    flags: dict[str, bool] = {}
    for k in ("admin", "free_targets"):
        flag = t.get(k, False)
        if not isinstance(flag, bool):
            raise ConfigError(f"{where}.{k} must be true or false")
        flags[k] = flag
    return Tenant(
        name=name,
        key_digests=tuple(digests),
        classes=classes,
        default_class=default,
        on_forbidden_class=forbid,
        on_overload=on_overload,
        prefix_cache_group=group,
        **flags,
        **limits,
    )


def parse_config(data: Mapping) -> ServerConfig:
    """A ``ServerConfig`` from a parsed TOML document (see docs/server.md)."""
    _check_keys(
        "config", data, {"server", "engine", "classes", "tenants", "service_tiers", "usage"}
    )
    usage_t = data.get("usage", {})
    _check_keys("usage", usage_t, _USAGE_KEYS)
    try:
        usage = UsageConfig(**usage_t)
    except UsageConfigError as e:
        raise ConfigError(str(e)) from None
    server = dict(data.get("server", {}))
    _check_keys("server", server, _SERVER_KEYS)
    tiers = data.get("service_tiers", {})
    _check_keys("service_tiers", tiers, set(SERVICE_TIERS))
    classes: tuple[SLOClass, ...] | None = None
    if "classes" in data:
        _check_keys("classes", data["classes"], set(data["classes"]))
        listed: list[SLOClass] = []
        for name, c in data["classes"].items():
            check_name("class", name)
            _check_keys(f"classes.{name}", c, _CLASS_KEYS)
            try:
                listed.append(SLOClass(name=name, **c))
            except (InvalidRequestError, TypeError) as e:
                raise ConfigError(f"classes.{name}: {e}") from None
        classes = tuple(listed)
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
            usage=usage,
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
    for sc in classes:
        need(f"classes.{sc.name}.degrade_to", sc.degrade_to)


def engine_config_for_server(ecfg: EngineConfig, cfg: ServerConfig) -> EngineConfig:
    """The engine configuration a server runs: the config file's classes, and engine
    admission control as ``server.admission`` says (on by default; with
    ``server.max_waiting`` as its queue cap when set)."""
    repl: dict = {"admission": cfg.admission}
    if cfg.max_waiting is not None:
        repl["max_waiting"] = cfg.max_waiting
    if cfg.classes is not None:
        names = [c.name for c in cfg.classes]
        repl["classes"] = cfg.classes
        repl["default_class"] = cfg.default_class or (
            ecfg.default_class if ecfg.default_class in names else names[0]
        )
    elif cfg.default_class is not None:
        repl["default_class"] = cfg.default_class
    return dataclasses.replace(ecfg, **repl)
