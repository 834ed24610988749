"""The OpenAI-compatible server against the official ``openai`` client on loopback:
completions and chat (streaming and not), usage, SLO fields, bad input, metrics,
client disconnects and many concurrent streams."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import numpy as np
import openai
import pytest
from conftest import VOCAB
from server_fixtures import (
    LiveServer,
    engine_config,
    model_pair,
    scrape,
    server_test_env,
    wait_for,
)

from adaserve.server import ServerConfig
from adaserve.server.metrics import VLLM_NAMES
from adaserve.text.tokenizer import DEFAULT_CHAT_TEMPLATE, load_tokenizer

MODEL = "target"

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, draft = model_pair(tmp_path_factory)
    # admission off: these tests are about the API (test_server_overload covers shedding)
    cfg = ServerConfig(max_body_bytes=1 << 20, admission=False)
    s = LiveServer(engine_config(target, draft), cfg)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    return load_tokenizer(target)


def _chunks_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


# ---------------------------------------------------------------------- happy paths


def test_completion_non_streaming_returns_text_usage_and_metrics(srv, tok):
    c = srv.client()
    r = c.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    ch = r.choices[0]
    assert ch.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(tok.encode("def add(a, b):"))
    assert 1 <= r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    m = r.model_extra["metrics"]
    for k in ("ttft_ms", "tpot_ms", "queue_ms", "slo_class", "slo_attained", "accepted_tokens"):
        assert k in m
    assert m["tree_nodes"] >= 0 and m["slo_class"] == "chat"
    assert ch.model_extra["metrics"] == m


def test_completion_streaming_equals_non_streaming(srv):
    c = srv.client()
    kw = dict(model=MODEL, prompt="import os\n", max_tokens=12, temperature=0)
    full = c.completions.create(**kw)
    text, chunks = _chunks_text(
        c.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and "metrics" in finals[0].model_extra


def test_sse_ends_with_done_and_usage_only_when_asked(srv):
    body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 3, "stream": True}
    with srv.http() as h:
        lines = [ln for ln in h.post("/v1/completions", json=body).text.split("\n") if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    assert not any('"usage"' in ln for ln in lines)


def test_chat_uses_default_template_and_streams(srv, tok):
    c = srv.client()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(msgs)))
    s = c.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_text_parts_and_token_id_prompts(srv):
    c = srv.client()
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=2,
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    r = c.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5


def test_models_and_health(srv):
    ms = srv.client().models.list()
    assert [m.id for m in ms.data] == [MODEL]
    with srv.http() as h:
        assert h.get("/health").json()["status"] == "ok"
        assert h.get("/openapi.json").json()["paths"]["/v1/chat/completions"]


# ---------------------------------------------------------------------- SLOs


def _m(resp) -> dict:
    return resp.model_extra["metrics"]


def test_slo_sources_and_precedence(srv):
    c = srv.client()
    slos = srv.state.loop.class_slos

    def ask(**kw):
        return _m(c.completions.create(model=MODEL, prompt="a", max_tokens=1, **kw))

    m = ask(extra_body={"slo_class": "batch"})
    assert m["slo_class"] == "batch" and m["tpot_target_ms"] == pytest.approx(slos["batch"].tpot_ms)
    # explicit loose targets keep the default class
    m = ask(extra_body={"slo": {"tpot_ms": 1e6, "ttft_ms": 5e5}})
    assert (m["slo_class"], m["tpot_target_ms"], m["ttft_target_ms"]) == ("chat", 1e6, 5e5)
    # gateway headers; the body wins over them
    m = ask(extra_headers={"x-slo-tpot-ms": "123456", "x-slo-ttft-ms": "99999"})
    assert (m["tpot_target_ms"], m["ttft_target_ms"]) == (123456, 99999)
    m = ask(extra_headers={"x-slo-tpot-ms": "123456"}, extra_body={"slo": {"tpot_ms": 1e6}})
    assert m["tpot_target_ms"] == 1e6
    # with no class named, a target stricter than any class picks the strictest class
    strict = 0.9 * slos["interactive"].tpot_ms
    m = ask(extra_body={"slo": {"tpot_ms": strict}})
    assert (m["slo_class"], m["tpot_target_ms"]) == ("interactive", pytest.approx(strict))
    # a named class stays; open mode honours targets stricter than the class's
    m = ask(extra_body={"slo_class": "batch", "slo": {"tpot_ms": 0.5}})
    assert (m["slo_class"], m["tpot_target_ms"]) == ("batch", 0.5)
    # vLLM priority and OpenAI service_tier map to classes; slo_class beats both
    assert ask(extra_body={"priority": 0})["slo_class"] == "interactive"
    assert ask(extra_body={"priority": 2})["slo_class"] == "batch"
    assert ask(extra_body={"service_tier": "flex"})["slo_class"] == "batch"
    assert ask(extra_body={"service_tier": "priority"})["slo_class"] == "interactive"
    assert ask(extra_body={"service_tier": "auto"})["slo_class"] == "chat"
    tiered = {"service_tier": "priority", "slo_class": "batch"}
    assert ask(extra_body=tiered)["slo_class"] == "batch"
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=1, service_tier="flex"
    )
    assert _m(chat)["slo_class"] == "batch" and chat.service_tier == "flex"
    assert ask(extra_body={"priority": 2, "slo_class": "chat"})["slo_class"] == "chat"


# ---------------------------------------------------------------------- bad input


def _err(resp: httpx.Response, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    e = resp.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    return e


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "temperature": 1e9}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ({"prompt": "x", "slo": {"tpot_ms": -5}}, 400, "slo.tpot_ms"),
    ({"prompt": "x", "slo": {"tpot_ms": "fast"}}, 400, "slo.tpot_ms"),
    ({"prompt": "x", "slo": {"tpot_ms": 10, "color": 1}}, 400, "slo.color"),
    ({"prompt": "x", "slo": {"ttft_ms": 0}}, 400, "slo.ttft_ms"),
    ({"prompt": "x", "slo_class": "platinum"}, 400, "slo_class"),
    ({"prompt": "x", "priority": 1.5}, 400, "priority"),
    ({"prompt": "x", "service_tier": "gold"}, 400, "service_tier"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, 400, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    # stop_token_ids are token ids: integers in [0, vocab)
    ({"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids[0]"),
    ({"prompt": "x", "stop_token_ids": [5, 2**70]}, 400, "stop_token_ids[1]"),
    ({"prompt": "x", "stop_token_ids": [5, VOCAB]}, 400, "stop_token_ids"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
def test_bad_completion_inputs_get_openai_errors(srv, body, status, param):
    with srv.http() as h:
        _err(h.post("/v1/completions", json={"model": MODEL, **body}), status, param)


BAD_CHAT = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": "hello"}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, 400, None),
    # tools without tool_choice mean "auto": no tool-call parser, so a clear 400
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        400,
        "tool_choice",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [VOCAB]},
        400,
        "stop_token_ids",
    ),
]


@pytest.mark.parametrize("body,status,param", BAD_CHAT)
def test_bad_chat_inputs_get_openai_errors(srv, body, status, param):
    with srv.http() as h:
        _err(h.post("/v1/chat/completions", json={"model": MODEL, **body}), status, param)


def test_malformed_bodies_and_headers(srv):
    with srv.http() as h:
        hdr = {"content-type": "application/json"}
        _err(h.post("/v1/completions", content=b'{"prompt": "x",', headers=hdr), 400)
        _err(h.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=hdr), 400)
        _err(h.post("/v1/completions", content=b"[1, 2]", headers=hdr), 400)
        _err(h.post("/v1/completions", content=b"", headers=hdr), 400)
        _err(h.post("/v1/completions", content=b"NaN", headers=hdr), 400)
        lone = b'{"model": "target", "prompt": "\\ud800"}'  # a lone surrogate
        _err(h.post("/v1/completions", content=lone, headers=hdr), 400, "prompt")
        deep = b"[" * 100000 + b"]" * 100000
        _err(h.post("/v1/completions", content=deep, headers=hdr), 400)
        big = json.dumps({"model": MODEL, "prompt": "a" * (2 << 20)})
        _err(h.post("/v1/completions", content=big, headers=hdr), 413)
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        for v in ("abc", "-1", "0", "nan", "inf"):
            _err(h.post("/v1/completions", json=body, headers={"x-slo-tpot-ms": v}), 400,
                 "x-slo-tpot-ms")  # fmt: skip
        _err(h.post("/v1/completions", json={**body, "model": "nope"}), 404, "model",
             "model_not_found")  # fmt: skip
        _err(h.get("/v1/nothing-here"), 404)
        _err(h.get("/v1/completions"), 405)


@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-slo-tpot-ms"])
def test_slo_headers_must_be_plain_decimal_numbers(srv, header):
    """``x-slo-ttft-ms: 1_000`` was read as 1000 (Python's float syntax)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    with srv.http() as h:
        for v in ("1_000", "1e3", "+5", "-5", "inf", "Infinity", "nan", "0x10", "5ms", "1e10",
                  "0", "."):  # fmt: skip
            _err(h.post("/v1/completions", json=body, headers={header: v}), 400, header,
                 "invalid_value")  # fmt: skip
        for v, want in (("120000", 120000), ("2500.5", 2500.5), (".5", 0.5), ("7.", 7)):
            r = h.post("/v1/completions", json=body, headers={header: v})
            assert r.status_code == 200, r.text
            key = header.removeprefix("x-slo-").replace("-ms", "_target_ms")
            assert r.json()["metrics"][key] == want


def test_model_is_the_served_id_not_the_checkpoint_path(srv):
    """The checkpoint's absolute path was accepted as ``model`` (confirming it)."""
    path = srv.state.loop.info.model_dir
    with srv.http() as h:
        body = {"model": path, "prompt": "x", "max_tokens": 1}
        _err(h.post("/v1/completions", json=body), 404, "model", "model_not_found")
        msgs = [{"role": "user", "content": "x"}]
        body = {"model": path, "messages": msgs, "max_tokens": 1}
        _err(h.post("/v1/chat/completions", json=body), 404, "model", "model_not_found")
        assert h.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                "max_tokens": 1}).status_code == 200  # fmt: skip


