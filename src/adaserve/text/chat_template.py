"""Chat templates: where a checkpoint keeps them, and rendering them as ``transformers``
does.

Where (first found wins, as ``transformers`` 5 loads them):

- ``chat_template.jinja`` in the checkpoint (what ``save_pretrained`` writes since
  transformers 4.5x; it then leaves the template out of ``tokenizer_config.json``), with
  named ones in ``additional_chat_templates/NAME.jinja``;
- ``tokenizer_config.json``'s ``chat_template``: a string, or the list form
  ``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``;
- the legacy ``chat_template.json`` (``{"chat_template": ...}``).

A ``--chat-template`` value (a file, or the template text itself, as vLLM takes it)
replaces them all. Of named templates, a request with ``tools`` uses ``tool_use`` when
there is one, else ``default`` (``transformers``' ``get_chat_template``).

Rendering is ``transformers``' (``render_jinja_template``): a jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension and a ``{% generation %}`` block, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, and the variables
``messages``, ``tools``, ``documents``, ``add_generation_prompt``, ``bos_token``,
``eos_token`` (plus the other special tokens of ``tokenizer_config.json``). Message keys
whose value is None are dropped first, as ``transformers`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from adaserve.errors import ModelLoadError

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
LEGACY_FILE = "chat_template.json"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplateError(ModelLoadError):
    """A template that cannot be read or compiled, or that refused the messages."""


def _token_text(v) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(v, Mapping):
        v = v.get("content")
    return v if isinstance(v, str) else None


def templates_from_config(value, where: str) -> dict[str, str]:
    """Name -> template of a ``chat_template`` value (string or list form)."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        out = {}
        for i, item in enumerate(value):
            if (
                not isinstance(item, Mapping)
                or not isinstance(item.get("name"), str)
                or not isinstance(item.get("template"), str)
            ):
                raise ChatTemplateError(
                    f"{where}: chat_template[{i}] must be {{'name': str, 'template': str}}"
                )
            out[item["name"]] = item["template"]
        return out
    if isinstance(value, Mapping) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    raise ChatTemplateError(f"{where}: chat_template must be a string or a list of templates")


def find_templates(model_dir: str | Path, config: Mapping) -> dict[str, str]:
    """Every chat template a checkpoint carries (see the module docstring)."""
    d = Path(model_dir)
    out: dict[str, str] = {}
    f = d / TEMPLATE_FILE
    if f.is_file():
        out["default"] = _read(f)
        extra = d / TEMPLATE_DIR
        if extra.is_dir():
            for g in sorted(extra.glob("*.jinja")):
                out[g.stem] = _read(g)
        return out
    out = templates_from_config(config.get("chat_template"), str(d / "tokenizer_config.json"))
    if out:
        return out
    legacy = d / LEGACY_FILE
    if legacy.is_file():
        try:
            data = json.loads(_read(legacy))
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{legacy} is not valid JSON: {e}") from None
        if isinstance(data, Mapping):
            return templates_from_config(data.get("chat_template"), str(legacy))
    return {}


def load_template_arg(value: str) -> str:
    """A ``--chat-template`` value: a file's text, or the template itself when it is no
    file and looks like one (contains ``{`` or a newline), as vLLM reads it."""
    p = Path(value)
    try:
        if p.is_file():
            return _read(p)
    except OSError:
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ChatTemplateError(f"--chat-template {value!r}: no such file")


def _read(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read {p}: {e}") from None


@lru_cache(maxsize=32)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers
        uses it to find assistant tokens)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def _drop_none(v):
    if isinstance(v, Mapping):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_none(x) for x in v]
    return v


class ChatTemplate:
    """A checkpoint's chat templates (by name) and its special tokens."""

    def __init__(self, templates: Mapping[str, str], config: Mapping | None = None):
        self.templates = dict(templates)
        config = config or {}
        self.special = {k: _token_text(config.get(k)) or "" for k in _SPECIAL}

    def check(self) -> None:
        """Compile every template (ChatTemplateError for one that does not)."""
        for t in self.templates.values():
            _compile(t)

    @classmethod
    def of_checkpoint(
        cls, model_dir: str | Path, config: Mapping, override: str | None = None
    ) -> ChatTemplate:
        """The templates of ``model_dir`` (``override``: a ``--chat-template`` value),
        or the documented default when it has none."""
        if override is not None:
            templates = {"default": load_template_arg(override)}
        else:
            templates = find_templates(model_dir, config) or {"default": DEFAULT_CHAT_TEMPLATE}
        return cls(templates, config)

    def pick(self, tools: list | None = None, name: str | None = None) -> str:
        """The template for a request, as transformers' ``get_chat_template``."""
        t = self.templates
        if name is not None:
            if name not in t:
                raise ChatTemplateError(
                    f"no chat template named {name!r} (this model has {sorted(t)})"
                )
            return t[name]
        if tools and "tool_use" in t:
            return t["tool_use"]
        if "default" in t:
            return t["default"]
        if len(t) == 1:
            return next(iter(t.values()))
        raise ChatTemplateError(
            f"this model has several chat templates and no default: {sorted(t)}"
        )

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list | None = None,
        documents: list | None = None,
        name: str | None = None,
        **kwargs,
    ) -> str:
        """The conversation as the prompt text the model was trained on."""
        import jinja2

        tmpl = _compile(self.pick(tools, name))
        ctx = {**self.special, **kwargs}
        try:
            return tmpl.render(
                messages=_drop_none(messages),
                tools=_drop_none(tools) if tools is not None else None,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **ctx,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
