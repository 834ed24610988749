"""What a vLLM user does by habit, against one live server started the way ``adaserve
serve CKPT --api-key K1,K2 ...`` starts it (``build_configs`` of the parsed flags), on a
checkpoint saved by ``transformers``' ``save_pretrained``: ``chat_template.jinja``
(ChatML, tools aware), special tokens in the tokenizer, and a ``generation_config.json``
recommending ``top_k=1``.

Covered with the official ``openai`` client (and httpx for vLLM's non-OpenAI routes):
prompt token counts equal to ``transformers``' ``apply_chat_template``, tools with
``tool_choice="none"``, tool-call history, refused ``tool_choice`` values, unknown fields
ignored (and refused with ``--strict-fields``), ``/v1/models/{id}``, ``/tokenize`` and
``/detokenize``, ``/version``, ``/ping``, the API keys, ``n=2`` streamed and not, and the
generation-config defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import openai
import pytest
from conftest import save_tiny
from server_fixtures import EOS, LiveServer, build_tokenizer, server_test_env

from adaserve.server.cli import add_arguments, build_configs

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)

NAME = "tiny-chatml"
ALIAS = "tiny-alias"  # a second --served-model-name
KEYS = ("key-one", "key-two")
CHATML = (
    "{{ bos_token }}"
    "{%- if messages | length > 8 %}{{ raise_exception('at most 8 messages') }}{% endif %}"
    "{%- if tools %}<|im_start|>system\n# Tools\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
]


def _args_dict(call: dict) -> dict:
    f = call["function"]
    return {**call, "function": {**f, "arguments": json.loads(f["arguments"])}}


def _hf_ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(directory, transformers tokenizer) of the saved checkpoint."""
    import transformers

    d = tmp_path_factory.mktemp("chatml") / "ckpt"
    d.mkdir()
    build_tokenizer(d)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(d / "tokenizer.json"), eos_token=EOS, bos_token=EOS
    )
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = CHATML
    model = save_tiny(d, vocab_size=len(hf), eos_token_id=hf.convert_tokens_to_ids(EOS))
    model.generation_config.do_sample = True
    model.generation_config.top_k = 1
    model.generation_config.temperature = 0.7
    model.generation_config.save_pretrained(d)
    hf.save_pretrained(d)
    assert (d / "chat_template.jinja").is_file()
    assert "chat_template" not in (d / "tokenizer_config.json").read_text()
    return d, hf


@pytest.fixture(scope="module")
def srv(ckpt):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        [
            str(ckpt[0]),
            "--no-draft",
            "--policy",
            "ar",
            "--kv-cache-bytes",
            "8MiB",
            "--api-key",
            KEYS[0],
            "--api-key",
            f" ,{KEYS[1]}",
            "--served-model-name",
            NAME,
            ALIAS,
        ]
    )
    ecfg, scfg = build_configs(args)
    assert ecfg.kv_cache_bytes == 8 << 20 and ecfg.model == str(ckpt[0])
    s = LiveServer(ecfg, scfg)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return srv.client(KEYS[1])


