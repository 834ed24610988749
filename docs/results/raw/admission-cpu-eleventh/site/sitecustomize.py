# STEP_LOG=path: one JSON line per engine step (the loop's time outside the step too)
# and one per finished request; for issue 31's eleventh pass (where a strict request's
# TPOT goes under overload).
import json
import os
import time

path = os.environ.get("STEP_LOG")
if path:
    import adaserve.engine.engine as E
    import adaserve.server.engine_loop as L

    f = open(path, "a")
    acc = {"cmd": 0.0, "pub": 0.0, "adds": 0, "kinds": {}}
    o_step, o_cmd, o_pub = E.Engine.step, L.EngineLoop._command, L.EngineLoop._publish

    def step(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        fin = o_step(self)
        t1, c1 = time.perf_counter(), time.thread_time()
        tr = self.last_trace
        if tr is not None and tr.t_end >= t0:
            f.write(json.dumps({"ev": "step", "t0": t0, "t1": t1, "cpu": c1 - c0, "ts": tr.t_start,
                "te": tr.t_end, "pred": tr.predicted_ms, "plan_ms": tr.plan.t_iter_ms, "tok": tr.tokens,
                "dec": tr.decode, "cls": {str(k): v for k, v in tr.classes.items()},
                "acc": {str(k): v for k, v in tr.accepted.items()},
                "nodes": {str(k): v for k, v in tr.tree_nodes.items()},
                "spec": {str(k): v for k, v in tr.spec.items()},
                "pre": {str(k): v for k, v in tr.prefill.items()},
                "cmd": acc["cmd"], "pub": acc["pub"], "adds": acc["adds"], "kinds": acc["kinds"]}) + "\n")
            acc.update(cmd=0.0, pub=0.0, adds=0, kinds={})
        for r in fin:
            if r.first_token_at is not None and r.num_output >= 2:
                f.write(json.dumps({"ev": "fin", "rid": r.rid, "cls": r.slo.cls,
                    "first": r.first_token_at, "end": r.finished_at, "n": r.num_output,
                    "arr": r.arrival, "target": r.slo.tpot_ms}) + "\n")
        f.flush()
        return fin

    def command(self, c):
        t = time.perf_counter()
        o_cmd(self, c)
        acc["cmd"] += time.perf_counter() - t
        acc["adds"] += 1
        k = type(c).__name__
        if k == "Call":
            k += ":" + getattr(c.fn, "__qualname__", "?")
        acc["kinds"][k] = acc["kinds"].get(k, 0) + 1

    def publish(self):
        t = time.perf_counter()
        o_pub(self)
        acc["pub"] += time.perf_counter() - t

    E.Engine.step, L.EngineLoop._command, L.EngineLoop._publish = step, command, publish

# NOMEMO=1: every arrival judged afresh (a refusal not remembered within its state)
if os.environ.get("NOMEMO"):
    import adaserve.core.admission as _A

    _A.AdmissionControl._refusal_key = lambda self, seq: None

# SERIAL=1: an experiment, not a policy: the strict class one request at a time (an
# interactive arrival is refused while another interactive request runs or waits), to
# bound what admission alone could give the strict class on this machine
if os.environ.get("SERIAL"):
    import adaserve.core.admission as _A2
    from adaserve.errors import AdmissionRejected as _AR

    _ov = _A2.AdmissionControl._verdict

    def _serial(self, seq, now):
        s = self.sched
        if seq.slo.cls == "interactive" and any(
            r.slo.cls == "interactive" for r in (*s.running, *s.waiting)
        ):
            return _AR("serial experiment", "capacity", 1.0)
        return _ov(self, seq, now)

    _A2.AdmissionControl._verdict = _serial

# NOCOMPANY=1: a strict request's company not judged (the code before the eleventh pass's
# company bound)
if os.environ.get("NOCOMPANY"):
    import adaserve.core.admission as _A3

    _A3.AdmissionControl.steep = property(lambda self: False)