def test_head_health_answers_like_get(srv):
    """Load balancers probe with HEAD: it was 405."""
    with srv.http() as h:
        r = h.head("/health")
        assert r.status_code == 200 and r.content == b""
        assert h.get("/health").json()["status"] == "ok"


def _raw(srv, data: bytes) -> tuple[int, dict, bytes]:
    """Send raw bytes, read the whole answer: (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(data)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize(
    "data",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",  # NUL in a value
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n",  # space in a name
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
        b"NOT AN HTTP REQUEST\r\n\r\n",
    ],
)
def test_requests_uvicorn_cannot_parse_get_openai_json(srv, data):
    """Errors raised below the app (bad header bytes) were plain text."""
    status, headers, body = _raw(srv, data)
    assert status == 400 and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    e = json.loads(body)["error"]
    assert e["type"] == "invalid_request_error" and e["code"] == "invalid_http" and e["message"]
    # and the server goes on serving
    with srv.http() as h:
        assert h.get("/health").status_code == 200


def test_prompt_longer_than_context(srv, tok):
    long = " ".join(["word"] * 600)
    assert len(tok.encode(long)) > 512
    c = srv.client()
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model=MODEL, prompt=long, max_tokens=1)
    assert ei.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model=MODEL, prompt=[1 + i % 300 for i in range(600)], max_tokens=1)
    assert ei.value.body["code"] == "context_length_exceeded"


def test_bad_input_does_not_disturb_other_requests(srv):
    """A long streaming request keeps going, uncorrupted, while bad requests hammer
    the server."""
    c = srv.client()
    kw = dict(model=MODEL, prompt="class Foo:", max_tokens=24, temperature=0)
    expected = c.completions.create(**kw).choices[0].text
    out = {}

    def good():
        out["text"], out["chunks"] = _chunks_text(c.completions.create(stream=True, **kw))

    t = threading.Thread(target=good)
    t.start()
    with srv.http() as h:
        while t.is_alive():
            for body, status, _ in BAD_COMPLETIONS[:8]:
                assert (
                    h.post("/v1/completions", json={"model": MODEL, **body}).status_code == status
                )
            h.post("/v1/completions", content=b"{{{", headers={"content-type": "application/json"})
    t.join()
    assert out["text"] == expected


def test_extreme_but_valid_sampling_values_work(srv):
    """Values at the edge of the valid ranges (found by fuzzing: a top_p below float32
    resolution used to make every token's probability NaN and fail the engine step)."""
    c = srv.client()
    for extra in (
        {"top_p": 1e-300, "temperature": 1.0},
        {"temperature": 1e-300, "top_k": 2**31 - 1, "seed": 2**63 - 1},
        {"temperature": 100, "top_p": 1.0},
        # what vLLM's benchmark client sends (neutral vLLM extras, null logprobs)
        {"repetition_penalty": 1.0, "min_p": 0.0, "logprobs": None, "ignore_eos": True},
        {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 100},
    ):
        kw = {k: extra.pop(k) for k in ("top_p", "temperature", "seed") if k in extra}
        r = c.completions.create(model=MODEL, prompt="z", max_tokens=3, extra_body=extra, **kw)
        assert r.usage.completion_tokens >= 1


def test_penalties_reach_the_engine(srv, tmp_path_factory):
    """presence / frequency (OpenAI fields) and repetition (vLLM's extra) penalties: the
    server's greedy text (speculating) is the offline engine's with the same penalties
    (plain decoding), which is not the unpenalised text."""
    from adaserve import LLM, SamplingParams

    target, _ = model_pair(tmp_path_factory)
    pen = dict(presence_penalty=0.5, frequency_penalty=0.7)
    prompt = "The quick brown fox"  # a prompt whose greedy output penalties change
    r = srv.client().completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
        **pen,
    )
    llm = LLM(model=str(target), no_draft=True, policy="ar", kv_cache_bytes=8 << 20)

    def offline(**kw) -> str:
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)
        return llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].text

    want = offline(repetition_penalty=1.5, **pen)
    assert r.choices[0].text == want and want != offline()


