# ADM_LOG=path: one JSON line per admission verdict (the request's class, whether it came
# back with a retry token, the reason refused, the seats held and ahead, the batch) and
# one per seat held; for issue 31's twelfth pass (why retries that honour Retry-After
# are refused on the CPU engine).
import json
import os

path = os.environ.get("ADM_LOG")
if path:
    import adaserve.core.admission as A
    import adaserve.core.retry_seats as R

    f = open(path, "a")
    o_verdict, o_hold = A.AdmissionControl.verdict, R.RetrySeats.hold

    def verdict(self, seq, now):
        s = self.sched
        tok = seq.retry_token
        mine = self.seats._seats.get(tok or "")
        e = o_verdict(self, seq, now)
        f.write(json.dumps({"ev": "v", "t": now, "cls": seq.slo.cls, "retry": tok is not None,
            "known": mine is not None, "due": mine[0] if mine else None,
            "reason": e.reason if e else None, "msg": str(e)[:160] if e else None,
            "held": len(self.seats._seats), "back": list(self.seats.returns).count(True),
            "nret": len(self.seats.returns), "run": len(s.running), "wait": len(s.waiting),
            "rate": self.finish_rate(now)}) + "\n")
        f.flush()
        return e

    def hold(self, now, wait_s, spacing_s=0.0):
        tok, w = o_hold(self, now, wait_s, spacing_s)
        f.write(json.dumps({"ev": "hold", "t": now, "asked": wait_s, "told": w,
            "spacing": spacing_s, "held": len(self._seats)}) + "\n")
        return tok, w

    A.AdmissionControl.verdict, R.RetrySeats.hold = verdict, hold

# with ADM_LOG, also the planner check's state after each answer: the count now, over
# the life, the steady count, the held seats ahead and the life's share
if path:
    import adaserve.core.planner_check as P

    o_off, o_life = P.PlannerCheck.off_pace, P.PlannerCheck._life_batch

    def life(self, seq, now, targets):
        b, n = o_life(self, seq, now, targets)
        self._x_n = n
        return b, n

    def off(self, seq, rank, now):
        self._x_n = None
        out = o_off(self, seq, rank, now)
        f.write(json.dumps({"ev": "p", "t": now, "retry": seq.retry_token is not None,
            "n": self._x_n, "n_life": self._n_life, "steady": self._steady, "held": self._held,
            "share": self._share, "out": None if out is None else (str(out) if out is P.NO_ANSWER else [out[0], round(out[1], 2), out[3]])}) + "\n")
        return out

    P.PlannerCheck.off_pace, P.PlannerCheck._life_batch = off, life

# the twelfth pass's variants: IDLE_SEATS=1 (an idle engine counts the seats due back
# before a request would leave), PATIENCE=0 (every held seat counts, whatever its wait)
if os.environ.get("IDLE_SEATS") is not None or os.environ.get("PATIENCE") is not None:
    import adaserve.core.admission as _A3
    import adaserve.core.retry_seats as _R3

    _A3.AdmissionControl.IDLE_SEATS = os.environ.get("IDLE_SEATS", "0") == "1"
    _R3.RetrySeats.PATIENCE = os.environ.get("PATIENCE", "1") == "1"
