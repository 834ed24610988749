# NOGAINS=1: planner.request_gains returns ones (the per-request gain off)
import json, os, time
path = os.environ.get("ADM_LOG")
if path:
    import adaserve.core.admission as A
    f = open(path, "a")
    oa, of = A.AdmissionControl.admitted, A.AdmissionControl.observe_finish
    def admitted(self, seq, now):
        oa(self, seq, now)
        s = self.sched
        f.write(json.dumps({"ev": "adm", "rid": seq.rid, "t": now, "cls": seq.slo.cls,
            "promise": seq.promise, "pred": seq.pred_tpot_ms, "err": self._own_err,
            "run": len(s.running), "wait": len(s.waiting), "tr": self.time_ratio,
            "tok": self.tok_ratio.get(seq.slo.cls)}) + "\n"); f.flush()
    def observe_finish(self, t, seq=None):
        if seq is not None and seq.first_token_at is not None and seq.num_output >= 2:
            f.write(json.dumps({"ev": "fin", "rid": seq.rid, "t": t, "cls": seq.slo.cls,
                "tpot": (t - seq.first_token_at) * 1000 / (seq.num_output - 1),
                "ttft": (seq.first_token_at - seq.arrival) * 1000, "n": seq.num_output,
                "target": seq.slo.tpot_ms, "run": len(self.sched.running)}) + "\n"); f.flush()
        of(self, t, seq)
    A.AdmissionControl.admitted = admitted
    A.AdmissionControl.observe_finish = observe_finish
_sw = os.environ.get("SWITCH_S")
if _sw:
    import sys
    sys.setswitchinterval(float(_sw))
if os.environ.get("PIN0"):
    try:
        os.sched_setaffinity(0, {0})
    except OSError:
        pass
if os.environ.get("NOCONFINE"):
    import adaserve.util.threads as _T
    import contextlib as _cl
    _T.confine_rest = lambda *a, **k: ()
    _T.keep_off = lambda *a, **k: ()  # the name at commit 46215e1, when ab.sh ran
    _T.kept_off = lambda *a, **k: _cl.nullcontext(())  # its name since
if os.environ.get("NOGAINS"):
    import numpy as _np
    import adaserve.policies.budgeted.planner as _P
    _P.request_gains = lambda dec: _np.ones(len(dec))
