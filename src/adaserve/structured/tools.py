"""Tool calls: the constraint of ``tool_choice`` "required" or a named function, and
the parsers that read calls out of a model's text for "auto" (``--tool-call-parser``).

Output forms:
- a named function: the output *is* its arguments, constrained to its parameters'
  schema (the call is always valid);
- "required": a JSON array of ``{"name": ..., "parameters": {...}}`` objects, each one
  of the tools with its own parameters' schema (one item unless parallel calls are
  allowed), as vLLM constrains it;
- "auto": free text; the parser finds the calls in the model's own format:
  ``hermes`` / ``qwen`` (``<tool_call>{"name", "arguments"}</tool_call>``),
  ``llama3_json`` (``{"name", "parameters"}`` objects, ``;``-separated, after an
  optional ``<|python_tag|>``) and ``mistral`` (``[TOOL_CALLS]`` then a JSON array).

``ToolStream`` turns a choice's streamed text into content deltas and OpenAI tool-call
deltas; the argument fragments of a call join into the same JSON the whole response
carries.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from adaserve.errors import InvalidRequestError
from adaserve.structured.params import StructuredOutputsParams

PARSERS = ("hermes", "qwen", "llama3_json", "mistral")
# calls one "required" reply may make (a sampling model cannot run on adding calls)
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class Call:
    """One parsed tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "chatcmpl-tool-" + uuid.uuid4().hex)


def _params_schema(tool: dict) -> dict:
    p = tool["function"].get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object", "properties": {}}


def _args(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of a "required" output: an array of calls of the given tools."""
    items = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _params_schema(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema: dict = {"type": "array", "minItems": 1, "items": items}
    schema["maxItems"] = MAX_PARALLEL_CALLS if parallel else 1
    return schema


# ------------------------------------------------------------------ parsers (auto)
def _json_values(text: str, start: int = 0) -> tuple[list[Any], int]:
    """The JSON values one after another from ``start`` (separated by whitespace, ``,``
    or ``;``); returns them and where parsing stopped."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = start
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text):
            return out, i
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return out, i
        out.append(v)


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for k in args_keys:
        if k in obj:
            a = obj[k]
            return Call(obj["name"], a if isinstance(a, str) else _args(a))
    return Call(obj["name"], "{}")


def _calls(vals, args_keys: tuple[str, ...]) -> list[Call]:
    """The calls among JSON values (a list value: its items)."""
    objs = [o for v in vals for o in (v if isinstance(v, list) else [v])]
    return [c for c in (_call_of(o, args_keys) for o in objs) if c is not None]


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5)."""

    markers = ("<tool_call>",)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        at = text.find("<tool_call>")
        if at < 0:
            return text, []
        calls = []
        for m in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text[at:], re.S):
            calls += _calls(_json_values(m.group(1).strip())[0], ("arguments", "parameters"))
        if not calls:
            return text, []
        content = text[:at].strip()
        return content or None, calls


class Llama3JsonParser:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}`` objects (``;``
    between several), the text starting with one or with ``<|python_tag|>``."""

    markers = ("<|python_tag|>", "{")

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        s = text.lstrip()
        if s.startswith("<|python_tag|>"):
            s = s[len("<|python_tag|>") :]
        if not s.lstrip().startswith("{"):
            return text, []
        vals, end = _json_values(s)
        calls = _calls(vals, ("parameters", "arguments"))
        if not calls or s[end:].strip():
            return text, []  # not all calls: the text is content
        return None, calls


class MistralParser:
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral's)."""

    markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        calls = _calls(_json_values(text, at + len("[TOOL_CALLS]"))[0], ("arguments", "parameters"))
        if not calls:
            return text, []
        content = text[:at].strip()
        return content or None, calls


def make_parser(name: str):
    if name in ("hermes", "qwen"):
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    if name == "mistral":
        return MistralParser()
    raise ValueError(f"tool-call parser must be one of {', '.join(PARSERS)}")


