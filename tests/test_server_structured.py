"""Structured outputs and tool calls over real HTTP with the official ``openai`` client,
on the shipped pair served with speculation (the adaserve policy and its draft).

- every response format and ``structured_outputs`` kind, streamed and not, on both
  endpoints; vLLM's deprecated ``guided_*`` aliases;
- 200 sampled outputs over 10 schemas of different shapes: 100% valid (jsonschema);
- tool calls: a named function and "required" (100% valid arguments, streamed deltas
  that join into the same calls), "auto" with each parser, parallel_tool_calls;
- bad schemas and grammars are 400s that name the problem;
- a grammar that takes long to compile delays no other request: they finish while it
  is held, and the engine keeps stepping;
- compile and mask time in /metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import jsonschema
import openai
import pytest
from server_fixtures import LiveServer, scrape, server_test_env
from structured_schemas import SCHEMAS, _s

from adaserve.config import EngineConfig
from adaserve.server import ServerConfig
from adaserve.util.paths import DEFAULT_TARGET

pytestmark = pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
_env = pytest.fixture(scope="module", autouse=True)(server_test_env)
MODEL = "adaserve"
MSGS = [{"role": "user", "content": "Give me the record."}]


@pytest.fixture(scope="module")
def srv(profile_file):
    s = LiveServer(
        EngineConfig(profile=profile_file, kv_cache_bytes=64 << 20),
        ServerConfig(admission=False, enable_auto_tool_choice=True, tool_call_parser="hermes"),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return srv.client()


def _valid_json(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _chat(client, stream=False, **kw):
    """(text, finish_reason) of one chat completion, streamed or not."""
    kw.setdefault("max_tokens", 300)
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=MSGS, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, fr = "", None
    for ch in client.chat.completions.create(model=MODEL, messages=MSGS, stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            fr = ch.choices[0].finish_reason or fr
    return text, fr


def _completion(client, stream=False, **kw):
    kw.setdefault("max_tokens", 300)
    if not stream:
        r = client.completions.create(model=MODEL, prompt="record:", **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, fr = "", None
    for ch in client.completions.create(model=MODEL, prompt="record:", stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].text or ""
            fr = ch.choices[0].finish_reason or fr
    return text, fr


KINDS = [
    ("json", {"json": SCHEMAS[0]}, lambda t: _valid_json(t, SCHEMAS[0])),
    (
        "regex",
        {"regex": r"[A-Z][a-z]{1,6}-[0-9]{2,4}"},
        lambda t: re.fullmatch(r"[A-Z][a-z]{1,6}-[0-9]{2,4}", t),
    ),
    (
        "choice",
        {"choice": ["alpha", "beta", "gamma ray"]},
        lambda t: t in ("alpha", "beta", "gamma ray"),
    ),
    (
        "grammar-gbnf",
        {"grammar": 'root ::= "x=" [0-9]{1,3} (";" "x=" [0-9]{1,3}){0,2}'},
        lambda t: re.fullmatch(r"x=[0-9]{1,3}(;x=[0-9]{1,3}){0,2}", t),
    ),
    (
        "grammar-lark",
        {"grammar": 'start: "v" /[0-9]{1,2}/ ("." /[0-9]{1,2}/)?'},
        lambda t: re.fullmatch(r"v[0-9]{1,2}(\.[0-9]{1,2})?", t),
    ),
    ("json_object", {"json_object": True}, None),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("kind, so, check", KINDS, ids=[k[0] for k in KINDS])
def test_structured_outputs_kinds_on_both_endpoints(client, endpoint, stream, kind, so, check):
    call = _chat if endpoint == "chat" else _completion
    max_tokens = 40 if kind == "json_object" else 300
    for seed in (1, 2):
        text, fr = call(
            client, stream, temperature=1.0, seed=seed, max_tokens=max_tokens,
            extra_body={"structured_outputs": so},
        )  # fmt: skip
        if check is None:  # any JSON object: valid once it is finished
            if fr == "stop":
                assert isinstance(json.loads(text), dict), text
            else:
                assert text.startswith("{"), text
            continue
        assert fr == "stop" and check(text), (text, fr)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_json_object(client, stream):
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "rec", "schema": SCHEMAS[1], "strict": True},
    }
    text, fr = _chat(client, stream, temperature=1.0, seed=3, response_format=rf)
    assert fr == "stop" and _valid_json(text, SCHEMAS[1]), text
    text, fr = _chat(
        client, stream, temperature=0, response_format={"type": "json_object"}, max_tokens=30
    )
    assert text.startswith("{")
    text, _ = _chat(client, stream, temperature=0, response_format={"type": "text"}, max_tokens=4)
    assert isinstance(text, str)


def test_response_format_on_completions(client):
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=300, temperature=1.0, seed=4,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMAS[2]}}},
    )  # fmt: skip
    assert _valid_json(r.choices[0].text, SCHEMAS[2]), r.choices[0].text


def test_two_hundred_sampled_outputs_over_ten_schemas_are_all_valid(srv):
    """10 schemas x 20 sampled choices (n=20, temperature 1), all sent at once."""

    async def run():
        c = srv.async_client(timeout=600)
        rf = [
            {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}}
            for i, s in enumerate(SCHEMAS)
        ]
        rs = await asyncio.gather(
            *(
                c.chat.completions.create(
                    model=MODEL,
                    messages=MSGS,
                    n=20,
                    temperature=1.0,
                    max_tokens=600,
                    response_format=f,
                    seed=100 + i,
                )  # fmt: skip
                for i, f in enumerate(rf)
            )
        )
        await c.close()
        return rs

    rs = asyncio.run(run())
    total = bad = 0
    for schema, r in zip(SCHEMAS, rs):
        for ch in r.choices:
            total += 1
            if ch.finish_reason != "stop" or not _valid_json(ch.message.content, schema):
                bad += 1
                print("invalid:", ch.finish_reason, repr(ch.message.content[:200]))
    assert total == 200 and bad == 0, f"{bad} of {total} invalid"


def test_guided_aliases_are_accepted_with_a_deprecation_warning(client, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="adaserve.server"):
        text, fr = _completion(client, extra_body={"guided_choice": ["left", "right"]})
        assert text in ("left", "right") and fr == "stop"
        text, _ = _completion(client, extra_body={"guided_regex": "[0-9]{3}"})
        assert re.fullmatch("[0-9]{3}", text)
        text, _ = _chat(client, temperature=1.0, seed=5, extra_body={"guided_json": SCHEMAS[6]})
        assert _valid_json(text, SCHEMAS[6])
        text, _ = _completion(client, extra_body={"guided_grammar": 'root ::= "ab" | "cd"'})
        assert text in ("ab", "cd")
    warned = " ".join(caplog.messages)
    for name in ("guided_choice", "guided_regex", "guided_json", "guided_grammar"):
        assert f"{name} is deprecated" in warned


@pytest.mark.parametrize(
    "extra, what, param",
    [
        (
            {"structured_outputs": {"json": {"type": "objectx"}}},
            "invalid JSON schema",
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "invalid regex", "structured_outputs"),
        (
            {"structured_outputs": {"grammar": "start: nowhere"}},
            "invalid grammar",
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"grammar": "root ::= undefined"}},
            "invalid grammar",
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "exactly one of",
            "structured_outputs",
        ),
        ({"structured_outputs": {"choice": []}}, "must not be empty", "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "unknown field", "structured_outputs"),
        ({"structured_outputs": "json"}, "", "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]},
            "ask for one output constraint",
            "guided_choice",
        ),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema", "response_format"),
        ({"response_format": {"type": "xml"}}, "", "response_format"),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_constraints_are_400s_that_name_the_problem(client, endpoint, extra, what, param):
    call = _chat if endpoint == "chat" else _completion
    with pytest.raises(openai.BadRequestError) as e:
        call(client, max_tokens=4, extra_body=extra)
    body = e.value.body
    assert what in body["message"] and body["param"].startswith(param), body


# ---------------------------------------------------------------------- tools
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": _s(12), "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -99, "maximum": 99},
                    "b": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _calls_valid(calls) -> bool:
    return bool(calls) and all(
        c.function.name in SCHEMA_OF and _valid_json(c.function.arguments, SCHEMA_OF[c.function.name])
        and c.id.startswith("chatcmpl-tool-")
        for c in calls
    )  # fmt: skip


def _streamed_calls(client, **kw) -> tuple[list[dict], str | None]:
    """The tool calls of a streamed chat, joined from their deltas by index."""
    calls: dict[int, dict] = {}
    fr = None
    for ch in client.chat.completions.create(model=MODEL, messages=MSGS, stream=True, **kw):
        if not ch.choices:
            continue
        fr = ch.choices[0].finish_reason or fr
        for d in ch.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            c["id"] = d.id or c["id"]
            c["name"] = (d.function.name if d.function else None) or c["name"]
            c["arguments"] += (d.function.arguments if d.function else None) or ""
    return [calls[i] for i in sorted(calls)], fr


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_tool_calls_are_always_valid(client, choice):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, n=12, temperature=1.0,
        max_tokens=800, seed=11,
    )  # fmt: skip
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert _calls_valid(ch.message.tool_calls), ch.message.tool_calls
        if isinstance(choice, dict):
            assert [c.function.name for c in ch.message.tool_calls] == ["add"]
    # streamed: the deltas join into calls of the same shape (named: the same as the
    # whole response of that seed)
    for seed in (12, 13):
        calls, fr = _streamed_calls(
            client, tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=800, seed=seed
        )
        assert fr == "tool_calls" and calls
        for c in calls:
            assert c["id"].startswith("chatcmpl-tool-") and c["name"] in SCHEMA_OF
            assert _valid_json(c["arguments"], SCHEMA_OF[c["name"]]), c
        whole = client.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=1.0,
            max_tokens=800, seed=seed,
        ).choices[0].message.tool_calls  # fmt: skip
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in whole
        ]


def test_parallel_tool_calls_false_gives_one_call(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", n=8,
        temperature=1.0, max_tokens=300, seed=21, parallel_tool_calls=False,
    )  # fmt: skip
    assert all(len(ch.message.tool_calls) == 1 for ch in r.choices)


def test_named_function_not_among_the_tools_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    assert (
        e.value.body["param"] == "tool_choice" and "not among the tools" in e.value.body["message"]
    )


CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
PARSER_FORMS = {
    "hermes": ("Sure. <tool_call>\n" + CALL + "\n</tool_call>", "Sure."),
    "qwen": ("<tool_call>\n" + CALL + "\n</tool_call>", None),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', None),
    "mistral": ("[TOOL_CALLS][" + CALL + "]", None),
}


@pytest.fixture(scope="module", params=sorted(PARSER_FORMS))
def parser_srv(request, srv, profile_file):
    if request.param == "hermes":
        yield request.param, srv
        return
    s = LiveServer(
        EngineConfig(profile=profile_file, kv_cache_bytes=16 << 20),
        ServerConfig(admission=False, enable_auto_tool_choice=True, tool_call_parser=request.param),
    )
    yield request.param, s
    s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_each_format(parser_srv, stream):
    """The model's text in each parser's format (made so by a regex constraint, since
    the tiny model does not call tools by itself) becomes OpenAI tool calls."""
    name, s = parser_srv
    text, content = PARSER_FORMS[name]
    client = s.client()
    kw = dict(tools=TOOLS, tool_choice="auto", max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"regex": re.escape(text)}})  # fmt: skip
    if stream:
        calls, fr = _streamed_calls(client, **kw)
        got = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        r = client.chat.completions.create(model=MODEL, messages=MSGS, **kw)
        fr, m = r.choices[0].finish_reason, r.choices[0].message
        assert m.content == content
        got = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls]
    assert fr == "tool_calls"
    assert got == [("get_weather", {"city": "Paris", "unit": "C"})]


def test_auto_without_a_call_is_text(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="auto", max_tokens=20,
        extra_body={"structured_outputs": {"regex": "no tools needed"}},
    )  # fmt: skip
    m = r.choices[0].message
    assert m.content == "no tools needed" and m.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------- compile off the loop
def test_a_slow_compile_delays_no_other_request(srv, client):
    """One grammar's compile is held (an event the test controls) while other requests
    are served: they finish, the engine keeps stepping, then the held one finishes."""
    structured = srv.state.loop.engine.structured
    backend = structured.compiler.backend
    real = backend.compile
    release, entered = threading.Event(), threading.Event()

    def held(spec):
        if spec.regex == "held-[0-9]":
            entered.set()
            assert release.wait(60)
        return real(spec)

    backend.compile = held
    try:
        box = {}
        t = threading.Thread(
            target=lambda: box.setdefault(
                "r",
                client.completions.create(
                    model=MODEL, prompt="x", max_tokens=8,
                    extra_body={"structured_outputs": {"regex": "held-[0-9]"}},
                ),
            )
        )  # fmt: skip
        t.start()
        assert entered.wait(30)
        held_from = time.monotonic()
        steps = srv.state.loop.snapshot.counters.get("iterations", 0)
        for seed in range(3):  # unconstrained and constrained requests meanwhile
            text, fr = _completion(client, max_tokens=8, seed=seed, temperature=1.0)
            assert fr in ("stop", "length")
            text, fr = _completion(
                client, extra_body={"structured_outputs": {"choice": ["a", "b"]}}
            )
            assert text in ("a", "b")
        assert "r" not in box and t.is_alive()  # still compiling
        assert srv.state.loop.snapshot.counters.get("iterations", 0) > steps
        held_s = time.monotonic() - held_from
        release.set()
        t.join(60)
        r = box["r"]
        assert re.fullmatch("held-[0-9]", r.choices[0].text)
        # its TTFT counts the compile it waited for (admission judged it so too)
        assert r.metrics["ttft_ms"] >= 1000 * held_s
    finally:
        backend.compile = real
        release.set()


def test_compile_and_mask_time_are_metrics(srv, client):
    _completion(client, extra_body={"structured_outputs": {"regex": "m[0-9]{2}x"}})
    fams = scrape(srv.url)
    assert fams["adaserve:grammar_compile_seconds_count"][0][1] >= 1
    assert fams["adaserve:grammar_masks_total"][0][1] > 0
    assert fams["adaserve:grammar_mask_seconds_total"][0][1] > 0
    assert "adaserve:structured_forced_tokens_total" in fams


def test_the_dashboard_shows_compile_and_mask_time(srv, client, browser):
    from selenium.webdriver.common.by import By
    from server_fixtures import wait_for

    _completion(client, extra_body={"structured_outputs": {"regex": "dash[0-9]{2}"}})
    rep = srv.http().get("/v1/slo/report").json()["engine"]["structured"]
    assert rep["grammars_compiled"] >= 1 and rep["masks"] > 0 and rep["backend"] == "llguidance"
    browser.get(srv.url + "/dashboard")

    def note():
        return browser.find_element(By.ID, "structured-note").text

    assert wait_for(lambda: "grammar(s) compiled" in note(), 30), browser.page_source[:2000]
    assert "node masks at" in note() and "llguidance" in note()
