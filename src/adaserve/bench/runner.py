"""Drive a workload through the engine in-process (real time) or an HTTP server.

In-process: items are added at their arrival times (``arrival = t0 + item.arrival_s``)
and ``engine.step()`` runs while there is work; the loop sleeps until the next arrival
when idle. Engine-side shifts (``draft-noise``, ``kv-pressure``) are applied at their
times through ``engine.faults``. Every iteration's trace goes to a ``RunRecorder`` (one
timeline sample per iteration, the energy tally), the simulator's too.

HTTP: ``bench/http_runner.py`` (``run_http``, ``server_targets``,
``measure_unloaded_tpot``, re-exported here).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

# the HTTP runner and the class targets live in their own modules; callers import them here
from adaserve.bench.http_runner import (
    measure_unloaded_tpot,
    off_server_cores,
    run_http,
    server_targets,
)
from adaserve.bench.metrics import RequestRecord
from adaserve.bench.replayed import replayed_tpot
from adaserve.bench.slo_targets import class_ranks, class_slos
from adaserve.bench.workload_spec import WorkItem, WorkloadSpec, item_slo
from adaserve.core.admission import TTFT_DEADLINE
from adaserve.core.clock import ManualClock
from adaserve.core.slo import SLO
from adaserve.core.trace import ModelCosts, RunRecorder, RunTimeline
from adaserve.errors import AdaServeError, AdmissionRejected

if TYPE_CHECKING:
    from adaserve.engine.engine import Engine
    from adaserve.spec_decode.request import Request

log = logging.getLogger("adaserve.bench")


# ---------------------------------------------------------------------- engines
class EngineFactory:
    """``factory(policy) -> Engine``: builds one engine and reuses it for every policy
    (``Engine.set_policy`` and ``Engine.reset_stats``), so models load and the hardware
    profile is measured once."""

    def __init__(self, cfg, reuse: bool = True):
        self.cfg = cfg
        self.reuse = reuse
        self.engine: Engine | None = None

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
    from adaserve.policies.registry import make_policy

    pol = make_policy(policy)
    if pol.uses_draft and engine.draft is None:
        raise AdaServeError(f"policy {policy!r} needs a draft model")
    if pol.uses_draft and engine.hw is None:
        from adaserve.engine.profile import load_or_profile

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
    live: dict[int, tuple[WorkItem, Request, SLO]] = {}
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
    # each request's TPOT with these passes at the profile's prices (``bench.replayed``)
    timeline.info["replayed_tpot"] = replayed_tpot(records, recorder.passes)
    return records, timeline


__all__ = [
    "EngineFactory",
    "class_ranks",
    "class_slos",
    "measure_unloaded_tpot",
    "off_server_cores",
    "run_http",
    "run_in_process",
    "server_targets",
    "set_policy",
    "warmup",
]
