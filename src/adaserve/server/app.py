"""The FastAPI app: OpenAI-compatible endpoints with per-request SLOs.

``create_app(engine_or_config, server_config)`` builds one app around one engine
thread (``EngineLoop``). Request flow for a generation:

  guard middleware: 503 while draining, 401 without a valid key, 413 for big bodies
  -> pydantic body (400 on malformed JSON, invalid UTF-8, wrong types)
  -> unknown fields (400 when strict), model (404), unsupported options (400)
  -> SLO resolution (400 / 403), sampling params (400), prompt tokens and context (400)
  -> tenant quotas (429 + Retry-After) -> engine admission (429 / 503 + Retry-After)
  -> a JSON response, or SSE chunks ending with ``data: [DONE]``.

Every error body is OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Annotated

import anyio
from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaserve.config import EngineConfig
from adaserve.errors import (
    AdmissionRejected,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
)
from adaserve.sampling import SamplingParams
from adaserve.server.engine_loop import (
    DISCONNECTED,
    ENGINE_ERROR,
    SHUTDOWN,
    EngineLoop,
    Final,
    Handle,
    ShuttingDown,
    model_name_of,
)
from adaserve.server.metrics import ServerMetrics
from adaserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from adaserve.server.report import Record, ReportStore
from adaserve.server.tenants import (
    ApiError,
    QuotaBook,
    ServerConfig,
    SLOChoice,
    Tenant,
    TenantRegistry,
    UsageBook,
    check_against_classes,
    resolve_slo,
    retry_after,
)

log = logging.getLogger("adaserve.server")

NORMAL_FINISH = ("stop", "length")
ENCODE_IN_THREAD_CHARS = 32_768


class _JSON(JSONResponse):
    """JSON with every non-ASCII character escaped (so no input can break encoding)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def error_response(e: ApiError) -> _JSON:
    return _JSON(e.body(), status_code=e.status, headers=e.headers)


# ---------------------------------------------------------------------- state


@dataclass(frozen=True)
class _Ctx:
    """Per-request accounting data carried by a ``Handle``."""

    tenant: str
    cls: str
    price_per_1k: float
    degraded_from: str | None
    source: str
    count_prompt: bool


