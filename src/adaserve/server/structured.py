"""The HTTP side of structured outputs: a request's constraint from its fields
(``response_format``, ``structured_outputs``, the deprecated ``guided_*``, the tool
mode), compiled on the grammar threads, one grammar state per engine request."""

from __future__ import annotations

import logging

from adaserve.errors import InvalidRequestError
from adaserve.server.errors import ApiError
from adaserve.server.state import ServerState
from adaserve.structured.params import GUIDED_ALIASES, StructuredOutputsParams, from_fields
from adaserve.structured.tools import ToolMode

log = logging.getLogger("adaserve.server")


def constraint_of(
    body, tools: ToolMode | None = None, warned: set[str] | None = None
) -> StructuredOutputsParams | None:
    """The one output constraint the request asks for (400 when it asks for two, or
    for one that is malformed); a deprecated ``guided_*`` field is logged once per
    name in ``warned`` (the server's)."""
    guided = {k: getattr(body, k) for k in GUIDED_ALIASES if getattr(body, k, None) is not None}
    warned = set() if warned is None else warned
    for k in guided:
        if k not in warned:
            warned.add(k)
            log.warning(
                "the request field %s is deprecated: send structured_outputs={%r: ...}",
                k,
                GUIDED_ALIASES[k],
            )
    rf = body.response_format.as_dict() if body.response_format else None
    try:
        spec = from_fields(body.structured_outputs, rf, guided, body.guided_whitespace_pattern)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=e.param) from None
    forced = tools.constraint() if tools is not None else None
    if tools is not None and forced is not None and spec is not None:
        raise ApiError(
            400,
            f"tool_choice {tools.kind!r} constrains the output to the tools' schemas: it "
            "cannot be combined with response_format or structured_outputs",
            param="tool_choice",
        )
    return forced or spec


async def grammar_states(state: ServerState, spec: StructuredOutputsParams, k: int) -> list:
    """``k`` fresh grammar states of ``spec``, compiled (or found in the cache) on the
    grammar threads: the request waits for its own grammar only."""
    structured = state.loop.built_engine.structured

    def build():
        return [structured.state_for(spec) for _ in range(k)]

    try:
        return await state.off_loop_grammar(build)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=e.param) from None
    finally:
        state.metrics.observe_compiles(structured.drain_compile_times())
