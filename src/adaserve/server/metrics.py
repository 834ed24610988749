"""Prometheus metrics: vLLM names (labelled ``model_name``) plus ``adaserve:`` ones.

The ``vllm:`` series follow vLLM's v1 ``PrometheusStatLogger`` (names, types, the
``finished_reason`` label, the 1-2-5 token buckets up to the context length, the
per-step token buckets), so that vLLM's Grafana dashboard works unchanged; the
``adaserve:`` ones add what vLLM has no concept for (SLO classes, attainment, goodput,
tenants). ``docs/grafana/adaserve.json`` is a dashboard over both.

Each app owns its ``CollectorRegistry``. Per-request histograms and per-class counters
are updated when a request finishes (on the engine thread; prometheus-client is
thread-safe), the per-step token histogram after every engine step; engine gauges and
counters are read from the engine snapshot at scrape time by a custom collector, so
they always equal the engine's own numbers.

The per-tenant series (labelled ``tenant``: usage, charges, quota refusals) are billing
data and live in a registry of their own, so that ``render`` can leave them out (a
scrape without an admin key, when API keys are configured) or keep one tenant's.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import Metric

from adaserve.server.engine_loop import Final
from adaserve.server.engine_metrics import EngineCollector

# vLLM turns the ``_created`` twin of every counter and histogram off: the series are
# what its dashboards and clients read (process-wide, as vLLM does)
prometheus_client.disable_created_metrics()

TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

COMPILE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# vLLM's FinishReason values; adaserve's other reasons (client_disconnected,
# server_shutdown, engine_error, timeouts) are aborts
FINISHED_REASONS = ("stop", "length", "abort")

VLLM_NAMES = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_params_n",
    "vllm:request_max_num_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:cache_config_info",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_total",
)

SHED_REASONS = ("queue_full", "server_shutdown")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def finished_reason(reason: str | None) -> str:
    """vLLM's ``finished_reason`` label for an adaserve finish reason."""
    return reason if reason in ("stop", "length") else "abort"


TENANT_NAMES = (
    "adaserve:rate_limited_requests",
    "adaserve:charges",
    "adaserve:tenant_output_tokens",
)


