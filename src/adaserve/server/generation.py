"""One generation request end to end, whatever the endpoint: SLO resolution, token
budgets and sampling parameters, tenant quotas, submission to the engine loop, then a
whole JSON response (``collect``) or an SSE stream (``streaming.stream``)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from adaserve.errors import RETRY_TOKEN, AdmissionRejected
from adaserve.ledger import OverBudget
from adaserve.server.accounting import key_id_of
from adaserve.server.config import Tenant
from adaserve.server.engine_errors import final_error, finish_reason, submit_error
from adaserve.server.engine_loop import Final, Handle
from adaserve.server.errors import ApiError, retry_after
from adaserve.server.jobs import Endpoint, Job, Meta, next_or_disconnect, wait_disconnect
from adaserve.server.protocol import RequestMetrics, Usage
from adaserve.server.quotas import retry_after_s
from adaserve.server.render import JSON
from adaserve.server.slo_resolution import SLOChoice, resolve_slo
from adaserve.server.state import RequestCtx, ServerState
from adaserve.server.streaming import SSE, stream
from adaserve.server.structured import constraint_of, grammar_states
from adaserve.server.validation import check_choices, max_tokens_per_prompt, sampling_params
from adaserve.structured.tools import ToolMode


def _resolve(state: ServerState, body, headers, tenant: Tenant) -> SLOChoice:
    info = state.loop.ready_info
    return resolve_slo(
        classes=info.classes,
        class_slos=state.loop.class_slos,
        tenant=tenant,
        default_class=state.cfg.default_class or info.default_class,
        service_tiers=state.cfg.service_tiers,
        slo=body.slo.model_dump() if body.slo is not None else None,
        slo_class=body.slo_class,
        priority=body.priority,
        service_tier=body.service_tier,
        headers=headers,
    )


async def enter_quotas(state: ServerState, tenant: Tenant) -> None:
    """Take the tenant's request and concurrency slot (429), before the body is read or
    parsed; ``state.quotas.release`` gives the slot back when the response has ended.
    A tenant that ignored the Retry-After of its last refusal waits it out here first
    (``RetryHold``) and is then tried once more."""
    door = state.retry_hold
    try:
        await state.quotas.begin(tenant)
        return
    except ApiError as e:
        refused = e
    hold = door.hold_s(tenant.name) if refused.status == 429 else 0.0
    if hold > 0:
        door.enter(tenant.name)
        try:
            await asyncio.sleep(hold)
        finally:
            door.leave(tenant.name)
        try:
            await state.quotas.begin(tenant)
            return
        except ApiError as e:
            refused = e
    if refused.status == 429:
        door.told(tenant.name, retry_after_s(refused))
    state.rate_limited(tenant.name, refused.reason or "quota")
    raise refused


async def generate(
    state: ServerState,
    request: Request,
    body,
    endpoint: Endpoint,
    prompts: list[list[int]],
    max_tokens: int | None,
    default_max: int | None,
    echo: list[str] | None,
    prompt_param: str,
    score_only: bool = False,
    tools: ToolMode | None = None,
):
    """Generate ``body.n`` choices for every prompt (``max_tokens`` None: the rest of
    the context, capped at ``default_max``); ``echo``: the prompts' texts to prepend;
    ``tools``: how the output becomes tool calls (chat)."""
    tenant: Tenant = request.state.tenant
    n = body.n
    check_choices(state, len(prompts), n)
    constraint = constraint_of(body, tools, state.warned_guided)
    compile_start = time.perf_counter()  # a grammar's compile counts toward its TTFT
    try:
        choice = _resolve(state, body, request.headers, tenant)
    except ApiError as e:
        if e.status == 403:
            state.refused(tenant.name, body.slo_class or "", e.code or "", 403)
        raise
    per_prompt_max = max_tokens_per_prompt(state, prompts, max_tokens, default_max, prompt_param)
    prompt_tokens = sum(len(p) for p in prompts)
    # the tokens-per-minute quota reserves every choice's max_tokens up front (without
    # an explicit max_tokens, the default shrinks to what the tenant has left), so the
    # output can never overshoot it; each choice gives back what it did not use
    try:
        reserved = await state.quotas.reserve(
            tenant,
            prompt_tokens,
            [per_prompt_max[i] for i in range(len(prompts)) for _ in range(n)],
            fit=max_tokens is None,
        )
    except ApiError as e:
        if e.status == 429:  # not a 400 exceeds_quota: that one can never fit
            state.rate_limited(tenant.name, e.reason or "quota", choice.cls.name)
        raise
    params = [
        sampling_params(
            body,
            reserved[i * n + j],
            None if body.seed is None else body.seed + j,
            state.loop.ready_info.sampling_defaults,
            constraint,
        )
        for i in range(len(prompts))
        for j in range(n)
    ]
    acc = state.new_acc(
        endpoint.id_prefix + uuid.uuid4().hex,
        tenant.name,
        key_id_of(request.headers.get("authorization")),
        choice.degraded_from or choice.cls.name,  # the class asked for
    )
    # the daily and monthly budgets (after the per-minute quotas: the cheaper check);
    # from here to the ``try`` below nothing raises, so an admitted request is settled
    try:
        acc.budget_admitted = state.budgets.admit(tenant.name)
    except OverBudget as e:
        state.quotas.refund(tenant.name, prompt_tokens + sum(reserved))
        state.rate_limited(tenant.name, e.reason, choice.cls.name)
        raise budget_error(e) from None
    job = Job(state, tenant)
    job.acc = acc
    streaming = False
    try:
        grammars = [None] * len(params)
        if constraint is not None:  # compiled off the loop; a bad one is a 400
            grammars = await grammar_states(state, constraint, len(params))
        digest = getattr(request.state, "body_digest", None)
        token = (request.headers.get(RETRY_TOKEN) or "")[:64] or state.retry_match.claim(
            tenant.name, digest, request.headers
        )
        for i, ids in enumerate(prompts):
            for j in range(n):
                ctx = RequestCtx(
                    tenant.name,
                    choice.cls.name,
                    choice.cls.price_per_1k,
                    choice.degraded_from,
                    choice.source,
                    count_prompt=(j == 0),
                    reserved_tokens=reserved[i * n + j],
                    acc=acc,
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
                        drop_output=score_only,
                        grammar=grammars[i * n + j],
                        cache_salt=tenant.cache_salt(body.cache_salt),
                        tenant=tenant.name,
                        retry_token=token,
                    )
                )
                if constraint is not None:
                    # the engine judges the TTFT (and admission predicts it) from before
                    # the compile: the client waited for it
                    job.handles[-1].arrival = compile_start
        acc.arm(len(job.handles))
        results = await asyncio.gather(
            *(state.loop.submit(h) for h in job.handles), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException):
                err = submit_error(state, r, choice.cls.name, prompt_param, tenant.name)
                if isinstance(r, AdmissionRejected) and r.retry_token is not None:
                    # its client may retry without the token (the official clients)
                    state.retry_match.remember(tenant.name, digest, r.retry_token, r.retry_after_s)
                raise err
        meta = Meta(
            id=acc.id,
            created=int(time.time()),
            model=state.model_name,
            endpoint=endpoint,
            prompt_tokens=prompt_tokens,
            service_tier=body.service_tier or "default",
            echo=echo,
            stop_holdback=max((len(s) for s in params[0].stop or ()), default=1) - 1,
            skip_special_tokens=params[0].skip_special_tokens,
            n=n,
            score_only=score_only,
            tools=tools,
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            resp = await stream(state, request, job, meta, include_usage)
            streaming = isinstance(resp, SSE)
            return resp
        return await collect(state, request, job, meta)
    finally:
        if not streaming:
            job.close()
        if not acc.expected:  # never submitted: no row will settle its budget
            state.budgets.settle(tenant.name, acc.budget_admitted, 0, 0.0)


def budget_error(e: OverBudget) -> ApiError:
    """429 for a spent daily or monthly budget, ``Retry-After`` at the window's end."""
    return ApiError(
        429,
        f"budget exceeded ({e.reason}: {e.limit:g}, {e.used:g} used); retry when the window ends",
        type="rate_limit_error",
        code="budget_exceeded",
        headers=retry_after(e.retry_after_s),
        reason=e.reason,
    )


