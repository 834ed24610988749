"""API keys, tenants, class permissions, quotas, pricing and the TOML configuration."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import httpx
import openai
import pytest
from server_fixtures import (
    CUSTOM_TEMPLATE,
    LiveServer,
    engine_config,
    scrape,
    server_test_env,
    templated_target,
)

from adaserve.core.slo import DEFAULT_CLASSES, SLO
from adaserve.server import load_config, parse_config
from adaserve.server.auth import TenantRegistry
from adaserve.server.config import ConfigError, Tenant, check_against_classes, tomllib
from adaserve.server.errors import ApiError
from adaserve.server.quotas import QuotaBook, TokenBucket
from adaserve.server.slo_resolution import resolve_slo
from adaserve.text.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[server]
model_name = "tiny"

[tenants.acme]
keys = ["sk-acme-secret"]
classes = ["chat", "batch"]

[tenants.cheap]
keys = ["sk-cheap-secret"]
classes = ["batch"]
default_class = "batch"
on_forbidden_class = "downgrade"

[tenants.limited]
keys = ["sk-limited-secret"]
requests_per_minute = 2

[tenants.tokens]
keys = ["sk-tokens-secret"]
tokens_per_minute = 40

[tenants.ops]
keys = ["sk-ops-secret"]
admin = true
free_targets = true
"""

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target = templated_target(tmp_path_factory)
    s = LiveServer(engine_config(target), parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


def _ask(srv, key, **kw):
    kw.setdefault("max_tokens", 2)
    kw.setdefault("prompt", "hello")
    return srv.client(key).completions.create(model="tiny", **kw)


# ---------------------------------------------------------------------- live


def test_missing_or_wrong_key_is_401(srv):
    with srv.http() as h:
        r = h.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "missing_api_key"
        assert h.get("/v1/models").status_code == 401
        assert h.get("/v1/slo/report").status_code == 401
        # health, metrics and the schema stay open
        assert h.get("/health").status_code == 200
        assert h.get("/metrics").status_code == 200
        assert h.get("/openapi.json").status_code == 200
    with pytest.raises(openai.AuthenticationError) as ei:
        _ask(srv, "sk-acme-secreT")
    assert ei.value.body["code"] == "invalid_api_key"
    assert srv.client("sk-acme-secret").models.list().data[0].id == "tiny"


def test_forbidden_class_is_403_or_downgraded(srv):
    with pytest.raises(openai.PermissionDeniedError) as ei:
        _ask(srv, "sk-acme-secret", extra_body={"slo_class": "interactive"})
    assert ei.value.body["code"] == "slo_class_not_allowed"
    # explicit targets stricter than the allowed classes promote, then are refused
    with pytest.raises(openai.PermissionDeniedError):
        _ask(srv, "sk-acme-secret", extra_body={"slo": {"tpot_ms": 0.01}})
    ok = _ask(srv, "sk-acme-secret", extra_body={"slo_class": "batch"})
    assert ok.model_extra["metrics"]["slo_class"] == "batch"
    # a named class caps the targets at its own strictness (no strict SLO at chat price)
    slos = srv.state.loop.class_slos
    r = _ask(srv, "sk-acme-secret", extra_body={"slo_class": "chat", "slo": {"tpot_ms": 0.01}})
    m = r.model_extra["metrics"]
    assert m["slo_class"] == "chat" and m["tpot_target_ms"] == pytest.approx(slos["chat"].tpot_ms)
    # ... unless the tenant may set free targets
    r = _ask(srv, "sk-ops-secret", extra_body={"slo_class": "chat", "slo": {"tpot_ms": 0.01}})
    assert r.model_extra["metrics"]["tpot_target_ms"] == 0.01
    # a downgrading tenant runs interactive as batch (chat is not allowed either)
    r = _ask(srv, "sk-cheap-secret", extra_body={"slo_class": "interactive"})
    m = r.model_extra["metrics"]
    assert (m["slo_class"], m["degraded_from"]) == ("batch", "interactive")
    # and cannot keep a stricter explicit target than its class gives
    r = _ask(srv, "sk-cheap-secret", extra_body={"slo": {"tpot_ms": 0.01}})
    m = r.model_extra["metrics"]
    assert m["slo_class"] == "batch" and m["tpot_target_ms"] == pytest.approx(
        srv.state.loop.class_slos["batch"].tpot_ms
    )


# every SLO input a client controls, each with the strictest values it can send
ESCAPES = [
    ({"slo": {"max_queue_ms": 1}}, {}),
    ({"slo": {"deadline_ms": 1}}, {}),
    ({"slo": {"tpot_ms": 0.01, "ttft_ms": 1, "max_queue_ms": 1, "deadline_ms": 1}}, {}),
    ({"slo_class": "batch", "slo": {"max_queue_ms": 1, "deadline_ms": 1}}, {}),
    ({"slo_class": "chat", "slo": {"max_queue_ms": 1}}, {}),
    ({"slo_class": "interactive", "slo": {"max_queue_ms": 1}}, {}),
    ({"priority": -5, "slo": {"max_queue_ms": 1}}, {}),
    ({"service_tier": "priority", "slo": {"max_queue_ms": 1}}, {}),
    ({"slo": {"max_queue_ms": 1}}, {"x-slo-ttft-ms": "1", "x-slo-tpot-ms": "0.01"}),
    ({}, {"x-slo-ttft-ms": "1", "x-slo-tpot-ms": "0.01"}),
]


@pytest.mark.parametrize("key,allowed", [("sk-cheap-secret", ["batch"]),
                                         ("sk-acme-secret", ["chat", "batch"])])  # fmt: skip
@pytest.mark.parametrize("body,headers", ESCAPES)
def test_no_slo_input_beats_the_strictest_allowed_class(srv, monkeypatch, key, allowed, body,
                                                        headers):  # fmt: skip
    """Queue jump: a batch-only tenant sending ``max_queue_ms: 1`` was served before
    every queued request of stricter tenants. No field, header, class, priority or tier
    may give a tenant a target stricter than its strictest allowed class's."""
    submitted = []
    submit = srv.state.loop.submit

    async def spy(h):
        submitted.append(h.slo)
        return await submit(h)

    monkeypatch.setattr(srv.state.loop, "submit", spy)
    slos = [srv.state.loop.class_slos[c] for c in allowed]
    try:
        _ask(srv, key, max_tokens=1, extra_body=body, extra_headers=headers)
    except openai.PermissionDeniedError:
        assert not submitted  # refused outright: no escape
        return
    (slo,) = submitted
    assert slo.cls in allowed
    for k in ("tpot_ms", "ttft_ms", "max_queue_ms", "deadline_ms"):
        given = [getattr(s, k) for s in slos if getattr(s, k) is not None]
        got = getattr(slo, k)
        if not given:  # no allowed class sets this target: none may be had
            assert got is None, (k, got)
        else:
            assert got is None or got >= min(given) * (1 - 1e-9), (k, got, min(given))


def test_scoring_request_bills_no_output_tokens(srv):
    """``max_tokens: 0`` with ``echo`` reports 0 completion tokens: bill and count 0."""
    c = srv.client("sk-acme-secret")
    before = c.get("/slo/report", cast_to=object)["tenants"].get("acme", {"classes": {}})
    r = _ask(srv, "sk-acme-secret", prompt="score this text", max_tokens=0, echo=True,
             logprobs=1)  # fmt: skip
    assert r.usage.completion_tokens == 0 and r.choices[0].text == "score this text"
    m = r.model_extra["metrics"]
    assert (m["charge"], m["output_tokens"]) == (0, 0)
    after = c.get("/slo/report", cast_to=object)["tenants"]["acme"]["classes"]["chat"]
    prev = before["classes"].get("chat", {"requests": 0, "completion_tokens": 0, "charge": 0})
    assert after["requests"] == prev["requests"] + 1
    assert after["completion_tokens"] == prev["completion_tokens"]
    assert after["charge"] == pytest.approx(prev["charge"])


def test_requests_per_minute_quota_is_429_with_retry_after(srv):
    _ask(srv, "sk-limited-secret")
    _ask(srv, "sk-limited-secret")
    with pytest.raises(openai.RateLimitError) as ei:
        _ask(srv, "sk-limited-secret")
    e = ei.value
    assert e.body["reason"] == "requests_per_minute"
    assert int(e.response.headers["retry-after"]) >= 1
    # other tenants are unaffected
    _ask(srv, "sk-acme-secret")


def test_tokens_per_minute_quota_counts_prompt_and_output(srv):
    r = _ask(srv, "sk-tokens-secret", max_tokens=30, extra_body={"ignore_eos": True})
    assert 30 < r.usage.total_tokens <= 40  # the output counts too: < 10 tokens are left
    # within the quota, over what is left: 429 with Retry-After
    with pytest.raises(openai.RateLimitError) as ei:
        _ask(srv, "sk-tokens-secret", prompt="hello world, " * 3)
    assert ei.value.body["reason"] == "tokens_per_minute"
    assert int(ei.value.response.headers["retry-after"]) >= 1
    # over the whole quota (the prompt alone): it can never fit, 400 without Retry-After
    with pytest.raises(openai.BadRequestError) as ei:
        _ask(srv, "sk-tokens-secret", prompt="hello world, " * 6)
    assert ei.value.body["code"] == "exceeds_quota"
    assert ei.value.body["reason"] == "tokens_per_minute"
    assert "retry-after" not in ei.value.response.headers


def test_usage_and_charges_per_tenant_and_class(srv):
    before = srv.client("sk-ops-secret").get("/slo/report", cast_to=object)
    r1 = _ask(srv, "sk-acme-secret", max_tokens=5, extra_body={"ignore_eos": True})
    r2 = _ask(
        srv,
        "sk-acme-secret",
        max_tokens=3,
        extra_body={"ignore_eos": True, "slo_class": "batch"},
    )
    own = srv.client("sk-acme-secret").get("/slo/report", cast_to=object)
    assert set(own["tenants"]) == {"acme"}  # a tenant sees only itself
    full = srv.client("sk-ops-secret").get("/slo/report", cast_to=object)
    assert {"acme", "cheap", "limited"} <= set(full["tenants"])
    prices = {c.name: c.price_per_1k for c in DEFAULT_CLASSES}

    def get(rep, cls, k):
        return rep["tenants"].get("acme", {"classes": {}})["classes"].get(cls, {}).get(k, 0)

    for cls, r in (("chat", r1), ("batch", r2)):
        dtok = get(own, cls, "completion_tokens") - get(before, cls, "completion_tokens")
        assert dtok == r.usage.completion_tokens
        dcharge = get(own, cls, "charge") - get(before, cls, "charge")
        assert dcharge == pytest.approx(r.usage.completion_tokens * prices[cls] / 1000)
        assert r.model_extra["metrics"]["charge"] == pytest.approx(dcharge)


TENANT_SERIES = (
    "adaserve:charges_total",
    "adaserve:tenant_output_tokens_total",
    "adaserve:rate_limited_requests_total",
)


def _tenants_in(fams) -> set[str]:
    return {lab["tenant"] for samples in fams.values() for lab, _ in samples if "tenant" in lab}


def test_metrics_billing_series_need_an_admin_key(srv):
    _ask(srv, "sk-acme-secret", max_tokens=3, extra_body={"ignore_eos": True})
    for _ in range(3):  # 2 requests a minute: the third (at the latest) is refused
        try:
            _ask(srv, "sk-limited-secret")
        except openai.RateLimitError:
            break
    # no key: the engine-wide series a gateway scrapes, and no billing data at all
    anon = scrape(srv.url)
    assert "vllm:generation_tokens_total" in anon and "adaserve:output_tokens_total" in anon
    assert anon["vllm:generation_tokens_total"][0][1] > 0
    assert not any(name.startswith(TENANT_SERIES) for name in anon)
    assert _tenants_in(anon) == set()
    # an admin key: every tenant's usage, charges and quota refusals
    admin = scrape(srv.url, key="sk-ops-secret")
    for name in TENANT_SERIES:
        assert name in admin, name
    assert {"acme", "limited"} <= _tenants_in(admin)
    assert any(lab["tenant"] == "acme" and v > 0 for lab, v in admin["adaserve:charges_total"])
    # another tenant's key: only its own series
    own = scrape(srv.url, key="sk-acme-secret")
    assert _tenants_in(own) == {"acme"}
    # a wrong key is refused, as on /v1/*
    r = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer sk-nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_chat_template_from_tokenizer_config(srv, tmp_path_factory):
    msgs = [{"role": "user", "content": "hi there"}]
    r = srv.client("sk-acme-secret").chat.completions.create(
        model="tiny", messages=msgs, max_tokens=2
    )
    tok = load_tokenizer(templated_target(tmp_path_factory))
    assert tok.chat_template == CUSTOM_TEMPLATE
    assert r.usage.prompt_tokens == len(tok.encode("<user>hi there</user><assistant>"))


def test_keys_are_never_logged(srv, caplog):
    caplog.set_level(logging.DEBUG)
    _ask(srv, "sk-acme-secret")
    with pytest.raises(openai.AuthenticationError):
        _ask(srv, "sk-wrong-secret")
    assert "secret" not in caplog.text
    assert "secret" not in repr(srv.state.cfg)


# ---------------------------------------------------------------------- units


def test_example_config_parses(monkeypatch):
    monkeypatch.setenv("ADASERVE_IDE_KEYS", "k1, k2")
    monkeypatch.setenv("ADASERVE_REPORTS_KEYS", "k3")
    monkeypatch.setenv("ADASERVE_OPS_KEYS", "k4")
    cfg = load_config(ROOT / "examples" / "server.toml")
    assert not cfg.open_mode
    assert [c.name for c in cfg.classes] == ["interactive", "chat", "batch"]
    check_against_classes(cfg, cfg.classes)
    reg = TenantRegistry(cfg.tenants)
    assert reg.authenticate("Bearer k2").name == "ide"
    assert reg.authenticate("Bearer k3").name == "reports"
    assert reg.authenticate("bearer k4").admin
    ide = next(t for t in cfg.tenants if t.name == "ide")
    assert (ide.tokens_per_day, ide.charge_per_month) == (50_000_000, 5000.0)
    assert cfg.usage.keep_days == 400 and cfg.usage.enabled


@pytest.mark.parametrize(
    "text,match",
    [
        ("[server]\nport_number = 1", "unknown key"),
        ("[tenants.a]\nkeys = ['k']\nquota = 3", "unknown key"),
        ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']", "configured twice"),
        ("[tenants.a]\nkeys = ['k']\nrequests_per_minute = -1", "positive"),
        ("[tenants.a]\nkey_sha256 = ['abc']", "SHA-256"),
        ("[tenants.a]\nkeys_env = 'ADASERVE_SURELY_UNSET_VAR'", "not set"),
        ("[tenants.a]\non_forbidden_class = 'ignore'", "downgrade"),
        ("[classes.x]\ntpot_ms = -3", "classes.x"),
        ("[classes.x]\nspeed = 3", "unknown key"),
        ("[service_tiers]\ngold = 'chat'", "unknown key"),
        ("[server]\nmax_body_bytes = 0", "positive"),
    ],
)
def test_bad_configs_name_the_problem(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(tomllib.loads(text))


def test_config_class_names_must_exist():
    cfg = parse_config(tomllib.loads("[tenants.a]\nkeys=['k']\nclasses=['gold']"))
    with pytest.raises(ConfigError, match="gold"):
        check_against_classes(cfg, DEFAULT_CLASSES)


def test_open_mode_without_keys():
    reg = TenantRegistry(())
    assert reg.open_mode and reg.authenticate(None).name == "anonymous"
    with pytest.raises(ApiError) as ei:
        TenantRegistry((Tenant("t", key_digests=(b"x" * 32,)),)).authenticate("Basic abc")
    assert ei.value.status == 401


def test_token_bucket_refills_and_reports_wait():
    now = [0.0]
    b = TokenBucket(60, clock=lambda: now[0])  # one per second
    assert b.wait_for(60) == 0
    b.take(60)
    assert b.wait_for(1) == pytest.approx(1.0)
    now[0] += 0.5
    assert b.wait_for(1) == pytest.approx(0.5)
    assert math.isinf(b.wait_for(61))
    b.take(10)  # debt
    assert b.wait_for(1) == pytest.approx(10.5)


def test_quota_book_max_concurrent():
    t = Tenant("t", max_concurrent=1)
    q = QuotaBook((t,))
    q.enter(t)
    with pytest.raises(ApiError) as ei:
        q.enter(t)
    assert ei.value.status == 429 and ei.value.reason == "max_concurrent"
    q.release(t)
    q.enter(t)


SLOS = {c.name: c.resolve(10.0) for c in DEFAULT_CLASSES}


def _resolve(tenant=None, headers=None, **kw):
    return resolve_slo(
        classes=DEFAULT_CLASSES,
        class_slos=SLOS,
        tenant=tenant or Tenant("anonymous"),
        default_class="chat",
        service_tiers={},
        headers=headers,
        **kw,
    )


def test_slo_precedence_table():
    assert _resolve().cls.name == "chat"
    assert _resolve(tenant=Tenant("t", default_class="batch")).cls.name == "batch"
    assert _resolve(service_tier="flex").cls.name == "batch"
    assert _resolve(service_tier="flex", priority=0).cls.name == "interactive"
    assert _resolve(priority=0, slo_class="batch").cls.name == "batch"
    assert _resolve(priority=99).cls.name == "batch"
    assert _resolve(priority=-5).cls.name == "interactive"
    # explicit targets: body beats headers beats class
    h = {"x-slo-tpot-ms": "500", "x-slo-ttft-ms": "9000"}
    c = _resolve(headers=h)
    assert (c.slo.tpot_ms, c.slo.ttft_ms) == (500, 9000)
    c = _resolve(headers=h, slo={"tpot_ms": 700})
    assert (c.slo.tpot_ms, c.slo.ttft_ms) == (700, 9000)
    # stricter than the class promises -> the loosest class that is strict enough
    c = _resolve(slo={"tpot_ms": 15})  # chat is 18 ms, interactive 12 ms
    assert c.cls.name == "interactive" and c.slo.tpot_ms == 15 and c.source == "slo"
    assert _resolve(slo={"tpot_ms": 40}).cls.name == "chat"
    # a named class is kept; its strictness caps the targets unless free_targets
    c = _resolve(slo_class="batch", slo={"tpot_ms": 15})
    assert (c.cls.name, c.slo.tpot_ms) == ("batch", 50)
    c = _resolve(tenant=Tenant("t", free_targets=True), slo_class="batch", slo={"tpot_ms": 15})
    assert (c.cls.name, c.slo.tpot_ms) == ("batch", 15)
    # every target is capped: raised to the class's, dropped where the class sets none
    c = _resolve(slo_class="batch", slo={"max_queue_ms": 1, "deadline_ms": 1})
    assert (c.slo.max_queue_ms, c.slo.deadline_ms) == (30000, None)
    c = _resolve(slo_class="batch", slo={"max_queue_ms": 60000})
    assert c.slo.max_queue_ms == 60000
    assert _resolve(slo={"max_queue_ms": 1}).slo.max_queue_ms is None  # chat sets none


def test_slo_rejections():
    with pytest.raises(ApiError) as ei:
        _resolve(headers={"x-slo-ttft-ms": "soon"})
    assert (ei.value.status, ei.value.param) == (400, "x-slo-ttft-ms")
    with pytest.raises(ApiError) as ei:
        _resolve(slo_class="gold")
    assert ei.value.status == 400
    with pytest.raises(ApiError) as ei:
        _resolve(tenant=Tenant("t", classes=("batch",)), slo_class="chat")
    assert ei.value.status == 403
    t = Tenant("t", classes=("chat",), on_forbidden_class="downgrade")
    c = _resolve(tenant=t, slo_class="interactive")
    assert (c.cls.name, c.degraded_from) == ("chat", "interactive")
    assert isinstance(c.slo, SLO)