# ---------------------------------------------------------------------- metrics


def test_metrics_parse_with_vllm_and_adaserve_names(srv):
    c = srv.client()
    c.completions.create(model=MODEL, prompt="y = 2", max_tokens=4, temperature=0)
    fams = scrape(srv.url)
    for name in VLLM_NAMES:  # a counter family with no samples yet parses without _total
        assert name in fams or name.removesuffix("_total") in fams, name
    for name in (
        "adaserve:slo_attainment",
        "adaserve:verification_tokens_total",
        "adaserve:fallback_iterations",
        "adaserve:shed_requests_total",
        "adaserve:slo_attained_requests_total",
    ):
        assert name in fams, name
    labels = {tuple(sorted(lab.items())) for lab, _ in fams["vllm:generation_tokens_total"]}
    assert labels == {(("model_name", MODEL),)}
    classes = {lab["slo_class"] for lab, _ in fams["adaserve:verification_tokens_total"]}
    assert classes == {"interactive", "chat", "batch"}
    # open mode (no keys): the per-tenant series are there for the anonymous tenant
    tenants = {lab["tenant"] for lab, _ in fams["adaserve:tenant_output_tokens_total"]}
    assert tenants == {"anonymous"} and "adaserve:charges_total" in fams
    (_, gen), = fams["vllm:generation_tokens_total"]  # fmt: skip
    (_, drafts), = fams["vllm:spec_decode_num_draft_tokens_total"]  # fmt: skip
    assert gen > 0 and drafts > 0  # spec-chain policy speculates
    counts = [v for lab, v in fams["vllm:e2e_request_latency_seconds_count"]]
    assert counts and counts[0] >= 1


