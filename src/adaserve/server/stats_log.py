"""The server's log lines about itself: a start-up summary and a periodic stats line.

As vLLM's ``LoggingStatLogger``: every ``log_stats_interval_s`` seconds (10 by default;
``--disable-log-stats`` turns it off) one INFO line with the prompt and generation
throughput over the interval, the running and waiting requests and the KV cache use,
followed by what adaserve adds: each class's SLO attainment and draft acceptance over
the interval. An idle interval (no tokens now nor in the previous one) logs at DEBUG,
as vLLM does, to keep an idle server's log quiet.

Throughputs come from the engine's own counters (``EngineSnapshot``), per-class figures
from the requests that finished in the interval (``observe_finish``, engine thread).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("adaserve.server.stats")


@dataclass
class _ClassTally:
    finished: int = 0
    attained: int = 0
    verified: int = 0  # candidate tokens verified
    accepted: int = 0


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def startup_summary(info, model_name: str, admission: bool | None = None) -> str:
    """One line: what is served and with what (``info`` is an ``EngineInfo``), and
    whether admission control is on (what a 429 means)."""
    classes = ", ".join(c.name for c in info.classes)
    max_tokens = info.kv_blocks * info.block_size
    pool = (
        f"KV pool {info.kv_blocks} blocks x {info.block_size} tokens = {max_tokens} tokens "
        f"({_fmt_bytes(info.kv_bytes)})"
    )
    return (
        f"engine ready: model {model_name} ({info.model_dir}), "
        f"draft {info.draft_dir or 'none (no speculation)'}, dtype {info.dtype or '?'}, "
        f"device {info.device or '?'}, {pool}, policy {info.policy}, "
        f"max model len {info.max_model_len}, classes {classes} (default {info.default_class}), "
        f"prefix caching {'on' if info.prefix_caching else 'off'}"
        + (
            ""
            if admission is None
            else "; admission on: a request whose class's TTFT or TPOT promise cannot be "
            "kept now gets 429 with Retry-After (--no-admission queues it)"
            if admission
            else "; admission off: every request queues, 429 only when the queue is full"
        )
    )


class StatsLogger:
    """Interval statistics for the periodic log line.

    ``snapshot_fn()`` returns the engine's latest ``EngineSnapshot``; ``clock`` is the
    time source (injected in tests)."""

    def __init__(
        self,
        class_names,
        snapshot_fn: Callable,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.class_names = list(class_names)
        self.snapshot_fn = snapshot_fn
        self.clock = clock
        self._lock = threading.Lock()
        self._tally = {c: _ClassTally() for c in self.class_names}
        self._last_time = clock()
        self._last_counts = self._counts(snapshot_fn())
        self._last_active = False

    @staticmethod
    def _counts(snap) -> tuple[int, ...]:
        c = snap.counters or {}
        pc = snap.prefix_cache or {}
        return (
            int(c.get("prompt_tokens", 0)),
            int(c.get("generation_tokens", 0)),
            int(c.get("spec_draft_tokens", 0)),
            int(c.get("spec_accepted_tokens", 0)),
            int(pc.get("queried_tokens", 0)),
            int(pc.get("cached_tokens", 0)),
        )

    def observe_finish(self, cls: str, attained: bool, verified: int, accepted: int) -> None:
        """A request of ``cls`` finished (any thread)."""
        with self._lock:
            t = self._tally.setdefault(cls, _ClassTally())
            t.finished += 1
            t.attained += bool(attained)
            t.verified += int(verified)
            t.accepted += int(accepted)

    def line(self) -> tuple[str, bool]:
        """The stats line for the interval since the last call, and whether the engine
        did anything in it or in the one before (else the line is logged at DEBUG)."""
        now = self.clock()
        snap = self.snapshot_fn()
        counts = self._counts(snap)
        with self._lock:
            tally, self._tally = self._tally, {c: _ClassTally() for c in self.class_names}
        dt = now - self._last_time
        d = [a - b for a, b in zip(counts, self._last_counts)]
        self._last_time, self._last_counts = now, counts
        prompt_tps = d[0] / dt if dt > 0 else 0.0
        gen_tps = d[1] / dt if dt > 0 else 0.0
        active = bool(d[0] or d[1])
        loud = active or self._last_active
        self._last_active = active
        acc = f"{100 * d[3] / d[2]:.1f}%" if d[2] else "-"
        hits = f"{100 * d[5] / d[4]:.1f}%" if d[4] else "-"
        parts = []
        for c, t in tally.items():
            att = f"{100 * t.attained / t.finished:.1f}% of {t.finished}" if t.finished else "-"
            cacc = f"{100 * t.accepted / t.verified:.1f}%" if t.verified else "-"
            parts.append(f"{c} {att} (acceptance {cacc})")
        text = (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {snap.running} reqs, Waiting: {snap.waiting} reqs, "
            f"KV cache usage: {100 * snap.kv_usage:.1f}%, "
            f"Prefix cache hit rate: {hits}, "
            f"Draft acceptance: {acc}; SLO attainment: " + ", ".join(parts)
        )
        return text, loud

    def log(self) -> str:
        """Log the interval's line (INFO, or DEBUG when idle); returns it."""
        text, loud = self.line()
        log.log(logging.INFO if loud else logging.DEBUG, "%s", text)
        return text

    async def run(self, interval_s: float) -> None:
        """Log every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.log()
            except Exception:  # a stats line must never take the server down
                log.exception("stats logging failed")
