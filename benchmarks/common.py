"""Helpers shared by the benchmark scripts (held-out prompts, timing)."""

from __future__ import annotations

import hashlib
import sysconfig
import time
from pathlib import Path


def heldout_code_prompts(n: int, min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """Code snippets from standard-library files of the held-out split (sha1 % 20 == 0)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if any(
            p in ("test", "tests", "idlelib", "site-packages") for p in f.relative_to(root).parts
        ):
            continue
        if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20:
            continue
        text = f.read_text(errors="ignore")
        for start in range(0, max(1, len(text) - max_chars), 3000):
            chunk = text[start : start + max_chars]
            cut = chunk.rfind("\n", min_chars)
            if cut > 0:
                out.append(chunk[: cut + 1])
            if len(out) >= n:
                return out
    return out


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0


def decoding_engine(batch: int, policy: str):
    """An engine on the shipped pair with ``batch`` held-out prompts past prefill, each
    decoding without end (for step-time A/B measurements)."""
    from adaserve.config import EngineConfig
    from adaserve.core.slo import SLO
    from adaserve.engine import build_engine
    from adaserve.sampling import SamplingParams

    e = build_engine(EngineConfig(policy=policy))
    sp = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for p in heldout_code_prompts(batch, 400, 1600):
        e.add_request(e.tokenizer.encode(p), sp, SLO(tpot_ms=50))
    while e.waiting or any(r.num_output == 0 for r in e.running):
        e.step()
    return e


def alternate_steps(engine, variants: dict, rounds: int, steps: int = 5) -> dict[str, float]:
    """Mean step ms of each variant, alternated on one engine so that machine-speed
    drift hits all alike. ``variants``: name -> function installing that variant; each
    turn runs one warm-up step, then ``steps`` timed steps."""
    tot = dict.fromkeys(variants, 0.0)
    for _ in range(rounds):
        for name, install in variants.items():
            install()
            engine.step()
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            tot[name] += time.perf_counter() - t
    return {k: round(v / (steps * rounds) * 1e3, 2) for k, v in tot.items()}


def run_cases(doc: str, default_cases: str, run_case) -> None:
    """CLI of the A/B step-time benchmarks: ``--cases batch:policy,...`` and
    ``--rounds``; prints each case's ``run_case(batch, policy, rounds)`` and a JSON."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--cases", default=default_cases, help="batch:policy,...")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    out = {}
    for case in args.cases.split(","):
        b, pol = case.split(":", 1)
        out[case] = run_case(int(b), pol, args.rounds)
        print(case, out[case], flush=True)
    print(json.dumps(out, indent=1))
