"""Drive a workload through an OpenAI-compatible HTTP server.

Each request is a streaming ``POST /v1/completions`` sent at its arrival time; the
SLO travels as ``slo: {tpot_ms, ttft_ms}`` and ``slo_class`` (our extensions) and as
vLLM's integer ``priority`` (the class rank; ``send_priority=False`` leaves it out for
servers that reject it). Also the server's unloaded TPOT, measured or reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from adaserve.bench.metrics import RequestRecord
from adaserve.bench.slo_targets import class_ranks, class_slos
from adaserve.bench.workload_spec import WorkItem, WorkloadSpec, item_slo
from adaserve.core.slo import SLO
from adaserve.errors import AdaServeError

log = logging.getLogger("adaserve.bench")


def _auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _stream_one(client, body: dict, t0: float) -> dict:
    """Send one streaming completion; returns times (relative to t0) and counts."""
    out: dict[str, Any] = {
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
    ``/v1/slo/report``: the profile's, ``hardware.model.unloaded_tpot_ms``); None from
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
    an adaserve server reports its pair's targets record (``adaserve.engine.profile``), the
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


@contextlib.contextmanager
def off_server_cores(base_url: str, api_key: str | None = None) -> Iterator[str | None]:
    """Within the block, on the server's own machine (its report's thread plan names
    this machine: ``threads.machine_id``, whatever the address; a tunnel to another
    machine does not count), this client runs off the cores the server's engine is
    pinned to, as a client on another machine would; yields a line saying so, None
    where nothing changed (another machine, no pinned cores, no room left, no
    per-thread affinity, or an engine in this very process, whose thread must keep its
    cores). Every thread's cores are given back after the block."""
    import httpx

    from adaserve.util import threads

    plan = None
    here = any(t.name == "adaserve-engine" for t in threading.enumerate())
    me = threads.machine_id()
    if me is not None and not here:
        try:
            # best effort: a server that does not answer soon is left as it is
            r = httpx.get(f"{base_url}/v1/slo/report", headers=_auth_headers(api_key), timeout=10.0)
            rep = r.json() if r.status_code == 200 else None
            eng = rep.get("engine") if isinstance(rep, dict) else None
            got = eng.get("threads") if isinstance(eng, dict) else None
            plan = got if isinstance(got, dict) else None
        except (httpx.HTTPError, ValueError):
            plan = None
    ok = plan is not None and plan.get("pinned") and plan.get("machine") == me
    cores = tuple(int(c) for c in plan.get("cores") or ()) if plan is not None and ok else ()
    if not cores:
        yield None
        return
    with threads.kept_off(cores) as rest:
        yield (
            f"bench client on cores {threads.describe_cores(rest)}, off the server "
            f"engine's {threads.describe_cores(cores)}"
            if rest
            else None
        )
