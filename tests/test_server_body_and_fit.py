"""Issue 32 item 6 (the rest): a JSON body must be UTF-8 (a UTF-16/32 one is 400
``invalid_encoding``), and a request that can never fit is a 400, not a 429 to retry:
prompt + max_tokens larger than the KV cache (``kv_cache_exceeded``; it used to
preempt itself for ever) or than the tenant's whole tokens-per-minute quota
(``exceeds_quota``). Over real HTTP with httpx and the official client."""

from __future__ import annotations

import codecs
import json

import openai
import pytest
from server_fixtures import (
    LiveServer,
    engine_config,
    model_pair,
    server_test_env,
    templated_target,
)

from adaserve.server import parse_config
from adaserve.server.config import tomllib

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)

KV_BYTES = 200_000  # the tiny pair's pool: 24 blocks of 16 tokens = 384 tokens
TPM = 50

CONFIG = f"""
[server]
model_name = "tiny"

[tenants.small]
keys = ["sk-small-secret"]
tokens_per_minute = {TPM}

[tenants.big]
keys = ["sk-big-secret"]
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = LiveServer(engine_config(templated_target(tmp_path_factory), kv_cache_bytes=KV_BYTES))
    yield s
    s.stop()


@pytest.fixture
def fresh(tmp_path_factory):
    """A server of its own (a request that preempts itself for ever, as one did before
    the fix, would stall every test after it) with tenants and the small KV pool."""
    target, _ = model_pair(tmp_path_factory)
    s = LiveServer(
        engine_config(target, kv_cache_bytes=KV_BYTES), parse_config(tomllib.loads(CONFIG))
    )
    yield s
    s.stop()


# ---------------------------------------------------------------------- encoding

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
}
JSON_CT = {"content-type": "application/json"}
NOT_UTF8 = {
    "utf-16-le": lambda t: t.encode("utf-16-le"),
    "utf-16-be-bom": lambda t: codecs.BOM_UTF16_BE + t.encode("utf-16-be"),
    "utf-16-le-bom": lambda t: codecs.BOM_UTF16_LE + t.encode("utf-16-le"),
    "utf-32": lambda t: t.encode("utf-32"),  # with its BOM
    "utf-32-be": lambda t: t.encode("utf-32-be"),
    "utf-32-le": lambda t: t.encode("utf-32-le"),
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("enc", list(NOT_UTF8))
def test_utf16_or_utf32_body_is_400(srv, path, enc):
    text = json.dumps({"model": "target", **BODIES[path]})
    with srv.http() as h:
        r = h.post(path, content=NOT_UTF8[enc](text), headers=JSON_CT)
        assert r.status_code == 400, (enc, r.status_code, r.text[:200])
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert err["code"] == "invalid_encoding" and err["type"] == "invalid_request_error"
        assert "UTF-8" in err["message"]
        # the connection stays usable: the whole body was read
        ok = h.post(path, content=text.encode(), headers=JSON_CT)
        assert ok.status_code == 200, ok.text[:300]


@pytest.mark.parametrize(
    "content_type", [None, "application/json; charset=utf-16", "application/vnd.x+json"]
)
def test_utf16_refused_whatever_the_json_content_type_says(srv, content_type):
    text = json.dumps({"model": "target", "prompt": "hello", "max_tokens": 2})
    headers = {"content-type": content_type} if content_type else {}
    with srv.http() as h:
        r = h.post("/v1/completions", content=text.encode("utf-16"), headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding"


@pytest.mark.parametrize("bom", [b"", codecs.BOM_UTF8], ids=["utf-8", "utf-8-bom"])
@pytest.mark.parametrize("path", list(BODIES))
def test_utf8_body_is_served(srv, path, bom):
    """UTF-8, non-ASCII text included; a UTF-8 byte order mark is ignored (RFC 8259
    allows a parser to, and vLLM does)."""
    body = {"model": "target", **BODIES[path]}
    if "prompt" in body:
        body["prompt"] = "h\u00e9llo \u4e16\u754c"
    with srv.http() as h:
        r = h.post(
            path, content=bom + json.dumps(body, ensure_ascii=False).encode(), headers=JSON_CT
        )
        assert r.status_code == 200, r.text[:300]


# ---------------------------------------------------------------------- never fits


def _pool(s) -> int:
    info = s.state.loop.info
    return info.kv_blocks * info.block_size


def test_request_that_can_never_fit_the_kv_cache_is_400(fresh):
    pool = _pool(fresh)
    assert pool == 384  # the figures below assume it
    c = fresh.client("sk-big-secret", timeout=30)
    n_prompt = c.completions.create(model="tiny", prompt="hello world", max_tokens=1)
    n_prompt = n_prompt.usage.prompt_tokens
    most = pool - n_prompt + 1  # the last decode holds the prompt and all but one output
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(
            model="tiny", prompt="hello world", max_tokens=most + 1, extra_body={"ignore_eos": True}
        )
    body = ei.value.body
    assert body["code"] == "kv_cache_exceeded" and body["param"] == "max_tokens"
    assert str(most) in body["message"]
    assert "retry-after" not in ei.value.response.headers
    # the largest that fits is served in full
    r = c.completions.create(
        model="tiny", prompt="hello world", max_tokens=most, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == most and r.choices[0].finish_reason == "length"
    # a request that does not fit beside another now (n=2: 2 x 207 slots > 384) is not
    # refused: its choices take turns
    r = c.completions.create(
        model="tiny", prompt="hello world", n=2, max_tokens=200, extra_body={"ignore_eos": True}
    )
    assert [ch.finish_reason for ch in r.choices] == ["length", "length"]
    assert r.usage.completion_tokens == 400


def test_without_max_tokens_the_budget_is_what_the_kv_cache_holds(fresh):
    """A chat request without max_tokens runs to the end of the context (512 tokens),
    which would never fit the 384-token pool: the budget is capped at what the pool
    holds, and the request is served."""
    c = fresh.client("sk-big-secret", timeout=30)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens - 1 == _pool(fresh)


def test_request_over_the_whole_tokens_quota_is_400(fresh):
    c = fresh.client("sk-small-secret", timeout=30)
    # over the whole quota (50 a minute): it can never be admitted, waiting cannot help
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model="tiny", prompt="hi", n=2, max_tokens=30)
    body = ei.value.body
    assert body["code"] == "exceeds_quota" and body["reason"] == "tokens_per_minute"
    assert body["type"] == "invalid_request_error" and f"{TPM} tokens per minute" in body["message"]
    assert "retry-after" not in ei.value.response.headers
    with pytest.raises(openai.BadRequestError) as ei:  # a prompt alone over it
        c.completions.create(model="tiny", prompt="hello world, " * 20, max_tokens=1)
    assert ei.value.body["code"] == "exceeds_quota"
    # within the quota but over what is left: a 429 to retry, as before
    r = c.completions.create(
        model="tiny", prompt="hi", max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 40
    with pytest.raises(openai.RateLimitError) as ei:
        c.completions.create(model="tiny", prompt="hi", max_tokens=30)
    assert ei.value.body["code"] == "rate_limit_exceeded"
    assert int(ei.value.response.headers["retry-after"]) >= 1


def test_engine_refuses_what_its_kv_cache_can_never_hold(tmp_path_factory):
    """The engine's own check (any caller, the offline API included): a request that
    would preempt itself for ever is an InvalidRequestError at once."""
    from adaserve import LLM, SamplingParams
    from adaserve.errors import InvalidRequestError

    target, _ = model_pair(tmp_path_factory)
    llm = LLM(model=str(target), no_draft=True, policy="ar", kv_cache_bytes=KV_BYTES)
    ids = [5, 6, 7, 8]
    with pytest.raises(InvalidRequestError) as ei:
        llm.generate(
            [ids], SamplingParams(temperature=0.0, max_tokens=382, ignore_eos=True), use_tqdm=False
        )
    assert ei.value.param == "max_tokens"
    out = llm.generate(
        [ids], SamplingParams(temperature=0.0, max_tokens=381, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 381
