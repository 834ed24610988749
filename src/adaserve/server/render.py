"""JSON of response bodies: every non-ASCII character escaped (so no input can break
the encoding) and no NaN or infinity."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from adaserve.server.errors import ApiError


def jsonable(body):
    """A dict/list body as it is; a protocol model as its ``model_dump``."""
    return body.model_dump() if isinstance(body, BaseModel) else body


class JSON(JSONResponse):
    """A JSON response of a dict or a protocol model."""

    def render(self, content) -> bytes:
        return json.dumps(jsonable(content), ensure_ascii=True, allow_nan=False).encode("ascii")


def dumps(body) -> str:
    """Compact JSON of a dict or a protocol model (one SSE event's data)."""
    return json.dumps(jsonable(body), ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def error_response(e: ApiError) -> JSON:
    return JSON(e.body(), status_code=e.status, headers=e.headers)
