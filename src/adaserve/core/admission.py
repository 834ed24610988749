"""Admission control: answer a new request at once when its class's promise cannot be
kept, and never let a queued request wait past its TTFT deadline unanswered.

Every class gets its own decision (not only the strictest):

* **queue**: the waiting queue is bounded (``max_waiting``);
* **decode pace**: with the new request the batch holds ``N`` requests (every running
  and queued one, up to ``max_num_seqs``); a pass over them is predicted from the
  hardware model at the measured tree size per request and prefill per pass, scaled
  by the measured/predicted pass time. Each class ``c`` at or above the new one's
  strictness must still be on pace: ``pass_ms(N) / tokens_per_pass(c) <= tpot(c)``,
  with ``tokens_per_pass(c)`` the accepted tokens per pass measured for the class (1
  until measured), within ``PACE_TOLERANCE``. A relaxed request is thus judged
  against what the stricter classes leave (those in the batch and those seen lately),
  and never admitted at the expense of a stricter class's TPOT. A class whose target
  the hardware misses by far (``HOPELESS`` times) even for a request alone is not kept
  on pace (shedding cannot fix a target the machine cannot reach), nor is a class
  whose pace was last measured more than ``PACE_FRESH_S`` ago (admitting is how it
  gets measured again);
* **TTFT**: the predicted time to its first token must be within its TTFT target,
  less ``TTFT_MARGIN`` for the prediction's error
  (when its own prefill alone fits it: a target nothing could meet is served as
  best it can, behind the others, and not refused). The
  prediction is earliest-deadline-first, as the planner prefills: the prompt tokens of
  every queued or prefilling request whose TTFT deadline falls before the new one's
  (and has not passed: a request that is already late goes last) plus its own, at one
  prefill chunk per pass of the measured pass time; and, when every seat is taken, the
  time until enough running requests finish to seat it (from the measured finish rate).
  The queue ahead includes requests still to come that will overtake it: at each
  other class's measured admission rate, those arriving while their deadline would
  still fall before its own.

An idle engine (nothing running or waiting) admits every request: it is served alone
and at once, so no prediction of load applies.

A refusal is ``AdmissionRejected`` with a Retry-After near the time the promise could
be kept again. A queued request that was never started and is past its TTFT deadline is
ended with reason ``ttft_deadline`` (the server answers 429) as soon as it can no longer
make its deadline: under a burst the prediction can be wrong, and the answer must
still come by the deadline.

Torch-free; the engine and the simulator both run it through the ``Scheduler``. Time
comes from the scheduler's clock, never the wall clock.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from typing import TYPE_CHECKING

from adaserve.core.config import CAPACITY_RETRY_S, QUEUE_FULL_RETRY_S
from adaserve.errors import AdmissionRejected

# a class may run this much over its TPOT target per pass before new work is refused
# (a request's TPOT is its mean over its life: the planner makes up short stretches)
PACE_TOLERANCE = 0.05
# a request is admitted only when its predicted first token leaves this share of its
# TTFT target spare (seat waits and queues ahead are estimates)
TTFT_MARGIN = 0.2
# a class's measured pace counts for this long after it last decoded (a stale one,
# say from a burst long gone, would refuse work forever: nothing would re-measure it)
PACE_FRESH_S = 5.0
# a class whose predicted pace for a request alone exceeds its target this many times
# over runs best effort (no load level would meet it; near the target, shedding helps)
HOPELESS = 1.5
# context tokens per request assumed until a pass is measured
_DEFAULT_CONTEXT = 256.0

if TYPE_CHECKING:
    from adaserve.core.scheduler import Scheduler
    from adaserve.core.seq import SeqState
    from adaserve.core.trace import StepTrace

# reason of a queued request ended at its TTFT deadline
TTFT_DEADLINE = "ttft_deadline"
# refusals a looser class can avoid (a full queue is full for every class)
DEGRADABLE = ("capacity", "ttft")
# a pass counts as a prefill pass for the measured pass time when it carries at least
# this share of the chunk
_PREFILL_PASS_SHARE = 0.5
_EWMA = 0.1  # weight of the newest observation in the running means
_CLASS_EWMA = 0.05
_SPEED_PASSES = 32  # passes the measured speed is the median of  # the same for a class's pace (ms per pass, tokens per pass)
_SEEN_WINDOW_S = 60.0  # a stricter class decoding this recently keeps its room
_FINISH_WINDOW_S = 30.0  # finishes counted for the finish rate
_MIN_FINISHES = 4  # below this many finishes in the window the rate is unknown


def _mix(old: float | None, new: float, w: float = _EWMA) -> float:
    return new if old is None else (1.0 - w) * old + w * new


class AdmissionControl:
    """Per-class admission decisions and the measurements they use (see the module
    docstring). ``sched`` is the scheduler whose queues and hardware model it reads."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        # measured passes carrying a prefill chunk (the pass time without a model)
        self.pass_ms: float | None = None
        self._speeds: deque[float] = deque(maxlen=_SPEED_PASSES)  # measured / predicted
        self.nodes_per_decode: float | None = None  # candidates verified per decode
        self.prefill_per_pass: float | None = None  # prefill tokens per pass
        self.context: float | None = None  # context tokens per request in a pass
        self.tokens_per_pass: dict[str, float] = {}  # class -> tokens per decode pass
        self.class_pass_ms: dict[str, float] = {}  # class -> ms of the passes it decoded in
        self.class_batch: dict[str, float] = {}  # class -> decoders in those passes
        self._finishes: deque[float] = deque()
        self._seen: dict[str, float] = {}  # class -> when it last decoded
        # class -> (time, prompt tokens, ttft) of the requests admitted lately
        self._admits: dict[str, deque] = {}

    def reset(self) -> None:
        """Forget every measurement (after a profile run, whose passes are not load)."""
        self.__init__(self.sched)

    def new_model(self) -> None:
        """The hardware model changed: the measured/predicted speed starts over."""
        self._speeds.clear()

    # ------------------------------------------------------------------ measurements
    def observe(self, tr: StepTrace, cadence_s: float | None = None) -> None:
        """Learn from a finished pass (its trace, token counts filled by the executor):
        pass time, tree size and tokens per pass by class, prefill per pass.
        ``cadence_s``: start to start when the next pass followed at once (the pass's
        cost with the work between passes), which counts when longer."""
        dur_ms = max(tr.duration_s, cadence_s or 0.0) * 1000.0
        if dur_ms <= 0:
            return
        prefill = sum(tr.prefill.values())
        if prefill >= _PREFILL_PASS_SHARE * self.sched.cfg.max_prefill_tokens:
            self.pass_ms = _mix(self.pass_ms, dur_ms, 0.2)
        self.prefill_per_pass = _mix(self.prefill_per_pass, float(prefill))
        b = len(tr.decode)
        if b:
            nodes = sum(tr.tree_nodes.get(rid, 0) for rid in tr.decode)
            self.nodes_per_decode = _mix(self.nodes_per_decode, nodes / b)
            got: dict[str, list[float]] = {}
            for rid in tr.decode:
                cls = tr.classes.get(rid)
                if cls is not None:
                    got.setdefault(cls, []).append(1.0 + tr.accepted.get(rid, 0))
            for cls, toks in got.items():
                tpp = self.tokens_per_pass
                tpp[cls] = _mix(tpp.get(cls), sum(toks) / len(toks), _CLASS_EWMA)
                self.class_pass_ms[cls] = _mix(self.class_pass_ms.get(cls), dur_ms, _CLASS_EWMA)
                self._seen[cls] = tr.t_end
                self.class_batch[cls] = _mix(self.class_batch.get(cls), float(b), _CLASS_EWMA)
        n = b + len(tr.prefill)
        if n:
            self.context = _mix(self.context, tr.kv_tokens / n)
        hw = self.sched.hw
        if hw is not None and tr.tokens > 0:
            pred = float(hw.iteration_ms(tr.tokens, tr.kv_tokens, prefill_pairs=tr.prefill_pairs))
            if pred > 0:
                self._speeds.append(dur_ms / pred)

    def observe_finish(self, t: float) -> None:
        """A request left the running batch at ``t`` (s)."""
        self._finishes.append(t)
        while self._finishes and self._finishes[0] < t - _FINISH_WINDOW_S:
            self._finishes.popleft()

    def finish_rate(self, now: float) -> float | None:
        """Running requests finishing per second over the recent window (None: too few
        finishes to tell)."""
        f = self._finishes
        while f and f[0] < now - _FINISH_WINDOW_S:
            f.popleft()
        if len(f) < _MIN_FINISHES:
            return None
        span = max(now - f[0], 1e-3)
        return len(f) / span

    def admitted(self, seq: SeqState, now: float) -> None:
        """``seq`` passed the checks and was queued at ``now``."""
        q = self._admits.setdefault(seq.slo.cls, deque())
        q.append((now, seq.to_prefill, seq.slo.ttft_ms))
        while q and q[0][0] < now - _FINISH_WINDOW_S:
            q.popleft()

    def _arrivals(self, now: float) -> dict[str, tuple[float, float, float]]:
        """Per class with a TTFT target: its admitted requests per second over the
        recent window, their mean prompt tokens and its TTFT target (ms)."""
        out = {}
        for cls, q in self._admits.items():
            while q and q[0][0] < now - _FINISH_WINDOW_S:
                q.popleft()
            if len(q) < _MIN_FINISHES or q[-1][2] is None:
                continue
            span = max(now - q[0][0], 1.0)
            out[cls] = (len(q) / span, sum(p for _, p, _ in q) / len(q), float(q[-1][2]))
        return out

    # ------------------------------------------------------------------ predictions
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
        kv = decoders * (self.context if self.context is not None else _DEFAULT_CONTEXT)
        speed = self.speed()
        ctx = max(int(context), 0)
        t = full * float(s.hw.iteration_ms(chunk + decoders, kv, prefill_pairs=chunk * ctx))
        if rest:
            t += float(s.hw.iteration_ms(rest + decoders, kv, prefill_pairs=rest * ctx))
        return t * speed

    def speed(self) -> float:
        """Measured over predicted pass time: the median of the recent passes (robust to
        a pass that compiled or was stalled), 1 before any."""
        if not self._speeds:
            return 1.0
        return float(statistics.median(self._speeds))

    def decode_pass_ms(self, n: float) -> float | None:
        """Predicted ms of a pass with ``n`` requests decoding at the measured tree size,
        context and prefill per pass (None without a hardware model)."""
        hw = self.sched.hw
        if hw is None:
            return None
        nodes = self.nodes_per_decode or 0.0
        tokens = n * (1.0 + nodes) + (self.prefill_per_pass or 0.0)
        ctx = self.context if self.context is not None else _DEFAULT_CONTEXT
        return float(hw.iteration_ms(tokens, n * ctx)) * self.speed()

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
        tokens = seq.to_prefill
        seats_ahead = 0
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
        if s.hw is not None:  # its own chunks attend its cached prefix
            t += s.hw.prefill_ms_per_pair * seq.to_prefill * _in_kv(seq) * self.speed()
        free = s.cfg.max_num_seqs - len(s.running)
        short = seats_ahead + 1 - free
        if short > 0:
            rate = self.finish_rate(now)
            if rate is not None:
                t = max(t, short / rate * 1000.0 + self.alone_ms(seq))
        return t

    def pace_ms(self, cls: str) -> float | None:
        """The ms per token class ``cls`` runs at now: its measured ms per pass over its
        measured tokens per pass (None until measured)."""
        ms = self.class_pass_ms.get(cls)
        return None if ms is None else ms / self.tokens_per_pass[cls]

    def off_pace(self, seq: SeqState, rank: int, now: float) -> tuple[str, float, float] | None:
        """The first class at or above ``rank``'s strictness that would fall off its TPOT
        pace with ``seq`` in the batch, as (class, predicted ms per token, target), or
        None when every one keeps pace (or nothing is measured yet). The predicted pace
        is the measured one scaled by the predicted pass time of the batch with ``seq``
        over that of the batch the pace was measured at."""
        s = self.sched
        if not s.running:  # nothing decodes: no load to be off pace because of
            return None
        # the classes to keep on pace: those at or above rank in the batch, and every
        # stricter class seen decoding lately (its next request must still find room)
        targets: dict[str, float] = {}
        for cls, seen in self._seen.items():
            if s.rank_of(cls) < rank and now - seen <= _SEEN_WINDOW_S:
                t = s.class_slo(cls).tpot_ms if cls in s._classes else None
                if t:
                    targets[cls] = t
        n = 1
        for r in itertools.chain(s.running, s.waiting, (seq,)):
            if r is not seq:
                n += 1
            t = r.slo.tpot_ms
            if t and s.rank_of(r.slo.cls) <= rank:
                targets[r.slo.cls] = min(t, targets.get(r.slo.cls, t))
        then_ms = self.decode_pass_ms(min(n, s.cfg.max_num_seqs))
        if then_ms is None:
            return None
        for cls in sorted(targets, key=s.rank_of):
            pace = self.pace_ms(cls)
            if pace is None or now - self._seen.get(cls, -math.inf) > PACE_FRESH_S:
                continue  # not measured lately: admitting it is how it is measured again
            # scaled from the batch its pace was measured at to the batch with seq
            was_ms = self.decode_pass_ms(self.class_batch[cls])
            if not was_ms:
                continue
            pred = pace * then_ms / was_ms
            # a target this hardware misses even for a request alone is not load's
            # doing, and refusing work cannot meet it: the class runs best effort
            if pace * self.decode_pass_ms(1) / was_ms > HOPELESS * targets[cls]:
                continue
            if pred > targets[cls] * (1.0 + PACE_TOLERANCE):
                return cls, pred, targets[cls]
        return None

    # ------------------------------------------------------------------ decisions
    def verdict(self, seq: SeqState, now: float) -> AdmissionRejected | None:
        """Why ``seq``, with its SLO as it stands, cannot be admitted at ``now`` (the
        refusal, not raised nor counted), or None when it can; records nothing (the
        scheduler's ``check_admission`` counts, degrades and records the admission;
        see the module docstring)."""
        s = self.sched
        if len(s.waiting) >= s.cfg.max_waiting:
            return AdmissionRejected("server queue is full", "queue_full", QUEUE_FULL_RETRY_S)
        slo = seq.slo
        rank = s.rank_of(slo.cls)
        if not s.running and not s.waiting:
            # nothing runs or waits: the request is served alone, at once, as well as
            # this machine can serve it; what predictions say of load (recent arrivals,
            # a pace measured in a burst now gone) does not apply to an idle engine
            return None
        if slo.tpot_ms is not None:
            late = self.off_pace(seq, rank, now)
            if late is not None:
                cls, pred, target = late
                return AdmissionRejected(
                    f"with this request class {cls!r} would run at {pred:.1f} ms per token "
                    f"against its {target:.1f} ms target",
                    "capacity",
                    CAPACITY_RETRY_S,
                )
        if slo.ttft_ms:
            t = self.predicted_ttft_ms(seq, now)
            waited = (now - seq.arrival) * 1000.0
            budget = slo.ttft_ms * (1.0 - TTFT_MARGIN)  # the prediction's error
            if t is not None and waited + t > budget and slo.ttft_ms >= waited + self.alone_ms(seq):
                over_s = (waited + t - budget) / 1000.0
                return AdmissionRejected(
                    f"predicted time to first token {waited + t:.0f} ms exceeds the "
                    f"{slo.ttft_ms:.0f} ms target of class {slo.cls!r}",
                    "ttft",
                    max(1.0, over_s),
                )
        return None

    def expire(self, now: float) -> list[SeqState]:
        """End (reason ``ttft_deadline``) every queued request never started that can no
        longer make its TTFT deadline: started now, its own prefill would end past it
        (one whose target its prefill alone misses is served as it can); returns them."""
        s = self.sched
        late = [
            r
            for r in s.waiting
            if r.num_output == 0
            and r.num_cached == 0
            and r.slo.ttft_ms is not None
            and (now - r.arrival) * 1000.0 + (alone := self.alone_ms(r)) > r.slo.ttft_ms
            and r.slo.ttft_ms >= alone
        ]
        for r in late:
            s.counters.count_shed(TTFT_DEADLINE)
            s.finish(r, TTFT_DEADLINE, now)
        return late


def _in_kv(seq: SeqState) -> int:
    """Prompt tokens of ``seq`` that need no prefill (a cached prefix, earlier chunks):
    its prefill attends them."""
    return max(seq.num_tokens - seq.to_prefill, 0)