async def collect(state: ServerState, request: Request, job: Job, meta: Meta):
    """The whole response once every choice has finished (499 if the client left)."""
    finals: dict[int, Final] = {}
    disc = asyncio.ensure_future(wait_disconnect(request))
    try:
        while len(finals) < len(job.handles):
            ev = await next_or_disconnect(job.sink, disc)
            if ev is None:
                return Response(status_code=499)
            idx, final = ev[0], ev[2]
            if final is not None:
                finals[idx] = final
    finally:
        disc.cancel()
    cls, tenant = job.handles[0].ctx.cls, job.handles[0].ctx.tenant
    k = len(job.handles)
    for i in range(k):
        err = final_error(state, finals[i], cls, tenant)
        if err is not None:
            raise err
    ep = meta.endpoint
    tok = state.loop.ready_info.tokenizer
    choices = []
    for i in range(k):
        f = finals[i]
        text = f.text or ""
        # max_tokens=0: the one token generated is not in the Final (Handle.drop_output)
        fr = "length" if meta.score_only else finish_reason(f)
        out_ids, out_lps = f.output_ids, f.logprobs
        lp = ep.logprobs(tok, out_ids, out_lps)
        if (
            lp is not None
            and meta.echo is not None
            and f.prompt_logprobs is not None
            and out_lps is not None
        ):
            ids = job.handles[i].prompt_ids
            lp = ep.logprobs(tok, [*ids, *out_ids], (*f.prompt_logprobs, *out_lps))
        echo = meta.echo_of(i, k)
        if echo is not None:
            text = echo + text
        if meta.tools is not None:
            content, calls = meta.tools.parse(text)
            if calls:
                fr = "tool_calls"
            choices.append(ep.choice(i, content, lp, fr, RequestMetrics.of(f.metrics), calls))
            continue
        choices.append(ep.choice(i, text, lp, fr, RequestMetrics.of(f.metrics)))
    completion_tokens = sum(f.completion_tokens for f in finals.values())
    state.metrics.observe_request(meta.n, max(f.completion_tokens for f in finals.values()))
    await job.row_committed()  # the ledger's row, before the response
    return JSON(
        ep.response(
            id=meta.id,
            created=meta.created,
            model=meta.model,
            choices=choices,
            usage=Usage.of(meta.prompt_tokens, completion_tokens, cached_of(finals, meta.n)),
            metrics=RequestMetrics.of(finals[0].metrics),
            service_tier=meta.service_tier,
        )
    )


def cached_of(finals: dict, n: int) -> int:
    """Prompt tokens served from the prefix cache: each prompt's first choice's (the
    others share its prompt, as ``prompt_tokens`` counts it once)."""
    return sum(f.cached_tokens for i, f in finals.items() if i % n == 0)
