"""Admission's time predictions: the measured speed of passes against the hardware
model, the finish rate, and the predicted time to a request's first token (its prefill
and the queue ahead, earliest deadline first, and the wait for a seat). A base of
``AdmissionControl`` (``core.admission``), which feeds it the measurements. Torch-free."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from typing import TYPE_CHECKING

from adaserve.core.pace import FINISH_WINDOW_S, MIN_FINISHES

if TYPE_CHECKING:
    from adaserve.core.scheduler import Scheduler
    from adaserve.core.seq import SeqState

# context tokens per request assumed until a pass is measured
DEFAULT_CONTEXT = 256.0


class PrefillForecast:
    """The predictions of pass and prefill times, from the measurements the admission
    control keeps (declared here; ``AdmissionControl.__init__`` sets them)."""

    sched: Scheduler
    pass_ms: float | None  # measured passes carrying a prefill chunk
    context: float | None  # context tokens per request in a pass
    _speeds: deque[float]  # measured / predicted pass time, recent passes
    # (finish time, busy seconds so far then) of running requests, recent window
    _finishes: deque[tuple[float, float]]
    busy_s: float  # seconds of passes so far (each at least its start-to-start cadence)
    # class -> (time, prompt tokens, ttft) of the requests admitted lately
    _admits: dict[str, deque[tuple[float, int, float | None]]]

    def finish_rate(self, now: float) -> float | None:
        """Running requests finishing per second over the recent window (None: too few
        finishes to tell)."""
        f = self._recent_finishes(now)
        if len(f) < MIN_FINISHES:
            return None
        span = max(now - f[0][0], 1e-3)
        return len(f) / span

    def busy_finish_rate(self, now: float) -> float | None:
        """Running requests finishing per second the engine was busy (passing) over the
        recent window: the rate it frees seats while it has work, which the wall-clock
        rate understates by its idle time (None: too few finishes to tell)."""
        f = self._recent_finishes(now)
        if len(f) < MIN_FINISHES:
            return None
        return len(f) / max(self.busy_s - f[0][1], 1e-3)

    def _recent_finishes(self, now: float) -> deque[tuple[float, float]]:
        f = self._finishes
        while f and f[0][0] < now - FINISH_WINDOW_S:
            f.popleft()
        return f

    def _arrivals(self, now: float) -> dict[str, tuple[float, float, float]]:
        """Per class with a TTFT target: its admitted requests per second over the
        recent window, their mean prompt tokens and its TTFT target (ms)."""
        out = {}
        for cls, q in self._admits.items():
            while q and q[0][0] < now - FINISH_WINDOW_S:
                q.popleft()
            if len(q) < MIN_FINISHES or q[-1][2] is None:
                continue
            span = max(now - q[0][0], 1.0)
            out[cls] = (len(q) / span, sum(p for _, p, _ in q) / len(q), float(q[-1][2]))
        return out

    def prefill_ms(self, tokens: int, context: int = 0) -> float | None:
        """Predicted ms to prefill ``tokens`` prompt tokens at a chunk per pass beside the
        running decodes, each chunk attending ``context`` tokens already in the KV (a
        cached prefix): the hardware model's passes scaled by the measured speed (the
        measured pass time itself, without a model; None with neither)."""
        s = self.sched
        chunk = s.cfg.max_prefill_tokens
        full, rest = divmod(max(int(tokens), 0), chunk)
        if s.hw is None:
            if self.pass_ms is None:
                return None
            return (full + (rest > 0)) * self.pass_ms
        decoders = sum(1 for r in s.running if not r.in_prefill)
        kv = decoders * (self.context if self.context is not None else DEFAULT_CONTEXT)
        speed = self.speed()
        ctx = max(int(context), 0)
        t = full * float(
            s.hw.iteration_ms(
                chunk + decoders, kv, prefill_pairs=chunk * ctx, requests=decoders + 1
            )
        )
        if rest:
            t += float(
                s.hw.iteration_ms(
                    rest + decoders, kv, prefill_pairs=rest * ctx, requests=decoders + 1
                )
            )
        return t * speed

    def speed(self) -> float:
        """Measured over predicted pass time: the median of the recent passes (robust to
        a pass that compiled or was stalled), 1 before any."""
        if not self._speeds:
            return 1.0
        return float(statistics.median(self._speeds))

    def alone_ms(self, seq: SeqState) -> float:
        """Predicted ms of ``seq``'s prefill with nothing ahead of it (0 without a model
        of the pass time)."""
        return self.prefill_ms(seq.to_prefill, _in_kv(seq)) or 0.0

    def predicted_ttft_ms(self, seq: SeqState, now: float) -> float | None:
        """Predicted ms from ``now`` to ``seq``'s first token (None without a model of
        the pass time); see the module docstring."""
        if self.prefill_ms(1) is None:
            return None
        s = self.sched
        ttft = seq.slo.ttft_ms
        deadline = seq.arrival + (ttft / 1000.0 if ttft is not None else math.inf)
        tokens: float = seq.to_prefill
        seats_ahead: float = 0
        for r in itertools.chain(s.running, s.waiting):
            waiting = r not in s.running
            if not (waiting or r.in_prefill):
                continue
            if r.num_output > 0:  # preempted: back at the front of the queue
                tokens += r.to_prefill
                seats_ahead += waiting
                continue
            rt = r.slo.ttft_ms
            rd = r.arrival + (rt / 1000.0 if rt is not None else math.inf)
            if rd <= deadline and rd > now:
                tokens += r.to_prefill
                seats_ahead += waiting
        # requests still to come that will go ahead of it: those of a class whose
        # deadline, if they arrive before ``deadline - their ttft``, falls before its own
        for cls, (rate, prompt, cls_ttft) in self._arrivals(now).items():
            window = deadline - cls_ttft / 1000.0 - now
            if cls != seq.slo.cls and window > 0:
                tokens += rate * window * prompt
                seats_ahead += rate * window
        t = self.prefill_ms(math.ceil(tokens))
        assert t is not None  # as ``prefill_ms(1)`` above: the same model answers
        if s.hw is not None:  # its own chunks attend its cached prefix
            t += s.hw.prefill_ms_per_pair * seq.to_prefill * _in_kv(seq) * self.speed()
        free = s.cfg.max_num_seqs - len(s.running)
        short = seats_ahead + 1 - free
        if short > 0:
            finishing = self.finish_rate(now)
            if finishing is not None:
                t = max(t, short / finishing * 1000.0 + self.alone_ms(seq))
        return t


def _in_kv(seq: SeqState) -> int:
    """Prompt tokens of ``seq`` that need no prefill (a cached prefix, earlier chunks):
    its prefill attends them."""
    return max(seq.num_tokens - seq.to_prefill, 0)
