"""The engine thread and its bridge to asyncio.

The ``Engine`` is not thread-safe, so exactly one thread (``adaserve-engine``) creates
it and calls it. HTTP handlers talk to that thread through a FIFO inbox of commands
(add, abort, drain, stop) and never block the event loop:

- ``submit(handle)`` queues an add and awaits a ``concurrent.futures.Future`` that the
  engine thread resolves with the ``Request`` (or the validation / admission error);
- after every step (and after every batch of commands) the engine thread hands each
  tracked request's new token ids, and on finish a ``Final`` (text, metrics), to its
  asyncio queue with ``loop.call_soon_threadsafe``;
- ``abort(handle)`` queues an abort; the thread drains the inbox before every step, so
  a disconnected client's request and KV are freed within one iteration.

Read-only views for other threads (``snapshot``, ``class_slos``, ``info``) are
immutable objects replaced by reference on the engine thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaserve.config import EngineConfig
from adaserve.core.config import QUEUE_FULL_RETRY_S
from adaserve.core.slo import SLO
from adaserve.engine.api import request_metrics
from adaserve.errors import AdmissionRejected
from adaserve.server.engine_messages import (
    DISCONNECTED,
    ENGINE_ERROR,
    SHUTDOWN,
    Abort,
    Add,
    Call,
    Command,
    Drain,
    EngineInfo,
    EngineSnapshot,
    Event,
    Final,
    Finished,
    Handle,
    Rejected,
    ShuttingDown,
    Stepped,
    Stop,
    Traced,
)
from adaserve.spec_decode.request import Status
from adaserve.text.generation_config import sampling_defaults
from adaserve.util import gc_heap, threads
from adaserve.util.jsonsafe import json_safe

if TYPE_CHECKING:
    from adaserve.engine.engine import Engine

__all__ = [  # the messages, where the server's modules import them from
    "DISCONNECTED",
    "ENGINE_ERROR",
    "SHUTDOWN",
    "EngineInfo",
    "EngineLoop",
    "EngineSnapshot",
    "Final",
    "Handle",
    "ShuttingDown",
]

log = logging.getLogger("adaserve.server")


class EngineLoop:
    """Owns the engine thread. ``source`` is an ``Engine`` or an ``EngineConfig``
    (the engine is then built on the engine thread)."""

    @classmethod
    def for_server(cls, source, cfg) -> EngineLoop:
        """The loop a server runs for ``source``, with ``cfg``'s (``ServerConfig``)
        queue bound and step timing."""
        return cls(
            source,
            max_waiting=cfg.max_waiting,
            step_delay_s=cfg.step_delay_s,
            step_pace_ms=cfg.step_pace_ms,
            confine=bool(cfg.confine_threads),
        )

    def __init__(
        self,
        source,
        *,
        max_waiting: int | None = None,
        step_delay_s: float = 0.0,
        step_pace_ms: tuple[float, float] | None = None,
        confine: bool = False,
    ):
        self._source = source
        self.max_waiting = max_waiting
        self.step_delay_s = step_delay_s
        self.step_pace_ms = step_pace_ms  # ``ServerConfig.step_pace_ms``
        # called with every ``Event`` on the engine thread (``subscribe``)
        self._listeners: list[Callable[[Event], None]] = []
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._tracked: dict[int, Handle] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.info: EngineInfo | None = None
        self.snapshot = EngineSnapshot()
        self.class_slos: dict[str, SLO] = {}
        self.unloaded_tpot_ms: float | None = None  # what the class targets multiply
        self.pinned = False  # the engine thread is pinned to the thread plan's cores
        self.confine = confine  # ``ServerConfig.confine_threads``
        # the cores the rest of the process is confined to (``threads.confine_rest``)
        self.reserve_cores: tuple[int, ...] = ()
        self.provenance: dict = {}  # ``engine_provenance``: threads, profile, targets
        self._class_slos_at = 0.0
        self._owns_engine = isinstance(source, EngineConfig)
        self._drain_deadline: float | None = None
        self._closed = False  # no more adds (draining past its deadline, or stopping)
        self.alive = False

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Have ``listener`` called with every ``Event``, on the engine thread (an error
        it raises is logged)."""
        self._listeners.append(listener)

    def _emit(self, ev: Event) -> None:
        for listener in self._listeners:
            try:
                listener(ev)
            except Exception:
                log.exception("%s listener failed", type(ev).__name__)

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> None:
        """Start the thread and wait until the engine is built (re-raises its error)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="adaserve-engine", daemon=True)
            self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not start in time")
        if self.error is not None:
            raise self.error

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is in flight (reason ``server_shutdown``) and end the thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._inbox.put(Stop())
        self._thread.join(timeout)

    def drain(self, grace_s: float) -> None:
        """Refuse new requests now; abort those still running after ``grace_s``."""
        self._inbox.put(Drain(time.monotonic() + grace_s))

    @property
    def in_flight(self) -> int:
        """Requests the engine thread holds (queued commands not yet counted)."""
        return len(self._tracked)

    def tracked(self) -> tuple[Handle, ...]:
        """The handles the engine thread holds now (a snapshot, from any thread: the
        copy is one C call under the GIL)."""
        for _ in range(3):
            try:
                return tuple(self._tracked.values())
            except RuntimeError:  # changed size while copied (a free-threaded build)
                continue
        return ()

    # ------------------------------------------------------------------ async API
    async def submit(self, h: Handle):
        """Queue ``h`` in the engine; returns its ``Request`` or raises the engine's
        ``InvalidRequestError`` / ``AdmissionRejected``, or ``ShuttingDown``."""
        if self._closed or not self.alive:
            self._emit(Rejected(h))
            raise ShuttingDown("the server is shutting down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Add(h, fut))
        return await asyncio.wrap_future(fut)

    def abort(self, h: Handle, reason: str = DISCONNECTED) -> None:
        """Cancel ``h`` (no-op once finished); thread-safe and non-blocking."""
        if h.done or h.aborted:
            return
        h.aborted = True
        self._inbox.put(Abort(h, reason))

    def reload_profile(self) -> concurrent.futures.Future:
        """Queue the admin action (``reload_profile``): the profile read again from its
        file between two steps, the class targets refreshed; resolves to its
        provenance (or the ValueError saying why not)."""

        def go(e):
            prov = reload_profile(e)
            self._refresh_class_slos(force=True)
            return prov

        return self.call(go)

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Call(fn, fut))
        return fut

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            if isinstance(self._source, EngineConfig):
                from adaserve.engine import build_engine

                # the serving loop's thread (and the OpenMP team it starts) runs on the
                # cores the thread plan leaves after the reserve; the HTTP loop does not
                with contextlib.suppress(ValueError):  # a bad count: build_engine says so
                    self.pinned = threads.pin_current_thread(threads.choose(self._source.threads))
                self.engine = build_engine(self._source)
                if self.confine and self.pinned and self.engine.thread_plan is not None:
                    # the rest of the process (the HTTP loop, tokenisers, the threads
                    # they start) off the engine's cores: after the build, which
                    # chooses the plan again from the process's cores
                    self.reserve_cores = threads.confine_rest(self.engine.thread_plan)
                    if self.reserve_cores:
                        print(
                            "adaserve: the rest of the server (HTTP loop, tokenisers) runs on "
                            f"cores {threads.describe_cores(self.reserve_cores)}",
                            file=sys.stderr,
                            flush=True,
                        )
            else:
                self.engine = self._source
            e = self.engine
            from adaserve.engine.warmup import warm_up

            warm_up(e)  # every kernel and pass family run once before /health says ready
            # start-up state out of the collector's reach: a full collection walked it
            # in ~200 ms, a stall of every running request (``util.gc_heap``)
            gc_heap.freeze_startup_heap()
            assert e.cfg.default_class is not None  # EngineConfig requires one
            self.info = EngineInfo(
                model_dir=str(e.model_dir),
                draft_dir=str(e.draft_dir) if e.draft_dir else None,
                max_model_len=e.max_model_len,
                vocab_size=e.target.cfg.vocab_size,
                tokenizer=e.tokenizer,
                classes=tuple(e.cfg.classes),
                default_class=e.cfg.default_class,
                policy=e.policy.name,
                flops_per_token_target=float(e.flops_per_token_target),
                sampling_defaults=sampling_defaults(e.model_dir, e.cfg.generation_config),
                **_pool_info(e),
            )
            self._refresh_class_slos(force=True)
            self._publish_snapshot()
        except BaseException as exc:  # noqa: BLE001 - reported to the starter
            self.error = exc
            self._ready.set()
            return
        self.alive = True
        self._ready.set()
        try:
            self._loop()
        finally:
            self.alive = False
            self._closed = True
            self._fail_pending()
            if self._owns_engine and self.engine is not None:
                self.engine.close()

    @property
    def ready_info(self) -> EngineInfo:
        """``info``, once ``start`` has returned (the engine is built)."""
        info = self.info
        assert info is not None, "the engine loop has not started"
        return info

    @property
    def built_engine(self) -> Engine:
        """The engine once built (``engine``, narrowed: for a call between steps)."""
        return self._engine

    @property
    def _engine(self) -> Engine:
        """The engine, on the engine thread once it is built (``_run`` builds it before
        anything else runs there)."""
        e = self.engine
        assert e is not None, "the engine is not built yet"
        return e

    def _loop(self) -> None:
        e = self._engine
        while True:
            cmds = []
            if not e.has_work():
                # the loop never measures anything while it waits: a profile comes from
                # ``adaserve profile`` or the admin action, not from an idle moment
                timeout = None
                if self._drain_deadline is not None:
                    timeout = max(0.0, self._drain_deadline - time.monotonic()) + 0.01
                with contextlib.suppress(queue.Empty):
                    cmds.append(self._inbox.get(timeout=timeout))
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            stop = False
            for c in cmds:
                if isinstance(c, Stop):
                    stop = True
                else:
                    self._command(c)
            if stop:
                self._closed = True
                self._abort_all(SHUTDOWN)
                self._publish()
                return
            if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                self._closed = True
                self._drain_deadline = None
                self._abort_all(SHUTDOWN)
            if e.has_work():
                before = e.last_trace
                tokens_before = _step_tokens(e)
                started = time.perf_counter()
                try:
                    e.step()
                except Exception:
                    log.exception("engine step failed; aborting the requests in flight")
                    self._abort_all(ENGINE_ERROR)
                else:
                    self._emit(Stepped(_step_tokens(e) - tokens_before))
                if e.last_trace is not None and e.last_trace is not before:
                    self._emit(Traced(e.last_trace))
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
                if self.step_pace_ms is not None:
                    time.sleep(self._pace_left(before, time.perf_counter() - started))
            self._publish()

    def _command(self, c: Command) -> None:
        match c:
            case Add(h, fut):
                self._add(h, fut)
            case Abort(h, reason):
                if h.req is not None and not h.req.finished:
                    self._engine.abort(h.req, reason)
            case Drain(deadline):
                self._drain_deadline = deadline
                if deadline <= time.monotonic():
                    self._closed = True
            case Call(fn, fut):
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self._engine))
                    except Exception as exc:
                        fut.set_exception(exc)

    def _add(self, h: Handle, fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            self._emit(Rejected(h))
            return
        try:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if self.max_waiting is not None and len(self._engine.waiting) >= self.max_waiting:
                raise AdmissionRejected(
                    f"the queue is full ({len(self._engine.waiting)} requests waiting)",
                    "queue_full",
                    QUEUE_FULL_RETRY_S,
                )
            r = self._engine.add_request(
                h.prompt_ids,
                h.params,
                h.slo,
                arrival=h.arrival,
                grammar=h.grammar,
                cache_salt=h.cache_salt,
                tenant=h.tenant,
                retry_token=h.retry_token,
            )
        except Exception as exc:  # handed to the awaiting handler
            self._emit(Rejected(h))
            fut.set_exception(exc)
            return
        h.req = r
        self._tracked[r.rid] = h
        fut.set_result(r)

    def _abort_all(self, reason: str) -> None:
        for h in list(self._tracked.values()):
            r = h.req
            if r is not None and not r.finished:
                try:
                    self._engine.abort(r, reason)
                except Exception:  # never leave a client waiting on a broken engine
                    log.exception("abort failed")
                    r.finish_reason = reason
                    r.finished_at = time.perf_counter()
                    r.status = Status.FINISHED

    def _publish(self) -> None:
        """Hand new tokens / finals to their consumers; refresh the snapshot."""
        for rid, h in list(self._tracked.items()):
            r = h.req
            assert r is not None  # a tracked handle holds its request (``_add``)
            n = r.num_output
            if n <= h.sent and not r.finished:
                continue
            new = r.output_ids[h.sent : n] if h.want_tokens else []
            lps = (
                r.logprobs[h.sent : n] if h.want_tokens and r.params.logprobs is not None else None
            )
            plps = None
            if h.sent == 0 and h.want_tokens and r.params.prompt_logprobs is not None:
                plps = tuple(r.prompt_logprobs)
            h.sent = n
            final = None
            if r.finished:
                del self._tracked[rid]
                final = self._final(h)
            elif not h.want_tokens:
                continue
            with contextlib.suppress(RuntimeError):  # the event loop is gone
                h.loop.call_soon_threadsafe(h._deliver, new, final, lps, plps)
        self._publish_snapshot()
        self._refresh_class_slos()

    def _final(self, h: Handle) -> Final:
        e = self._engine
        r = h.req
        assert r is not None  # a tracked handle holds its request (``_add``)
        try:
            text = e.output_text(r)
        except Exception:
            text = None
        try:
            metrics = request_metrics(e, r)
        except Exception:
            log.exception("request_metrics failed")
            metrics = {"slo_class": r.slo.cls, "slo_attained": False}
        logprobs: Any
        output_ids, logprobs = list(r.output_ids), r.logprobs
        if h.drop_output:
            text, output_ids, logprobs = "", [], ()
            metrics["output_tokens"] = 0
        final = Final(
            reason=r.finish_reason or "abort",
            text=text,
            output_ids=output_ids,
            prompt_tokens=len(r.prompt_ids),
            metrics=json_safe(metrics),
            token_times=tuple(r.token_times),
            arrival=r.arrival,
            finished_at=r.finished_at or time.perf_counter(),
            logprobs=tuple(logprobs) if r.params.logprobs is not None else None,
            prompt_logprobs=(
                tuple(r.prompt_logprobs) if r.params.prompt_logprobs is not None else None
            ),
            cls=r.slo.cls,
            degraded_from=r.degraded_from,
            cached_tokens=r.cached_prompt,
        )
        self._emit(Finished(h, final))
        return final

    def _pace_left(self, before, elapsed_s: float) -> float:
        """Seconds to sleep so that a step that took ``elapsed_s`` lasts its modelled
        time ``A + B x tokens`` (``step_pace_ms``); 0 when the real step took longer,
        or when no pass ran (the trace is still ``before``)."""
        tr = self._engine.last_trace
        if tr is None or tr is before or self.step_pace_ms is None:
            return 0.0
        a, b = self.step_pace_ms
        return max(0.0, (a + b * tr.tokens) / 1000.0 - elapsed_s)

    def _publish_snapshot(self) -> None:
        e = self._engine
        self.snapshot = EngineSnapshot(
            running=len(e.running),
            waiting=len(e.waiting),
            kv_usage=float(e.kv_usage()),
            counters=dataclasses.asdict(e.counters),
            prefix_cache=_prefix_cache_of(e),
            time=time.time(),
            drift=_drift_of(e),
        )

    def refresh_class_slos(self) -> None:
        """The class targets read again from the engine (on the engine thread, after a
        change of its hardware model's targets)."""
        self._refresh_class_slos(force=True)

    def _refresh_class_slos(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._class_slos_at < 10.0:
            return
        self._class_slos_at = now
        self.class_slos = {c.name: self._engine.class_slo(c.name) for c in self._engine.cfg.classes}
        self.unloaded_tpot_ms = float(self._engine.unloaded_tpot_ms())
        self.provenance = engine_provenance(self._engine, self.pinned, self.reserve_cores)

    def _fail_pending(self) -> None:
        """After the loop ends: answer queued adds and unfinished handles."""
        while True:
            try:
                c = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(c, Add):
                self._emit(Rejected(c.handle))
            if isinstance(c, Add | Call) and c.future.set_running_or_notify_cancel():
                c.future.set_exception(ShuttingDown("the server is shutting down"))
        if self.engine is not None and self._tracked:
            self._abort_all(SHUTDOWN)
            self._publish()


def _drift_of(e: Engine) -> dict:
    return e.drift.as_dict()


def engine_provenance(e: Engine, pinned: bool = False, reserve: tuple[int, ...] = ()) -> dict:
    """Threads (with the cores the rest of the process is confined to, ``reserve``),
    profile, where the class targets come from and the start-up heap's freeze
    (``util.gc_heap``; immutable once made)."""
    plan = e.thread_plan
    hw = e.hw
    out: dict = {"threads": None, "profile": None}
    if plan is not None:
        out["threads"] = {
            **plan.as_dict(),
            "pinned": bool(pinned),
            "reserve_cores": list(reserve),
            # which machine's cores these are (a client compares it with its own)
            "machine": threads.machine_id(),
        }
    if hw is not None and hasattr(hw, "provenance"):
        out["profile"] = hw.provenance()
    heap = gc_heap.frozen()
    out["gc"] = heap.as_dict() if heap is not None else None
    return out


def reload_profile(e) -> dict:
    """The admin action, run on the engine thread: the profile read again from its
    file (what ``adaserve profile`` last adopted); returns its provenance."""
    from adaserve.engine.profile import reload_profile as load

    e.set_hardware(load(e))
    return e.hw.provenance()


def _step_tokens(e) -> int:
    """Prompt + generated tokens the engine has processed so far."""
    c = e.counters
    return int(c.prompt_tokens) + int(c.generation_tokens)


def _pool_info(e: Engine) -> dict:
    """Device, dtype and KV pool size of an engine (what its runner knows)."""
    run = e.runner
    blocks = int(run.num_blocks or 0)
    bs = int(e.cfg.block_size or 0)
    per_slot = int(run.kv_bytes_per_slot or 0)
    return {
        "device": str(e.device or ""),
        "dtype": str(e.dtype or "").removeprefix("torch."),
        "kv_blocks": blocks,
        "block_size": bs,
        "kv_bytes": blocks * bs * per_slot,
        "prefix_caching": bool(e.cfg.enable_prefix_caching),
    }


def model_name_of(source) -> str:
    """A default served model id: the checkpoint directory's name (``adaserve`` for the
    shipped pair)."""
    from adaserve.util import paths

    if isinstance(source, EngineConfig):
        return Path(source.model).name if source.model else "adaserve"
    md = source.model_dir  # an Engine
    if md is None or Path(md) == paths.DEFAULT_TARGET:
        return "adaserve"
    return Path(md).name


def _prefix_cache_of(e: Engine) -> dict:
    """The engine's prefix-cache figures."""
    return e.prefix_cache_stats()
