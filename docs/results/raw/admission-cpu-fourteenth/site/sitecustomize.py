# MISS_LOG=path: one JSON line per pass (end time, decoders, prefill tokens, measured
# and predicted ms), per admitted request (class, company, running, waiting, promise,
# predicted TPOT) and per finish (TPOT, TTFT, met); for issue 31's fourteenth pass
# (where the strict class's misses come from in a slow hour).
import json
import os

path = os.environ.get("MISS_LOG")
if path:
    import adaserve.core.admission as A

    f = open(path, "a")
    o_obs, o_adm, o_fin = (A.AdmissionControl.observe, A.AdmissionControl.admitted,
                           A.AdmissionControl.observe_finish)

    def observe(self, tr, cadence_s=None):
        o_obs(self, tr, cadence_s)
        hw = self.sched.hw
        pred = None
        if hw is not None and tr.tokens > 0:
            n = len(tr.decode) + len(tr.prefill)
            pred = float(hw.iteration_ms(tr.tokens, tr.kv_tokens,
                                         prefill_pairs=tr.prefill_pairs, requests=n))
        dec = {}
        for rid in tr.decode:
            c = tr.classes.get(rid)
            dec[c] = dec.get(c, 0) + 1
        f.write(json.dumps({"ev": "s", "t": tr.t_end, "ms": tr.duration_s * 1000.0,
            "cad": None if cadence_s is None else cadence_s * 1000.0, "pred": pred,
            "dec": dec, "pre": sum(tr.prefill.values()), "tok": tr.tokens,
            "acc": {str(k): v for k, v in tr.accepted.items()}}) + "\n")

    def admitted(self, seq, now):
        o_adm(self, seq, now)
        s = self.sched
        f.write(json.dumps({"ev": "a", "t": now, "rid": seq.rid, "cls": seq.slo.cls,
            "beside": seq.beside, "run": len(s.running), "wait": len(s.waiting),
            "promise": seq.promise, "pred_tpot": seq.pred_tpot_ms, "room_for": seq.room_for,
            "retry": seq.retry_token is not None}) + "\n")
        f.flush()

    def observe_finish(self, t, seq=None):
        o_fin(self, t, seq)
        if seq is None or seq.first_token_at is None:
            return
        tpot = ((t - seq.first_token_at) * 1000.0 / (seq.num_output - 1)
                if seq.num_output >= 2 else None)
        f.write(json.dumps({"ev": "f", "t": t, "rid": seq.rid, "cls": seq.slo.cls,
            "tpot": tpot, "target": seq.slo.tpot_ms, "first": seq.first_token_at,
            "arr": seq.arrival, "out": seq.num_output}) + "\n")
        f.flush()

    A.AdmissionControl.observe = observe
    A.AdmissionControl.admitted = admitted
    A.AdmissionControl.observe_finish = observe_finish

# LOOP_LOG=path: the engine thread's time between passes, by part (commands: admission
# verdicts and adds; publish: tokens handed to the streams), a JSON line every 5 s
lpath = os.environ.get("LOOP_LOG")
if lpath:
    import time as _t

    import adaserve.server.engine_loop as L

    lf = open(lpath, "a")
    acc = {"cmd": 0.0, "ncmd": 0, "pub": 0.0, "npub": 0, "step": 0.0, "nstep": 0,
           "verdict": 0.0, "nverdict": 0, "t0": _t.perf_counter()}
    o_cmd, o_pub = L.EngineLoop._command, L.EngineLoop._publish

    def _flush():
        now = _t.perf_counter()
        if now - acc["t0"] >= 5.0:
            lf.write(json.dumps({**acc, "wall": now - acc["t0"]}) + "\n")
            lf.flush()
            for k in acc:
                acc[k] = 0 if k != "t0" else now

    def cmd(self, c):
        t = _t.perf_counter()
        try:
            return o_cmd(self, c)
        finally:
            acc["cmd"] += _t.perf_counter() - t
            acc["ncmd"] += 1

    def pub(self):
        t = _t.perf_counter()
        try:
            return o_pub(self)
        finally:
            acc["pub"] += _t.perf_counter() - t
            acc["npub"] += 1
            _flush()

    L.EngineLoop._command, L.EngineLoop._publish = cmd, pub
    import adaserve.engine.engine as E

    o_step = E.Engine.step

    def step(self):
        t = _t.perf_counter()
        try:
            return o_step(self)
        finally:
            acc["step"] += _t.perf_counter() - t
            acc["nstep"] += 1

    E.Engine.step = step
    import adaserve.core.admission as A2

    o_v = A2.AdmissionControl.verdict

    def verdict(self, seq, now):
        t = _t.perf_counter()
        try:
            return o_v(self, seq, now)
        finally:
            acc["verdict"] += _t.perf_counter() - t
            acc["nverdict"] += 1

    A2.AdmissionControl.verdict = verdict

# VERDICT_PROF=path: cProfile of the admission verdicts alone, dumped every 200 verdicts
ppath = os.environ.get("VERDICT_PROF")
if ppath:
    import cProfile

    import adaserve.core.admission as A3

    prof = cProfile.Profile()
    o_v3 = A3.AdmissionControl.verdict
    count = [0]

    def verdict3(self, seq, now):
        prof.enable()
        try:
            return o_v3(self, seq, now)
        finally:
            prof.disable()
            count[0] += 1
            if count[0] % 200 == 0:
                prof.dump_stats(ppath)

    A3.AdmissionControl.verdict = verdict3

# LOOP_PROF=path: cProfile of the whole engine thread (EngineLoop._loop), dumped every
# 2,000 passes
lp = os.environ.get("LOOP_PROF")
if lp:
    import cProfile as _cp

    import adaserve.server.engine_loop as L4

    _o_loop, _o_pub4 = L4.EngineLoop._loop, L4.EngineLoop._publish
    _prof4 = _cp.Profile()
    _n4 = [0]

    def _loop4(self):
        _prof4.enable()
        try:
            return _o_loop(self)
        finally:
            _prof4.disable()
            _prof4.dump_stats(lp)

    def _pub4(self):
        _o_pub4(self)
        _n4[0] += 1
        if _n4[0] % 2000 == 0:
            _prof4.disable()
            _prof4.dump_stats(lp)
            _prof4.enable()

    L4.EngineLoop._loop, L4.EngineLoop._publish = _loop4, _pub4
