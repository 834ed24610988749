"""Every refusal of one simulated run, with what the check saw (issue 31's diagnosis).

Runs ``adaserve simulate`` on the reference workload of ``admission_sim.py`` in this
process with admission on, wrapping the admission check to log, for each refusal: the
time, class, reason and message, the requests running (and how many of them decode),
waiting, the measured arrival rate and time in the engine, the load the pace check
counted now (``n``) and over the request's life (``n_life``); then the same seed with
admission off, to say whether the refused request met its SLO there. Also prints the
decoders and the requests in the engine over time in both runs.

    python benchmarks/admission_refusals.py --rate 1.6 --seed 1

Deterministic, like the simulator.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from admission_sim import REF

from adaserve import cli
from adaserve.core import admission as adm


def simulate(rate: float, seed: int, duration: float, on: bool, out: str) -> list[dict]:
    """One run's request records (``requests.jsonl``)."""
    argv = ["simulate", *REF, "--request-rate", str(rate), "--duration", str(duration)]
    argv += ["--seeds", str(seed), "--policies", "adaserve", "--no-plots", "--no-progress"]
    argv += ["--out", out] + (["--admission"] if on else [])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cli.main(argv)
    return [json.loads(x) for x in (Path(out) / "requests.jsonl").read_text().splitlines()]


def in_engine(recs: list[dict], t: float) -> tuple[int, int]:
    """(decoding, admitted and not finished) at ``t``."""
    dec = sum(
        1
        for r in recs
        if r["first_token_s"] is not None and r["first_token_s"] <= t < (r["finish_s"] or 0)
    )
    sys_ = sum(1 for r in recs if not r["shed"] and r["arrival_s"] <= t < (r["finish_s"] or 1e18))
    return dec, sys_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1.6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=180.0)
    a = ap.parse_args()

    log: list[dict[str, Any]] = []
    last: dict[str, float] = {}
    verdict, over_life = adm.AdmissionControl.verdict, adm.AdmissionControl.load_over_life

    def load_over_life(self: adm.AdmissionControl, n: float, seq: Any, now: float) -> float:
        got = over_life(self, n, seq, now)
        last.setdefault("n", n)  # the first call is the check's own (the rest, Retry-After)
        last.setdefault("n_life", got)
        return got

    def logged(self: adm.AdmissionControl, seq: Any, now: float) -> Any:
        last.clear()
        e = verdict(self, seq, now)
        if e is not None:
            s = self.sched
            rate = self.arrival_rate(now)
            log.append(
                {
                    "t": now,
                    "cls": seq.slo.cls,
                    "reason": e.reason,
                    "msg": str(e),
                    "running": len(s.running),
                    "decoding": sum(1 for r in s.running if not r.in_prefill),
                    "waiting": len(s.waiting),
                    "rate": rate,
                    "stay": self.stay_s,
                    **last,
                }
            )
        return e

    adm.AdmissionControl.verdict = logged  # type: ignore[method-assign]
    adm.AdmissionControl.load_over_life = load_over_life  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as d:
        on = simulate(a.rate, a.seed, a.duration, True, d + "/on")
        adm.AdmissionControl.verdict = verdict  # type: ignore[method-assign]
        off = simulate(a.rate, a.seed, a.duration, False, d + "/off")
    off_ok = {r["idx"]: r["attained"] for r in off}
    refused = [r for r in on if r["shed"]]
    for r, e in zip(refused, log):
        e["met_with_admission_off"] = off_ok.get(r["idx"])
    print(f"{len(refused)} of {len(on)} refused at {a.rate} req/s, seed {a.seed}")
    print("| t s | class | reason | running (decoding) | waiting | rate/s | stay s | n | n_life "
          "| met with admission off | message |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for e in log:
        f = {k: (f"{v:.1f}" if isinstance(v, float) else v) for k, v in e.items()}
        print(
            f"| {f['t']} | {e['cls']} | {e['reason']} | {e['running']} ({e['decoding']}) | "
            f"{e['waiting']} | {f['rate']} | {f['stay']} | {f.get('n')} | {f.get('n_life')} | "
            f"{e.get('met_with_admission_off')} | {e['msg']} |"
        )
    if log:
        t0, t1 = int(log[0]["t"]) - 20, int(log[-1]["t"]) + 20
        print("\ndecoding / in the engine over time (admission on; off):")
        for t in range(max(t0, 0), t1, 4):
            print(f"  t={t:4d} s  on {in_engine(on, t)}  off {in_engine(off, t)}")


if __name__ == "__main__":
    main()
