"""vLLM's output-changing sampling fields, implemented instead of ignored: ``bad_words``
(lossless under speculation: banned at every tree node, draft and target),
``include_stop_str_in_output`` and ``skip_special_tokens``, offline and over HTTP with
the ``openai`` client (streamed and not)."""

from __future__ import annotations

import pytest
from conftest import shipped_llm
from server_fixtures import LiveServer, server_test_env

from adaserve import SamplingParams
from adaserve.config import EngineConfig
from adaserve.server import ServerConfig
from adaserve.util.paths import DEFAULT_TARGET

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)
pytestmark = pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "for i in range(10):"]


@pytest.fixture(scope="module")
def shipped(profile_file):
    return shipped_llm(profile_file)


def _outs(llm, policy, sp):
    llm.engine.set_policy(policy)
    return [o.outputs[0] for o in llm.generate(PROMPTS, sp)]


def _contains(ids: list[int], seq: list[int]) -> bool:
    k = len(seq)
    return any(ids[i : i + k] == seq for i in range(len(ids) - k + 1))


def test_bad_words_are_never_generated_and_speculation_stays_lossless(shipped):
    plain = _outs(shipped, "ar", SamplingParams(temperature=0.0, max_tokens=40))
    words = [w for w in " ".join(o.text for o in plain).split() if len(w) > 2][:3]
    assert words, [o.text for o in plain]
    sp = SamplingParams(temperature=0.0, max_tokens=40, bad_words=words)
    ref = _outs(shipped, "ar", sp)
    seqs = shipped.engine._bad_words_ids(words)
    for o in ref:
        assert not any(_contains(o.token_ids, s) for s in seqs), (o.text, words)
    assert [o.token_ids for o in ref] != [o.token_ids for o in plain]
    for pol in ("spec-chain:4", "spec-tree:3x2", "adaserve"):
        assert [o.token_ids for o in _outs(shipped, pol, sp)] == [o.token_ids for o in ref], pol


def test_include_stop_str_in_output_and_skip_special_tokens(shipped):
    plain = _outs(shipped, "ar", SamplingParams(temperature=0.0, max_tokens=24))
    stop = plain[0].text[6:9]
    cut = _outs(shipped, "ar", SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0].text
    kept = _outs(
        shipped,
        "ar",
        SamplingParams(
            temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
        ),
    )[0].text
    assert not cut.endswith(stop) and kept == cut + stop
    eos = next(iter(shipped.engine.eos_ids))
    eos_text = shipped.engine.tokenizer.id_to_token(eos)
    forced = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    hidden = _outs(shipped, "ar", SamplingParams(**forced))[0]
    shown = _outs(shipped, "ar", SamplingParams(**forced, skip_special_tokens=False))[0]
    assert hidden.token_ids == shown.token_ids == [eos] * 3
    assert hidden.text == "" and shown.text == eos_text * 3


@pytest.mark.parametrize("stream", [False, True])
def test_the_fields_over_http(profile_file, stream):
    s = LiveServer(EngineConfig(profile=profile_file, kv_cache_bytes=16 << 20), ServerConfig())
    try:
        c = s.client()

        def text(**kw) -> str:
            kw.setdefault("max_tokens", 24)
            if not stream:
                r = c.completions.create(model="adaserve", prompt=PROMPTS[0], temperature=0, **kw)
                return r.choices[0].text
            out = ""
            for ch in c.completions.create(
                model="adaserve", prompt=PROMPTS[0], temperature=0, stream=True, **kw
            ):
                out += ch.choices[0].text if ch.choices else ""
            return out

        plain = text()
        word = next(w for w in plain.split() if len(w) > 2)
        assert word not in text(extra_body={"bad_words": [word]}).split()
        stop = plain[6:9]
        cut = text(stop=[stop])
        assert text(stop=[stop], extra_body={"include_stop_str_in_output": True}) == cut + stop
        tok = s.state.loop.info.tokenizer
        eos = tok.eos_id
        forced = {"max_tokens": 2, "logit_bias": {str(eos): 100}}
        assert text(**forced, extra_body={"ignore_eos": True}) == ""
        shown = text(**forced, extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert shown == tok.id_to_token(eos) * 2
    finally:
        s.stop()


def test_offline_chat_passes_tools_and_template_kwargs(shipped):
    template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% if shout %}!{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [{"role": "user", "content": "hi"}]
    out = shipped.chat(msgs, SamplingParams(temperature=0.0, max_tokens=2), chat_template=template, tools=tools,
                       chat_template_kwargs={"shout": True}, use_tqdm=False)[0]  # fmt: skip
    assert shipped.get_tokenizer().decode(out.prompt_token_ids) == "[tool get_weather]!hi"
    plain = shipped.chat(
        msgs, SamplingParams(temperature=0.0, max_tokens=2), chat_template=template
    )[0]
    assert shipped.get_tokenizer().decode(plain.prompt_token_ids) == "hi"
