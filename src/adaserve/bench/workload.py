"""Benchmark workloads: arrivals, SLO classes, prompts and lengths, all from one seed.

A workload is a list of ``WorkItem`` built by ``build_workload(spec)``. Everything
random (arrival gaps, class draws, lengths, prompt choice) comes from independent
streams of ``numpy.random.SeedSequence(spec.seed)``, so the same spec gives the same
items on every run and every policy sees the identical workload.

What a workload is made of lives beside this module: the spec and its parsers in
``adaserve.bench.workload_spec``, arrival processes and trace files in
``adaserve.bench.arrivals``, prompt sources (``dataset``: ``stdlib``, ``random``,
``humaneval`` or a ShareGPT file) in ``adaserve.bench.datasets``, and the session
workloads whose prompts share prefixes (``multiturn``, ``agent``) in
``adaserve.bench.sessions``.
"""

from __future__ import annotations

import math

import numpy as np

from adaserve.bench.arrivals import gamma_arrivals, load_trace, trace_arrivals
from adaserve.bench.datasets import (
    _WORDS,
    _Entry,
    _ids_from_text,
    heldout_stdlib_files,
    load_humaneval,
    load_sharegpt,
)
from adaserve.bench.sessions import build_sessions, is_session_dataset
from adaserve.bench.workload_spec import (
    FALLBACK_INPUT,
    FALLBACK_OUTPUT,
    LengthDist,
    WorkItem,
    WorkloadSpec,
    parse_shift,
)

# the documented entry points (docs/bench.md, "Python API"): the spec and its shift
# parser are importable from here too
__all__ = ["WorkloadSpec", "build_workload", "parse_shift"]


def _dist_for(table: tuple[tuple[str, LengthDist], ...], cls: str, fallback: LengthDist):
    d = dict(table)
    return d.get(cls) or d.get("*") or fallback


def _class_weights(spec: WorkloadSpec, t: float, horizon: float) -> list[tuple[str, float]]:
    mix = list(spec.class_mix)
    for s in sorted(spec.shifts, key=lambda s: s.at_s):
        if s.kind == "mix" and t >= s.at_s:
            mix = list(s.value)
    if spec.class_peaks and horizon > 0:
        k = len(mix)
        out = []
        for i, (c, w) in enumerate(mix):
            peak = (i + 0.5) / k
            out.append((c, w * (1.0 + 0.9 * math.cos(2 * math.pi * (t / horizon - peak)))))
        return out
    return mix