class _Job:
    """The engine requests of one HTTP request, and their clean-up."""

    def __init__(self, state: ServerState, tenant: Tenant):
        self.state = state
        self.tenant = tenant
        self.sink: asyncio.Queue = asyncio.Queue()
        self.handles: list[Handle] = []
        self._closed = False

    def close(self, reason: str = DISCONNECTED) -> None:
        """Abort unfinished requests and release the tenant's slot (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h in self.handles:
            self.state.loop.abort(h, reason)
        self.state.quotas.release(self.tenant)


class ServerState:
    """Everything the routes share: engine loop, tenants, quotas, metrics, report."""

    def __init__(self, loop: EngineLoop, cfg: ServerConfig, model_name: str, classes):
        self.loop = loop
        self.cfg = cfg
        self.model_name = model_name
        self.served_names = {model_name}
        self.tenants = TenantRegistry(cfg.tenants)
        self.quotas = QuotaBook(cfg.tenants)
        self.usage = UsageBook()
        names = [c.name for c in classes]
        self.report = ReportStore(names)
        self.metrics = ServerMetrics(
            model_name, names, lambda: self.loop.snapshot, self.report.attainment
        )
        self.draining = False
        self._drain_started = False
        self.created = int(time.time())

    # ------------------------------------------------------------------ lifecycle
    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await asyncio.to_thread(self.loop.start)
        info = self.loop.info
        check_against_classes(self.cfg, info.classes)
        self.served_names.add(info.model_dir)
        if self.tenants.open_mode:
            log.warning(
                "no API keys configured: open local mode, every request is accepted "
                "as tenant 'anonymous' with every SLO class and no quotas"
            )
        else:
            log.info(
                "%d tenant(s) with API keys configured; requests need a Bearer key",
                len(self.tenants.tenants),
            )
        log.info(
            "serving %s (policy %s, context %d)", self.model_name, info.policy, info.max_model_len
        )
        try:
            yield
        finally:
            self.draining = True
            await asyncio.to_thread(self.loop.stop)

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Stop taking requests; in-flight ones get ``grace_s`` to finish, then are
        cancelled with a ``server_shutdown`` error."""
        if self._drain_started:
            return
        self._drain_started = True
        self.draining = True
        grace = self.cfg.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down: refusing new requests, %.1f s for those in flight", grace)
        self.loop.drain(grace)

    # ------------------------------------------------------------------ finish hook
    def on_finish(self, h: Handle, final: Final) -> None:
        """Account a finished request (engine thread)."""
        ctx: _Ctx = h.ctx
        pt = final.prompt_tokens if ctx.count_prompt else 0
        charge = self.usage.record(
            ctx.tenant, ctx.cls, pt, final.completion_tokens, ctx.price_per_1k
        )
        self.quotas.charge_output(ctx.tenant, final.completion_tokens)
        m = final.metrics
        m["charge"] = charge
        m["slo_source"] = ctx.source
        if ctx.degraded_from:
            m["degraded_from"] = ctx.degraded_from
        self.metrics.observe_finish(ctx.cls, ctx.tenant, final, charge)
        self.report.record(
            Record(
                cls=ctx.cls,
                tenant=ctx.tenant,
                reason=final.reason,
                ttft_ms=m.get("ttft_ms"),
                tpot_ms=m.get("tpot_ms"),
                e2e_ms=m.get("e2e_ms"),
                queue_ms=m.get("queue_ms"),
                attained=bool(m.get("slo_attained")),
                output_tokens=final.completion_tokens,
                tree_nodes=int(m.get("tree_nodes") or 0),
                accepted_tokens=int(m.get("accepted_tokens") or 0),
                arrival=final.arrival,
                finished_at=final.finished_at,
                degraded_from=ctx.degraded_from,
            )
        )

    # ------------------------------------------------------------------ checks
    def check_body(self, body) -> None:
        """Unknown fields (when strict), model, and options we do not implement."""
        extra = sorted((body.model_extra or {}).keys())
        if extra and self.cfg.strict_fields:
            raise ApiError(
                400,
                f"Unrecognized request argument supplied: {', '.join(extra)}",
                param=extra[0],
                code="unknown_parameter",
            )
        if body.model is not None and body.model not in self.served_names:
            raise ApiError(
                404,
                f"The model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise _unsupported(name, "penalties are not supported")
        if body.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported")
        if body.repetition_penalty not in (None, 1.0):
            raise _unsupported(
                "repetition_penalty", "repetition_penalty other than 1 is not supported"
            )

    def resolve(self, body, headers, tenant: Tenant) -> SLOChoice:
        info = self.loop.info
        return resolve_slo(
            classes=info.classes,
            class_slos=self.loop.class_slos,
            tenant=tenant,
            default_class=self.cfg.default_class or info.default_class,
            service_tiers=self.cfg.service_tiers,
            slo=body.slo.model_dump() if body.slo is not None else None,
            slo_class=body.slo_class,
            priority=body.priority,
            service_tier=body.service_tier,
            headers=headers,
        )

    async def encode(self, text: str, param: str) -> list[int]:
        tok = self.loop.info.tokenizer
        if tok is None:
            raise ApiError(
                400, "this model has no tokenizer: send prompts as token ids", param=param
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{param} is not valid UTF-8 text", param=param) from None
        if len(text) > ENCODE_IN_THREAD_CHARS:
            return await asyncio.to_thread(tok.encode, text)
        return tok.encode(text)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ApiError(400, f"{param} is empty", param=param)
        V = self.loop.info.vocab_size
        if not all(0 <= t < V for t in ids):
            raise ApiError(400, f"token ids must be integers in [0, {V})", param=param)
        return ids

    # ------------------------------------------------------------------ generation
    async def completion(self, body: CompletionRequest, request: Request):
        self.check_body(body)
        if body.suffix:
            raise _unsupported("suffix", "suffix is not supported")
        if body.best_of not in (None, 1):
            raise _unsupported("best_of", "best_of > 1 is not supported")
        score_only = body.max_tokens == 0  # OpenAI's scoring form: echo, no completion
        if score_only and not body.echo:
            raise ApiError(
                400, "max_tokens must be at least 1 (0 only with echo=true)", param="max_tokens"
            )
        if score_only and body.stream:
            raise _unsupported("max_tokens", "max_tokens=0 (scoring the prompt) is not streamed")
        p = body.prompt
        if isinstance(p, str):
            prompts = [self.check_ids(await self.encode(p, "prompt"), "prompt")]
        elif not p:
            raise ApiError(400, "prompt is empty", param="prompt")
        elif isinstance(p[0], str):
            prompts = [self.check_ids(await self.encode(s, "prompt"), "prompt") for s in p]
        elif isinstance(p[0], int):
            prompts = [self.check_ids(list(p), "prompt")]
        else:
            prompts = [self.check_ids(list(ids), "prompt") for ids in p]
        echo = None
        if body.echo:
            tok = self.loop.info.tokenizer
            echo = [tok.decode(ids) if tok is not None else "" for ids in prompts]
        return await self._generate(
            request,
            body,
            "completion",
            prompts,
            1 if score_only else body.max_tokens,  # one token is generated and dropped
            16,
            echo,
            "prompt",
            score_only=score_only,
        )

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_body(body)
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        if not body.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        tok = self.loop.info.tokenizer
        if tok is None:
            raise ApiError(
                400, "this model has no tokenizer: chat completions are unavailable", "messages"
            )
        msgs = []
        for m in body.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            msgs.append(d)
        try:
            if sum(len(d["content"]) for d in msgs) > ENCODE_IN_THREAD_CHARS:
                text = await asyncio.to_thread(tok.apply_chat_template, msgs)
            else:
                text = tok.apply_chat_template(msgs)
        except ModelLoadError as e:
            raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from e
        prompt = self.check_ids(await self.encode(text, "messages"), "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generate(
            request,
            body,
            "chat",
            [prompt],
            max_tokens,
            self.cfg.default_max_tokens,
            None,
            "messages",
        )

    def _params(self, body, max_tokens: int, seed: int | None) -> SamplingParams:
        stop = body.stop
        if isinstance(stop, list) and not stop:
            stop = None
        if isinstance(stop, list) and len(stop) > 16:
            raise ApiError(400, "at most 16 stop sequences", param="stop")
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                min_p=body.min_p or 0.0,
                max_tokens=max_tokens,
                seed=seed,
                stop=stop,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                logprobs=_requested_logprobs(body),
                prompt_logprobs=body.logprobs if getattr(body, "echo", False) else None,
            )
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None

    async def _generate(
        self,
        request: Request,
        body,
        kind: str,
        prompts: list[list[int]],
        max_tokens: int | None,
        default_max: int | None,
        echo: list[str] | None,
        prompt_param: str,
        score_only: bool = False,
    ):
        info = self.loop.info
        tenant: Tenant = request.state.tenant
        n = body.n
        if len(prompts) * n > self.cfg.max_choices:
            raise ApiError(
                400,
                f"{len(prompts)} prompts x n={n} exceeds {self.cfg.max_choices} choices",
                param="n",
            )
        choice = self.resolve(body, request.headers, tenant)
        L = info.max_model_len
        per_prompt_max = []
        for ids in prompts:
            if len(ids) + 1 > L:
                raise _context_error(
                    f"This model's maximum context length is {L} tokens; the prompt has "
                    f"{len(ids)} tokens",
                    prompt_param,
                )
            room = L - len(ids)
            if max_tokens is not None:
                if max_tokens > room:
                    raise _context_error(
                        f"This model's maximum context length is {L} tokens. However, you "
                        f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                        f"{max_tokens} in the completion)",
                        "max_tokens",
                    )
                per_prompt_max.append(max_tokens)
            else:
                per_prompt_max.append(min(room, default_max) if default_max else room)
        params = [
            self._params(body, per_prompt_max[i], None if body.seed is None else body.seed + j)
            for i in range(len(prompts))
            for j in range(n)
        ]
        prompt_tokens = sum(len(p) for p in prompts)
        try:
            self.quotas.admit(tenant, prompt_tokens)
        except ApiError as e:
            self.metrics.observe_rate_limited(tenant.name, e.reason or "quota")
            self.report.rate_limited(tenant.name, e.reason or "quota")
            raise
        job = _Job(self, tenant)
        streaming = False
        try:
            for i, ids in enumerate(prompts):
                for j in range(n):
                    ctx = _Ctx(
                        tenant.name,
                        choice.cls.name,
                        choice.cls.price_per_1k,
                        choice.degraded_from,
                        choice.source,
                        count_prompt=(j == 0),
                    )
                    job.handles.append(
                        Handle(
                            ids,
                            params[i * n + j],
                            choice.slo,
                            sink=job.sink,
                            index=i * n + j,
                            want_tokens=body.stream,
                            ctx=ctx,
                        )
                    )
            results = await asyncio.gather(
                *(self.loop.submit(h) for h in job.handles), return_exceptions=True
            )
            for r in results:
                if isinstance(r, BaseException):
                    raise self._submit_error(r, choice.cls.name, prompt_param)
            meta = _Meta(
                id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex,
                created=int(time.time()),
                model=self.model_name,
                kind=kind,
                prompt_tokens=prompt_tokens,
                service_tier=body.service_tier or "default",
                echo=echo,
                stop_holdback=max((len(s) for s in params[0].stop or ()), default=1) - 1,
                score_only=score_only,
            )
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                resp = await self._stream(request, job, meta, include_usage)
                streaming = isinstance(resp, _SSE)
                return resp
            return await self._collect(request, job, meta)
        finally:
            if not streaming:
                job.close()

    def _submit_error(self, e: BaseException, cls: str, prompt_param: str) -> Exception:
        if isinstance(e, AdmissionRejected):
            self.metrics.observe_shed(cls, e.reason)
            self.report.shed(cls, e.reason)
            return ApiError(
                429,
                f"request shed by admission control ({e.reason}): {e}",
                type="overloaded_error",
                code="server_overloaded",
                headers=retry_after(e.retry_after_s),
                reason=e.reason,
            )
        if isinstance(e, ShuttingDown):
            self.metrics.observe_shed(cls, SHUTDOWN)
            self.report.shed(cls, SHUTDOWN)
            return _shutdown_error()
        if isinstance(e, PromptTooLongError):
            return _context_error(str(e), prompt_param)
        if isinstance(e, InvalidRequestError):
            return ApiError(400, str(e), param=e.param)
        if isinstance(e, ApiError):
            return e
        log.error("engine refused a request: %r", e)
        return ApiError(500, "internal error", type="internal_error", code="internal_error")

    def _final_error(self, f: Final, cls: str) -> ApiError | None:
        if f.reason in NORMAL_FINISH:
            return None
        if f.reason == SHUTDOWN:
            return _shutdown_error()
        if f.reason == ENGINE_ERROR:
            return ApiError(
                500, "the engine failed while running this request", type="internal_error",
                code="engine_error",
            )  # fmt: skip
        if f.completion_tokens == 0 and f.reason != DISCONNECTED:
            self.metrics.observe_shed(cls, f.reason)
            self.report.shed(cls, f.reason)
            return ApiError(
                429,
                f"request shed by the scheduler ({f.reason})",
                type="overloaded_error",
                code="server_overloaded",
                headers=retry_after(1),
                reason=f.reason,
            )
        return None

    async def _collect(self, request: Request, job: _Job, meta: _Meta):
        finals: dict[int, Final] = {}
        disc = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while len(finals) < len(job.handles):
                ev = await _next_or_disconnect(job.sink, disc)
                if ev is None:
                    return Response(status_code=499)
                idx, final = ev[0], ev[2]
                if final is not None:
                    finals[idx] = final
        finally:
            disc.cancel()
        cls = job.handles[0].ctx.cls
        for i in range(len(job.handles)):
            err = self._final_error(finals[i], cls)
            if err is not None:
                raise err
        choices = []
        tok = self.loop.info.tokenizer
        for i in range(len(job.handles)):
            f = finals[i]
            text = f.text or ""
            fr = _finish_reason(f)
            out_ids, out_lps = f.output_ids, f.logprobs
            if meta.score_only:  # max_tokens=0: the one token generated is dropped
                text, fr, out_ids = "", "length", []
                out_lps = None if out_lps is None else ()
            lp = _logprobs_json(tok, meta.kind, out_ids, out_lps)
            if lp is not None and meta.echo is not None and f.prompt_logprobs is not None:
                ids = job.handles[i].prompt_ids
                lp = _logprobs_json(
                    tok, meta.kind, [*ids, *out_ids], (*f.prompt_logprobs, *out_lps)
                )
            if meta.kind == "chat":
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": lp,
                        "finish_reason": fr,
                        "metrics": f.metrics,
                    }
                )
            else:
                if meta.echo is not None:
                    text = meta.echo[i // (len(job.handles) // len(meta.echo))] + text
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": fr,
                        "metrics": f.metrics,
                    }
                )
        completion_tokens = sum(f.completion_tokens for f in finals.values())
        if meta.score_only:
            completion_tokens = 0
        return _JSON(
            {
                "id": meta.id,
                "object": "chat.completion" if meta.kind == "chat" else "text_completion",
                "created": meta.created,
                "model": meta.model,
                "choices": choices,
                "usage": _usage(meta.prompt_tokens, completion_tokens),
                "metrics": finals[0].metrics,
                "service_tier": meta.service_tier,
            }
        )

    async def _stream(self, request: Request, job: _Job, meta: _Meta, include_usage: bool):
        """Wait for the first event (so early failures are real HTTP errors), then SSE."""
        disc = asyncio.ensure_future(_wait_disconnect(request))
        try:
            first = await _next_or_disconnect(job.sink, disc)
        finally:
            disc.cancel()
        if first is None:
            return Response(status_code=499)
        final = first[2]
        if final is not None:
            err = self._final_error(final, job.handles[0].ctx.cls)
            if err is not None:
                raise err
        gen = self._events(job, meta, first, include_usage)
        return _SSE(gen, on_close=job.close)

    async def _events(self, job: _Job, meta: _Meta, first, include_usage: bool):
        tok = self.loop.info.tokenizer
        k = len(job.handles)
        detok = [_Detok(tok, meta.stop_holdback) for _ in range(k)]
        chat = meta.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: str | None, finish=None, metrics=None, lp=None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if text is None and finish is None:
                    delta = {"role": "assistant", "content": ""}
                c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                c = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
            out = {
                "id": meta.id,
                "object": obj,
                "created": meta.created,
                "model": meta.model,
                "choices": [c],
            }
            if metrics is not None:
                out["metrics"] = metrics
            return f"data: {_dumps(out)}\n\n"

        for i in range(k):
            if chat:
                yield chunk(i, None)
            elif meta.echo is not None:
                yield chunk(i, meta.echo[i // (k // len(meta.echo))])
        left = k
        completion_tokens = 0
        ev = first
        while True:
            idx, new, final, lps, plps = ev
            lp_ids, lp_entries = new, lps
            if plps is not None and lps is not None:  # echo: the prompt's logprobs first
                lp_ids, lp_entries = [*job.handles[idx].prompt_ids, *new], (*plps, *lps)
            lp = _logprobs_json(tok, meta.kind, lp_ids, lp_entries) if lp_entries else None
            if final is None:
                delta = detok[idx].push(new)
                if delta or lp:
                    yield chunk(idx, delta, lp=lp)
            else:
                left -= 1
                completion_tokens += final.completion_tokens
                err = self._final_error(final, job.handles[idx].ctx.cls)
                if err is not None:
                    job.close(SHUTDOWN)
                    yield f"data: {_dumps(err.body())}\n\n"
                    break
                delta = detok[idx].finish(final.text)
                yield chunk(idx, delta or None, _finish_reason(final), final.metrics, lp=lp)
                if left == 0:
                    break
            ev = await job.sink.get()
        if include_usage and left == 0:
            usage = {
                "id": meta.id,
                "object": obj,
                "created": meta.created,
                "model": meta.model,
                "choices": [],
                "usage": _usage(meta.prompt_tokens, completion_tokens),
            }
            yield f"data: {_dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"


def _requested_logprobs(body) -> int | None:
    """SamplingParams.logprobs of a request: completions' ``logprobs: N``, chat's
    ``logprobs: true`` with ``top_logprobs: N`` (0 when absent); None when not asked."""
    lp = getattr(body, "logprobs", None)
    if isinstance(lp, bool):
        return (body.top_logprobs or 0) if lp else None
    return lp


def _token_text(tok, token_id: int) -> str:
    """The text of one token (``token_id:N`` without a tokenizer, as vLLM writes it)."""
    return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"


def _logprobs_json(tok, kind: str, ids, entries) -> dict | None:
    """The OpenAI ``logprobs`` object of some output tokens: chat's ``{"content": [...]}``
    or completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
    ``entries``: (logprob, ((id, logprob), ...)) per token, or None (not requested)."""
    if entries is None:
        return None
    ids = list(ids)[: len(entries)]
    texts = [_token_text(tok, t) for t in ids]
    if kind == "chat":

        def item(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**item(s, lp), "top_logprobs": [item(_token_text(tok, t), v) for t, v in top]}
                for s, (lp, top) in zip(texts, entries)
            ]
        }
    offsets, pos = [], 0
    for s in texts:
        offsets.append(pos)
        pos += len(s)
    return {  # an echoed prompt's first token has no logprob: None, as OpenAI's
        "tokens": texts,
        "token_logprobs": [None if e is None else e[0] for e in entries],
        "top_logprobs": [
            None if e is None else {_token_text(tok, t): v for t, v in e[1]} for e in entries
        ],
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class _Meta:
    id: str
    created: int
    model: str
    kind: str
    prompt_tokens: int
    service_tier: str
    echo: list[str] | None
    stop_holdback: int
    score_only: bool = False  # max_tokens=0 with echo: the generated token is dropped


class _Detok:
    """Incremental detokenisation (the HF/vLLM scheme): each step decodes only the tokens
    since the last clean boundary (with the previous chunk as left context), so a stream
    costs O(length), not O(length^2). Text that ends in a partial UTF-8 character waits
    for the next token; the last (longest stop string - 1) characters are held back until
    the request finishes, because the engine cuts the output where a stop string starts.
    The final chunk completes the engine's own (full) decode of the output."""

    def __init__(self, tok, holdback: int):
        self.tok = tok
        self.holdback = max(0, holdback)
        self.ids: list[int] = []
        self.prefix = 0  # start of the left-context tokens
        self.read = 0  # tokens up to here are in self.text
        self.prefix_text = ""
        self.text = ""
        self.emitted = 0

    def push(self, new: list[int]) -> str:
        if self.tok is None or not new:
            return ""
        self.ids.extend(new)
        new_text = self.tok.decode(self.ids[self.prefix :])
        if len(new_text) > len(self.prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(self.prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
        end = len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def finish(self, final_text: str | None) -> str:
        if final_text is None or len(final_text) <= self.emitted:
            return ""
        if not final_text.startswith(self.text[: self.emitted]):
            log.debug("incremental detokenisation diverged from the full decode")
        out = final_text[self.emitted :]
        self.emitted = len(final_text)
        return out


class _SSE(StreamingResponse):
    """Server-sent events that always watch for the client going away: on disconnect
    the body task is cancelled and ``on_close`` aborts the requests at once."""

    def __init__(self, gen, on_close):
        super().__init__(
            gen,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def body() -> None:
                    with suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(body)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            with anyio.CancelScope(shield=True):
                with suppress(Exception):
                    await self.body_iterator.aclose()


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _next_or_disconnect(sink: asyncio.Queue, disc: asyncio.Future):
    """The next sink event, or None when the client disconnected first."""
    if not sink.empty():
        return sink.get_nowait()
    get = asyncio.ensure_future(sink.get())
    try:
        done, _ = await asyncio.wait({get, disc}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        get.cancel()
        raise
    if get in done:
        return get.result()
    get.cancel()
    return None


def _finish_reason(f: Final) -> str:
    return f.reason if f.reason in NORMAL_FINISH else "abort"


def _usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


def _context_error(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="context_length_exceeded")


def _shutdown_error() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down; the request was cancelled",
        type="service_unavailable_error",
        code="server_shutdown",
        headers=retry_after(5),
        reason=SHUTDOWN,
    )


# ---------------------------------------------------------------------- middleware


class _Guard:
    """Pure ASGI middleware: drain (503), auth (401) for /v1/*, body size limit (413)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        method = scope["method"]
        try:
            if scope["path"].startswith("/v1/"):
                if st.draining and method == "POST":
                    raise _shutdown_error()
                headers = Headers(scope=scope)
                tenant = st.tenants.authenticate(headers.get("authorization"))
                scope.setdefault("state", {})["tenant"] = tenant
            if method in ("POST", "PUT", "PATCH"):
                receive = await self._buffer(scope, receive)
        except ApiError as e:
            await error_response(e)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _buffer(self, scope, receive):
        """Read the whole body (up to the limit) and replay it to the app."""
        limit = self.state.cfg.max_body_bytes
        too_big = ApiError(
            413,
            f"request body larger than {limit} bytes",
            param=None,
            code="request_too_large",
        )
        cl = Headers(scope=scope).get("content-length")
        if cl is not None:
            try:
                if int(cl) > limit:
                    raise too_big
            except ValueError:
                raise ApiError(400, "invalid Content-Length header") from None
        chunks, size = [], 0
        while True:
            msg = await receive()
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
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        return replay


# ---------------------------------------------------------------------- app


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


def _validation_error(exc: RequestValidationError) -> ApiError:
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


def _classes_of(source):
    if isinstance(source, EngineLoop):
        source = source._source
    if isinstance(source, EngineConfig):
        return source.classes
    return source.cfg.classes


_bearer = HTTPBearer(auto_error=False, description="API key (not needed in open mode)")
BearerKey = Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]

_ERRORS = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    403: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    429: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}


def engine_config_for_server(ecfg: EngineConfig, cfg: ServerConfig) -> EngineConfig:
    """The engine configuration a server runs: the config file's classes, and engine
    admission control on (with ``server.max_waiting`` as its queue cap when set)."""
    repl: dict = {"admission": True}
    if cfg.max_waiting is not None:
        repl["max_waiting"] = cfg.max_waiting
    if cfg.classes is not None:
        names = [c.name for c in cfg.classes]
        repl["classes"] = cfg.classes
        repl["default_class"] = cfg.default_class or (
            ecfg.default_class if ecfg.default_class in names else names[0]
        )
    elif cfg.default_class is not None:
        repl["default_class"] = cfg.default_class
    return dataclasses.replace(ecfg, **repl)


def create_app(source, server_config: ServerConfig | None = None) -> FastAPI:
    """The app around an ``Engine``, an ``EngineConfig`` (built on the engine thread at
    start-up) or an already started ``EngineLoop``."""
    cfg = server_config or ServerConfig()
    if isinstance(source, EngineConfig):
        source = engine_config_for_server(source, cfg)
    if isinstance(source, EngineLoop):
        eloop = source
    else:
        eloop = EngineLoop(source, max_waiting=cfg.max_waiting, step_delay_s=cfg.step_delay_s)
    name = cfg.model_name or model_name_of(eloop._source)
    state = ServerState(eloop, cfg, name, _classes_of(eloop))
    eloop.on_finish = state.on_finish

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
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error"
        )
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        err = ApiError(exc.status_code, detail, type=kind, headers=dict(exc.headers or {}))
        return error_response(err)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return error_response(ApiError(500, "internal error", type="internal_error"))

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={200: {"model": CompletionResponse}, **_ERRORS},
    )
    async def completions(body: CompletionRequest, request: Request, _key: BearerKey) -> Response:
        """Text completion (OpenAI ``/v1/completions``); ``stream`` for SSE."""
        return await state.completion(body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletionResponse}, **_ERRORS},
    )
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, _key: BearerKey
    ) -> Response:
        """Chat completion (OpenAI ``/v1/chat/completions``); ``stream`` for SSE."""
        return await state.chat(body, request)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(_key: BearerKey):
        """The served model."""
        info = state.loop.info
        return _JSON(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_name,
                        "object": "model",
                        "created": state.created,
                        "owned_by": "adaserve",
                        "max_model_len": info.max_model_len if info else None,
                    }
                ],
            }
        )

    @app.get("/v1/slo/report", responses=_ERRORS)
    async def slo_report(request: Request, _key: BearerKey):
        """Per class: TTFT/TPOT percentiles, attainment, goodput, verification capacity;
        per tenant: usage and charges (only the caller's, unless admin or open mode)."""
        tenant: Tenant = request.state.tenant
        only = None if (state.tenants.open_mode or tenant.admin) else tenant.name
        info = state.loop.info
        snap = state.loop.snapshot
        slos = state.loop.class_slos
        rep = await asyncio.to_thread(
            state.report.build,
            class_targets={
                c: {"tpot_ms": s.tpot_ms, "ttft_ms": s.ttft_ms} for c, s in slos.items()
            },
            prices={c.name: c.price_per_1k for c in info.classes},
            flops_per_token=info.flops_per_token_target,
            usage=state.usage.by_tenant(only),
            engine={
                "policy": info.policy,
                "running": snap.running,
                "waiting": snap.waiting,
                "kv_usage": snap.kv_usage,
                "iterations": snap.counters.get("iterations", 0),
                "fallback_iterations": snap.counters.get("fallback_iterations", {}),
                "spec_draft_tokens": snap.counters.get("spec_draft_tokens", 0),
                "spec_accepted_tokens": snap.counters.get("spec_accepted_tokens", 0),
            },
            tenant=only,
        )
        rep["model"] = state.model_name
        return _JSON(_jsonable(rep))

    @app.get("/health")
    async def health():
        """200 when serving; 503 while draining or when the engine thread is down."""
        if not state.loop.alive:
            return _JSON({"status": "unavailable"}, status_code=503)
        if state.draining:
            return _JSON({"status": "draining"}, status_code=503)
        return _JSON({"status": "ok", "model": state.model_name})

    @app.get("/metrics")
    async def metrics():
        """Prometheus text format."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _jsonable(v):
    if isinstance(v, float):
        return v if v == v and abs(v) != float("inf") else None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v