class ServerMetrics:
    """The app's registries (engine-wide, per-tenant) and the hooks that feed them."""

    def __init__(self, model_name: str, class_names, snapshot_fn, attainment_fn, targets_fn=None):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.tenant_registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        treg = self.tenant_registry
        ProcessCollector(registry=reg)  # process_* (CPU, memory, open fds), as vLLM's
        m = ["model_name"]
        mc = ["model_name", "slo_class"]
        self.grammar_compile = Histogram(
            "adaserve:grammar_compile_seconds",
            "Time to compile one structured-output grammar (cache misses only).",
            m, buckets=COMPILE_BUCKETS, registry=reg,
        )  # fmt: skip
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (arrival to first output token).",
            m, buckets=TTFT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens (0 inside one speculative step).",
            m, buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            m, buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to finish.",
            m, buckets=E2E_BUCKETS, registry=reg,
        )  # fmt: skip
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Arrival to admission into the running batch.",
            m, buckets=E2E_BUCKETS, registry=reg,
        )  # fmt: skip
        self.step_tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time between the engine steps that gave a request output tokens (vLLM's "
            "per-iteration figure; one speculative step counts once).",
            m, buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.inference = Histogram(
            "vllm:request_inference_time_seconds",
            "Admission to the last token (prefill + decode).",
            m, buckets=E2E_BUCKETS, registry=reg,
        )  # fmt: skip
        self.prefill = Histogram(
            "vllm:request_prefill_time_seconds",
            "Admission to the first token.",
            m, buckets=E2E_BUCKETS, registry=reg,
        )  # fmt: skip
        self.decode = Histogram(
            "vllm:request_decode_time_seconds",
            "First token to the last.",
            m, buckets=E2E_BUCKETS, registry=reg,
        )  # fmt: skip
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Prompt + generated tokens per engine step.",
            m, buckets=ITERATION_TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.ledger_wait = Histogram(
            "adaserve:usage_ledger_wait_seconds",
            "What a response waited for its usage ledger row's commit before its last bytes.",
            m, buckets=LEDGER_WAIT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.ledger_commit = Histogram(
            "adaserve:usage_ledger_commit_seconds",
            "A usage ledger row's time from the request's end (queued on the engine thread) "
            "to its commit (or spool).",
            m, buckets=LEDGER_WAIT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by vLLM finish reason (stop, length, abort).",
            ["model_name", "finished_reason"], registry=reg,
        )  # fmt: skip
        # per class: what the SLO targets are measured on (request-level TTFT and mean TPOT)
        self.class_ttft = Histogram(
            "adaserve:time_to_first_token_seconds",
            "Time to first token, by SLO class.",
            mc, buckets=TTFT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.class_tpot = Histogram(
            "adaserve:time_per_output_token_seconds",
            "Mean time per output token after the first, per request, by SLO class.",
            mc, buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        # set by ``start`` once the context length is known (the buckets depend on it)
        self.prompt_tokens: Histogram | None = None
        self.generation_tokens: Histogram | None = None
        self.max_tokens: Histogram | None = None
        self.finished = Counter(
            "adaserve:requests_finished",
            "Finished requests by class and finish reason.",
            ["model_name", "slo_class", "finish_reason"], registry=reg,
        )  # fmt: skip
        self.attained = Counter(
            "adaserve:slo_attained_requests",
            "Finished requests that met their TPOT and TTFT targets.",
            mc, registry=reg,
        )  # fmt: skip
        self.verify_tokens = Counter(
            "adaserve:verification_tokens",
            "Speculative candidate tokens verified for requests of this class.",
            mc, registry=reg,
        )  # fmt: skip
        self.accepted = Counter(
            "adaserve:accepted_tokens",
            "Speculative tokens accepted for requests of this class.",
            mc, registry=reg,
        )  # fmt: skip
        self.output_tokens = Counter(
            "adaserve:output_tokens", "Output tokens by class.", mc, registry=reg
        )
        self.goodput_tokens = Counter(
            "adaserve:goodput_tokens",
            "Output tokens of requests that met their SLO.",
            mc, registry=reg,
        )  # fmt: skip
        self.shed = Counter(
            "adaserve:shed_requests",
            "Requests refused by admission control or shutdown, by reason.",
            ["model_name", "slo_class", "reason"], registry=reg,
        )  # fmt: skip
        self.rate_limited = Counter(
            "adaserve:rate_limited_requests",
            "Requests refused by a tenant quota, by reason.",
            ["model_name", "tenant", "reason"], registry=treg,
        )  # fmt: skip
        self.charges = Counter(
            "adaserve:charges",
            "Charges (price per 1k output tokens of the class) by tenant and class.",
            ["model_name", "tenant", "slo_class"], registry=treg,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "adaserve:tenant_output_tokens",
            "Output tokens by tenant and class.",
            ["model_name", "tenant", "slo_class"], registry=treg,
        )  # fmt: skip
        for h in (
            self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.step_tpot,
            self.inference, self.prefill, self.decode, self.iteration_tokens,
        ):  # fmt: skip
            h.labels(model_name)
        for r in FINISHED_REASONS:
            self.success.labels(model_name, r)
        for c in class_names:
            self.class_ttft.labels(model_name, c)
            self.class_tpot.labels(model_name, c)
            for ctr in (
                self.attained,
                self.verify_tokens,
                self.accepted,
                self.output_tokens,
                self.goodput_tokens,
            ):
                ctr.labels(model_name, c)
            for r in SHED_REASONS:
                self.shed.labels(model_name, c, r)
        self._collector = EngineCollector(model_name, snapshot_fn, attainment_fn, targets_fn)
        reg.register(self._collector)

    def start(self, max_model_len: int, cache_info: dict | None = None) -> None:
        """What needs the loaded engine: the token-count histograms (1-2-5 buckets up to
        ``max_model_len``, as vLLM) and ``vllm:cache_config_info`` (``cache_info``:
        label -> value)."""
        if self.prompt_tokens is not None:
            return
        reg, m, mn = self.registry, ["model_name"], self.model_name
        buckets = build_1_2_5_buckets(max(1, int(max_model_len)))
        self.prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.",
            m, buckets=buckets, registry=reg,
        )  # fmt: skip
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request.",
            m, buckets=buckets, registry=reg,
        )  # fmt: skip
        self.max_tokens = Histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.",
            m, buckets=buckets, registry=reg,
        )  # fmt: skip
        self.max_generation = Histogram(
            "vllm:request_max_num_generation_tokens",
            "Per request, the most tokens any of its n choices generated.",
            m, buckets=buckets, registry=reg,
        )  # fmt: skip
        self.params_n = Histogram(
            "vllm:request_params_n", "The n request parameter.",
            m, buckets=(1, 2, 5, 10, 20), registry=reg,
        )  # fmt: skip
        for h in (
            self.prompt_tokens,
            self.generation_tokens,
            self.max_tokens,
            self.max_generation,
            self.params_n,
        ):
            h.labels(mn)
        self._collector.cache_info = dict(cache_info or {})

    def observe_request(self, n: int, max_generation_tokens: int) -> None:
        """One HTTP request whose choices all finished: its ``n`` and the most tokens
        one of them generated (vLLM's per-request series)."""
        if self.prompt_tokens is None:
            return
        self.params_n.labels(self.model_name).observe(n)
        self.max_generation.labels(self.model_name).observe(max_generation_tokens)

    def observe_compiles(self, seconds: list[float]) -> None:
        for v in seconds:
            self.grammar_compile.labels(self.model_name).observe(v)

    def observe_step(self, tokens: int) -> None:
        """One engine step that processed ``tokens`` prompt + generated tokens."""
        if tokens > 0:
            self.iteration_tokens.labels(self.model_name).observe(tokens)

    def observe_finish(
        self, cls: str, tenant: str, final: Final, charge: float, max_tokens: int | None = None
    ) -> None:
        """Record one finished request."""
        mn = self.model_name
        m = final.metrics
        self.finished.labels(mn, cls, final.reason).inc()
        self.success.labels(mn, finished_reason(final.reason)).inc()
        ttft, queue, e2e = m.get("ttft_ms"), m.get("queue_ms"), m.get("e2e_ms")
        if ttft is not None:
            self.ttft.labels(mn).observe(ttft / 1000)
            self.class_ttft.labels(mn, cls).observe(ttft / 1000)
        if m.get("tpot_ms") is not None:
            self.tpot.labels(mn).observe(m["tpot_ms"] / 1000)
            self.class_tpot.labels(mn, cls).observe(m["tpot_ms"] / 1000)
        if e2e is not None:
            self.e2e.labels(mn).observe(e2e / 1000)
        if queue is not None:
            self.queue.labels(mn).observe(queue / 1000)
        # vLLM's phases: queued -> admitted (scheduled) -> first token -> last token
        if queue is not None and ttft is not None:
            self.prefill.labels(mn).observe(max(0.0, ttft - queue) / 1000)
            if e2e is not None:
                self.decode.labels(mn).observe(max(0.0, e2e - ttft) / 1000)
                self.inference.labels(mn).observe(max(0.0, e2e - queue) / 1000)
        if (  # the three are made together (``start``)
            self.prompt_tokens is not None
            and self.generation_tokens is not None
            and self.max_tokens is not None
        ):
            self.prompt_tokens.labels(mn).observe(final.prompt_tokens)
            self.generation_tokens.labels(mn).observe(final.completion_tokens)
            if max_tokens:
                self.max_tokens.labels(mn).observe(max_tokens)
        times = final.token_times
        itl = self.itl.labels(mn)
        step = self.step_tpot.labels(mn)
        for a, b in zip(times, times[1:]):
            itl.observe(max(0.0, b - a))
            if b > a:  # a new step (tokens of one speculative step share a time)
                step.observe(b - a)
        n = final.completion_tokens
        self.output_tokens.labels(mn, cls).inc(n)
        self.verify_tokens.labels(mn, cls).inc(m.get("tree_nodes") or 0)
        self.accepted.labels(mn, cls).inc(m.get("accepted_tokens") or 0)
        if m.get("slo_attained"):
            self.attained.labels(mn, cls).inc()
            self.goodput_tokens.labels(mn, cls).inc(n)
        self.tenant_tokens.labels(mn, tenant, cls).inc(n)
        self.charges.labels(mn, tenant, cls).inc(charge)

    def observe_shed(self, cls: str, reason: str) -> None:
        self.shed.labels(self.model_name, cls, reason).inc()

    def observe_rate_limited(self, tenant: str, reason: str) -> None:
        self.rate_limited.labels(self.model_name, tenant, reason).inc()

    def render(self, tenants: bool = True, only_tenant: str | None = None) -> bytes:
        """Prometheus text: the engine-wide series, then the per-tenant ones unless
        ``tenants`` is false (only ``only_tenant``'s samples when that is given)."""
        text = generate_latest(self.registry)
        if not tenants:
            return text
        if only_tenant is None:
            return text + generate_latest(self.tenant_registry)
        return text + generate_latest(_OneTenant(self.tenant_registry, only_tenant))


class _OneTenant:
    """A collector view of the per-tenant registry that keeps one tenant's samples."""

    def __init__(self, registry: CollectorRegistry, tenant: str):
        self.registry = registry
        self.tenant = tenant

    def collect(self):
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s for s in fam.samples if s.labels.get("tenant") == self.tenant]
            yield out


LEDGER_WAIT_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
    10.0,
)
