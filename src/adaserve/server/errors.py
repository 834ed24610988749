"""Errors answered to the client as OpenAI-style bodies:
``{"error": {"message", "type", "param", "code"}}`` plus ``reason`` for a refusal
(429/503), and ``Retry-After`` where waiting helps.

Light on purpose (no FastAPI, no engine): tenants, quotas and SLO resolution raise
these; ``render.error_response`` answers them and ``engine_errors`` maps the engine's
outcomes to them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from adaserve.errors import RETRY_TOKEN, AdaServeError
from adaserve.server.protocol import ErrorBody, ErrorResponse

if TYPE_CHECKING:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException


class ApiError(AdaServeError):
    """An error answered to the client as an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.reason = reason

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(
                message=self.message,
                type=self.type,
                param=self.param,
                code=self.code,
                reason=self.reason,
            )
        )


def retry_after(seconds: float) -> dict[str, str]:
    """The wait before a retry: ``Retry-After`` in whole seconds rounded up, at least 1
    (RFC 9110), and ``retry-after-ms`` to the millisecond (Azure OpenAI's header, which
    the official OpenAI clients read first): a seat held for the retry is due at the
    exact wait (``core.retry_seats``)."""
    ms = max(1, math.ceil(seconds * 1000.0 - 1e-6))
    return {"Retry-After": str(max(1, math.ceil(seconds - 1e-9))), "retry-after-ms": str(ms)}


# ---------------------------------------------------------------------- kinds


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


def context_error(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="context_length_exceeded")


def overloaded(message: str, reason: str, retry_s: float, token: str | None = None) -> ApiError:
    """429: shed by admission control or the scheduler; ``token``: the seat held for a
    retry after ``retry_s`` (sent back in the ``Retry-Token`` header)."""
    headers = retry_after(retry_s)
    if token is not None:
        headers[RETRY_TOKEN] = token
    return ApiError(
        429,
        message,
        type="overloaded_error",
        code="server_overloaded",
        headers=headers,
        reason=reason,
    )


def internal_error(code: str | None = None) -> ApiError:
    return ApiError(500, "internal error", type="internal_error", code=code)


# ---------------------------------------------------------------------- framework errors


def _param_of(loc) -> str | None:
    parts = [p for p in loc if p != "body"]
    if not parts or isinstance(parts[0], int):
        return None
    out = str(parts[0])
    for p in parts[1:]:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str", "int", "list[str]", "list[int]", "list[list[int]]", "float", "bool"):
            continue  # union branch names
        else:
            out += f".{p}"
    return out


def validation_error(exc: RequestValidationError) -> ApiError:
    """400 for a body pydantic refused: malformed JSON, or the first three problems."""
    errs = exc.errors()
    if errs and errs[0].get("type") == "json_invalid":
        detail = (errs[0].get("ctx") or {}).get("error", "")
        return ApiError(400, f"malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    msgs, param = [], None
    for e in errs[:3]:
        p = _param_of(e.get("loc", ()))
        param = param or p
        msgs.append(f"{p or 'body'}: {e.get('msg', 'invalid')}")
    if len(errs) > 3:
        msgs.append(f"(+{len(errs) - 3} more)")
    return ApiError(400, "; ".join(msgs) or "invalid request", param=param, code="invalid_value")


def http_error(exc: HTTPException) -> ApiError:
    """Starlette's own errors (unknown route 404, wrong method 405, ...)."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
        exc.status_code, "invalid_request_error"
    )
    detail = exc.detail if isinstance(exc.detail, str) else "request failed"
    return ApiError(exc.status_code, detail, type=kind, headers=dict(exc.headers or {}))
