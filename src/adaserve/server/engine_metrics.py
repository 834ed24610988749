"""The engine's Prometheus gauges and counters, read from its latest snapshot at
scrape time (``EngineCollector``), so they always equal the engine's own numbers
(``server/metrics.py`` registers it beside the per-request series)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adaserve.server.engine_loop import EngineSnapshot


class EngineCollector:
    """Engine gauges and counters, read from the latest snapshot at scrape time."""

    def __init__(self, model_name: str, snapshot_fn, attainment_fn, targets_fn=None):
        self.model_name = model_name
        self.snapshot_fn = snapshot_fn
        self.attainment_fn = attainment_fn
        self.targets_fn = targets_fn  # () -> {class: SLO} (the current class targets)
        self.cache_info: dict | None = None
        self.threads_fn: Callable[[], Any] | None = (
            None  # () -> the thread plan dict (``engine_provenance``)
        )
        self.structured_fn: Callable[[], Any] | None = (
            None  # () -> the engine's ``StructuredOutputs`` (or None)
        )
        self.ledger_fn: Callable[[], Any] | None = (
            None  # () -> the usage ledger's ``LedgerWriter`` (or None)
        )

    def describe(self):
        return []

    def collect(self):
        mn = self.model_name
        s: EngineSnapshot = self.snapshot_fn()
        c = s.counters or {}

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([mn], value)
            return g

        def counter(name, doc, value):
            f = CounterMetricFamily(name, doc, labels=["model_name"])
            f.add_metric([mn], value)
            return f

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.running)
        w = self.ledger_fn() if self.ledger_fn is not None else None
        if w is not None:
            st = w.stats
            yield gauge(
                "adaserve:usage_ledger_up",
                "1 while the usage database takes writes; 0 while records are spooled.",
                0 if st.spooling else 1,
            )
            yield gauge(
                "adaserve:usage_ledger_spool_pending",
                "Usage records in the local spool, waiting for the database.",
                w.spool_pending,
            )
            yield counter(
                "adaserve:usage_ledger_committed_records",
                "Usage records committed to the database as they came.",
                st.committed,
            )
            yield counter(
                "adaserve:usage_ledger_spooled_records",
                "Usage records written to the spool (the database was unreachable).",
                st.spooled,
            )
            yield counter(
                "adaserve:usage_ledger_replayed_records",
                "Spooled usage records stored by a replay (new ones only).",
                st.replayed,
            )
            yield counter(
                "adaserve:usage_ledger_write_failures",
                "Usage database commits or replays that failed.",
                st.failures,
            )
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission.", s.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", s.kv_usage)
        yield counter("vllm:prompt_tokens", "Prefilled prompt tokens.", c.get("prompt_tokens", 0))
        yield counter("vllm:generation_tokens", "Generated tokens.", c.get("generation_tokens", 0))
        yield counter(
            "vllm:spec_decode_num_drafts",
            "Request-iterations that verified at least one draft token.",
            c.get("spec_drafts", 0),
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens",
            "Draft tokens verified.",
            c.get("spec_draft_tokens", 0),
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            c.get("spec_accepted_tokens", 0),
        )
        pc = s.prefix_cache or {}
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            pc.get("queried_tokens", 0),
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            pc.get("cached_tokens", 0),
        )
        yield counter(
            "vllm:prompt_tokens_cached",
            "Prompt tokens served from the prefix cache.",
            pc.get("cached_tokens", 0),
        )
        for key, name, doc in (
            ("queried_tokens", "adaserve:prefix_cache_queries_by_class",
             "Prompt tokens looked up in the prefix cache, by SLO class."),
            ("cached_tokens", "adaserve:prefix_cache_hits_by_class",
             "Prompt tokens found in the prefix cache, by SLO class."),
        ):  # fmt: skip
            f = CounterMetricFamily(name, doc, labels=["model_name", "slo_class"])
            for cls, v in (pc.get("by_class") or {}).items():
                f.add_metric([mn, cls], v.get(key, 0))
            yield f
        yield counter(
            "adaserve:prefix_cache_evictions",
            "Cached KV blocks evicted to make room.",
            pc.get("evictions", 0),
        )
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the speculated path (0 = first).",
            labels=["model_name", "position"],
        )
        for pos, v in sorted((c.get("accepted_per_pos") or {}).items()):
            per_pos.add_metric([mn, str(pos)], v)
        yield per_pos
        fb = CounterMetricFamily(
            "adaserve:fallback_iterations",
            "Iterations (or requests within one) that fell back to plain decoding, by reason.",
            labels=["model_name", "reason"],
        )
        for reason, v in sorted((c.get("fallback_iterations") or {}).items()):
            fb.add_metric([mn, str(reason)], v)
        yield fb
        yield counter("adaserve:engine_iterations", "Engine iterations.", c.get("iterations", 0))
        stalls = CounterMetricFamily(
            "adaserve:stalls",
            "Passes over 3x the profile's prediction, by cause (compile, gc, "
            "slowed_machine, unknown).",
            labels=["model_name", "cause"],
        )
        for cause, v in sorted((c.get("stalls") or {}).items()):
            stalls.add_metric([mn, str(cause)], v)
        yield stalls
        drift = s.drift or {}
        if drift.get("median_ratio") is not None:
            yield gauge(
                "adaserve:profile_drift_ratio",
                "Median measured / profiled iteration time over the drift window.",
                drift["median_ratio"],
            )
        yield counter(
            "adaserve:profile_drift_events",
            "Times the drift window's median left its bounds.",
            drift.get("events", 0),
        )
        if self.threads_fn is not None:
            th = self.threads_fn() or {}
            if th.get("threads"):
                yield gauge(
                    "adaserve:intra_op_threads",
                    "Intra-op threads of the forward passes.",
                    th["threads"],
                )
                info = GaugeMetricFamily(
                    "adaserve:thread_config_info",
                    "The engine's thread plan (how it was chosen, reserve, pinned cores).",
                    labels=["model_name", "source", "usable", "reserve", "cores", "pinned"],
                )
                info.add_metric(
                    [
                        mn,
                        str(th.get("source")),
                        str(th.get("usable")),
                        str(th.get("reserve")),
                        ",".join(map(str, th.get("cores") or [])),
                        str(bool(th.get("pinned"))).lower(),
                    ],
                    1,
                )
                yield info
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", c.get("preemptions", 0)
        )
        so = self.structured_fn() if self.structured_fn is not None else None
        if so is not None:
            yield counter(
                "adaserve:grammar_mask_seconds",
                "Host time computing grammar masks of constrained requests' tree nodes.",
                so.mask_s,
            )
            yield counter(
                "adaserve:grammar_masks", "Grammar masks computed (one per node).", so.masks
            )
            yield counter(
                "adaserve:structured_forced_tokens",
                "Grammar-forced tokens put into trees without a draft step.",
                so.forced_tokens,
            )
            yield counter(
                "adaserve:structured_forced_accepted_tokens",
                "Grammar-forced tokens the target accepted.",
                so.forced_accepted,
            )
        if self.cache_info is not None:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the engine's KV cache configuration.",
                labels=["model_name", *self.cache_info],
            )
            info.add_metric([mn, *(str(v) for v in self.cache_info.values())], 1)
            yield info
        if self.targets_fn is not None:
            slos = self.targets_fn() or {}
            for key, name, doc in (
                ("ttft_ms", "adaserve:slo_ttft_target_seconds", "The class's TTFT target."),
                ("tpot_ms", "adaserve:slo_tpot_target_seconds", "The class's TPOT target."),
            ):
                g = GaugeMetricFamily(name, doc, labels=["model_name", "slo_class"])
                for cls, slo in slos.items():
                    v = getattr(slo, key, None)
                    if v is not None:
                        g.add_metric([mn, cls], v / 1000)
                yield g
        att = GaugeMetricFamily(
            "adaserve:slo_attainment",
            "Share of finished requests of the class that met their SLO.",
            labels=["model_name", "slo_class"],
        )
        for cls, ratio in self.attainment_fn().items():
            att.add_metric([mn, cls], ratio)
        yield att
