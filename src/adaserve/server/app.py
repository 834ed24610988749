"""The FastAPI app: OpenAI-compatible endpoints with per-request SLOs.

``create_app(engine_or_config, server_config)`` builds one app around one engine
thread (``EngineLoop``). Request flow for a generation:

  guard middleware: 503 while draining, 401 without a valid key (429 for an address
  locked after wrong keys), 413 for big bodies, 408 for a body that does not arrive
  within ``body_timeout_s``, 400 for a JSON body not in UTF-8
  -> pydantic body (400 on malformed JSON, invalid UTF-8, wrong types)
  -> unknown fields (400 when strict), model (404), unsupported options (400)
  -> SLO resolution (400 / 403), sampling params (400), prompt tokens and context (400)
  -> tenant quotas (429 + Retry-After) -> engine admission (429 / 503 + Retry-After)
  -> a JSON response, or SSE chunks ending with ``data: [DONE]``.

Every error body is OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.

Where things are: ``completions`` and ``chat`` (the two endpoints), ``generation``
(one request end to end), ``streaming`` (SSE), ``validation``, ``errors`` and
``engine_errors`` (error mapping), ``render`` (JSON), ``state`` (what routes share);
``config``, ``auth``, ``quotas``, ``slo_resolution`` and ``usage`` for tenants;
``dashboard`` (``/dashboard`` and its data) and ``iterations`` (the step timeline).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve import __version__
from adaserve.config import EngineConfig
from adaserve.server.auth import AUTH_PATHS, client_of
from adaserve.server.chat import create_chat
from adaserve.server.completions import create_completion
from adaserve.server.config import ServerConfig, Tenant, engine_config_for_server
from adaserve.server.dashboard import SELF_AUTH_PATHS, create_dashboard
from adaserve.server.engine_errors import shutdown_error
from adaserve.server.engine_loop import EngineLoop, model_name_of
from adaserve.server.errors import ApiError, http_error, internal_error, validation_error
from adaserve.server.fair_pool import current_tenant
from adaserve.server.generation import enter_quotas
from adaserve.server.http_runtime import mark_trusted
from adaserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from adaserve.server.render import JSON, error_response
from adaserve.server.retry_match import body_digest
from adaserve.server.state import ServerState
from adaserve.server.tokenize import detokenize, parse_tokenize, tokenize
from adaserve.server.usage_routes import create_usage_routes, past_report
from adaserve.server.validation import is_json_content, json_encoding_error
from adaserve.util.jsonsafe import json_safe

log = logging.getLogger("adaserve.server")


# ---------------------------------------------------------------------- middleware


# the endpoints whose requests the tenant's request quotas (requests per minute,
# concurrency) count: whatever becomes of them once their body is read
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
QUOTA_PATHS = (*GENERATION_PATHS, "/tokenize", "/detokenize")


class _Guard:
    """Pure ASGI middleware: drain (503), auth (401) for /v1/*, the tenant's request
    quotas (429: a request per minute and a concurrency slot, held until the response
    has ended) for generations and (de)tokenising, body size limit (413), body read
    timeout (408: the whole body within ``body_timeout_s`` of the headers). These cost
    nothing in the size of the request, so they come before it is read."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        method = scope["method"]
        entered = None  # the tenant whose request and concurrency slot this holds
        try:
            path = scope["path"]
            if path.startswith("/v1/") or path in AUTH_PATHS:
                if st.draining and method == "POST":
                    raise shutdown_error()
                # the dashboard's routes take a Bearer key or its session cookie
                if path not in SELF_AUTH_PATHS:
                    headers = Headers(scope=scope)
                    tenant = st.tenants.authenticate(headers.get("authorization"), client_of(scope))
                    scope.setdefault("state", {})["tenant"] = tenant
                    current_tenant.set(tenant.name)  # its tokenizer jobs take turns
                    if not st.tenants.open_mode:
                        mark_trusted(scope)  # a valid key: its connection is kept longest
                    if method == "POST" and path in QUOTA_PATHS:
                        await enter_quotas(st, tenant)  # before the body is read or parsed
                        entered = tenant
            if method in ("POST", "PUT", "PATCH"):
                receive = await self._buffer(scope, receive)
        except ApiError as e:
            try:
                await error_response(e)(scope, receive, send)
            finally:
                if entered is not None:
                    st.quotas.release(entered)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if entered is not None:
                st.quotas.release(entered)  # the response has ended (streams included)

    async def _buffer(self, scope, receive):
        """Read the whole body (up to the limit) and replay it to the app; a JSON body
        that is not UTF-8 (UTF-16/32) is 400 ``invalid_encoding``."""
        limit = self.state.body_limit
        why = "" if self.state.cfg.max_body_bytes else " (derived from the model's context)"
        too_big = ApiError(
            413,
            f"request body larger than {limit} bytes{why}",
            param=None,
            code="request_too_large",
            headers={"Connection": "close"},  # the rest of the body is not read
        )
        cl = Headers(scope=scope).get("content-length")
        if cl is not None:
            try:
                if int(cl) > limit:
                    raise too_big
            except ValueError:
                raise ApiError(400, "invalid Content-Length header") from None
        timeout = self.state.cfg.body_timeout_s
        clock = asyncio.get_running_loop().time
        deadline = clock() + timeout
        chunks, size = [], 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - clock()))
            except asyncio.TimeoutError:
                raise ApiError(
                    408,
                    f"request body not received within {timeout:g} s",
                    code="request_timeout",
                    headers={"Connection": "close"},
                ) from None
            if msg["type"] == "http.disconnect":
                break
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                raise too_big
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        data = b"".join(chunks)
        if scope["path"] in GENERATION_PATHS:  # a retry without its seat's token is known by it
            scope.setdefault("state", {})["body_digest"] = body_digest(data)
        if data and is_json_content(Headers(scope=scope).get("content-type")):
            bad = json_encoding_error(data)  # UTF-16/32: Python's json would take it
            if bad is not None:
                raise bad
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        return replay


# ---------------------------------------------------------------------- app


def _classes_of(source):
    if isinstance(source, EngineLoop):
        source = source._source
    if isinstance(source, EngineConfig):
        return source.classes
    return source.cfg.classes


_ANY_BODY = Body(
    ...,
    openapi_examples={
        "prompt": {"value": {"prompt": "Hello", "add_special_tokens": True}},
        "messages": {"value": {"messages": [{"role": "user", "content": "Hello"}]}},
    },
)
_bearer = HTTPBearer(auto_error=False, description="API key (not needed in open mode)")
BearerKey = Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    403: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    408: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    429: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}


def create_app(source, server_config: ServerConfig | None = None) -> FastAPI:
    """The app around an ``Engine``, an ``EngineConfig`` (built on the engine thread at
    start-up) or an already started ``EngineLoop``."""
    cfg = server_config or ServerConfig()
    if isinstance(source, EngineConfig):
        source = engine_config_for_server(source, cfg)
    if isinstance(source, EngineLoop):
        eloop = source
    else:
        eloop = EngineLoop.for_server(source, cfg)
    name = cfg.model_name or model_name_of(eloop._source)
    state = ServerState(eloop, cfg, name, _classes_of(eloop))  # subscribes to its events

    app = FastAPI(
        title="adaserve",
        version="0.1.0",
        description="OpenAI-compatible LLM serving with per-request latency SLOs.",
        lifespan=state.lifespan,
    )
    app.state.adaserve = state
    app.add_middleware(_Guard, state=state)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(http_error(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return error_response(internal_error())

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={200: {"model": CompletionResponse}, **_ERRORS},
    )
    async def completions(body: CompletionRequest, request: Request, _key: BearerKey) -> Response:
        """Text completion (OpenAI ``/v1/completions``); ``stream`` for SSE."""
        return await create_completion(state, body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletionResponse}, **_ERRORS},
    )
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, _key: BearerKey
    ) -> Response:
        """Chat completion (OpenAI ``/v1/chat/completions``); ``stream`` for SSE."""
        return await create_chat(state, body, request)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(_key: BearerKey):
        """The served model."""
        return JSON(ModelList(data=[model_card()]))

    def model_card() -> ModelCard:
        info = state.loop.ready_info
        return ModelCard(
            id=state.model_name,
            created=state.created,
            owned_by="adaserve",
            max_model_len=info.max_model_len if info else None,
        )

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str, _key: BearerKey):
        """One model by id (404 for another id)."""
        if model_id not in state.served_names:
            raise ApiError(
                404,
                f"The model {model_id!r} does not exist",
                param="model",
                type="invalid_request_error",
                code="model_not_found",
            )
        return JSON(model_card())

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize_route(request: Request, _key: BearerKey, body: dict = _ANY_BODY):
        """vLLM's tokenizer endpoint: a prompt, or messages through the chat template."""
        return JSON(await tokenize(state, parse_tokenize(body)))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize_route(body: DetokenizeRequest, _key: BearerKey):
        """vLLM's detokenizer endpoint: token ids -> text."""
        return JSON(await detokenize(state, body))

    @app.get("/version", response_model=VersionResponse)
    async def version():
        """The server's version (vLLM's ``/version``)."""
        return JSON(VersionResponse(version=__version__))

    async def ping():
        """Liveness, as vLLM's ``/ping`` (GET or POST): the same answer as /health."""
        return await health()

    @app.get("/v1/slo/report", responses=_ERRORS)
    async def slo_report(request: Request, _key: BearerKey):
        """Per class: TTFT/TPOT percentiles, attainment, goodput, verification capacity;
        per tenant: usage and charges (only the caller's, unless admin or open mode)."""
        tenant: Tenant = request.state.tenant
        only = None if (state.tenants.open_mode or tenant.admin) else tenant.name
        q = request.query_params
        if "since" in q or "until" in q:  # a past window: from the usage ledger
            return JSON(json_safe(await past_report(state, request, only)))
        rep = await asyncio.to_thread(state.slo_report, only)
        return JSON(json_safe(rep))

    @app.post("/v1/admin/profile", responses=_ERRORS)
    async def admin_profile(request: Request, _key: BearerKey):
        """The explicit admin action that adopts a fresh hardware profile: the engine
        reads its profile file again (what ``adaserve profile`` last adopted, or the
        ``--profile`` file) between two steps. The class targets stay those of the
        pair's targets record. Needs an admin key (or open mode)."""
        tenant: Tenant = request.state.tenant
        if not (state.tenants.open_mode or tenant.admin):
            raise ApiError(
                403,
                "reloading the hardware profile needs an API key with the admin role",
                type="permission_error",
                code="admin_required",
            )
        try:
            prov = await asyncio.wrap_future(state.loop.reload_profile())
        except ValueError as e:
            raise ApiError(409, str(e), code="no_profile") from None
        return JSON({"status": "reloaded", "profile": json_safe(prov)})

    @app.post("/reset_prefix_cache", responses=_ERRORS)
    async def reset_prefix_cache(request: Request, _key: BearerKey):
        """vLLM's ``/reset_prefix_cache``: forget every cached KV block between two
        steps (running requests keep theirs). Needs an admin key (or open mode)."""
        tenant: Tenant = request.state.tenant
        if not (state.tenants.open_mode or tenant.admin):
            raise ApiError(
                403,
                "resetting the prefix cache needs an API key with the admin role",
                type="permission_error",
                code="admin_required",
            )
        n = await asyncio.wrap_future(state.loop.call(lambda e: e.reset_prefix_cache()))
        return JSON({"status": "reset", "blocks_forgotten": n})

    @app.get("/health")
    async def health():
        """200 when serving; 503 while draining or when the engine thread is down (HEAD,
        as load balancers probe: the same status, no body)."""
        if not state.loop.alive:
            return JSON({"status": "unavailable"}, status_code=503)
        if state.draining:
            return JSON({"status": "draining"}, status_code=503)
        return JSON({"status": "ok", "model": state.model_name})

    app.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head")
    app.add_api_route("/ping", ping, methods=["GET"], operation_id="ping_get")
    app.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post")
    app.include_router(create_dashboard(state))
    app.include_router(create_usage_routes(state))

    @app.get("/metrics", responses={401: {"model": ErrorResponse}})
    async def metrics(request: Request, _key: BearerKey):
        """Prometheus text format. With API keys configured the per-tenant series
        (billing data) need a key: an admin tenant's shows every tenant, another
        tenant's only its own; without a key only the engine-wide series are shown."""
        return Response(_render_metrics(state, request), media_type=CONTENT_TYPE_LATEST)

    return app


def _render_metrics(state: ServerState, request: Request) -> bytes:
    """/metrics for this caller (see ``metrics``); a wrong key is 401, as on /v1/*."""
    reg = state.tenants
    if reg.open_mode:
        return state.metrics.render()
    authorization = request.headers.get("authorization")
    if not authorization:
        return state.metrics.render(tenants=False)
    tenant = reg.authenticate(authorization, client_of(request.scope))
    return state.metrics.render(only_tenant=None if tenant.admin else tenant.name)
