"""One service's ``/metrics`` and ``/v1/slo/report`` from its replicas' reports.

Metrics: counters and histograms are summed over the replicas (the dead ones
included: what they counted happened), so every series reads as a single engine's
would; gauges (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ...) are
per replica, with a ``replica`` label, the live replicas only: what a gateway routing
to replicas reads.

Report: the single server's ``ReportStore.build`` over every replica's records and
counts, usage summed per tenant and class; ``engine`` carries the sums and one entry
per replica under ``replicas``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from adaserve.server.report import ReportStore


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


def merge_report(snaps: dict, tenant: str | None, model_name: str) -> dict:
    """The report of the whole service from ``Ledger.snapshots()``."""
    live = {rid: s for rid, s in snaps.items() if s["live"]}
    ref = next(iter(live.values()), None) or next(iter(snaps.values()), None)
    rep0 = ref["report"] if ref else {}
    store = ReportStore(rep0.get("class_names", []))
    usage: dict = {}
    replicas = {}
    for rid, s in sorted(snaps.items()):
        for rec in s["records"]:
            store.record(rec)
        rep = s["report"]
        store.add_counts(rep.get("shed", {}), rep.get("rate_limited", {}))
        _add_usage(usage, rep.get("usage", {}))
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
