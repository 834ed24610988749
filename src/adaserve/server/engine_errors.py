"""The engine's outcomes as API errors: a refused submission, or a request that ended
other than by ``stop``/``length`` (shutdown, engine failure, shed by the scheduler).
Sheds are counted in the metrics and the SLO report."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from adaserve.errors import AdmissionRejected, InvalidRequestError, PromptTooLongError
from adaserve.server.engine_loop import DISCONNECTED, ENGINE_ERROR, SHUTDOWN, Final, ShuttingDown
from adaserve.server.errors import ApiError, context_error, internal_error, overloaded, retry_after

if TYPE_CHECKING:
    from adaserve.server.state import ServerState

log = logging.getLogger("adaserve.server")

NORMAL_FINISH = ("stop", "length")


def finish_reason(f: Final) -> str:
    return f.reason if f.reason in NORMAL_FINISH else "abort"


def shutdown_error() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down; the request was cancelled",
        type="service_unavailable_error",
        code="server_shutdown",
        headers=retry_after(5),
        reason=SHUTDOWN,
    )


def submit_error(
    state: ServerState, e: BaseException, cls: str, prompt_param: str, tenant: str | None = None
) -> ApiError:
    """The error of a submission the engine loop refused."""
    if isinstance(e, AdmissionRejected):
        state.shed(cls, e.reason, tenant)
        return overloaded(
            f"request shed by admission control ({e.reason}): {e}",
            e.reason,
            e.retry_after_s,
            e.retry_token,
        )
    if isinstance(e, ShuttingDown):
        state.shed(cls, SHUTDOWN, tenant, 503)
        return shutdown_error()
    if isinstance(e, PromptTooLongError):
        return context_error(str(e), prompt_param)
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e), param=e.param)
    if isinstance(e, ApiError):
        return e
    log.error("engine refused a request: %r", e)
    return internal_error("internal_error")


def final_error(
    state: ServerState, f: Final, cls: str, tenant: str | None = None
) -> ApiError | None:
    """The error of a request that did not finish normally (None when it did, or when
    it had produced tokens, or the client went away)."""
    if f.reason in NORMAL_FINISH:
        return None
    if f.reason == SHUTDOWN:
        return shutdown_error()
    if f.reason == ENGINE_ERROR:
        return ApiError(
            500, "the engine failed while running this request", type="internal_error",
            code="engine_error",
        )  # fmt: skip
    if f.completion_tokens == 0 and f.reason != DISCONNECTED:
        state.shed(cls, f.reason, tenant)
        return overloaded(f"request shed by the scheduler ({f.reason})", f.reason, 1)
    return None
