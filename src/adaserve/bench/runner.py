"""Drive a workload through the engine in-process (real time) or an HTTP server.

In-process: items are added at their arrival times (``arrival = t0 + item.arrival_s``)
and ``engine.step()`` runs while there is work; the loop sleeps until the next arrival
when idle. Engine-side shifts (``draft-noise``, ``kv-pressure``) are applied at their
times through ``engine.faults``. Every iteration's trace goes to a ``RunRecorder`` (one
timeline sample per iteration, the energy tally), the simulator's too.

HTTP: each request is a streaming ``POST /v1/completions`` sent at its arrival time; the
SLO travels as ``slo: {tpot_ms, ttft_ms}`` and ``slo_class`` (our extensions) and as
vLLM's integer ``priority`` (the class rank; ``send_priority=False`` leaves it out for
servers that reject it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import sys
import time

from adaserve.bench.metrics import RequestRecord
from adaserve.bench.workload_spec import WorkItem, WorkloadSpec, item_slo
from adaserve.core.admission import TTFT_DEADLINE
from adaserve.core.clock import ManualClock
from adaserve.core.trace import ModelCosts, RunRecorder, RunTimeline
from adaserve.errors import AdaServeError, AdmissionRejected
from adaserve.slo import DEFAULT_CLASSES, SLO, SLOClass

log = logging.getLogger("adaserve.bench")


# ---------------------------------------------------------------------- SLO targets
def class_slos(
    class_names,
    slo_scale: float = 1.0,
    engine=None,
    unloaded_tpot_ms: float | None = None,
    classes: tuple[SLOClass, ...] = DEFAULT_CLASSES,
) -> dict[str, SLO]:
    """Per-class SLO: the engine's classes (TPOT resolved from the measured unloaded
    TPOT) or ``classes`` resolved with ``unloaded_tpot_ms``; TPOT times ``slo_scale``.
    A class the engine does not know gets no targets."""
    out: dict[str, SLO] = {}
    for name in class_names:
        if engine is not None:
            known = {c.name for c in engine.cfg.classes}
            base = engine.class_slo(name) if name in known else SLO(cls=name)
        else:
            c = next((c for c in classes if c.name == name), None)
            if c is not None and unloaded_tpot_ms is None and c.tpot_ms is None:
                raise AdaServeError("class TPOT targets need the unloaded TPOT")
            base = c.resolve(unloaded_tpot_ms or 0.0) if c is not None else SLO(cls=name)
        tpot = base.tpot_ms * slo_scale if base.tpot_ms is not None else None
        out[name] = SLO(
            tpot_ms=tpot,
            ttft_ms=base.ttft_ms,
            max_queue_ms=base.max_queue_ms,
            deadline_ms=base.deadline_ms,
            cls=name,
        )
    return out


def class_ranks(classes: tuple[SLOClass, ...] = DEFAULT_CLASSES) -> dict[str, int]:
    return {c.name: c.rank for c in classes}


# ---------------------------------------------------------------------- engines
class EngineFactory:
    """``factory(policy) -> Engine``: builds one engine and reuses it for every policy
    (``Engine.set_policy`` and ``Engine.reset_stats``), so models load and the hardware
    profile is measured once."""

    def __init__(self, cfg, reuse: bool = True):
        self.cfg = cfg
        self.reuse = reuse
        self.engine = None

    def _build(self, policy: str):
        from dataclasses import replace

        from adaserve.engine import build_engine

        # build with a drafting policy so the hardware profile is loaded
        first = "adaserve" if not self.cfg.no_draft else policy
        return build_engine(replace(self.cfg, policy=first))

    def __call__(self, policy: str):
        if self.engine is None or not self.reuse:
            self.engine = self._build(policy)
        eng = self.engine
        set_policy(eng, policy)
        eng.reset_stats()
        return eng


def set_policy(engine, policy: str) -> None:
    """Switch ``engine`` to ``policy``, loading the hardware profile if it needs one."""
    from adaserve.sched.registry import make_policy

    pol = make_policy(policy)
    if pol.uses_draft and engine.draft is None:
        raise AdaServeError(f"policy {policy!r} needs a draft model")
    if pol.uses_draft and engine.hw is None:
        from adaserve.profile import load_or_profile

        engine.set_hardware(load_or_profile(engine, auto=engine.cfg.auto_profile))
    engine.set_policy(pol)


def warmup(engine, n_tokens: int = 8) -> None:
    """One short request to completion (first-call costs), then reset counters."""
    from adaserve.sampling import SamplingParams

    V = engine.target.cfg.vocab_size
    ids = [1 + (i * 7) % max(1, V - 2) for i in range(16)]
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.reset_stats()


# ---------------------------------------------------------------------- in-process
def _apply_shift(engine, shift) -> None:
    from dataclasses import replace

    if shift.kind == "draft-noise":
        engine.set_faults(replace(engine.faults, draft_noise=float(shift.value)))
    elif shift.kind == "kv-pressure":
        engine.set_faults(replace(engine.faults, kv_reserved=float(shift.value)))


def run_in_process(
    engine_factory,
    policy: str,
    items: list[WorkItem],
    spec: WorkloadSpec,
    progress: bool = True,
    *,
    slos: dict[str, SLO] | None = None,
    max_wall_s: float | None = None,
    do_warmup: bool = True,
) -> tuple[list[RequestRecord], RunTimeline]:
    """Run ``items`` through ``engine_factory(policy)`` in real time (the engine's
    clock).

    ``slos`` maps class -> SLO (default: the engine's classes times ``spec.slo_scale``).
    ``max_wall_s`` aborts what is left after that long (recorded as errors).
    Returns the per-request records (times relative to the start) and the timeline.
    """
    from adaserve.sampling import SamplingParams

    engine = engine_factory(policy)
    if do_warmup:
        warmup(engine)
    if slos is None:
        slos = class_slos(sorted({it.cls for it in items}), spec.slo_scale, engine=engine)
    items = sorted(items, key=lambda it: (it.arrival_s, it.idx))
    shifts = sorted((s for s in spec.shifts if s.engine_side), key=lambda s: s.at_s)
    if max_wall_s is None:
        last = items[-1].arrival_s if items else 0.0
        max_wall_s = 3.0 * last + 600.0

    clock = engine.clock
    costs = ModelCosts(
        (engine.flops_per_token_target, engine.flops_per_token_draft),
        engine.runner.weight_bytes,
        engine.kv_bytes_per_slot,
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc=policy, unit="req", leave=False)

    records: list[RequestRecord] = []
    live: dict[int, tuple[WorkItem, object, SLO]] = {}
    applied: list[dict] = []
    t0 = clock.now()
    recorder = RunRecorder(costs, t0=t0)
    timeline = recorder.timeline

    def rel(x: float | None) -> float | None:
        return None if x is None else x - t0

    def collect(req, item: WorkItem, slo: SLO) -> None:
        records.append(
            RequestRecord(
                idx=item.idx,
                cls=item.cls,
                arrival_s=req.arrival - t0,
                first_token_s=rel(req.first_token_at),
                finish_s=rel(req.finished_at),
                token_times_s=[t - t0 for t in req.token_times],
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_prompt,
                output_tokens=req.num_output,
                tpot_target_ms=slo.tpot_ms,
                ttft_target_ms=slo.ttft_ms,
                drafted=req.stats.drafted_tokens,
                verified=req.stats.verified_tokens,
                accepted=req.stats.accepted_tokens,
                finish_reason=req.finish_reason,
                degraded=req.degraded_from is not None,
                steps=req.stats.steps,
            )
        )
        if bar is not None:
            bar.update(1)

    def fail(item: WorkItem, slo: SLO | None, err: str, shed: bool) -> None:
        records.append(RequestRecord.failed(item, slo, err, shed))
        if bar is not None:
            bar.update(1)

    i = 0
    try:
        while True:
            now = clock.now() - t0
            while shifts and shifts[0].at_s <= now:
                s = shifts.pop(0)
                _apply_shift(engine, s)
                applied.append({"at_s": s.at_s, "applied_s": now, "change": s.change})
            while i < len(items) and items[i].arrival_s <= now:
                it = items[i]
                i += 1
                slo = item_slo(it, slos.get(it.cls))
                prompt = it.prompt_ids if it.prompt_ids is not None else it.prompt
                params = SamplingParams(temperature=0.0, max_tokens=it.max_tokens, ignore_eos=True)
                try:
                    req = engine.add_request(prompt, params, slo, arrival=t0 + it.arrival_s)
                except AdmissionRejected as e:
                    fail(it, slo, f"shed: {e.reason}", shed=True)
                    continue
                except AdaServeError as e:
                    fail(it, slo, str(e), shed=False)
                    continue
                live[req.rid] = (it, req, slo)
            if now > max_wall_s:
                break
            if engine.has_work():
                before = engine.last_trace
                engine.step()
                tr = engine.last_trace
                if tr is not None and tr is not before:  # an iteration actually ran
                    recorder.record(tr)
                for rid in [rid for rid, (_, r, _) in live.items() if r.finished]:
                    it, r, slo = live.pop(rid)
                    if r.finish_reason == TTFT_DEADLINE:  # never started: answered 429
                        fail(it, slo, f"shed: {r.finish_reason}", shed=True)
                    else:
                        collect(r, it, slo)
                continue
            nxt = [items[i].arrival_s] if i < len(items) else []
            if shifts:
                nxt.append(shifts[0].at_s)
            if not nxt:
                break
            if isinstance(clock, ManualClock):  # fake time: jump to the next event
                clock.set(max(clock.now(), t0 + min(nxt)))
            else:
                time.sleep(max(0.0, min(nxt) - (clock.now() - t0)))
    finally:
        end = clock.now() - t0
        for _rid, (it, r, slo) in list(live.items()):
            if r.finished:
                collect(r, it, slo)
            else:
                engine.abort(r, "timeout")
                fail(it, slo, "timeout: run exceeded its wall-time limit", shed=False)
        live.clear()
        for it in items[i:]:
            fail(it, slos.get(it.cls), "not sent: run stopped", shed=False)
        engine.set_faults(type(engine.faults)())
        if bar is not None:
            bar.close()

    finish = [r.finish_s for r in records if r.finish_s is not None]
    duration = max(finish) if finish else end
    pool_bytes = engine.allocator.num_blocks * engine.cfg.block_size * engine.kv_bytes_per_slot
    c = engine.counters
    timeline.info = {
        **recorder.info(policy, c, pool_bytes, slos),
        "duration_s": duration if duration > 0 else max(end, 1e-9),
        "wall_s": end,
        "model_time_s": c.model_time_s,
        "step_time_s": c.step_time_s,
        "shifts_applied": applied,
        "unloaded_tpot_ms": engine.unloaded_tpot_ms(),
        # passes over 3x the profile's prediction, by cause (``core.stalls``)
        "stalls": dict(c.stalls),
        "stalls_total": sum(c.stalls.values()),
    }
    records.sort(key=lambda r: r.idx)
    return records, timeline


# ---------------------------------------------------------------------- HTTP
def _auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _stream_one(client, body: dict, t0: float) -> dict:
    """Send one streaming completion; returns times (relative to t0) and counts."""
    out = {
        "sent": time.perf_counter() - t0,
        "first": None,
        "times": [],
        "finish": None,
        "reason": None,
        "usage": None,
        "metrics": None,
        "error": None,
        "shed": False,
        "chunks": 0,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")[:300]
                out["shed"] = resp.status_code == 429
                out["error"] = f"HTTP {resp.status_code}: {text}"
                out["finish"] = time.perf_counter() - t0
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                now = time.perf_counter() - t0
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if "error" in obj:
                    err = obj["error"]
                    out["error"] = str(err.get("message") if isinstance(err, dict) else err)
                    break
                for ch in obj.get("choices") or []:
                    text = ch.get("text") or ""
                    if text or ch.get("finish_reason") is None:
                        if out["first"] is None:
                            out["first"] = now
                        out["times"].append(now)
                        out["chunks"] += 1
                    if ch.get("finish_reason"):
                        out["reason"] = ch["finish_reason"]
                if obj.get("usage"):
                    out["usage"] = obj["usage"]
                if obj.get("metrics"):
                    out["metrics"] = obj["metrics"]
            out["finish"] = time.perf_counter() - t0
    except Exception as e:  # network errors of any kind end up in the record
        out["error"] = f"{type(e).__name__}: {e}"
        out["finish"] = time.perf_counter() - t0
    return out


def _body(
    item: WorkItem, slo: SLO | None, model: str | None, rank: int | None, send_priority: bool
) -> dict:
    body: dict = {
        # text when there is text (any server tokenizes it); token ids otherwise
        "prompt": item.prompt if item.prompt is not None else item.payload_prompt(),
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "slo_class": item.cls,
    }
    if model:
        body["model"] = model
    s = item_slo(item, slo)
    targets = {
        k: float(v) for k, v in (("tpot_ms", s.tpot_ms), ("ttft_ms", s.ttft_ms)) if v is not None
    }
    if targets:
        body["slo"] = targets
    if send_priority and rank is not None:
        body["priority"] = int(rank)
    return body


def _cached_of(usage: dict) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (0 when a server reports none)."""
    d = usage.get("prompt_tokens_details")
    n = d.get("cached_tokens") if isinstance(d, dict) else None
    return n if isinstance(n, int) and n >= 0 else 0


def _record_from(item: WorkItem, slo: SLO, arrival: float, res: dict) -> RequestRecord:
    usage = res["usage"] or {}
    m = res["metrics"] or {}
    n_out = usage.get("completion_tokens")
    if not isinstance(n_out, int):
        n_out = res["chunks"]
    err = res["error"]
    first = res["first"]
    if first is None and err is None and isinstance(m.get("ttft_ms"), (int, float)):
        # the stream carried no text before the end (e.g. a model without a tokenizer):
        # fall back to the server's own TTFT measurement
        first = arrival + float(m["ttft_ms"]) / 1000.0
    return RequestRecord(
        idx=item.idx,
        cls=item.cls,
        arrival_s=arrival,
        first_token_s=first,
        finish_s=res["finish"] if err is None else None,
        token_times_s=list(res["times"]),
        prompt_tokens=usage.get("prompt_tokens") or item.prompt_len,
        cached_tokens=_cached_of(usage),
        output_tokens=n_out if err is None else 0,
        tpot_target_ms=slo.tpot_ms,
        ttft_target_ms=slo.ttft_ms,
        drafted=int(m.get("drafted_tokens") or 0),
        verified=int(m.get("verified_tokens") or m.get("tree_nodes") or 0),
        accepted=int(m.get("accepted_tokens") or 0),
        finish_reason=res["reason"] if err is None else None,
        shed=res["shed"],
        error=err,
        degraded=bool(m.get("degraded_from")),
        steps=m.get("steps") if isinstance(m.get("steps"), int) else None,
    )


async def _get_model(client) -> str | None:
    try:
        r = await client.get("/v1/models")
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data:
                return data[0].get("id")
    except Exception:
        return None
    return None


async def _measure_unloaded(client, model, n: int) -> float:
    """Median TPOT of ``n`` single 32-token requests (text prompts; token ids when the
    server refuses text, e.g. a model without a tokenizer)."""
    texts = ("def fibonacci(n):\n    ", "import os\n\nclass ")
    vals: list[float] = []
    use_ids, tries, err = False, 0, None
    while len(vals) < n and tries < n + 1:
        tries += 1
        item = WorkItem(
            idx=-1,
            arrival_s=0.0,
            cls="probe",
            prompt=None if use_ids else texts[tries % 2],
            prompt_ids=list(range(1, 9)) if use_ids else None,
            prompt_len=8,
            max_tokens=32,
        )
        body = _body(item, None, model, None, False)
        body.pop("slo_class", None)
        res = await _stream_one(client, body, time.perf_counter())
        if res["error"] is not None:
            err = res["error"]
            use_ids = True
            continue
        rec = _record_from(item, SLO(cls="probe"), 0.0, res)
        if rec.tpot_ms:
            vals.append(rec.tpot_ms)
    if not vals:
        raise AdaServeError(
            f"could not measure the unloaded TPOT: the probe requests failed ({err})"
        )
    return float(statistics.median(vals))


async def _reported_unloaded(client) -> float | None:
    """The unloaded TPOT an adaserve server resolves its class targets with (its
    ``/v1/slo/report``: the profile's, ``sched.hardware.unloaded_tpot_ms``); None from
    a server that reports none (a peer such as vLLM)."""
    try:
        r = await client.get("/v1/slo/report")
        if r.status_code != 200:
            return None
        v = (r.json().get("engine") or {}).get("unloaded_tpot_ms")
    except Exception:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9:
        return float(v)
    return None


async def _unloaded_of(client, model, n: int) -> float:
    """The server's own unloaded TPOT when it reports one (so that the benchmark
    judges with the targets the server schedules for), else the probe's."""
    v = await _reported_unloaded(client)
    if v is not None:
        print(f"bench: unloaded TPOT {v:.3f} ms (reported by the server)", file=sys.stderr)
        return v
    v = await _measure_unloaded(client, model, n)
    print(f"bench: unloaded TPOT {v:.3f} ms (probed: {n} single requests)", file=sys.stderr)
    return v


def server_targets(base_url: str, api_key: str | None = None) -> tuple[float, str]:
    """(the unloaded TPOT the server's class targets multiply, where it comes from):
    an adaserve server reports its pair's targets record (``adaserve.profile``), the
    one the bench, the demo and the simulator all read; a server that reports none is
    probed (``measure_unloaded_tpot``)."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/v1/slo/report", headers=_auth_headers(api_key), timeout=60.0)
        eng = r.json().get("engine") or {} if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        eng = {}
    prof = eng.get("profile") or {}
    v = prof.get("unloaded_tpot_ms", eng.get("unloaded_tpot_ms"))
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        src = prof.get("targets_from") or "the server's hardware profile"
        return float(v), src
    return measure_unloaded_tpot(base_url, api_key=api_key), "probed: single requests"


def measure_unloaded_tpot(base_url: str, n: int = 3, api_key: str | None = None) -> float:
    """The unloaded TPOT class targets multiply: the one an adaserve server reports
    (its profile's), else the median TPOT of ``n`` single 32-token requests sent one
    after another (a server that reports none)."""
    import httpx

    async def go():
        async with httpx.AsyncClient(
            base_url=base_url, timeout=httpx.Timeout(600.0), headers=_auth_headers(api_key)
        ) as client:
            model = await _get_model(client)
            return await _unloaded_of(client, model, n)

    return asyncio.run(go())


def run_http(
    base_url: str,
    items: list[WorkItem],
    spec: WorkloadSpec,
    concurrency: int | None = None,
    *,
    slos: dict[str, SLO] | None = None,
    unloaded_tpot_ms: float | None = None,
    model: str | None = None,
    send_priority: bool = True,
    ranks: dict[str, int] | None = None,
    progress: bool = True,
    api_key: str | None = None,
    request_timeout_s: float = 600.0,
) -> list[RequestRecord]:
    """Send ``items`` to an OpenAI-compatible server at their arrival times (streaming).

    SLO targets: ``slos`` or the default classes resolved with ``unloaded_tpot_ms``
    (measured with a few single requests when None) times ``spec.slo_scale``.
    ``concurrency`` caps requests in flight (None = unlimited).
    """
    import httpx

    for s in spec.shifts:
        if s.engine_side:
            log.warning("shift %s applies in-process only; ignored over HTTP", s.describe())
    ranks = ranks if ranks is not None else class_ranks()

    async def go():
        limits = httpx.Limits(max_connections=concurrency or 4096, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(request_timeout_s, connect=30.0),
            limits=limits,
            headers=_auth_headers(api_key),
        ) as client:
            nonlocal model, slos
            if model is None:
                model = await _get_model(client)
            if slos is None:
                tpot = unloaded_tpot_ms
                if tpot is None:
                    tpot = await _unloaded_of(client, model, 3)
                slos = class_slos(
                    sorted({it.cls for it in items}), spec.slo_scale, unloaded_tpot_ms=tpot
                )
            sem = asyncio.Semaphore(concurrency) if concurrency else None
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=len(items), desc="http", unit="req", leave=False)
            t0 = time.perf_counter()

            async def one(item: WorkItem) -> RequestRecord:
                delay = t0 + item.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                slo = item_slo(item, slos.get(item.cls))
                body = _body(item, slo, model, ranks.get(item.cls), send_priority)
                if sem is not None:
                    async with sem:
                        res = await _stream_one(client, body, t0)
                else:
                    res = await _stream_one(client, body, t0)
                if bar is not None:
                    bar.update(1)
                # timed from the moment it is sent (after any concurrency wait)
                return _record_from(item, slo, res["sent"], res)

            try:
                recs = await asyncio.gather(*(one(it) for it in items))
            finally:
                if bar is not None:
                    bar.close()
            return list(recs)

    return asyncio.run(go())
