"""One service's ``/metrics``, ``/v1/slo/report`` and dashboard data from its
replicas' reports.

Metrics: counters and histograms are summed over the replicas (the dead ones
included: what they counted happened), so every series reads as a single engine's
would; gauges (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ...) are
per replica, with a ``replica`` label, the live replicas only: what a gateway routing
to replicas reads.

Report: the single server's ``ReportStore.build`` over every replica's records and
counts, usage summed per tenant and class (with what dead replicas' interrupted
streams had relayed, ``Ledger.interrupted``); ``engine`` carries the sums (fallback
iterations by reason too, ``interrupted``: those streams and their output tokens) and
one entry per replica under ``replicas``.

Dashboard: see ``merge_dashboard``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from adaserve.server.dashboard import report_view
from adaserve.server.report import ReportStore, rolling_counts, rolling_rates
from adaserve.util.dashboard_page import RECENT_ITERATIONS, ROLLING_WINDOW_S, timeline_series


class _Families:
    def __init__(self, fams):
        self.fams = fams

    def collect(self):
        return iter(self.fams)


def merge_metrics(texts: dict[str, tuple[str, bool]], only_tenant: str | None = None) -> bytes:
    """``texts``: {replica_id: (Prometheus text, live)}; returns the merged text
    (``only_tenant``: keep, of series labelled ``tenant``, that tenant's)."""
    order: list[str] = []
    fams: dict[str, Metric] = {}
    sums: dict[str, dict[tuple, float]] = {}
    for rid, (text, live) in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            if fam.name not in fams:
                fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                sums[fam.name] = {}
                order.append(fam.name)
            acc = sums[fam.name]
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                if only_tenant is not None and s.labels.get("tenant", only_tenant) != only_tenant:
                    continue
                labels = dict(s.labels)
                if fam.type == "gauge":
                    if not live:
                        continue
                    labels["replica"] = rid
                key = (s.name, tuple(sorted(labels.items())))
                acc[key] = acc.get(key, 0.0) + s.value
    out = []
    for name in order:
        m = fams[name]
        for (sname, labels), v in sums[name].items():
            m.add_sample(sname, dict(labels), v)
        out.append(m)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families(out))
    return generate_latest(reg)


def _add_usage(into: dict, usage: dict) -> None:
    for tenant, u in usage.items():
        t = into.setdefault(tenant, {"classes": {}, "total": {}})
        for cls, vals in u.get("classes", {}).items():
            c = t["classes"].setdefault(cls, {})
            for k, v in vals.items():
                c[k] = c.get(k, 0) + v
        for k, v in u.get("total", {}).items():
            t["total"][k] = t["total"].get(k, 0) + v


