"""Issue 32 items 4 and 6 (authentication): wrong keys are throttled per client address
(429 ``too_many_failed_auth`` with Retry-After after a handful, valid keys still
served), the key is exactly what was sent (a trailing non-breaking space is not
stripped), tenant and class names are ASCII, and no key of the shipped examples is
accepted. Over real HTTP on loopback; each test sends from its own loopback address
(127.0.0.x), so their failures do not add up."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env

from adaserve.server import auth, parse_config
from adaserve.server import dashboard as dash
from adaserve.server.auth import (
    GOOD_KEYS_PER_CLIENT,
    AuthThrottle,
    TenantRegistry,
    _key_of,
    client_of,
)
from adaserve.server.config import EXAMPLE_KEYS, ConfigError, Tenant, key_digest, tomllib
from adaserve.server.errors import ApiError

ROOT = Path(__file__).resolve().parents[1]
MAX_FAILURES = 3
GOOD = "sk-good"
ADMIN = "sk-ops-admin-key"

CONFIG = f"""
[server]
model_name = "tiny"
auth_max_failures = {MAX_FAILURES}
auth_failure_window_s = 60

[tenants.good]
keys = ["{GOOD}"]

[tenants.ops]
keys = ["{ADMIN}"]
admin = true
"""

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    s = LiveServer(engine_config(target), parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


def _from(srv, addr: str) -> httpx.Client:
    """An HTTP client whose connections come from loopback address ``addr``."""
    return httpx.Client(
        base_url=srv.url, timeout=30, transport=httpx.HTTPTransport(local_address=addr)
    )


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _ask(srv, addr: str, key: str):
    """A 2-token completion with the official client, from ``addr``."""
    with _from(srv, addr) as h:
        c = openai.OpenAI(
            base_url=srv.url + "/v1", api_key=key, max_retries=0, http_client=h, timeout=30
        )
        return c.completions.create(model="tiny", prompt="hello", max_tokens=2)


def _locked(r: httpx.Response) -> None:
    assert r.status_code == 429, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == "too_many_failed_auth" and err["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1


# ---------------------------------------------------------------------- throttle


@pytest.fixture
def long_locks(monkeypatch):
    """A first lock of 5 s (1 s by default): room for several requests during it."""
    monkeypatch.setattr(auth, "FIRST_LOCK_S", 5.0, raising=False)


def test_wrong_keys_are_throttled_valid_keys_still_served(srv, long_locks):
    addr = "127.0.0.11"
    assert _ask(srv, addr, GOOD).usage.completion_tokens == 2  # known here before
    with _from(srv, addr) as h:
        for i in range(MAX_FAILURES):
            r = h.get("/v1/models", headers=_bearer(f"sk-guess-{i}"))
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # the handful is spent: every wrong key is 429 now, whatever the endpoint
        _locked(h.get("/v1/models", headers=_bearer("sk-guess-x")))
        _locked(h.post("/tokenize", json={"prompt": "a"}, headers=_bearer("sk-guess-y")))
        _locked(h.post("/v1/completions", json={"prompt": "a"}, headers=_bearer("sk-guess-z")))
        assert int(h.get("/v1/models", headers=_bearer("sk-x")).headers["retry-after"]) <= 5
        # a request without a key guesses nothing: still 401 missing_api_key
        r = h.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        # the valid key that authenticated from here is served during the lock
        assert h.get("/v1/models", headers=_bearer(GOOD)).status_code == 200
    assert _ask(srv, addr, GOOD).usage.completion_tokens == 2
    # another address is not locked by this one's guesses
    with _from(srv, "127.0.0.12") as other:
        r = other.get("/v1/models", headers=_bearer("sk-guess-0"))
        assert r.status_code == 401
        assert other.get("/v1/models", headers=_bearer(ADMIN)).status_code == 200


def test_a_key_first_seen_during_the_lock_gets_the_same_429(srv, long_locks):
    """A lock tells nothing about a guess: a right key never seen from the address
    before gets the 429 a wrong one gets (else the lock would be an oracle)."""
    addr = "127.0.0.13"
    with _from(srv, addr) as h:
        for i in range(MAX_FAILURES):
            assert h.get("/v1/models", headers=_bearer(f"sk-guess-{i}")).status_code == 401
        _locked(h.get("/v1/models", headers=_bearer(ADMIN)))
        _locked(h.get("/v1/models", headers=_bearer("sk-guess-again")))


def test_dashboard_sign_in_is_throttled_the_same_way(srv, long_locks):
    addr = "127.0.0.14"
    with _from(srv, addr) as h:
        r = h.post(dash.SESSION_URL, headers=_bearer(ADMIN))
        assert r.status_code == 204  # signed in from here once
        h.cookies.clear()
        for i in range(MAX_FAILURES):
            r = h.post(dash.SESSION_URL, headers=_bearer(f"sk-guess-{i}"))
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = h.post(dash.SESSION_URL, headers=_bearer("sk-guess-x"))
        _locked(r)
        assert "set-cookie" not in r.headers
        # the page's and the data endpoint's keys, and the API's, share the lock
        _locked(h.get(dash.DATA_URL, headers=_bearer("sk-guess-y")))
        _locked(h.get("/v1/models", headers=_bearer("sk-guess-z")))
        # the admin key known from here still signs in
        r = h.post(dash.SESSION_URL, headers=_bearer(ADMIN))
        assert r.status_code == 204 and r.cookies.get(dash.COOKIE)


def test_lock_ends_after_its_retry_after(srv):
    addr = "127.0.0.15"
    with _from(srv, addr) as h:
        for i in range(MAX_FAILURES):
            assert h.get("/v1/models", headers=_bearer(f"sk-guess-{i}")).status_code == 401
        r = h.get("/v1/models", headers=_bearer("sk-guess-x"))
        _locked(r)
        time.sleep(int(r.headers["retry-after"]) + 0.1)
        assert h.get("/v1/models", headers=_bearer("sk-guess-y")).status_code == 401
        assert h.get("/v1/models", headers=_bearer(GOOD)).status_code == 200


# ---------------------------------------------------------------------- exact keys


@pytest.mark.parametrize(
    "addr, value",
    [
        ("127.0.0.21", f"Bearer {GOOD}\u00a0".encode()),  # UTF-8, as a text client sends it
        ("127.0.0.22", f"Bearer {GOOD}\u00a0".encode("latin-1")),  # one 0xA0 byte
        ("127.0.0.23", f"Bearer \u00a0{GOOD}".encode("latin-1")),
        ("127.0.0.24", f"Bearer {GOOD}\x85".encode("latin-1")),  # NEL
        ("127.0.0.25", f"Bearer {GOOD}\u3000".encode()),  # ideographic space
    ],
    ids=["nbsp-utf8", "nbsp-latin1", "leading-nbsp-latin1", "nel-latin1", "ideographic-utf8"],
)
def test_key_with_non_ascii_whitespace_is_refused(srv, addr, value):
    with _from(srv, addr) as h:
        assert h.get("/v1/models", headers=_bearer(GOOD)).status_code == 200
        r = h.get("/v1/models", headers=[(b"Authorization", value)])
        assert r.status_code == 401, (value, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"


def _raw_status(srv, addr: str, authorization: bytes) -> int:
    """The status of ``GET /v1/models`` sent byte for byte on a raw socket (httpx will
    not send a header value that ends in whitespace)."""
    with socket.create_connection(
        ("127.0.0.1", srv.port), timeout=30, source_address=(addr, 0)
    ) as s:
        s.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization
            + b"\r\nConnection: close\r\n\r\n"
        )  # fmt: skip
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_key_with_ascii_space_or_tab_around_is_accepted(srv):
    addr = "127.0.0.26"
    for value in (f"Bearer {GOOD} ", f"Bearer {GOOD}\t", f"Bearer  {GOOD}", f"bearer {GOOD}"):
        assert _raw_status(srv, addr, value.encode()) == 200, value
    with _from(srv, addr) as h:  # and through httpx, as bytes
        assert (
            h.get("/v1/models", headers=[(b"Authorization", b"Bearer  sk-good")]).status_code == 200
        )
    # the same bytes with a non-breaking space instead: 401
    assert _raw_status(srv, addr, f"Bearer {GOOD}\u00a0".encode("latin-1")) == 401
    assert _raw_status(srv, addr, f"Bearer {GOOD}\u00a0 ".encode()) == 401


# ---------------------------------------------------------------------- config


def _cfg(tenants: str, classes: str = "") -> str:
    return f"[server]\nmodel_name = 'tiny'\n{classes}\n{tenants}"


@pytest.mark.parametrize(
    "toml, where",
    [
        ("[tenants.\"g\u043eld\"]\nkeys = ['sk-a-1']\n", "g\\u043eld"),  # Cyrillic o
        ("[tenants.Gold]\nkeys = ['sk-a-1']\n[tenants.gold]\nkeys = ['sk-b-1']\n", "gold"),
        ("[tenants.\"gold \"]\nkeys = ['sk-a-1']\n", "gold "),
        ("[tenants.\"\"]\nkeys = ['sk-a-1']\n", "tenants."),
        ("[tenants.ops]\nkeys = ['change-me-ops-key']\nadmin = true\n", "tenants.ops"),
        ("[tenants.ops]\nkeys = ['change-me-too']\n", "tenants.ops"),
        ("[tenants.ops]\nkeys = ['example-key']\n", "tenants.ops"),
        ("[tenants.ops]\nkeys = ['sk-good\u00a0']\n", "tenants.ops"),
    ],
    ids=["cyrillic", "case-folded", "space", "empty", "change-me", "prefix", "example", "nbsp"],
)
def test_bad_tenant_names_and_example_keys_refused(toml, where):
    with pytest.raises(ConfigError) as ei:
        parse_config(tomllib.loads(_cfg(toml)))
    assert where in str(ei.value), str(ei.value)
    assert "-ops-key" not in str(ei.value) and "-too" not in str(ei.value)  # no key shown


def test_class_name_with_a_space_or_non_ascii_refused():
    for name in ("fast lane", "f\u0430st"):  # a space; a Cyrillic a
        classes = f'[classes."{name}"]\ntpot_ms = 20\n'
        with pytest.raises(ConfigError, match=r"classes\."):
            parse_config(tomllib.loads(_cfg("", classes)))
    parse_config(tomllib.loads(_cfg("", "[classes.fast-lane_2]\ntpot_ms = 20\n")))


@pytest.mark.parametrize("key", EXAMPLE_KEYS)
def test_example_keys_refused_from_env_and_as_digests(key, monkeypatch):
    monkeypatch.setenv("ADASERVE_TEST_OPS_KEYS", f"sk-fine-key, {key}")
    with pytest.raises(ConfigError, match=r"tenants\.ops\.keys_env"):
        parse_config(tomllib.loads(_cfg("[tenants.ops]\nkeys_env = 'ADASERVE_TEST_OPS_KEYS'\n")))
    digest = hashlib.sha256(key.encode()).hexdigest()
    with pytest.raises(ConfigError, match=r"tenants\.ops"):
        parse_config(tomllib.loads(_cfg(f"[tenants.ops]\nkey_sha256 = ['{digest}']\n")))


def test_example_config_ships_no_working_key(monkeypatch):
    """Every tenant of examples/server.toml reads its keys from the environment, which
    must be set: the file alone starts no server with a key."""
    text = (ROOT / "examples" / "server.toml").read_text()
    data = tomllib.loads(text)
    assert data["tenants"]
    for name, t in data["tenants"].items():
        assert not t.get("keys") and not t.get("key_sha256"), name
        monkeypatch.delenv(t["keys_env"], raising=False)
    assert not any(k in text for k in EXAMPLE_KEYS)
    with pytest.raises(ConfigError, match="is not set"):
        parse_config(data)
    for name, t in data["tenants"].items():
        monkeypatch.setenv(t["keys_env"], f"sk-{name}-local-secret")
    assert len(parse_config(data).tenants) == len(data["tenants"])


def test_serve_refuses_to_start_with_an_example_key(tmp_path):
    """``adaserve serve`` exits 2 with one line on stderr (before any model is loaded)."""
    cfg = tmp_path / "server.toml"
    cfg.write_text("[tenants.ops]\nkeys = ['change-me-ops-key']\nadmin = true\n")
    exe = Path(sys.executable).with_name("adaserve")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "adaserve"]
    p = subprocess.run(
        [*cmd, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2, (p.returncode, p.stderr)
    err = p.stderr.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("adaserve serve:") and "tenants.ops" in err
    assert "change-me-ops-key" not in err  # the message never repeats a key


# ---------------------------------------------------------------------- units


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


D_GOOD, D_OTHER = key_digest("sk-good"), key_digest("sk-other")


def _fail(th: AuthThrottle, addr: str, n: int) -> None:
    for _ in range(n):
        th.failed(addr)


def test_throttle_locks_after_the_handful_and_doubles_the_lock():
    clock = Clock()
    th = AuthThrottle(3, 60.0, max_lock_s=8.0, clock=clock)
    _fail(th, "a", 2)
    assert th.refused("a", D_OTHER, False) == 0.0
    th.failed("a")
    assert th.refused("a", D_OTHER, False) == pytest.approx(1.0)
    assert th.refused("b", D_OTHER, False) == 0.0  # per address
    locks = [1.0]
    for _ in range(4):
        clock.t += locks[-1]  # the lock has just ended: the next guesses come at once
        assert th.refused("a", D_OTHER, False) == 0.0
        _fail(th, "a", 2)
        assert th.refused("a", D_OTHER, False) == 0.0  # a fresh handful each time
        th.failed("a")
        locks.append(th.refused("a", D_OTHER, False))
    assert locks == pytest.approx([1.0, 2.0, 4.0, 8.0, 8.0])  # doubling, capped
    clock.t += 8.0 + 8.5  # the lock, then quiet for longer than the longest lock
    _fail(th, "a", 3)
    assert th.refused("a", D_OTHER, False) == pytest.approx(1.0)  # locks start over


def test_throttle_window_forgets_old_failures():
    clock = Clock()
    th = AuthThrottle(3, 60.0, clock=clock)
    for _ in range(6):  # one wrong key every 31 s: never 3 within 60 s of the first
        th.failed("a")
        clock.t += 31.0
        assert th.refused("a", D_OTHER, False) == 0.0


def test_throttle_serves_keys_known_from_the_address_only():
    clock = Clock()
    th = AuthThrottle(2, 60.0, clock=clock)
    th.succeeded("a", D_GOOD)
    _fail(th, "a", 2)
    assert th.refused("a", D_GOOD, True) == 0.0  # valid, authenticated here before
    assert th.refused("a", D_GOOD, False) > 0  # the same digest is no pass when invalid
    assert th.refused("a", D_OTHER, True) > 0  # valid but never seen from here
    # a success does not clear the count
    clock.t += 2.0
    th.failed("a")
    th.succeeded("a", D_GOOD)
    th.failed("a")
    assert th.refused("a", D_OTHER, False) > 0


def test_throttle_memory_is_bounded():
    clock = Clock()
    th = AuthThrottle(1, 60.0, max_clients=100, clock=clock)
    for i in range(5000):
        th.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(th) == 100
    assert th.refused("10.0.19.135", D_OTHER, False) > 0  # the most recent kept (4999)
    assert th.refused("10.0.0.0", D_OTHER, False) == 0.0  # the oldest forgotten
    for i in range(3 * GOOD_KEYS_PER_CLIENT):
        th.succeeded("k", key_digest(f"sk-{i}"))
    assert len(th._clients["k"].good) == GOOD_KEYS_PER_CLIENT
    assert len(th) == 100


def test_registry_throttles_wrong_keys_not_missing_ones():
    reg = TenantRegistry((Tenant("t", key_digests=(D_GOOD,)),), AuthThrottle(2, 60.0))
    for _ in range(5):  # no key: not a guess
        with pytest.raises(ApiError) as ei:
            reg.authenticate(None, "a")
        assert ei.value.code == "missing_api_key"
    assert reg.authenticate("Bearer sk-good", "a").name == "t"
    for code in ("invalid_api_key", "invalid_api_key", "too_many_failed_auth"):
        with pytest.raises(ApiError) as ei:
            reg.authenticate("Bearer sk-bad", "a")
        assert ei.value.code == code
    assert ei.value.status == 429 and "Retry-After" in ei.value.headers
    assert reg.authenticate("Bearer sk-good", "a").name == "t"
    assert reg.authenticate("Bearer sk-good", None).name == "t"  # no address: no throttle


def test_key_of_takes_the_key_exactly():
    assert _key_of("Bearer sk-good") == "sk-good"
    assert _key_of(" bearer\tsk-good \t") is None  # the scheme is followed by a space
    assert _key_of("Bearer  sk-good\t") == "sk-good"
    for bad in ("Bearer sk-good\u00a0", "Bearer sk-g\u043eod", "Bearer sk-good\x00",
                "Bearer sk good", "Basic sk-good", "Bearer ", "sk-good"):  # fmt: skip
        assert _key_of(bad) is None, bad


def test_client_of_groups_ipv6_by_64():
    assert client_of({"client": ("127.0.0.1", 5)}) == "127.0.0.1"
    assert client_of({"client": ("::ffff:10.1.2.3", 5)}) == "10.1.2.3"
    a = client_of({"client": ("2001:db8:1:2:aaaa::1", 5)})
    assert a == client_of({"client": ("2001:db8:1:2:bbbb::9", 5)}) == "2001:db8:1:2::/64"
    assert a != client_of({"client": ("2001:db8:1:3::1", 5)})
    assert client_of({"client": None}) is None and client_of({}) is None
