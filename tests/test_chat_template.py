"""Chat templates found where transformers keeps them and rendered as transformers
renders them (``apply_chat_template(tokenize=False)`` as the reference): the list form
of ``tokenizer_config.json`` with named templates (``tool_use`` picked for requests with
tools), ``chat_template.jinja`` with ``additional_chat_templates/``, ``--chat-template``
values, and the template errors."""

from __future__ import annotations

import json

import pytest
from server_fixtures import EOS, build_tokenizer

from adaserve.text.chat_template import ChatTemplate, ChatTemplateError, load_template_arg
from adaserve.text.tokenizer import load_tokenizer

DEFAULT = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
TOOL_USE = (
    "{% for t in tools %}<tool>{{ t.function.name }}:{{ t.function.parameters | tojson }}"
    "</tool>{% endfor %}{% for m in messages %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "({{ c.function.arguments }})</call>{% endfor %}"
    "{% elif m.role == 'tool' %}<result id={{ m.tool_call_id }}>{{ m.content }}</result>"
    "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
    "{% generation %}{% if add_generation_prompt %}<assistant>{% endif %}{% endgeneration %}"
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "description": "a<b & c"}},
    }
]
MSGS = [
    {"role": "user", "content": "add 2 and 3 — «vite»"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "[2, 3]"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]


@pytest.fixture(scope="module")
def list_form(tmp_path_factory):
    """A checkpoint whose tokenizer_config.json has the legacy list form."""
    d = tmp_path_factory.mktemp("listform")
    build_tokenizer(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"content": EOS, "__type": "AddedToken"}  # the older spelling
    cfg["chat_template"] = [
        {"name": "default", "template": DEFAULT},
        {"name": "tool_use", "template": TOOL_USE},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _hf(d):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(d))


def test_list_form_renders_as_transformers(list_form):
    hf = _hf(list_form)
    ours = load_tokenizer(list_form).chat
    assert set(ours.templates) == {"default", "tool_use"}
    plain = MSGS[:1]
    want = hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert ours.render(plain) == want and want.startswith(EOS)
    want = hf.apply_chat_template(MSGS, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.render(MSGS, tools=TOOLS) == want  # tool_use picked, as transformers does
    assert "<call>add([2, 3])</call>" in want and "a<b & c" in want  # tojson: no escaping
    want = hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=False)
    assert ours.render(plain, add_generation_prompt=False) == want


def test_jinja_file_and_additional_templates_as_transformers_saves_them(list_form, tmp_path):
    hf = _hf(list_form)
    hf.save_pretrained(tmp_path)  # transformers 5: chat_template.jinja + additional_...
    assert (tmp_path / "chat_template.jinja").is_file()
    ours = load_tokenizer(tmp_path).chat
    assert set(ours.templates) == {"default", "tool_use"}
    want = hf.apply_chat_template(MSGS, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.render(MSGS, tools=TOOLS) == want


def test_chat_template_argument_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(DEFAULT)
    assert load_template_arg(str(f)) == DEFAULT
    assert load_template_arg(DEFAULT) == DEFAULT  # not a file, but a template
    with pytest.raises(ChatTemplateError, match="no such file"):
        load_template_arg(str(tmp_path / "missing.jinja"))


def test_template_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate({"default": "{% for %}"}).check()
    ct = ChatTemplate({"default": "{{ raise_exception('no system role') }}"})
    with pytest.raises(ChatTemplateError, match="no system role"):
        ct.render([{"role": "system", "content": "x"}])
    ct = ChatTemplate({"default": "{{ messages[5].content }}"})
    with pytest.raises(ChatTemplateError):
        ct.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no default"):
        ChatTemplate({"a": "x", "b": "y"}).render([])
    with pytest.raises(ChatTemplateError, match="chat_template\\[0\\]"):
        from adaserve.text.chat_template import templates_from_config

        templates_from_config([{"name": "default"}], "tokenizer_config.json")
    # the sandbox: no attribute walks to Python internals
    ct = ChatTemplate({"default": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(ChatTemplateError):
        ct.render([{"role": "user", "content": "x"}])
