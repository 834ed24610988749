"""Prefix caching over real HTTP with the official client: ``usage.prompt_tokens_details
.cached_tokens``, tenant isolation (and sharing on purpose), ``cache_salt``, vLLM's
metrics, the report and ``POST /reset_prefix_cache``."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
from server_fixtures import LiveServer, engine_config, model_pair, scrape, server_test_env

from adaserve.server import ServerConfig, parse_config
from adaserve.server.cli import add_arguments, build_configs
from adaserve.server.config import tomllib

CONFIG = """
[server]
model_name = "tiny"

[tenants.alpha]
keys = ["sk-alpha-secret"]

[tenants.beta]
keys = ["sk-beta-secret"]

[tenants.gamma]
keys = ["sk-gamma-secret"]
prefix_cache_group = "public"

[tenants.delta]
keys = ["sk-delta-secret"]
prefix_cache_group = "public"

[tenants.ops]
keys = ["sk-ops-secret"]
admin = true
"""

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, draft = model_pair(tmp_path_factory)
    s = LiveServer(engine_config(target, draft), parse_config(tomllib.loads(CONFIG)))
    yield s
    s.stop()


def _prompt(seed: int, n: int = 80) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


def _cached(srv, key: str, prompt, **extra) -> int:
    r = srv.client(key).completions.create(
        model="tiny", prompt=prompt, max_tokens=3, extra_body=extra or None
    )
    assert r.usage.prompt_tokens == len(prompt)
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_hits_its_own_prefix_and_no_one_elses(srv):
    p = _prompt(1)
    full = (len(p) - 1) // 16 * 16
    assert _cached(srv, "sk-alpha-secret", p) == 0
    assert _cached(srv, "sk-alpha-secret", p) == full
    assert _cached(srv, "sk-beta-secret", p) == 0  # another tenant: its own blocks
    assert _cached(srv, "sk-beta-secret", p + [5, 6, 7]) == (len(p) + 2) // 16 * 16
    # a salt of its own: a fresh prefix within the tenant
    assert _cached(srv, "sk-alpha-secret", p, cache_salt="doc-1") == 0
    assert _cached(srv, "sk-alpha-secret", p, cache_salt="doc-1") == full


def test_tenants_of_one_group_share_on_purpose(srv):
    p = _prompt(2)
    assert _cached(srv, "sk-gamma-secret", p) == 0
    assert _cached(srv, "sk-delta-secret", p) == (len(p) - 1) // 16 * 16
    assert _cached(srv, "sk-alpha-secret", p) == 0


def test_streaming_and_chat_report_cached_tokens(srv):
    c = srv.client("sk-alpha-secret")
    msgs = [
        {"role": "system", "content": "You are terse. " * 30},
        {"role": "user", "content": "hi"},
    ]
    first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    second = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < hit < second.usage.prompt_tokens and hit % 16 == 0
    stream = c.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [ch.usage for ch in stream if ch.usage is not None]
    assert usage and usage[-1].prompt_tokens_details.cached_tokens == hit


def test_a_bad_cache_salt_is_a_400(srv):
    c = srv.client("sk-alpha-secret")
    for bad in ("", 7, ["x"]):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(
                model="tiny", prompt="x", max_tokens=1, extra_body={"cache_salt": bad}
            )
        assert "cache_salt" in str(e.value)


def test_metrics_report_and_reset(srv):
    p = _prompt(3)
    _cached(srv, "sk-alpha-secret", p)
    assert _cached(srv, "sk-alpha-secret", p) > 0
    m = scrape(srv.url)
    q, h = m["vllm:prefix_cache_queries_total"][0][1], m["vllm:prefix_cache_hits_total"][0][1]
    assert q >= h > 0
    assert m["vllm:prompt_tokens_cached_total"][0][1] == h
    by_class = {lab["slo_class"]: v for lab, v in m["adaserve:prefix_cache_hits_by_class_total"]}
    assert sum(by_class.values()) == h
    info = m["vllm:cache_config_info"][0][0]
    assert info["enable_prefix_caching"] == "True"
    rep = httpx.get(
        srv.url + "/v1/slo/report", headers={"Authorization": "Bearer sk-ops-secret"}
    ).json()
    pc = rep["engine"]["prefix_cache"]
    assert pc["cached_tokens"] == h and pc["queried_tokens"] == q and 0 < pc["hit_rate"] <= 1
    assert sum(c["cached_tokens"] for c in pc["by_class"].values()) == h
    with srv.http() as x:
        assert x.post("/reset_prefix_cache").status_code == 401
        r = x.post("/reset_prefix_cache", headers={"Authorization": "Bearer sk-alpha-secret"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
        r = x.post("/reset_prefix_cache", headers={"Authorization": "Bearer sk-ops-secret"})
        assert r.status_code == 200 and r.json()["blocks_forgotten"] > 0
    assert _cached(srv, "sk-alpha-secret", p) == 0


def test_the_flags_switch_it(tmp_path_factory):
    import argparse

    def parse(*argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return build_configs(p.parse_args(list(argv)))[0]

    target, _ = model_pair(tmp_path_factory)
    assert parse("--model", str(target)).enable_prefix_caching
    off = parse("--model", str(target), "--no-enable-prefix-caching")
    assert not off.enable_prefix_caching
    slo = parse("--model", str(target), "--prefix-cache-eviction", "slo")
    assert slo.prefix_cache_eviction == "slo"


def test_the_dashboard_shows_hits_by_class(tmp_path_factory, browser):
    from selenium.webdriver.common.by import By
    from server_fixtures import wait_for

    target, draft = model_pair(tmp_path_factory)
    # open mode: the dashboard needs no key
    s = LiveServer(engine_config(target, draft), ServerConfig(model_name="tiny"))
    try:
        p = _prompt(9)
        assert _cached(s, "none", p) == 0 and _cached(s, "none", p) > 0
        browser.get(s.url + "/dashboard")

        def note():
            return browser.find_element(By.ID, "prefix-note").text

        assert wait_for(lambda: "prompt tokens cached" in note(), 30), browser.page_source[:2000]
        assert "chat" in note() and "computed" in note()
    finally:
        s.stop()
