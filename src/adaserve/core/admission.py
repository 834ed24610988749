"""Admission control: answer a new request at once when its class's promise cannot be
kept, and never let a queued request wait past its TTFT deadline unanswered.

Every class gets its own decision (not only the strictest):

* **queue**: the waiting queue is bounded (``max_waiting``);
* **KV memory** (``core.kv_room``): the KV the admitted work is expected to hold and
  the new request's must fit the pool (``kv``);
* **fair share** (``core.fair_share``; judged last): a tenant over its fair share of a
  batch another tenant was refused room in is refused (``fair_share``);
* **decode pace**: with the new request the batch holds ``N`` requests (every running
  and queued one, up to ``max_num_seqs``); over the new request's life it holds ``N'``
  on average (``load_over_life``: the batch relaxes toward its steady size, the
  measured arrival rate, admitted or not, times the measured time in the engine,
  Little's law). Each
  class ``c`` at or above the new one's strictness gets a predicted ms per token at
  ``N'``: its measured pace scaled by the hardware model's pass time at ``N'`` over the
  pass time it was measured at (the measured tree size and prefill per pass, the
  measured/predicted speed), or, when lower, the pace it was measured at lately at
  that load or above (the planner shrinks trees as the batch grows, which the
  scaling does not know). A relaxed request is thus judged against what the
  stricter classes leave (those in the batch and those seen lately), and never
  admitted at the expense of a stricter class's TPOT; it is off pace beyond
  ``PACE_TOLERANCE`` over its target. A class whose target the hardware misses by far (``HOPELESS`` times) even
  for a request alone is not kept on pace (shedding cannot fix a target the machine
  cannot reach), nor is a class whose pace was last measured more than
  ``PACE_FRESH_S`` ago (admitting is how it gets measured again);
* **decode pace, asked of the planner** (``planner_off_pace``; instead of the above when
  ``SchedulerConfig.admission_check`` is "planner" or "auto", the default; on "auto"
  with a steep hardware model, ``STEEP``, besides it: ``paces_too``; env
  ``ADASERVE_ADMISSION_PLANNER`` "0" / "1" overrides it): the
  policy's own planner (``Policy.forecast``) forecasts the pass over the new request's
  life, its batch counted in decoders (those running, those due to decode beside it,
  itself; relaxed toward the offered rate times the measured decode time) and its
  prefill at the rate the queued TTFT deadlines need. Each class at or above its
  strictness must afford its forecast pace from its requests' remaining budgets
  (their credit and deficit), those yet to decode apart
  (docs/results/admission-issue31.md, fifth pass);
* **TTFT**: the predicted time to its first token must be within its TTFT target,
  less ``TTFT_MARGIN`` for the prediction's error (when its own prefill alone fits it:
  a target nothing could meet is served as best it can, behind the others, and not
  refused).
  The prediction is earliest-deadline-first, as the planner prefills: the prompt tokens of
  every queued or prefilling request whose TTFT deadline falls before the new one's
  (and has not passed: a request that is already late goes last) plus its own, at one
  prefill chunk per pass of the measured pass time; and, when every seat is taken, the
  time until enough running requests finish to seat it (from the measured finish rate).
  The queue ahead includes requests still to come that will overtake it: at each
  other class's measured admission rate, those arriving while their deadline would
  still fall before its own.

**Promises: predicted, then counted.** Every admitted request gets a predicted chance
of meeting its SLO (``SeqState.promise``: the TTFT part from a per-class fit of realised
on predicted TTFT, ``core.promise.Calibration``; the TPOT part the share of the class's
requests admitted at that load that met their TPOT), counted at its finish against
whether it did (``Counters.promised``). Neither chance is the bar for admitting: as
bars they did worse than the margin and tolerance (docs/results/admission-issue31.md).

An idle engine (nothing running or waiting) admits every request: it is served alone
and at once, so no prediction of load applies.

A refusal is ``AdmissionRejected`` with a Retry-After near the time the promise could
be kept again: the time, at the measured finish rate, until enough requests leave the
batch (pace, KV) or the queue ahead drains by the excess (TTFT). A refusal for room
holds a seat for the client's retry (``core.retry_seats``), spaced at the rate the
batch frees room while busy; the client back on time for it and refused for room
waits at the door for that room instead when it frees before its latest start
(``_door``). A queued request never
started that can no longer make its TTFT deadline is ended (``ttft_deadline``, a 429).

Torch-free; the engine and the simulator both run it through the ``Scheduler``. Time
comes from the scheduler's clock, never the wall clock.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from collections import deque
from typing import TYPE_CHECKING

from adaserve.core.config import CAPACITY_RETRY_S, QUEUE_FULL_RETRY_S, STEEP
from adaserve.core.fair_share import FairShare
from adaserve.core.kv_room import KV_FULL, kv_verdict
from adaserve.core.pace import (
    CLASS_EWMA,
    FINISH_WINDOW_S,
    MIN_FINISHES,
    SEEN_WINDOW_S,
    ClassPaces,
)
from adaserve.core.planner_check import (
    ASK_PLANNER_ENV,
    NO_ANSWER,
    PROMISE,
    PlannerCheck,
    _Answer,
)
from adaserve.core.prefill_forecast import DEFAULT_CONTEXT, PrefillForecast
from adaserve.core.promise import WINDOW, Calibration
from adaserve.core.retry_seats import RetrySeats
from adaserve.errors import AdmissionRejected

# a class's measured pace counts for this long after it last decoded (a stale one,
# say from a burst long gone, would refuse work forever: nothing would re-measure it)
PACE_FRESH_S = 5.0
# a class whose predicted pace for a request alone exceeds its target this many times
# over runs best effort (no load level would meet it; near the target, shedding helps)
HOPELESS = 1.5

if TYPE_CHECKING:
    from adaserve.core.scheduler import Scheduler
    from adaserve.core.seq import SeqState
    from adaserve.core.slo import SLO
    from adaserve.core.trace import StepTrace

# a class may run this much over its TPOT target per pass before new work is refused
# (a request's TPOT is its mean over its life: the planner makes up short stretches).
# Not a chance: the measured pace is the planner's steering (it holds every request near
# its target while the load is feasible), so it predicts no request's realised TPOT
PACE_TOLERANCE = 0.05
# a request is admitted only when its predicted first token leaves this share of its
# TTFT target spare (seat waits and queues ahead are estimates). Measured against the
# fitted chance (``Calibration``) as the bar in the simulator: the margin kept strict
# attainment at 3x capacity at 95%, the chance at 87% (docs/results/admission-issue31.md)
TTFT_MARGIN = 0.2


# reason of a queued request ended at its TTFT deadline
TTFT_DEADLINE = "ttft_deadline"
# the one-sided confidence of the upper bound on the chance a strict request admitted
# beside others meets its TPOT (``company_bound``): a bound under the promise is evidence
# at this level that such company breaks it, not one unlucky request
COMPANY_CONFIDENCE = 0.95
# refusals remembered for later arrivals alike in the same state
# (``AdmissionControl.verdict``): by (class, TPOT and TTFT targets, tenant, constrained,
# prompt to prefill, prompt and output so far, output limit): message, reason,
# Retry-After
_REMEMBERED = frozenset({"capacity", "ttft", KV_FULL})
_RefusalKey = tuple[str, float | None, float | None, str | None, bool, int, int, int]
_Refusal = tuple[str, str, float]
# refusals a looser class can avoid (a full queue is full for every class)
DEGRADABLE = ("capacity", "ttft")
# refusals for lack of room in the batch (decode capacity, KV): they make it contended
# (a TTFT refusal is the prefill queue ahead, which deadlines order, not seats)
_CONTENDED = ("capacity", KV_FULL)
# a pass counts as a prefill pass for the measured pass time when it carries at least
# this share of the chunk
_PREFILL_PASS_SHARE = 0.5
_EWMA = 0.1  # weight of the newest observation in the running means
_SPEED_PASSES = 32  # passes the measured speed is the median of


def _mix(old: float | None, new: float, w: float = _EWMA) -> float:
    return new if old is None else (1.0 - w) * old + w * new


class AdmissionControl(PrefillForecast):
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
        self.paces = ClassPaces()  # each class's measured pace, overall and by load
        self._finishes: deque[tuple[float, float]] = deque()
        self.busy_s = 0.0
        # class -> (time, prompt tokens, ttft) of the requests admitted lately
        self._admits: dict[str, deque[tuple[float, int, float | None]]] = {}
        # class -> log(realised / predicted) of its admitted requests' TPOT and TTFT
        # class -> (predicted pace / target at admission, TPOT met) of its admitted requests
        self.tpot_met: dict[str, deque[tuple[float, bool]]] = {}
        # class -> (finish time, requests of its class or stricter it was admitted beside,
        # TPOT met) of its admitted requests, the last ``FINISH_WINDOW_S``
        # (``company_bound``)
        self.met_beside: dict[str, deque[tuple[float, int, bool]]] = {}
        self.ttft_cal: dict[str, Calibration] = {}
        self.out_len: dict[str, float] = {}  # class -> output tokens of its finished requests
        self._arrived: deque[float] = deque()  # arrival times of the requests judged
        self.fair = FairShare(FINISH_WINDOW_S)  # each tenant's share of a contended batch
        self.seats = RetrySeats()  # held for refused clients' retries
        self.stay_s: float | None = None  # arrival to finish of the requests that finished
        self.decode_s: float | None = None  # first token to finish of the same
        # the planner's forecasts against what passes gave: class -> realised over
        # expected tokens per pass; measured over predicted pass time
        self.tok_ratio: dict[str, float] = {}
        self.time_ratio: float | None = None
        # class -> (forecast pace / target at admission, realised TPOT / forecast pace)
        # of its admitted requests, judged by the planner (``tpot_error``)
        self.tpot_err: dict[str, deque[tuple[float, float]]] = {}
        # (arrival, prompt tokens, rank of its class) of the requests offered
        self._arr_tok: deque[tuple[float, int, int, str]] = deque()
        # the last verdict's predictions for the request judged (promise, TPOT, TTFT)
        self._pred: tuple[float | None, float | None, float | None] = (None, None, None)
        self._beside: int | None = None  # the last verdict's company (``SeqState.beside``)
        self._own_tpot: float | None = None  # the request judged: its class's predicted pace
        # the planner's measured error its prediction was scaled by (``tpot_error``), of
        # the request judged and, by id, of those admitted until they finish: the error
        # is measured against the planner's own forecast, not the scaled one (else each
        # correction would be measured against the last, and swing)
        self._own_err: float | None = None  # None: not the planner's prediction
        self._err_at: dict[int, float] = {}
        # see ``planner_off_pace``: the config's choice, or the environment's override
        env = os.environ.get(ASK_PLANNER_ENV)
        self._ask: bool | None = env == "1" if env in ("0", "1") else None
        self.planner = PlannerCheck(self)  # the planner's answer and its state
        # a refusal stands for later arrivals alike while what it was judged by holds
        # (``_state``: the epoch a pass, an admission, a finish or another kind of
        # arrival moves, and the rest; ``_refusal_stands``)
        self._epoch = 0
        self._refusals: dict[_RefusalKey, _Refusal] = {}
        self._refusals_at: tuple[int, ...] = ()  # the state they were judged in
        self._last_key: _RefusalKey | None = None  # the last arrival's key

    @property
    def ask_planner(self) -> bool:
        """Whether the planner's check judges (``SchedulerConfig.admission_check``:
        "auto" and "planner"; the environment's "1" / "0" overrides it)."""
        if self._ask is not None:
            return self._ask
        return self.sched.cfg.admission_check in ("auto", "planner")

    @ask_planner.setter
    def ask_planner(self, on: bool) -> None:
        self._ask = on
        self._epoch += 1

    @property
    def paces_too(self) -> bool:
        """Whether a request the planner admits must also keep the measured paces: on
        "auto", where the hardware model is steep (``STEEP``). There the planner's
        forecast over a request's life misses what it costs now: on the CPU pair's
        profile at 3x capacity the planner's check alone admitted mostly batch-class
        work (judged at the batch its long life relaxes to) and its strict requests
        attained 18-68%; the measured paces alone 93-95% there, but 68-69% on short
        requests, where the planner's check had 86-90% and both 87-96% on the two
        (simulator, docs/results/admission-issue31.md, seventh pass). On the A100
        preset the planner's check alone meets the goals the paces miss."""
        if self._ask is not None or self.sched.cfg.admission_check != "auto":
            return False
        hw = self.sched.hw
        return hw is not None and hw.steepness() >= STEEP

    def reset(self) -> None:
        """Forget every measurement (after a profile run, whose passes are not load)."""
        self.__init__(self.sched)  # type: ignore[misc]  # start over as new: every field

    def new_model(self) -> None:
        """The hardware model changed: the measured/predicted speed starts over."""
        self._speeds.clear()
        self._epoch += 1

    # ------------------------------------------------------------------ measurements
    def observe(self, tr: StepTrace, cadence_s: float | None = None) -> None:
        """Learn from a finished pass (its trace, token counts filled by the executor):
        pass time, tree size and tokens per pass by class, prefill per pass.
        ``cadence_s``: start to start when the next pass followed at once (the pass's
        cost with the work between passes), which counts when longer."""
        self._epoch += 1
        dur_ms = max(tr.duration_s, cadence_s or 0.0) * 1000.0
        if dur_ms <= 0:
            return
        self.busy_s += dur_ms / 1000.0
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
                self.paces.observe(cls, toks, dur_ms, b, tr.t_end)
            self._observe_forecast(tr, dur_ms)
        n = b + len(tr.prefill)
        if n:
            self.context = _mix(self.context, tr.kv_tokens / n)
        hw = self.sched.hw
        if hw is not None and tr.tokens > 0:
            pred = float(
                hw.iteration_ms(tr.tokens, tr.kv_tokens, prefill_pairs=tr.prefill_pairs, requests=n)
            )
            if pred > 0:
                self._speeds.append(dur_ms / pred)

    def _observe_forecast(self, tr: StepTrace, dur_ms: float) -> None:
        """The planner's plan for the pass ``tr`` against what it gave: per class, the
        realised over the expected tokens of its decoders; the measured over the
        predicted pass time (running means, ``CLASS_EWMA``)."""
        s = self.sched
        plan = s.last_plan
        if plan is None or not plan.t_iter_ms:
            return
        exp = s.planned_expected(plan)
        if not exp:
            return
        self.time_ratio = _mix(self.time_ratio, dur_ms / plan.t_iter_ms, CLASS_EWMA)
        got: dict[str, list[float]] = {}
        for rid in tr.decode:
            cls, e = tr.classes.get(rid), exp.get(rid)
            if cls is not None and e:
                g = got.setdefault(cls, [0.0, 0.0])
                g[0] += 1.0 + tr.accepted.get(rid, 0)
                g[1] += e
        for cls, (real, e) in got.items():
            self.tok_ratio[cls] = _mix(self.tok_ratio.get(cls), real / e, CLASS_EWMA)

    def observe_finish(self, t: float, seq: SeqState | None = None) -> None:
        """A request (``seq``) left the running batch at ``t`` (s): the finish rate, its
        class's output length and the calibration of its predictions; its promise is
        counted against whether it met its SLO."""
        self._epoch += 1
        self._finishes.append((t, self.busy_s))
        self._recent_finishes(t)
        err = self._err_at.pop(seq.rid, None) if seq is not None else None
        if seq is None or seq.cancelled or seq.first_token_at is None:
            return
        cls, slo = seq.slo.cls, seq.slo
        if seq.finish_reason in ("stop", "length"):
            self.out_len[cls] = _mix(self.out_len.get(cls), float(seq.num_output), CLASS_EWMA)
            self.stay_s = _mix(self.stay_s, t - seq.arrival, CLASS_EWMA)
            self.decode_s = _mix(self.decode_s, t - seq.first_token_at, CLASS_EWMA)
        ttft = (seq.first_token_at - seq.arrival) * 1000.0
        tpot = (
            (t - seq.first_token_at) * 1000.0 / (seq.num_output - 1)
            if seq.num_output >= 2
            else None
        )
        if seq.pred_ttft_ms is not None:
            self.ttft_cal.setdefault(cls, Calibration()).add(
                ttft, seq.pred_ttft_ms, slo.ttft_ms or seq.pred_ttft_ms
            )
        if seq.beside is not None and tpot is not None and slo.tpot_ms is not None:
            q_b = self.met_beside.setdefault(cls, deque())
            q_b.append((t, seq.beside, tpot <= slo.tpot_ms))
            while q_b and q_b[0][0] < t - FINISH_WINDOW_S:
                q_b.popleft()
        if seq.pred_tpot_ms is not None and tpot is not None and slo.tpot_ms is not None:
            q = self.tpot_met.setdefault(cls, deque(maxlen=WINDOW))
            q.append((seq.pred_tpot_ms / slo.tpot_ms, tpot <= slo.tpot_ms))
            if seq.pred_tpot_ms > 0 and err is not None:
                raw = seq.pred_tpot_ms / err  # the planner's own forecast
                e = self.tpot_err.setdefault(cls, deque(maxlen=WINDOW))
                e.append((raw / slo.tpot_ms, tpot / raw))
        if seq.promise is not None:
            met = (slo.ttft_ms is None or ttft <= slo.ttft_ms) and (
                slo.tpot_ms is None or tpot is None or tpot <= slo.tpot_ms
            )
            self.sched.counters.count_promise(cls, seq.promise, met)

    def admitted(self, seq: SeqState, now: float) -> None:
        """``seq`` passed the checks and was queued at ``now``: it keeps the last
        verdict's promise and predictions."""
        self._epoch += 1
        seq.promise, seq.pred_tpot_ms, seq.pred_ttft_ms = self._pred
        seq.beside = self._beside
        if self._own_err is not None and seq.pred_tpot_ms is not None:
            self._err_at[seq.rid] = self._own_err
        q = self._admits.setdefault(seq.slo.cls, deque())
        q.append((now, seq.to_prefill, seq.slo.ttft_ms))
        while q and q[0][0] < now - FINISH_WINDOW_S:
            q.popleft()

    # ------------------------------------------------------------------ predictions
    def decode_pass_ms(self, n: float) -> float | None:
        """Predicted ms of a pass with ``n`` requests decoding at the measured tree size,
        context and prefill per pass (None without a hardware model)."""
        hw = self.sched.hw
        if hw is None:
            return None
        nodes = self.nodes_per_decode or 0.0
        tokens = n * (1.0 + nodes) + (self.prefill_per_pass or 0.0)
        ctx = self.context if self.context is not None else DEFAULT_CONTEXT
        return float(hw.iteration_ms(tokens, n * ctx, requests=n)) * self.speed()

    def pace_ms(self, cls: str) -> float | None:
        """The ms per token class ``cls`` runs at now (``ClassPaces.pace_ms``)."""
        return self.paces.pace_ms(cls)

    def pace_at(self, cls: str, n: float, target: float, now: float) -> float | None:
        """The predicted ms per token of class ``cls`` with ``n`` requests in the batch:
        its measured pace scaled by the predicted pass time at ``n`` over that of the
        batch the pace was measured at; or, when lower, the pace the class was measured
        at lately at the nearest load at least ``n``
        (``ClassPaces.measured_at``): as the batch grows the planner shrinks the trees, so the
        model's pass time at the measured tree size overstates what the load costs,
        and a load seen kept on pace lately is evidence the model does not have. None when it is not to be kept on pace: not
        measured lately (admitting is how it is measured again), or hopeless (its
        ``target`` missed ``HOPELESS`` times over even for a request alone: load is not
        the cause, and refusing work cannot meet it; the class runs best effort)."""
        pace = self.pace_ms(cls)
        if pace is None or now - self.paces.seen.get(cls, -math.inf) > PACE_FRESH_S:
            return None
        was_ms = self.decode_pass_ms(self.paces.batch[cls])
        n = min(n, self.sched.cfg.max_num_seqs)
        then_ms = self.decode_pass_ms(n)
        if not was_ms or then_ms is None:
            return None
        one_ms = self.decode_pass_ms(1)
        assert one_ms is not None  # as ``was_ms``: the same hardware model answers
        if pace * one_ms / was_ms > HOPELESS * target:
            return None
        scaled = pace * then_ms / was_ms
        seen = self.paces.measured_at(cls, n, now)
        return scaled if seen is None else min(scaled, seen)

    def prior_spread(self) -> float:
        """The spread of log(measured / predicted) pass time over the recent passes: a
        class's prior spread of realised over predicted until its own is measured."""
        xs = [math.log(x) for x in self._speeds if x > 0]
        return statistics.pstdev(xs) if len(xs) >= 2 else 0.0

    def tpot_chance(self, cls: str, load: float | None = None) -> float | None:
        """The chance a request of ``cls`` admitted at ``load`` (its class's predicted
        pace over its target) meets its TPOT: of the class's last ``WINDOW``
        admitted requests predicted at that load or above (all of them without
        ``load``), the share that met it, counting one more that did (a few finishes
        are weak evidence of a miss: the chance is not judged below the bar on one
        unlucky request); None with fewer than ``MIN_FINISHES`` such."""
        q = self.tpot_met.get(cls) or ()
        got = [met for x, met in q if load is None or x >= load]
        return (sum(got) + 1) / (len(got) + 1) if len(got) >= MIN_FINISHES else None

    @property
    def steep(self) -> bool:
        """Whether the hardware model is steep (``STEEP``): there a strict request's
        company is judged by what such company realised (``company_bound``). On the
        A100 preset strict requests beside others kept their promise (95.8% at 3x
        capacity) and the bound refused 1.2% at 0.8x, all of which would have met."""
        hw = self.sched.hw
        return hw is not None and hw.steepness() >= STEEP

    def company(self, seq: SeqState, rank: int) -> int:
        """The requests of ``seq``'s class or a stricter one, with a TPOT target, running
        or queued: the company it would decode beside."""
        s = self.sched
        return sum(
            1
            for r in itertools.chain(s.running, s.waiting)
            if r is not seq and r.slo.tpot_ms is not None and s.rank_of(r.slo.cls) <= rank
        )

    def company_bound(self, cls: str, k: int, now: float) -> float | None:
        """``_company_low``'s bound alone."""
        low = self._company_low(cls, k, now)
        return low[0] if low is not None else None

    def _company_low(self, cls: str, k: int, now: float) -> tuple[float, int] | None:
        """The lowest upper bound (``COMPANY_CONFIDENCE``) on the chance that a request
        of ``cls`` admitted beside j of its class or stricter meets its TPOT target, over
        j = 1..``k`` measured (more company is no better: a company of j too many is too
        many at k), with that j: of those admitted beside j that
        finished in the last ``FINISH_WINDOW_S`` (at least ``MIN_FINISHES``), the exact
        binomial (Clopper-Pearson) bound on the share that met it; None when none is
        measured. The planner forecasts the mean pace of a batch; what a strict request
        beside others realises also spreads with each one's acceptance and with the
        passes it shares, and on the CPU pair at 3x capacity requests admitted beside
        others met their target far less often than one alone
        (docs/results/admission-issue31.md, eleventh pass). The window forgets, so a
        company refused comes back to be measured again; an exact bound, so a few
        unlucky requests refuse nothing (one miss in four: 0.99)."""
        q = self.met_beside.get(cls)
        if not q:
            return None
        while q and q[0][0] < now - FINISH_WINDOW_S:
            q.popleft()
        counts: dict[int, list[int]] = {}  # company size -> [met, finished]
        for _, b, met in q:
            if 1 <= b <= k:
                c = counts.setdefault(b, [0, 0])
                c[0] += met
                c[1] += 1
        best: tuple[float, int] | None = None
        for j, (ok, n) in sorted(counts.items()):
            if n < MIN_FINISHES:
                continue
            u = _binomial_upper(ok, n, 1.0 - COMPANY_CONFIDENCE)
            if best is None or u < best[0]:
                best = (u, j)
        return best

    def ttft_chance(self, cls: str, target: float, predicted: float) -> float:
        """The chance a request of ``cls`` predicted at ``predicted`` ms from arrival to
        its first token meets its ``target`` TTFT."""
        cal = self.ttft_cal.get(cls) or Calibration()
        return cal.chance(target, predicted, self.prior_spread())

    def off_pace(
        self, seq: SeqState, rank: int, now: float
    ) -> tuple[str, float, float, float] | None:
        """The first class at or above ``rank``'s strictness that would fall off its TPOT
        pace (``PACE_TOLERANCE``) with ``seq`` in the batch, as (class, predicted ms per
        token, target, Retry-After s), or None when every one keeps pace (or nothing is
        measured). Sets ``seq``'s own predicted TPOT (``_own_tpot``) on the way."""
        s = self.sched
        if not s.running and not s.waiting:  # no load to be off pace because of
            return None
        # the classes to keep on pace: those at or above rank in the batch, and every
        # stricter class seen decoding lately (its next request must still find room)
        targets: dict[str, float] = {}
        for cls, seen in self.paces.seen.items():
            if s.rank_of(cls) < rank and now - seen <= SEEN_WINDOW_S:
                t = s.class_slo(cls).tpot_ms if s.knows_class(cls) else None
                if t:
                    targets[cls] = t
        n = 1 + self.seats.ahead(seq.retry_token, now)  # seats held for retries
        for r in itertools.chain(s.running, s.waiting, (seq,)):
            if r is not seq:
                n += 1
            t = r.slo.tpot_ms
            if t and s.rank_of(r.slo.cls) <= rank:
                targets[r.slo.cls] = min(t, targets.get(r.slo.cls, t))
        n_life = self.load_over_life(n, seq, now)
        for cls in sorted(targets, key=s.rank_of):
            pred = self.pace_at(cls, n_life, targets[cls], now)
            if pred is None:
                continue
            if cls == seq.slo.cls:
                self._own_tpot = pred
            if self._off_pace(pred, targets[cls]):
                return cls, pred, targets[cls], self._retry_pace(cls, n, targets[cls], seq, now)
        return None

    def planner_off_pace(
        self, seq: SeqState, rank: int, now: float
    ) -> tuple[str, float, float, float] | None | _Answer:
        """``off_pace`` answered by the policy's own planner (``PlannerCheck.off_pace``);
        ``NO_ANSWER`` when it cannot answer."""
        return self.planner.off_pace(seq, rank, now)

    def load_over_life(self, n: float, seq: SeqState, now: float) -> float:
        """The mean batch size over ``seq``'s decode, from ``n`` now: a request's TPOT
        is its mean over its life, and the batch relaxes toward its steady size, the
        measured arrival rate times the measured time a request spends in the
        engine (Little's law), with that time as its time constant. ``n`` itself when
        either is unmeasured or ``seq``'s class has no measured output length."""
        rate, stay = self.arrival_rate(now), self.stay_s
        out = self.out_len.get(seq.slo.cls)
        tpot = seq.slo.tpot_ms
        if rate is None or stay is None or not out or not tpot or stay <= 0:
            return n
        steady = rate * stay
        life = out * tpot / 1000.0  # its decode at its target pace (s)
        share = stay / life * (1.0 - math.exp(-life / stay))  # mean of exp(-t / stay)
        return max(1.0, steady + (n - steady) * share)

    def observe_arrival(self, t: float, prompt: int = 0, rank: int = 0, cls: str = "") -> None:
        """A request of class ``cls`` arrived at ``t`` (s) with ``prompt`` tokens to
        prefill, its class of strictness ``rank``, and is judged (each once: a degradable
        one is judged again for each looser class at the same arrival)."""
        if not self._arrived or self._arrived[-1] != t:
            self._arrived.append(t)
            self._arr_tok.append((t, prompt, rank, cls))

    def _offered(self, now: float) -> deque[tuple[float, int, int, str]]:
        """The requests offered over the recent window (older ones dropped)."""
        q = self._arr_tok
        while q and q[0][0] < now - FINISH_WINDOW_S:
            q.popleft()
        return q

    def offered_mix(self, now: float) -> dict[str, float]:
        """Each class's share of the requests offered over the recent window (admitted
        or not; empty: too few offered to tell)."""
        q = self._offered(now)
        if len(q) < MIN_FINISHES:
            return {}
        out: dict[str, float] = {}
        for *_, cls in q:
            out[cls] = out.get(cls, 0.0) + 1.0 / len(q)
        return out

    def offered_prompt_rate(self, now: float) -> dict[int, float]:
        """Prompt tokens offered per second over the recent window (admitted or not),
        by the rank of their class (empty: too few offered to tell)."""
        q = self._offered(now)
        if len(q) < MIN_FINISHES:
            return {}
        span = max(now - q[0][0], 1.0)
        out: dict[int, float] = {}
        for _, x, rank, _ in q:
            out[rank] = out.get(rank, 0.0) + x / span
        return out

    def arrival_rate(self, now: float) -> float | None:
        """Requests offered per second over the recent window (admitted or not)."""
        q = self._arrived
        while q and q[0] < now - FINISH_WINDOW_S:
            q.popleft()
        if len(q) < MIN_FINISHES:
            return None
        return len(q) / max(now - q[0], 1.0)

    @staticmethod
    def _off_pace(pred: float, target: float) -> bool:
        """Whether a class predicted at ``pred`` ms per token is off its ``target`` pace:
        beyond ``PACE_TOLERANCE`` over it. (Judged instead by the
        share of the class's requests admitted that loaded that met their TPOT, against
        the promise, below capacity it refused twice as often: a few finishes at a load
        are weak evidence, docs/results/admission-issue31.md.)"""
        return pred > target * (1.0 + PACE_TOLERANCE)

    def _retry_pace(self, cls: str, n: float, target: float, seq: SeqState, now: float) -> float:
        """Seconds until class ``cls`` would keep pace again: the requests that must
        leave the batch of ``n`` for its predicted pace to, at the measured finish rate
        (``CAPACITY_RETRY_S`` while the rate is unknown)."""
        rate = self.finish_rate(now)
        if rate is None:
            return CAPACITY_RETRY_S
        m = n - 1
        while m > 1:
            pred = self.pace_at(cls, self.load_over_life(m, seq, now), target, now)
            if pred is None or not self._off_pace(pred, target):
                break
            m -= 1
        return max(1.0, (n - m) / rate)

    def kv_verdict(self, seq: SeqState, now: float) -> AdmissionRejected | None:
        """``kv_room.kv_verdict`` on the scheduler's running and queued requests."""
        s = self.sched
        return kv_verdict(
            seq,
            itertools.chain(s.running, s.waiting),
            s.allocator.num_blocks * s.cfg.block_size,
            self.out_len,
            self.nodes_per_decode,
            self.finish_rate(now),
        )

    # ------------------------------------------------------------------ room
    def refused(self, seq: SeqState, e: AdmissionRejected, now: float) -> None:
        """``seq`` was refused (``e``) at ``now``: a tenant refused room (capacity or KV)
        makes the batch contended (``fair_share_verdict``) for ``FINISH_WINDOW_S``;
        a refusal for room holds a seat for the client's retry (``e.retry_token``)."""
        if e.reason in _CONTENDED:
            self.fair.refused_room(seq.tenant, now)
            # the seats are spaced by the rate the batch frees room while it has work
            # (the wall-clock rate counts the idle time the seats are to fill)
            rate = self.busy_finish_rate(now)
            e.retry_token, e.retry_after_s = self.seats.hold(
                now, e.retry_after_s, 1.0 / rate if rate else 0.0
            )

    def use_seat(self, seq: SeqState) -> None:
        """``seq`` came back with its retry token and was judged: its seat is used."""
        self.seats.use(seq.retry_token)

    def fair_share_verdict(self, seq: SeqState, now: float) -> AdmissionRejected | None:
        """``FairShare.verdict`` on the scheduler's batch."""
        s = self.sched
        return self.fair.verdict(seq, s.running, s.waiting, self.finish_rate(now), now)

    # ------------------------------------------------------------------ decisions
    def verdict(self, seq: SeqState, now: float) -> AdmissionRejected | None:
        """Why ``seq``, with its SLO as it stands, cannot be admitted at ``now`` (the
        refusal, not raised nor counted), or None when it can; records nothing but the
        predictions ``admitted`` gives the request (the scheduler's
        ``check_admission`` counts, degrades and records the admission; see the module
        docstring). A refusal for room or time (``_refusal_stands``) is remembered
        until what it was judged by changes, so a flood of arrivals costs the engine's
        thread a lookup each, not a plan."""
        s = self.sched
        self.observe_arrival(seq.arrival, seq.to_prefill, s.rank_of(seq.slo.cls), seq.slo.cls)
        self._pred = (None, None, None)
        self._beside = None
        self._own_tpot, self._own_err = None, None
        key = self._refusal_key(seq)
        if key is not None:
            if key != self._last_key:  # another kind of arrival judged: its arrival counts
                self._last_key = key
                self._epoch += 1
            if (old := self._refusal_stands(key)) is not None:
                return old
        e = self._verdict(seq, now)
        if key is not None and e is not None and e.reason in _REMEMBERED:
            self._sync_refusals()  # the verdict may have moved the state (seats lapse)
            self._refusals[key] = (str(e), e.reason, e.retry_after_s)
        return e

    def _refusal_key(self, seq: SeqState) -> _RefusalKey | None:
        """Everything of ``seq`` a verdict reads but its arrival time: the SLO it is
        judged against, its tenant, whether it is constrained, its prompt (to prefill,
        and in all) and its output limit. None for a request coming back with a retry
        token (its seat puts it ahead of others)."""
        if seq.retry_token is not None:
            return None
        slo = seq.slo
        return (
            slo.cls, slo.tpot_ms, slo.ttft_ms, seq.tenant, seq.constrained,
            seq.to_prefill, seq.num_tokens, seq.max_new_tokens,
        )  # fmt: skip

    def _state(self) -> tuple[int, ...]:
        """What a verdict judges by, as far as it changes between two passes: the epoch
        (a pass, an admission, a finish, another kind of arrival judged, a new model or
        check), the batch's size, the retry seats released, the policy and hardware
        model. Refusals only add seats and arrivals, which refuse more."""
        s = self.sched
        return (
            self._epoch, len(s.running), len(s.waiting), self.seats.released,
            id(s.policy), id(s.hw),
        )  # fmt: skip

    def _sync_refusals(self) -> None:
        """Forget the refusals remembered in another state than this one."""
        state = self._state()
        if state != self._refusals_at:
            self._refusals.clear()
            self._refusals_at = state

    def _refusal_stands(self, key: _RefusalKey) -> AdmissionRejected | None:
        """The refusal remembered for ``key`` in this state, anew (None: none)."""
        self._sync_refusals()
        old = self._refusals.get(key)
        return AdmissionRejected(*old) if old is not None else None

    def _verdict(self, seq: SeqState, now: float) -> AdmissionRejected | None:
        """``verdict``'s checks, in order."""
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
        kv = self.kv_verdict(seq, now)
        if kv is not None:
            return kv
        if slo.tpot_ms is not None:
            late = self.planner_off_pace(seq, rank, now) if self.ask_planner else NO_ANSWER
            if late is NO_ANSWER:
                late = self.off_pace(seq, rank, now)
            elif late is None and self.paces_too:
                own = (self._own_tpot, self._own_err)  # the planner's, for the promise
                late = self.off_pace(seq, rank, now)
                self._own_tpot, self._own_err = own
            if late is not None:
                cls, pred, target, retry = late
                room = self.planner.room if self.ask_planner else None
                if self._door(seq, room or 1, now):
                    return None
                return AdmissionRejected(
                    f"with this request class {cls!r} would run at {pred:.1f} ms per token "
                    f"against its {target:.1f} ms target",
                    "capacity",
                    retry,
                )
            self._beside = k = self.company(seq, rank)
            low = self._company_low(slo.cls, k, now) if k > 0 and self.steep else None
            if low is not None and low[0] < PROMISE and not self._door(seq, 1, now):
                bound, k = low
                rate = self.finish_rate(now)
                return AdmissionRejected(
                    f"requests of class {slo.cls!r} admitted beside {k} of their class or "
                    f"stricter met their TPOT target at most {100 * bound:.0f}% of the "
                    f"time lately, under the {100 * PROMISE:.0f}% promised",
                    "capacity",
                    max(CAPACITY_RETRY_S, 1.0 / rate) if rate else CAPACITY_RETRY_S,
                )
        pred_tpot, pred_ttft = self._own_tpot, None
        if slo.ttft_ms:
            t = self.predicted_ttft_ms(seq, now)
            if t is not None:
                waited = (now - seq.arrival) * 1000.0
                pred_ttft = waited + t
                budget = slo.ttft_ms * (1.0 - TTFT_MARGIN)  # the prediction's error
                if pred_ttft > budget and slo.ttft_ms >= waited + self.alone_ms(seq):
                    return AdmissionRejected(
                        f"predicted time to first token {pred_ttft:.0f} ms exceeds the "
                        f"{slo.ttft_ms:.0f} ms target of class {slo.cls!r} less its "
                        f"{100 * TTFT_MARGIN:.0f}% margin",
                        "ttft",
                        max(1.0, (pred_ttft - budget) / 1000.0),
                    )
        # last: a request refused for room anyway is told that reason, not its share
        unfair = self.fair_share_verdict(seq, now)
        if unfair is not None:
            return unfair
        self._pred = (self._chance(slo, pred_tpot, pred_ttft), pred_tpot, pred_ttft)
        return None

    def _door(self, seq: SeqState, room: int, now: float) -> bool:
        """Whether ``seq``, refused for room, is admitted at the door instead: a seat's
        client come back on time (its seat still held) while nothing else waits, when
        enough running requests are predicted to leave for it to run in a batch of
        ``room`` (the largest the check found feasible) before its latest start (its
        TTFT target less the margin and its own prefill; its seat's grace without a
        TTFT target). It then waits in the queue, first in line, until they have left
        (``SeqState.room_for``; the scheduler's ``admit``), instead of being refused
        again: a client that honoured its Retry-After came when its seat was due, and
        the requests the batch held then finish shortly (on the CPU engine at 3x
        capacity, 92 of 111 retries refused found one request running)."""
        s = self.sched
        gone = self.seats.gone_at(seq.retry_token)
        if gone is None or s.waiting or not s.running:
            return False
        slo = seq.slo
        until = gone
        if slo.ttft_ms is not None:
            until = seq.arrival + (slo.ttft_ms * (1.0 - TTFT_MARGIN) - self.alone_ms(seq)) / 1000.0
        leave = len(s.running) - (room - 1)  # the running requests that must leave first
        if leave <= 0:
            return False
        left_s = sorted(self._left_s(r) for r in s.running)
        wait_s = left_s[min(leave, len(left_s)) - 1]
        if now + wait_s > until:
            return False
        seq.room_for, seq.door_until = room, until
        ttft = (now - seq.arrival + wait_s) * 1000.0 + self.alone_ms(seq)
        # its class's chance, in the room it waits for
        self._pred = (self._chance(slo, self._own_tpot, ttft), self._own_tpot, ttft)
        return True

    def _chance(self, slo: SLO, pred_tpot: float | None, pred_ttft: float | None) -> float:
        """The promise of a request admitted at these predictions: its class's chance of
        its TPOT at ``pred_tpot`` times that of its TTFT at ``pred_ttft`` (ms; a part
        not predicted or not targeted counts 1)."""
        chance = 1.0
        if slo.tpot_ms is not None and pred_tpot is not None:
            chance = self.tpot_chance(slo.cls, pred_tpot / slo.tpot_ms) or 1.0
        if slo.ttft_ms and pred_ttft is not None:
            chance *= self.ttft_chance(slo.cls, slo.ttft_ms, pred_ttft)
        return chance

    def _left_s(self, r: SeqState) -> float:
        """Predicted seconds until running request ``r`` finishes: its expected output
        tokens left (its class's measured length, within its limit) at its class's
        measured pace (its TPOT target while unmeasured)."""
        cls = r.slo.cls
        out = min(self.out_len.get(cls, float(r.max_new_tokens)), float(r.max_new_tokens))
        left = max(1.0, out - r.num_output)
        pace = self.pace_ms(cls) or r.slo.tpot_ms or 0.0
        return left * pace / 1000.0 + (self.alone_ms(r) / 1000.0 if r.in_prefill else 0.0)

    def expired(self, now: float) -> list[SeqState]:
        """The queued requests never started that can no longer make their TTFT
        deadline: started now, their own prefill would end past it (one whose target its
        prefill alone misses is served as it can). The scheduler ends them (reason
        ``TTFT_DEADLINE``); admission only decides."""
        s = self.sched
        return [
            r
            for r in s.waiting
            if r.num_output == 0
            and r.num_cached == 0
            and r.slo.ttft_ms is not None
            and (now - r.arrival) * 1000.0 + (alone := self.alone_ms(r)) > r.slo.ttft_ms
            and r.slo.ttft_ms >= alone
        ]


def _binomial_upper(x: int, n: int, alpha: float) -> float:
    """The exact one-sided upper bound on a binomial share with ``x`` successes in ``n``
    trials (Clopper-Pearson): the p at which ``x`` or fewer has probability ``alpha``
    (1 when ``x == n``), by bisection."""
    if x >= n:
        return 1.0
    lo, hi = x / n, 1.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        cdf = sum(math.comb(n, i) * mid**i * (1.0 - mid) ** (n - i) for i in range(x + 1))
        if cdf > alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