def _tokenize(srv, **body) -> dict:
    with srv.http(headers={"Authorization": f"Bearer {KEYS[0]}"}) as h:
        r = h.post("/tokenize", json={"model": NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------- chat templates


def test_prompt_tokens_equal_transformers_apply_chat_template(srv, ckpt, client):
    _, hf = ckpt
    msgs = [{"role": "user", "content": "Say hello to the new user."}]
    want = _hf_ids(hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2)
    assert r.usage.prompt_tokens == len(want)
    assert _tokenize(srv, messages=msgs)["tokens"] == want
    # a tool-call history and tools, rendered by the template (tool_choice "none")
    # the history's arguments reach the template as a dict (as vLLM passes them)
    as_dicts = [dict(m) for m in CONVERSATION]
    as_dicts[2] = {**as_dicts[2], "tool_calls": [_args_dict(c) for c in as_dicts[2]["tool_calls"]]}
    want = _hf_ids(
        hf.apply_chat_template(as_dicts, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    )
    r = client.chat.completions.create(
        model=NAME, messages=CONVERSATION, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert r.usage.prompt_tokens == len(want)
    assert r.choices[0].message.tool_calls is None
    assert _tokenize(srv, messages=CONVERSATION, tools=TOOLS)["tokens"] == want
    without = _tokenize(srv, messages=CONVERSATION)["count"]
    assert without < len(want)  # the tools reached the template


def test_a_tool_call_and_its_result_go_back_through_the_template(ckpt, client):
    """A named tool choice answers with a call; the call and the tool's result, sent
    back as the next turn, reach the chat template (arguments as a dict, as vLLM
    passes them): the prompt is what transformers renders for that conversation."""
    _, hf = ckpt
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(
        model=NAME,
        messages=msgs,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    turn = [
        *msgs,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    r2 = client.chat.completions.create(
        model=NAME, messages=turn, tools=tools, tool_choice="none", max_tokens=2
    )
    hf_turn = [*turn[:1], {**turn[1], "tool_calls": [_args_dict(call.model_dump())]}, turn[2]]
    want = _hf_ids(
        hf.apply_chat_template(hf_turn, tools=tools, add_generation_prompt=True, tokenize=True)
    )
    assert r2.usage.prompt_tokens == len(want)


def test_a_served_model_name_alias_is_accepted(client):
    r = client.completions.create(model=ALIAS, prompt="hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another-model", prompt="hi", max_tokens=2)


def test_template_raise_exception_is_a_400(client):
    msgs = [{"role": "user", "content": "x"}] * 9
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1)
    assert "at most 8 messages" in e.value.message


def test_auto_tool_choice_needs_the_parser_flags(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=1,
        )
    body = e.value.body
    assert body["param"] == "tool_choice" and "--enable-auto-tool-choice" in body["message"]


def test_tools_without_tool_choice_mean_auto(client):
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], tools=TOOLS, max_tokens=1
        )


# ---------------------------------------------------------------------- request fields


def test_unknown_fields_are_ignored_with_one_warning_unless_strict(srv, client, caplog):
    msgs = [{"role": "user", "content": "hi"}]
    known = {"metadata": {"run": "a"}, "parallel_tool_calls": False, "store": False}
    with caplog.at_level(logging.WARNING, logger="adaserve.server"):
        for _ in range(2):
            r = client.chat.completions.create(
                model=NAME,
                messages=msgs,
                max_tokens=2,
                extra_body={"frobnicate_level": 3, "min_tokens": 0, **known},
                **{k: v for k, v in known.items() if k != "store"},
            )
            assert r.choices[0].finish_reason in ("stop", "length")
    warned = [m for m in caplog.messages if "frobnicate_level" in m]
    assert len(warned) == 1 and "ignored" in warned[0]
    assert not any("metadata" in m or "parallel_tool_calls" in m for m in caplog.messages)
    st = srv.state
    old = st.cfg
    st.cfg = dataclasses.replace(old, strict_fields=True)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=NAME, messages=msgs, max_tokens=2, extra_body={"frobnicate_level": 3}
            )
        assert e.value.body["param"] == "frobnicate_level"
        assert e.value.body["code"] == "unknown_parameter"
        # declared fields are not unknown, strict or not
        client.completions.create(
            model=NAME, prompt="x", max_tokens=1, extra_body={"metadata": {}, "min_tokens": 0}
        )
    finally:
        st.cfg = old


@pytest.mark.parametrize(
    "field,value",
    [
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("allowed_token_ids", [1, 2, 3]),
        ("truncate_prompt_tokens", 4),
        ("prompt_logprobs", 1),
        ("return_tokens_as_token_ids", True),
        ("spaces_between_special_tokens", False),
    ],
)
def test_vllm_fields_that_would_change_the_output_are_refused(srv, client, field, value):
    """Never ignored silently: a 400 naming the field, on both endpoints, strict or
    not; the field's no-op value is accepted (vLLM clients send the defaults)."""
    from adaserve.server.validation import UNSUPPORTED_VLLM_FIELDS

    msgs = [{"role": "user", "content": "hi"}]
    for call in (
        lambda eb: client.completions.create(model=NAME, prompt="x", max_tokens=1, extra_body=eb),
        lambda eb: client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=1, extra_body=eb
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            call({field: value})
        assert e.value.body["param"] == field
        assert e.value.body["code"] == "unsupported_parameter"
        assert field in e.value.body["message"]
        r = call({field: UNSUPPORTED_VLLM_FIELDS[field]})
        assert r.usage.completion_tokens == 1
    old = srv.state.cfg
    srv.state.cfg = dataclasses.replace(old, strict_fields=True)
    try:  # the no-op value is not an unknown field either
        call({field: UNSUPPORTED_VLLM_FIELDS[field]})
    finally:
        srv.state.cfg = old


# ---------------------------------------------------------------------- endpoints


def test_models_by_id(client):
    m = client.models.retrieve(NAME)
    assert m.id == NAME and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    assert e.value.body["type"] == "invalid_request_error"


def test_tokenize_detokenize_round_trip(srv, ckpt, client):
    text = "def greet(name):\n    return 'hello ' + name\n"
    t = _tokenize(srv, prompt=text, return_token_strs=True)
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 512
    assert t["tokens"] == ckpt[1].encode(text, add_special_tokens=True)
    assert len(t["token_strs"]) == t["count"]
    with srv.http(headers={"Authorization": f"Bearer {KEYS[0]}"}) as h:
        r = h.post("/detokenize", json={"model": NAME, "tokens": t["tokens"]})
        assert r.status_code == 200 and r.json() == {"prompt": text}
        r = h.post("/detokenize", json={"model": NAME, "tokens": [10**6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = h.post("/tokenize", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = h.post("/tokenize", json={"prompt": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # the completions endpoint counts the prompt as /tokenize does
    r = client.completions.create(model=NAME, prompt=text, max_tokens=1)
    assert r.usage.prompt_tokens == t["count"]


def test_keys_version_and_ping(srv):
    with srv.http() as h:
        for path in ("/v1/models", "/v1/models/" + NAME):
            assert h.get(path).status_code == 401
        assert h.post("/tokenize", json={"prompt": "x"}).status_code == 401
        r = h.post("/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        v = h.get("/version")
        assert v.status_code == 200 and v.json()["version"]
        assert h.get("/ping").status_code == 200 and h.post("/ping").status_code == 200
    for key in KEYS:
        assert srv.client(key).models.list().data[0].id == NAME


# ---------------------------------------------------------------------- n and defaults


def test_n2_streamed_equals_not_streamed(client):
    kw = dict(
        model=NAME,
        prompt="The",
        max_tokens=6,
        n=2,
        seed=11,
        temperature=1.0,
        extra_body={"top_k": 0},
    )
    whole = client.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    texts = {c.index: c.text for c in whole.choices}
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    assert texts[0] != texts[1]  # seed + index: two different samples
    msgs = [{"role": "user", "content": "hi"}]
    ckw = dict(model=NAME, messages=msgs, max_tokens=4, n=2, seed=3, extra_body={"top_k": 0})
    whole = client.chat.completions.create(**ckw)
    chat = {c.index: c.message.content for c in whole.choices}
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **ckw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == chat and set(chat) == {0, 1}


def test_generation_config_defaults_apply_where_the_request_is_silent(srv, client):
    assert srv.state.loop.info.sampling_defaults == {"temperature": 0.7, "top_k": 1}
    greedy = client.completions.create(model=NAME, prompt="The", max_tokens=8, temperature=0)
    # no temperature / top_k: the checkpoint's top_k=1 makes sampling greedy, whatever
    # the seed
    for seed in (1, 2):
        r = client.completions.create(model=NAME, prompt="The", max_tokens=8, seed=seed)
        assert r.choices[0].text == greedy.choices[0].text
    # an explicit top_k wins: two seeds now sample two different texts
    a, b = (
        client.completions.create(
            model=NAME, prompt="The", max_tokens=8, seed=s, extra_body={"top_k": 0}
        )
        .choices[0]
        .text
        for s in (1, 2)
    )
    assert a != b


def test_chat_with_httpx_body_of_tool_history_and_documents(srv):
    """The message fields vLLM accepts pass pydantic; a bad tool call is a 400."""
    with srv.http(headers={"Authorization": f"Bearer {KEYS[0]}"}) as h:
        body = {"model": NAME, "messages": CONVERSATION, "max_tokens": 1}
        assert h.post("/v1/chat/completions", json=body).status_code == 200
        bad = [{**CONVERSATION[2], "tool_calls": [{"id": "x", "function": {"name": 1}}]}]
        r = h.post("/v1/chat/completions", json={**body, "messages": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0]")
        r = h.post(
            "/v1/chat/completions",
            json={**body, "chat_template_kwargs": {"messages": []}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