def build_workload(spec: WorkloadSpec, tokenizer=None, vocab_size: int | None = None):
    """The items of ``spec`` in arrival order (deterministic in ``spec.seed``).

    With a tokenizer, ``prompt_ids`` is the source text's ids cut to the drawn length and
    ``prompt`` their decoded text. Without one but with ``vocab_size``, ``prompt_ids`` is
    synthesised from the text's bytes (random ids for ``dataset="random"``) and
    ``prompt`` is None. With neither, only ``prompt`` is set (text cut to about four
    characters per token).
    """
    if is_session_dataset(spec.dataset):
        return build_sessions(spec, tokenizer, vocab_size)
    ss = np.random.SeedSequence(spec.seed)
    r_arr, r_cls, r_len, r_prompt = (np.random.default_rng(s) for s in ss.spawn(4))
    rate_changes = [(s.at_s, float(s.value)) for s in spec.shifts if s.kind == "rate"]
    trace_idx = None
    rows = None
    if spec.trace:
        rows = load_trace(spec.trace)
        arrivals, trace_idx = trace_arrivals(
            rows, spec.request_rate, spec.duration_s, spec.num_prompts
        )
    else:
        arrivals = gamma_arrivals(
            r_arr,
            spec.request_rate,
            spec.burstiness,
            spec.duration_s,
            spec.num_prompts,
            rate_changes,
        )
    n = len(arrivals)
    horizon = spec.duration_s or (float(arrivals[-1]) if n else 0.0)

    entries: list[_Entry] | None = None
    if spec.dataset not in ("stdlib", "random"):
        entries = load_humaneval() if spec.dataset == "humaneval" else load_sharegpt(spec.dataset)
        order = r_prompt.permutation(len(entries))
    elif spec.dataset == "stdlib":
        files = heldout_stdlib_files()

    items: list[WorkItem] = []
    u_cls = r_cls.random(n)
    for i in range(n):
        t = float(arrivals[i])
        entry = entries[int(order[i % len(entries)])] if entries is not None else None
        weights = _class_weights(spec, t, horizon)
        if entry is not None and entry.cls:
            cls = entry.cls
        else:
            total = sum(w for _, w in weights)
            acc, cls = 0.0, weights[-1][0]
            for c, w in weights:
                acc += w / total
                if u_cls[i] < acc:
                    cls = c
                    break
        in_d = _dist_for(spec.input_len, cls, FALLBACK_INPUT)
        out_d = _dist_for(spec.output_len, cls, FALLBACK_OUTPUT)
        plen = int(in_d.sample(r_len, 1)[0])
        olen = int(out_d.sample(r_len, 1)[0])
        if (
            spec.trace_lengths
            and rows is not None
            and trace_idx is not None  # read with ``rows``
            and rows.context_tokens is not None
            and rows.generated_tokens is not None  # read together (``load_trace``)
        ):
            j = int(trace_idx[i])
            plen = int(np.clip(rows.context_tokens[j], 1, in_d.max))
            olen = int(np.clip(rows.generated_tokens[j], 1, out_d.max))
        text: str | None
        meta: dict = {}
        if entry is not None:
            text = entry.text
            if entry.output_len is not None:
                if entry.output_len > 0:
                    olen = min(entry.output_len, out_d.max)
                elif tokenizer is not None and entry.reply:
                    olen = int(np.clip(len(tokenizer.encode(entry.reply)), 1, out_d.max))
                else:  # about four characters per token
                    olen = int(np.clip(-entry.output_len // 4, 1, out_d.max))
        elif spec.dataset == "stdlib":
            rel, src = files[int(r_prompt.integers(len(files)))]
            lines = src.splitlines(keepends=True)
            start = int(r_prompt.integers(0, max(1, len(lines) - 10)))
            text = "".join(lines[start:])
            meta = {"file": rel, "line": start + 1}
        else:
            text = " ".join(_WORDS[int(k)] for k in r_prompt.integers(len(_WORDS), size=plen * 2))
        if entry is not None:
            plen = in_d.max  # a dataset prompt is used whole, up to the class maximum
        if tokenizer is not None:
            chars = max(64, plen * 8)
            ids = tokenizer.encode(text[:chars])
            while len(ids) < plen and len(text[:chars]) < len(text):
                chars *= 2
                ids = tokenizer.encode(text[:chars])
            ids = ids[:plen]
            if not ids:
                ids = tokenizer.encode("x")
            prompt_ids = ids
            prompt = tokenizer.decode(ids)
        elif vocab_size is not None:
            if entry is not None:
                plen = min(max(1, len(text.encode()) // 4), plen)
            if spec.dataset == "random":
                prompt_ids = [int(x) for x in r_prompt.integers(1, vocab_size - 1, size=plen)]
            else:
                prompt_ids = _ids_from_text(text, plen, vocab_size)
            prompt = None
        else:
            prompt_ids = None
            prompt = text[: plen * 4]
        items.append(
            WorkItem(
                idx=i,
                arrival_s=t,
                cls=cls,
                prompt=prompt,
                prompt_ids=prompt_ids,
                prompt_len=len(prompt_ids) if prompt_ids is not None else plen,
                max_tokens=max(1, olen),
                tpot_ms=entry.tpot_ms if entry is not None else None,
                ttft_ms=entry.ttft_ms if entry is not None else None,
                meta=meta,
            )
        )
    return items
