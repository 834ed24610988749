"""What the routes share: the engine loop, tenants, quotas, usage, metrics and the SLO
report; start-up, drain and the accounting of every finished request."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from adaserve.core.counters import admission_summary
from adaserve.ledger import Budget, BudgetBook, Ledger
from adaserve.server.accounting import RowAcc, wall_of
from adaserve.server.auth import TenantRegistry
from adaserve.server.config import ServerConfig, check_against_classes
from adaserve.server.engine_loop import EngineLoop, Final, Handle
from adaserve.server.engine_messages import Event, Finished, Rejected, Stepped, Traced
from adaserve.server.fair_pool import FairPool
from adaserve.server.iterations import IterationLog
from adaserve.server.metrics import ServerMetrics
from adaserve.server.quotas import QuotaBook, RetryHold
from adaserve.server.report import Record, ReportStore
from adaserve.server.retry_match import RetryMatch
from adaserve.server.stats_log import StatsLogger, startup_summary
from adaserve.server.usage import UsageBook
from adaserve.text.chat_template import ChatTemplate
from adaserve.text.generation_config import describe as describe_defaults

if TYPE_CHECKING:
    from adaserve.server.dashboard import Dashboard


def engine_summary(loop: EngineLoop) -> dict:
    """The engine part of ``/v1/slo/report``: policy, unloaded TPOT, queues, KV use and
    the speculation counters, as of the last step."""
    snap = loop.snapshot
    c = snap.counters
    return {
        "policy": loop.ready_info.policy,
        "unloaded_tpot_ms": loop.unloaded_tpot_ms,
        "running": snap.running,
        "waiting": snap.waiting,
        "kv_usage": snap.kv_usage,
        "iterations": c.get("iterations", 0),
        "fallback_iterations": c.get("fallback_iterations", {}),
        "spec_draft_tokens": c.get("spec_draft_tokens", 0),
        "spec_accepted_tokens": c.get("spec_accepted_tokens", 0),
        "stalls": c.get("stalls", {}),
        "drift": snap.drift,
        # structured outputs: compile and mask time, forced tokens
        "structured": _structured_summary(loop),
        # automatic prefix caching: queried and cached prompt tokens, hit rate by class
        "prefix_cache": snap.prefix_cache or None,
        # admission: refusals by class and reason, promised against realised attainment
        "admission": admission_summary(c.get("shed_by_class"), c.get("promised")),
        # the thread plan, the profile and where the class targets come from
        **loop.provenance,
    }


def _structured_summary(loop: EngineLoop) -> dict | None:
    e = loop.engine  # None before the loop built it
    return e.structured.summary() if e is not None else None


# the derived request-body limit (``derived_body_limit``) stays within these
MIN_BODY_BYTES = 1 << 20
MAX_BODY_BYTES = 64 << 20
# a body may hold this many worst-case contexts (several prompts, JSON escaping)
BODY_CONTEXTS = 8


def derived_body_limit(max_model_len: int, tokenizer) -> int:
    """The default body limit: room for ``BODY_CONTEXTS`` contexts of the longest
    tokens the vocabulary has (1 MiB to 64 MiB). A bigger body cannot be a prompt that
    fits, and is refused at its headers, before it is read or parsed."""
    per_token = tokenizer.max_token_bytes if tokenizer is not None else 16
    want = BODY_CONTEXTS * max_model_len * per_token
    return int(min(max(want, MIN_BODY_BYTES), MAX_BODY_BYTES))


log = logging.getLogger("adaserve.server")

# the threads that tokenise, detokenise and run chat templates, never the event loop's:
# half the cores (the engine's threads have the rest), at least one
TOKENIZER_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
GRAMMAR_THREADS = 2  # concurrent grammar compiles (each request waits for its own)


@dataclass(frozen=True)
class RequestCtx:
    """Per-request accounting data carried by a ``Handle``."""

    tenant: str
    cls: str
    price_per_1k: float
    degraded_from: str | None
    source: str
    count_prompt: bool
    reserved_tokens: int = 0  # output tokens reserved against tokens per minute
    acc: Any = None  # the request's ``RowAcc`` (its ledger row)


class ServerState:
    """Everything the routes share: engine loop, tenants, quotas, metrics, report."""

    dashboard: Dashboard  # set by ``server.dashboard.create_dashboard``

    def __init__(self, loop: EngineLoop, cfg: ServerConfig, model_name: str, classes):
        self.loop = loop
        self.cfg = cfg
        self.model_name = model_name
        # only the served id: the checkpoint's path is not a name a client may use (nor
        # learn from the answer)
        self.served_names = {model_name, *cfg.model_aliases}
        self.tenants = TenantRegistry.for_config(cfg)
        self.quotas = QuotaBook(cfg.tenants)
        self.retry_hold = RetryHold(cfg.quota_hold_s)
        self.retry_match = RetryMatch()  # seats of refused clients that retry without the token
        self.usage = UsageBook()
        # budgets longer than a minute, started from the ledger at start-up
        self.budgets = BudgetBook(
            {
                t.name: Budget(t.tokens_per_day, t.requests_per_day, t.charge_per_month)
                for t in cfg.tenants
            }
        )
        self.ledger: Ledger | None = None  # opened at start-up (None: --usage-db none)
        names = [c.name for c in classes]
        self.prices = {c.name: c.price_per_1k for c in classes}
        self.report = ReportStore(names)
        self.metrics = ServerMetrics(
            model_name,
            names,
            lambda: self.loop.snapshot,
            self.report.attainment,
            lambda: self.loop.class_slos,
        )
        self.metrics._collector.threads_fn = lambda: self.loop.provenance.get("threads")
        self.metrics._collector.structured_fn = lambda: (
            self.loop.engine.structured if self.loop.engine is not None else None
        )
        self.metrics._collector.ledger_fn = lambda: (
            self.ledger.writer if self.ledger is not None else None
        )
        # the engine's clock (``WallClock``: perf_counter) at start; iteration samples
        # are stamped in seconds from here
        self.started_at = time.perf_counter()
        self.iterations = IterationLog(self.started_at)
        loop.subscribe(self.on_engine_event)
        self.stats = StatsLogger(names, lambda: self.loop.snapshot)
        self.draining = False
        self._drain_started = False
        self.body_limit = cfg.max_body_bytes or MAX_BODY_BYTES  # set at startup
        self.created = int(time.time())
        self.chat_template: ChatTemplate | None = None  # set at start-up
        self._warned_fields: set[str] = set()
        self.warned_guided: set[str] = set()  # deprecated guided_* fields logged once each
        self._tokenizer_pool = FairPool(TOKENIZER_THREADS, "adaserve-tokenize")
        # grammar compiles have threads of their own: a slow one holds neither the
        # tokenisers nor the event loop nor the engine, only its own request
        self._grammar_pool = ThreadPoolExecutor(
            GRAMMAR_THREADS, thread_name_prefix="adaserve-grammar"
        )

    async def off_loop(self, fn, *args):
        """``fn(*args)`` on the tokenizer threads: tokenising, detokenising and chat
        templates never run on the event loop (a flood of them queues there, bounded
        by each tenant's concurrency, while the loop keeps answering), and the tenants
        take turns (``FairPool``): one tenant's long prompts do not queue another's."""
        return await self._tokenizer_pool.run(fn, *args)

    async def off_loop_grammar(self, fn, *args):
        """``fn(*args)`` on the grammar-compile threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._grammar_pool, functools.partial(fn, *args))

    def warn_ignored_fields(self, names: list[str]) -> None:
        """Log unknown request fields (ignored, as vLLM), once per field name."""
        new = [n for n in names if n not in self._warned_fields]
        if new:
            self._warned_fields.update(new)
            log.warning(
                "ignored unknown request field(s) %s (logged once each; "
                "--strict-fields rejects them)",
                ", ".join(repr(n)[:80] for n in new[:16]),
            )

    def slo_report(self, only: str | None) -> dict:
        """The ``/v1/slo/report`` body (``only``: that tenant's usage alone)."""
        info = self.loop.ready_info
        slos = self.loop.class_slos
        rep = self.report.build(
            class_targets={
                c: {"tpot_ms": s.tpot_ms, "ttft_ms": s.ttft_ms} for c, s in slos.items()
            },
            prices={c.name: c.price_per_1k for c in info.classes},
            flops_per_token=info.flops_per_token_target,
            usage=self.usage.by_tenant(only),
            engine=engine_summary(self.loop),
            tenant=only,
        )
        rep["model"] = self.model_name
        return rep

    # ------------------------------------------------------------------ lifecycle
    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await asyncio.to_thread(self.open_ledger)
        await asyncio.to_thread(self.loop.start)
        info = self.loop.ready_info
        # (before serving: reading the vocabulary once may block the loop)
        self.body_limit = self.cfg.max_body_bytes or derived_body_limit(
            info.max_model_len, info.tokenizer
        )
        check_against_classes(self.cfg, info.classes)
        self.metrics.start(
            info.max_model_len,
            {
                "block_size": info.block_size,
                "num_gpu_blocks": info.kv_blocks,
                "cache_dtype": info.dtype,
                "device": info.device,
                "enable_prefix_caching": info.prefix_caching,
            },
        )
        self.chat_template = self.load_chat_template()
        if info.sampling_defaults:
            log.info("%s", describe_defaults(info.sampling_defaults))
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
        log.info("%s", startup_summary(info, self.model_name, self.cfg.admission))
        ticker = None
        if self.cfg.log_stats:
            self.stats = StatsLogger(self.stats.class_names, lambda: self.loop.snapshot)
            ticker = asyncio.create_task(self.stats.run(self.cfg.log_stats_interval_s))
        try:
            yield
        finally:
            self.draining = True
            if ticker is not None:
                ticker.cancel()
            self._tokenizer_pool.shutdown(wait=False)
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(self.loop.stop)
            if self.ledger is not None:
                await asyncio.to_thread(self.ledger.close)

    def open_ledger(self) -> None:
        """The usage ledger (``[usage] db``), migrated, with the budgets read from it;
        ``none``: usage stays in memory, as it says."""
        ucfg = self.cfg.usage
        if not ucfg.enabled:
            log.warning(
                "usage ledger off (--usage-db none): usage, charges and budgets live in "
                "memory only and are lost on restart"
            )
            return
        if self.ledger is None:
            self.ledger = Ledger(ucfg, self.budgets)
            self.ledger.writer.on_done = self.metrics.ledger_commit.labels(self.model_name).observe
            log.info("usage ledger: %s (spool %s)", self.ledger.describe(), ucfg.spool_path())

    def new_acc(self, rid: str, tenant: str, key_id: str | None, class_asked: str) -> RowAcc:
        replica = self.ledger.replica if self.ledger is not None else ""
        return RowAcc(rid, tenant, key_id, class_asked, replica)

    def load_chat_template(self) -> ChatTemplate | None:
        """The model's chat templates, or ``chat_template`` of the config (which must
        compile: ``ChatTemplateError`` else); None without a tokenizer."""
        tok = self.loop.ready_info.tokenizer
        if self.cfg.chat_template is not None:
            config = tok.config if tok is not None else {}
            ct = ChatTemplate.of_checkpoint(
                self.loop.ready_info.model_dir, config, self.cfg.chat_template
            )
            ct.check()
            return ct
        return tok.chat if tok is not None else None

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

    # ------------------------------------------------------------------ accounting
    def shed(self, cls: str, reason: str, tenant: str | None = None, status: int = 429) -> None:
        """Count a request shed (admission control, the scheduler, shutdown)."""
        self.metrics.observe_shed(cls, reason)
        self.report.shed(cls, reason)
        self.refused(tenant or "", cls, reason, status)

    def rate_limited(self, tenant: str, reason: str, cls: str = "") -> None:
        """Count a request refused by the tenant's quotas or budgets."""
        self.metrics.observe_rate_limited(tenant, reason)
        self.report.rate_limited(tenant, reason)
        self.refused(tenant, cls, reason, 429)

    def refused(self, tenant: str, cls: str, reason: str, status: int) -> None:
        """A refusal in the ledger (per tenant, class and reason)."""
        if self.ledger is not None:
            self.ledger.refuse(tenant, cls, reason, status)

    def on_engine_event(self, ev: Event) -> None:
        """The engine thread's events: a finished request accounted, an add refused
        before the engine refunded, each step's tokens and trace recorded."""
        match ev:
            case Finished(h, final):
                self.on_finish(h, final)
            case Rejected(h):
                self.on_reject(h)
            case Stepped(tokens):
                self.metrics.observe_step(tokens)
            case Traced(trace):
                self.iterations.record(trace)

    def on_reject(self, h: Handle) -> None:
        """A request that never reached the engine gives back its output reservation."""
        ctx: RequestCtx | None = h.ctx
        if ctx is not None:
            self.quotas.refund(ctx.tenant, ctx.reserved_tokens)
            if ctx.acc is not None:
                self._row_part(ctx.acc, h.index, None)

    def _row_part(self, acc: RowAcc, index: int, part) -> None:
        """A choice of ``acc``'s request ended; the last one writes its row."""
        try:
            last, row = acc.add(index, part)
            if not last:
                return
            ledger = self.ledger
            acc.future = self.budgets.settle(
                acc.tenant,
                acc.budget_admitted,
                0 if row is None else row.prompt_tokens + row.completion_tokens,
                0.0 if row is None else row.charge,
                row is not None,
                None if row is None or ledger is None else lambda: ledger.record(row),
            )
        except Exception:
            log.exception("usage ledger: recording request %s failed", acc.id)

    def on_finish(self, h: Handle, final: Final) -> None:
        """Account a finished request (engine thread) at the class it was delivered in:
        a request the scheduler degraded is billed at the looser class's price and
        counted there, with ``degraded_from`` the class it asked for."""
        ctx: RequestCtx = h.ctx
        self.quotas.settle(ctx.tenant, ctx.reserved_tokens, final.completion_tokens)
        cls, price = ctx.cls, ctx.price_per_1k
        if final.cls is not None and final.cls != ctx.cls:
            cls, price = final.cls, self.prices.get(final.cls, ctx.price_per_1k)
        degraded_from = ctx.degraded_from or final.degraded_from
        pt = final.prompt_tokens if ctx.count_prompt else 0
        charge = self.usage.record(
            ctx.tenant, cls, pt, final.completion_tokens, price, degraded=degraded_from is not None
        )
        m = final.metrics
        if ctx.acc is not None:
            self._row_part(
                ctx.acc,
                h.index,
                (
                    cls, pt, final.completion_tokens, charge, m.get("ttft_ms"),
                    m.get("tpot_ms"), bool(m.get("slo_attained")), final.reason,
                    wall_of(final.arrival), wall_of(final.finished_at),
                ),
            )  # fmt: skip
        m["charge"] = charge
        m["slo_source"] = ctx.source
        if degraded_from:
            m["degraded_from"] = degraded_from
        self.metrics.observe_finish(cls, ctx.tenant, final, charge, h.params.max_tokens)
        self.stats.observe_finish(
            cls,
            bool(m.get("slo_attained")),
            int(m.get("tree_nodes") or 0),
            int(m.get("accepted_tokens") or 0),
        )
        self.report.record(
            Record(
                cls=cls,
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
                degraded_from=degraded_from,
            )
        )
