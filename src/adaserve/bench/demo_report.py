"""What ``adaserve demo`` prints: the workload and its targets, one side-by-side table of
every policy per SLO class, what the table means, and a sample of generated text.

Pure formatting of the demo's ``result.json`` (``config`` and ``results`` as
``adaserve bench serve`` writes them, plus the demo's ``samples``); no servers here.
"""

from __future__ import annotations

import os
import textwrap

from adaserve.bench.tables import _class_order, _f, _text_table

MEANING = (
    "What it means: each 'met' cell is the share of that class's requests whose first token "
    "came within the TTFT target and whose mean time per output token stayed within the TPOT "
    "target; every policy got the same requests at the same times; higher is better. shed: "
    "refused at admission (429), counted as missed. Goodput counts the tokens of requests "
    "that met both."
)

SOURCES = {
    "interactive": "HumanEval coding prompts",
    "chat": "stdlib code, short",
    "batch": "stdlib code, long",
}


def _ms(v) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:g} s" if v >= 1000 else f"{v:.1f} ms"


def _met(m: dict) -> str:
    n, ok = int(m.get("requests") or 0), int(m.get("attained") or 0)
    if n == 0:
        return "-"
    shed = int(m.get("shed") or 0)
    return f"{100.0 * ok / n:.0f}% ({ok}/{n}" + (f", {shed} shed)" if shed else ")")


def _tpot(m: dict) -> str:
    t = m.get("tpot_ms") or {}
    return f"{_f(t.get('p50'), '{:.0f}')} / {_f(t.get('p99'), '{:.0f}')}"


def targets_lines(config: dict) -> list[str]:
    """The class targets in ms and where they come from."""
    tpot = config.get("unloaded_tpot_ms")
    src = config.get("unloaded_tpot_source") or "the server's hardware profile"
    out = textwrap.wrap(
        f"Targets: multiples of the unloaded TPOT {tpot:.1f} ms (one request decoding alone "
        f"on this machine; {src}), so that every run here judges by the same ones:",
        96,
    )
    mult = config.get("tpot_multiples") or {}
    targets = config.get("slo_targets") or {}
    for c in _class_order([{"-": {"per_class": targets}}]):
        t = targets[c]
        x = f" ({mult[c]:g} x)" if c in mult else ""
        src = SOURCES.get(c, "")
        out.append(
            f"  {c:<12} TPOT <= {_ms(t.get('tpot_ms'))}{x}, TTFT <= {_ms(t.get('ttft_ms'))}"
            + (f"   prompts: {src}" if src else "")
        )
    return out


def side_by_side(result: dict) -> str:
    """One row per class (and all): per policy the requests that met both targets, then
    per policy TPOT p50 / p99; a goodput row."""
    results = result.get("results", {})
    pols = list(results)
    classes = _class_order([results])
    rows = []
    for c in [*classes, "overall"]:
        ms = [
            results[p]["overall"] if c == "overall" else results[p]["per_class"].get(c)
            for p in pols
        ]
        if any(m is None for m in ms):
            continue
        rows.append(
            [c if c != "overall" else "all"] + [_met(m) for m in ms] + [_tpot(m) for m in ms]
        )
    rows.append(
        ["goodput tok/s"]
        + [_f(results[p]["overall"].get("goodput_tok_s"), "{:.0f}") for p in pols]
        + ["" for _ in pols]
    )
    table = _text_table(["class", *pols, *pols], rows)
    # a line over the header naming the two column groups
    widths = [len(x) for x in table.splitlines()[1].split("  ")]
    k = len(pols)
    g1 = 2 * (k - 1) + sum(widths[1 : 1 + k])
    g2 = 2 * (k - 1) + sum(widths[1 + k :])
    groups = (
        " " * widths[0]
        + "  "
        + "met both targets".center(g1, "-")
        + "  "
        + "TPOT p50 / p99 ms".center(g2, "-")
    )
    return groups.rstrip() + "\n" + table


def sample_lines(samples: dict, width: int = 88) -> list[str]:
    """The greedy completion of one prompt from each server, and whether they agree."""
    if not samples:
        return []
    first = next(iter(samples.values()))
    out = [
        f"Sample: {first['task']} greedy, {len(first['tokens'])} tokens, sent alone to each server "
        "after its run. The prompt ends:"
    ]
    tail = first["prompt"].rstrip("\n").splitlines()[-3:]
    out += ["    " + ln[:width] for ln in tail]
    out.append(f"{next(iter(samples))} continues:")
    out += ["    " + ln[:width] for ln in first["text"].splitlines()[:12] or [""]]
    for pol, s in list(samples.items())[1:]:
        if s["tokens"] == first["tokens"] and s["text"] == first["text"]:
            out.append(
                f"{pol}: the same text, token for token (speculation does not change the output)."
            )
        else:
            out.append(f"{pol} DIFFERS:")
            out += ["    " + ln[:width] for ln in s["text"].splitlines()[:12]]
    return out


def load_line() -> str | None:
    """A warning when other work shares the cores (the figures then move from run to run)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    n = os.cpu_count() or 1
    if load <= 1.25 * n:
        return None
    return (
        f"Note: load average {load:.1f} on {n} cores: other work shares this machine, so the "
        "figures are slower and noisier than on an idle one."
    )


def format_demo(result: dict, load_note: str | None = None) -> str:
    """The whole report ``adaserve demo`` prints."""
    cfg = result.get("config") or {}
    pols = list(result.get("results", {}))
    n = next(iter(result["results"].values()))["overall"]["requests"] if pols else 0
    head = (
        f"adaserve demo: the shipped model pair on this machine, served by {' and '.join(pols)} "
        f"in turn over HTTP; the same {n} requests ({cfg.get('request_rate', 0):.2f} req/s for "
        f"{cfg.get('duration_s', 0):g} s, interactive/chat/batch 60/20/20) to each."
    )
    parts = [textwrap.fill(head, 96), "", *targets_lines(cfg), "", side_by_side(result), ""]
    parts.append(textwrap.fill(MEANING, 96))
    if load_note:
        parts.append(textwrap.fill(load_note, 96))
    s = sample_lines(result.get("samples") or {})
    if s:
        parts += ["", *s]
    return "\n".join(parts)