# ---------------------------------------------------------------------- disconnect


def test_disconnect_mid_stream_frees_request_and_kv(srv):
    body = {
        "model": MODEL,
        "prompt": "def main():",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    seen = 0
    # steps of at least 20 ms (the server's step pacing), so that the 400 tokens cannot
    # all be made before this client has read three chunks (the tiny pair makes them in
    # a few hundred ms, which a client slowed by the busy machine can take)
    loop = srv.state.loop
    pace, loop.step_pace_ms = loop.step_pace_ms, (20.0, 0.0)
    try:
        with (
            httpx.Client(base_url=srv.url, timeout=60) as h,
            h.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen >= 3:
                    break
            assert loop.snapshot.running == 1
    finally:
        loop.step_pace_ms = pace
    # the connection is closed: the request and its KV go within an iteration or so

    def freed():
        s = scrape(srv.url)
        return (
            s["vllm:num_requests_running"][0][1] == 0 and s["vllm:kv_cache_usage_perc"][0][1] == 0
        )

    assert wait_for(freed, timeout=5.0)
    rep = srv.http().get("/v1/slo/report").json()
    assert rep["classes"]["chat"]["finish_reasons"].get("client_disconnected", 0) >= 1
    fams = scrape(srv.url)
    assert any(
        lab["finish_reason"] == "client_disconnected"
        for lab, _ in fams["adaserve:requests_finished_total"]
    )


def test_disconnect_while_waiting_for_non_streaming_answer(srv):
    before = srv.http().get("/v1/slo/report").json()["classes"]["chat"]["finish_reasons"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=0.3)

    def freed():
        s = srv.state.loop.snapshot
        return s.running == 0 and s.waiting == 0 and s.kv_usage == 0

    assert wait_for(freed, timeout=5.0)
    after = srv.http().get("/v1/slo/report").json()["classes"]["chat"]["finish_reasons"]
    assert after["client_disconnected"] == before.get("client_disconnected", 0) + 1


# ---------------------------------------------------------------------- concurrency


def test_many_concurrent_streams_match_one_by_one(srv):
    n = 64
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(n)]
    kw = dict(model=MODEL, max_tokens=6, temperature=0, ignore_eos=True)

    async def one(client, p):
        stream = await client.completions.create(
            prompt=p, stream=True, stream_options={"include_usage": True}, **_body(kw)
        )
        text, usage, reasons = "", None, []
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
                if ch.choices[0].finish_reason:
                    reasons.append(ch.choices[0].finish_reason)
            if ch.usage:
                usage = ch.usage
        return text, usage.completion_tokens, reasons

    async def all_at_once():
        async with srv.async_client(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(all_at_once())
    c = srv.client()
    for p, (text, ntok, reasons) in zip(prompts, results):
        ref = c.completions.create(prompt=p, **_body(kw))
        assert reasons == ["length"] and ntok == 6
        assert text == ref.choices[0].text


def _body(kw: dict) -> dict:
    """Split adaserve extensions into extra_body for the openai client."""
    kw = dict(kw)
    extra = {k: kw.pop(k) for k in ("ignore_eos", "slo", "slo_class", "priority") if k in kw}
    if extra:
        kw["extra_body"] = extra
    return kw


def test_percentiles_use_numpy_linear():
    # pins the convention docs/server.md documents for /v1/slo/report
    from adaserve.server.report import _pcts

    v = [1.0, 2.0, 3.0, 10.0]
    assert _pcts(v)["p95"] == pytest.approx(float(np.percentile(v, 95)))


def _streamed_logprobs(client, kw: dict) -> tuple[list, list]:
    """(tokens, token_logprobs) of a streamed completion, its chunks' logprobs joined."""
    parts = [
        ch.choices[0].logprobs
        for ch in client.completions.create(stream=True, **kw)
        if ch.choices and ch.choices[0].logprobs
    ]
    return sum((x.tokens for x in parts), []), sum((x.token_logprobs for x in parts), [])


def test_logprobs_through_the_openai_client(srv, tok, tmp_path_factory):
    """``logprobs`` (completions) and ``logprobs``/``top_logprobs`` (chat), streaming or
    not: the target's log-probabilities of the generated tokens, the same as the Python
    API computes with plain decoding."""
    from adaserve import LLM, SamplingParams

    c = srv.client()
    prompt = "def add(a, b):"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    r = c.completions.create(**kw)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n
    for v, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) <= 3
        # greedy: the top token (tokens that decode alike share one key of the dict)
        assert v >= max(top.values()) - 1e-6
    target, _ = model_pair(tmp_path_factory)
    llm = LLM(model=str(target), no_draft=True, policy="ar", kv_cache_bytes=16 << 20)
    ref = llm.generate(
        [tok.encode(prompt)], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    )[0]
    ref = ref.outputs[0]  # vLLM's shape: per position, token id -> Logprob
    assert [tok.decode([t]) for t in ref.token_ids] == lp.tokens
    taken = [pos[t].logprob for t, pos in zip(ref.token_ids, ref.logprobs)]
    assert np.allclose(taken, lp.token_logprobs, atol=1e-4)
    tokens, got = _streamed_logprobs(c, kw)
    assert tokens == lp.tokens
    assert np.allclose(got, lp.token_logprobs, atol=1e-4)
    # echo + logprobs: the prompt's tokens scored too (the first has none), as OpenAI's
    score = dict(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    scored = c.completions.create(**score)
    slp = scored.choices[0].logprobs
    ids = tok.encode(prompt)
    assert len(slp.tokens) == len(ids) + 1 and slp.token_logprobs[0] is None
    assert slp.top_logprobs[0] is None
    pref = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))[0]
    want = [pos[t].logprob for t, pos in zip(ids[1:], pref.prompt_logprobs[1:])]
    assert np.allclose(slp.token_logprobs[1 : len(ids)], want, atol=1e-4)
    assert slp.text_offset == sorted(slp.text_offset)
    tokens, got = _streamed_logprobs(c, score)
    assert tokens == slp.tokens
    assert got[0] is None and np.allclose(got[1:], slp.token_logprobs[1:], atol=1e-4)
    # max_tokens=0 with echo (OpenAI's scoring form): the prompt alone, scored
    only = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    olp = only.choices[0].logprobs
    assert only.usage.completion_tokens == 0 and len(olp.tokens) == len(ids)
    assert only.choices[0].text == tok.decode(ids)
    assert np.allclose(olp.token_logprobs[1:], want, atol=1e-4)
    msgs = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for t in content:
        assert bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 2
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6)
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None
