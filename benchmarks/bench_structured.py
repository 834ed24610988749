"""Structured outputs on the shipped pair, in process (issue 33's goals).

    .venv/bin/python benchmarks/bench_structured.py [--rounds 3] [--out DIR]

Run it alone (nothing else of ours on the machine). Every figure is side by side in
one process, rounds interleaved, and reported per round and as the median:

1. mask overhead: 16 concurrent requests under a JSON schema with long strings
   against the same 16 unconstrained (``ignore_eos``, the same max_tokens), with
   ``ar``: wall time per generated token, constrained / unconstrained - 1; and the
   host time the masks take per token (``adaserve:grammar_mask_seconds``);
2. speculation under a schema: 16 greedy JSON-schema requests (the same output for
   every policy), generated tokens/s of ``adaserve``, ``spec-chain:4`` and ``dyn-tree``
   against ``ar``, with and without forced tokens (the grammar's forced continuations
   put into the tree without a draft step), and the share of output tokens that were
   forced;
3. the backends: llguidance and xgrammar, the cold compile of 10 schemas, the mask
   time per tree node, and tokens/s of (2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from adaserve import LLM, SamplingParams  # noqa: E402
from adaserve.structured.params import StructuredOutputsParams  # noqa: E402

PROMPTS = [
    "def parse(line):",
    "Hello, my name is",
    "import os\nimport sys\n",
    "# Configuration of the service",
    "class Point:",
    "The weather today",
    "for i in range(10):",
    "README\n======\n",
]
LONG = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 120},
        "body": {"type": "string", "maxLength": 200},
        "n": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["title", "body", "n"],
    "additionalProperties": False,
}
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 16},
        "email": {"type": "string", "maxLength": 24},
        "active": {"type": "boolean"},
        "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 20},
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "email", "active", "roles", "address"],
    "additionalProperties": False,
}


def _run(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def _steps_at(llm, prompts, params, batch: int) -> tuple[list[float], int, float]:
    """Durations (s) of the steps that decoded exactly ``batch`` requests, the tokens
    generated, and the run's wall time."""
    steps: list[float] = []
    llm.engine.on_step = lambda eng, tr: (
        steps.append(tr.duration_s) if len(tr.decode) == batch and not tr.prefill else None
    )
    try:
        dt, toks = _run(llm, prompts, params)
    finally:
        llm.engine.on_step = None
    return steps, toks, dt