# ------------------------------------------------------------------ a request's mode
@dataclass
class ToolMode:
    """How one chat request's output becomes tool calls.

    kind: "named" (``function`` is the tool), "required" or "auto" (``parser``)
    """

    kind: str
    tools: list[dict]
    function: str | None = None
    parallel: bool = True
    parser: Any = None

    @property
    def named(self) -> str:
        """The tool of a "named" mode."""
        assert self.function is not None, "a named tool mode names its function"
        return self.function

    def constraint(self) -> StructuredOutputsParams | None:
        if self.kind == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.function)
            return StructuredOutputsParams(json=_params_schema(tool))
        if self.kind == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        return None

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a whole output."""
        if self.kind == "named":
            return None, [Call(self.named, text)]
        if self.kind == "required":
            vals, _ = _json_values(text)
            items = vals[0] if vals and isinstance(vals[0], list) else []
            calls = [c for c in (_call_of(o, ("parameters",)) for o in items) if c]
            return (None, calls) if calls else (text, [])
        content, calls = self.parser.parse(text)
        if not self.parallel:
            calls = calls[:1]
        return content, calls


def tool_mode(
    tools: list[dict] | None,
    tool_choice: Any,
    parallel: bool | None,
    auto_enabled: bool,
    parser: str | None,
) -> ToolMode | None:
    """The request's tool mode (None: the output is text). ``tool_choice`` is "none",
    "auto", "required", ``{"type": "function", "function": {"name": ...}}`` or None
    (tools without a choice mean "auto", as OpenAI and vLLM read them)."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    par = True if parallel is None else bool(parallel)
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({', '.join(names)})",
                "tool_choice",
            )
        return ToolMode("named", tools, function=name, parallel=False)
    if tool_choice == "required":
        return ToolMode("required", tools, parallel=par)
    if not auto_enabled or parser is None:
        raise InvalidRequestError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            'to be set (or send tool_choice "none", "required" or a named function)',
            "tool_choice",
        )
    return ToolMode("auto", tools, parallel=par, parser=make_parser(parser))


# ------------------------------------------------------------------ streaming
class ToolStream:
    """One streamed choice's text -> events: ``("content", text)`` and ``("call", index,
    id, name, arguments_fragment)`` (id and name on a call's first event only)."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.text = ""
        self.sent_content = 0  # characters of text sent as content
        self.calls_sent = 0
        self.ids: list[str] = []
        self.in_call = False  # auto: a marker was seen, the rest is buffered

    def push(self, delta: str) -> list[tuple]:
        if not delta:
            return []
        self.text += delta
        m = self.mode
        if m.kind == "named":
            ev: list[tuple] = []
            if self.calls_sent == 0:
                self.ids.append(Call(m.named, "").id)
                ev.append(("call", 0, self.ids[0], m.function, ""))
                self.calls_sent = 1
            ev.append(("call", 0, None, None, delta))
            return ev
        if m.kind == "required":
            return self._complete_items()
        return self._auto_content()

    def _complete_items(self) -> list[tuple]:
        """The array items of a "required" output completed so far, one event each."""
        s = self.text.lstrip()
        if not s.startswith("["):
            return []
        vals, _ = _json_values(s, 1)
        ev = []
        for obj in vals[self.calls_sent :]:
            c = _call_of(obj, ("parameters",))
            if c is None:
                continue
            self.ids.append(c.id)
            ev.append(("call", self.calls_sent, c.id, c.name, c.arguments))
            self.calls_sent += 1
        return ev

    def _auto_content(self) -> list[tuple]:
        if self.in_call:
            return []
        markers = self.mode.parser.markers
        t = self.text
        hit = min((t.find(mk) for mk in markers if mk in t), default=-1)
        if isinstance(self.mode.parser, Llama3JsonParser):
            # its calls are the whole output: a first non-blank "{" or the tag
            s = t.lstrip()
            if not s:
                return []
            hit = len(t) - len(s) if s[0] == "{" or s.startswith("<|python_tag|>"[: len(s)]) else -1
        if hit >= 0:
            self.in_call = True
            end = hit
        else:  # hold back what could be the start of a marker
            hold = max(
                (k for mk in markers for k in range(1, len(mk)) if t.endswith(mk[:k])),
                default=0,
            )
            end = len(t) - hold
        out = t[self.sent_content : end]
        self.sent_content = max(self.sent_content, end)
        return [("content", out)] if out else []

    def finish(self, final_text: str) -> list[tuple]:
        """The events left once the whole text is known (the same calls as
        ``ToolMode.parse(final_text)``)."""
        m = self.mode
        if final_text.startswith(self.text):
            rest = final_text[len(self.text) :]
            ev = self.push(rest) if rest else []
        else:
            ev = []
        self.text = final_text
        if m.kind == "named":
            if self.calls_sent == 0:
                self.ids.append(Call(m.named, "").id)
                return [("call", 0, self.ids[0], m.function, final_text)]
            return ev
        content, calls = m.parse(final_text)
        if m.kind == "required":
            ev += self._complete_items()
            if not self.calls_sent and not calls:  # not a complete call: the text
                out = final_text[self.sent_content :]
                self.sent_content = len(final_text)
                ev += [("content", out)] if out else []
            return ev
        if not calls:  # auto without calls: everything is content
            out = final_text[self.sent_content :]
            self.sent_content = len(final_text)
            return ev + ([("content", out)] if out else [])
        for i, c in enumerate(calls[self.calls_sent :], start=self.calls_sent):
            self.ids.append(c.id)
            ev.append(("call", i, c.id, c.name, c.arguments))
        self.calls_sent = len(calls)
        return ev
