"""Issue 22 findings 3 and 5, over real HTTP with the official client: the
tokens-per-minute quota bounds output (reserved at admission, refunded at the end), and
a request the scheduler degrades is billed and reported at the class it was served in."""

from __future__ import annotations

import time

import openai
import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env, wait_for

from adaserve.server import parse_config
from adaserve.server.config import Tenant, tomllib
from adaserve.server.errors import ApiError
from adaserve.server.quotas import QuotaBook

QUOTA = 100

CONFIG = f"""
[server]
model_name = "tiny"
step_delay_s = 0.01

[tenants.small]
keys = ["sk-small-secret"]
tokens_per_minute = {QUOTA}

[tenants.nomax]
keys = ["sk-nomax-secret"]
tokens_per_minute = 30

[tenants.aborts]
keys = ["sk-aborts-secret"]
tokens_per_minute = {QUOTA}

[tenants.refused]
keys = ["sk-refused-secret"]
tokens_per_minute = {QUOTA}

[tenants.ops]
keys = ["sk-ops-secret"]
admin = true
"""

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    s = LiveServer(engine_config(target), parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


def _usage(srv, tenant: str) -> dict:
    rep = srv.client("sk-ops-secret").get("/slo/report", cast_to=object)
    return rep["tenants"].get(tenant, {}).get("total", {"completion_tokens": 0, "requests": 0})


# ---------------------------------------------------------------------- finding 3


def test_tokens_quota_bounds_the_output_of_one_request(srv):
    """A tenant allowed 100 tokens/min got 1,600 tokens from one n=16 request: the
    output was charged only when it finished. Now every choice's max_tokens is reserved
    at admission, so a request that cannot fit is refused and nothing is produced. One
    over the whole quota can never fit (issue 32): a 400 without Retry-After, not a 429
    to retry."""
    c = srv.client("sk-small-secret")
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(
            model="tiny", prompt="hi", n=16, max_tokens=100, extra_body={"ignore_eos": True}
        )
    body = ei.value.body
    assert body["reason"] == "tokens_per_minute" and body["code"] == "exceeds_quota"
    assert body["type"] == "invalid_request_error" and "max_tokens" in body["message"]
    assert "retry-after" not in ei.value.response.headers
    assert _usage(srv, "small")["completion_tokens"] == 0


def test_second_request_refused_while_the_first_streams(srv):
    """A second request was admitted while the first stream had produced >= 457 tokens:
    the reservation of the first is taken up front, so the second is refused while the
    first is still streaming, and the minute's output stays within the quota."""
    c = srv.client("sk-small-secret")
    # prompt + 4 x 20 reserved: fits 100
    stream = c.completions.create(
        model="tiny",
        prompt="hi",
        n=4,
        max_tokens=20,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it)  # streaming has started
    with pytest.raises(openai.RateLimitError) as ei:
        c.completions.create(model="tiny", prompt="hi", max_tokens=30)  # 19 left
    assert ei.value.body["reason"] == "tokens_per_minute"
    done = [ch for ch in it if ch.choices and ch.choices[0].finish_reason]
    assert len(done) == 4
    assert wait_for(lambda: _usage(srv, "small")["requests"] == 4)
    assert _usage(srv, "small")["completion_tokens"] == 80 <= QUOTA


def test_default_max_tokens_shrinks_to_the_budget_left(srv):
    """Without max_tokens a chat request runs to the end of the context; with a quota of
    30 tokens/min its output is bounded by what the tenant has left."""
    c = srv.client("sk-nomax-secret")
    r = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens <= 30 + 1  # + refill
    with pytest.raises(openai.RateLimitError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_unused_reservation_is_given_back(srv):
    """A stream the client abandons gives back the part of max_tokens it never used."""
    c = srv.client("sk-aborts-secret")
    stream = c.completions.create(
        model="tiny", prompt="hi", max_tokens=80, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    next(it)
    stream.close()
    assert wait_for(lambda: _usage(srv, "aborts")["requests"] == 1)
    produced = _usage(srv, "aborts")["completion_tokens"]
    assert produced < 80
    level = srv.state.quotas.tokens_available("aborts")
    # what is gone is the prompt and what was produced (plus nothing reserved)
    assert QUOTA - level <= 5 + produced
    c.completions.create(model="tiny", prompt="hi", max_tokens=40)  # fits again


def test_reservation_of_a_refused_submission_is_given_back(srv, monkeypatch):
    """A request the engine refuses (here: its queue is full) never finishes, so it
    gives back its output reservation when it is refused."""
    q = srv.state.quotas
    monkeypatch.setattr(srv.state.loop, "max_waiting", 0)
    with pytest.raises(openai.RateLimitError) as ei:
        srv.client("sk-refused-secret").completions.create(model="tiny", prompt="hi", max_tokens=60)
    assert ei.value.body["reason"] == "queue_full"
    assert q.tokens_available("refused") >= QUOTA - 5  # only the prompt is gone


def test_quota_book_reserves_and_settles():
    now = [0.0]
    t = Tenant("t", tokens_per_minute=60)
    q = QuotaBook((t,), clock=lambda: now[0])
    assert q.admit(t, 10, [20, 20]) == [20, 20]
    assert q.tokens_available("t") == 10
    with pytest.raises(ApiError) as ei:
        q.admit(t, 5, [10])
    assert ei.value.status == 429 and ei.value.reason == "tokens_per_minute"
    q.settle("t", 20, 5)  # one choice stopped after 5 tokens
    q.settle("t", 20, 20)
    assert q.tokens_available("t") == 25
    assert q.admit(t, 5, [100], fit=True) == [20]  # no max_tokens: what is left
    q.refund("t", 20)  # never reached the engine
    assert q.tokens_available("t") == 20
    with pytest.raises(ApiError) as ei:
        q.admit(t, 1, [30] * 3)  # 91 > 60 can never fit: 400, nothing to wait for
    assert (ei.value.status, ei.value.code, ei.value.headers) == (400, "exceeds_quota", {})
    now[0] += 60
    assert q.tokens_available("t") == 60


# ---------------------------------------------------------------------- finding 5

DEGRADE_CONFIG = """
[server]
model_name = "tiny"
default_class = "interactive"

[classes.interactive]
tpot_ms = 0.001
rank = 1  # not the strictest rank: admission control would refuse it outright
degrade_to = "chat"
price_per_1k = 4.0

[classes.chat]
tpot_ms = 100000.0
rank = 2
price_per_1k = 1.0
"""


@pytest.fixture(scope="module")
def degrading(tmp_path_factory):
    target, draft = model_pair(tmp_path_factory)
    ecfg = engine_config(target, draft, policy="adaserve:degrade=1:degrade_after=1")
    s = LiveServer(ecfg, parse_config(tomllib.loads(DEGRADE_CONFIG)))
    yield s
    s.stop()


def test_degraded_requests_billed_and_reported_as_delivered(degrading):
    """Degraded requests were billed at the class they asked for, and the report showed
    degraded_in: 0 while every interactive request was degraded: bill and report what was
    delivered."""
    c = degrading.client()
    rs = [
        c.completions.create(
            model="tiny", prompt="hello there", max_tokens=12, extra_body={"ignore_eos": True}
        )
        for _ in range(3)
    ]
    for r in rs:
        m = r.model_extra["metrics"]
        assert (m["slo_class"], m["degraded_from"]) == ("chat", "interactive")
        assert m["charge"] == pytest.approx(r.usage.completion_tokens * 1.0 / 1000)
    time.sleep(0.1)
    rep = c.get("/slo/report", cast_to=object)
    cls = rep["classes"]
    assert cls["chat"]["requests"] == 3 and cls["chat"]["degraded_in"] == 3
    assert cls["interactive"]["requests"] == 0 and cls["interactive"]["degraded_out"] == 3
    usage = rep["tenants"]["anonymous"]["classes"]
    assert "interactive" not in usage
    tokens = sum(r.usage.completion_tokens for r in rs)
    assert usage["chat"]["completion_tokens"] == tokens and usage["chat"]["degraded"] == 3
    assert usage["chat"]["charge"] == pytest.approx(tokens * 1.0 / 1000)