def mask_overhead(llm, rounds: int) -> dict:
    """Steps of 16 decoding requests, constrained against unconstrained (``ar``): the
    mask's cost per step, hence per token, at the same batch."""
    llm.engine.set_policy("ar")
    prompts = (PROMPTS * 2)[:16]
    s = llm.engine.structured
    con = SamplingParams(temperature=0.0, max_tokens=160, structured_outputs={"json": LONG})
    rows = []
    for _ in range(rounds):
        m0, n0 = s.mask_s, s.masks
        st_c, tok_c, _ = _steps_at(llm, prompts, con, 16)
        mask_s, masks = s.mask_s - m0, s.masks - n0
        per = max(1, tok_c // len(prompts))
        st_u, _, _ = _steps_at(
            llm, prompts, SamplingParams(temperature=0.0, max_tokens=per, ignore_eos=True), 16
        )
        c, u = statistics.median(st_c), statistics.median(st_u)
        rows.append(
            {
                "steps_compared": [len(st_c), len(st_u)],
                "constrained_step_ms": 1000 * c,
                "unconstrained_step_ms": 1000 * u,
                "overhead": c / u - 1,
                "mask_ms_per_token": 1000 * mask_s / tok_c,
                "mask_us_per_node": 1e6 * mask_s / max(1, masks),
            }
        )
    return {"rounds": rows, "median_overhead": statistics.median(r["overhead"] for r in rows)}


def speculation(llm, rounds: int, concurrency=(1, 4, 16)) -> dict:
    """Generated tokens/s per policy against ``ar`` at each concurrency, on the JSON
    schema workload (greedy: the same tokens for every policy) and unconstrained (the
    same prompts, 120 tokens each): what speculation keeps under a schema."""
    import adaserve.engine.executor as eng_mod

    configs = [
        ("ar", 32),
        ("adaserve", 32),
        ("adaserve", 0),
        ("spec-chain:4", 32),
        ("dyn-tree", 32),
    ]
    workloads = {
        "json_schema": SamplingParams(
            temperature=0.0, max_tokens=200, structured_outputs={"json": RECORD}
        ),
        "unconstrained": SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True),
    }
    s = llm.engine.structured
    per: dict[str, list] = {}
    refs: dict = {}
    for _ in range(rounds):
        for wname, sp in workloads.items():
            for conc in concurrency:
                prompts = (PROMPTS * 2)[:conc]
                for pol, forced in configs:
                    if wname == "unconstrained" and not forced:
                        continue
                    eng_mod.MAX_FORCED = forced
                    llm.engine.set_policy(pol)
                    f0, a0 = s.forced_tokens, s.forced_accepted
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, sp)
                    dt = time.perf_counter() - t0
                    toks = sum(len(o.outputs[0].token_ids) for o in outs)
                    ids = [o.outputs[0].token_ids for o in outs]
                    ref = refs.setdefault((wname, conc), ids)
                    key = f"{wname} x{conc} {pol}" + ("" if forced else " (no forced tokens)")
                    per.setdefault(key, []).append(
                        {
                            "tokens_per_s": toks / dt,
                            "tokens": toks,
                            "same_output": ids == ref,
                            "forced_proposed": s.forced_tokens - f0,
                            "forced_accepted": s.forced_accepted - a0,
                        }
                    )
    eng_mod.MAX_FORCED = 32
    summary = {}
    for key, rows in per.items():
        w, c = key.split(" ")[:2]
        ar = statistics.median(r["tokens_per_s"] for r in per[f"{w} {c} ar"])
        tps = statistics.median(r["tokens_per_s"] for r in rows)
        summary[key] = {
            "tokens_per_s": round(tps, 1),
            "vs_ar": round(tps / ar, 3),
            "forced_share": round(
                statistics.median(r["forced_accepted"] / r["tokens"] for r in rows), 3
            ),
            "same_output_as_ar": all(r["same_output"] for r in rows),
        }
    return {"rounds": per, "summary": summary}


def backends(profile: str | None) -> dict:
    out = {}
    schemas = [RECORD, LONG] + [
        {
            "type": "object",
            "properties": {
                f"k{j}": {"type": "integer", "minimum": 0, "maximum": 10 * i} for j in range(i + 1)
            },
            "required": [f"k{j}" for j in range(i + 1)],
            "additionalProperties": False,
        }
        for i in range(8)
    ]
    for be in ("llguidance", "xgrammar"):
        llm = LLM(structured_outputs_backend=be, profile=profile)
        s = llm.engine.structured
        t0 = time.perf_counter()
        _ = s.compiler  # the backend's tokenizer tables
        init_s = time.perf_counter() - t0
        times = []
        for sc in schemas:
            t0 = time.perf_counter()
            s.compile(StructuredOutputsParams(json=sc))
            times.append(time.perf_counter() - t0)
        llm.engine.set_policy("adaserve")
        m0, n0 = s.mask_s, s.masks
        sp = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs={"json": RECORD})
        dt, toks = _run(llm, (PROMPTS * 2)[:16], sp)
        out[be] = {
            "init_s": init_s,
            "compile_ms_median": 1000 * statistics.median(times),
            "compile_ms_max": 1000 * max(times),
            "mask_us_per_node": 1e6 * (s.mask_s - m0) / max(1, s.masks - n0),
            "adaserve_tokens_per_s": toks / dt,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None, help="hardware profile file (default: cache)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    llm = LLM(profile=a.profile)
    res = {
        "mask_overhead": mask_overhead(llm, a.rounds),
        "speculation": speculation(llm, a.rounds),
        "backends": backends(a.profile),
    }
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