def _sum_counts(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in (d or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def _merge_drift(drifts: list[dict]) -> dict:
    """The service's drift from its live replicas' (``DriftMonitor.as_dict``): the
    replica furthest from its profile (median ratio furthest from 1) stands for the
    service, ``drifted`` if any replica drifted, ``events`` summed. Empty if none
    reports one."""
    known = [d for d in drifts if d]
    if not known:
        return {}

    def off(d: dict) -> float:
        m = d.get("median_ratio")
        return -1.0 if m is None else abs(m - 1.0)

    worst = max(known, key=off)
    return {
        **worst,
        "drifted": any(d.get("drifted") for d in known),
        "events": sum(d.get("events", 0) for d in known),
    }


def merge_report(snaps: dict, tenant: str | None, model_name: str) -> dict:
    """The report of the whole service from ``Ledger.snapshots()``."""
    live = {rid: s for rid, s in snaps.items() if s["live"]}
    ref = next(iter(live.values()), None) or next(iter(snaps.values()), None)
    rep0 = ref["report"] if ref else {}
    store = ReportStore(rep0.get("class_names", []))
    usage: dict = {}
    replicas = {}
    interrupted = {"requests": 0, "completion_tokens": 0}
    for rid, s in sorted(snaps.items()):
        for rec in s["records"]:
            store.record(rec)
        rep = s["report"]
        store.add_counts(rep.get("shed", {}), rep.get("rate_limited", {}))
        _add_usage(usage, rep.get("usage", {}))
        lost = s.get("interrupted") or {}
        _add_usage(usage, lost)
        for name, u in lost.items():
            if tenant is None or name == tenant:
                for k in interrupted:
                    interrupted[k] += u["total"].get(k, 0)
        replicas[rid] = {**rep.get("engine", {}), "live": s["live"]}
    if tenant is not None:
        usage = {k: v for k, v in usage.items() if k == tenant}
    alive = [e for e in replicas.values() if e["live"]]
    engine = {
        "policy": rep0.get("engine", {}).get("policy"),
        "unloaded_tpot_ms": rep0.get("engine", {}).get("unloaded_tpot_ms"),
        "running": sum(e.get("running", 0) for e in alive),
        "waiting": sum(e.get("waiting", 0) for e in alive),
        "kv_usage": (sum(e.get("kv_usage", 0.0) for e in alive) / len(alive)) if alive else 0.0,
        "iterations": sum(e.get("iterations", 0) for e in replicas.values()),
        "spec_draft_tokens": sum(e.get("spec_draft_tokens", 0) for e in replicas.values()),
        "spec_accepted_tokens": sum(e.get("spec_accepted_tokens", 0) for e in replicas.values()),
        "fallback_iterations": _sum_counts(
            e.get("fallback_iterations", {}) for e in replicas.values()
        ),
        "stalls": _sum_counts(e.get("stalls", {}) for e in replicas.values()),
        "admission": merge_admission([e.get("admission") or {} for e in replicas.values()]),
        "interrupted": interrupted,
        "drift": _merge_drift([e.get("drift") or {} for e in alive]),
        # one deployment: every replica runs the same thread plan and profile
        "threads": rep0.get("engine", {}).get("threads"),
        "profile": rep0.get("engine", {}).get("profile"),
        "live_replicas": len(alive),
        "replicas": replicas,
    }
    out = store.build(
        class_targets=rep0.get("class_targets", {}),
        prices=rep0.get("prices", {}),
        flops_per_token=rep0.get("flops_per_token", 0.0),
        usage=usage,
        engine=engine,
        tenant=tenant,
    )
    out["model"] = model_name
    return out


def merge_admission(parts: list[dict]) -> dict:
    """The replicas' ``engine.admission`` sections as one: refusals summed by class and
    reason; promised and met counts summed, the attainments weighted by them."""
    out: dict[str, dict] = {}
    for part in parts:
        for cls, a in part.items():
            o = out.setdefault(cls, {})
            if a.get("refused"):
                o["refused"] = _sum_counts([o.get("refused", {}), a["refused"]])
            n = a.get("promised_n", 0)
            if n:
                m = o.get("promised_n", 0)
                for k in ("predicted_attainment", "realised_attainment"):
                    o[k] = round((o.get(k, 0.0) * m + a[k] * n) / (m + n), 4)
                o["promised_n"] = m + n
    return dict(sorted(out.items()))


def merge_dashboard(snaps: dict, model_name: str, tenant_names, as_of_s: float) -> dict:
    """The dashboard's data of the whole service from ``Ledger.snapshots(samples=True)``
    at ``as_of_s`` seconds on the front door's clock (since it started).

    What it merges: the class table, sheds and tenants are ``merge_report``'s (so they
    agree with the front door's ``/v1/slo/report``); the rolling attainment sums each
    replica's requests finished in the last ``ROLLING_WINDOW_S`` seconds (on that
    replica's clock: its clock at its last push plus the time since); acceptance by
    position and the draft count are summed over every replica (the dead included, as
    the report's counters); running / waiting are summed and KV use averaged over the
    live replicas (the report's engine).

    The per-iteration timeline stays per replica: an iteration is one engine's decision
    (its budget B, its tree depth, its batch), which does not add up across engines, and
    an operator looking at one replica's chart sees how that engine schedules. So
    ``replicas`` has, per replica, its live flag, gauges, iteration count and its
    timeline (on the front door's time axis); the top-level ``timeline`` is that of
    ``timeline_replica`` (the first live replica that has iterated), which the page
    charts first and offers the others in a selector. The class table's per-iteration
    means are over the service's newest ``RECENT_ITERATIONS`` iterations, all replicas'
    samples in time order."""
    rep = merge_report(snaps, None, model_name)
    classes = list(rep["classes"])
    rolling: dict[str, list[int]] = {c: [0, 0] for c in classes}
    accepted: dict[int, int] = {}
    drafts = 0
    replicas: dict[str, dict] = {}
    every: list[dict] = []
    for rid, s in sorted(snaps.items()):
        d = s["report"].get("dashboard") or {}
        eng = rep["engine"]["replicas"].get(rid, {})
        # this replica's clock now, and where its samples' zero lies on the front door's
        now = d.get("clock", 0.0) + s.get("age_s", 0.0)
        for c, r in rolling_counts(s["records"], classes, now, ROLLING_WINDOW_S).items():
            n = rolling.setdefault(c, [0, 0])
            n[0] += r["requests"]
            n[1] += r["attained"]
        for pos, n in (d.get("accepted_per_pos") or {}).items():
            accepted[int(pos)] = accepted.get(int(pos), 0) + n
        drafts += d.get("spec_drafts", 0)
        shift = as_of_s - (now - d.get("started_at", now))
        samples = [{**x, "t": x["t"] + shift} for x in s.get("samples", ())]
        every.extend(samples)
        replicas[rid] = {
            "live": s["live"],
            **{k: eng.get(k) for k in ("running", "waiting", "kv_usage", "iterations")},
            "timeline": timeline_series(samples, classes),
        }
    every.sort(key=lambda x: x["t"])
    shown = next(
        (r for r, v in replicas.items() if v["live"] and v["timeline"]["t"]),
        next(iter(replicas), None),
    )
    live = rep["engine"]["live_replicas"]
    return report_view(
        rep,
        title=f"adaserve: {model_name} ({live} replica{'s' if live != 1 else ''})",
        as_of_s=as_of_s,
        rolling=rolling_rates(rolling),
        tenant_names=tenant_names,
        accepted_per_pos=accepted,
        spec_drafts=drafts,
        timeline=replicas[shown]["timeline"] if shown else timeline_series([], classes),
        recent_timeline=timeline_series(every[-RECENT_ITERATIONS:], classes),
        replicas=replicas,
        timeline_replica=shown,
    )
